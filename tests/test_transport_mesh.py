"""Mesh rounds (qstrat/transport/mesh*.py, routing.py): two expert-parallel trainer ranks into
engine-less receivers with different shares, each a process on a gloo group over loopback.

The expected share of each receiver is computed HERE, from the single-process driver's output and
the receiver's layout written out by hand (vLLM's TP narrowing: q/k/v/gate/up rows, o/down
columns, half each; experts kept or dropped), not with qstrat.transport.mesh.routing."""
from __future__ import annotations

import pytest
import torch
from mesh_harness import model_and_plans, run_mesh
from transport_harness import free_port

from qstrat.errors import TransportError
from qstrat.transport.security.keys import pair_mac
from qstrat.transport.mesh.routing import MeshRoutes, ReceiverLayout, share_of

SENDERS = 2
#: TP rank 0 and 1 of a TP=2 engine (experts narrowed by TP), and one expert-parallel rank holding
#: the odd experts whole (round-robin placement) under TP rank 1 of 2 for attention.
LAYOUTS = [ReceiverLayout(0, 2), ReceiverLayout(1, 2), ReceiverLayout(1, 2, (1, 3, 5, 7), moe_tp=False)]
#: The fault tests' engine: both ranks of an expert-parallel TP=2 engine (LAYOUTS[2] and its even
#: twin), so that every expert reaches a rank (mesh routes refuse an expert no engine rank holds).
EP_ENGINE = [LAYOUTS[2].to_dict(), ReceiverLayout(0, 2, (0, 2, 4, 6), moe_tp=False).to_dict()]
COLUMN, ROW = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")


def expected_share(single: dict[str, torch.Tensor], layout: ReceiverLayout) -> dict[str, torch.Tensor]:
    """The test's own reading of what one engine rank loads."""
    out = {}
    for name, t in single.items():
        parts = name.split(".")
        expert = int(parts[parts.index("experts") + 1]) if "experts" in parts else None
        if expert is not None and layout.experts is not None and expert not in layout.experts:
            continue
        module = parts[-2]
        dim = 0 if module in COLUMN else 1 if module in ROW else None
        if (dim is None or t.dim() < 2 or t.shape[dim] % 2 or (expert is not None and not layout.moe_tp)):
            out[name] = t
        else:
            half = t.shape[dim] // 2
            out[name] = t.narrow(dim, layout.tp_rank * half, half)
    return out


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() + repr(
        (str(t.dtype), tuple(t.shape))).encode()


@pytest.fixture(scope="module")
def single():
    driver, state, _, _, plan = model_and_plans("mxfp8", SENDERS)
    from conftest import per_expert_view

    return {n: t.clone() for n, t in driver.run(per_expert_view(state), plan=plan)}


def test_two_expert_parallel_senders_give_each_receiver_exactly_its_share(single):
    res = run_mesh(free_port(), "mxfp8", SENDERS, [lay.to_dict() for lay in LAYOUTS])
    assert all(s == "ok" for s, _ in res.values()), res
    full = sum(t.nbytes for t in single.values())
    for i, layout in enumerate(LAYOUTS):
        got, stats = res[SENDERS + i][1]
        want = expected_share(single, layout)
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            assert got[name] == as_bytes(t), name
        share = sum(t.nbytes for t in want.values())
        assert stats["tensor_bytes"] == share  # counted on the receiving side
        assert share <= stats["bytes"] <= share + 64 * len(want)  # alignment padding only
        print(f"rank {SENDERS + i} {layout}: {share} of {full} bytes ({share / full:.1%})")
    tp0 = expected_share(single, LAYOUTS[0])
    sharded = [n for n in single if tp0[n].shape != single[n].shape]
    assert sum(tp0[n].nbytes for n in sharded) * 2 == sum(single[n].nbytes for n in sharded)
    half = sum(single[n].nbytes for n in sharded) // 2
    assert sum(t.nbytes for t in tp0.values()) == full - half  # the rest (embeddings, lm_head, norms) whole
    sent = [res[r][1] for r in range(SENDERS)]  # what each trainer rank sent to each engine rank
    for i in range(len(LAYOUTS)):
        assert sum(s[SENDERS + i] for s in sent) == res[SENDERS + i][1][1]["bytes"]


def test_routing_gives_every_part_once_and_each_output_one_owner(single):
    outputs = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), int("experts.4" in n or "experts.5" in n))
               for n, t in single.items()]
    routes = MeshRoutes(outputs, 2, LAYOUTS, 1 << 16, 64)
    for r, layout in enumerate(LAYOUTS):
        names = [s.name for k in range(2) for s in routes.pair(k, r)]
        assert sorted(names) == sorted(expected_share(single, layout))
        assert [s.name for s in routes.share(r)] == [n for n in single if n in set(names)]  # wire order
    with pytest.raises(TransportError, match="owned by rank 2"):
        MeshRoutes([("a.weight", "bfloat16", (2, 2), 2)], 2, LAYOUTS, 1 << 16, 64)
    assert share_of("model.layers.0.mlp.experts.2.up_proj.weight", "bfloat16", (4, 4), LAYOUTS[2]) is None
    assert pair_mac(None, bytes(32), 0, 2) != pair_mac(None, bytes(32), 1, 2)
    o_proj = share_of("model.layers.0.self_attn.o_proj.weight", "bfloat16", (4, 6), LAYOUTS[1])
    whole = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    assert (o_proj.dim, o_proj.start, o_proj.stop, o_proj.sent) == (1, 3, 6, (4, 3))
    full = o_proj.embed(o_proj.cut(whole).contiguous())  # what vLLM's row-parallel loader narrows
    assert torch.equal(full.narrow(1, 3, 3), whole[:, 3:]) and not full[:, :3].any()


def _refused_everywhere(res: dict, match: str) -> None:
    assert all(s != "ok" for s, _ in res.values()), res
    messages = " | ".join(str(v) for s, v in res.values() if s == "err")
    assert match in messages, messages


def test_a_sender_raising_mid_round_is_refused_everywhere_nothing_loaded():
    res = run_mesh(free_port(), "mxfp8", SENDERS, EP_ENGINE, {1: {"raise_at": 5}})
    assert res[1][0] == "err" and "KeyError" in res[1][1] and "trainer-side failure" in res[1][1]
    assert res[2][0] == "err" and "nothing loaded" in res[2][1], res[2]
    assert res[0][0] == "err" and "nothing loaded" in res[0][1]


def test_a_sender_killed_mid_round_is_refused_everywhere_nothing_loaded():
    res = run_mesh(free_port(), "mxfp8", SENDERS, EP_ENGINE, {0: {"kill_at": 5}})
    assert res[0] == ("dead", 17)
    for r in (1, 2, 3):
        assert res[r][0] == "err" and "TransportError" in res[r][1], res[r]


def test_a_flipped_byte_on_one_pair_is_refused_everywhere_nothing_loaded():
    res = run_mesh(free_port(), "mxfp8", SENDERS, EP_ENGINE, {1: {"flip_to": 2}})
    assert "bucket 0/" in res[2][1] and "from rank 1 failed its checksum" in res[2][1], res[2]
    _refused_everywhere(res, "nothing loaded")


def test_a_sender_without_the_secret_is_refused_before_any_data():
    res = run_mesh(free_port(), "mxfp8", SENDERS, EP_ENGINE, {1: {"no_secret": True}})
    _refused_everywhere(res, "refused before any data")
    assert "TransferAuthError" in res[0][1] or "TransferAuthError" in res[1][1], res


def test_a_sender_routing_another_share_than_the_receiver_loads_is_refused_before_any_data():
    res = run_mesh(free_port(), "mxfp8", SENDERS, [LAYOUTS[0].to_dict()], {1: {"whole_shares": True}})
    assert res[2][0] == "err" and "trainer rank 1 would send another share" in res[2][1], res[2]
    assert "WireManifestMismatchError" in res[0][1] and "refused before any data" in res[0][1], res[0]
    _refused_everywhere(res, "refused before any data")


@pytest.mark.parametrize("senders,receivers", [(1, 2), (2, 4), (4, 2), (4, 4)])
def test_the_mesh_benchmark_moves_one_expert_per_pair(senders, receivers):
    """scripts/bench_transport.py --mesh-links: its busiest-link figure (max(S, R) x pair bytes)
    holds only if every (sender, engine rank) pair carries exactly one pair-sized expert."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from mesh_links import mesh_outputs_synthetic

    pair = 3 * 2048 * 64  # bytes; a multiple of the 64-byte alignment: no padding
    outputs = mesh_outputs_synthetic(senders, receivers, pair)
    layouts = [ReceiverLayout(experts=tuple(s * receivers + r for s in range(senders)), moe_tp=False)
               for r in range(receivers)]
    routes = MeshRoutes(outputs, senders, layouts, 4 << 20, 64)
    for s in range(senders):
        for r in range(receivers):
            (part,) = routes.pair(s, r)
            assert part.name == f"model.layers.0.mlp.experts.{s * receivers + r}.down_proj.weight"
            assert routes.pair_manifest(s, r).total_bytes == pair
    assert routes.bytes_per_receiver() == [senders * pair] * receivers
    assert routes.full_bytes() == senders * receivers * pair


@pytest.mark.parametrize("mode", ["atomic", "bounded"])
def test_an_engine_session_is_handed_whole_shaped_tensors_holding_exactly_its_slice(single, mode):
    """The vLLM backend's receiver (ReceiverSession's mesh round, qstrat/transport/mesh/engine.py):
    its loader gets every tensor in the whole shape (what vLLM's weight loaders narrow by TP rank),
    the received slice where TP rank 1 of 2 narrows, zeros elsewhere; bytes counted on receipt.
    Bounded (qstrat/transport/mesh/bounded.py): the same, unit by unit as the pieces arrive."""
    layout = LAYOUTS[1]
    res = run_mesh(free_port(), "mxfp8", SENDERS, [layout.to_dict()],
                   {SENDERS: {"session": mode}, **{r: {"mode": mode} for r in range(SENDERS)}})
    assert all(s == "ok" for s, _ in res.values()), res
    loaded, stats = res[SENDERS][1]
    part = expected_share(single, layout)
    assert sorted(loaded) == sorted(single)
    for name, whole in single.items():
        want = whole
        if part[name].shape != whole.shape:
            dim = next(d for d in range(whole.dim()) if part[name].shape[d] != whole.shape[d])
            want = torch.zeros_like(whole)
            want.narrow(dim, layout.tp_rank * part[name].shape[dim], part[name].shape[dim]).copy_(part[name])
        assert loaded[name] == (str(want.dtype), tuple(want.shape), want.contiguous().view(torch.uint8).reshape(
            -1).numpy().tobytes()), name
    assert stats["tensor_bytes"] == sum(t.nbytes for t in part.values())


def test_an_engine_session_refuses_a_mesh_round_whose_mode_is_not_its_routes_before_any_data():
    res = run_mesh(free_port(), "mxfp8", SENDERS, [LAYOUTS[1].to_dict()],
                   {SENDERS: {"session": "bounded", "doc_mode": "atomic"}})
    assert "update_info names mode 'bounded', its routes are atomic's" in res[SENDERS][1], res[SENDERS]
    _refused_everywhere(res, "refused before any data")


def test_rank_0_ends_exactly_the_update_sessions_a_dead_rank_0_left_open():
    """The new rank 0 of a mesh group calls finish_weight_update on each engine ALL of whose ranks
    reported an open update session when the group formed (group ranks: 2 trainers, a TP=2 engine
    on 2 and 3, a TP=1 engine on 4), once; an engine open on some of its ranks only is refused
    by name (a finish failing on some of its workers would leave vLLM's stale answers)."""
    from qstrat.transport.mesh.refit import MeshRefitSender

    class Client:
        def __init__(self):
            self.finished = 0

        def finish_weight_update(self):
            self.finished += 1

    clients = [Client(), Client()]
    sender = MeshRefitSender(0, 2, "127.0.0.1", 1, clients, [2, 1], secret=b"k" * 32)
    assert [sender.engine_ranks(i) for i in (0, 1)] == [[2, 3], [4]]
    sender._to_end = [2, 3]
    sender._end_left_open()
    sender._end_left_open()  # once per group
    assert [c.finished for c in clients] == [1, 0]
    sender._to_end = [3, 4]
    with pytest.raises(TransportError, match=r"^engine 0: the update session of a previous round is open on ranks "
                                             r"\[3\] only, of \[2, 3\]: restart that engine$"):
        sender._end_left_open()
    assert [c.finished for c in clients] == [1, 0]
