"""The delta sender's source run ahead on a second thread (qstrat.transport.delta.ahead): steps in
order, errors at their own index, nothing running after close, the caller's autograd mode, and
a delta round's payloads byte for byte those of the round without it."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.ahead import LookAhead
from qstrat.transport.delta.stream import PatchEncoder
from qstrat.transport.wire_manifest import build_wire_manifest


def test_steps_run_in_order_ahead_of_the_caller_and_take_waits_for_its_own():
    ran, gate = [], threading.Event()

    def step(k):
        if k == 2:
            gate.wait(5)
        ran.append(k)

    ahead = LookAhead(step, 3)
    ahead.take(0)
    deadline = time.monotonic() + 5
    while ran != [0, 1] and time.monotonic() < deadline:  # step 1 runs without being asked for
        time.sleep(0.01)
    assert ran == [0, 1]
    gate.set()
    assert ahead.take(1) >= 0.0 and ahead.take(3) >= 0.0
    assert ran == [0, 1, 2, 3]
    ahead.close()


def test_an_error_is_raised_by_the_take_of_its_own_index_and_no_later_step_runs():
    ran = []

    def step(k):
        ran.append(k)
        if k == 2:
            raise RuntimeError("source failed at bucket 2")

    ahead = LookAhead(step, 5)
    ahead.take(0)
    ahead.take(1)  # steps before the failure are still handed out
    with pytest.raises(RuntimeError, match="source failed at bucket 2"):
        ahead.take(2)
    ahead.close()
    assert ran == [0, 1, 2]


def test_close_waits_for_the_running_step_and_starts_no_other():
    ran, started = [], threading.Event()

    def step(k):
        if k == 1:
            started.set()
            time.sleep(0.2)
        ran.append(k)

    ahead = LookAhead(step, 5)
    ahead.take(0)
    assert started.wait(5)
    ahead.close()
    assert ran == [0, 1]  # step 1 finished before close returned; step 2 never began
    time.sleep(0.05)
    assert ran == [0, 1]
    ahead.close()  # idempotent


def test_the_thread_runs_under_the_callers_autograd_mode():
    seen = []
    with torch.no_grad():
        ahead = LookAhead(lambda k: seen.append(torch.is_grad_enabled()), 1)
    ahead.take(1)
    ahead.close()
    assert seen == [False, False]


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"t{i}", torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
            for i, n in enumerate([70_000, 5, 200_000, 33_000, 1, 131_072])]


def manifest_for(tensors, bucket_bytes):
    return build_wire_manifest([(n, "uint8", tuple(t.shape)) for n, t in tensors], bucket_bytes)


def _payloads(wm, tensors, base, look_ahead):
    enc = PatchEncoder(wm, iter(tensors), base, look_ahead=look_ahead)
    enc.info["round"] = "r1"  # one round id: the digests are keyed by it
    enc.start(None, bytes(32))
    out = [enc.payload(k) for k in range(len(wm.buckets))]
    enc.close()
    return enc, out


def test_a_round_pulled_ahead_encodes_the_same_payloads_and_stream():
    first, second = _tensors(1), _tensors(1)
    for _, t in second[::2]:
        t[::997] += 1
    wm = manifest_for(first, 64 * 1024)
    assert len(wm.buckets) >= 4
    base = delta.Base("r0", wm.digest, delta.stream_of(wm, first))
    plain, want = _payloads(wm, second, base, False)
    ahead, got = _payloads(wm, second, base, True)
    assert ahead.kind == plain.kind == "delta"
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
    assert torch.equal(ahead.stream, plain.stream)


def test_a_source_failing_part_way_fails_its_own_bucket_only():
    tensors = _tensors(2)

    def source():
        for i, (name, t) in enumerate(tensors):
            if i == 4:
                raise ValueError("quantizing t4 failed")
            yield name, t

    wm = manifest_for(tensors, 64 * 1024)
    bad = next(s.bucket for s in wm.slots if s.name == "t4")
    assert bad > 0
    enc = PatchEncoder(wm, source(), None, look_ahead=True)
    enc.start(None, bytes(32))
    for k in range(bad):
        enc.payload(k)
    with pytest.raises(ValueError, match="quantizing t4 failed"):
        enc.payload(bad)
    enc.close()
    assert enc.done == bad and not enc.complete


def test_the_sender_bench_runs_both_ways_over_adam_steps_with_the_same_stream_every_round(capsys, monkeypatch):
    """scripts/bench_delta_sender.py: every round's stream is byte for byte the same with the source
    run ahead and in order (block FP8 and NVFP4, 4 Adam steps of the tiny model), and it prints a
    row of measured seconds per format."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_delta_sender as script

    monkeypatch.setattr(sys, "argv", ["bench_delta_sender.py", "--width", "1", "--steps", "4",
                                      "--formats", "block-fp8", "nvfp4"])
    script.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["block-fp8", "nvfp4"]
    for r in rows:
        assert r[6] == "True", r  # same bytes
        assert all(float(x) > 0 for x in r[1:6]), r


def test_the_switch_interval_is_lowered_while_a_source_thread_runs_and_put_back_after():
    """The GIL hand-over between the encoder and the source: sys.getswitchinterval() is at most
    SWITCH_INTERVAL_S while a source thread runs, and the caller's value is back once every one
    ended (a finished run, a failed step, a close before the end, two at once)."""
    import sys

    from qstrat.transport.delta.ahead import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        seen, gate = [], threading.Event()

        def step(k):
            seen.append(sys.getswitchinterval())
            if k == 1:
                gate.wait(5)

        one, two = LookAhead(step, 2), LookAhead(lambda k: seen.append(sys.getswitchinterval()), 0)
        one.take(0)
        two.take(0)
        two.close()  # the other one still runs: the interval stays low
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S
        gate.set()
        one.take(2)
        one.close()
        assert seen == [SWITCH_INTERVAL_S] * 4 and sys.getswitchinterval() == 0.004

        def failing(k):
            raise ValueError("source failed")

        bad = LookAhead(failing, 3)
        with pytest.raises(ValueError):
            bad.take(0)
        bad.close()
        assert sys.getswitchinterval() == 0.004
    finally:
        sys.setswitchinterval(before)
