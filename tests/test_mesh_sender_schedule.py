"""How a mesh sender rank schedules its pairs (qstrat/transport/mesh/sender.py), without processes:
a recording group whose sends finish only when the test says so. A rank whose wire order goes to
one engine rank after another (experts placed round-robin) must put every pair on the wire at once
within its look-ahead, never more than IN_FLIGHT buckets of one pair, and each pair's stream must
be exactly its wire manifest's buckets, in order, with the pair's seals."""
from __future__ import annotations

import torch

from qstrat.transport import protocol as proto
from qstrat.transport.security.auth import from_words
from qstrat.transport.mesh.steps import pair_sealer
from qstrat.transport.mesh.sender import IN_FLIGHT, PairOut, keep_busy
from qstrat.transport.wire_manifest import build_wire_manifest

BUCKET = 1 << 12


class Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> None:
        self.done = True  # the wire delivers it while the sender waits


class Group:
    """Records every send: (dst, tag, bytes, Work)."""

    rank, world_size, device, timeout_s, pg = 0, 3, torch.device("cpu"), 5.0, object()

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, bytes, Work]] = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        w = Work()
        self.sent.append((dst, tag, tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes(), w))
        return w

    def wait(self, work: Work) -> None:
        work.wait()

    def on_wire(self, dst: int) -> int:
        return sum(1 for d, tag, _, w in self.sent if d == dst and tag % 2 and not w.done)


def _pairs(group: Group, tensors: int) -> tuple[dict[int, PairOut], dict[int, list[torch.Tensor]]]:
    """Two pairs (to group ranks 1 and 2), each ``tensors`` bf16 experts of 4 buckets each."""
    parts = {dst: [torch.arange(dst * 1000 + i, dst * 1000 + i + 8192).to(torch.bfloat16).reshape(8, 1024)
                   for i in range(tensors)] for dst in (1, 2)}
    outs = {}
    for dst, ts in parts.items():
        wm = build_wire_manifest(((f"e{dst}.{i}", "bfloat16", (8, 1024)) for i in range(len(ts))), BUCKET, 64)
        outs[dst] = PairOut(group, dst, wm, pair_sealer(None, bytes(32), 0, dst, group.device))
    return outs, parts


def test_every_pair_is_on_the_wire_at_once_within_the_look_ahead():
    group = Group()
    outs, parts = _pairs(group, 2)
    for i, t in enumerate(parts[1]):  # the wire order: everything to rank 1 first
        outs[1].push(f"e1.{i}", t)
        keep_busy(outs.values(), 1 << 20)
    assert group.on_wire(1) == IN_FLIGHT  # the window, not more, and nothing waited for
    assert not any(w.done for *_, w in group.sent)
    outs[2].push("e2.0", parts[2][0])
    keep_busy(outs.values(), 1 << 20)
    assert group.on_wire(2) == IN_FLIGHT  # rank 2 is sent to while rank 1's buckets are still on the wire
    assert not any(w.done for *_, w in group.sent)


def test_the_look_ahead_bounds_what_the_pairs_hold():
    group = Group()
    outs, parts = _pairs(group, 3)
    limit = 2 * 16384  # two experts' bytes
    for i, t in enumerate(parts[1]):
        outs[1].push(f"e1.{i}", t)
        keep_busy(outs.values(), limit)
        assert sum(o.held() for o in outs.values()) <= limit
    done = [w.done for *_, w in group.sent]
    assert any(done), "over the limit the oldest bucket on the wire is waited for"
    assert group.on_wire(1) <= IN_FLIGHT


def test_each_pair_streams_its_wire_manifest_in_order_with_its_seals():
    group = Group()
    outs, parts = _pairs(group, 2)
    for i in range(2):
        for dst in (1, 2):
            outs[dst].push(f"e{dst}.{i}", parts[dst][i])
            keep_busy(outs.values(), 1 << 20)
    keep_busy(outs.values(), 0)
    for out in outs.values():
        out.finish()
    for dst, out in outs.items():
        mine = [(tag, raw) for d, tag, raw, _ in group.sent if d == dst]
        payloads, headers = mine[0::2], mine[1::2]
        n = len(out.wm.buckets)
        assert [t for t, _ in payloads] == [2 * k + 1 for k in range(n)]
        assert [t for t, _ in headers] == [2 * k + 2 for k in range(n)]
        stream = b"".join(raw for _, raw in payloads)
        assert stream == b"".join(t.view(torch.uint8).reshape(-1).numpy().tobytes() for t in parts[dst])
        check = pair_sealer(None, bytes(32), 0, dst, group.device)
        for k, ((_, raw), (_, hdr)) in enumerate(zip(payloads, headers)):
            words = torch.frombuffer(bytearray(hdr), dtype=torch.int64).tolist()
            assert words[:3] == [proto.BUCKET_MAGIC, k, 0]
            assert check.verifies(k, 0, torch.frombuffer(bytearray(raw), dtype=torch.uint8), from_words(words[3:7]))
        assert out.sent == out.wm.total_bytes and out.held() == 0


class _Capture(Exception):
    pass


class SumGroup:
    """One rank's view of the opening all-reduce: captures its contribution, or returns ``total``."""

    device, world_size = torch.device("cpu"), 4

    def __init__(self, rank: int, total: torch.Tensor | None = None) -> None:
        self.rank, self.total, self.given = rank, total, None

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        self.given = t.clone()
        if self.total is None:
            raise _Capture
        return self.total.clone()


def test_the_opening_all_reduce_carries_every_challenge_and_layout():
    """Steps 0 and 1 of a mesh round in one all-reduce (qstrat.transport.mesh.steps.opening): 2 senders,
    2 engine ranks; the sum of what each rank contributes gives every rank the same layouts and
    challenge vector, each engine rank's drawn words and last counter in its own slot."""
    import pytest

    from qstrat.errors import TransportError
    from qstrat.transport.security.auth import CHALLENGE_WORDS
    from qstrat.transport.mesh.steps import LAYOUT_WORDS, opening
    from qstrat.transport.mesh.routing import ReceiverLayout

    layouts = {2: ReceiverLayout(0, 2, kv_heads=2), 3: ReceiverLayout(1, 2, (1, 3), moe_tp=False, kv_heads=2)}
    parts = []
    for rank in range(4):
        g = SumGroup(rank)
        with pytest.raises(_Capture):
            opening(g, 2, layouts.get(rank), last_counter=10 + rank)
        parts.append(g.given)
    assert not parts[0].any() and not parts[1].any()  # a sender writes nothing
    total = sum(parts)
    for rank in range(4):
        got, drawn, ch = opening(SumGroup(rank, total), 2, layouts.get(rank), last_counter=10 + rank)
        assert got == [layouts[2], layouts[3]]
        assert len(ch) == CHALLENGE_WORDS * 4 and ch[:2 * CHALLENGE_WORDS] == (0,) * (2 * CHALLENGE_WORDS)
        for r in (2, 3):
            assert ch[CHALLENGE_WORDS * r + 2] == 10 + r
        if rank < 2:
            assert drawn == ()
        else:  # a fresh draw each call: only its shape is fixed
            assert len(drawn) == 2 and ch[CHALLENGE_WORDS * rank:CHALLENGE_WORDS * rank + 2] != (0, 0)
    bad = total.clone()
    bad[CHALLENGE_WORDS * 4 + LAYOUT_WORDS * 3] = 0x7B7B  # rank 3's JSON no longer parses
    with pytest.raises(TransportError, match="rank 3 published no usable receiver layout"):
        opening(SumGroup(0, bad), 2, None)
    huge = ReceiverLayout(experts=tuple(range(3000)), moe_tp=False)
    with pytest.raises(TransportError, match="rank 2: layout too large"):
        opening(SumGroup(2, total), 2, huge)
