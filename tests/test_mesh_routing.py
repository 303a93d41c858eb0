"""qstrat.transport.mesh.routing without processes: the share each engine rank loads, against vLLM's
loaders' rules written out here (QKVParallelLinear's KV-head replication: ``shard_rank = tp_rank //
num_kv_head_replicas``), and the layouts a rank may publish (a malformed one is refused, naming
the field)."""
from __future__ import annotations

import pytest

from qstrat.errors import TransportError
from qstrat.transport.mesh.routing import ReceiverLayout, share_of

K = "model.layers.0.self_attn.k_proj.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_kv_heads_replicated_when_tp_exceeds_them(tp):
    """2 KV heads of 4 rows each (k_proj [8, 16]): with tp > 2 every KV head is loaded by tp / 2
    ranks, rank r loading head r // (tp / 2); q_proj (no replication) is cut per rank."""
    kv_heads, head_rows = 2, 4
    for rank in range(tp):
        layout = ReceiverLayout(rank, tp, kv_heads=kv_heads)
        head = rank // (tp // kv_heads) if tp > kv_heads else None
        got = share_of(K, "bfloat16", (kv_heads * head_rows, 16), layout)
        if head is None:  # tp == kv_heads: one head per rank
            assert (got.start, got.stop) == (rank * head_rows, (rank + 1) * head_rows)
        else:
            assert (got.dim, got.start, got.stop) == (0, head * head_rows, (head + 1) * head_rows), (rank, got)
        q = share_of(Q, "bfloat16", (8 * tp, 16), layout)
        assert (q.start, q.stop) == (rank * 8, (rank + 1) * 8)


def test_kv_heads_unknown_cuts_per_rank():
    """Without kv_heads the layout says tp does not exceed them: k/v are cut per rank."""
    got = share_of(K, "bfloat16", (8, 16), ReceiverLayout(3, 4))
    assert (got.start, got.stop) == (6, 8)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"tp_rank": 2, "tp_size": 2}, "tp_rank 2 outside tp_size 2"),
    ({"tp_rank": 1.9, "tp_size": 2}, "tp_rank 1.9 is not a non-negative int"),
    ({"tp_rank": True, "tp_size": 2}, "tp_rank True is not a non-negative int"),
    ({"experts": (1, 1), "moe_tp": False}, r"experts \(1, 1\) must be distinct"),
    ({"experts": (-1, 3), "moe_tp": False}, r"experts \(-1, 3\) must be distinct non-negative"),
    ({"tp_rank": 0, "tp_size": 2, "experts": (0, 1)}, "holds them whole: set moe_tp=False"),
    ({"moe_tp": "false"}, "moe_tp 'false' is not a bool"),
    ({"tp_rank": 0, "tp_size": 6, "kv_heads": 4}, "tp_size 6 is not a multiple of kv_heads 4"),
])
def test_malformed_layouts_are_refused_naming_the_field(kwargs, reason):
    with pytest.raises(TransportError, match=reason):
        ReceiverLayout(**kwargs)


def test_layout_document_round_trip_sorts_experts_and_refuses_coercion():
    layout = ReceiverLayout(1, 2, (5, 1, 3), moe_tp=False, kv_heads=4)
    assert layout.experts == (1, 3, 5)
    assert ReceiverLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(TransportError, match="malformed receiver layout"):
        ReceiverLayout.from_dict({**layout.to_dict(), "experts": "123"})
    with pytest.raises(TransportError, match="tp_rank"):
        ReceiverLayout.from_dict({**layout.to_dict(), "tp_rank": "1"})


# ---- bad routing inputs are refused naming what (adversarial run, branch attack) ---------------

from qstrat.transport.mesh.routing import MeshRoutes, mesh_outputs  # noqa: E402

_E = "model.layers.0.mlp.experts.{}.down_proj.weight"
_OUTS = [(_E.format(e), "bfloat16", (8, 8), e % 2) for e in range(4)] + [("model.norm.weight", "bfloat16", (8,), 0)]


@pytest.mark.parametrize("kwargs, reason", [
    ({"experts": 3, "moe_tp": False}, "experts 3 must be a sequence of expert indices"),  # was: TypeError
    ({"tp_size": 2, "kv_heads": 0}, "kv_heads 0 is not a positive int"),  # was: accepted, read as unknown
])
def test_more_malformed_layouts(kwargs, reason):
    with pytest.raises(TransportError, match=f"^receiver layout: {reason}"):
        ReceiverLayout(**kwargs)


@pytest.mark.parametrize("outputs, senders, layouts, reason", [
    (_OUTS, 0, [ReceiverLayout()], "senders must be a positive int (the trainer ranks), got 0"),
    ([], -1, [ReceiverLayout()], "senders must be a positive int (the trainer ranks), got -1"),  # was: accepted
    (_OUTS, "2", [ReceiverLayout()], "senders must be a positive int (the trainer ranks), got '2'"),  # TypeError
    (_OUTS, 2, [{"tp_rank": 0}], "engine rank 0's layout is a dict, not a ReceiverLayout"),  # AttributeError
    ([("a.b.c", "bfloat16", (2,))], 1, [ReceiverLayout()],
     "an output must be (name, dtype, shape, owner), got ('a.b.c', 'bfloat16', (2,))"),  # ValueError
    ([("a.b.c", "bfloat16", (-2,), 0)], 1, [ReceiverLayout()], "a.b.c: shape [-2] must be non-negative ints"),
    ([("a.b.c", "bfloat16", (2,), 0.5)], 1, [ReceiverLayout()], "a.b.c: owner 0.5 is not a sender rank (an int)"),
    # expert 3 held by neither rank: it reached no engine, silently
    (_OUTS, 2, [ReceiverLayout(0, 1, (0, 1), False), ReceiverLayout(0, 1, (1, 2), False)],
     f"{_E.format(3)}: expert 3 is held by no engine rank (the layouts hold experts [0, 1, 2]); "
     "it would reach no engine"),
])
def test_bad_routes_are_refused_naming_what(outputs, senders, layouts, reason):
    with pytest.raises(TransportError) as exc:
        MeshRoutes(outputs, senders, layouts, 1 << 20, 256)
    assert str(exc.value) == f"mesh routes: {reason}"


def test_routes_that_cover_every_expert_and_a_pair_outside_the_round():
    layouts = [ReceiverLayout(0, 1, (0, 1), False), ReceiverLayout(0, 1, (2, 3), False)]
    routes = MeshRoutes(_OUTS, 2, layouts, 1 << 20, 256)
    assert [s.name for s in routes.share(1)] == [_E.format(2), _E.format(3), "model.norm.weight"]
    # an expert held twice (two engines, or redundant experts) is valid
    assert len(MeshRoutes(_OUTS, 2, [ReceiverLayout(), layouts[1]], 1 << 20, 256).share(0)) == 5
    with pytest.raises(TransportError, match=r"^mesh routes: no pair \(sender 0, engine rank 5\): the round has "
                                             r"2 senders and 2 engine ranks$"):
        routes.pair(0, 5)


def test_mesh_outputs_refuses_an_owner_that_is_no_rank():
    class Out:
        name, dtype, shape = "x.y.weight", "bfloat16", (2,)

    class Plan:
        entries = [object()]

        def wire_order(self):
            return [(0, Out())]

    assert mesh_outputs(Plan(), lambda e: 1) == [("x.y.weight", "bfloat16", (2,), 1)]
    for owner in (None, 1.7, True):  # int(1.7) routed it to rank 1
        with pytest.raises(TransportError, match=rf"^mesh outputs: the owner of x.y.weight must be a sender rank "
                                                 rf"\(an int\), got {owner!r}$"):
            mesh_outputs(Plan(), lambda e, o=owner: o)


def test_a_bounded_rounds_staged_bytes_takes_numpy_ints_and_refuses_what_is_not_a_positive_integer():
    """``staged_bytes`` computed with numpy (an ``np.int64``) is a valid bound (it was refused);
    the routes document holds a plain int."""
    import numpy as np

    from qstrat.transport.mesh.bounded import BoundedRoutes

    routes = BoundedRoutes(_OUTS, 2, [ReceiverLayout()], 1 << 20, 256, staged_bytes=np.int64(1 << 20))
    assert routes.staged_bytes == 1 << 20 and type(routes.staged_bytes) is int
    assert routes.to_dict()["staged_bytes"] == 1 << 20
    for bad in (0, -5, True, 1.5, "4096", np.float64(4096)):
        with pytest.raises(TransportError) as exc:
            BoundedRoutes(_OUTS, 2, [ReceiverLayout()], 1 << 20, 256, staged_bytes=bad)
        assert str(exc.value) == f"mesh bounded round: staged_bytes must be a positive int (bytes) or None, got {bad!r}"
