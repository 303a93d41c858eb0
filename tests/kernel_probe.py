"""A test kernel applying one :mod:`.fp_encode` device helper elementwise (see
:func:`kernel_harness.run_fp_encode`)."""
from __future__ import annotations

import triton
import triton.language as tl

from qstrat.serializers.kernels import fp_encode


@triton.jit
def fp_encode_probe(x_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] (int32) = helper OP (index into testing.FP_ENCODE_OPS) of x[i]; fp32 results as bits."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0)
    if OP == 0:
        r = fp_encode.e4m3_encode(x)
    elif OP == 1:
        r = fp_encode.e8m0_from_amax(x, True)
    elif OP == 2:
        r = fp_encode.e8m0_from_amax(x, False)
    elif OP == 3:
        r = fp_encode.f32_bits(fp_encode.exp2_int(x))
    elif OP == 4:
        r = fp_encode.f32_bits(fp_encode.ceil_pow2(x))
    elif OP == 5:
        r = fp_encode.f32_bits(fp_encode.e4m3_decode(x))
    elif OP == 6:
        r = fp_encode.e2m1_magnitude(x)
    elif OP == 7:  # Triton's native fp32 -> e4m3 cast, the candidate to replace e4m3_encode on a GPU
        r = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:  # the sm_90 E2M1 bit encoder of the native NVFP4 branch
        r = fp_encode.e2m1_from_bits(x)
    tl.store(out_ptr + offs, r, mask=m)
