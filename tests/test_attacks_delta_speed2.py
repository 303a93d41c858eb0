"""Attacks on the delta sender's second speed pass: the look-ahead source started before the
engines' accept vote (PatchEncoder.begin, LookAhead.start, PatchEncoder.whole), the sender's
digests from kept row sums (qstrat.transport.delta.digest), and the compare that updates the
requantizer's kept input (changed_values(update=True)).

Oracles: a receiver's PatchDecoder (its full read of every rebuilt byte), delta.stream_of (the
whole stream), checksum.row_sums of each region, a brute-force compare."""
from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from qstrat.errors import WireManifestMismatchError
from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.ahead import LookAhead
from qstrat.transport.delta.digest import RegionDigests
from qstrat.transport.delta.encoding import bits_view, changed_values
from qstrat.transport.delta.receive import PatchDecoder
from qstrat.transport.delta.rounds import DeltaRounds
from qstrat.transport.security import checksum as cs
from qstrat.transport.wire_manifest import build_wire_manifest

MAC = bytes(range(32))


def _tensors(seed: int, sizes=(70_000, 5, 200_000, 33_000, 1, 131_072)) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"t{i}", torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)) for i, n in enumerate(sizes)]


def _stepped(tensors, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in tensors:
        t = t.clone()
        t[torch.randint(0, t.numel(), (max(1, t.numel() // 500),), generator=g)] += 1
        out.append((name, t))
    return out


def _manifest(tensors, bucket_bytes=64 * 1024):
    return build_wire_manifest([(n, "uint8", tuple(t.shape)) for n, t in tensors], bucket_bytes)


class Engine:
    """One receiver in process: the accept vote (its base against the round's) and every
    bucket rebuilt and checked by a PatchDecoder (a full read of each region)."""

    def __init__(self) -> None:
        self.base: delta.Base | None = None
        self.loads, self.refuse_accept, self.before_accept = 0, None, None

    def send(self, enc, extra):
        info = extra["delta"]
        if self.before_accept is not None:
            hook, self.before_accept = self.before_accept, None
            hook()
        if self.refuse_accept is not None:
            exc, self.refuse_accept = self.refuse_accept, None
            raise exc
        if info["base"] is not None and (self.base is None or self.base.round_id != info["base"]):
            raise delta.DeltaRefused("stale base")
        enc.start(None, MAC)
        dec = PatchDecoder(info, enc.target, self.base, None, MAC)
        failed = None
        for k in range(len(enc.target.buckets)):  # the whole stream, then the commit vote
            payload = enc.payload(k)
            if failed is None:
                try:
                    dec.apply(k, payload)
                except delta.DeltaError as exc:
                    failed = exc
        if failed is not None:
            raise delta.DeltaRefused(f"did not reconstruct: {failed}")
        dec.staged()
        self.base = dec.new_base
        self.loads += 1
        return SimpleNamespace(wire_manifest=enc.target, buckets=len(enc.target.buckets), stream_seconds=0.0)


def _sums_describe(base: delta.Base, target) -> bool:
    """Whether the base's kept row sums are those of its stream's regions (a full read)."""
    seed, rows = base.row_sums
    cuts = delta.cuts(target)
    for k, kept in enumerate(rows):
        region = base.stream[cuts[k]:cuts[k + 1]]
        if kept is None:
            if region.numel():
                return False
            continue
        if not all(torch.equal(a, b) for a, b in zip(kept, cs.row_sums(region, seed))):
            return False
    return len(rows) == len(cuts) - 1


def _slow(tensors, delay_s: float, log: list, fail_at: int | None = None, gate: threading.Event | None = None):
    for i, (name, t) in enumerate(tensors):
        if gate is not None and i == 2:
            gate.wait(10)
        time.sleep(delay_s)
        if fail_at == i:
            raise ValueError(f"quantizing {name} failed")
        log.append(name)
        yield name, t


# --- 1. the source started before the accept vote ------------------------------------------


def test_a_delta_refused_in_the_accept_vote_mid_slab_is_sent_whole_from_the_running_source():
    """The engine refuses the delta in the accept vote while the source is held part-way
    (mid-slab): the whole resend waits for it, carries exactly the round's stream, the engine
    ends with the round's bytes, the new base's kept row sums describe its stream, and the
    next round goes as a delta the engine rebuilds exactly."""
    first, second = _tensors(1), _stepped(_tensors(1), 2)
    wm = _manifest(first)
    engine, rounds = Engine(), DeltaRounds(incremental=False)
    rounds.refit(wm, iter(first), engine.send)
    gate, log = threading.Event(), []

    def refuse_while_held():
        time.sleep(0.05)
        assert log == ["t0", "t1"]  # the source is running, held before t2
        engine.refuse_accept = delta.DeltaRefused("stale base (mid-slab)")
        gate.set()

    engine.before_accept = refuse_while_held
    report = rounds.refit(wm, _slow(second, 0.01, log, gate=gate), engine.send)
    d = report.delta
    assert d.kind == "full" and d.attempts == 2 and "stale base (mid-slab)" in d.reason, d
    assert log == [n for n, _ in second]  # every tensor pulled exactly once
    want = delta.stream_of(wm, second)
    assert torch.equal(engine.base.stream[:wm.total_bytes], want[:wm.total_bytes])
    assert torch.equal(rounds.base.stream[:wm.total_bytes], want[:wm.total_bytes])
    assert _sums_describe(rounds.base, wm)
    third = _stepped(second, 3)
    d = rounds.refit(wm, iter(third), engine.send).delta
    assert d.kind == "delta" and d.attempts == 1, d
    assert torch.equal(engine.base.stream[:wm.total_bytes], delta.stream_of(wm, third)[:wm.total_bytes])
    assert engine.loads == 3


def test_a_refusal_reports_the_seconds_the_source_ran_ahead_of_it():
    """A round refused in the accept vote and sent whole from the source that ran ahead: the
    source's seconds (6 tensors x 20 ms) are in the report, not lost with the first encoder."""
    first, second = _tensors(4), _stepped(_tensors(4), 5)
    wm = _manifest(first)
    engine, rounds = Engine(), DeltaRounds(incremental=False)
    rounds.refit(wm, iter(first), engine.send)
    engine.refuse_accept = delta.DeltaRefused("stale base")
    d = rounds.refit(wm, _slow(second, 0.02, []), engine.send).delta
    assert d.attempts == 2 and d.kind == "full"
    assert d.source_s >= 0.1, d.source_s


@pytest.mark.parametrize("fail_at", [0, 3])
def test_a_source_failing_before_or_after_an_accept_vote_refusal_raises_its_own_error_and_keeps_the_base(fail_at):
    first = _tensors(6)
    wm = _manifest(first)
    engine, rounds = Engine(), DeltaRounds(incremental=False)
    rounds.refit(wm, iter(first), engine.send)
    base = rounds.base
    engine.refuse_accept = delta.DeltaRefused("stale base")
    with pytest.raises(ValueError, match=f"quantizing t{fail_at} failed"):
        rounds.refit(wm, _slow(_stepped(first, 7), 0.005, [], fail_at=fail_at), engine.send)
    assert rounds.base is base and engine.loads == 1  # nothing loaded anywhere, the base kept
    d = rounds.refit(wm, iter(_stepped(first, 8)), engine.send).delta
    assert d.kind == "delta" and d.attempts == 1, d


def test_a_refusal_before_any_data_stops_a_slow_source_and_keeps_the_base():
    """A WireManifestMismatchError in the accept vote while a slow source runs ahead: the source
    is stopped after the step it is in (not run to the end), the base and spare kept."""
    first = _tensors(9)
    wm = _manifest(first)
    engine, rounds = Engine(), DeltaRounds(incremental=False)
    rounds.refit(wm, iter(first), engine.send)
    base, log, interval = rounds.base, [], sys.getswitchinterval()
    engine.refuse_accept = WireManifestMismatchError("rank 1: another plan")
    with pytest.raises(WireManifestMismatchError, match="rank 1: another plan"):
        rounds.refit(wm, _slow(_stepped(first, 10), 0.05, log), engine.send)
    assert rounds.base is base and 0 < len(log) < len(first), log
    assert sys.getswitchinterval() == interval  # the stopped thread put it back
    d = rounds.refit(wm, iter(_stepped(first, 11)), engine.send).delta
    assert d.kind == "delta" and d.attempts == 1
    assert torch.equal(engine.base.stream[:wm.total_bytes],
                       delta.stream_of(wm, _stepped(first, 11))[:wm.total_bytes])


def test_a_look_ahead_started_after_close_never_runs_and_every_take_raises():
    ran = []
    ahead = LookAhead(ran.append, 3)
    ahead.close()
    ahead.start()
    assert not ahead.started
    for k in (0, 3):
        with pytest.raises(RuntimeError, match=f"closed before step {k} ran"):
            ahead.take(k)
    assert ran == []


# --- 2. the sender's digests from kept row sums ----------------------------------------------


def _receiver_digest_check(base_true, sender_base_stream, kept, new):
    """One 2-tile bucket: the sender's digest (kept sums + its compare against its own base) and
    what a receiver holding the true base rebuilds; returns (accepted, rebuilt bytes)."""
    sealer = delta.digest_sealer(None, MAC, {"round": "r2", "base": "r1"}, "layout")
    changed = delta.changed_bytes(new, sender_base_stream)
    patch, _ = delta.encode_patch(new, sender_base_stream, changed)
    digest = RegionDigests(sealer, kept).digest(0, new, sender_base_stream, changed)
    rebuilt = delta.decode_patch(patch, base_true.clone(), new.numel())
    return delta.region_digest(sealer, 0, rebuilt) == digest, rebuilt


def _first_round(n_tiles=2, seed=1):
    base = torch.randint(0, 256, (n_tiles * delta.TILE,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    first = RegionDigests(delta.digest_sealer(None, MAC, {"round": "r1", "base": None}, "layout"), None)
    first.digest(0, base, None, None)
    return base, first.kept()


def test_a_sender_base_fault_the_next_round_does_not_carry_is_refused_by_the_receiver():
    """A byte of the sender's base flipped in memory; the next round's stream holds the true byte
    there (it did not change): the patch carries it, the receiver's bytes are right but the
    sender's digest is not theirs: refused (sent again whole), never loaded wrong."""
    base, kept = _first_round()
    sender_base = base.clone()
    sender_base[77] ^= 0x10
    new = base.clone()
    new[1000] += 3
    accepted, rebuilt = _receiver_digest_check(base, sender_base, kept, new)
    assert not accepted and torch.equal(rebuilt, new)


def test_a_sender_base_fault_equal_to_the_next_rounds_byte_is_not_caught_by_the_digest():
    """The documented limit of the digests from kept sums: a sender base byte changed in memory
    TO the value the next round carries there is not in the compare's changed set, so the patch
    skips it, the receiver keeps its old byte, and the sender's digest (kept sums: the old byte)
    is the receiver's: accepted with that one byte not the round's. A full read of the new
    region (the digest before dde336a) gives a digest the receiver does not match."""
    base, kept = _first_round()
    sender_base = base.clone()
    sender_base[77] ^= 0x01  # the fault
    new = base.clone()
    new[77] = sender_base[77]  # the next round's code there is the faulted one (an LSB step)
    new[1000] += 3
    accepted, rebuilt = _receiver_digest_check(base, sender_base, kept, new)
    assert accepted
    assert torch.nonzero(rebuilt != new).reshape(-1).tolist() == [77]
    sealer = delta.digest_sealer(None, MAC, {"round": "r2", "base": "r1"}, "layout")
    assert delta.region_digest(sealer, 0, new) != delta.region_digest(sealer, 0, rebuilt)


@pytest.mark.parametrize("tiles", [1, 3])
def test_kept_sums_follow_changes_in_every_rows_last_word_and_across_the_int64_wrap(tiles):
    """Regions of one and three tiles, two rounds from kept sums: the last word of every row,
    the first words, words crossing 2**63 both ways, set to 0 and -1: each digest a full read's."""
    old, kept = _first_round(tiles, seed=tiles)
    for step, values in enumerate(([2**63 - 1, 0], [-(2**63), -1])):
        new = old.clone()
        w = new.view(torch.int64)
        last = torch.arange(cs.ROW_WORDS - 1, w.numel(), cs.ROW_WORDS)
        w[last] = values[0]
        w[0], w[1] = values[1], values[0] + 1 if values[0] < 2**63 - 1 else -(2**63)
        sealer = delta.digest_sealer(None, MAC, {"round": f"r{step + 2}", "base": f"r{step + 1}"}, "layout")
        digests = RegionDigests(sealer, kept)
        got = digests.digest(0, new, old, delta.changed_bytes(new, old))
        assert got == delta.region_digest(sealer, 0, new), step
        assert all(torch.equal(a, b) for a, b in zip(digests.rows[0], cs.row_sums(new, kept[0])))
        old, kept = new, digests.kept()


def test_a_whole_resend_after_a_commit_vote_refusal_keeps_sums_that_describe_its_stream():
    """The first attempt is refused in the commit vote (the engine's base was corrupted: its
    rebuilt digest differs); the round goes whole from the stream; its base's row sums are a
    full read's, and the next delta round is rebuilt exactly."""
    first, second = _tensors(12), _stepped(_tensors(12), 13)
    wm = _manifest(first)
    engine, rounds = Engine(), DeltaRounds(incremental=False)
    rounds.refit(wm, iter(first), engine.send)
    engine.base.stream[5] ^= 1  # the receiver's copy is out of step
    d = rounds.refit(wm, iter(second), engine.send).delta
    assert d.kind == "full" and d.attempts == 2 and "did not reconstruct" in d.reason, d
    assert _sums_describe(rounds.base, wm)
    third = _stepped(second, 14)
    d = rounds.refit(wm, iter(third), engine.send).delta
    assert d.kind == "delta" and d.attempts == 1
    assert torch.equal(engine.base.stream[:wm.total_bytes], delta.stream_of(wm, third)[:wm.total_bytes])


# --- 3. the compare that updates old ---------------------------------------------------------


def _brute(new, old):
    nb, ob = bits_view(new.reshape(-1)), bits_view(old.reshape(-1))
    idx = torch.nonzero(nb != ob).reshape(-1)
    return idx, nb.index_select(0, idx), ob.index_select(0, idx)


@pytest.mark.parametrize("split_it", [True, False], ids=["split", "one-thread"])
@pytest.mark.parametrize("shift", [8, 64, -64, 3])
def test_update_with_new_and_old_overlapping_is_refused_naming_both(monkeypatch, split_it, shift):
    """``old`` cannot end equal to ``new`` when they share bytes (writing one changes the other),
    and on the split compare the pieces' writes race the other thread's reads (measured: wrong
    indices). Refused before any byte is written."""
    if split_it:
        monkeypatch.setattr(delta, "SPLIT_WORDS", 16)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    buf = torch.randint(0, 4, (4096 + 128,), dtype=torch.uint8, generator=torch.Generator().manual_seed(shift % 97))
    lo = 64
    new, old = buf[lo:lo + 4096], buf[lo + shift:lo + shift + 4096]
    before = buf.clone()
    with pytest.raises(ValueError, match="changed_values.update=True.: new and old share memory"):
        changed_values(new, old, update=True)
    assert torch.equal(buf, before)
    got, want = changed_values(new, old), _brute(new, old)  # without update: still the compare
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_update_with_the_same_tensor_twice_changes_nothing():
    x = torch.randn(64, 64).to(torch.bfloat16)
    before = x.clone()
    idx, a, b = changed_values(x, x, update=True)
    assert idx.numel() == a.numel() == b.numel() == 0 and torch.equal(bits_view(x), bits_view(before))


def test_update_of_disjoint_views_of_one_buffer_is_exact(monkeypatch):
    monkeypatch.setattr(delta, "SPLIT_WORDS", 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    buf = torch.randint(0, 4, (8192,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    new, old = buf[:4096].view(torch.int16), buf[4096:].view(torch.int16)
    want, target = _brute(new, old), new.clone()
    got = changed_values(new, old, update=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(old, target) and torch.equal(new, target)


def test_a_source_thread_that_cannot_start_runs_the_round_on_the_callers_thread(monkeypatch):
    """No thread to be had (a process at its thread limit) when the round begins: the look-ahead
    is only a speed-up, so the round goes on with the source on the caller's thread, the same
    stream; the base is not dropped for it (the next round is a delta)."""
    first, second = _tensors(15), _stepped(_tensors(15), 16)
    wm = _manifest(first)
    engine, rounds = Engine(), DeltaRounds(incremental=False)
    rounds.refit(wm, iter(first), engine.send)
    start = threading.Thread.start

    def no_source_thread(self):
        if self.name == "qstrat-delta-source":
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", no_source_thread)
    interval = sys.getswitchinterval()
    d = rounds.refit(wm, iter(second), engine.send).delta
    assert d.kind == "delta" and d.attempts == 1, d
    assert sys.getswitchinterval() == interval
    assert torch.equal(engine.base.stream[:wm.total_bytes], delta.stream_of(wm, second)[:wm.total_bytes])
    d = rounds.refit(wm, iter(_stepped(second, 17)), engine.send).delta
    assert d.kind == "delta" and d.attempts == 1, d


def test_a_caller_under_inference_mode_without_a_source_thread_keeps_the_requantizer_usable(monkeypatch):
    """The source falls back to the caller's thread (no thread to be had) while the caller is
    under ``torch.inference_mode()``: the requantizer's entries must still be normal tensors,
    since the next round's source thread (outside inference mode, torch's default on a new
    thread) updates them in place. Every round: a full quantize's bytes, as deltas."""
    from qstrat.plugins.registry import get_serializer

    ser, rounds = get_serializer("mxfp8"), DeltaRounds(incremental=True)
    g = torch.Generator().manual_seed(18)
    w = torch.randn(64, 512, generator=g).to(torch.bfloat16)

    def source(weight):
        for name, part in rounds.quantize(ser, "w", weight).items():
            yield name, part.view(torch.uint8).reshape(-1)

    want = lambda weight: [(n, p.view(torch.uint8).reshape(-1)) for n, p in ser.quantize(weight).items()]
    wm = build_wire_manifest([(n, "uint8", tuple(t.shape)) for n, t in want(w)], 64 * 1024)
    engine = Engine()
    start = threading.Thread.start

    def no_source_thread(self):
        if self.name == "qstrat-delta-source":
            raise RuntimeError("can't start new thread")
        return start(self)

    steps = []
    for step in range(3):
        w = w.clone()
        w[step, :40] += 0.25
        steps.append(w)
        if step == 0:
            monkeypatch.setattr(threading.Thread, "start", no_source_thread)
        elif step == 1:
            monkeypatch.setattr(threading.Thread, "start", start)
        with torch.inference_mode():
            rounds.refit(wm, source(w), engine.send)
        assert torch.equal(engine.base.stream[:wm.total_bytes], delta.stream_of(wm, want(w))[:wm.total_bytes]), step
    d = rounds.refit(wm, source(steps[-1]), engine.send).delta
    assert d.kind == "delta" and d.requantize.get("incremental") == 1, d
