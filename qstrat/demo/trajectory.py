"""A trainer's trajectory for the tiny model: real Adam steps, the bf16 state dict after each.

What the delta tests, ``scripts/bench_transport.py --delta`` and the churn study
(:mod:`qstrat.transport.delta_churn`) refit: weights that move as an RL step moves them.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def adam_trajectory(model: Any, lr: float, steps: int, seed: int = 0) -> Iterator[dict]:
    """Real optimizer steps on a copy of ``model`` (a transformers causal LM): float32 master
    weights, ``torch.optim.Adam(lr)``, next-token loss on seeded random tokens. Yields the bf16
    state dict (what a trainer refits from) before the first step and after each of ``steps``."""
    import copy

    master = copy.deepcopy(model).float().train()
    opt = torch.optim.Adam(master.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    vocab = master.config.vocab_size

    def bf16() -> dict:
        return {n: t.detach().to(torch.bfloat16).clone() for n, t in master.state_dict().items()}

    yield bf16()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 32), generator=g)
        loss = master(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield bf16()
