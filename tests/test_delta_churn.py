"""The per-step churn study (qstrat.transport.delta.churn, scripts/delta_churn.py, issue 45) on a
small real trajectory (the tiny Qwen3-MoE, 2 Adam steps at lr 1e-5 on the Zen of Python, block
FP8 and NVFP4 on every linear layer): every count equals an oracle computed here from
``RefitDriver.run``'s tensors (FP8 codes compared as bytes, NVFP4 codes unpacked nibble by
nibble), the delta bytes equal the payloads of the round the SENDER encodes bucket by bucket
(``delta_stream.encode_round``) and they rebuild the step's stream exactly, and the printed
table (no matplotlib needed) shows the medians and ranges of those counts. The script's command
line at lr 0 (every format): nothing changes, each delta round is its patch headers only, and
the chart is a PNG."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.receive import PatchDecoder
from qstrat.transport.delta.stream import encode_round
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
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.cli.demo.trajectory import adam_trajectory, text_tokens
    from qstrat.execute.driver import RefitDriver
    from qstrat.transport.delta.churn import FORMATS as CONFIGS

    model = build_tiny_qwen3_moe(seed=1)
    states = list(adam_trajectory(model, LR, STEPS, tokens=text_tokens()))
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
        assert row[:3] == [fmt, "1e-05", "2"]
        assert row[3] == f"{(pcts[0] + pcts[1]) / 2:.3g} ({pcts[0]:.3g}-{pcts[1]:.3g})"  # median (min-max)


def test_parts_of_one_study_merge_and_others_are_refused(run, tmp_path, capsys):
    parts = []
    for fmt in FORMATS:  # one part per format, as one process per lr writes one part per lr
        part = tmp_path / f"{fmt}.json"
        part.write_text(json.dumps({**run, "runs": [r for r in run["runs"] if r["format"] == fmt]}))
        parts.append(str(part))
    merged = tmp_path / "merged.json"
    assert script.main(["--from-json", *parts, "--json", str(merged)]) == 0
    doc = json.loads(merged.read_text())
    assert doc["runs"] == run["runs"] and doc["load"] == run["load"] * 2 and len(doc["parts"]) == 2
    with pytest.raises(ValueError, match=r"a \(format, lr\) appears twice: \[\('block-fp8', 1e-05\)"):
        script.main(["--from-json", parts[0], parts[0]])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**run, "width": 2}))
    with pytest.raises(ValueError, match="not one study"):
        script.main(["--from-json", parts[0], str(other)])


def test_the_script_at_lr_0_changes_nothing_and_sends_patch_headers_only(tmp_path, capsys):
    """lr 0: Adam moves no weight, so no code, scale or bf16 element changes, and each step's
    delta round is, per bucket, its digest, the patch header (int64 magic, length, tiles, tile
    size) and the tile table (a kind byte and an int32 count per tile, every count 0); the
    same for the bf16 delta. The chart of the run is a PNG of the size matplotlib drew."""
    import matplotlib.image

    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.transport.delta.churn import FORMATS as CONFIGS

    model = build_tiny_qwen3_moe(seed=1)  # the script's model; at lr 0 every step's weights are its own
    bf16 = list(model.state_dict().items())
    out, png = tmp_path / "churn.json", tmp_path / "churn.png"
    assert script.main(["--steps", "1", "--lr", "0", "--threads", "1", "--json", str(out), "--png", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert doc["token_stream"] == "bytes of the Zen of Python (856 tokens)" and doc["steps"] == 1
    assert sorted(r["format"] for r in doc["runs"]) == sorted(["block-fp8", "mxfp8", "nvfp4-experts", "nvfp4-linear"])

    def headers_only(tensors) -> tuple[int, int]:
        """(the full round's bytes, the delta round's bytes when no byte changed)."""
        target = build_wire_manifest([(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors],
                                     4 << 20)
        tiles = delta.padded_size(target.total_bytes) // delta.TILE
        return target.total_bytes, len(target.buckets) * (delta.DIGEST_BYTES + 32) + 5 * tiles

    for r in doc["runs"]:
        (row,) = r["rows"]
        assert r["lr"] == 0 and row["step"] == 1, r["format"]
        assert [row[f"{k}_changed"] for k in ("codes", "scales", "global", "other")] == [0, 0, 0, 0], r["format"]
        assert row["codes"] > 0 and row["scales"] > 0 and (row["global"] > 0) == r["format"].startswith("nvfp4")
        checkpoint = list(RefitDriver(CONFIGS[r["format"]], hf_config=hf_config(model)).run(dict(bf16)))
        assert (row["full_bytes"], row["delta_bytes"]) == headers_only(checkpoint), r["format"]
        assert (row["bf16_full_bytes"], row["bf16_delta_bytes"]) == headers_only(bf16)
    table = capsys.readouterr().out
    assert "| mxfp8 | 0e+00 | 1 | 0 (0-0) | 0 (0-0) | - |" in table
    image = matplotlib.image.imread(png)  # a PNG that decodes, of the figure's size at its dpi
    assert image.shape[:2] == (7 * 110, round(4.2 * 4 * 110))


def test_what_the_formats_force_one_ulp_moves():
    """``forced_churn`` on the tiny model's weights, against oracles from the format rules. Every
    weight one bf16 ulp larger: every block-FP8 scale (amax / 448) changes; an MXFP8 scale
    (2^ceil(log2(amax / 448))) only in the 32-blocks whose amax was 448 x a power of two (a
    significand of 1.75: one bf16 ulp more crosses it); every NVFP4 global scale (amax / 2688).
    Each matrix's largest weight one ulp larger: one block-FP8 scale per quantized trainer
    matrix (the block holding it), every NVFP4 global scale (each fused group's amax is one
    matrix's largest), and one bf16 element per unquantized matrix (embeddings, lm_head,
    routers)."""
    from qstrat.transport.delta import churn as dc

    model, drivers = dc.study_model(1, ["block-fp8", "mxfp8", "nvfp4-linear"])
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    got = dc.forced_churn(drivers, state)
    assert list(got) == list(dc.PERTURBATIONS) == ["every weight +1 ulp", "matrix max +1 ulp"]

    every, top = got["every weight +1 ulp"], got["matrix max +1 ulp"]
    assert every["block-fp8"]["scales_changed"] == every["block-fp8"]["scales"] == 240
    quantized = [t for n, t in state.items() if ".self_attn." in n and n.endswith("_proj.weight") or ".mlp.experts." in n]
    at_175 = 0  # 32-blocks (along the input dim, as the checkpoint's) whose amax is 1.75 x 2^e: bf16 mantissa 0x60
    for t in quantized:
        amax = t.float().abs().reshape(-1, 32).amax(1).to(torch.bfloat16)
        at_175 += int((((amax.view(torch.int16) & 0x7F) == 0x60) & (amax > 0)).sum())
    assert 0 < every["mxfp8"]["scales_changed"] == at_175 < every["mxfp8"]["scales"] // 50
    assert every["nvfp4-linear"]["global_changed"] == every["nvfp4-linear"]["global"] > 0
    for fmt in drivers:  # every bf16 element left unquantized moved
        assert every[fmt]["other_changed"] == sum(t.numel() for n, t in drivers[fmt].run(state)
                                                  if t.dtype == torch.bfloat16), fmt

    matrices = sum(t.shape[0] if t.dim() == 3 else 1 for t in quantized)  # an expert slab: E matrices
    unquantized = sum(1 for t in state.values() if t.dim() >= 2) - len(quantized)
    assert matrices == 4 * (4 + 2 * 8) and unquantized == 6  # 4 layers: q, k, v, o, 8 gate_up, 8 down; embed, head, 4 routers
    assert top["block-fp8"]["scales_changed"] == matrices
    assert top["nvfp4-linear"]["global_changed"] == top["nvfp4-linear"]["global"]
    for fmt in drivers:
        assert top[fmt]["other_changed"] == unquantized, fmt
        assert 0 < top[fmt]["delta_bytes"] < every[fmt]["delta_bytes"] < top[fmt]["full_bytes"], fmt


def test_the_training_text_is_the_zen_of_python_and_bad_streams_are_refused():
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe
    from qstrat.cli.demo.trajectory import adam_trajectory, text_tokens

    zen = text_tokens()
    assert zen.dtype == torch.int64 and zen.numel() == 856
    assert bytes(zen[:32].tolist()) == b"The Zen of Python, by Tim Peters" and bytes(zen[-30:].tolist()).endswith(b"more of those!")
    assert torch.equal(text_tokens("\u00e9a"), torch.tensor([0xC3, 0xA9, 0x61]))  # UTF-8 bytes
    with pytest.raises(ValueError, match="the text is empty"):
        text_tokens("")
    model = build_tiny_qwen3_moe(seed=1)
    with pytest.raises(ValueError, match=r"ids in \[0, 1024\) \(the model's vocab_size\); got 2 ids in \[3, 1024\]"):
        next(adam_trajectory(model, 1e-5, 1, tokens=torch.tensor([3, 1024])))
