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
