"""Round modes without an engine: bounded memory and host staging, over gloo from this process
to two StandaloneReceiver processes (the live-engine versions are in tests/test_engine_transport.py).

* bounded mode ends with exactly the driver's bytes, like atomic; a receiver's measured peak RSS
  in a bounded round is about one reload unit plus two buckets, under half the round; in an
  atomic round the round's payload (scripts/bench_transport.py --memory, in subprocesses);
* atomic mode with host staging (each verified bucket copied out of two receive buffers: what
  ``QSTRAT_TRANSFER_STAGING=host`` does on CUDA, here on CPU) gives the same bytes;
* a bucket corrupted at the middle layer in bounded mode: MixedWeightsError on the sender naming
  the ranks, both receivers flagged, the units before the fault new and the rest old (exactly),
  a partial refit refused naming the flag, a whole refit repairs (== the driver's bytes) and
  clears the flag.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qstrat.errors import MixedWeightsError, WireManifestMismatchError
from qstrat.transport import RefitSender
from qstrat.transport.wire_manifest import reload_unit, wire_manifest_for_plan

from transport_harness import (first_bucket_of, flip_first_byte, free_port, sha256, standalone_receivers,
                               wrap_group)

BUCKET = 64 << 10
BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench_transport.py"


@pytest.fixture(scope="module")
def receivers(tiny):
    with standalone_receivers(tiny[3]) as rs:
        yield rs


def sender_for(receivers, mode, **kw):
    s = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=20, bucket_bytes=BUCKET,
                    mode=mode, delta_min_bucket_bytes=kw.pop("delta_min_bucket_bytes", 0), **kw)  # delta: many buckets
    s.connect()
    return s


def want(driver, trainer):
    return {name: sha256(t) for name, t in driver.run(trainer)}


def test_bounded_round_gives_the_atomic_bytes(receivers, tiny):
    driver, trainer_a, trainer_b, _ = tiny
    atomic = sender_for(receivers, "atomic")
    atomic.refit(driver, trainer_a)
    assert [r.ctl.call("digests") for r in receivers] == [want(driver, trainer_a)] * 2
    atomic.close()
    bounded = sender_for(receivers, "bounded")
    bounded.refit(driver, trainer_b)
    assert [r.ctl.call("digests") for r in receivers] == [want(driver, trainer_b)] * 2
    bounded.close()


def test_bounded_rounds_peak_rss_is_a_layer_and_two_buckets_atomic_the_payload(tmp_path):
    """The receiver's peak RSS (VmHWM, in its own process, reset before the measured round:
    scripts/bench_transport.py --memory) above its RSS before the round, on a 136 MiB synthetic
    payload of 32 MiB layers and 8 MiB buckets (the figure for 2 GiB: docs/performance.md)."""
    out = tmp_path / "memory.json"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # a freed buffer leaves the RSS at once
    subprocess.run([sys.executable, str(BENCH), "--memory", "--layers", "4", "--layer-mib", "32", "--receivers", "1",
                    "--bucket-mib", "8", "--modes", "atomic", "bounded", f"--json={out}"],
                   check=True, capture_output=True, timeout=300, env=env)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["memory"]}
    atomic, bounded = rows["atomic"], rows["bounded"]
    payload = atomic["payload_bytes"]
    assert atomic["peak_above_bytes"] >= 0.9 * payload, atomic  # the apparatus sees a round's staging
    # one reload unit being completed plus two buckets in flight, and the process's own noise
    bound = bounded["largest_unit_bytes"] + 2 * bounded["bucket_bytes"] + (16 << 20)
    assert bounded["peak_above_bytes"] <= bound and bounded["peak_above_bytes"] < payload / 2, bounded


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
