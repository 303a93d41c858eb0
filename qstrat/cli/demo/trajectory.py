"""A trainer's trajectory for the tiny model: real Adam steps, the bf16 state dict after each.

What the delta tests, ``scripts/bench_transport.py --delta`` and the churn study
(:mod:`qstrat.transport.delta.churn`) refit: weights that move as an RL step moves them.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

#: Sequences per step and tokens per sequence of a step's batch.
BATCH, SEQ_LEN = 2, 32


def text_tokens(text: str | None = None) -> torch.Tensor:
    """A fixed token stream of real text: the UTF-8 bytes of ``text`` as token ids (0-255; any
    vocabulary of >= 256 ids holds them), default the Zen of Python (the standard library's
    ``this`` module, unchanged since Python 2.2: the same 856 bytes on every machine).

    Returns: int64 [n] (n = the text's byte length). Raises: ValueError for an empty text."""
    if text is None:
        import codecs
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the text
            import this
        text = codecs.decode(this.s, "rot13")
    data = text.encode()
    if not data:
        raise ValueError("text_tokens: the text is empty (a token stream needs at least one byte)")
    return torch.tensor(list(data), dtype=torch.int64)


def adam_trajectory(model: Any, lr: float, steps: int, seed: int = 0,
                    tokens: torch.Tensor | None = None) -> Iterator[dict]:
    """Real optimizer steps on a copy of ``model`` (a transformers causal LM): float32 master
    weights, ``torch.optim.Adam(lr)``, next-token loss on a batch of :data:`BATCH` sequences of
    :data:`SEQ_LEN` tokens per step: seeded random tokens (``seed``), or consecutive windows of
    ``tokens`` (int64 [n], e.g. :func:`text_tokens`; step s reads ids s*64 ... s*64+63, wrapping
    around). Yields the bf16 state dict (what a trainer refits from) before the first step and
    after each of ``steps``.

    Raises: ValueError when ``tokens`` is empty or holds ids outside the model's vocabulary."""
    import copy

    master = copy.deepcopy(model).float().train()
    opt = torch.optim.Adam(master.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    vocab = master.config.vocab_size
    if tokens is not None and (tokens.numel() == 0 or int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"adam_trajectory: tokens must be a non-empty stream of ids in [0, {vocab}) "
                         f"(the model's vocab_size); got {tokens.numel()} ids"
                         + (f" in [{int(tokens.min())}, {int(tokens.max())}]" if tokens.numel() else ""))

    def bf16() -> dict:
        return {n: t.detach().to(torch.bfloat16).clone() for n, t in master.state_dict().items()}

    yield bf16()
    for step in range(steps):
        if tokens is None:
            ids = torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=g)
        else:
            at = step * BATCH * SEQ_LEN + torch.arange(BATCH * SEQ_LEN)
            ids = tokens[at % tokens.numel()].reshape(BATCH, SEQ_LEN)
        loss = master(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield bf16()
