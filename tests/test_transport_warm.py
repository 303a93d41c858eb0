"""A warm RefitSender.refit over real gloo rounds to two spawned StandaloneReceiver processes: the
driver's kept plan reused by names and hf_config, each input's shape and dtype checked where the
stream reads it (qstrat.execute.driver.PlanCache, RefitSender.refit).

Oracle for the bytes: ``RefitDriver.run`` of the same trainer tensors with a FRESH driver (the
tensors a direct in-process refit would hand vLLM). Checked against the receivers' actual tensors
and mix flags after each round:

* a warm refit does not run the planner (``PlanCache.planned``) and sends the right bytes;
* a recast input on a warm atomic round: the round is aborted with nothing loaded, the inputs
  are planned again and sent once, the report says why, the receivers hold the right bytes;
* the same in delta mode: the delta base survives the aborted attempt (the second round is a
  delta against it);
* a reshaped input: the aborted warm round, then the re-plan refused up front naming the tensor;
  a renamed input: a cold refit refused up front - the receivers unchanged in both;
* a NaN on a warm round: raised while streaming, nothing loaded.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from qstrat import NonFiniteError, PlanError, RefitDriver
from qstrat.transport import RefitSender
from qstrat.transport.security.keys import ENV_SECRET

from transport_harness import free_port, sha256, standalone_receivers

SECRET = "a shared secret for the warm refit tests"
BUCKET = 64 << 10
RECAST = "model.layers.1.self_attn.o_proj.weight"
RESHAPED = "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def receivers(tiny):
    with standalone_receivers(tiny[3], env={ENV_SECRET: SECRET}) as rs:
        yield rs


@contextlib.contextmanager
def started(receivers, tiny, mode="atomic"):
    """A connected sender whose first (cold) refit sent trainer A, with the driver's plan kept."""
    driver, trainer_a = tiny[0], tiny[1]
    driver.plan_cache.clear()
    s = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=20, bucket_bytes=BUCKET,
                    secret=SECRET, mode=mode, delta_min_bucket_bytes=0)  # delta rounds of many buckets
    s.connect()
    try:
        s.refit(driver, trainer_a)
        assert state(receivers) == [(want(driver, trainer_a), None)] * 2
        yield s
    finally:
        s.close()


def want(driver, trainer):
    """What a fresh driver (no kept plan) emits for ``trainer``: name -> SHA-256."""
    fresh = RefitDriver(driver.config, hf_config=driver.hf_config)
    return {name: sha256(t) for name, t in fresh.run(trainer)}


def state(receivers):
    return [(r.ctl.call("digests"), r.ctl.call("mixed")) for r in receivers]


def step(trainer, **changed):
    """A new dict, as a trainer's state_dict() builds each step: new name strings, same text."""
    return {(n + ".")[:-1]: changed.get(n, t) for n, t in trainer.items()}


def recast(trainer, other):
    """``trainer`` with RECAST given as float32 holding ``other``'s values (other bytes than the
    receivers hold; the same outputs' names, shapes and dtypes: the receivers accept the round)."""
    return step(trainer, **{RECAST: other[RECAST].float()})


@pytest.mark.parametrize("mode", ["atomic", "delta"])
def test_a_warm_refit_reuses_the_plan_and_a_recast_input_is_replanned_and_sent_once(receivers, tiny, mode):
    driver, trainer_a, trainer_b, _ = tiny
    with started(receivers, tiny, mode) as sender:
        planned = driver.plan_cache.planned
        report = sender.refit(driver, step(trainer_b))  # warm: the kept plan, its checks and wire manifest
        assert driver.plan_cache.planned == planned and report.replanned is None
        assert state(receivers) == [(want(driver, trainer_b), None)] * 2
        base = sender.base

        changed = recast(trainer_b, trainer_a)
        report = sender.refit(driver, changed)
        assert report.replanned.startswith(f"{RECAST}: arrived as float32[256, 256], planned as bfloat16[256, 256] "
                                           "(the round reusing the kept plan was aborted, nothing loaded"), \
            report.replanned
        assert driver.plan_cache.planned == planned + 1  # planned once more, for the recast input
        assert state(receivers) == [(want(driver, changed), None)] * 2
        assert want(driver, changed) != want(driver, trainer_b)  # the round changed the receivers' bytes
        if mode == "delta":  # the aborted attempt loaded nothing: the base stayed shared, the retry was a delta
            assert base is not None and report.delta.kind == "delta" and report.delta.reason is None, report.delta


def test_a_reshaped_or_renamed_input_is_refused_and_the_receivers_keep_their_weights(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    with started(receivers, tiny) as sender:
        before = state(receivers)

        reshaped = step(trainer_b, **{RESHAPED: trainer_b[RESHAPED].reshape(256, 128)})
        with pytest.raises(PlanError, match=rf"{RESHAPED}.*\[256, 128\]") as err:
            sender.refit(driver, reshaped)  # warm: found in the stream, the round aborted; the re-plan refused
        notes = "\n".join(getattr(err.value, "__notes__", []))
        assert (f"first attempt (the kept plan): {RESHAPED}: arrived as bfloat16[256, 128], planned as "
                f"bfloat16[128, 256]; that round was aborted, nothing loaded") in notes, notes
        assert state(receivers) == before and sender.group is not None

        renamed = {("model.layers.0.self_attn.k_proj.w" if n == RESHAPED else n): t for n, t in trainer_b.items()}
        with pytest.raises(PlanError, match=r"model\.layers\.0\.self_attn\.k_proj"):
            sender.refit(driver, renamed)  # the names differ: a cold refit, refused up front
        assert state(receivers) == before

        report = sender.refit(driver, step(trainer_b))  # the same sender and group go on
        assert state(receivers) == [(want(driver, trainer_b), None)] * 2, report


def test_a_nan_on_a_warm_round_is_raised_while_streaming_and_nothing_is_loaded(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    with started(receivers, tiny) as sender:
        bad = trainer_b[RECAST].clone()
        bad[3, 5] = float("nan")
        with pytest.raises(NonFiniteError, match=rf"^{RECAST}: non-finite value nan"):
            sender.refit(driver, step(trainer_b, **{RECAST: bad}))
        assert state(receivers) == [(want(driver, trainer_a), None)] * 2
        # a bad value is the trainer's data, not a failed device: as a cold refit refusing it up
        # front, the warm round leaves the group open and the next step's refit goes on it
        assert sender.group is not None
        sender.refit(driver, step(trainer_b))
        assert state(receivers) == [(want(driver, trainer_b), None)] * 2
