"""The serializer contract: one quantization format, from a BF16 weight to checkpoint tensors.

A serializer turns a weight ``[N, K]`` (out_features x in_features) or a grouped expert slab
``[E, N, K]`` into named parts keyed by checkpoint suffix (``"weight"``, ``"weight_scale_inv"``, ...).
It declares those parts (:meth:`Serializer.part_specs`) from the shape alone, so a refit can be
planned - names, shapes, dtypes, bytes - before a single weight is read.

Subclasses provide ``matrix_parts`` (shapes for one [N, K] matrix), ``reference`` (torch math for a
chunk of experts/rows: the CPU path and the test oracle), ``dequantize`` and, optionally, a Triton
``kernel`` (see :mod:`qstrat.serializers.kernels`) and a ``group_context`` step.

A format also owns its engine contract: the ``quantization_config`` it writes and which engine
configs it serves (:meth:`Serializer.engine_config_mismatch`, :mod:`qstrat.serializers.engine_contract`),
its CPU emulation of vLLM's kernels (``emulation``) and its peers in ``qstrat bench``
(``bench_peers``); qstrat's lists of formats are read from the registry, never written out.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from qstrat.errors import NonFiniteError, UnsupportedShapeError
from qstrat.serializers import backend, torch_paths
from qstrat.serializers.chunking import Scratch, cache_chunk_elements
from qstrat.serializers.engine_contract import config_difference, on_defaults, read_difference
from qstrat.serializers.finite import all_finite, check_context, check_decoded, check_finite, options_text, peak_abs
from qstrat.serializers.parts import (WEIGHT_DTYPES, Context, PartSpec, check_parts, check_weight_dtype, declared_parts,
                                     dtype_name, tensor_nbytes)

# re-exported: formats and qstrat import these names from here
__all__ = ["Context", "PartSpec", "Serializer", "SerializerOptions", "WEIGHT_DTYPES", "all_finite", "check_finite",
           "check_parts", "config_difference", "dtype_name", "options_text", "peak_abs", "tensor_nbytes"]


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




class Serializer(ABC):
    """A quantization format. Instances are immutable and cheap; options are validated by pydantic.

    Class attributes: ``name`` (registry name), ``summary`` (one line for ``qstrat list``),
    ``Options`` (pydantic options model), ``quantizes`` (False for passthrough formats: modules
    using them go into the engine's ignore list), ``row_tile`` (rows quantized together: the
    granularity of chunking and of row splits of fused weights), ``kernel``, ``emulation``,
    ``bench_peers`` (below).
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    Options: ClassVar[type[SerializerOptions]] = SerializerOptions
    quantizes: ClassVar[bool] = True
    row_tile: ClassVar[int] = 1
    #: Triton implementation ``kernel(serializer, w3: [E, N, K], context) -> parts``: a lazy
    #: ``"module:function"`` reference (imported by :meth:`resolve_kernel` when a backend is
    #: chosen and triton imports), a callable, or None (torch reference only).
    kernel: ClassVar[str | Callable[..., dict[str, torch.Tensor]] | None] = None
    #: CPU emulation of vLLM's kernels for this format, opted into by naming it: a lazy
    #: ``"module"`` / ``"module:attr"`` reference or the object itself, with ``hooks() -> dict``
    #: (resolve the vLLM names it needs, change nothing; raise VllmHookError naming a missing
    #: one) and ``register(hooks)`` (install, idempotent). :mod:`qstrat.engine.emulation` registers
    #: every registered format's on a CPU vLLM platform. None: no emulation (vLLM's own kernels).
    emulation: ClassVar[str | object | None] = None
    #: ``qstrat bench`` peers of this format: implementation label (``"vllm"``) -> a lazy
    #: ``"module:function"`` reference or the function, ``peer(format_name, x) -> (fn | None, note)``
    #: with ``x`` a bf16 [N, K] weight and ``fn()`` the timed call (None: unavailable here, ``note``
    #: says why). Empty: the format has no peer, and its bench rows say so.
    bench_peers: ClassVar[Mapping[str, str | Callable[..., Any]]] = {}
    #: With ``nonfinite="error"``, a weight whose largest magnitude exceeds this has its DECODED
    #: values (:meth:`dequantize` of what was emitted) checked too: a finite input near float32's
    #: max can decode to inf after a scale or element is rounded up (block FP8 ``ue8m0``, MXFP8
    #: RCEIL: up to 2x) or cast (BF16 of an fp32 value above bfloat16's max). Below it every
    #: built-in format decodes finitely (no rounding raises a value 4x), so the check costs
    #: nothing on real weights. A format whose decode may grow a value more lowers it.
    decode_check_above: ClassVar[float] = torch.finfo(torch.float32).max / 4

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

    def vllm_quantization_config(self, ignored: Sequence[str]) -> dict[str, Any] | None:
        """The engine's ``quantization_config`` for a checkpoint in this format.

        Args: ignored: vLLM module prefixes left unquantized (``model.layers.0.mlp.gate``).
        Returns: the config dict, or None for a passthrough format.
        """
        return None

    # ---- the engine contract -------------------------------------------------------------
    def engine_config_mismatch(self, quantization_config: Mapping[str, Any]) -> str | None:
        """Why an engine started with ``quantization_config`` does not serve this format's
        checkpoints (with these options), or None when it does. Override to tell apart configs
        the default rule cannot (compare more keys with
        :func:`~qstrat.serializers.engine_contract.config_difference`).

        Default: the format's own ``vllm_quantization_config([])`` and the engine's agree on
        :data:`~qstrat.serializers.engine_contract.MATCH_KEYS` as vLLM reads them
        (:func:`~qstrat.serializers.engine_contract.read_difference`: lower-case ``quant_algo``,
        ``group_size: "16"``, the nested ModelOpt form, MiniMax ``mxfp8`` are what vLLM accepts; a
        config vLLM refuses is refused naming the key); a passthrough format (no config) serves
        no quantized engine.

        Args: quantization_config: the engine's (its config.json ``quantization_config``).
        Returns: ``"quantization_config.KEY: engine has X, NAME writes Y"`` or None.
        """
        mine = self.vllm_quantization_config([])
        if mine is None:
            return f"{self.name} writes no quantization_config (a passthrough format)"
        return read_difference(mine, quantization_config, self.name)

    def engine_fusion_problem(self, rows: Sequence[int], experts: bool) -> str | None:
        """Why vLLM cannot load, in this format, one fused module made of members with these
        row counts, or None when it can. Checked at plan time for every engine-fused group
        (q/k/v, gate/up of a dense MLP: ``experts=False``; gate/up of routed experts, whose
        down_proj vLLM's fused-MoE layer builds with them: ``experts=True``), so that no
        checkpoint or refit reaches an engine that then fails on it (docs/formats.md).

        Default: None (formats whose scales are per row, e.g. MXFP8, NVFP4, load any split).

        Args: rows: each member's weight rows (N), in the engine's fused order (q, k, v;
            gate, up); experts: a routed experts module.
        Returns: the reason, naming the rule vLLM applies, or None.
        """
        return None

    @on_defaults
    def matches_engine_config(self, quantization_config: Mapping[str, Any]) -> bool:
        """Whether an engine started with ``quantization_config`` serves this format's
        checkpoints: :meth:`engine_config_mismatch` is None. On the class
        (``BlockFP8.matches_engine_config(cfg)``) it asks the format with default options.

        Raises: pydantic ValidationError (on the class) if the format's options have no defaults.
        """
        return self.engine_config_mismatch(quantization_config) is None

    @classmethod
    def resolve_emulation(cls) -> Any | None:
        """The format's CPU emulation object (see ``emulation``), imported on first use, or None.

        Raises: PluginError if the reference cannot be imported or lacks ``hooks``/``register``.
        """
        return backend.resolve_emulation(cls)

    @classmethod
    def resolve_bench_peers(cls) -> dict[str, Callable[..., Any]]:
        """``bench_peers`` with lazy references imported: label -> ``peer(format_name, x)``.

        Raises: PluginError naming the format and the reference that does not import.
        """
        return backend.resolve_bench_peers(cls)

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
            or finite values that decode to NaN/inf: :attr:`decode_check_above`),
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
            parts = torch_paths.run_reference(self, w3, ctx, self.part_specs(w3.shape))
        if not batched:
            parts = {k: v.squeeze(0) for k, v in parts.items()}
        check_parts(self.name, name, specs, parts)
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
        return cls.encode_into is not Serializer.encode_into

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

