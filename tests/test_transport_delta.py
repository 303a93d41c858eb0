"""Delta rounds (``RefitSender(mode="delta")``, issue 34), without an engine.

Unit part (in process): a round's stream patched at densities from none to all decodes to the
exact bytes, each 32 KiB tile in its smallest encoding (rle, bitmap, raw) with the patch size
the format's description gives (an oracle in the test, not the encoder's cost function); tiles mixing every encoding and changes at tile edges; a patch that does
not fit its stream, or one that patches tiles without a base, is refused with the reason.

Transport part: this process is the trainer (rank 0), two spawned StandaloneReceivers are ranks
1 and 2 over gloo (tests/transport_harness.py), keyed rounds. Faults are injected from OUTSIDE
the production path: another sender (a restarted trainer), restarted receiver processes, a
receiver's base bytes flipped under its session (memory corruption), a wrapped process group
corrupting a bucket. Checked each time against the receivers' actual tensors (SHA-256 of every
tensor equal to ``RefitDriver.run``'s output) and the reason the sender reports.
"""
from __future__ import annotations

import pytest
import torch

from qstrat.errors import TransportError
from qstrat.transport import RefitSender
from qstrat.transport.delta import encoding as delta
from qstrat.transport.security.keys import ENV_SECRET
from qstrat.transport.wire_manifest import reload_unit

from transport_harness import EditingClient, connected_sender, counting_receivers, free_port, sha256, standalone_receivers
from transport_harness import held_digests as held, run_digests as want, sign_step as stepped

SECRET = "a shared secret for the delta tests"
BUCKET = 64 << 10
TIMEOUT_S = 20


# ---- the patch (in process) --------------------------------------------------------------------
T = delta.TILE


def patched(old, density, seed=7):
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    new[torch.rand(old.numel(), generator=g) < density] ^= 1
    return new


@pytest.mark.parametrize("density", [0.0, 1e-5, 4e-3, 0.05, 0.2, 0.5, 1.0])
def test_every_density_decodes_to_the_exact_bytes_each_tile_in_its_smallest_encoding(density):
    g = torch.Generator().manual_seed(3)
    old = torch.randint(0, 256, (9 * T,), dtype=torch.uint8, generator=g)
    new = patched(old, density)
    patch, tiles = delta.encode_patch(new, old)
    assert torch.equal(delta.decode_patch(patch, old, new.numel()), new)
    # The oracle, written from the format's description (not the encoder's cost function): per
    # tile with k changed bytes, rle = a uint16 run and a value per change, bitmap = one bit per
    # byte and a value per change, raw = the tile; the smallest, ties to the earlier of the three.
    want, body = {}, 0
    for tile in range(9):
        k = sum(1 for a, b in zip(new[tile * T:(tile + 1) * T].tolist(), old[tile * T:(tile + 1) * T].tolist())
                if a != b)
        sizes = {"rle": (2 + 1) * k, "bitmap": T // 8 + k, "raw": T}
        kind = min(sizes, key=lambda name: (sizes[name], ["rle", "bitmap", "raw"].index(name)))
        want[kind] = want.get(kind, 0) + 1
        body += sizes[kind]
    assert patch.numel() == 4 * 8 + 9 * (1 + 4) + body  # header, a kind byte and an int32 count per tile
    assert tiles == want


def test_tiles_mixing_every_encoding_and_changes_at_tile_edges_decode_exactly():
    old = torch.zeros(6 * T, dtype=torch.uint8)
    new = old.clone()
    new[[0, T - 1, T, 2 * T + 5, 3 * T - 1]] = 7          # rle tiles 0, 1, 2
    new[3 * T:4 * T:3] = 1                                 # 1/3 of tile 3 changed: bitmap
    new[4 * T:5 * T] = 9                                   # all of tile 4: raw
    patch, tiles = delta.encode_patch(new, old)             # tile 5 unchanged: rle, 0 bytes
    assert tiles == {"rle": 4, "bitmap": 1, "raw": 1}
    # 32 header + 6 kinds + 6 int32 counts; rle 3 bytes x 5 changes; bitmap 4096 + 10923 changes; raw 32768
    assert patch.numel() == 32 + 6 + 24 + 15 + (4096 + 10923) + 32768
    assert torch.equal(delta.decode_patch(patch, old, new.numel()), new)
    full, tiles = delta.encode_patch(new, None)
    assert tiles == {"raw": 6} and torch.equal(delta.decode_patch(full, None, new.numel()), new)


def test_a_patch_that_does_not_fit_or_lacks_its_base_is_refused_with_the_reason():
    old = torch.zeros(2 * T, dtype=torch.uint8)
    new = old.clone()
    new[[3, T + 100]] = 1
    patch, tiles = delta.encode_patch(new, old)
    assert tiles == {"rle": 2}
    with pytest.raises(delta.DeltaError, match=r"patches tiles, and this receiver holds no base stream"):
        delta.decode_patch(patch, None, 2 * T)
    with pytest.raises(delta.DeltaError, match=r"header .* does not fit a stream of 98304 bytes"):
        delta.decode_patch(patch, torch.zeros(3 * T, dtype=torch.uint8), 3 * T)
    with pytest.raises(delta.DeltaError, match=r"has \d+ bytes, its tile table says"):
        delta.decode_patch(patch[:-1], old, 2 * T)
    bad = patch.clone()
    bad[32 + 10:32 + 12] = 255  # the first rle token: a run of 65535 -> past its tile
    with pytest.raises(delta.DeltaError, match=r"run lengths past the end of their tile"):
        delta.decode_patch(bad, old, 2 * T)
    bad = patch.clone()
    bad[32] = 5  # tile 0's kind
    with pytest.raises(delta.DeltaError, match=r"tile kind or change count out of range"):
        delta.decode_patch(bad, old, 2 * T)


def test_a_hostile_delta_round_is_refused_before_its_allocation():
    """What a receiver allocates for a delta bucket is bounded by the bucket's tiles (an attack
    once declared a 4 TiB patch and the receiver allocated it): a prelude announcing more than
    the largest patch of its bucket closes the group before anything is allocated; a malformed
    update_info['delta'] is refused before the accept vote."""
    from qstrat.errors import WireManifestMismatchError
    from qstrat.transport.delta.receive import PatchDecoder, receive_patches
    from qstrat.transport.delta.stream import encode_round
    from qstrat.transport.security.seal import Sealer
    from qstrat.transport.wire_manifest import build_wire_manifest

    target = build_wire_manifest([("w", "uint8", (T + 5,))], BUCKET, 16)
    enc, payloads = encode_round(target, iter([("w", torch.ones(T + 5, dtype=torch.uint8))]), None)
    decoder = PatchDecoder(enc.info, target, None, None, bytes(32))
    assert len(payloads) == 1 and payloads[0].numel() <= decoder.limit(0) == delta.patch_limit(2)
    assert delta.patch_limit(2) == 32 + 32 + 5 * 2 + 3 * 2 * T  # digest, patch header, tile table, rle of every byte
    over = decoder.limit(0) + 1

    class Announcing:  # rank 1's view of a sender announcing ``over`` bytes
        rank, world_size, device, timeout_s, closed = 1, 2, torch.device("cpu"), 1.0, False

        def broadcast(self, t):
            t.copy_(torch.tensor([0x5153_5450_4348, 0, over, 0]))
            return None

        def wait(self, work):
            pass

        def close(self):
            self.closed = True

    group = Announcing()
    with pytest.raises(TransportError, match=rf"bucket 0/1: the sender announced a delta payload of {over} bytes "
                                             rf".*at most {over - 1}\): nothing allocated"):
        receive_patches(group, target, Sealer(None, bytes(32), torch.device("cpu")), decoder, {})
    assert group.closed
    for bad in (None, {"round": 5}, {"round": "r", "base": 7}, {"round": "x" * 65}):
        with pytest.raises(WireManifestMismatchError, match=r"a delta round needs update_info\['delta'\]"):
            delta.check_info(bad)


def test_the_bucket_by_bucket_encoder_gives_the_whole_streams_bytes_and_every_byte_is_written():
    """The pipelined encoder (fill, compare, patch and digest one bucket at a time) writes the
    stream stream_of makes, each bucket's patch covers whole tiles (a tile straddling two
    buckets goes with the later one), and a receiver rebuilds the exact tensors bucket by bucket.
    The layout has alignment gaps, a tensor chunked over buckets, buckets that end off a word
    boundary and tail padding; fill_stream into a buffer of stale bytes writes every byte (gaps
    and padding zero, as in a new stream)."""
    from qstrat.transport.delta.receive import PatchDecoder
    from qstrat.transport.delta.stream import encode_round
    from qstrat.transport.wire_manifest import build_wire_manifest

    g = torch.Generator().manual_seed(5)
    shapes = {"a": (1000,), "big": (3 * BUCKET + 7,), "b": (33,), "c": (5, 9)}
    old = {n: torch.randint(0, 256, s, dtype=torch.uint8, generator=g) for n, s in shapes.items()}
    new = {n: patched(t.reshape(-1), 0.01, seed=i).reshape(t.shape) for i, (n, t) in enumerate(old.items())}
    target = build_wire_manifest([(n, "uint8", s) for n, s in shapes.items()], BUCKET, 16)
    assert any((b.stream_offset + b.nbytes) % 8 for b in target.buckets)  # a bucket ends off a word
    first, _ = encode_round(target, iter(old.items()), None)
    assert first.kind == "full" and torch.equal(first.stream, delta.stream_of(target, old.items()))
    base = first.new_base()
    rnd, payloads = encode_round(target, iter(new.items()), base)
    assert torch.equal(rnd.stream, delta.stream_of(target, new.items())) and rnd.kind == "delta"
    cuts = delta.cuts(target)
    assert cuts[0] == 0 and cuts[-1] == rnd.stream.numel() and all(c % T == 0 for c in cuts)
    assert all(c <= b.stream_offset + b.nbytes for c, b in zip(cuts[1:-1], target.buckets))
    # each payload: the digest, then the patch of its tiles (the oracle: encode_patch of that range)
    for k, p in enumerate(payloads):
        lo, hi = cuts[k], cuts[k + 1]
        assert torch.equal(p[32:], delta.encode_patch(rnd.stream[lo:hi], base.stream[lo:hi])[0])
    assert rnd.wire_bytes == sum(p.numel() for p in payloads) < target.total_bytes / 4
    decoder = PatchDecoder(rnd.info, target, base, None, bytes(32))
    for k, p in enumerate(payloads):
        decoder.apply(k, p)
    assert {n: sha256(t) for n, t in decoder.staged()} == {n: sha256(t) for n, t in new.items()}
    assert decoder.new_base.round_id == rnd.info["round"] and torch.equal(decoder.new_base.stream, rnd.stream)
    stale = torch.full_like(base.stream, 0xA5)
    assert delta.fill_stream(target, new.items(), stale) is stale and torch.equal(stale, rnd.stream)
    with pytest.raises(TransportError, match=r"a stream buffer of \d+ bytes is needed, this one is \(8,\)"):
        delta.fill_stream(target, new.items(), torch.zeros(8, dtype=torch.uint8))


@pytest.mark.parametrize("where", ["digest", "patch", "base"])
def test_a_corrupted_bucket_k_is_caught_by_its_own_digest_naming_its_tensors(where):
    """Per-bucket digests: bucket k's rebuilt bytes are checked before bucket k+1 is taken. A
    flipped byte in bucket k's digest, in its patch's new values, or in the receiver's base
    under bucket k's tiles, is caught at bucket k - a DeltaError with status DELTA naming the
    bucket and its tensors (the sender then sends the round whole) - the buckets before it
    rebuilt exactly, and the decoder drops the receiver's base (out of step)."""
    from qstrat.transport.delta.receive import PatchDecoder
    from qstrat.transport.delta.stream import encode_round
    from qstrat.transport.protocol import DELTA
    from qstrat.transport.wire_manifest import build_wire_manifest

    g = torch.Generator().manual_seed(9)
    shapes = {f"t{i}": (3 * T + 11 * i,) for i in range(6)}
    old = {n: torch.randint(0, 256, s, dtype=torch.uint8, generator=g) for n, s in shapes.items()}
    new = {n: patched(t, 0.001, seed=i) for i, (n, t) in enumerate(old.items())}
    target = build_wire_manifest([(n, "uint8", s) for n, s in shapes.items()], 4 * T, 16)
    base = encode_round(target, iter(old.items()), None)[0].new_base()
    rnd, payloads = encode_round(target, iter(new.items()), base, None, b"m" * 32)
    k = 3
    lo, hi = delta.cuts(target)[k:k + 2]
    names = delta.region_names(target, lo, hi)
    assert names and hi > lo
    if where == "digest":
        payloads[k][5] ^= 1
    elif where == "patch":
        payloads[k][-1] ^= 1  # the last rle value
    else:
        base = delta.Base(base.round_id, base.target, base.stream.clone())
        base.stream[lo + 100] ^= 1
    dropped = []
    decoder = PatchDecoder(rnd.info, target, base, None, b"m" * 32, lambda: dropped.append(True))
    for j in range(k):
        decoder.apply(j, payloads[j])
        assert torch.equal(decoder.stream[delta.cuts(target)[j]:delta.cuts(target)[j + 1]],
                           rnd.stream[delta.cuts(target)[j]:delta.cuts(target)[j + 1]])
    with pytest.raises(delta.DeltaError, match=rf"bucket {k} \({names}\): the rebuilt bytes' digest differs from "
                                               r"the trainer's") as err:
        decoder.apply(k, payloads[k])
    assert err.value.vote_status == DELTA and dropped == [True]
    other = PatchDecoder(rnd.info, target, base, None, b"n" * 32)  # another round MAC: other digests
    with pytest.raises(delta.DeltaError, match=r"bucket 0 "):
        other.apply(0, payloads[0])


def test_a_rebuild_into_the_spare_copies_only_the_last_patchs_bytes_and_a_stale_spare_is_caught():
    """Round 3 is rebuilt into round 1's stream (the spare): only the bytes round 2's patch
    changed (rle positions; raw and bitmap tiles whole) are copied from the base (``catch_up``), then round
    3's patch - the exact stream.
    A spare with one byte off where neither patch wrote (a memory fault, a loader writing into a
    view) fails that bucket's digest (status DELTA), naming the bucket; a spare of another round
    (``spare_round`` not the base's parent) is not trusted: the base's regions are copied whole."""
    from qstrat.transport.delta.receive import PatchDecoder
    from qstrat.transport.delta.stream import encode_round
    from qstrat.transport.protocol import DELTA
    from qstrat.transport.wire_manifest import build_wire_manifest

    g = torch.Generator().manual_seed(11)
    shapes = {f"t{i}": (2 * T + 13 * i,) for i in range(5)}
    r1 = {n: torch.randint(0, 256, s, dtype=torch.uint8, generator=g) for n, s in shapes.items()}
    dense = {"t1": 1.0, "t3": 0.3}  # round 2: raw tiles, bitmap tiles, rle tiles
    r2 = {n: patched(t, dense.get(n, 0.002), seed=i) for i, (n, t) in enumerate(r1.items())}
    r3 = {n: patched(t, 0.3 if n == "t2" else 0.002, seed=10 + i) for i, (n, t) in enumerate(r2.items())}
    target = build_wire_manifest([(n, "uint8", s) for n, s in shapes.items()], 3 * T, 16)
    e1, _ = encode_round(target, iter(r1.items()), None)
    rebuilt1 = e1.stream.clone()  # the receiver's stream of round 1 (the spare of round 3)

    def rebuild(enc, payloads, base, spare=None, spare_round=None):
        dec = PatchDecoder(enc.info, target, base, None, bytes(32), spare=spare, spare_round=spare_round)
        for k, p in enumerate(payloads):
            dec.apply(k, p)
        dec.staged()
        return dec

    e2, p2 = encode_round(target, iter(r2.items()), e1.new_base())
    base2 = rebuild(e2, p2, delta.Base(e1.info["round"], target.digest, rebuilt1)).new_base
    assert base2.parent == e1.info["round"] and len(base2.changes) == len(target.buckets)
    assert e2.tiles.keys() == {"raw", "bitmap", "rle"}
    assert sum(c.tiles.numel() for c in base2.changes) == e2.tiles["raw"] + e2.tiles["bitmap"]
    e3, p3 = encode_round(target, iter(r3.items()), e2.new_base())
    assert "raw" in e3.tiles or "bitmap" in e3.tiles  # t2 moved a lot: tiles beyond rle
    dec = rebuild(e3, p3, base2, rebuilt1.clone(), e1.info["round"])
    assert dec.catch_up is base2.changes and torch.equal(dec.stream, e3.stream)
    untrusted = rebuild(e3, p3, base2, rebuilt1.clone(), "another round")
    assert untrusted.catch_up is None and torch.equal(untrusted.stream, e3.stream)
    stale = rebuilt1.clone()
    cuts = delta.cuts(target)
    same = torch.nonzero((e1.stream == e2.stream) & (e2.stream == e3.stream)).reshape(-1)
    at = int(same[same >= cuts[-2]][0])  # under the last bucket
    stale[at] ^= 0x40
    bad = PatchDecoder(e3.info, target, base2, None, bytes(32), spare=stale, spare_round=e1.info["round"])
    last = len(p3) - 1
    for k in range(last):
        bad.apply(k, p3[k])
    with pytest.raises(delta.DeltaError, match=rf"bucket {last} \(.*\): the rebuilt bytes' digest differs") as err:
        bad.apply(last, p3[last])
    assert err.value.vote_status == DELTA


# ---- rounds over the transport ----------------------------------------------------------------
@pytest.fixture(scope="module")
def receivers(tiny):
    with counting_receivers(tiny[3], SECRET) as rs:
        yield rs


def sender_for(receivers, mode="delta", clients=None):
    return connected_sender(receivers, mode, SECRET, BUCKET, TIMEOUT_S, clients)


def loads(receivers):
    return [r.ctl.call("loads") for r in receivers]


def load_calls(receivers, wire_manifest, mode):
    """Per receiver, each load call's reload units since the last query, and what a committed
    round of ``mode`` makes: one call per unit in wire order (bounded delta), else one call."""
    got = [[sorted({reload_unit(n) for n in names}) for names in r.ctl.call("load_calls")] for r in receivers]
    units = list(dict.fromkeys(reload_unit(s.name) for s in wire_manifest.slots))
    return got, [[[u] for u in units] if mode == "bounded-delta" else [sorted(units)]] * len(receivers)


@pytest.mark.parametrize("mode", ["delta", "bounded-delta"])
def test_first_round_is_whole_then_deltas_give_the_exact_tensors_in_fewer_bytes(receivers, tiny, mode):
    """Delta and bounded delta: a whole round, then deltas of under half its bytes, exact every
    step, each loaded once (atomic: one load; bounded delta: one load per unit, in wire order)."""
    driver, _, trainer, _ = tiny
    sender = sender_for(receivers, mode)
    for r in receivers:
        r.ctl.call("load_calls")
    first = sender.refit(driver, trainer)
    assert first.delta.kind == "full" and first.delta.reason.startswith("no base")
    assert held(receivers) == [want(driver, trainer)] * 2
    got, made = load_calls(receivers, first.wire_manifest, mode)
    assert got == made
    base_ids = {r.ctl.call("delta_base") for r in receivers}
    assert base_ids == {sender.base.round_id}
    for step in range(2):
        trainer = stepped(trainer, 1e-5, step)
        report = sender.refit(driver, trainer)
        d = report.delta
        assert d.kind == "delta" and d.reason is None and d.attempts == 1, d
        assert d.wire_bytes == report.bytes < d.full_bytes / 2, d
        # quantized incrementally (qstrat.transport.delta.requantize), every entry: still exact below
        assert d.requantize["incremental"] > 0 and not any(k.startswith("whole:") for k in d.requantize), d
        # the requantized tensors came from its write log: only the passthrough ones copied whole
        passthrough = sum(s.nbytes for s in report.wire_manifest.slots if s.dtype in ("bfloat16", "float32")
                          and not s.name.endswith("scale_inv"))
        assert 0 < d.copied_whole <= passthrough < d.full_bytes, (d.copied_whole, passthrough)
        assert held(receivers) == [want(driver, trainer)] * 2
        assert [r.ctl.call("delta_base") for r in receivers] == [sender.base.round_id] * 2
        got, made = load_calls(receivers, report.wire_manifest, mode)
        assert got == made
        assert [r.ctl.call("mixed") for r in receivers] == [None, None]
    sender.close()


def whole_payload(target) -> int:
    """The payload bytes of ``target``'s round sent whole: per bucket its digest, patch header,
    tile table and raw tiles."""
    tiles = [(hi - lo) // delta.TILE for lo, hi in zip(delta.cuts(target), delta.cuts(target)[1:])]
    return sum(delta.DIGEST_BYTES + 32 + 5 * t + t * delta.TILE for t in tiles)


@pytest.mark.parametrize("mode", ["delta", "bounded-delta"])
def test_a_base_from_another_trainer_turns_the_round_whole_with_the_reason(receivers, tiny, mode):
    """Trainer 1 holds base r1; a restarted trainer 2 refits (whole: no base) -> the engines hold
    r2. Trainer 1's next delta (against r1) is refused in the accept vote, before any data, and
    sent again whole; the engines hold exactly its round, and loaded only it (bounded delta: one
    load per reload unit, nothing before the whole round)."""
    driver, trainer_a, trainer_b, _ = tiny
    one = sender_for(receivers, mode)
    one.refit(driver, trainer_a)
    one.close()
    two = sender_for(receivers, mode)
    assert two.refit(driver, trainer_b).delta.reason.startswith("no base")
    two.close()
    before = loads(receivers)
    one.connect()
    report = one.refit(driver, stepped(trainer_a, 1e-5, 1))
    d = report.delta
    assert d.kind == "full" and d.attempts == 2, d
    assert "the engines refused the delta: delta refused before any data" in d.reason, d.reason
    assert d.wire_bytes == report.bytes == whole_payload(report.wire_manifest)  # the delta sent nothing
    assert "rank 1 does not hold the delta round's base" in d.reason and "rank 2 does not hold" in d.reason
    assert held(receivers) == [want(driver, stepped(trainer_a, 1e-5, 1))] * 2
    per_round = len({reload_unit(s.name) for s in report.wire_manifest.slots}) if mode == "bounded-delta" else 1
    assert [a - b for a, b in zip(loads(receivers), before)] == [per_round] * 2  # the whole round only
    one.close()


def test_a_round_in_another_mode_in_between_drops_the_base(receivers, tiny):
    """A partial atomic refit between two delta rounds: the engines' weights moved outside the
    delta's bookkeeping, so they drop their base and the next delta round goes whole."""
    driver, trainer_a, trainer_b, _ = tiny
    sender = sender_for(receivers)
    sender.refit(driver, trainer_a)
    sender.close()
    partial = sender_for(receivers, "atomic")
    partial.refit(driver, trainer_b, plan=driver.plan(trainer_b).only_layers([0]))
    partial.close()
    assert [r.ctl.call("delta_base") for r in receivers] == [None, None]
    sender.connect()
    trainer = stepped(trainer_a, 1e-5, 5)
    d = sender.refit(driver, trainer).delta
    assert d.kind == "full" and d.attempts == 2, d
    assert "rank 1 does not hold the delta round's base" in d.reason, d.reason
    assert held(receivers) == [want(driver, trainer)] * 2
    sender.close()


def test_a_corrupted_base_is_refused_before_loading_and_the_round_sent_whole(receivers, tiny):
    """Rank 2's base has a flipped bit in its first tensor: the rebuilt bucket's digest differs
    from the trainer's, so rank 2 refuses in the commit vote, NOTHING is loaded anywhere (the
    load counters move by one: the whole round that follows), and the engines end exact."""
    driver, trainer_a, _, _ = tiny
    sender = sender_for(receivers)
    sender.refit(driver, trainer_a)
    receivers[1].ctl.call("corrupt_base")
    before = loads(receivers)
    trainer = stepped(trainer_a, 1e-5, 2)
    report = sender.refit(driver, trainer)
    d = report.delta
    assert d.kind == "full" and d.attempts == 2, d
    assert "delta refused, nothing loaded: rank 2 did not reconstruct the delta round to the trainer's digests" \
        in d.reason, d.reason
    # both attempts went on the wire: the refused delta's payloads, then the whole round's
    assert d.wire_bytes == report.bytes > whole_payload(report.wire_manifest), d
    assert [a - b for a, b in zip(loads(receivers), before)] == [1, 1]
    assert held(receivers) == [want(driver, trainer)] * 2
    sender.close()


def test_a_base_corrupted_under_a_later_bucket_is_caught_by_that_buckets_digest_and_sent_whole(receivers, tiny):
    """Per-bucket digests over the transport: rank 1's base has a flipped byte under the tiles of
    a bucket in the middle of the round; that bucket's digest (checked as it arrives, the
    buckets before it rebuilt) refuses the delta in the commit vote naming the bucket, nothing is
    loaded anywhere, the round is sent again whole and both engines end exact."""
    driver, trainer_a, _, _ = tiny
    sender = sender_for(receivers)
    target = sender.refit(driver, trainer_a).wire_manifest
    k = len(target.buckets) // 2
    lo = delta.cuts(target)[k]
    receivers[0].ctl.call("corrupt_base", lo + 7)
    before = loads(receivers)
    trainer = stepped(trainer_a, 1e-5, 6)
    d = sender.refit(driver, trainer).delta
    assert d.kind == "full" and d.attempts == 2, d
    assert "delta refused, nothing loaded: rank 1 did not reconstruct the delta round to the trainer's digests" \
        in d.reason and "rank 2 did not" not in d.reason, d.reason
    assert f"bucket {k} (" in d.reason and "the rebuilt bytes' digest differs" in d.reason, d.reason
    assert [a - b for a, b in zip(loads(receivers), before)] == [1, 1]
    assert held(receivers) == [want(driver, trainer)] * 2
    sender.close()


def test_a_senders_base_changed_in_its_memory_is_caught_and_the_round_sent_whole(receivers, tiny):
    """The sender's digests come from the row sums it kept for its base plus the changed words
    (qstrat.transport.delta.digest): a byte of its base flipped in memory after the round, where
    the next round's byte is not that flipped value, makes a digest no receiver's bytes give, so
    the delta is refused in the commit vote, nothing is loaded, the round goes again whole and
    both engines end exact (the flipped-to-the-next-value case, which is not caught:
    tests/test_attacks_delta_speed2.py)."""
    driver, trainer_a, _, _ = tiny
    sender = sender_for(receivers)
    sender.refit(driver, trainer_a)
    sender.delta_rounds.base.stream[123] ^= 0x04
    before = loads(receivers)
    trainer = stepped(trainer_a, 1e-5, 4)
    d = sender.refit(driver, trainer).delta
    assert d.kind == "full" and d.attempts == 2, d
    assert "did not reconstruct the delta round to the trainer's digests" in d.reason, d.reason
    assert [a - b for a, b in zip(loads(receivers), before)] == [1, 1]
    assert held(receivers) == [want(driver, trainer)] * 2
    d = sender.refit(driver, stepped(trainer, 1e-5, 5)).delta  # the whole round's sums describe its stream
    assert d.kind == "delta" and d.attempts == 1, d
    sender.close()


def test_a_trainer_speaking_the_old_delta_wire_format_is_refused_before_any_data(receivers, tiny):
    """Protocol 3 changed a delta round's wire format (one patch per bucket instead of two blobs
    after the whole round): an update_info naming protocol 2 (an older trainer) is refused in the
    accept vote with both versions named, and nothing is loaded."""
    driver, trainer_a, _, _ = tiny
    sender = sender_for(receivers)
    sender.refit(driver, trainer_a)
    sender.close()

    def older(method, args):
        if method == "update_weights":
            args[0]["protocol"] = 2
        return args

    old = sender_for(receivers, clients=[receivers[0].rpc, EditingClient(receivers[1].rpc, older)])
    old.delta_rounds.base = sender.base
    before = loads(receivers)
    with pytest.raises(TransportError) as err:
        old.refit(driver, stepped(trainer_a, 1e-5, 7))
    msg = str(err.value)
    assert "round refused before any data: rank 2 speaks another transport protocol version (this qstrat: 3)" in msg
    assert "update_info names transport protocol 2, this engine speaks 3" in msg, msg
    assert loads(receivers) == before and held(receivers) == [want(driver, trainer_a)] * 2
    old.close()


def test_a_corrupted_bucket_in_a_delta_round_loads_nothing_and_the_next_round_is_whole(receivers, tiny):
    driver, trainer_a, _, _ = tiny
    sender = sender_for(receivers)
    sender.refit(driver, trainer_a)
    receivers[0].ctl.call("inject", {"corrupt_bucket": 0})
    before = loads(receivers)
    with pytest.raises(TransportError, match=r"rank 1 a bucket failed its checksum.*nothing loaded"):
        sender.refit(driver, stepped(trainer_a, 1e-5, 3))
    assert loads(receivers) == before and held(receivers) == [want(driver, trainer_a)] * 2
    assert sender.base is None
    sender.connect()  # a new group (the wrapped one is dropped)
    d = sender.refit(driver, stepped(trainer_a, 1e-5, 3)).delta
    assert d.kind == "full" and d.reason.startswith("no base") and d.attempts == 1
    # nothing of the failed round is trusted: every entry was quantized whole again
    assert "incremental" not in d.requantize and d.requantize["whole:first round"] > 0, d.requantize
    assert held(receivers) == [want(driver, stepped(trainer_a, 1e-5, 3))] * 2
    sender.close()


def test_restarted_receivers_get_a_whole_round(tiny):
    driver, trainer_a, _, ckpt = tiny
    with standalone_receivers(ckpt, n=1, env={ENV_SECRET: SECRET}) as first:
        sender = sender_for(first)
        sender.refit(driver, trainer_a)
        sender.close()
    with standalone_receivers(ckpt, n=1, env={ENV_SECRET: SECRET}) as restarted:
        sender.clients = [r.rpc for r in restarted]
        sender.connect()
        trainer = stepped(trainer_a, 1e-5, 4)
        d = sender.refit(driver, trainer).delta
        assert d.kind == "full" and d.attempts == 2, d
        assert "rank 1 does not hold the delta round's base" in d.reason, d.reason
        assert held(restarted) == [want(driver, trainer)]
        sender.close()


def test_a_delta_sender_refuses_send_and_an_unknown_mode_is_named():
    from qstrat.errors import ConfigError, TransportConfigError
    from qstrat.transport.mesh.refit import MeshRefitSender

    with pytest.raises(TransportError, match=r"mode 'sparse': use 'atomic', 'bounded', 'delta' or 'bounded-delta'") as bad:
        RefitSender([], "127.0.0.1", 1, mode="sparse")
    assert isinstance(bad.value, TransportConfigError) and isinstance(bad.value, ConfigError)  # a bad argument
    with pytest.raises(ConfigError, match=r"MeshRefitSender mode 'bounded-delta': use 'atomic', 'bounded' or 'delta'"):
        MeshRefitSender(0, 1, "127.0.0.1", 1, mode="bounded-delta")
    with pytest.raises(TransportConfigError, match=r"MeshRefitSender: rank 2 of 2 senders"):
        MeshRefitSender(2, 2, "127.0.0.1", 1)
    s = RefitSender([], "127.0.0.1", 1, mode="delta")
    with pytest.raises(TransportError, match=r"a delta-mode sender sends through refit\(\)"):
        s.send(None, iter(()))


def test_the_delta_bucket_floor_applies_to_the_delta_modes_only_rounds_to_the_alignment_and_bad_values_are_named():
    """``delta_min_bucket_bytes`` (default 16 MiB) raises a delta-mode sender's bucket bound, not
    another mode's; 0 keeps ``bucket_bytes``; a floor off the alignment is rounded up to it; a
    ``bucket_bytes`` the wire manifest refuses is left for its check to name; a floor that is not
    an int >= 0 is refused at construction, naming the key and the value."""
    from qstrat.errors import TransportConfigError
    from qstrat.transport.delta.rounds import DELTA_MIN_BUCKET_BYTES, delta_bucket_bytes
    from qstrat.transport.mesh.refit import MeshRefitSender

    import numpy as np

    assert DELTA_MIN_BUCKET_BYTES == 16 << 20
    for mode, want in (("atomic", 1 << 20), ("bounded", 1 << 20), ("delta", 16 << 20), ("bounded-delta", 16 << 20)):
        assert RefitSender([], "127.0.0.1", 1, bucket_bytes=1 << 20, mode=mode).layout_bucket_bytes == want, mode
        assert RefitSender([], "127.0.0.1", 1, bucket_bytes=1 << 20, mode=mode,
                           delta_min_bucket_bytes=0).layout_bucket_bytes == 1 << 20, mode
    for mode, want in (("atomic", 1 << 20), ("bounded", 1 << 20), ("delta", 16 << 20)):
        assert MeshRefitSender(0, 1, "127.0.0.1", 1, bucket_bytes=1 << 20, mode=mode).layout_bucket_bytes == want
    assert MeshRefitSender(0, 1, "127.0.0.1", 1, bucket_bytes=1 << 20, mode="delta",
                           delta_min_bucket_bytes=0).layout_bucket_bytes == 1 << 20
    assert RefitSender([], "127.0.0.1", 1, bucket_bytes=64 << 20, mode="delta").layout_bucket_bytes == 64 << 20
    assert delta_bucket_bytes(512, 1000, 256) == 1024  # the floor rounded up to the alignment
    assert delta_bucket_bytes(64 << 10, 1000, 64) == 64 << 10  # above the floor: as given
    assert delta_bucket_bytes(1000, 16 << 20, 64) == 1000  # not a multiple of the alignment: left to its check
    assert delta_bucket_bytes(-64, 16 << 20, 64) == -64
    assert delta_bucket_bytes(np.int64(1 << 20), 16 << 20, 64) == 16 << 20  # a NumPy bucket_bytes is raised too
    s = RefitSender([], "127.0.0.1", 1, bucket_bytes=1 << 20, mode="delta", delta_min_bucket_bytes=np.int64(4 << 20))
    assert s.layout_bucket_bytes == 4 << 20 and type(s.delta_min_bucket_bytes) is int  # a NumPy integer is one
    mesh = MeshRefitSender(0, 1, "127.0.0.1", 1, bucket_bytes=1 << 20, mode="delta")
    for bad in (-1, 1.5, True, "16", None):
        with pytest.raises(TransportConfigError, match=rf"^RefitSender delta_min_bucket_bytes={bad!r}: give an int >= 0"):
            RefitSender([], "127.0.0.1", 1, mode="delta", delta_min_bucket_bytes=bad)
        with pytest.raises(TransportConfigError, match=rf"^MeshRefitSender delta_min_bucket_bytes={bad!r}: give an int"):
            MeshRefitSender(0, 1, "127.0.0.1", 1, mode="delta", delta_min_bucket_bytes=bad)
        with pytest.raises(TransportConfigError, match=rf"^RefitSender delta_min_bucket_bytes={bad!r}: give an int"):
            s.delta_min_bucket_bytes = bad  # set between rounds: checked the same
        with pytest.raises(TransportConfigError, match=rf"^MeshRefitSender delta_min_bucket_bytes={bad!r}: give an int"):
            mesh.delta_min_bucket_bytes = bad
    assert s.layout_bucket_bytes == 4 << 20 and mesh.layout_bucket_bytes == 16 << 20  # unchanged by the refusals


def test_a_bucket_bytes_the_wire_manifest_refuses_is_named_in_delta_mode_too(tiny):
    """The floor does not hide a bad ``bucket_bytes``: 1000 bytes (not a multiple of the 64-byte
    alignment) is refused before anything is sent, naming it, as in atomic mode."""
    from qstrat.errors import WireManifestMismatchError

    driver, trainer, _, _ = tiny
    for mode in ("atomic", "delta"):
        s = RefitSender([], "127.0.0.1", 1, bucket_bytes=1000, mode=mode)
        with pytest.raises(WireManifestMismatchError, match=r"bucket_bytes 1000: must be a positive multiple of the "
                                                            r"alignment \(64\)"):
            s.refit(driver, trainer)


def test_by_default_delta_rounds_are_laid_out_with_16_mib_buckets_and_stay_exact(receivers, tiny):
    """A delta sender given the tests' 64 KiB ``bucket_bytes`` and the default floor lays its
    rounds out with buckets of up to 16 MiB - the tiny model's ~5 MB in one bucket - and the
    receivers follow that layout from ``update_info``: the first round whole, the next a delta of
    under a fifth of its bytes, both exact. An atomic sender with the same arguments keeps 64 KiB
    buckets (many per round)."""
    driver, _, trainer, _ = tiny
    sender = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=TIMEOUT_S,
                         bucket_bytes=BUCKET, secret=SECRET, mode="delta")
    sender.connect()
    try:
        first = sender.refit(driver, trainer)
        wm = first.wire_manifest
        assert wm.total_bytes < 16 << 20 and wm.bucket_bytes == 16 << 20 and len(wm.buckets) == 1, wm.bucket_bytes
        assert first.delta.kind == "full" and held(receivers) == [want(driver, trainer)] * 2
        trainer = stepped(trainer, 1e-5, 5)
        second = sender.refit(driver, trainer)
        assert second.wire_manifest.digest == wm.digest and second.buckets == 1
        assert second.delta.kind == "delta" and second.delta.wire_bytes < second.delta.full_bytes / 5, second.delta
        assert held(receivers) == [want(driver, trainer)] * 2
    finally:
        sender.close()
    atomic = RefitSender([r.rpc for r in receivers], "127.0.0.1", free_port(), timeout_s=TIMEOUT_S,
                         bucket_bytes=BUCKET, secret=SECRET)
    atomic.connect()
    try:
        report = atomic.refit(driver, trainer)
        assert report.wire_manifest.bucket_bytes == BUCKET and len(report.wire_manifest.buckets) > 1
        assert held(receivers) == [want(driver, trainer)] * 2
    finally:
        atomic.close()


def _nan_in_last_layer(trainer):
    name = max((n for n in trainer if n.endswith("self_attn.o_proj.weight")), key=lambda n: int(n.split(".")[2]))
    bad = dict(trainer)
    bad[name] = trainer[name].clone()
    bad[name][0, 0] = float("nan")
    return bad, name


def test_a_warm_round_refused_before_any_data_keeps_the_base_and_the_next_round_is_a_delta(receivers, tiny):
    """A warm round that no engine took - a NaN the stream finds while encoding (nothing sent),
    a round of another plan refused in the accept vote (before any data) - dropped the sender's
    base although every engine still held it: the next round went whole, "no base" (issue 42).
    Now the base stays: the next round is a delta of the engines' base, its bytes a delta's."""
    from qstrat import NonFiniteError, RefitDriver
    from qstrat.errors import WireManifestMismatchError

    driver, trainer_a, _, _ = tiny
    sender = sender_for(receivers)
    sender.refit(driver, trainer_a)
    base_id = sender.base.round_id
    trainer = stepped(trainer_a, 1e-5, 8)
    bad, name = _nan_in_last_layer(trainer)
    before = loads(receivers)
    with pytest.raises(NonFiniteError, match=name.replace(".", r"\.")):
        sender.refit(driver, bad)
    assert sender.base is not None and sender.base.round_id == base_id
    other = RefitDriver("mxfp8-experts", hf_config=driver.hf_config)
    with pytest.raises(WireManifestMismatchError):
        sender.refit(other, trainer)
    assert sender.base is not None and sender.base.round_id == base_id
    assert loads(receivers) == before and held(receivers) == [want(driver, trainer_a)] * 2
    report = sender.refit(driver, trainer)
    d = report.delta
    assert d.kind == "delta" and d.reason is None and d.attempts == 1, d
    assert d.wire_bytes == report.bytes < d.full_bytes / 2, d
    assert held(receivers) == [want(driver, trainer)] * 2
    sender.close()
