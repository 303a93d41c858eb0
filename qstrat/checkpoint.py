"""Safetensors sink: write a refit as an HF checkpoint directory vLLM can load.

The directory gets ``model.safetensors`` (or shards plus ``model.safetensors.index.json``) with
the tensors in wire order, and ``config.json`` with the plan's ``quantization_config``. The plan
is validated before anything is written. Outputs are assigned to shards from the plan (every
output's size is known before quantizing), and each shard file is written as soon as its last
tensor is quantized and then dropped: host memory holds about one shard plus the driver's live
parts (about one decoder layer), not the whole output. Files are written to a temporary
directory that is renamed into place at the end: an error never leaves a half-written
checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from qstrat.driver import RefitDriver
from qstrat.inputs import NamedTensors, as_tensor_dict
from qstrat.errors import QstratError
from qstrat.plan import OutputTensor, RefitPlan

INDEX = "model.safetensors.index.json"

# Files of a source model directory that the output regenerates (or that hold weights) and are
# therefore not copied by ``write_checkpoint(..., source_dir=...)``.
_NOT_COPIED_NAMES = {"config.json", "qstrat_plan.json"}
_NOT_COPIED_SUFFIXES = (".safetensors", ".index.json", ".bin", ".pt", ".pth", ".ckpt", ".h5",
                        ".msgpack", ".gguf")


def write_checkpoint(driver: RefitDriver, named_tensors: NamedTensors, out_dir: str | Path,
                     hf_config: Mapping[str, Any] | None = None, shard_bytes: int = 4 << 30,
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
        hf_config: config.json content to write (default: the driver's ``hf_config``); its
            ``quantization_config`` is replaced by the plan's (removed for a BF16 plan).
        shard_bytes: maximum bytes per safetensors shard (a single larger tensor gets a shard
            of its own). One shard is written as ``model.safetensors``, several as
            ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``.
        overwrite: replace an existing ``out_dir`` (a directory; an existing file is refused).
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
    Raises: PlanError (nothing written); FileExistsError (``out_dir`` exists and not
        ``overwrite``, or is not a directory); QstratError (``out_dir`` overlaps
        ``source_dir``); NonFiniteError (nothing written).
    """
    out = Path(out_dir)
    if source_dir is not None:
        _check_not_source(out, Path(source_dir))
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{out} exists; use --overwrite (overwrite=True) to replace it")
        if out.is_symlink() or not out.is_dir():
            raise FileExistsError(f"{out} exists and is not a directory; not replacing it "
                                  "(overwrite replaces a checkpoint directory only)")
    if plan is None:
        tensors: Any = as_tensor_dict(named_tensors)
        plan = driver.plan(tensors)
    else:
        driver.check_plan(plan)
        tensors = named_tensors
    shards = assign_shards(plan.outputs(), shard_bytes)
    total = sum(o.nbytes for o in plan.outputs())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".qstrat-", dir=out.parent))
    try:
        umask = _umask()
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700: an engine under another uid could not read it
        if progress is not None:
            progress(0, total)
        _stream_shards(tmp, shards, driver.execute(plan, tensors), total, progress, 0o666 & ~umask)
        if source_dir is not None:
            _copy_other_files(Path(source_dir), tmp)
        cfg = dict(hf_config if hf_config is not None else driver.hf_config)
        cfg.pop("quantization_config", None)
        if plan.quantization_config is not None:
            cfg["quantization_config"] = plan.vllm_quantization_config()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "qstrat_plan.json").write_text(plan.to_json(indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return plan


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

    Raises: FileNotFoundError if the directory has no ``*.safetensors`` file; QstratError naming
        the file for an unreadable safetensors header (truncated or not safetensors) and naming
        the tensor for a dtype qstrat does not read (e.g. ``U16``).
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    result = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                headers = [(name, handle.get_slice(name)) for name in handle.keys()]
                shapes = [(name, tuple(sl.get_shape()), sl.get_dtype()) for name, sl in headers]
        except SafetensorError as exc:
            raise QstratError(f"{f}: not a readable safetensors file: {exc}") from exc
        for name, shape, dtype in shapes:
            if dtype not in _SAFETENSORS_DTYPES:
                raise QstratError(f"{f}: tensor {name!r} has dtype {dtype}, which qstrat does not read "
                                  f"(supported: {', '.join(_SAFETENSORS_DTYPES)})")
            result[name] = LazyTensor(f, name, shape, _SAFETENSORS_DTYPES[dtype])
    return result


def load_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint directory (CPU). Used to verify written output."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,
}
