"""Which part of each checkpoint tensor one rank of a vLLM engine loads (the routing model's
receiving side; read from vLLM's model and layer code, not assumed).

vLLM hands every TP rank the full checkpoint tensor and its weight loader narrows it:

* ``ColumnParallelLinear`` / ``MergedColumnParallelLinear`` (``q_proj``, ``q_b_proj``,
  ``kv_b_proj``, ``gate_proj``, ``up_proj``; ``vllm/model_executor/layers/linear.py``,
  ``weight_loader``: ``output_dim``, dim 0): rank ``k`` loads rows ``[k * N / tp, (k + 1) * N / tp)``;
* ``QKVParallelLinear``'s ``k_proj`` / ``v_proj``: the same with ``min(tp, num_key_value_heads)``
  parts, a part shared by ``tp / num_key_value_heads`` ranks when the TP size exceeds the KV
  heads (``num_kv_head_replicas``, ``shard_rank = tp_rank // num_kv_head_replicas``);
* ``RowParallelLinear`` (``o_proj``, ``down_proj``; ``input_dim``, dim 1): columns
  ``[k * K / tp, ...)``;
* ``VocabParallelEmbedding`` / ``ParallelLMHead`` (``embed_tokens``, ``lm_head``, the MTP layer's
  ``shared_head.head``; ``vocab_parallel_embedding.py``): rows ``[k * P / tp, (k + 1) * P / tp)``
  of the vocabulary padded to a multiple of 64 (``pad_vocab_size``), cut at the real size;
* ``FusedMoE`` (``layers/fused_moe/layer.py``, ``_load_w13`` dim 0 / ``_load_w2`` dim 1) without
  expert parallelism: each expert's ``gate_proj`` / ``up_proj`` narrowed on dim 0 and
  ``down_proj`` on dim 1 by TP rank; with it (``enable_expert_parallel``, the MoE TP size becomes
  1): the whole expert to the one rank ``determine_expert_map`` gives it
  (``fused_moe/expert_map_manager.py``: ``linear``, rank ``r`` holds ``E // ep`` experts from
  ``r * (E // ep) + min(r, E % ep)``, the first ``E % ep`` ranks one more; ``round_robin``: experts
  ``e`` with ``e % ep == r``);
* everything else whole on every rank: norms, routers (``ReplicatedLinear``), DeepSeek's
  ``q_a_proj`` / ``kv_a_proj_with_mqa`` (``fused_qkv_a_proj``, ``disable_tp=True``, and
  ``ReplicatedLinear``), the MTP layer's ``eh_proj`` (``nn.Linear``).

A scale tensor is cut like its weight on the same dim (vLLM's block / group scale parameters
carry the weight's ``output_dim`` / ``input_dim``); a tensor without that dim, or of one element
(NVFP4's ``weight_scale_2``, ``input_scale``), is loaded whole.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from qstrat.plan.cluster_layout import EngineLayout
from qstrat.plan.data import OutputTensor, PlanEntry

#: Module name (its last segment) -> the dim vLLM's loader narrows by TP rank.
COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "q_b_proj", "kv_b_proj", "gate_proj",
                    "up_proj", "gate_up_proj"})
ROW = frozenset({"o_proj", "down_proj"})
VOCAB = frozenset({"embed_tokens", "lm_head", "head"})
KV_HEADS = frozenset({"k_proj", "v_proj"})
#: Expert projections: FusedMoE's w13 (dim 0) and w2 (dim 1).
EXPERT_DIM = {"gate_proj": 0, "up_proj": 0, "w1": 0, "w3": 0, "gate_up_proj": 0, "down_proj": 1, "w2": 1}
#: ``vllm/model_executor/layers/vocab_parallel_embedding.py``: DEFAULT_VOCAB_PADDING_SIZE.
VOCAB_PADDING = 64


@functools.lru_cache(maxsize=16)
def expert_ranks(placement: str, ep: int, num_experts: int) -> tuple[int, ...]:
    """The rank holding each global expert, by vLLM's ``determine_expert_map`` rule (module
    docstring); ``num_experts`` ints in ``[0, ep)``."""
    if placement == "round_robin":
        return tuple(e % ep for e in range(num_experts))
    base, extra = divmod(num_experts, ep)
    owners: list[int] = []
    for r in range(ep):
        owners += [r] * (base + (1 if r < extra else 0))
    return tuple(owners)


def kv_head_part(tp_rank: int, tp_size: int, kv_heads: int) -> int:
    """The KV head TP rank ``tp_rank`` loads where ``tp_size`` exceeds ``kv_heads``: vLLM's
    ``QKVParallelLinear`` replicates each head on ``tp_size / kv_heads`` ranks and a rank loads
    head ``tp_rank // num_kv_head_replicas``."""
    return tp_rank // (tp_size // kv_heads)


def _rows(n: int, parts: int, part: int) -> int:
    """Rows of part ``part`` when ``n`` rows are cut into ``parts`` of ``ceil(n / parts)``."""
    size = -(-n // parts)
    low = min(n, part * size)
    return min(n, low + size) - low


@dataclass(frozen=True)
class EngineShards:
    """Bytes each TP rank of one engine replica loads of a checkpoint tensor.

    Attributes: layout (the engines), num_key_value_heads (config.json; None: no KV-head rule),
    num_experts (routed experts per MoE layer; needed with ``layout.ep``).
    """

    layout: EngineLayout
    num_key_value_heads: int | None = None
    num_experts: int | None = None

    def loads(self, entry: PlanEntry, out: OutputTensor) -> tuple[int, ...]:
        """Bytes of ``out`` (an output of ``entry``) loaded by TP ranks ``0..tp-1`` of a replica
        (the same for every replica). Raises: ValueError for an expert output without an expert
        index under expert parallelism (a fused slab: plan per-expert outputs)."""
        tp = self.layout.tp
        module = out.name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        if entry.kind == "expert" and module in EXPERT_DIM:
            if self.layout.ep:
                return self._expert_owner(entry, out)
            return self._narrow(out, EXPERT_DIM[module], tp, range(tp))
        if module in VOCAB and out.suffix == "weight":
            return self._vocab(out)
        if module in KV_HEADS and self.num_key_value_heads and tp > self.num_key_value_heads:
            heads = self.num_key_value_heads
            return self._narrow(out, 0, heads, [kv_head_part(k, tp, heads) for k in range(tp)])
        if module in COLUMN:
            return self._narrow(out, 0, tp, range(tp))
        if module in ROW:
            return self._narrow(out, 1, tp, range(tp))
        return (out.nbytes,) * tp

    def _narrow(self, out: OutputTensor, dim: int, parts: int, part_of_rank) -> tuple[int, ...]:
        n_elems = 1
        for s in out.shape:
            n_elems *= s
        if len(out.shape) <= dim or n_elems <= 1:
            return (out.nbytes,) * self.layout.tp
        per_row = out.nbytes // out.shape[dim]
        return tuple(per_row * _rows(out.shape[dim], parts, p) for p in part_of_rank)

    def _vocab(self, out: OutputTensor) -> tuple[int, ...]:
        tp, n = self.layout.tp, out.shape[0]
        per = -(-n // VOCAB_PADDING) * VOCAB_PADDING // tp
        per_row = out.nbytes // n
        return tuple(per_row * (min(n, (k + 1) * per) - min(n, k * per)) for k in range(tp))

    def _expert_owner(self, entry: PlanEntry, out: OutputTensor) -> tuple[int, ...]:
        expert = out.expert if out.expert is not None else entry.expert
        if expert is None or self.num_experts is None:
            raise ValueError(f"{out.name}: an expert output without its expert index (a fused slab?): "
                             "expert parallelism routes per-expert outputs; plan expert_emission: per_expert")
        owner = expert_ranks(self.layout.placement, self.layout.tp, self.num_experts)[expert]
        return tuple(out.nbytes if k == owner else 0 for k in range(self.layout.tp))
