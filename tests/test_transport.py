"""The transport without an engine: wire manifest layout, bucket packing, and a real gloo round from
this process (rank 0) to two spawned StandaloneReceiver processes.

Oracle for the bytes: ``RefitDriver.run`` of the same trainer tensors in this process (the
tensors a direct in-process refit would hand vLLM); both receivers must end with exactly those
bytes. The engine end-to-end and fault tests are in tests/test_engine_transport.py.
"""
from __future__ import annotations

import re
import time

import pytest
import torch

from qstrat.errors import TransportError, WireManifestMismatchError
from qstrat.transport import RefitSender, build_wire_manifest, check_against
from qstrat.transport.buckets import bucket_contents, pack, receive_buffers, unpack
from qstrat.transport.wire_manifest import WireManifest

from transport_harness import Receiver, crashing_sender, free_port, sha256, wrap_group

MIXED = [("a.weight", "float8_e4m3fn", (3, 5)), ("a.weight_scale_inv", "float32", (1, 1)),
         ("b.weight", "bfloat16", (7,)), ("big.weight", "bfloat16", (300, 10)),
         ("c.flag", "bool", ()), ("d.weight", "float8_e8m0fnu", (33,))]


def tensors_for(specs, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, dtype, shape in specs:
        n = int(torch.Size(shape).numel()) * getattr(torch, dtype).itemsize
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        out.append((name, raw.view(getattr(torch, dtype)).reshape(shape)))
    return out


def test_manifest_layout_mixed_dtypes_aligned_bounded_and_chunked():
    m = build_wire_manifest(MIXED, bucket_bytes=1024, alignment=64)
    slots = {s.name: s for s in m.slots}
    assert [s.name for s in m.slots] == [n for n, _, _ in MIXED]  # wire order kept
    assert all(s.offset % 64 == 0 for s in m.slots)
    assert all(0 < b.nbytes <= 1024 for b in m.buckets)
    # a (15 B) at 0, its scale (4 B) at 64, b (14 B) at 128: one shared bucket of 192 B
    assert (slots["a.weight"].offset, slots["a.weight_scale_inv"].offset, slots["b.weight"].offset) == (0, 64, 128)
    assert m.buckets[0].nbytes == 192
    # big (6000 B) > bucket: 6 chunks of its own, the last 880 B
    big = slots["big.weight"]
    assert (big.bucket, big.chunks, big.offset) == (1, 6, 0)
    assert [b.nbytes for b in m.buckets[1:7]] == [1024] * 5 + [880]
    assert all(b.tensor == "big.weight" for b in m.buckets[1:7])
    assert slots["c.flag"].bucket == slots["d.weight"].bucket == 7
    assert m.total_bytes == sum(b.nbytes for b in m.buckets) == m.buckets[-1].stream_offset + m.buckets[-1].nbytes


def test_manifest_round_trip_and_digest_guards_every_field():
    m = build_wire_manifest(MIXED, bucket_bytes=1024)
    doc = m.to_dict()
    assert WireManifest.from_dict(doc) == m
    assert build_wire_manifest(MIXED, bucket_bytes=2048).digest != m.digest
    edited = m.to_dict()
    edited["slots"][2]["shape"] = [8]
    with pytest.raises(WireManifestMismatchError, match="digest"):
        WireManifest.from_dict(edited)
    from dataclasses import replace

    bad = replace(m, buckets=(replace(m.buckets[0], tensor="b.weight"),) + m.buckets[1:])
    with pytest.raises(WireManifestMismatchError, match="bucket 0: holds 'b.weight'"):
        bad.check_layout()
    with pytest.raises(WireManifestMismatchError, match="multiple of the alignment"):
        build_wire_manifest(MIXED, bucket_bytes=1000)
    with pytest.raises(WireManifestMismatchError, match="unknown dtype"):
        build_wire_manifest([("x", "float9", (2,))])


def test_check_against_names_partial_units_extra_and_wrong_tensors():
    specs = MIXED + [("model.layers.0.q.weight", "bfloat16", (2, 2)),
                     ("model.layers.0.q.weight_scale_inv", "float32", (1, 1)),
                     ("model.layers.1.q.weight", "bfloat16", (2, 2))]
    expected = {n: (d, s) for n, d, s in specs}
    check_against(build_wire_manifest(specs), expected)
    # whole units may be left out (a partial refit): layer 1, module b
    check_against(build_wire_manifest([t for t in specs if t[0] not in ("model.layers.1.q.weight", "b.weight")]),
                  expected)
    m = build_wire_manifest([t for t in specs if t[0] != "model.layers.0.q.weight_scale_inv"])
    expected["e.weight"] = ("bfloat16", (2,))
    expected["a.weight"] = ("float8_e4m3fn", (5, 3))
    del expected["c.flag"]
    with pytest.raises(WireManifestMismatchError) as err:
        check_against(m, expected)
    msg = str(err.value)
    assert "model.layers.0 (missing 1: ['model.layers.0.q.weight_scale_inv'])" in msg
    assert "1 not expected by the engine: ['c.flag']" in msg
    assert "a.weight: sent float8_e4m3fn [3, 5], engine expects float8_e4m3fn [5, 3]" in msg
    assert "e.weight" not in msg  # a module sent not at all keeps its weights: allowed


def test_a_partly_sent_unit_says_how_many_names_it_lacks_not_only_the_first_three():
    specs = [(f"model.layers.0.experts.{e}.{p}", "float32", (1, 1))
             for e in range(4) for p in ("weight", "weight_scale_inv")]
    sent = [s for s in specs if not s[0].endswith("weight_scale_inv")]
    with pytest.raises(WireManifestMismatchError) as err:
        check_against(build_wire_manifest(sent), {n: (d, s) for n, d, s in specs})
    msg = str(err.value)
    assert "model.layers.0 (missing 4: ['model.layers.0.experts.0.weight_scale_inv', " in msg
    assert "'model.layers.0.experts.2.weight_scale_inv'] (+1 more))" in msg


def test_a_received_wire_manifest_is_rebuilt_once_per_document_and_an_edit_is_refused():
    """A warm refit sends the same wire manifest every round: a receiver rebuilds it (parse, SHA-256,
    layout checks) once and takes the kept one for an EQUAL document. Any edit - with the digest
    left or changed, or made in place to the very document the kept one came from - is rebuilt
    and refused as from_dict refuses it."""
    import copy

    specs = MIXED + [("model.layers.0.q.weight", "bfloat16", (2, 2))]
    doc = build_wire_manifest(specs).to_dict()
    first = WireManifest.received(doc)
    assert WireManifest.received(copy.deepcopy(doc)) is first  # the same round's document again: kept
    assert first == WireManifest.from_dict(doc)
    doc["slots"][0]["shape"] = [9, 9]  # edited in place, the digest left
    with pytest.raises(WireManifestMismatchError, match="does not match its content"):
        WireManifest.received(doc)
    doc["digest"] = "0" * 64
    with pytest.raises(WireManifestMismatchError, match="does not match its content"):
        WireManifest.received(doc)
    other = build_wire_manifest(specs, bucket_bytes=64).to_dict()
    assert WireManifest.received(other).digest == other["digest"] != first.digest


def test_pack_then_unpack_gives_the_same_bytes_as_views_of_the_received_buffers():
    m = build_wire_manifest(MIXED, bucket_bytes=1024)
    data = dict(tensors_for(MIXED))
    contents = bucket_contents(m)
    received, big = [], data["big.weight"].contiguous()
    scratch = torch.empty(1024, dtype=torch.uint8)
    for b, (_, dst) in zip(m.buckets, receive_buffers(m, torch.device("cpu"))):
        if b.tensor is None:
            dst.copy_(pack(scratch, b, contents[b.index], [data[s.name] for s in contents[b.index]]))
        else:
            start = b.stream_offset - m.buckets[contents[b.index][0].bucket].stream_offset
            dst.copy_(big.reshape(-1).view(torch.uint8)[start:start + b.nbytes])
        received.append(dst)
    out = unpack(m, received)
    assert [n for n, _ in out] == [n for n, _, _ in MIXED]
    for name, t in out:
        assert t.dtype == data[name].dtype and t.shape == data[name].shape
        assert torch.equal(t.reshape(-1).view(torch.uint8), data[name].reshape(-1).view(torch.uint8)), name
    # zero-copy: every tensor lives in a received buffer's storage
    storages = {r.untyped_storage().data_ptr() for r in received}
    assert all(t.untyped_storage().data_ptr() in storages for _, t in out)


# ---- a real round over gloo: this process sends, two processes receive ------------------------
@pytest.fixture(scope="module")
def standalone(tiny):
    """Two StandaloneReceiver processes (checked against A's checkpoint headers) and a sender
    connected to them; 64 KiB buckets, so the 512 KiB embedding travels in chunks."""
    receivers = [Receiver("standalone", tiny[3]) for _ in range(2)]
    try:
        for r in receivers:
            r.wait_ready()
        sender = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=20,
                             bucket_bytes=64 << 10)
        sender.connect()
        yield sender, receivers
        sender.close()
    finally:
        for r in receivers:
            r.close()


def test_two_receivers_end_with_the_driver_output_bytes(standalone, tiny):
    sender, receivers = standalone
    driver, _, trainer_b, _ = tiny
    report = sender.refit(driver, trainer_b)
    want = {name: sha256(t) for name, t in driver.run(trainer_b)}
    got = [r.ctl.call("digests") for r in receivers]
    assert got[0] == got[1] == want
    assert any(s.chunks > 1 for s in report.wire_manifest.slots), "expected a chunked tensor"
    assert report.buckets == len(report.wire_manifest.buckets) and report.bytes == report.wire_manifest.total_bytes
    assert repr(report) == (
        f"TransferReport(tensors={len(report.wire_manifest.slots)}, bytes={report.bytes} "
        f"({report.bytes / 2**20:.2f} MiB), buckets={report.buckets}, stream_seconds="
        f"{report.stream_seconds:.3f}, seconds={report.seconds:.3f}, wire manifest digest "
        f"{report.wire_manifest.digest[:12]})")  # one line, not the whole wire manifest


def test_a_source_that_falls_short_aborts_the_round_and_the_group_stays_usable(standalone, tiny):
    from qstrat.transport.wire_manifest import wire_manifest_for_plan

    sender, receivers = standalone
    driver, trainer_a, trainer_b, _ = tiny
    sender.refit(driver, trainer_b)
    before = receivers[0].ctl.call("digests")
    plan = driver.plan(trainer_a)
    wire_manifest = wire_manifest_for_plan(plan, sender.bucket_bytes)
    emitted = list(driver.execute(plan, trainer_a))
    t0 = time.perf_counter()
    with pytest.raises(TransportError, match="source ended before") as err:
        sender.send(wire_manifest, iter(emitted[:len(emitted) // 2]))
    assert "aborted the stream at bucket" in str(err.value)  # what the receivers reported
    assert time.perf_counter() - t0 < 10
    assert [r.ctl.call("digests") for r in receivers] == [before, before]  # nothing committed
    wrong = emitted[:3] + [(emitted[4][0], emitted[3][1])] + emitted[4:]
    with pytest.raises(TransportError, match="where the wire manifest has"):
        sender.send(wire_manifest, iter(wrong))
    sender.send(wire_manifest, iter(emitted))  # same group, next round
    want = {name: sha256(t) for name, t in emitted}
    assert [r.ctl.call("digests") for r in receivers] == [want, want]


def test_a_sender_process_that_dies_mid_stream_leaves_the_receivers_unchanged(standalone, tiny):
    """A real trainer process exits (no cleanup) before bucket 4: both receivers' update_weights
    fail promptly with "stream truncated", and they keep their last committed tensors. (Last in
    this module: the receivers now hold the dead sender's group.)"""
    import multiprocessing as mp

    sender, receivers = standalone
    driver, _, trainer_b, _ = tiny
    sender.refit(driver, trainer_b)
    before = [r.ctl.call("digests") for r in receivers]
    proc = mp.get_context("spawn").Process(target=crashing_sender, args=(
        [r.rpc.conn for r in receivers], free_port(), 4, sender.bucket_bytes))
    t0 = time.perf_counter()
    proc.start()
    try:
        proc.join(120)
        assert proc.exitcode == 17, "the sender did not die where planned"
        for r in receivers:  # the pending update_weights answers arrive on the RPC pipes
            assert r.rpc.conn.poll(30), "a receiver hangs after its sender died"
            status, message = r.rpc.conn.recv()
            # bucket 3 may still have been in flight (two buckets are): truncated at 3 or 4
            assert status == "err" and re.search(r"stream truncated at bucket [34]/", message), message
        print(f"[timing] sender death -> both receivers failed: {time.perf_counter() - t0:.1f} s "
              f"(incl. the sender's start-up)")
    finally:
        if proc.is_alive():
            proc.kill()
    assert [r.ctl.call("digests") for r in receivers] == before


def test_buckets_larger_than_a_piece_are_sealed_piece_by_piece_and_a_bad_middle_piece_is_caught():
    """Buckets over PIECE_BYTES travel as several broadcasts, each sealed as it is produced and as
    it arrives (the seal then equals the whole bucket's). A shared 9 MiB bucket (pieces of 4, 4
    and 1 MiB) and a 25 MiB tensor in 10 MiB chunks arrive byte-exact, without and with a secret
    (checksum and bucket MAC paths); one byte changed in the MIDDLE piece is refused, receivers
    unchanged."""
    from qstrat.transport.security.keys import ENV_SECRET
    from qstrat.transport.security.seal import PIECE_BYTES

    specs = [("a.weight", "uint8", ((9 << 20) - 4096,)), ("a.scale", "float32", (7,)),
             ("big.weight", "bfloat16", (25 << 19,)), ("c.weight", "bfloat16", (3, 5))]
    wm = build_wire_manifest(specs, bucket_bytes=10 << 20)
    sizes = [b.nbytes for b in wm.buckets]
    assert len(sizes) == 5 and sizes[0] > 2 * PIECE_BYTES and sizes[1:4] == [10 << 20, 10 << 20, 5 << 20], sizes
    secret = "a test secret of enough length"
    receivers = [Receiver("standalone", "") for _ in range(2)]
    try:
        for r in receivers:
            r.wait_ready()
        for keyed in (False, True):
            for r in receivers:
                r.ctl.call("setenv", ENV_SECRET, secret if keyed else None)
            first, second = tensors_for(specs, seed=1), tensors_for(specs, seed=2)

            def corrupt(bucket, piece, t):  # one byte inside the second of bucket 0's three pieces
                if (bucket, piece) != (0, 1):
                    return None
                bad = t.clone()
                bad[5] ^= 0x01
                return bad

            kw = dict(timeout_s=30, bucket_bytes=10 << 20, secret=secret if keyed else None)
            sender = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), **kw)
            sender.connect()
            sender.send(wm, iter(first))
            want = {n: sha256(t) for n, t in first}
            assert [r.ctl.call("digests") for r in receivers] == [want, want]
            tap = wrap_group(sender.group, wire=corrupt)
            with pytest.raises(TransportError) as err:
                sender.send(wm, iter(second))
            sender.group.pg = tap.pg
            msg = str(err.value)
            assert msg.count("bucket 0/5 failed its checksum (seal mismatch; tensors ['a.weight', 'a.scale'])") == 2, msg
            assert [r.ctl.call("digests") for r in receivers] == [want, want]
            sender.send(wm, iter(second))
            want = {n: sha256(t) for n, t in second}
            assert [r.ctl.call("digests") for r in receivers] == [want, want]
            sender.close()
    finally:
        for r in receivers:
            r.close()
