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

import functools
import math
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from qstrat.errors import NonFiniteError, UnsupportedShapeError
from qstrat.serializers.chunking import Scratch, cache_chunk_elements, chunk_pool, chunk_workers, chunks
from qstrat.serializers.engine_contract import config_difference, on_defaults, read_difference

#: Per-expert state a serializer shares across the members of a fusion group: name -> tensor [E].
Context = Mapping[str, torch.Tensor]


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


#: Weight dtypes a serializer reads (fp8, integer and float64 inputs are refused).
WEIGHT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


@dataclass(frozen=True)
class PartSpec:
    """One checkpoint tensor a serializer emits for a weight.

    Attributes:
        suffix: checkpoint suffix, e.g. ``"weight"``, ``"weight_scale_inv"``.
        shape: full shape, including the leading expert dim E for grouped input.
        dtype: torch dtype as stored in the checkpoint.
        rows_per_entry: weight rows (the matrix's N) covered by one entry of this part along
            the part's first per-matrix dimension (1 per-row, 128 for 128x128 tiles); ``None``
            for one value per matrix (a per-tensor scale, shape ``[]`` per matrix), which is
            duplicated when a fused weight is split by rows.
    """

    suffix: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows_per_entry: int | None = 1

    @functools.cached_property
    def nbytes(self) -> int:
        """Size in bytes."""
        return tensor_nbytes(self.shape, self.dtype)


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (no allocation)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as plans and checkpoints name it: ``torch.float8_e4m3fn`` -> ``float8_e4m3fn``
    (cached: asked three times per tensor of a plan)."""
    return str(dtype).removeprefix("torch.")


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
        ref = cls.emulation
        obj = _import_ref(cls.name, ref, "emulation", need_callable=False) if isinstance(ref, str) else ref
        if obj is not None and not all(callable(getattr(obj, a, None)) for a in ("hooks", "register")):
            from qstrat.errors import PluginError

            raise PluginError(f"serializer {cls.name!r}: emulation {ref!r} has no hooks() and register(hooks)")
        return obj

    @classmethod
    def resolve_bench_peers(cls) -> dict[str, Callable[..., Any]]:
        """``bench_peers`` with lazy references imported: label -> ``peer(format_name, x)``.

        Raises: PluginError naming the format and the reference that does not import.
        """
        return {label: _import_ref(cls.name, ref, f"bench peer {label!r}") if isinstance(ref, str) else ref
                for label, ref in cls.bench_peers.items()}

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
            if len(shape) not in (2, 3) or min(shape) <= 0:
                raise UnsupportedShapeError(
                    f"{self.name}: expected a non-empty [N, K] or [E, N, K] weight, got shape {list(shape)}"
                )
            lead = shape[:-2]
            declared = self.matrix_parts(*shape[-2:])
            if not isinstance(declared, (tuple, list)) or not all(isinstance(p, PartSpec) for p in declared):
                from qstrat.errors import PluginError

                raise PluginError(f"serializer {self.name!r} ({type(self).__module__}.{type(self).__qualname__}): "
                                  f"matrix_parts({shape[-2]}, {shape[-1]}) must return a tuple of PartSpec, got "
                                  f"{declared!r:.120}")
            cache[shape] = tuple(PartSpec(p.suffix, lead + p.shape, p.dtype, p.rows_per_entry) for p in declared)
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
        if w.dtype not in WEIGHT_DTYPES:
            raise UnsupportedShapeError(
                f"{name}: {self.name} quantizes bfloat16, float16 or float32 weights, got "
                f"{dtype_name(w.dtype)}" + (" (cast it to float32)" if w.dtype == torch.float64 else "")
            )
        if context is not None and self.options.nonfinite == "error":
            bad = [k for k, v in context.items() if torch.is_tensor(v) and v.is_floating_point()
                   and not all_finite(v)]
            if bad:
                raise NonFiniteError(f"{name}: the fusion-group context's {', '.join(bad)} is not finite "
                                     "(group_context of members holding NaN/inf?); set "
                                     "nonfinite='propagate' to encode it anyway")
        batched = w.dim() == 3
        w3 = w if batched else w.unsqueeze(0)
        kernel = self._use_kernel(w3)
        fast = not kernel and self._use_fast()
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
            parts, peak = self._fast_chunked(w3, ctx, self.part_specs(w3.shape), name if check else None,
                                             source=w)
        else:
            parts = self._reference_chunked(w3, ctx, self.part_specs(w3.shape))
        if not batched:
            parts = {k: v.squeeze(0) for k, v in parts.items()}
        _check_parts(self.name, name, specs, parts)
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
        decoded = self.dequantize(parts)
        if all_finite(decoded):
            return
        index = ", ".join(str(int(i)) for i in (~torch.isfinite(decoded)).nonzero()[0])
        raise NonFiniteError(
            f"{name}: its finite values (largest magnitude {peak:.6g}) decode to a non-finite value in "
            f"{self.name}{_options_text(self.options)} at index [{index}]: a scale or element rounded up past "
            "float32's max (bfloat16's for a cast); scale the weight down, or choose options that do not "
            "round scales up (block_fp8 ue8m0=False, mxfp8 scale_rounding='floor'); set "
            "nonfinite='propagate' to encode it anyway")

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
        ref = cls.kernel
        if ref is None or callable(ref):
            return ref
        if cls not in _RESOLVED:
            from qstrat.serializers.kernels import triton_available

            _RESOLVED[cls] = _import_ref(cls.name, ref) if triton_available() else None
        return _RESOLVED[cls]

    # ---- internals ------------------------------------------------------------------------
    def check_backend(self, device: torch.device | str) -> bool:
        """Whether quantizing tensors on ``device`` runs the Triton kernel (else the torch
        reference), raising if the ``backend`` option cannot run there. Reads no data.

        Raises: BackendUnavailableError: ``backend="triton"`` and the format has no kernel,
            triton does not import, or ``device`` is not CUDA without ``TRITON_INTERPRET=1``.
        """
        from qstrat.errors import BackendUnavailableError

        backend = self.options.backend
        if backend in ("torch", "fast"):
            return False
        has_kernel = type(self).resolve_kernel() is not None
        is_cuda = torch.device(device).type == "cuda"
        if backend == "auto":
            return has_kernel and is_cuda
        if not has_kernel:
            why = "no Triton kernel is registered for this format" if type(self).kernel is None else (
                "no Triton kernel is available (triton does not import: pip install 'qstrat[triton]')")
            raise BackendUnavailableError(f"{self.name}: backend='triton' cannot run: {why}")
        if not is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendUnavailableError(
                f"{self.name}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU); "
                f"the tensors are on {torch.device(device)}: use backend 'auto' or 'torch' here"
            )
        return True

    def _use_kernel(self, w3: torch.Tensor) -> bool:
        return self.check_backend(w3.device)

    def _use_fast(self) -> bool:
        return self.options.backend in ("auto", "fast") and self.has_fast_path()

    def _chunk_elements(self) -> int:
        return self.options.chunk_elements or cache_chunk_elements()

    def _expert_chunk(self, w: torch.Tensor) -> int:
        """Experts per cache-sized chunk of ``w`` ([N, K] or [E, N, K]: its last two dims)."""
        return max(1, self._chunk_elements() // (w.shape[-2] * w.shape[-1]))

    def _chunk_views(self, w3: torch.Tensor, ctx: Context | None, specs: tuple[PartSpec, ...]):
        """``(out, [(label, x chunk, ctx chunk, part views), ...])`` over cache-sized chunks."""
        out = {p.suffix: torch.empty(p.shape, dtype=p.dtype, device=w3.device) for p in specs}
        views = []
        for e0, e1, r0, r1 in chunks(tuple(w3.shape), self._chunk_elements(), self.row_tile):
            sub_ctx = None if ctx is None else {k: v[e0:e1] for k, v in ctx.items()}
            dsts = {}
            for p in specs:
                dst = out[p.suffix][e0:e1]
                if p.rows_per_entry is not None:
                    dst = dst[:, r0 // p.rows_per_entry : -(-r1 // p.rows_per_entry)]
                dsts[p.suffix] = dst
            views.append((f"[{e0}:{e1}, {r0}:{r1}]", w3[e0:e1, r0:r1], sub_ctx, dsts))
        return out, views

    def _reference_chunked(
        self, w3: torch.Tensor, ctx: Context | None, specs: tuple[PartSpec, ...]
    ) -> dict[str, torch.Tensor]:
        """Run :meth:`reference` over cache-sized expert and row chunks (bounded fp32 scratch)."""
        out, views = self._chunk_views(w3, ctx, specs)
        for label, x, sub_ctx, dsts in views:
            got = self.reference(x.float(), sub_ctx)
            _check_parts(self.name, f"reference() chunk {label}",
                         [PartSpec(k, tuple(d.shape), d.dtype) for k, d in dsts.items()], got)
            for suffix, dst in dsts.items():
                dst.copy_(got[suffix])
        return out

    def _fast_chunked(
        self, w3: torch.Tensor, ctx: Context | None, specs: tuple[PartSpec, ...], check: str | None,
        source: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Run :meth:`encode_into` over cache-sized chunks, reusing one scratch. ``check``: the
        tensor's name when non-finite values must raise (found from the block maxima);
        ``source``: the weight as given (``w3`` is it as [E, N, K]), for the index in that error.
        Returns ``(parts, peak)``: ``peak`` the largest block maximum (0.0 without ``check``)."""
        out, views = self._chunk_views(w3, ctx, specs)
        workers = chunk_workers()
        if len(views) == 1 or workers == 1 or w3.device.type != "cpu":
            scratch = Scratch(w3.device)
            peak = max([self._encode_chunk(v, scratch, check) for v in views])
        else:  # chunks over single-threaded workers, one scratch per worker (chunking.chunk_pool)
            local = threading.local()

            def task(view: tuple) -> float:
                if not hasattr(local, "scratch"):
                    local.scratch = Scratch(w3.device)
                return self._encode_chunk(view, local.scratch, check)

            peak = max(list(chunk_pool(workers).map(task, views)))
        if peak == math.inf:
            check_finite(source, check, self._expert_chunk(w3))  # names the index
            raise NonFiniteError(f"{check}: its values overflow float32 (non-finite block maxima)")
        return out, peak

    def _encode_chunk(self, view: tuple, scratch: Scratch, check: str | None) -> float:
        """:meth:`encode_into` on one chunk view; with ``check``, its largest block maximum
        (:func:`peak_abs`: inf if it saw NaN/inf), else 0.0."""
        _, x, sub_ctx, dsts = view
        amax = self.encode_into(x, sub_ctx, dsts, scratch)
        return 0.0 if check is None else peak_abs(amax)


#: Kernels resolved by :meth:`Serializer.resolve_kernel`, per format class.
_RESOLVED: dict[type, Callable[..., dict[str, torch.Tensor]] | None] = {}


def _import_ref(fmt: str, ref: str, what: str = "kernel", need_callable: bool = True) -> Any:
    """Import ``"module:attr"`` (or ``"module"``: the module itself); raise PluginError naming the
    format and ``what`` if it does not import or (``need_callable``) is not callable."""
    import importlib

    from qstrat.errors import PluginError

    module, _, attr = ref.partition(":")
    try:
        obj = importlib.import_module(module)
        obj = getattr(obj, attr) if attr else obj
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"serializer {fmt!r}: {what} {ref!r} cannot be imported: {exc}") from exc
    if need_callable and not callable(obj):
        raise PluginError(f"serializer {fmt!r}: {what} {ref!r} is not callable")
    return obj


def all_finite(w: torch.Tensor) -> bool:
    """True if ``w`` (any float tensor, any strides) holds no NaN and no +-inf.

    One ``torch.aminmax`` reduction (NaN propagates to both results; an infinity is the max or
    the min), no temporary: on CPU far faster than ``torch.isfinite(w).all()`` for bf16, which
    has no vectorized isfinite (docs/performance.md, "Why the code does it this way").

    Args: w: float tensor (bf16/fp16/fp32/fp64), any shape, any device. Returns: a Python bool
    (True for an empty tensor, and for integer or bool tensors, which cannot hold NaN/inf). Raises
    nothing.
    """
    if w.numel() == 0:
        return True
    lo, hi = torch.aminmax(w)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _options_text(options: SerializerOptions) -> str:
    """`` with {'ue8m0': True}``: the format options set away from their defaults (not the
    common ``backend``/``nonfinite``/``chunk_elements``: they do not change the bytes), for messages."""
    changed = options.model_dump(exclude_defaults=True, exclude={"backend", "nonfinite", "chunk_elements"})
    return f" with {changed}" if changed else ""


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


def _check_parts(fmt: str, name: str, specs: Sequence[PartSpec], parts: Mapping[str, Any]) -> None:
    """A serializer must emit exactly what it declared in the plan (a plugin-author error):
    a mapping suffix -> tensor (``name``: the tensor, or the ``reference()`` chunk)."""
    from qstrat.errors import PluginError

    if not isinstance(parts, Mapping) or not all(torch.is_tensor(v) for v in parts.values()):
        raise PluginError(f"serializer {fmt!r} returned {type(parts).__name__} {parts!r:.80} for {name}; it must "
                          "return a dict suffix -> tensor, the parts part_specs declares")
    declared = {p.suffix: (tuple(p.shape), p.dtype) for p in specs}
    got = {k: (tuple(v.shape), v.dtype) for k, v in parts.items()}
    if declared != got:
        raise PluginError(
            f"serializer {fmt!r} emitted {got} for {name}, but declared {declared} in the plan"
        )
