"""The per-step churn study (qstrat.transport.delta_churn, scripts/delta_churn.py, issue 45) on a
small real trajectory (the tiny Qwen3-MoE, 2 Adam steps at lr 1e-5, block FP8 and NVFP4 on every
linear layer): every count equals an oracle computed here from ``RefitDriver.run``'s tensors
(FP8 codes compared as bytes, NVFP4 codes unpacked nibble by nibble), the delta bytes equal the
payloads of the round the SENDER encodes bucket by bucket (``delta_stream.encode_round``) and
they rebuild the step's stream exactly, and the printed table (no matplotlib needed) shows
the medians of those counts."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from qstrat.transport import delta
from qstrat.transport.delta_receive import PatchDecoder
from qstrat.transport.delta_stream import encode_round
from qstrat.transport.wire_manifest import build_wire_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import delta_churn as script  # noqa: E402

LR, STEPS, FORMATS = 1e-5, 2, ["block-fp8", "nvfp4-linear"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("churn") / "churn.json"
    doc = script.measure(1, STEPS, [LR], FORMATS, out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))  # what it wrote is what it measured
    return doc


@pytest.fixture(scope="module")
def checkpoints():
    from qstrat.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.demo.trajectory import adam_trajectory
    from qstrat.driver import RefitDriver
    from qstrat.transport.delta_churn import FORMATS as CONFIGS

    model = build_tiny_qwen3_moe(seed=1)
    states = list(adam_trajectory(model, LR, STEPS))
    return {f: [list(RefitDriver(CONFIGS[f], hf_config=hf_config(model)).run(s)) for s in states] for f in FORMATS}


def _oracle(new, old):
    """Counts by kind, from the checkpoint names and dtypes, element by element."""
    got = {}
    for (name, a), (_, b) in zip(new, old):
        if name.endswith("weight_scale_2"):
            kind = "global"
        elif name.endswith(("weight_scale", "weight_scale_inv")):
            kind = "scales"
        elif name.endswith(".weight") and a.dtype in (torch.float8_e4m3fn, torch.uint8):
            kind = "codes"
        else:
            kind = "other"
        if kind == "codes" and a.dtype == torch.uint8:  # two e2m1 codes per byte
            lo = lambda t: t.reshape(-1) & 15  # noqa: E731
            hi = lambda t: t.reshape(-1) >> 4  # noqa: E731
            n, c = 2 * a.numel(), int((lo(a) != lo(b)).sum() + (hi(a) != hi(b)).sum())
        else:
            x = a.reshape(-1).view(torch.uint8).view(a.numel(), a.element_size())
            y = b.reshape(-1).view(torch.uint8).view(b.numel(), b.element_size())
            n, c = a.numel(), int((x != y).any(1).sum())
        got[kind] = got.get(kind, 0) + n
        got[f"{kind}_changed"] = got.get(f"{kind}_changed", 0) + c
    return got


def test_every_count_equals_the_oracle_and_the_delta_bytes_are_the_senders_round(run, checkpoints):
    for fmt in FORMATS:
        rows = next(r["rows"] for r in run["runs"] if r["format"] == fmt)
        assert [r["step"] for r in rows] == [1, 2]
        for row, new, old in zip(rows, checkpoints[fmt][1:], checkpoints[fmt]):
            want = _oracle(new, old)
            assert {k: row[k] for k in want} == want, fmt
            assert row["codes_changed"] > 0  # lr 1e-5 moves codes in every format
            target = build_wire_manifest(
                [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in new], 4 << 20)
            base = encode_round(target, iter(old), None)[0].new_base()
            rnd, payloads = encode_round(target, iter(new), base)
            assert row["full_bytes"] == target.total_bytes
            assert row["delta_bytes"] == rnd.wire_bytes == sum(p.numel() for p in payloads) < row["full_bytes"] // 10
            decoder = PatchDecoder(rnd.info, target, base, None, bytes(32))
            for k, p in enumerate(payloads):
                decoder.apply(k, p)
            decoder.staged()
            assert torch.equal(decoder.new_base.stream, delta.stream_of(target, new))
            assert row["bf16_delta_bytes"] > row["delta_bytes"]


def test_the_table_prints_the_medians_without_matplotlib(run, checkpoints, capsys, monkeypatch, tmp_path):
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps(run))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the table part imports no matplotlib
    assert script.main(["--from-json", str(kept)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| format | lr | steps | codes changed %")
    for fmt in FORMATS:
        row = next(line for line in lines if line.startswith(f"| {fmt} |")).strip("| ").split(" | ")
        pcts = sorted(100 * _oracle(n, o)["codes_changed"] / _oracle(n, o)["codes"]
                      for n, o in zip(checkpoints[fmt][1:], checkpoints[fmt]))
        assert row[:3] == [fmt, "1e-05", "2"] and row[3] == f"{(pcts[0] + pcts[1]) / 2:.4f}"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed (the chart only)")
def test_the_chart_is_drawn(run, tmp_path):
    kept, png = tmp_path / "kept.json", tmp_path / "churn.png"
    kept.write_text(json.dumps(run))
    assert script.main(["--from-json", str(kept), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
