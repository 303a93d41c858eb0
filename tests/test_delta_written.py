"""The delta sender's write log (qstrat.transport.delta.written): the requantizer records every
byte of its parts it writes, the stream copies and compares only those, and anything the log
cannot vouch for is copied and compared whole.

Checked against oracles, not against the log itself: every byte that differs between a part
before and after an incremental call (read from the bytes) is in the log's answer, over generated
edits of every quantized format; the fast stream equals a stream written whole from a full
quantization every step of a real Adam trajectory; and an unrecorded write, a part made again,
a spare out of step or a record chain with a gap each fall back to the whole copy with exact
bytes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from properties import PROPS, weights
from qstrat.errors import NonFiniteError
from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.requantize import Requantizer
from qstrat.transport.delta.written import MAX_RECORDS, Mark, Pieces, WriteLog
from test_delta_requantize import EDITS, QUANTIZED, edit


def part_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("case", QUANTIZED, ids=[c[0] for c in QUANTIZED])
@PROPS
@given(data=st.data())
def test_every_byte_an_incremental_call_changes_is_in_the_log(case, data):
    """The oracle is the bytes: a part's bytes before and after each call compared whole; every
    position that differs is in ``since(part, mark before the call)``, and the answer is None
    (whole) exactly when the part was made again."""
    _, cls, options, k_multiple = case
    ser = cls(**options)
    w = data.draw(weights(k_multiple))
    rq = Requantizer()
    kinds = data.draw(st.lists(st.sampled_from(EDITS), min_size=1, max_size=4))
    parts = marks = None
    for step, kind in enumerate(["start", *kinds]):
        if step:
            w = edit(w, kind, step)
        try:
            new = rq.quantize(ser, "w", w, name="w")
        except NonFiniteError:
            return
        if parts is not None:
            for name, t in new.items():
                got = rq.written.since(t, marks[name]) if marks[name] is not None else None
                if t.untyped_storage().data_ptr() != parts[name][0]:  # made again (whole): a new part
                    assert got is None
                    continue
                assert got is not None, (name, kind, rq.stats)
                changed = torch.nonzero(part_bytes(t) != parts[name][1]).reshape(-1)
                assert torch.isin(changed, got).all(), (name, kind)
                assert got.numel() == 0 or (got[1:] > got[:-1]).all() and 0 <= int(got[0]) and \
                    int(got[-1]) < t.numel() * t.element_size()
        parts = {n: (t.untyped_storage().data_ptr(), part_bytes(t)) for n, t in new.items()}
        marks = {n: rq.written.mark(t) for n, t in new.items()}


def test_an_unrecorded_write_a_part_made_again_and_a_gap_are_answered_none():
    log = WriteLog()
    part = torch.zeros(4, 64, dtype=torch.uint8)
    log.add([part])
    mark = log.mark(part[1])
    assert mark == Mark(mark.uid, 64, 64, part._version)
    assert torch.equal(log.since(part[1], mark), torch.empty(0, dtype=torch.int64))  # nothing written
    before = part._version
    part.view(-1)[[70, 200]] = 1  # storage bytes 70 (row 1) and 200 (row 3)
    log.record(part, before, torch.tensor([70, 200]))
    assert log.since(part[1], mark).tolist() == [6]  # only row 1's byte, in row 1's own bytes
    assert log.since(part[3], log.mark(part[3])).numel() == 0
    assert log.since(part[2], mark) is None  # another window
    part[1, 0] = 9  # a write the log did not record: the chain no longer reaches the part's version
    assert log.since(part[1], mark) is None
    other = torch.zeros(4, 64, dtype=torch.uint8)
    log.add([other])
    assert log.since(other[1], mark) is None  # another part (another id)
    log.drop([part])
    assert log.mark(part[1]) is None and len(log) == 1
    # a record whose "before" is not the last record's "after" starts the chain again
    m0 = log.mark(other)
    for i in range(3):
        v = other._version
        other.view(-1)[i] = 1
        log.record(other, v if i != 2 else v - 1, torch.tensor([i]))
    assert log.since(other, m0) is None
    assert log.since(other, Mark(m0.uid, 0, other.numel(), other._version - 2)).tolist() == [2]


def test_records_beyond_the_kept_number_answer_none_for_an_older_mark():
    log, part = WriteLog(), torch.zeros(256, dtype=torch.uint8)
    log.add([part])
    first = log.mark(part)
    for i in range(MAX_RECORDS + 1):
        v = part._version
        part[i] = 1
        log.record(part, v, torch.tensor([i]))
    assert log.since(part, first) is None
    recent = Mark(first.uid, 0, 256, part._version - MAX_RECORDS)
    assert log.since(part, recent).tolist() == list(range(1, MAX_RECORDS + 1))


def test_parts_sharing_a_storage_or_inference_tensors_are_not_logged():
    log, buf = WriteLog(), torch.zeros(128, dtype=torch.uint8)
    log.add([buf[:64], buf[64:]])
    assert len(log) == 0
    with torch.inference_mode():
        t = torch.zeros(8)
    log.add([t])
    assert len(log) == 0 and log.mark(t) is None


def test_pieces_give_the_changed_positions_of_each_region_in_order():
    g = torch.Generator().manual_seed(1)
    old = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    new = old.clone()
    new[[5, 40000, 40001, 65535]] += 1  # 5 and 65535 in spans, 40000-1 reported as changed
    p = Pieces()
    p.add_span(0, 1000)
    p.add_changed(torch.tensor([40000, 40001]))
    p.add_span(60000, 1 << 16)
    want = torch.nonzero(new != old).reshape(-1)
    got = torch.cat([p.changed(lo, hi, new[lo:hi], old[lo:hi], delta.changed_bytes) + lo
                     for lo, hi in ((0, 32768), (32768, 40001), (40001, 1 << 16))])
    assert torch.equal(got, want)


# ---- the stream of a delta round from the log, over a real trajectory ------------------------------
@pytest.mark.parametrize("fmt", ["block-fp8", "mxfp8", "nvfp4-linear"])
def test_the_stream_from_the_log_equals_a_whole_stream_every_step_and_copies_little(tiny_model, fmt):
    """Rounds through DeltaRounds with an in-process receiver (PatchDecoder): each round's stream
    and the receiver's rebuilt bytes equal a stream written whole from a full quantization of the
    step; after the first delta round, only passthrough tensors are copied whole."""
    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.cli.demo.trajectory import adam_trajectory
    from qstrat.execute.driver import RefitDriver
    from qstrat.transport.delta.churn import FORMATS
    from qstrat.transport.delta.rounds import DeltaRounds

    driver = RefitDriver(FORMATS[fmt], hf_config=hf_config(tiny_model))
    rounds, receiver, seen = DeltaRounds(), Receiver(), []
    for step, state in enumerate(adam_trajectory(tiny_model, 1e-5, 4)):
        target = wire_manifest(driver, state)
        plan = driver.plan(state)
        report = rounds.refit(target, driver.execute(plan, state, quantize=rounds.quantize),
                              lambda enc, extra: receiver.round(enc, seen))
        whole = delta.stream_of(target, driver.run(state))
        assert torch.equal(rounds.base.stream, whole), (fmt, step)
        assert torch.equal(receiver.base.stream, whole), (fmt, step)
        assert report.delta.copied_whole == (seen[-1] if seen[-1] is not None else target.total_bytes)
        if step >= 1:
            assert report.delta.kind == "delta", report.delta
    logged = sum(s.nbytes for s, m in zip(target.slots, rounds.base.marks) if m is not None)
    assert logged > target.total_bytes // 2
    # copied whole: the passthrough tensors (and the gaps between them), nothing logged
    assert seen[0] is None and seen[1:] and all(s <= target.total_bytes - logged for s in seen[1:]), seen


def test_a_part_changed_in_place_a_stale_spare_and_a_whole_round_each_copy_whole_and_stay_exact(tiny_model):
    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.cli.demo.trajectory import adam_trajectory
    from qstrat.execute.driver import RefitDriver
    from qstrat.transport.delta.rounds import DeltaRounds

    driver = RefitDriver("block-fp8", hf_config=hf_config(tiny_model))
    rounds, receiver, seen = DeltaRounds(), Receiver(), []
    states = list(adam_trajectory(tiny_model, 1e-5, 6))

    def round_of(state, touch=None):
        target = wire_manifest(driver, state)
        tensors = driver.execute(driver.plan(state), state, quantize=rounds.quantize)
        sent = []

        def keep(items):
            for name, t in items:
                sent.append((name, t.clone()))
                yield name, t
        report = rounds.refit(target, keep(touch(tensors) if touch else tensors),
                              lambda enc, extra: receiver.round(enc, seen))
        return report, target, delta.stream_of(target, sent), delta.stream_of(target, driver.run(state))

    round_of(states[0])
    _, target, _, _ = round_of(states[1])
    logged = sum(s.nbytes for s, m in zip(target.slots, rounds.base.marks) if m is not None)
    assert logged > target.total_bytes // 2 and seen[-1] <= target.total_bytes - logged
    # a caller changing a requantizer part in place after it was returned (a write the log did
    # not record): that slot is copied and compared whole, so what is sent is what it holds
    flipped = []

    def flip(tensors):
        for name, t in tensors:
            if not flipped and t.dtype == torch.float8_e4m3fn:
                t.view(torch.uint8).view(-1)[3] ^= 0x01
                flipped.append(t.numel())
            yield name, t

    report, target, sent, whole = round_of(states[2], flip)
    # that slot whole too (with the other views of its part: they share its version counter)
    assert flipped and seen[-1] >= seen[-2] + flipped[0]
    assert torch.equal(receiver.base.stream, sent) and torch.equal(rounds.base.stream, sent)
    assert not torch.equal(sent, whole)  # the flipped byte went (the part held it)
    rounds.requantizer.clear()  # its parts hold that byte: quantize whole again
    report, target, sent, whole = round_of(states[3])
    assert torch.equal(receiver.base.stream, whole) and torch.equal(rounds.base.stream, whole)
    # a spare that is not the base's parent (a round that stopped part-way left it): the base is
    # copied into it whole first
    report, target, sent, whole = round_of(states[4])
    rounds.spare_round = "not the parent"
    rounds.spare.fill_(0xAB)
    report, target, sent, whole = round_of(states[5])
    assert torch.equal(receiver.base.stream, whole) and report.delta.kind == "delta"
    assert seen[-1] <= target.total_bytes - logged  # the log served
    # a whole round (the sender holds no base): every byte written, the next round a delta again
    rounds.base = None
    state = {n: t.clone() for n, t in states[5].items()}
    report, target, sent, whole = round_of(state)
    assert report.delta.kind == "full" and torch.equal(rounds.base.stream, whole) and seen[-1] is None


# ---- helpers -------------------------------------------------------------------------------------
def wire_manifest(driver, state):
    from qstrat.transport.wire_manifest import wire_manifest_for_plan

    return wire_manifest_for_plan(driver.plan(state), 1 << 18)


class Receiver:
    """A receiver in process: rebuilds each round against its base with the real decoder."""

    def __init__(self) -> None:
        self.base = None

    def round(self, enc, seen):
        from qstrat.transport.delta.receive import PatchDecoder
        from qstrat.transport.send.report import TransferReport

        enc.begin()
        enc.start(None, bytes(32))
        dec = PatchDecoder(enc.info, enc.target, self.base, None, bytes(32))
        for k in range(len(enc.target.buckets)):
            dec.apply(k, enc.payload(k))
        pieces = enc.writer.pieces if enc.writer is not None else None
        seen.append(pieces.span_bytes if pieces is not None else None)
        dec.staged()
        self.base = dec.new_base
        return TransferReport(enc.target, enc.wire_bytes, len(enc.target.buckets), 0.0, 0.0)


def test_a_whole_resend_reads_logged_slots_again_from_the_parts_not_the_streams_memory(tiny_model):
    """A byte of the sender's base and spare changed in memory (a fault) where the log says
    nothing was written: the delta leaves it out (the receivers keep their right byte), and when
    the round is then refused and sent whole, the logged slots are read again from the parts, so
    the whole round carries the right byte, not the stream's."""
    from qstrat.cli.demo.tiny_model import hf_config
    from qstrat.cli.demo.trajectory import adam_trajectory
    from qstrat.execute.driver import RefitDriver
    from qstrat.transport.delta.rounds import DeltaRounds

    driver = RefitDriver("block-fp8", hf_config=hf_config(tiny_model))
    rounds, receiver, seen = DeltaRounds(), Receiver(), []
    states = list(adam_trajectory(tiny_model, 1e-6, 3))
    for state in states[:2]:
        target = wire_manifest(driver, state)
        rounds.refit(target, driver.execute(driver.plan(state), state, quantize=rounds.quantize),
                     lambda enc, extra: receiver.round(enc, seen))
    slot = next(s for s, m in zip(target.slots, rounds.base.marks) if m is not None)
    at = target.buckets[slot.bucket].stream_offset + slot.offset + slot.nbytes // 2
    rounds.base.stream[at] ^= 0x10
    rounds.spare[at] ^= 0x10
    attempts = []

    def refuse_first(enc, extra):
        attempts.append(enc.base is not None)
        if len(attempts) == 1:
            enc.begin()
            enc.start(None, bytes(32))
            for k in range(len(enc.target.buckets)):
                enc.payload(k)
            raise delta.DeltaRefused("a receiver refused the delta (test)")
        return receiver.round(enc, seen)

    state = states[2]
    report = rounds.refit(target, driver.execute(driver.plan(state), state, quantize=rounds.quantize), refuse_first)
    whole = delta.stream_of(target, driver.run(state))
    assert attempts == [True, False] and report.delta.attempts == 2
    assert torch.equal(receiver.base.stream, whole) and torch.equal(rounds.base.stream, whole)
