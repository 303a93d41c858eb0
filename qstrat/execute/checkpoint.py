"""Safetensors sink: write a refit as an HF checkpoint directory vLLM can load.

The directory gets ``model.safetensors`` (or shards plus ``model.safetensors.index.json``) with
the tensors in wire order, and ``config.json`` with the plan's ``quantization_config``. The plan
is validated before anything is written (:meth:`RefitDriver.prepare`, with this sink's check of
the config.json it writes). Outputs are assigned to shards from the plan (every
output's size is known before quantizing), and each shard file is written as soon as its last
tensor is quantized and then dropped: host memory holds about one shard plus the driver's live
parts (about one decoder layer), not the whole output. Files are written to a temporary
directory that is renamed into place at the end: an error never leaves a half-written
checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from qstrat.vllm.checks.engine_ignore import with_engine_ignore_list
from qstrat.vllm.checks.engine_manifest import model_tensors_check
from qstrat.execute.driver import RefitDriver
from qstrat.execute.named_tensors import NamedTensors
from qstrat.errors import QstratError
from qstrat.layouts.model_config import ModelConfig
from qstrat.plan import OutputTensor, RefitPlan
from qstrat.execute.prepare import SinkCheck

INDEX = "model.safetensors.index.json"

# Files of a source model directory that the output regenerates (or that hold weights) and are
# therefore not copied by ``write_checkpoint(..., source_dir=...)``.
_NOT_COPIED_NAMES = {"config.json", "qstrat_plan.json"}  # PLAN_FILE
_NOT_COPIED_SUFFIXES = (".safetensors", ".index.json", ".bin", ".pt", ".pth", ".ckpt", ".h5",
                        ".msgpack", ".gguf")


def write_checkpoint(driver: RefitDriver, named_tensors: NamedTensors, out_dir: str | Path,
                     hf_config: Any = None, shard_bytes: int = 4 << 30,
                     overwrite: bool = False, progress: Callable[[int, int], Any] | None = None,
                     source_dir: str | Path | None = None, plan: RefitPlan | None = None) -> RefitPlan:
    """Quantize ``named_tensors`` with ``driver`` and write an HF checkpoint to ``out_dir``.

    Args:
        driver: the refit driver (its config decides formats).
        named_tensors: (HF name, tensor) pairs, any device.
        out_dir: target directory; must not exist unless ``overwrite``. Created with mode
            0777 minus the umask (0755 with the usual umask 022), like ``mkdir``, and its
            safetensors files 0666 minus the umask (0644), so that an engine running under
            another uid can read them.
        hf_config: config.json content to write (a mapping, transformers config or ModelConfig,
            parsed here; default: the driver's, else ``source_dir``'s config.json; with none, a
            UserWarning: the output then holds only the quantization config); its ``quantization_config`` is the plan's (none
            for BF16), a null ``architectures`` filled in (:func:`output_hf_config`).
        shard_bytes: maximum bytes per safetensors shard (a single larger tensor gets a shard
            of its own). One shard is written as ``model.safetensors``, several as
            ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``.
        overwrite: replace an existing ``out_dir`` if it is empty or a checkpoint qstrat wrote
            holding only the files qstrat wrote there (never a directory with anything else).
        progress: optional callable ``progress(bytes_written, bytes_total)``, called once with
            0 before quantizing starts and then after each shard FILE is written (so it reaches
            ``bytes_total`` only when every tensor is on disk). Bytes are tensor bytes.
        source_dir: the model directory the tensors were read from, if any. ``out_dir`` may
            not be it, lie inside it, or contain it; its other top-level files (tokenizer,
            generation config, chat template, ...) are copied into the output: all but
            ``config.json``, ``qstrat_plan.json``, weight files (``*.safetensors``, ``*.bin``,
            ``*.pt``, ...) and their ``*.index.json``, which the output regenerates or replaces.
        plan: a plan made beforehand from metadata (``driver.plan(tensor_specs(...))``);
            ``named_tensors`` may then be an iterator, consumed once (``RefitDriver.run``).
            A stream that does not match the plan raises PlanError mid-way: nothing is left
            written (the temporary directory is removed).
    Returns: the plan that was written.
    Raises (nothing is written, and an existing ``out_dir`` is left as it was, in every case):
        QstratError for a ``shard_bytes`` that is not a positive int; FileNotFoundError for a
        ``source_dir`` that is not a directory; PlanError; NonFiniteError;
        BackendUnavailableError (a rule's ``backend`` cannot run on the tensors' device);
        FileExistsError (``out_dir`` exists and not ``overwrite``; is not a directory; is not a
        checkpoint qstrat wrote - see :func:`check_replaceable`; is the current directory or
        holds it); QstratError (``out_dir`` cannot be created - a file on its path, a directory
        that takes no new entries such as ``/proc``; parent directories a failed write created are
        removed again -; ``out_dir`` overlaps ``source_dir``; the config has no
        ``architectures`` and none can be inferred; it is not JSON-serializable; writing failed,
        e.g. the disk is full: the message names the file and the cause).
    """
    out = Path(out_dir)
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise QstratError(f"shard_bytes must be a positive number of bytes, got {shard_bytes!r}")
    if source_dir is not None:
        if not Path(source_dir).is_dir():
            raise FileNotFoundError(f"source_dir {source_dir} is not a directory (the model directory the "
                                    "tensors were read from, whose tokenizer and other files are copied)")
        _check_not_source(out, Path(source_dir))
    check_output_location(out)
    if out.exists() or out.is_symlink():
        _check_not_cwd(out)
        if not overwrite:
            raise OutputExistsError(f"{out} exists; pass {{option}} to replace it")
        check_replaceable(out)
    config = _model_config(driver, hf_config, source_dir, out)
    config.check(getattr(driver.layout, "num_layers_key", "num_hidden_layers"))  # before anything is written
    # Values are checked while quantizing (an error removes the temporary directory), which
    # spares lazily loaded tensors a second read; a stream (plan given) has its devices checked
    # as its tensors arrive.
    check = SinkCheck("config.json", lambda p: output_hf_config(config, p.plan, driver.layout))
    prepared = driver.prepare(named_tensors, plan, (check, model_tensors_check(driver, config)), values="inline", stream=True)
    plan = prepared.plan
    cfg_text = json.dumps(prepared.results[check.name], indent=2) + "\n"
    shards = assign_shards(plan.outputs(), shard_bytes)
    total = sum(o.nbytes for o in plan.outputs())
    parent = out.resolve().parent
    created = _make_parent(out, parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".qstrat-", dir=parent))
    except OSError as exc:
        _remove_created(created)
        raise QstratError(f"cannot create {out}: {parent} does not take new entries ({exc.strerror or exc}); "
                          "nothing was written") from exc
    try:
        umask = _umask()
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700: an engine under another uid could not read it
        if progress is not None:
            progress(0, total)
        with _write_errors(out):
            _stream_shards(tmp, shards, prepared.execute(), total, progress, 0o666 & ~umask)
            if source_dir is not None:
                _copy_other_files(Path(source_dir), tmp)
            (tmp / "config.json").write_text(cfg_text)
            doc = json.loads(plan.to_json())
            doc[FILES_KEY] = sorted([p.name for p in tmp.iterdir()] + [PLAN_FILE])
            (tmp / PLAN_FILE).write_text(json.dumps(doc, indent=1))
            _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        raise
    return plan


def _model_config(driver: RefitDriver, hf_config: Any, source_dir: str | Path | None, out: Path) -> ModelConfig:
    """The model config a checkpoint's config.json is made from: ``hf_config``, else the driver's,
    else ``source_dir``'s config.json (the model directory the tensors came from). Without any
    model config (no ``model_type``) it warns: the config.json then holds only the
    quantization config, which neither vLLM nor transformers loads as it is."""
    config = ModelConfig.of(hf_config) if hf_config is not None else driver.model_config
    source = Path(source_dir) / "config.json" if source_dir is not None else None
    if hf_config is None and not config.top_model_type and source is not None and source.is_file():
        config = ModelConfig.of(json.loads(source.read_text()))
    if not config.top_model_type:
        warnings.warn(f"write_checkpoint: no model config (hf_config, the driver's hf_config or source_dir's "
                      f"config.json): {out}/config.json will hold only the quantization_config, and vLLM or "
                      "transformers cannot load the checkpoint as it is; pass hf_config=model.config (or the "
                      "model's config.json as a dict)", UserWarning, stacklevel=3)
    return config


def check_output_location(out: Path) -> None:
    """Refuse an output path that cannot be created, before anything is planned or written: its
    nearest existing ancestor must be a directory (``-o a_file/sub``) this process may write in.

    Raises: QstratError naming ``out`` and the ancestor.
    """
    anc = out.absolute().parent
    while not (anc.exists() or anc.is_symlink()) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise QstratError(f"cannot create {out}: {anc} is a file, not a directory; nothing was written")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise QstratError(f"cannot create {out}: no permission to create entries in {anc}; nothing was written")


def _make_parent(out: Path, parent: Path) -> list[Path]:
    """Create ``out``'s missing parent directories; return those created (outermost first), which
    a failed write removes again (what the user did not have is not left behind).

    Raises: QstratError naming ``out`` and the directory that could not be created.
    """
    missing: list[Path] = []
    d = parent
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    created: list[Path] = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs, never removed
        except OSError as exc:
            _remove_created(created)
            raise QstratError(f"cannot create {out}: creating {d} failed ({exc.strerror or exc}); nothing was "
                              "written") from exc
        created.append(d)
    return created


def _remove_created(created: list[Path]) -> None:
    """Remove the directories :func:`_make_parent` created, innermost first, each only if still
    empty (anything another process put there stays)."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


class OutputExistsError(FileExistsError):
    """The output directory exists and is not replaced. Its message names the option that
    replaces one as the API spells it (``overwrite=True``); :meth:`for_option` words it for
    another caller (the command line: ``--overwrite``)."""

    def __init__(self, template: str) -> None:
        self.template = template  # "{option}" where the option's name goes
        super().__init__(self.for_option("overwrite=True"))

    def for_option(self, option: str) -> str:
        """The message with ``option`` (e.g. ``"--overwrite"``) as the option's name."""
        return self.template.replace("{option}", option)


#: The plan file every qstrat checkpoint holds; its ``checkpoint_files`` key lists every file
#: qstrat wrote into the directory (what ``overwrite`` may delete).
PLAN_FILE = "qstrat_plan.json"
FILES_KEY = "checkpoint_files"


def check_replaceable(out: Path) -> None:
    """Refuse to replace ``out`` unless deleting it loses nothing a user made.

    Replaceable: an empty directory, or a checkpoint qstrat wrote: a directory whose
    ``qstrat_plan.json`` lists (``checkpoint_files``) every entry it holds. Never replaced: a
    file or symlink, a directory with anything else in it (user files, subdirectories), the
    current working directory or a directory holding it (``-o .``: replacing it would leave the
    shell in a deleted directory).

    Raises: FileExistsError saying why and what to do.
    """
    if out.is_symlink() or not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory; not replacing it "
                                "({option} replaces a checkpoint directory only)")
    _check_not_cwd(out)
    entries = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in out.iterdir())
    if not entries:
        return
    listed = _listed_files(out / PLAN_FILE)
    if listed is None:
        raise OutputExistsError(f"{out} is not a checkpoint qstrat wrote (no {PLAN_FILE} listing its files); "
                                "{option} never deletes other directories: choose a new output directory "
                                "or empty this one yourself")
    extra = [e for e in entries if e not in listed]
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise OutputExistsError(f"{out} is a qstrat checkpoint but also holds {shown}, which qstrat did not "
                                "write; {option} never deletes them: move them out or choose a new output "
                                "directory")


def _check_not_cwd(out: Path) -> None:
    """An existing ``out`` that is (or holds) the working directory is never replaced."""
    cwd = Path.cwd().resolve()
    if out.is_dir() and cwd.is_relative_to(out.resolve()):
        what = "is the current directory" if cwd == out.resolve() else "holds the current directory"
        raise FileExistsError(f"{out} {what}; a checkpoint is written as a new directory (or replaces one "
                              "as a whole), never into the directory you are in: pass a new directory, "
                              "e.g. -o ./fp8")


def _listed_files(plan_file: Path) -> set[str] | None:
    """The ``checkpoint_files`` of a qstrat_plan.json, or None (absent, unreadable, not ours)."""
    try:
        doc = json.loads(plan_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    files = doc.get(FILES_KEY) if isinstance(doc, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an existing ``out`` (already checked replaceable) is
    renamed aside first and deleted only once ``tmp`` is in place (restored if that fails)."""
    if not out.exists():
        tmp.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=".qstrat-old-", dir=tmp.parent))
    old.rmdir()
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _write_errors(out: Path) -> Iterator[None]:
    """Turn a failed write (disk full, quota, I/O error; safetensors reports them as
    SafetensorError) into a QstratError naming ``out`` and the cause."""
    try:
        yield
    except SafetensorError as exc:
        raise QstratError(f"writing {out} failed: {exc}; nothing was written") from exc
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise QstratError(f"writing {out} failed{where}: {exc.strerror or exc}; nothing was written") from exc


def output_hf_config(model_config: Any, plan: RefitPlan, layout: Any) -> dict[str, Any]:
    """The config.json a checkpoint of ``plan`` gets: ``model_config`` (a
    :class:`~qstrat.layouts.model_config.ModelConfig`, or config.json content parsed here) with the plan's
    ``quantization_config``, its ignore list in vLLM's terms (:func:`checkpoint_quantization_config`;
    removed for a BF16 plan; a ``text_config.quantization_config`` or
    ``compression_config``, which vLLM would read too, removed) and ``architectures`` filled in when it is
    missing or null in a model config (one with ``model_type``), as ``model.config.to_dict()``
    gives it (vLLM picks the model class from it). A mapping without ``model_type`` (no model
    config at all) is written as given.

    ``architectures`` is the layout's :meth:`~qstrat.layouts.model_layout.ModelLayout.output_architecture`:
    transformers' auto-model table for the config's ``model_type``, else the layout's single
    architecture. Then the layout's :meth:`~qstrat.layouts.model_layout.ModelLayout.output_config` (DeepSeek-V3:
    the routing keys transformers fixes and vLLM reads, ``scoring_func: sigmoid``,
    ``topk_method: noaux_tc``, filled in when absent).

    Raises: QstratError when no architecture can be inferred, or the config is not
        JSON-serializable (naming the key).
    """
    # every place vLLM looks for a quantization config (text_config's: multimodal models;
    # compression_config: compressed-tensors) holds the plan's or nothing
    config = ModelConfig.of(model_config).with_quantization(
        checkpoint_quantization_config(plan, layout) if plan.quantization_config is not None else None)
    if not config.architectures and config.top_model_type:
        arch = layout.output_architecture(config)
        if arch is None:
            raise QstratError(
                f"the model config has no 'architectures' (model_type {config.top_model_type!r}; "
                "model.config.to_dict() leaves it null) and qstrat cannot infer it; vLLM picks the model "
                "class from it: set hf_config['architectures'], e.g. [type(model).__name__]")
        config = config.with_architectures([arch])
    cfg = layout.output_config(config).to_dict()
    for key, value in cfg.items():
        try:
            json.dumps(value, allow_nan=False)  # NaN/inf is not JSON: vLLM and HF refuse the file
        except (TypeError, ValueError) as exc:
            raise QstratError(f"the model config's {key!r} cannot be written to config.json: {exc}") from exc
    return cfg


def checkpoint_quantization_config(plan: RefitPlan, layout: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` a checkpoint of ``plan`` carries: the plan's, its ignore list
    written in the terms vLLM matches (:func:`qstrat.vllm.checks.engine_ignore.with_engine_ignore_list`: a fused
    module kept whole under its fused name AND its shards, from ``layout.fused``). None for a BF16 plan."""
    return with_engine_ignore_list(plan.vllm_quantization_config(), layout.fused)


def assign_shards(outputs: list[OutputTensor], shard_bytes: int) -> list[list[OutputTensor]]:
    """Split ``outputs`` (wire order) into consecutive shards of at most ``shard_bytes`` each
    (a tensor larger than ``shard_bytes`` gets a shard of its own). Always at least one shard."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for o in outputs:
        if size and size + o.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(o)
        size += o.nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    """``["model.safetensors"]`` for one shard, else ``model-0000i-of-0000N.safetensors``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _stream_shards(directory: Path, shards: list[list[OutputTensor]], emitted: Any, total: int,
                   progress: Callable[[int, int], Any] | None, file_mode: int) -> None:
    """Write each shard as soon as its tensors have been emitted; keep only one shard in memory."""
    names = shard_file_names(len(shards))
    weight_map: dict[str, str] = {}
    written = 0
    it = iter(emitted)
    for fname, shard in zip(names, shards):
        current: dict[str, torch.Tensor] = {}
        storages: set[tuple[str, int]] = set()
        for want in shard:
            name, t = next(it, (None, None))
            if name != want.name:
                raise QstratError(f"the driver emitted {name!r} where the plan's wire order has "
                                  f"{want.name!r}")
            current[name] = _owned_cpu(t, storages)
            weight_map[name] = fname
        save_file(current, str(directory / fname), metadata={"format": "pt"})
        os.chmod(directory / fname, file_mode)  # safetensors creates its files 0600
        written += sum(t.numel() * t.element_size() for t in current.values())
        del current
        if progress is not None:
            progress(written, total)
    extra = next(it, None)
    if extra is not None:
        raise QstratError(f"the driver emitted {extra[0]!r}, which is not in the plan")
    if len(shards) > 1:
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _owned_cpu(t: torch.Tensor, storages: set[tuple[str, int]]) -> torch.Tensor:
    """``t`` on the CPU, contiguous, in memory that no other tensor of the shard uses.

    safetensors refuses tensors that share memory, and a view keeps its whole base alive (a
    per-expert view keeps the layer's quantized slab): a view smaller than its storage, or a
    second tensor on a storage already in the shard, is cloned.
    """
    t = t.detach().to("cpu").contiguous()
    storage = t.untyped_storage()
    key = (str(t.device), storage.data_ptr())
    if storage.nbytes() != t.numel() * t.element_size() or (storage.nbytes() and key in storages):
        t = t.clone()
        key = (str(t.device), t.untyped_storage().data_ptr())
    if t.untyped_storage().nbytes():
        storages.add(key)
    return t


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _check_not_source(out: Path, source: Path) -> None:
    o, s = out.resolve(), source.resolve()
    if o == s or o.is_relative_to(s):
        raise QstratError(f"output directory {out} is {'the' if o == s else 'inside the'} source model "
                          f"directory {source}; write the quantized checkpoint somewhere else")
    if s.is_relative_to(o):
        raise QstratError(f"output directory {out} contains the source model directory {source}; "
                          "write the quantized checkpoint somewhere else")


def _copy_other_files(source: Path, directory: Path) -> None:
    """Copy the source model's top-level files the output does not regenerate (tokenizer, ...)."""
    for f in sorted(source.iterdir()):
        if f.name in _NOT_COPIED_NAMES or f.name.endswith(_NOT_COPIED_SUFFIXES) or not f.is_file():
            continue
        shutil.copy2(f, directory / f.name)


class LazyTensor:
    """A checkpoint tensor known by ``shape`` and ``dtype``; :meth:`load` reads its data.

    The driver plans from shape and dtype alone and calls :meth:`load` only when it quantizes.
    """

    def __init__(self, path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.path, self.name, self.shape, self.dtype = path, name, torch.Size(shape), dtype

    def load(self) -> torch.Tensor:
        """Read the tensor from its safetensors file (CPU)."""
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as handle:
            return handle.get_tensor(self.name)


def lazy_checkpoint(model_dir: str | Path) -> dict[str, LazyTensor]:
    """Every tensor of a safetensors checkpoint directory as a :class:`LazyTensor` (headers only).

    Which file holds which tensor: with ``model.safetensors.index.json``, its ``weight_map``
    decides (as transformers and vLLM load sharded checkpoints): only the files it names are
    read, each tensor from the file it names, and ``*.safetensors`` files it does not name (a
    stale ``model.safetensors`` next to shards) are ignored. Without an index every
    ``*.safetensors`` file is read and a tensor name in two files is an error.

    Raises: FileNotFoundError if the directory has no ``*.safetensors`` file (or the index names
        a file that does not exist); QstratError naming the file for an unreadable safetensors
        header (truncated or not safetensors) or index, naming the tensor for a dtype qstrat does
        not read (e.g. ``U16``), for a name in two files (no index), for a tensor the index maps
        to a file that lacks it, and for a tensor of an indexed file the index does not list.
    """
    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    weight_map = _read_index(directory / INDEX)
    if weight_map is not None:
        if not weight_map:
            raise QstratError(f"{directory / INDEX}: its weight_map lists no tensors, but {model_dir} holds "
                              f"{', '.join(f.name for f in files)}: remove the stale index or complete it")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory / INDEX} maps tensors to {', '.join(missing)}, which "
                                    f"{'does' if len(missing) == 1 else 'do'} not exist in {model_dir}")
        files = [directory / n for n in names]
    result: dict[str, LazyTensor] = {}
    errors: list[str] = []
    for f in files:
        for name, shape, dtype in _headers(f):
            if weight_map is not None:
                if name not in weight_map:
                    errors.append(f"{f.name} holds {name!r}, which {INDEX} does not list (an incomplete "
                                  "index: add it, or remove the tensor)")
                    continue
                if weight_map[name] != f.name:
                    continue  # the index says another file holds it: that copy is the one read
            elif name in result:
                errors.append(f"tensor {name!r} is in both {result[name].path.name} and {f.name} (no {INDEX} "
                              "says which one holds it)")
                continue
            if dtype not in _SAFETENSORS_DTYPES:
                errors.append(f"{f}: tensor {name!r} has dtype {dtype}, which qstrat does not read "
                              f"(supported: {', '.join(_SAFETENSORS_DTYPES)})")
                continue
            result[name] = LazyTensor(f, name, shape, _SAFETENSORS_DTYPES[dtype])
    if weight_map is not None:
        errors += [f"{INDEX} maps {name!r} to {fname}, which does not hold it"
                   for name, fname in weight_map.items() if name not in result
                   and not any(name in e for e in errors)]
    if errors:
        raise QstratError(f"{model_dir}: " + (errors[0] if len(errors) == 1 else
                                              "invalid checkpoint:\n  " + "\n  ".join(errors)))
    return result


def _headers(f: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, safetensors dtype name) of every tensor in ``f``, from its header.

    Raises: QstratError naming ``f``: not a regular file (a directory named ``*.safetensors``, a
    FIFO, a device: refused before reading), unreadable (the OS's reason, e.g. "Permission
    denied", which safetensors' own open reports as a missing file), or not safetensors."""
    import os
    import stat

    from safetensors import safe_open

    try:
        mode = os.stat(f).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"
            raise QstratError(f"{f}: is {kind}, not a safetensors file; nothing was read")
        with open(f, "rb"):  # the OS's own reason for a file that cannot be read
            pass
    except OSError as exc:
        raise QstratError(f"{f}: cannot read: {exc.strerror or exc}") from exc
    try:
        with safe_open(str(f), framework="pt") as handle:
            return [(name, tuple(sl.get_shape()), sl.get_dtype())
                    for name, sl in ((n, handle.get_slice(n)) for n in handle.keys())]
    except SafetensorError as exc:
        raise QstratError(f"{f}: not a readable safetensors file: {exc}") from exc


def _read_index(path: Path) -> dict[str, str] | None:
    """The ``weight_map`` of a safetensors index file, or None when there is no index."""
    if not path.exists():
        return None
    from qstrat.config.files import read_text_file

    text = read_text_file(path, "safetensors index")  # a FIFO or /dev/zero: refused before reading
    try:
        doc = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QstratError(f"{path}: not a readable index: {exc}") from exc
    except RecursionError:
        from qstrat.config.files import NESTED_TOO_DEEPLY

        raise QstratError(f"{path}: not a readable index: {NESTED_TOO_DEEPLY}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "/" not in v for k, v in weight_map.items()):
        raise QstratError(f"{path}: expected {{\"weight_map\": {{tensor name: file name}}}} with file names "
                          "in the same directory")
    return weight_map


def load_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint directory (CPU), the files chosen as
    :func:`lazy_checkpoint` chooses them. Used to verify written output."""
    return {name: t.load() for name, t in lazy_checkpoint(model_dir).items()}


_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,
}
