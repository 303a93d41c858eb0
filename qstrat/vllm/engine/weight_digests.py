"""Read a running engine's weights back by qstrat's own means: one SHA-256 per tensor of the
worker's model, parameters AND buffers, and the weights vLLM's CPU backend moved out of its
parameters (a router, ``mlp.gate.weight``, included).

On a CPU, vLLM packs the weight of an unquantized linear layer (``UnquantizedLinearMethod``: the
routers of a quantized MoE model, the layers a checkpoint leaves in BF16) into its GEMM kernel
(``layer.cpu_linear``) and leaves ``layer.weight`` an EMPTY parameter; a digest of the parameters
alone (vLLM's ``/weight_checker``) then shows such a weight as unchanged whatever was loaded.
:func:`tensor_digests` reads that weight back through the kernel itself: the kernel applied to
the identity matrix gives ``I @ W.T`` (each output one product ``1 * w``, exact in any
accumulation), transposed and cast to the parameter's dtype.

:class:`WeightDigests` is a vLLM worker extension: a server started with
``--worker-extension-cls qstrat.vllm.engine.weight_digests.WeightDigests`` answers
``POST /collective_rpc {"method": "qstrat_weight_digests"}`` (dev mode,
``VLLM_SERVER_DEV_MODE=1``) with one ``{name: digest}`` per worker; an in-process ``vllm.LLM``
can call :func:`tensor_digests` through ``llm.collective_rpc``. Two engines hold the same
weights when their digests are equal (same names, dtypes, shapes and bytes). The layer
attributes read (the kernel, the input size) are vLLM names of the version table
(:mod:`qstrat.vllm.adapter.names`: ``cpu_linear``, ``linear_input_size_per_partition``,
``linear_input_size``), resolved when digests are taken. Importing this module does not import vLLM.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from qstrat.vllm.adapter.resolver import resolve


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 (hex) of ``tensor``'s dtype, shape and bytes (any dtype, any shape, any device;
    read as contiguous bytes on the host). Two tensors with equal digests have the same dtype,
    shape and bit pattern."""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


#: Rows of the identity applied to a packed kernel at once (bounds the probe's memory).
_PROBE_ROWS = 1024


def _layer_attributes() -> tuple[str, str, str]:
    """The installed vLLM's names of (the CPU kernel, the per-rank input size, the input size).

    Raises: VllmNameError (:func:`qstrat.vllm.adapter.resolve`) where the table lacks one."""
    return (resolve("cpu_linear"), resolve("linear_input_size_per_partition"), resolve("linear_input_size"))


def packed_weight(layer: torch.nn.Module, attributes: tuple[str, str, str] | None = None) -> torch.Tensor | None:
    """The weight, ``(out_features, in_features)`` in the empty parameter's dtype, of a linear
    layer whose weight vLLM's CPU GEMM dispatch packed into ``layer.cpu_linear`` (its ``weight``
    parameter is then empty); None for any other module. Read as ``cpu_linear(I, weight, None).T``
    over the identity ``I`` of ``in_features`` rows (``layer.input_size_per_partition``, else
    ``layer.input_size``), in blocks of :data:`_PROBE_ROWS` rows.

    Args: attributes: :func:`_layer_attributes` (resolved here when None).
    Raises: VllmNameError where the installed vLLM's table entry lacks one of these attributes."""
    kernel_name, per_rank, whole = attributes or _layer_attributes()
    weight = getattr(layer, "weight", None)
    kernel = getattr(layer, kernel_name, None)
    if not isinstance(weight, torch.Tensor) or weight.numel() or not callable(kernel):
        return None
    k = getattr(layer, per_rank, None) or getattr(layer, whole)
    rows = []
    with torch.no_grad():
        for start in range(0, k, _PROBE_ROWS):
            probe = torch.eye(k, dtype=weight.dtype, device=weight.device)[start:start + _PROBE_ROWS]
            rows.append(kernel(probe, weight, None))
    return torch.cat(rows).t().to(weight.dtype)


def tensor_digests(model: torch.nn.Module) -> dict[str, str]:
    """``{name: tensor_digest}`` for every parameter and buffer of ``model`` (``named_parameters``
    and ``named_buffers``, shared tensors once under their first name), where a module's
    ``weight`` was packed into vLLM's CPU kernel the digest of :func:`packed_weight` instead."""
    out = {name: tensor_digest(p) for name, p in model.named_parameters()}
    out.update((name, tensor_digest(b)) for name, b in model.named_buffers() if name not in out)
    attributes = _layer_attributes()
    for name, module in model.named_modules():
        weight = packed_weight(module, attributes)
        if weight is not None:
            out[f"{name}.weight" if name else "weight"] = tensor_digest(weight)
    return out


class WeightDigests:
    """vLLM worker extension (``--worker-extension-cls``): adds
    :meth:`qstrat_weight_digests` to the worker, callable by name through ``collective_rpc``."""

    def qstrat_weight_digests(self) -> dict[str, str]:
        """:func:`tensor_digests` of this worker's model (its shard under tensor parallelism)."""
        from qstrat.vllm.adapter.views import WorkerView

        return tensor_digests(WorkerView(self).model())
