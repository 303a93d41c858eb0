"""The routing model of a refit at cluster scale: bytes per link, from the plan alone.

The mesh rule: every output tensor is sent once from the one trainer rank that owns it to every
engine rank that loads it, only the part that rank loads (:class:`qstrat.plan.engine_shards.
EngineShards`), to every engine replica. Ownership is per plan entry (an input tensor is quantized
once, by one rank, and all its outputs leave from there): a routed expert's entry belongs to the
FSDP ranks of the expert-parallel group holding the expert (:class:`qstrat.execute.sharding.
ExpertParallel`), any other entry (replicated across expert-parallel groups) to any trainer rank;
within those candidates the rank with the fewest outgoing bytes so far takes it, entries taken
largest first (greedy longest-processing-time balance; expert entries first).

A link is one GPU's NIC: a trainer rank's outgoing link carries what it sends, an engine rank's
incoming link what it loads. The round is bound by the busiest link: ``bytes * 8 / (rate *
efficiency)`` seconds, ``efficiency`` the fraction of the nominal rate a point-to-point stream
achieves (measured by scripts/bench_transport.py ``--mesh-links``).

Today's round, for comparison: trainer rank 0 holds the whole payload ``P`` (after an FSDP
``full_tensor()`` / expert gather, not counted here) and ``torch.distributed.broadcast``s every
bucket to all ``R`` engine ranks. Its busiest link is the sender's, carrying ``P`` times the
copies it sends: ``R`` when the broadcast is flat (the root sends each receiver its copy),
``ceil(log2(R + 1))`` for a binomial tree over the ``R + 1`` ranks (gloo's broadcast: measured,
docs/transport.md), ``1`` when it is pipelined through the receivers (NCCL's ring / chain: every
link carries ``P`` once, the bound of any single-sender scheme).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

from qstrat.errors import PlanError
from qstrat.layouts.config_facts import num_experts as config_experts
from qstrat.layouts.model_config import ModelConfig
from qstrat.plan.cluster_layout import EngineLayout, TrainerLayout
from qstrat.plan.data import RefitPlan
from qstrat.plan.engine_shards import EngineShards
from qstrat.execute.sharding import ExpertParallel


@dataclass(frozen=True)
class ClusterRound:
    """Bytes per link of one mesh round (exact, from the plan's output sizes).

    Attributes:
        trainer, engine: the layouts.
        payload: bytes of one copy of the model (every output tensor once).
        sent: bytes each trainer rank sends (``trainer.world`` ints; its outgoing link).
        received: bytes each TP rank of one engine replica loads (``engine.tp`` ints; every replica
            receives the same; its incoming link).
    """

    trainer: TrainerLayout
    engine: EngineLayout
    payload: int
    sent: tuple[int, ...]
    received: tuple[int, ...]

    def busiest(self) -> tuple[str, int]:
        """``(which, bytes)`` of the link carrying the most: ``trainer rank s`` or ``engine rank k``."""
        s = max(range(len(self.sent)), key=self.sent.__getitem__)
        k = max(range(len(self.received)), key=self.received.__getitem__)
        if self.sent[s] >= self.received[k]:
            return f"trainer rank {s} (out)", self.sent[s]
        return f"engine tp rank {k} (in)", self.received[k]

    def seconds(self, rate_bps: float, efficiency: float = 1.0) -> float:
        """Link-bound round time: the busiest link's bytes at ``rate_bps * efficiency`` bits/s."""
        return self.busiest()[1] * 8 / (rate_bps * efficiency)

    def broadcast_bytes(self, kind: str) -> int:
        """Bytes on today's busiest link (the single sender's) for a broadcast ``kind``:
        ``pipelined`` ``P``, ``tree`` ``P * ceil(log2(R + 1))``, ``flat`` ``P * R`` (module docstring).
        Raises: ValueError for another kind."""
        copies = {"pipelined": 1, "tree": self.engine.world.bit_length(), "flat": self.engine.world}
        if kind not in copies:
            raise ValueError(f"broadcast kind {kind!r}: expected one of {', '.join(copies)}")
        return self.payload * copies[kind]


#: Config keys that may hold the routed expert count, the first set wins (DeepSeek, Qwen, Mixtral).
ROUTED_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def check_engine_tp(tp: int, model_config: Any) -> None:
    """Refuse a TP size vLLM refuses for this model (its ``ModelConfig.verify_with_parallel_config``
    and ``QKVParallelLinear``): ``num_attention_heads`` divisible by ``tp``, and ``tp`` and
    ``num_key_value_heads`` one a multiple of the other (KV heads split, or each replicated on
    ``tp / num_key_value_heads`` ranks). Heads absent from the config: nothing to check.
    ``model_config``: a :class:`~qstrat.layouts.model_config.ModelConfig` or config.json content.

    Raises: PlanError naming the config key, its value and the TP size."""
    config = ModelConfig.of(model_config)
    heads, kv = config.known("num_attention_heads"), config.num_key_value_heads
    if heads and heads % tp:
        raise PlanError(f"--engine-layout tp{tp}: num_attention_heads {heads} is not divisible by {tp} "
                        "(vLLM refuses such an engine)")
    if kv and (kv % tp if tp <= kv else tp % kv):
        raise PlanError(f"--engine-layout tp{tp}: num_key_value_heads {kv} and tp {tp}: one must divide the "
                        "other (vLLM splits the KV heads over TP ranks, or replicates each on tp / "
                        "num_key_value_heads ranks)")


def route(plan: RefitPlan, trainer: TrainerLayout, engine: EngineLayout,
          model_config: Any = None) -> ClusterRound:
    """Bytes per link of a mesh round of ``plan`` from ``trainer`` to ``engine`` (module docstring).

    ``model_config`` (a :class:`~qstrat.layouts.model_config.ModelConfig`, config.json content, or None)
    gives ``num_key_value_heads`` (vLLM's KV-head replication) and the routed expert count (else
    the plan's largest expert index + 1).
    Raises: PlanError when the trainer's expert parallelism does not divide the experts, or the
        engine's TP size is one vLLM refuses for this model (:func:`check_engine_tp`);
        ValueError for an expert output without an expert index under engine EP.
    """
    config = ModelConfig.of(model_config)
    experts = [e.expert for e in plan.entries if e.kind == "expert" and e.expert is not None]
    num_experts = (config_experts(config, ROUTED_EXPERT_KEYS) or (max(experts) + 1 if experts else None))
    check_engine_tp(engine.tp, config)
    shards = EngineShards(engine, config.num_key_value_heads, num_experts)
    received = [0] * engine.tp
    jobs: list[tuple[int, int, int | None]] = []  # (bytes sent, entry index, EP group or None)
    ep = ExpertParallel(trainer.ep, num_experts) if trainer.ep > 1 else None
    payload = 0
    for i, entry in enumerate(plan.entries):
        total = 0
        for out in entry.outputs:
            payload += out.nbytes
            for k, b in enumerate(shards.loads(entry, out)):
                received[k] += b
                total += b
        group = ep.owner(entry) if ep is not None and entry.kind == "expert" else None
        jobs.append((total * engine.dp, i, group))
    return ClusterRound(trainer, engine, payload, tuple(_balance(jobs, trainer)), tuple(received))


def _balance(jobs: list[tuple[int, int, int | None]], trainer: TrainerLayout) -> list[int]:
    """Outgoing bytes per trainer rank after the greedy owner choice (module docstring)."""
    sent = [0] * trainer.world
    grouped = sorted((j for j in jobs if j[2] is not None), key=lambda j: (-j[0], j[1]))
    heaps = {g: [(0, g * trainer.fsdp + f) for f in range(trainer.fsdp)] for g in range(trainer.ep)}
    for size, _, group in grouped:
        load, rank = heapq.heappop(heaps[group])
        sent[rank] = load + size
        heapq.heappush(heaps[group], (sent[rank], rank))
    anywhere = [(sent[r], r) for r in range(trainer.world)]
    heapq.heapify(anywhere)
    for size, _, _ in sorted((j for j in jobs if j[2] is None), key=lambda j: (-j[0], j[1])):
        load, rank = heapq.heappop(anywhere)
        sent[rank] = load + size
        heapq.heappush(anywhere, (sent[rank], rank))
    return sent
