"""Attacks on the delta bucket floor (``delta_min_bucket_bytes``, commit f76d098): values given or
assigned between rounds, layout changes on one sender, and the mesh sender's two places that lay
a round out (the routes the engines get, the pairs each trainer rank sends).

Checked against the receivers' actual tensors (SHA-256 of every tensor equal to
``RefitDriver.run``'s output) and the reason the sender reports."""
from __future__ import annotations

import re

import numpy as np
import pytest

from qstrat.errors import TransportConfigError
from qstrat.transport import RefitSender
from qstrat.transport.mesh.refit import MeshRefitSender
from qstrat.transport.wire_manifest import build_wire_manifest

from transport_harness import connected_sender, counting_receivers, free_port, sha256
from transport_harness import held_digests as held, run_digests as want, sign_step as stepped

SECRET = "a shared secret for the delta floor attacks"
BUCKET = 64 << 10
TIMEOUT_S = 20
MIB16 = 16 << 20


def _senders():
    return (("RefitSender", lambda **kw: RefitSender([], "127.0.0.1", 1, bucket_bytes=BUCKET, mode="delta", **kw)),
            ("MeshRefitSender", lambda **kw: MeshRefitSender(0, 1, "127.0.0.1", 1, bucket_bytes=BUCKET, mode="delta",
                                                             **kw)))


@pytest.mark.parametrize("bad", [-5, 16e6, 1.5, "16", None, True, np.float64(16 << 20)])
def test_a_floor_assigned_between_rounds_is_checked_as_one_given_at_construction(bad):
    """``sender.delta_min_bucket_bytes = ...`` (what scripts/bench_transport.py does) was not
    checked: -5 was used as 0 silently, 16e6 laid the round out with a float bound whose wire
    manifest every receiver refused as "corrupted or edited in transit", "16" raised TypeError
    (bad operand type for unary -) from inside refit. It is refused when assigned, naming the key
    and the value, and the sender keeps the floor it had."""
    for owner, make in _senders():
        sender = make()
        with pytest.raises(TransportConfigError, match=rf"^{owner} delta_min_bucket_bytes={re.escape(repr(bad))}: "
                                                      r"give an int >= 0 \(bytes; 0 lays delta rounds out"):
            sender.delta_min_bucket_bytes = bad
        assert sender.delta_min_bucket_bytes == MIB16 and sender.layout_bucket_bytes == MIB16


def test_a_numpy_integer_floor_is_taken_as_the_int_it_is():
    """A NumPy integer (e.g. read from an array of sizes) was refused as "not an int"; it is an
    int >= 0: taken, as a Python int (the layout's bound goes into the wire manifest's JSON)."""
    for _, make in _senders():
        for given in (np.int64(32 << 20), np.uint32(0)):
            sender = make(delta_min_bucket_bytes=given)
            assert type(sender.delta_min_bucket_bytes) is int and sender.delta_min_bucket_bytes == int(given)
            assert type(sender.layout_bucket_bytes) is int
            assert sender.layout_bucket_bytes == max(BUCKET, int(given))
            sender.delta_min_bucket_bytes = np.int32(1 << 24)
            assert sender.layout_bucket_bytes == MIB16
            wm = build_wire_manifest([("w", "float32", (1024,))], sender.layout_bucket_bytes, 64)
            assert wm.to_dict()["bucket_bytes"] == MIB16
    with pytest.raises(TransportConfigError, match=r"delta_min_bucket_bytes=np.int64\(-1\): give an int >= 0"):
        RefitSender([], "127.0.0.1", 1, mode="delta", delta_min_bucket_bytes=np.int64(-1))


@pytest.fixture(scope="module")
def receivers(tiny):
    with counting_receivers(tiny[3], SECRET) as rs:
        yield rs


def test_layout_changes_between_rounds_on_one_sender_go_whole_with_the_reason_and_stay_exact(receivers, tiny):
    """One delta sender, its floor, bucket_bytes and mode changed between rounds: each round whose
    layout differs from the base's goes whole ("the base has another layout"), the next one is a
    delta again, every round exact on both receivers; an atomic round in between (its own 64 KiB
    layout) drops the receivers' base: the next delta is refused and sent again whole."""
    driver, _, trainer, _ = tiny
    sender = connected_sender(receivers, "delta", SECRET, BUCKET, TIMEOUT_S)  # floor 0: 64 KiB buckets
    other = "the base has another layout (wire manifest)"
    steps = [(None, BUCKET, "delta", None), (dict(delta_min_bucket_bytes=MIB16), MIB16, "full", other),
             (None, MIB16, "delta", None), (dict(delta_min_bucket_bytes=MIB16 + 1), MIB16 + 64, "full", other),
             (None, MIB16 + 64, "delta", None), (dict(bucket_bytes=32 << 20), 32 << 20, "full", other),
             (None, 32 << 20, "delta", None), (dict(mode="atomic"), 32 << 20, None, None),
             (dict(mode="bounded-delta"), 32 << 20, "full", "the engines refused the delta"),
             (dict(bucket_bytes=BUCKET), MIB16 + 64, "full", other),
             (dict(delta_min_bucket_bytes=0), BUCKET, "full", other), (None, BUCKET, "delta", None)]
    try:
        first = sender.refit(driver, trainer)
        assert first.delta.kind == "full" and held(receivers) == [want(driver, trainer)] * 2
        for i, (change, bound, kind, reason) in enumerate(steps):
            for key, value in (change or {}).items():
                setattr(sender, key, value)
            trainer = stepped(trainer, 1e-5, 100 + i)
            report = sender.refit(driver, trainer)
            assert report.wire_manifest.bucket_bytes == bound, (i, report)
            if kind is None:
                assert report.delta is None, (i, report)
            else:
                assert report.delta.kind == kind, (i, report)
                assert (report.delta.reason or "").startswith(reason or ""), (i, report)
                assert (reason is None) == (report.delta.reason is None), (i, report)
            assert held(receivers) == [want(driver, trainer)] * 2, (i, report)
    finally:
        sender.close()


def test_a_mesh_senders_floor_or_bucket_assigned_after_connect_lays_out_both_sides_alike():
    """MeshRefitSender laid the pairs it sends out with the bound it had at connect() while the
    routes the engines get were laid out with the attributes at send(): after
    ``sender.delta_min_bucket_bytes = 0`` (or a new ``bucket_bytes``) every round was refused,
    "rank 1 rejected the wire manifest". Both follow the values at send(): that round goes whole
    (another layout than the pair's base), the next is a delta, each exact."""
    from mesh_floor_harness import SECRET as MESH_SECRET, PipeEngine
    from mesh_harness import model_and_plans
    from qstrat.execute.sharding import ExpertParallel

    driver, _, held_by_rank, _, plan = model_and_plans("mxfp8", 1)
    port = free_port()
    engine = PipeEngine(port)
    sender = MeshRefitSender(0, 1, "127.0.0.1", port, [engine], [1], timeout_s=60.0, secret=MESH_SECRET,
                             bucket_bytes=1 << 20, mode="delta")
    held_now = held_by_rank[0]
    try:
        sender.connect()
        for i, (change, bound, kind) in enumerate([
                (None, MIB16, "full"), (None, MIB16, "delta"),
                (dict(delta_min_bucket_bytes=0), 1 << 20, "full"), (None, 1 << 20, "delta"),
                (dict(bucket_bytes=1 << 16), 1 << 16, "full"), (None, 1 << 16, "delta")]):
            for key, value in (change or {}).items():
                setattr(sender, key, value)
            held_now = stepped(held_now, 1e-5, 200 + i)
            report = sender.refit(driver, held_now, plan, ExpertParallel(1, 8).owner)
            assert engine.docs[-1]["bucket_bytes"] == bound and sender.layout_bucket_bytes == bound, i
            assert report.delta.kind == kind and engine.stats.get("attempts") == 1, (i, report.delta)
            assert engine.held == {n: sha256(t) for n, t in driver.run(iter(held_now.items()), plan=plan)}, i
    finally:
        sender.close()
        engine.close()
