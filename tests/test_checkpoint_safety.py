"""The checkpoint sink and `qstrat quantize` never lose a user's files or leave partial output:
what --overwrite may replace, `-o .`, which safetensors file holds a tensor, disk full, a
malformed config.json, an unavailable backend, a config from ``model.config.to_dict()``."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

import qstrat.execute.checkpoint as ckpt
from qstrat import QstratError, RefitDriver
from qstrat.cli.commands import main
from qstrat.execute.checkpoint import lazy_checkpoint, load_checkpoint, write_checkpoint
from qstrat.errors import BackendUnavailableError
from qstrat.layouts.model_config import ModelConfig

NORM = {"model.norm.weight": torch.ones(8)}
CFG = {"model_type": "x", "architectures": ["XForCausalLM"]}


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes), directories as ``name/``."""
    return {str(p.relative_to(root)) + ("/" if p.is_dir() else ""): (b"" if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def src(tiny_bf16_dir):
    return tiny_bf16_dir


def cli(*args):
    """The real ``qstrat`` command in a child process."""
    return subprocess.run([sys.executable, "-m", "qstrat.cli.commands", *map(str, args)], capture_output=True,
                          text=True, timeout=300,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


def in_process(capsys, *args):
    """``qstrat ARGS`` in this process (so monkeypatches apply): (exit status, stderr)."""
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


# ---- --overwrite and -o ------------------------------------------------------------------------

def test_overwrite_never_deletes_a_directory_qstrat_did_not_write(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = tree(out)
    with pytest.raises(FileExistsError) as info:
        write_checkpoint(RefitDriver("bf16"), NORM, out, overwrite=True)
    assert str(info.value) == (f"{out} is not a checkpoint qstrat wrote (no qstrat_plan.json listing its files); "
                               "overwrite=True never deletes other directories: choose a new output directory or "
                               "empty this one yourself")
    assert tree(out) == before
    (out / "qstrat_plan.json").write_text('{"entries": []}')  # looks like a plan, lists no files
    with pytest.raises(FileExistsError, match="is not a checkpoint qstrat wrote"):
        write_checkpoint(RefitDriver("bf16"), NORM, out, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left behind


def test_overwrite_replaces_a_qstrat_checkpoint_but_not_files_added_to_it(tmp_path):
    out = tmp_path / "out"
    write_checkpoint(RefitDriver("bf16"), NORM, out, hf_config=CFG)
    listed = json.loads((out / "qstrat_plan.json").read_text())["checkpoint_files"]
    assert listed == ["config.json", "model.safetensors", "qstrat_plan.json"]
    write_checkpoint(RefitDriver("bf16"), {"model.norm.weight": torch.full((8,), 2.0)}, out, hf_config=CFG,
                     overwrite=True)
    assert load_checkpoint(out)["model.norm.weight"].tolist() == [2.0] * 8
    (out / "README.md").write_text("my notes")
    (out / "eval").mkdir()
    before = tree(out)
    with pytest.raises(FileExistsError) as info:
        write_checkpoint(RefitDriver("bf16"), NORM, out, hf_config=CFG, overwrite=True)
    assert str(info.value) == (f"{out} is a qstrat checkpoint but also holds README.md, eval/, which qstrat "
                               "did not write; overwrite=True never deletes them: move them out or choose a new "
                               "output directory")
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_of_the_source_models_copied_files_is_allowed(tmp_path, src):
    out = tmp_path / "out"
    driver = RefitDriver("bf16", hf_config=json.loads((src / "config.json").read_text()))
    tensors = lazy_checkpoint(src)
    write_checkpoint(driver, tensors, out, source_dir=src)
    assert "generation_config.json" in json.loads((out / "qstrat_plan.json").read_text())["checkpoint_files"]
    write_checkpoint(driver, tensors, out, source_dir=src, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "qstrat_plan.json"]


@pytest.mark.parametrize("target", [".", ".."])
@pytest.mark.parametrize("overwrite", [False, True])
def test_output_is_never_the_working_directory(tmp_path, src, target, overwrite, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    before = tree(tmp_path)
    monkeypatch.chdir(work)
    rc, err = in_process(capsys, "quantize", src, "--preset", "bf16", "-o", target,
                         *(["--overwrite"] if overwrite else []))
    what = "is the current directory" if target == "." else "holds the current directory"
    assert rc == 2 and err.strip() == (
        f"error: {target} {what}; a checkpoint is written as a new directory (or replaces one as a whole), "
        "never into the directory you are in: pass a new directory, e.g. -o ./fp8")
    assert tree(tmp_path) == before


def test_cli_overwrite_refusal_keeps_user_files(tmp_path, src):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    proc = cli("quantize", src, "--preset", "bf16", "-o", out, "--overwrite")  # the real command
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {out} is not a checkpoint qstrat wrote")
    assert tree(out) == {"thesis.tex": b"precious"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


# ---- which file holds a tensor ------------------------------------------------------------------

def _model(tmp_path, files, index=None):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CFG))
    for name, tensors in files.items():
        save_file(tensors, str(d / name))
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return d


def test_a_tensor_in_two_files_without_index_is_an_error(tmp_path, capsys):
    d = _model(tmp_path, {"a.safetensors": {"model.norm.weight": torch.ones(4)},
                          "b.safetensors": {"model.norm.weight": torch.zeros(4), "lm_head.weight": torch.ones(2, 4)}})
    with pytest.raises(QstratError) as info:
        lazy_checkpoint(d)
    assert str(info.value) == (f"{d}: tensor 'model.norm.weight' is in both a.safetensors and b.safetensors "
                               "(no model.safetensors.index.json says which one holds it)")
    rc, err = in_process(capsys, "quantize", d, "--preset", "bf16", "-o", tmp_path / "out")
    assert rc == 2 and err.startswith(f"error: {d}: tensor 'model.norm.weight' is in both a.safetensors")
    assert not (tmp_path / "out").exists()


def test_the_index_decides_which_file_holds_a_tensor(tmp_path):
    d = _model(tmp_path, {"model-1.safetensors": {"model.norm.weight": torch.zeros(4)},
                          "model-2.safetensors": {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.ones(2, 4)},
                          "model.safetensors": {"stale.weight": torch.ones(3)}},  # not in the index: ignored
               index={"model.norm.weight": "model-2.safetensors", "lm_head.weight": "model-2.safetensors"})
    got = load_checkpoint(d)
    assert sorted(got) == ["lm_head.weight", "model.norm.weight"]
    assert got["model.norm.weight"].tolist() == [1.0] * 4  # the copy the index names
    assert lazy_checkpoint(d)["model.norm.weight"].path.name == "model-2.safetensors"


@pytest.mark.parametrize("index,message", [
    ({"model.norm.weight": "model-1.safetensors", "lm_head.weight": "model-9.safetensors"},
     "FileNotFoundError: {d}/model.safetensors.index.json maps tensors to model-9.safetensors, which does not "
     "exist in {d}"),
    ({"model.norm.weight": "model-1.safetensors"},
     "QstratError: {d}: model-1.safetensors holds 'lm_head.weight', which model.safetensors.index.json does not "
     "list (an incomplete index: add it, or remove the tensor)"),
    ({"model.norm.weight": "model-1.safetensors", "lm_head.weight": "model-1.safetensors",
      "model.embed_tokens.weight": "model-1.safetensors"},
     "QstratError: {d}: model.safetensors.index.json maps 'model.embed_tokens.weight' to model-1.safetensors, "
     "which does not hold it"),
    ({}, "QstratError: {d}/model.safetensors.index.json: its weight_map lists no tensors, but {d} holds "
         "model-1.safetensors: remove the stale index or complete it"),
    ({"model.norm.weight": "../other.safetensors"},
     "QstratError: {d}/model.safetensors.index.json: expected {{\"weight_map\": {{tensor name: file name}}}} "
     "with file names in the same directory"),
])
def test_an_inconsistent_index_is_an_error(tmp_path, index, message):
    d = _model(tmp_path, {"model-1.safetensors": {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.ones(2, 4)}},
               index=index)
    with pytest.raises((QstratError, FileNotFoundError)) as info:
        lazy_checkpoint(d)
    assert f"{type(info.value).__name__}: {info.value}" == message.format(d=d)


# ---- failures leave nothing: disk full, bad config.json, unavailable backend ---------------------

ENOSPC_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


def failing_save(calls, fail_at):
    def save(tensors, path, metadata=None):
        calls.append(os.path.basename(path))
        if len(calls) == fail_at:
            raise SafetensorError(ENOSPC_SAFETENSORS)
        save_file(tensors, path, metadata=metadata)
    return save


def test_disk_full_after_some_shards_leaves_nothing(tmp_path, tiny_model, tiny_hf_config, monkeypatch):
    calls = []
    monkeypatch.setattr(ckpt, "save_file", failing_save(calls, fail_at=3))
    out = tmp_path / "out"
    with pytest.raises(QstratError) as info:
        write_checkpoint(RefitDriver("block-fp8", hf_config=tiny_hf_config), tiny_model.state_dict(), out,
                         shard_bytes=1 << 20)
    assert str(info.value) == f"writing {out} failed: {ENOSPC_SAFETENSORS}; nothing was written"
    assert calls == [f"model-0000{i}-of-00005.safetensors" for i in (1, 2, 3)]  # two shards were on disk
    assert list(tmp_path.iterdir()) == []


def test_disk_full_exits_2_without_a_traceback(tmp_path, src, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(ckpt, "save_file", failing_save(calls, fail_at=1))
    out = tmp_path / "out"
    rc, err = in_process(capsys, "quantize", src, "--preset", "block-fp8", "-o", out)
    assert rc == 2 and calls == ["model.safetensors"]
    assert err.strip() == f"error: writing {out} failed: {ENOSPC_SAFETENSORS}; nothing was written"
    assert list(tmp_path.iterdir()) == []


def test_disk_full_while_writing_config_json_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_checkpoint(RefitDriver("bf16"), NORM, out, hf_config=CFG)
    before = tree(out)
    real = Path.write_text

    def full(self, text, *args, **kwargs):
        if self.name == "config.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, text, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(QstratError) as info:
        write_checkpoint(RefitDriver("bf16"), {"model.norm.weight": torch.zeros(8)}, out, hf_config=CFG, overwrite=True)
    tmp_cfg = info.value.__cause__.filename
    assert str(info.value) == f"writing {out} failed ({tmp_cfg}): No space left on device; nothing was written"
    assert Path(tmp_cfg).parent.parent == tmp_path and not Path(tmp_cfg).parent.exists()
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_real_disk_full_on_a_tiny_tmpfs(tmp_path, src):
    """The same through the CLI on a real 256 KiB tmpfs (needs mount rights: root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root); the monkeypatched tests above cover the logic")
    try:
        proc = cli("quantize", src, "--preset", "block-fp8", "-o", mnt / "out")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith(f"error: writing {mnt / 'out'} failed: ")
        assert "No space left on device (os error 28); nothing was written" in proc.stderr
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("text,message", [
    ('{"model_type": "qwen3_moe",', "invalid JSON: Expecting property name enclosed in double quotes"),
    ("[1, 2]", "expected a JSON object, got list"),
    ("\udcff", "not a JSON text file"),
])
def test_malformed_config_json_exits_2_and_writes_nothing(tmp_path, src, text, message, capsys):
    model = tmp_path / "model"
    shutil.copytree(src, model)
    (model / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    rc, err = in_process(capsys, "quantize", model, "--preset", "block-fp8", "-o", tmp_path / "out")
    assert rc == 2 and err.startswith(f"error: {model / 'config.json'}: {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_an_unavailable_backend_exits_2_before_anything_is_written(tmp_path, src):
    cfg = tmp_path / "refit.yaml"
    cfg.write_text("rules:\n  - select: experts\n    serializer: mxfp8\n    options: {backend: triton}\n")
    proc = cli("quantize", src, "--config", cfg, "-o", tmp_path / "out")  # the real command
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(
        "error: model.layers.0.mlp.experts.0.down_proj.weight (rules[0]): mxfp8: backend='triton' needs CUDA "
        "tensors (or TRITON_INTERPRET=1 on CPU); the tensors are on cpu: use backend 'auto' or 'torch' here")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["refit.yaml"]


def test_an_unavailable_backend_raises_before_quantizing(tmp_path, tiny_model, tiny_hf_config, monkeypatch):
    driver = RefitDriver({"rules": [{"select": "attention", "serializer": "block_fp8",
                                     "options": {"backend": "triton"}}]}, hf_config=tiny_hf_config)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    quantized = []
    monkeypatch.setattr(driver, "execute", lambda *a, **k: quantized.append(1) or iter(()))
    with pytest.raises(BackendUnavailableError) as info:
        write_checkpoint(driver, tiny_model.state_dict(), tmp_path / "out")
    assert str(info.value).startswith("model.layers.0.self_attn.k_proj.weight (rules[0]): block_fp8: "
                                      "backend='triton' needs CUDA tensors")
    assert isinstance(info.value, RuntimeError) and quantized == []
    assert list(tmp_path.iterdir()) == []


# ---- a config from model.config.to_dict() ------------------------------------------------------

def test_a_to_dict_config_gets_its_architectures_and_loads(tmp_path):
    import transformers

    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe

    tiny_model = build_tiny_qwen3_moe(seed=1)  # fresh: save_pretrained sets architectures on a config
    raw = tiny_model.config.to_dict()
    assert raw["architectures"] is None  # what a trainer has at hand
    out = tmp_path / "bf16"
    write_checkpoint(RefitDriver("bf16", hf_config=raw), tiny_model.state_dict(), out)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]
    assert transformers.AutoConfig.from_pretrained(out).architectures == ["Qwen3MoeForCausalLM"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    want = tiny_model.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_vllm_knows_the_inferred_architecture():
    registry = pytest.importorskip("vllm").ModelRegistry
    from qstrat.plugins.builtin.layouts import GENERIC  # names no architecture: transformers' table alone answers

    for model_type, arch in [("qwen3_moe", "Qwen3MoeForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM"),
                             ("mixtral", "MixtralForCausalLM")]:
        assert GENERIC.output_architecture(ModelConfig.of({"model_type": model_type})) == arch
        assert arch in registry.get_supported_archs()


def test_a_config_without_inferable_architectures_is_a_clear_error(tmp_path):
    for cfg in ({"model_type": "my_own_lm", "architectures": None}, {"model_type": "my_own_lm"}):
        with pytest.raises(QstratError) as info:
            write_checkpoint(RefitDriver("bf16"), NORM, tmp_path / "out", hf_config=cfg)
        assert str(info.value) == (
            "the model config has no 'architectures' (model_type 'my_own_lm'; model.config.to_dict() leaves it "
            "null) and qstrat cannot infer it; vLLM picks the model class from it: set "
            "hf_config['architectures'], e.g. [type(model).__name__]")
    with pytest.raises(QstratError) as info:
        write_checkpoint(RefitDriver("bf16"), NORM, tmp_path / "out", hf_config={**CFG, "dtype": torch.bfloat16})
    assert str(info.value) == ("the model config's 'dtype' cannot be written to config.json: Object of type dtype "
                               "is not JSON serializable")
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_are_refused_before_quantizing(tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(QstratError) as info:
            write_checkpoint(RefitDriver("bf16"), NORM, tmp_path / "out", hf_config=CFG, shard_bytes=bad)
        assert str(info.value) == f"shard_bytes must be a positive number of bytes, got {bad!r}"
    with pytest.raises(FileNotFoundError) as info:
        write_checkpoint(RefitDriver("bf16"), NORM, tmp_path / "out", hf_config=CFG, source_dir=tmp_path / "nope")
    assert str(info.value).startswith(f"source_dir {tmp_path / 'nope'} is not a directory")
    assert list(tmp_path.iterdir()) == []


# ---- output locations that cannot be created; parents a failed write created -------------------

def test_an_output_under_a_file_is_refused_before_planning(tmp_path):
    (tmp_path / "afile").write_text("keep me")
    out = tmp_path / "afile" / "sub" / "ckpt"
    with pytest.raises(QstratError) as info:
        write_checkpoint(RefitDriver("bf16"), NORM, out, hf_config=CFG)
    assert str(info.value) == f"cannot create {out}: {tmp_path / 'afile'} is a file, not a directory; nothing was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "keep me"


def test_an_output_in_a_directory_that_takes_no_entries_names_the_output(tmp_path):
    out = Path("/proc/qstrat-out")
    with pytest.raises(QstratError) as info:
        write_checkpoint(RefitDriver("bf16"), NORM, out, hf_config=CFG)
    assert str(info.value) == ("cannot create /proc/qstrat-out: /proc does not take new entries (No such file or "
                               "directory); nothing was written")


def test_a_failed_write_removes_the_parents_it_created_and_keeps_the_users(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(ckpt, "save_file", failing_save(calls, fail_at=1))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    out = tmp_path / "mine" / "a" / "b" / "ckpt"
    with pytest.raises(QstratError, match="No space left on device"):
        write_checkpoint(RefitDriver("bf16"), NORM, out, hf_config=CFG)
    assert tree(tmp_path) == {"mine/": b"", "mine/notes.txt": b"keep"}  # a/ and a/b/ are gone, mine/ stays
    # an error before the first byte creates nothing at all
    with pytest.raises(QstratError, match="the model config's 'x' cannot be written"):
        write_checkpoint(RefitDriver("bf16"), NORM, out, hf_config={**CFG, "x": float("nan")})
    assert tree(tmp_path) == {"mine/": b"", "mine/notes.txt": b"keep"}


@pytest.mark.parametrize("target, message", [
    ("/proc/foo", "error: cannot create /proc/foo: /proc does not take new entries (No such file or directory); "
                  "nothing was written\n"),
    ("{tmp}/afile/sub", "error: cannot create {tmp}/afile/sub: {tmp}/afile is a file, not a directory; nothing was "
                        "written\n"),
])
def test_cli_output_that_cannot_be_created_is_a_user_error(tmp_path, src, target, message, capsys):
    (tmp_path / "afile").write_text("keep me")
    rc, err = in_process(capsys, "quantize", src, "--preset", "bf16", "-o", target.format(tmp=tmp_path))
    assert (rc, err) == (2, message.format(tmp=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
