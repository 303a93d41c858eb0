"""Host-side launch description shared by the format kernels.

Every format kernel module builds its one launch per grouped slab as a :class:`Launch` (a plan:
kernel, grid, arguments, output tensors) in a ``plan_<format>`` function, and its public
``quantize_<format>`` runs that plan. Planning reads no tensor data, so the same plan can be made
on ``meta`` tensors for any target GPU architecture and compiled without a GPU
(:mod:`qstrat.serializers.kernels.static_report`): the code that is measured statically is the
code the public API launches.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from qstrat.errors import UnsupportedShapeError


@contextlib.contextmanager
def device_guard(t: torch.Tensor) -> Iterator[None]:
    """Make ``t``'s CUDA device current while launching (Triton launches on the current device).

    A no-op for CPU tensors (the Triton interpreter). Args: t: any tensor.
    """
    if t.is_cuda:
        with torch.cuda.device(t.device):
            yield
    else:
        yield


def kernel_input(w: torch.Tensor, native: bool = False) -> tuple[torch.Tensor, bool]:
    """The tensor a kernel reads for ``w``, and whether it holds raw bf16 bits.

    bf16 is passed as ``w.view(torch.int16)`` (a same-strides view: no copy) and upcast in the
    kernel by ``bits << 16`` (:func:`.fp_encode.load_f32`): exact for every value, subnormals and
    NaN signs included (the interpreter's own conversion flushes subnormals). A native launch
    (:func:`native_casts`: compiled, finite values) gets ``w`` itself: the GPU's bf16 -> fp32
    conversion is exact on finite values and costs one instruction per element where the bits
    route costs 1.5. Other dtypes are passed as they are.
    Args: w: tensor of any float dtype and strides; native: see :func:`native_casts`.
    Returns: (tensor, bf16_bits).
    """
    if w.dtype == torch.bfloat16 and not native:
        return w.view(torch.int16), True
    return w, False


def device_arch(t: torch.Tensor) -> int | None:
    """The compute capability a launch on ``t``'s device compiles for, as ``10 * major + minor``
    (90: H100/H200, 100: B200), or None for a CPU tensor (Triton's interpreter)."""
    if t.is_cuda:
        major, minor = torch.cuda.get_device_capability(t.device)
        return 10 * major + minor
    return None


def native_casts(arch: int | None, nonfinite: str) -> bool:
    """Whether a kernel uses the GPU's native conversions (``cvt.rn.satfinite.e4m3x2``).

    True for a compiled launch (``arch`` not None) of finite inputs (``nonfinite="error"``: the
    serializer refuses NaN/inf before the kernel runs). The interpreter's fp8 cast is wrong
    (docs/formats.md, "Two encoders, one result"), and NaN/inf inputs (``nonfinite="propagate"``)
    take the exact integer encoder, whose NaN signs and saturation are the torch reference's.
    """
    return arch is not None and nonfinite == "error"


def quantize_with(fmt: str, plan: Callable[..., Launch]) -> Callable[..., dict[str, torch.Tensor]]:
    """The public ``quantize_<format>(serializer, w3, ctx=None)`` of a kernel module: ``plan``
    (its ``plan_<format>``) for ``w3``'s device (:func:`device_arch`), run; what the format's
    ``kernel`` attribute names."""
    def quantize(serializer: Any, w3: torch.Tensor, ctx: Any = None) -> dict[str, torch.Tensor]:
        return plan(serializer, w3, ctx, device_arch(w3)).run()

    quantize.__name__ = quantize.__qualname__ = f"quantize_{fmt}"
    quantize.__doc__ = (f"Quantize a grouped slab to {fmt} in one kernel launch: runs :func:`{plan.__name__}` "
                        "for ``w3``'s device. Args, returns and errors as there.")
    return quantize


@dataclass(frozen=True)
class SlabInput:
    """A grouped slab checked for a format kernel (:func:`slab_input`).

    Attributes:
        e, n, k: the slab's [E, N, K].
        x: the tensor the kernel reads (:func:`kernel_input`: ``w3`` itself, or its bf16 bits).
        bf16_bits: whether ``x`` holds bf16 bits as int16 (the kernel's ``BF16_BITS``).
        native: whether the kernel uses native conversions (:func:`native_casts`: ``NATIVE``).
    """

    e: int
    n: int
    k: int
    x: torch.Tensor
    bf16_bits: bool
    native: bool

    def constexprs(self, w3: torch.Tensor, q: torch.Tensor) -> dict[str, Any]:
        """The constexprs every format kernel takes: ``BF16_BITS``, ``NATIVE``, and the offset
        widths over the input ``w3`` and the largest output ``q`` (``WIDE``: :func:`needs_int64`,
        ``E64``: :func:`slab_needs_int64`)."""
        return dict(BF16_BITS=self.bf16_bits, NATIVE=self.native, WIDE=needs_int64(w3, q),
                    E64=slab_needs_int64(w3, q))


def slab_input(fmt: str, w3: torch.Tensor, arch: int | None, nonfinite: str, k_block: int = 1) -> SlabInput:
    """The preamble of every ``plan_<format>``: ``w3`` is a 3-D grouped slab [E, N, K] with
    ``K % k_block == 0``, read through :func:`kernel_input` with :func:`native_casts` for ``arch``.

    Raises: ValueError (``"<fmt> kernel expects [E, N, K], got shape [...]"``) for another rank;
        UnsupportedShapeError (``"<fmt> needs K divisible by <k_block>; got K=<k>"``).
    """
    if w3.dim() != 3:
        raise ValueError(f"{fmt} kernel expects [E, N, K], got shape {list(w3.shape)}")
    e, n, k = w3.shape
    if k % k_block:
        raise UnsupportedShapeError(f"{fmt} needs K divisible by {k_block}; got K={k}")
    native = native_casts(arch, nonfinite)
    x, bf16_bits = kernel_input(w3, native)
    return SlabInput(e, n, k, x, bf16_bits, native)


@dataclass
class Launch:
    """One kernel launch: ``kernel[grid](*args, **constexprs, **options())``.

    Attributes:
        kernel: the ``@triton.jit`` function.
        grid: programs per grid axis.
        args: the runtime arguments (tensors, ints, floats), in the kernel's order.
        constexprs: the ``tl.constexpr`` arguments by name.
        num_warps: warps per program.
        outputs: the tensors the kernel writes, by part name (what the format returns).
        device_tensor: the tensor whose device the launch runs on.
        loop_trips: trip count of each loop a program runs, in SASS address order (for the
            static report's instruction count; the kernels here run one tile per program: none).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: Mapping[str, Any]
    num_warps: int
    outputs: dict[str, torch.Tensor]
    device_tensor: torch.Tensor = field(repr=False)
    loop_trips: tuple[int, ...] = ()

    def options(self) -> dict[str, Any]:
        """Triton launch options: ``num_warps``, and FP fusion off (no multiply-add is contracted
        into an fma the torch reference does not do; the kernels write their one fma as
        ``tl.fma``)."""
        return {"num_warps": self.num_warps, "enable_fp_fusion": False}

    def run(self) -> dict[str, torch.Tensor]:
        """Launch on the device of ``device_tensor``; returns :attr:`outputs`."""
        with device_guard(self.device_tensor):
            self.kernel[self.grid](*self.args, **self.constexprs, **self.options())
        return self.outputs


#: Rows/columns a tile may reach past a tensor's end (masked lanes still form addresses).
_TILE_MARGIN = 256


def _reach(t: torch.Tensor, first_dim: int) -> int:
    return sum((s + _TILE_MARGIN) * abs(st) for s, st in zip(t.shape[first_dim:], t.stride()[first_dim:]))


def slab_needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether any offset a kernel can form over the whole [E, ...] ``tensors`` (the expert's
    included; masked tile lanes too: ``(size + 256) * |stride|`` summed over all dims) reaches
    2^31: then the expert offset is computed in 64 bits (:func:`.fp_encode.program_ids`)."""
    return any(_reach(t, 0) >= 2**31 for t in tensors)


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether a kernel over [E, ...] ``tensors`` needs 64-bit per-element offsets: True when an
    offset it can form WITHIN one expert, masked tile lanes included (``(size + 256) * |stride|``
    summed over the dims after the first), reaches 2^31. The expert's own offset is 64-bit where
    :func:`slab_needs_int64` and joins the base pointer once per program, so a
    slab past 2^31 elements whose experts are each below it stays on 32-bit offsets, exact and a
    third of the address instructions (docs/performance.md, the kernel figures "by offset width").
    """
    return any(_reach(t, 1) >= 2**31 for t in tensors)
