"""Attacks on the delta sender's speed changes (the compare handing back values and split over two
threads, the requantizer's scatter/shift steps, the checksum's row blocks, a refused-then-whole
round's byte accounting): each against an oracle computed here (brute-force compare, a full
``Serializer.quantize``, the payloads the fake wire saw)."""
from __future__ import annotations

import threading

import pytest
import torch

from qstrat.transport.delta import encoding as delta
from qstrat.transport.delta.encoding import bits_view, changed_values
from qstrat.transport.delta.stream import PatchEncoder
from qstrat.transport.wire_manifest import build_wire_manifest

T = delta.TILE


def brute(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nb, ob = bits_view(new).reshape(-1), bits_view(old).reshape(-1)
    idx = torch.nonzero(nb != ob).reshape(-1)
    return idx, nb[idx], ob[idx]


@pytest.fixture
def split(monkeypatch):
    """The split compare for every input of 16 words or more."""
    monkeypatch.setattr(delta, "SPLIT_WORDS", 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)


DTYPES = [torch.bool, torch.float8_e4m3fn, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.complex64]
#: every dtype at every byte offset its elements can start at (8: aligned; else the element-wise path)
PLACES = [(d, o) for d in DTYPES for o in (0, 2, 4, 8) if o % torch.tensor([], dtype=d).element_size() == 0]


@pytest.mark.parametrize(("dtype", "offset"), PLACES, ids=[f"{d}-{o}" for d, o in PLACES])
@pytest.mark.parametrize("nbytes", [0, 8, 72, 136, 1032, 64 * 8 * 9])
def test_split_compare_of_every_width_size_and_offset_equals_the_brute_force(split, dtype, nbytes, offset):
    g = torch.Generator().manual_seed(nbytes + offset)
    raw = torch.randint(0, 256, (nbytes + offset,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    old = raw[offset:].view(dtype)
    new = old.clone()
    n = new.numel()
    if n:
        bv = bits_view(new)
        at = torch.cat([torch.randint(0, n, (max(1, n // 10),), generator=g), torch.tensor([0, n - 1, n // 2])])
        bv[at] ^= 1
    got, want = changed_values(new, old), brute(new, old)
    for g_, w_ in zip(got, want):
        assert g_.dtype == w_.dtype and torch.equal(g_, w_)
    assert got[0].numel() == int((bits_view(new).reshape(-1) != bits_view(old).reshape(-1)).sum())


@pytest.mark.parametrize(("dtype", "offset"), PLACES, ids=[f"{d}-{o}" for d, o in PLACES])
@pytest.mark.parametrize("nbytes", [0, 8, 136, 64 * 8 * 9])
@pytest.mark.parametrize("split_it", [True, False], ids=["split", "one-thread"])
def test_a_compare_that_updates_old_gives_the_same_result_and_leaves_old_equal_to_new(
        monkeypatch, split_it, dtype, nbytes, offset):
    """``changed_values(update=True)`` (a requantizer's kept input): the same indices and bits
    as without it, and afterwards ``old`` holds ``new``'s bits exactly (every path: the split
    compare's pieces, one thread, the element-wise path of an unaligned view)."""
    if split_it:
        monkeypatch.setattr(delta, "SPLIT_WORDS", 16)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    g = torch.Generator().manual_seed(nbytes + offset + 1)
    raw = torch.randint(0, 256, (nbytes + offset,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    old = raw[offset:].view(dtype)
    new, before = old.clone(), raw[:offset].clone()
    if new.numel():
        bits_view(new)[torch.randint(0, new.numel(), (max(1, new.numel() // 7),), generator=g)] ^= 1
    want = brute(new, old)
    got = changed_values(new, old, update=True)
    for g_, w_ in zip(got, want):
        assert g_.dtype == w_.dtype and torch.equal(g_, w_)
    assert torch.equal(bits_view(old), bits_view(new))
    assert torch.equal(raw[:offset], before)  # the bytes before the view: untouched


def test_split_compare_sees_negative_zero_and_nan_payloads_and_parameters(split):
    old = torch.zeros(4096)
    old[100] = float("nan")
    new = old.clone()
    new[7] = -0.0
    bits_view(new)[100] |= 1  # another NaN payload
    idx, nb, ob = changed_values(new, old)
    assert idx.tolist() == [7, 100] and nb[0] == bits_view(torch.tensor(-0.0)) and ob[0] == 0
    p = torch.nn.Parameter(torch.randn(8192))
    q = p.detach().clone()
    q[5] += 1
    assert changed_values(p, q)[0].tolist() == [5]


def test_many_threads_at_once_each_get_their_own_exact_result(split):
    errors: list[int] = []

    def run(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        old = torch.randn(1 << 14, generator=g).bfloat16()
        new = old.clone()
        new[torch.randint(0, new.numel(), (50,), generator=g)] += 1
        for _ in range(10):
            if not torch.equal(changed_values(new, old)[0], brute(new, old)[0]):
                errors.append(seed)

    before = threading.active_count()
    threads = [threading.Thread(target=run, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and threading.active_count() == before


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, ValueError])
@pytest.mark.parametrize("on", ["qstrat-compare", "caller"])
def test_what_either_thread_raises_is_raised_and_no_helper_is_left(split, monkeypatch, exc, on):
    real = delta._changed_words

    def failing(a, *args):
        name = threading.current_thread().name
        if (name == "qstrat-compare") == (on == "qstrat-compare"):
            raise exc("boom")
        return real(a, *args)

    monkeypatch.setattr(delta, "_changed_words", failing)
    old = torch.randn(1 << 14).bfloat16()
    new = old.clone()
    new[3] += 1
    before = threading.active_count()
    with pytest.raises(exc, match="boom"):
        changed_values(new, old)
    assert threading.active_count() == before


def test_a_helper_thread_that_cannot_start_does_not_refuse_the_compare(split, monkeypatch):
    """Starting a thread can fail (a process at its thread limit, RuntimeError "can't start new
    thread"): the helper is only a speed-up, so the compare runs on the caller's thread instead of
    refusing a valid input."""
    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    old = torch.randn(1 << 14).bfloat16()
    new = old.clone()
    new[[3, 5000, 16383]] += 1
    got = changed_values(new, old)
    for g_, w_ in zip(got, brute(new, old)):
        assert torch.equal(g_, w_)
    assert got[0].tolist() == [3, 5000, 16383]


# ---- a refused-then-whole round's bytes: every payload the (fake, in-process) wire carried ----

def _round_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randint(0, 256, (3 * T + 11,), dtype=torch.uint8, generator=g),
            "b": torch.randint(0, 256, (T // 2,), dtype=torch.uint8, generator=g)}


def _stepped(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in state.items()}
    out["a"][:: 997] ^= 1
    return out


@pytest.mark.parametrize(("refusal", "bounded"), [("commit", False), ("commit", True), ("accept", False),
                                                  ("mix", True), (None, False)])
def test_delta_rounds_report_every_payload_the_wire_carried(refusal, bounded):
    """DeltaRounds over a fake ``send`` that sends (encodes) every bucket, except when it refuses
    in the accept vote (before any payload): the report's bytes and wire_bytes are the sum of the
    payloads that send saw, over both attempts."""
    from qstrat.transport.delta.rounds import DeltaRounds
    from qstrat.transport.send.report import TransferReport

    target = build_wire_manifest([("a", "uint8", (3 * T + 11,)), ("b", "uint8", (T // 2,))], 2 * T, 16)
    seen: list[int] = []
    calls = [0]

    def send(enc: PatchEncoder, info: dict) -> TransferReport:
        calls[0] += 1
        first = calls[0] == 2  # the second round's first attempt (the first round has no base: whole)
        if first and refusal == "accept":
            raise delta.DeltaRefused("rank 1 does not hold the delta round's base")
        enc.start(None, bytes(32))
        sizes = [enc.payload(k).numel() for k in range(len(target.buckets))]
        seen.extend(sizes)
        if first and refusal == "commit":
            raise delta.DeltaRefused("rank 1 did not reconstruct the delta round to the trainer's digests")
        if first and refusal == "mix":
            raise delta.DeltaMixed("ranks [1] hold new weights")
        return TransferReport(target, sum(sizes), len(sizes), 0.0, 0.0)

    rounds = DeltaRounds(incremental=False)
    state = _round_state(3)
    rounds.refit(target, iter(state.items()), send, bounded)
    seen.clear()
    report = rounds.refit(target, iter(_stepped(state).items()), send, bounded)
    d = report.delta
    assert d.attempts == (1 if refusal is None else 2)
    assert report.bytes == d.wire_bytes == sum(seen)
    assert torch.equal(rounds.base.stream, delta.stream_of(target, _stepped(state).items()))


def test_a_delta_mesh_round_refused_at_the_commit_vote_reports_both_attempts_wire_bytes(monkeypatch):
    """DeltaMeshSender.send over a fake MeshSender.send (each pair's encoder made as
    ``_pair_head`` makes it, every bucket encoded as the wire would carry it): a delta refused at
    the commit vote went on the wire before the whole resend, so the DeltaReport's wire_bytes
    (``attempts == 2``: both rounds' payloads, report.py) is the sum of every payload sent."""
    from qstrat.transport.mesh import pair_delta
    from qstrat.transport.mesh.sender import MeshReport, MeshSender

    target = build_wire_manifest([("a", "uint8", (3 * T + 11,)), ("b", "uint8", (T // 2,))], 2 * T, 16)
    states = {r: _round_state(10 + r) for r in (0, 1)}
    seen: list[int] = []
    refuse = [False]

    def fake_send(self, outputs, tensors) -> MeshReport:
        sent = {}
        for r in (0, 1):
            enc = self._resend.get(r) if self._resend is not None else None
            if enc is None:
                base = None if self._resend is not None else self.bases.get(r)
                enc = PatchEncoder(target, iter(states[r].items()), base)
            self._encoders[r] = enc
            enc.start(None, bytes(32))
            sizes = [enc.payload(k).numel() for k in range(len(target.buckets))]
            seen.extend(sizes)
            sent[self.senders + r] = sum(sizes)
        if refuse[0]:
            refuse[0] = False
            raise delta.DeltaRefused("rank 2: delta bucket 0: the rebuilt digest differs, nothing loaded")
        return MeshReport(sent, 0.0, 0.0)

    monkeypatch.setattr(MeshSender, "send", fake_send)
    sender = object.__new__(pair_delta.DeltaMeshSender)
    sender.senders, sender.bases, sender._encoders, sender._resend = 2, {}, {}, None
    assert sender.send([], iter(())).delta.attempts == 1  # the first round: whole (no bases)
    states = {r: _stepped(s) for r, s in states.items()}
    seen.clear()
    refuse[0] = True
    report = sender.send([], iter(()))
    d = report.delta
    assert d.attempts == 2 and d.kind == "full"
    delta_bytes = sum(seen[:2 * len(target.buckets)])
    assert 0 < delta_bytes < d.full_bytes
    assert d.wire_bytes == sum(seen)


# ---- the requantizer on the split compare: every step a full quantize's bytes ----

def _requantize_cases():
    from qstrat.serializers.block_fp8 import BlockFP8
    from qstrat.serializers.mxfp8 import MXFP8
    from qstrat.serializers.nvfp4 import NVFP4

    return [(BlockFP8, {}, (1, 130, 96)), (BlockFP8, {}, (2, 129, 288)), (BlockFP8, {"ue8m0": True}, (3, 7, 200)),
            (MXFP8, {}, (1, 33, 96)), (MXFP8, {"scale_rounding": "floor"}, (2, 70, 160)), (MXFP8, {}, (1, 5, 1568)),
            (NVFP4, {}, (1, 33, 96)), (NVFP4, {}, (2, 70, 160)), (NVFP4, {}, (3, 17, 48))]


@pytest.mark.parametrize("case", range(9))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_requantizer_on_the_split_compare_gives_a_full_quantizes_bytes_every_step(split, case, dtype):
    """Non-power-of-two and ragged N/K, 3-D expert slabs, each edit kind (raised and lowered
    block maxima: rescaled blocks), a transposed (non-contiguous) 2-D input and one tensor
    edited in place under two keys."""
    from test_delta_requantize import EDITS, edit, same_bytes

    from qstrat.transport.delta.requantize import Requantizer

    cls, options, shape = _requantize_cases()[case]
    ser = cls(**options)
    g = torch.Generator().manual_seed(case)
    w = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 4, (*shape[:2], 1), generator=g).float()))
    w = w.to(dtype)
    rq = Requantizer(max_fraction=0.5)
    alias = w[0].clone()  # quantized under keys "x" and "y", edited in place between rounds
    for step, kind in enumerate(["few", *EDITS, "few", "lower_max"]):
        w = edit(w, kind, step) if step else w
        same_bytes({k: v.clone() for k, v in rq.quantize(ser, "w", w).items()}, ser.quantize(w))
        alias.copy_(edit(alias, kind, 100 + step))
        for key in ("x", "y"):
            same_bytes({k: v.clone() for k, v in rq.quantize(ser, key, alias).items()}, ser.quantize(alias))
    assert rq.stats["incremental"] > 0 and rq.stats["blocks_rescaled"] > 0, dict(rq.stats)
    if shape[1] % 16 == 0 or cls.__name__ == "BlockFP8":  # a transposed view (its K is the slab's N)
        rows = w[0].clone()
        rq2 = Requantizer()
        for step in range(3):
            rows = edit(rows, "few", step) if step else rows
            t = rows.t()
            same_bytes({k: v.clone() for k, v in rq2.quantize(ser, "t", t).items()}, ser.quantize(t))


# ---- the checksum's row blocks: the formula's value at and around block ends, fed in pieces ----

@pytest.mark.parametrize("path", ["kernel", "mv", "multiply"])
@pytest.mark.parametrize(("rows", "tail"), [(31, 0), (32, 0), (33, 5), (0, 1), (0, 0), (1, 0)])
def test_checksum_row_blocks_fed_in_pieces_equal_the_formula(monkeypatch, path, rows, tail):
    """Each way the row sums are made - the numba loop (CPU), ``torch.mv`` blocks, a multiply
    and sum (CUDA's) - gives the formula's value."""
    from test_transport_security import oracle

    from qstrat.transport.security import checksum as cs

    assert cs.ROW_KERNEL, "numba did not import: the CPU row sums run on torch.mv"
    monkeypatch.setattr(cs, "ROW_KERNEL", path == "kernel")
    monkeypatch.setattr(cs, "_integer_mv", lambda device: path == "mv")
    n = rows * cs._ROW_BYTES + tail
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    for seed in (0, 2**63 - 1):
        want = oracle(bytes(x.tolist()), seed)
        assert cs.checksum(x, seed) == want
        buf = torch.empty(n + 3, dtype=torch.uint8)
        buf[3:] = x
        assert cs.checksum(buf[3:], seed) == want  # an unaligned view
        for cut in ([1], [31, 1], [32], [17, 5, 9]):
            state, at = cs.Checksum(seed, n, x.device), 0
            for c in cut:
                m = min(c * cs._ROW_BYTES, n - at)
                if m <= 0 or at + m >= n:
                    break
                piece = torch.empty(m + 1, dtype=torch.uint8)[1:]  # an unaligned piece
                piece.copy_(x[at:at + m])
                state.update(piece)
                at += m
            state.update(x[at:])
            assert state.value() == want, cut


def test_requantizer_under_deterministic_algorithms_gives_a_full_quantizes_bytes(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` (a trainer's reproducibility setting) with
    uninitialized memory filled: the scatter_/index_copy_ steps neither raise nor change a byte."""
    from test_delta_requantize import EDITS, edit, same_bytes

    from qstrat.serializers.block_fp8 import BlockFP8
    from qstrat.serializers.nvfp4 import NVFP4
    from qstrat.transport.delta.requantize import Requantizer

    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for ser, shape in [(BlockFP8(), (1, 130, 96)), (NVFP4(), (2, 33, 96))]:
            w = torch.randn(shape, generator=torch.Generator().manual_seed(1)).bfloat16()
            rq = Requantizer(max_fraction=0.5)
            for step, kind in enumerate(["few", *EDITS]):
                w = edit(w, kind, step) if step else w
                same_bytes({k: v.clone() for k, v in rq.quantize(ser, "w", w).items()}, ser.quantize(w))
            assert rq.stats["incremental"] >= 4, dict(rq.stats)
    finally:
        torch.use_deterministic_algorithms(was)
