"""A format's math: a BF16 weight to checkpoint parts and back, on the trainer's device.

The job vLLM's quantization package leaves to checkpoint producers and torchao's ``mx_formats``
does for MX: :class:`FormatMath` declares a format's parts from a shape alone
(:meth:`FormatMath.part_specs`, so a refit is planned before a weight is read), quantizes one
weight or grouped slab (:meth:`FormatMath.quantize`: the torch reference, the cache-blocked fast
path, a Triton kernel) and decodes it (:meth:`FormatMath.dequantize`, the test oracle's inverse).
It knows nothing of engines: what vLLM reads is :class:`qstrat.serializers.engine_contract.EngineFormat`,
how vLLM's kernels run on a CPU and who a bench compares with is
:class:`qstrat.serializers.emulation_hooks.EmulationHooks`; :class:`qstrat.serializers.Serializer`
joins the three for a plugin's format.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from qstrat.errors import NonFiniteError
from qstrat.serializers import backend, torch_paths
from qstrat.serializers.chunking import Scratch, cache_chunk_elements
from qstrat.serializers.finite import check_context, check_decoded, check_emitted_scales, check_finite
from qstrat.serializers.parts import Context, PartSpec, check_parts, check_weight_dtype, declared_parts

__all__ = ["FormatMath", "SerializerOptions"]


class SerializerOptions(BaseModel):
    """Options every serializer accepts. Subclasses add format options (``extra`` keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    backend: Literal["auto", "torch", "fast", "triton"] = Field(
        "auto",
        description="auto: Triton kernel for CUDA tensors, the fast torch path otherwise; torch: "
        "the eager torch reference (the oracle); fast: the cache-blocked torch path, bit-identical "
        "to the reference (the reference where a format has none); triton: the kernel.",
    )
    nonfinite: Literal["error", "propagate"] = Field(
        "error", description="error: NaN/inf weights raise NonFiniteError naming tensor and index."
    )
    chunk_elements: int | None = Field(
        None, gt=0,
        description="Torch paths: weight elements per chunk (bounds fp32 scratch); None sizes "
        "chunks for the CPU cache (qstrat.serializers.chunking.cache_chunk_elements).",
    )


class FormatMath(ABC):
    """A quantization format's math. Instances are immutable and cheap; options are validated
    by pydantic.

    Class attributes: ``name`` (registry name), ``Options`` (pydantic options model),
    ``row_tile`` (rows quantized together: the granularity of chunking and of row splits of
    fused weights), ``kernel``, ``decode_check_above`` (below).
    """

    name: ClassVar[str]
    Options: ClassVar[type[SerializerOptions]] = SerializerOptions
    row_tile: ClassVar[int] = 1
    #: Triton implementation ``kernel(serializer, w3: [E, N, K], context) -> parts``: a lazy
    #: ``"module:function"`` reference (imported by :meth:`resolve_kernel` when a backend is
    #: chosen and triton imports), a callable, or None (torch reference only).
    kernel: ClassVar[str | Callable[..., dict[str, torch.Tensor]] | None] = None
    #: With ``nonfinite="error"``, a weight whose largest magnitude exceeds this has its DECODED
    #: values (:meth:`dequantize` of what was emitted) checked too: a finite input near float32's
    #: max can decode to inf after a scale or element is rounded up (block FP8 ``ue8m0``, MXFP8
    #: RCEIL: up to 2x) or cast (BF16 of an fp32 value above bfloat16's max). Below it every
    #: built-in format decodes finitely (no rounding raises a value 4x), so the check costs
    #: nothing on real weights. A format whose decode may grow a value more lowers it.
    decode_check_above: ClassVar[float] = torch.finfo(torch.float32).max / 4
    #: Incremental re-quantization (a delta round's sender, :mod:`qstrat.transport.delta.requantize`):
    #: the (rows, columns) of weight one stored scale covers, the part holding those scales
    #: (one per block, in block order), and the codes one byte of ``weight`` holds (2: packed
    #: nibbles). A format that sets ``scale_block`` implements :meth:`block_scales` and
    #: :meth:`codes`, the same two functions its :meth:`reference` and :meth:`encode_into` call;
    #: None (the default, e.g. a plugin's format): every round quantizes it whole.
    scale_block: ClassVar[tuple[int, int] | None] = None
    scale_part: ClassVar[str] = ""
    codes_per_byte: ClassVar[int] = 1
    #: Parts stored as raw E8M0 bytes (uint8), where byte 0xFF is NaN (OCP Microscaling Formats
    #: v1.0, E8M0): :func:`qstrat.serializers.finite.check_emitted_scales` refuses it there.
    e8m0_parts: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: Any) -> None:
        """Raises: pydantic.ValidationError on unknown or invalid options."""
        self.options = self.Options(**options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"

    # ---- declared by formats -------------------------------------------------------------
    @abstractmethod
    def matrix_parts(self, n: int, k: int) -> tuple[PartSpec, ...]:
        """Parts emitted for one [n, k] matrix. Raises UnsupportedShapeError if not representable."""

    @abstractmethod
    def reference(self, x: torch.Tensor, context: Context | None) -> dict[str, torch.Tensor]:
        """Torch math on a chunk: ``x`` float32 [e, n, K] (n a multiple of ``row_tile`` except at
        the ragged end), ``context`` sliced to [e]. Returns parts with leading dim e."""

    @abstractmethod
    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`quantize`: parts of one [N, K] or [E, N, K] weight -> float32 weight."""

    def group_context(self, members: Sequence[torch.Tensor]) -> Context | None:
        """Group-serialization step, called before quantizing tensors an engine fuses.

        Args:
            members: the fused group (q/k/v of one layer, gate/up of one expert), each [N_i, K]
                or [E, N_i, K] (same E), in any float dtype.
        Returns:
            ``None`` (the default: no shared state), or tensors shaped [E] (``[]`` for 2-D)
            passed as ``context=`` to :meth:`quantize` of every member.
        """
        return None

    def block_scales(self, amax: torch.Tensor, context: Context | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's stored scale and its elements' multiplier from the block's amax (formats
        with :attr:`scale_block`; the one formula every path of the format calls).

        Args:
            amax: float32 max|x| of each block (any shape), over the block's real elements.
            context: the group context broadcast to ``amax``'s shape (None: no group step).
        Returns: (the stored scale in its part's dtype, or an integer tensor holding it; the
            float32 multiplier an element is scaled by before :meth:`codes`), both amax's shape.
        """
        raise NotImplementedError

    def codes(self, x: torch.Tensor, multiplier: torch.Tensor, out: torch.Tensor | None = None
              ) -> torch.Tensor:
        """The element codes of float32 values ``x`` scaled by ``multiplier`` (broadcast to
        ``x``; formats with :attr:`scale_block`: the one formula every path of the format calls).
        ``x`` may be overwritten. Returns the codes (in ``out`` when given), one per element,
        unpacked."""
        raise NotImplementedError

    def context_of_block_maxima(self, amax: torch.Tensor) -> Context | None:
        """:meth:`group_context` of one weight alone, from its block maxima ``amax`` (float32
        [E, ...]: no read of the weight; the incremental path). Default None (no group step)."""
        return None

    # ---- the contract used by the driver -------------------------------------------------
    def part_specs(self, shape: Sequence[int]) -> tuple[PartSpec, ...]:
        """Parts for a weight of ``shape`` ([N, K] or [E, N, K]) without touching data.

        Raises: UnsupportedShapeError for other ranks or shapes the format cannot represent.
        """
        cache = self.__dict__.setdefault("_part_specs", {})  # pure in shape; plans repeat shapes
        try:
            return cache[shape]
        except (KeyError, TypeError):  # new shape, or an unhashable sequence
            pass
        shape = tuple(int(s) for s in shape)
        if shape not in cache:
            cache[shape] = declared_parts(self, shape)
        return cache[shape]

    def quantize(
        self, w: torch.Tensor, *, name: str = "weight", context: Context | None = None,
        values_checked: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Quantize one weight or grouped slab.

        Args:
            w: [N, K] or [E, N, K], bf16/fp16/fp32, any device, any strides (views of a fused
                slab are read in place); a ``torch.nn.Parameter`` or any tensor that requires
                grad is read detached (no autograd graph, no error).
            name: tensor name used in error messages.
            context: from :meth:`group_context` when ``w`` is a member of a fused group; ``None``
                quantizes ``w`` as a group of one.
            values_checked: the caller already ran :meth:`check_values` on ``w`` (skips a
                second read pass; ``RefitDriver.check_values`` does this for a whole refit).
        Returns:
            dict suffix -> tensor, exactly as declared by :meth:`part_specs`, on ``w``'s device.
        Raises:
            UnsupportedShapeError (also for a dtype other than bf16/fp16/fp32),
            NonFiniteError (``nonfinite="error"``: NaN/inf in ``w`` or in a given ``context``,
            or finite values that decode to NaN/inf: :attr:`decode_check_above`, or a NaN/inf
            scale emitted for finite weights: :func:`~qstrat.serializers.finite.check_emitted_scales`),
            BackendUnavailableError (a RuntimeError) when the Triton backend is forced where it
            cannot run.
        """
        specs = self.part_specs(w.shape)
        w = w.detach()  # a trainer's nn.Parameter: quantizing reads values, never records autograd
        if context is not None:
            context = {k: v.detach() if torch.is_tensor(v) else v for k, v in context.items()}
        check_weight_dtype(self.name, name, w.dtype)
        if context is not None and self.options.nonfinite == "error":
            check_context(context, name)
        batched = w.dim() == 3
        w3 = w if batched else w.unsqueeze(0)
        kernel = self.check_backend(w3.device)
        fast = not kernel and self.options.backend in ("auto", "fast") and self.has_fast_path()
        check = not values_checked and self.options.nonfinite == "error"
        peak = 0.0  # largest |w| (read while checking), for the decoded-values check
        if check and not fast:  # the fast path checks its block maxima instead
            peak = check_finite(w, name, self._expert_chunk(w))
        ctx = context
        if ctx is None:
            try:
                ctx = self.group_context([w3])
            except NonFiniteError:
                self.check_values(w, name)  # the same error, naming this tensor
                raise
        if ctx is not None:
            ctx = {k: (v if batched else v.reshape(1)) for k, v in ctx.items()}
        if kernel:
            parts = type(self).resolve_kernel()(self, w3, ctx)
        elif fast:
            parts, peak = torch_paths.run_fast(self, w3, ctx, self.part_specs(w3.shape), name if check else None,
                                               source=w)
        else:
            parts = torch_paths.run_reference(self, w3, ctx, self.part_specs(w3.shape), name)
        if not batched:
            parts = {k: v.squeeze(0) for k, v in parts.items()}
        check_parts(self.name, name, specs, parts)
        if self.options.nonfinite == "error":
            check_emitted_scales(self, parts, name, w.numel())
        if peak > self.decode_check_above:
            self.check_decoded(parts, name, peak)
        return parts

    def check_values(self, w: torch.Tensor, name: str = "weight") -> None:
        """With ``nonfinite="error"``: raise NonFiniteError naming ``name`` and the first NaN/inf
        index of ``w`` ([N, K] or [E, N, K]); read in expert chunks, no full-size copy. A weight
        whose largest magnitude exceeds :attr:`decode_check_above` is also quantized (as a group
        of one) and its decoded values checked (:meth:`check_decoded`)."""
        if self.options.nonfinite == "error":
            peak = check_finite(w, name, self._expert_chunk(w))
            if peak > self.decode_check_above:
                self.check_decoded(self.quantize(w, name=name, values_checked=True), name, peak)

    def check_decoded(self, parts: Mapping[str, torch.Tensor], name: str, peak: float) -> None:
        """Raise NonFiniteError naming ``name``, the first index and ``peak`` (the input's largest
        magnitude) when :meth:`dequantize` of ``parts`` holds NaN/inf: finite weights the engine
        would read back as non-finite (a scale rounded up past float32's max, an fp32 value cast
        to bfloat16 above its max). Reads the decoded copy (float32, the weight's shape)."""
        check_decoded(self, parts, name, peak)

    def encode_into(self, x: torch.Tensor, context: Context | None, out: Mapping[str, torch.Tensor],
                    scratch: Scratch) -> torch.Tensor:
        """The fast torch path on one chunk: the bytes of :meth:`reference`, written in place.

        Optional (formats without it use :meth:`reference` for ``backend="fast"``). Must give
        exactly the reference's bytes (tests compare them on every test-vector class).

        Args:
            x: [e, n, K] chunk of the weight in its own dtype (bf16/fp16/fp32), a strided view.
            context: as for :meth:`reference`, sliced to [e].
            out: part suffix -> destination view of the chunk's part (leading dim e).
            scratch: reusable buffers of this quantize call.
        Returns:
            float32 block maxima of |x| (any shape): a NaN or inf there means a non-finite input
            value (the ``nonfinite="error"`` check costs no extra pass over the weight).
        """
        raise NotImplementedError

    @classmethod
    def has_fast_path(cls) -> bool:
        """True if the format implements :meth:`encode_into`."""
        return cls.encode_into is not FormatMath.encode_into

    @classmethod
    def resolve_kernel(cls) -> Callable[..., dict[str, torch.Tensor]] | None:
        """The format's kernel function, or None (no kernel declared, or triton not importable).

        A ``"module:function"`` reference is imported on first use and cached per class, so that
        importing a format never imports triton or its kernel module.
        Raises: PluginError if the reference does not name an importable callable (a broken
        kernel module must not fall back to the reference silently).
        """
        return backend.resolve_kernel(cls)

    # ---- internals ------------------------------------------------------------------------
    def check_backend(self, device: torch.device | str) -> bool:
        """Whether quantizing tensors on ``device`` runs the Triton kernel (else the torch
        reference), raising if the ``backend`` option cannot run there. Reads no data.

        Raises: BackendUnavailableError: ``backend="triton"`` and the format has no kernel,
            triton does not import, or ``device`` is not CUDA without ``TRITON_INTERPRET=1``.
        """
        return backend.runs_kernel(self, device)

    def _chunk_elements(self) -> int:
        return self.options.chunk_elements or cache_chunk_elements()

    def _expert_chunk(self, w: torch.Tensor) -> int:
        """Experts per cache-sized chunk of ``w`` ([N, K] or [E, N, K]: its last two dims)."""
        return max(1, self._chunk_elements() // (w.shape[-2] * w.shape[-1]))

