"""NaN/inf checks on weights: one ``torch.aminmax`` reduction screens a tensor, and only a
tensor that holds a non-finite value is read again to name its first bad index."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from qstrat.errors import NonFiniteError


def all_finite(w: torch.Tensor) -> bool:
    """True if ``w`` (any float tensor, any strides) holds no NaN and no +-inf.

    One ``torch.aminmax`` reduction (NaN propagates to both results; an infinity is the max or
    the min), no temporary (why not ``torch.isfinite(w).all()``: docs/performance.md, "Why the
    code does it this way").

    Args: w: float tensor (bf16/fp16/fp32/fp64), any shape, any device. Returns: a Python bool
    (True for an empty tensor, and for integer or bool tensors, which cannot hold NaN/inf). Raises
    nothing.
    """
    if w.numel() == 0:
        return True
    lo, hi = torch.aminmax(w)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def peak_abs(w: torch.Tensor) -> float:
    """The largest magnitude in ``w`` (any float tensor, any strides) as a Python float: 0.0 for
    an empty tensor, ``math.inf`` if it holds a NaN or an infinity. One ``torch.aminmax``
    reduction, as :func:`all_finite` (``all_finite(w) == (peak_abs(w) < inf)``)."""
    if w.numel() == 0:
        return 0.0
    lo, hi = torch.stack(torch.aminmax(w.detach())).float().tolist()  # one device sync
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return math.inf
    return max(-lo, hi)


def check_finite(w3: torch.Tensor, name: str, expert_chunk: int) -> float:
    """Raise NonFiniteError naming ``name`` and the first NaN/inf index of ``w3`` (rank 0 to 3);
    return its largest magnitude (:func:`peak_abs`).

    Screens the whole tensor with :func:`all_finite`; only a tensor that holds a NaN/inf is read
    again, in chunks of ``expert_chunk`` experts, to name the first bad index.

    The index is printed in the tensor's own rank: [E, N, K] ``[e, r, c] (expert, row, col)``
    (also for E = 1), [N, K] ``[r, c] (row, col)``, [K] or [] ``[i]``.
    """
    peak = peak_abs(w3)
    if peak < math.inf:
        return peak
    rank = min(max(w3.dim(), 1), 3)
    w3 = w3.reshape((1,) * (3 - w3.dim()) + tuple(w3.shape)) if w3.dim() < 3 else w3
    for e0 in range(0, w3.shape[0], expert_chunk):
        chunk = w3[e0 : e0 + expert_chunk]
        bad = ~torch.isfinite(chunk)
        if bool(bad.any()):
            e, r, c = (int(i) for i in bad.nonzero()[0])
            value = float(chunk[e, r, c])
            index = ", ".join(str(i) for i in (e0 + e, r, c)[3 - rank:])
            labels = {1: "", 2: " (row, col)", 3: " (expert, row, col)"}[rank]
            raise NonFiniteError(
                f"{name}: non-finite value {value} at index [{index}]{labels}; "
                "set nonfinite='propagate' to encode it anyway"
            )


def check_context(context: Mapping[str, Any], name: str) -> None:
    """Raise NonFiniteError naming ``name`` and the keys of a fusion-group ``context`` (tensors
    shaped [E] or []) whose floating values hold NaN/inf."""
    bad = [k for k, v in context.items() if torch.is_tensor(v) and v.is_floating_point() and not all_finite(v)]
    if bad:
        raise NonFiniteError(f"{name}: the fusion-group context's {', '.join(bad)} is not finite "
                             "(group_context of members holding NaN/inf?); set "
                             "nonfinite='propagate' to encode it anyway")


def check_decoded(ser: Any, parts: Mapping[str, torch.Tensor], name: str, peak: float) -> None:
    """Raise NonFiniteError naming ``name``, the first index and ``peak`` (the input's largest
    magnitude) when ``ser.dequantize(parts)`` (``ser`` a Serializer) holds NaN/inf: finite weights
    the engine would read back as non-finite (a scale rounded up past float32's max, an fp32
    value cast to bfloat16 above its max). Reads the decoded copy (float32, the weight's shape)."""
    decoded = ser.dequantize(parts)
    if all_finite(decoded):
        return
    index = ", ".join(str(int(i)) for i in (~torch.isfinite(decoded)).nonzero()[0])
    raise NonFiniteError(
        f"{name}: its finite values (largest magnitude {peak:.6g}) decode to a non-finite value in "
        f"{ser.name}{options_text(ser.options)} at index [{index}]: a scale or element rounded up past "
        "float32's max (bfloat16's for a cast); scale the weight down, or choose options that do not "
        "round scales up (block_fp8 ue8m0=False, mxfp8 scale_rounding='floor'); set "
        "nonfinite='propagate' to encode it anyway")


def check_emitted_scales(ser: Any, parts: Mapping[str, torch.Tensor], name: str, weight_numel: int) -> None:
    """Raise NonFiniteError naming ``name``, the part and its first bad index when a part a
    format emitted as a SCALE holds NaN/inf: a floating part (fp32/bf16/fp16/fp8) with at most
    an eighth of the weight's elements (one value per block of 8 or more: every built-in scale,
    per-tensor global scales included; code parts have one entry per element or per two).

    Finite weights never give a built-in format a non-finite scale (each floors its block maxima,
    e.g. block FP8's ``max(amax, 1e-4)``); a plugin's ``reference()`` can (``amax / 448`` of an
    all-zero block is 0 and its codes ``0 * inf``), and the engine would load it without a word.
    Reads only the scales (at most 1/8 of the elements, e.g. NVFP4's 1/16): cheap next to the
    quantization.

    A part the format declares raw E8M0 bytes (:attr:`~qstrat.serializers.format_math.FormatMath.
    e8m0_parts`, uint8) is refused where it holds 0xFF, E8M0's NaN (OCP MX v1.0).

    Args: ser: the format (for its name and ``e8m0_parts``); parts: suffix -> tensor as emitted;
        name: the weight's tensor name; weight_numel: elements of the quantized weight.
    Raises: NonFiniteError (``nonfinite='propagate'`` skips this check with the others).
    """
    for suffix, t in parts.items():
        if not is_scale_part(ser, suffix, t, weight_numel) or scale_values_ok(ser, suffix, t):
            continue
        if t.dtype == torch.uint8:  # a raw-E8M0 part
            index = ", ".join(str(int(i)) for i in (t == 0xFF).nonzero()[0])
            raise NonFiniteError(
                f"{name}: serializer {ser.name!r} emitted the E8M0 NaN byte 0xFF in {suffix!r} at index "
                f"[{index}] for finite weights; nothing was sent; set nonfinite='propagate' to encode it anyway")
        index = ", ".join(str(int(i)) for i in (~torch.isfinite(t.float())).nonzero()[0])
        raise NonFiniteError(
            f"{name}: serializer {ser.name!r} emitted a non-finite scale in {suffix!r} at index [{index}] "
            "for finite weights (a plugin's reference() dividing by a zero block maximum?); nothing was "
            "sent; set nonfinite='propagate' to encode it anyway")


def is_scale_part(ser: Any, suffix: str, t: torch.Tensor, weight_numel: int) -> bool:
    """Whether :func:`check_emitted_scales` reads part ``suffix`` (``t``, as emitted) as scales:
    a raw-E8M0 part of ``ser.e8m0_parts`` (uint8), or a floating part of at most an eighth of
    the weight's ``weight_numel`` elements."""
    if suffix in getattr(ser, "e8m0_parts", ()) and t.dtype == torch.uint8:
        return True
    return t.is_floating_point() and t.numel() * 8 <= weight_numel


def scale_values_ok(ser: Any, suffix: str, t: torch.Tensor) -> bool:
    """Whether scale values ``t`` of part ``suffix`` (all of the part, or a subset: a delta
    round's re-encoded blocks) hold no NaN/inf: no 0xFF in a raw-E8M0 part (uint8, E8M0's NaN,
    OCP MX v1.0), no NaN/inf in a floating part (fp8 read in float32). Raises nothing."""
    if suffix in getattr(ser, "e8m0_parts", ()) and t.dtype == torch.uint8:
        return not bool((t == 0xFF).any())
    if not t.is_floating_point():
        return True
    return all_finite(t if t.dtype.itemsize > 1 else t.float())  # fp8 scales: reduce in float32


def options_text(options: Any) -> str:
    """`` with {'ue8m0': True}``: the format ``options`` (a SerializerOptions) set away from their
    defaults (not the common ``backend``/``nonfinite``/``chunk_elements``: they do not change the
    bytes), for messages."""
    changed = options.model_dump(exclude_defaults=True, exclude={"backend", "nonfinite", "chunk_elements"})
    return f" with {changed}" if changed else ""
