"""scripts/fidelity_sizes.py's seeds' weights on disk (``--states``): one row per process reuses them."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_seed_states_are_the_seeds_weights_written_once_and_reused(tmp_path):
    from fidelity_sizes import seed_states

    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe

    state = seed_states("tiny", 2, tmp_path / "states")
    files = sorted(p.name for p in (tmp_path / "states").iterdir())
    assert files == ["tiny-1.safetensors", "tiny-2.safetensors"]  # no temporary file left
    want = build_tiny_qwen3_moe(seed=2).state_dict()
    got = state(2)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)
    stamp = (tmp_path / "states" / "tiny-1.safetensors").stat().st_mtime_ns
    (tmp_path / "states" / "tiny-2.safetensors").unlink()  # as if a run had stopped before writing it
    again = seed_states("tiny", 2, tmp_path / "states")
    assert (tmp_path / "states" / "tiny-1.safetensors").stat().st_mtime_ns == stamp  # kept, not rewritten
    assert all(torch.equal(again(2)[n], want[n]) for n in want)  # the missing one written again, same weights
