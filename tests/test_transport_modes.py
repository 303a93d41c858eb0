"""Round modes without an engine: bounded memory and host staging, over gloo from this process
to two StandaloneReceiver processes (the live-engine versions are in tests/test_engine_transport.py).

* bounded mode ends with exactly the driver's bytes, like atomic; its receivers' peak of live
  receive buffers is at most two buckets plus one reload unit plus the largest tensor that spans
  several buckets (received in place), under half the round; atomic's is the round's payload;
* atomic mode with host staging (each verified bucket copied out of two receive buffers: what
  ``QSTRAT_TRANSFER_STAGING=host`` does on CUDA, here on CPU) gives the same bytes;
* a bucket corrupted at the middle layer in bounded mode: MixedWeightsError on the sender naming
  the ranks, both receivers flagged, the units before the fault new and the rest old (exactly),
  a partial refit refused naming the flag, a whole refit repairs (== the driver's bytes) and
  clears the flag.
"""
from __future__ import annotations

import pytest

from qstrat.errors import MixedWeightsError, WireManifestMismatchError
from qstrat.transport import RefitSender
from qstrat.transport.wire_manifest import reload_unit, wire_manifest_for_plan

from transport_harness import (first_bucket_of, flip_first_byte, free_port, sha256, standalone_receivers,
                               wrap_group)

BUCKET = 64 << 10


@pytest.fixture(scope="module")
def receivers(tiny):
    with standalone_receivers(tiny[3]) as rs:
        yield rs


def sender_for(receivers, mode, **kw):
    s = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=20, bucket_bytes=BUCKET,
                    mode=mode, **kw)
    s.connect()
    return s


def want(driver, trainer):
    return {name: sha256(t) for name, t in driver.run(trainer)}


def test_bounded_round_gives_the_atomic_bytes_with_bounded_buffers(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    atomic = sender_for(receivers, "atomic")
    report = atomic.refit(driver, trainer_a)
    m = report.wire_manifest
    assert [r.ctl.call("stats")["peak_bytes"] for r in receivers] == [m.total_bytes] * 2
    atomic.close()
    bounded = sender_for(receivers, "bounded")
    bounded.refit(driver, trainer_b)
    assert [r.ctl.call("digests") for r in receivers] == [want(driver, trainer_b)] * 2
    unit_bytes: dict[str, int] = {}
    for s in m.slots:
        unit_bytes[reload_unit(s.name)] = unit_bytes.get(reload_unit(s.name), 0) + s.nbytes
    # one unit being completed, plus the next allocation: a bucket, or a tensor larger than a
    # bucket (received in place, allocated whole at its first chunk: the 512 KiB lm_head here)
    largest_chunked = max(s.nbytes for s in m.slots if s.chunks > 1)
    bound = 2 * BUCKET + max(unit_bytes.values()) + largest_chunked
    peaks = [r.ctl.call("stats")["peak_bytes"] for r in receivers]
    print(f"[memory] round {m.total_bytes} B, atomic peak {m.total_bytes} B, bounded peaks {peaks} B, "
          f"bound {bound} B (largest unit {max(unit_bytes.values())} B)")
    assert all(p <= bound for p in peaks) and all(p < m.total_bytes / 2 for p in peaks)
    bounded.close()


def test_host_staging_gives_the_same_bytes(receivers, tiny):
    driver, trainer_a, _, _ = tiny
    for r in receivers:
        r.ctl.call("stage_on_host")
    sender = sender_for(receivers, "atomic")
    sender.refit(driver, trainer_a)
    assert [r.ctl.call("digests") for r in receivers] == [want(driver, trainer_a)] * 2
    sender.close()


def test_bounded_fault_at_the_middle_layer_flags_a_mix_and_a_whole_refit_repairs(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    sender = sender_for(receivers, "atomic")
    sender.refit(driver, trainer_a)
    old = want(driver, trainer_a)
    new = want(driver, trainer_b)
    plan = driver.plan(trainer_b)
    m = wire_manifest_for_plan(plan, BUCKET)
    bad_bucket = first_bucket_of(m, "model.layers.2")  # layer 2's first bucket of its own
    bad = sender_for(receivers, "bounded")
    wrap_group(bad.group, wire=flip_first_byte(bad_bucket))  # the wire between sender and receivers
    with pytest.raises(MixedWeightsError) as err:
        bad.refit(driver, trainer_b)
    msg = str(err.value)
    assert "rank 1 failed after loading began (holds a mix); rank 2 failed after loading began" in msg, msg
    assert "ranks 1, 2 hold new weights" in msg and "accepts only a whole refit" in msg, msg
    assert bad.mixed is not None
    # units wholly before the bad bucket are new, the rest (layer 2 included) old
    done = {reload_unit(s.name) for s in m.slots} - {
        reload_unit(s.name) for s in m.slots if s.bucket + s.chunks - 1 >= bad_bucket}
    assert "model.layers.1" in done and "model.layers.2" not in done and "model.layers.3" not in done
    mix = {n: (new[n] if reload_unit(n) in done else old[n]) for n in old}
    for r in receivers:
        assert r.ctl.call("digests") == mix
        flag = r.ctl.call("mixed")
        assert flag is not None and f"{len(done)} of " in flag, flag
    with pytest.raises(WireManifestMismatchError, match=r"holds a MIX of two rounds .* must be whole"):
        bad.refit(driver, trainer_b, plan=plan.only_layers([2, 3]))
    assert [r.ctl.call("digests") for r in receivers] == [mix, mix]
    bad.close()
    whole = sender_for(receivers, "bounded")
    whole.refit(driver, trainer_b)
    assert [r.ctl.call("digests") for r in receivers] == [new, new]
    assert [r.ctl.call("mixed") for r in receivers] == [None, None] and whole.mixed is None
    whole.close()
