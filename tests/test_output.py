"""What the ``qstrat`` command prints: stable when piped, engine chatter in a log, no progress
bar above an error. The demo and the CLI end to end, piped as in a CI log:
tests/test_docs_snippets.py (scripts/demo.sh, qstrat quantize/plan/list)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from qstrat.cli.console import PIPE_WIDTH, make_console, stderr_to

CLI = [sys.executable, "-m", "qstrat.cli.commands"]


def test_stderr_to_catches_native_python_and_warning_output(tmp_path, capfd):
    log = tmp_path / "engine.log"
    with stderr_to(log), warnings.catch_warnings():
        os.write(2, b"[W1201 08:55:20 utils.cpp:68] Warning: NUMA binding\n")  # what C++ code does
        print("Loading safetensors checkpoint shards: 100%", file=sys.stderr)
        # print it to sys.stderr, as Python does outside pytest (which records warnings instead)
        warnings.showwarning = lambda m, c, f, n, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(m, c, f, n, line))
        warnings.simplefilter("always")
        warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning, stacklevel=1)
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    assert err == "after\n"  # nothing leaked, and fd 2 is back
    text = log.read_text()
    for line in ("NUMA binding", "Loading safetensors", "FutureWarning"):
        assert line in text


def test_stderr_to_names_the_log_and_its_tail_when_the_body_fails(tmp_path, capfd):
    log = tmp_path / "engine.log"
    with pytest.raises(RuntimeError) as info:
        with stderr_to(log, tail_lines=2):
            for i in range(5):
                print(f"line {i}", file=sys.stderr)
            raise RuntimeError("engine failed to start")
    note = "\n".join(info.value.__notes__)
    assert str(log) in note and "  line 3\n  line 4" in note and "line 2" not in note
    assert capfd.readouterr().err == ""


def test_console_for_a_pipe_is_wide_and_never_wraps(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    console = make_console()
    assert console.width == PIPE_WIDTH and not console.is_terminal
    doc = json.dumps({"ignored_layers": [f"model.layers.{i}.mlp.gate" for i in range(40)]})
    console.print("quantization_config:", doc)
    out = capsys.readouterr().out
    assert out == f"quantization_config: {doc}\n"  # 1,200 characters, one line
    monkeypatch.setenv("COLUMNS", "120")
    assert make_console().width == 120


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, tiny_model):
    from qstrat.cli.demo.tiny_model import save_bf16

    return save_bf16(tiny_model, tmp_path_factory.mktemp("out") / "bf16")


def test_quantize_prints_no_progress_above_an_error(bf16_dir, tmp_path):
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("preset: mxfp8-experts\nrules:\n  - select: [attention]\n    serializer: block_fp8\n")
    (tmp_path / "exists").mkdir()
    for args, message in (([ "--config", mixed, "-o", tmp_path / "out"], "mixes quantized formats"),
                          (["--preset", "block-fp8", "-o", tmp_path / "exists"], "exists; pass --overwrite to replace it")):
        proc = subprocess.run([*CLI, "quantize", bf16_dir, *map(str, args)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2 and message in proc.stderr
        assert proc.stdout == ""  # no bar, no summary: the error is the only output
    assert not (tmp_path / "out").exists()



def test_demo_removes_its_temporary_directory_unless_it_failed(tmp_path, monkeypatch):
    import tempfile

    import qstrat.cli.demo.run as demo

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = demo.run_demo("mxfp8-experts", engine=False)
    assert report.verified and report.removed and not list(tmp_path.glob("qstrat-demo-*"))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo, "write_checkpoint", full_disk)
    with pytest.raises(OSError) as info:
        demo.run_demo("mxfp8-experts", engine=False)
    kept = list(tmp_path.glob("qstrat-demo-*"))
    assert len(kept) == 1 and f"the demo's files are kept in {kept[0]}" in info.value.__notes__


def test_torchao_import_warnings_are_quieted_unless_configured():
    """transformers and vLLM import torchao when it is installed; its 'Failed to load
    ..._C_mxfp8.cpython-310...so' warnings (and torch's pytree notices for its enums) are raised
    to ERROR, but a logger the user configured keeps its level."""
    import logging

    from qstrat.cli.console import TORCHAO_IMPORT_LOGGERS, quiet_torchao_import

    saved = {n: logging.getLogger(n).level for n in TORCHAO_IMPORT_LOGGERS}
    try:
        logging.getLogger("torchao").setLevel(logging.NOTSET)
        logging.getLogger("torch.utils._pytree").setLevel(logging.DEBUG)  # the user's choice
        quiet_torchao_import()
        assert logging.getLogger("torchao").level == logging.ERROR
        assert logging.getLogger("torch.utils._pytree").level == logging.DEBUG
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


def test_a_users_script_in_the_project_environment_is_quiet(tmp_path):
    """``import peft`` and loading a transformers model in the project's .venv print nothing on
    stderr: no torchao there (pyproject's bench extra says why; its 0.18 printed failed loads of
    ``_C_mxfp8.cpython-310...so`` and torch's pytree deprecations on every such import).
    transformers' own progress bars are turned off: they are its interface, not noise."""
    script = tmp_path / "user.py"
    script.write_text(
        "import sys\n"
        "import peft\n"
        "import transformers\n"
        "from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe\n"
        "transformers.utils.logging.disable_progress_bar()\n"
        f"build_tiny_qwen3_moe(seed=0).save_pretrained({str(tmp_path / 'model')!r})\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'model')!r})\n"
        "print(type(m).__name__, peft.__version__)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Qwen3MoeForCausalLM ")
    assert out.stderr == ""


def test_stderr_redirected_names_the_log_while_stderr_goes_there(tmp_path):
    """What start_engine reads to leave an outer log (the demo's) in place."""
    from qstrat.cli.console import stderr_redirected

    assert stderr_redirected() is None
    with stderr_to(tmp_path / "outer.log"):
        assert stderr_redirected() == tmp_path / "outer.log"
        with stderr_to(tmp_path / "inner.log"):
            assert stderr_redirected() == tmp_path / "inner.log"
        assert stderr_redirected() == tmp_path / "outer.log"
    assert stderr_redirected() is None
