"""Device helpers that reproduce the torch reference's rounding bit for bit (the store and block-fill kernels):
round half to even, float16 rounded up / down as ``kv_quant._half_up`` / ``_half_down``, float8 encoding, and int4's
value scale steps ``2^(-k/3)``.

Plain functions until ``bind()`` decorates them (interpreted, they stay plain Python; see ``_tiles``).
"""

from __future__ import annotations

import functools

from ._common import Kernels, constexpr_globals, triton_interpreting
from .kv_quant import CUBE_ROOT_HALF, CUBE_ROOT_QUARTER

_CONSTANTS = ("CUBE_ROOT_HALF", "CUBE_ROOT_QUARTER")

tl = None  # triton.language, bound by bind()
_HELPERS = ("round_half_even", "half_up", "half_down", "float8_bits", "cast_rn", "value_scale_step")


@functools.cache
def bind() -> Kernels:
    """Binds ``tl`` and decorates the helpers (once); returns them by name."""
    global tl
    import triton
    import triton.language as language

    tl = language
    g = globals()
    constexpr_globals(g, _CONSTANTS)
    if not triton_interpreting():
        for name in _HELPERS:
            g[name] = triton.jit(g[name])
    return Kernels(**{name: g[name] for name in _HELPERS})


def round_half_even(x):
    """``torch.round`` of float32 ``x`` with ``|x| < 2^22`` (larger values stay large: callers clamp)."""
    return (x + 12582912.0) - 12582912.0


def half_up(x):
    """``kv_quant._half_up``: the smallest float16 >= ``x`` (float32 >= 0), capped at the float16 max."""
    x = tl.minimum(x, 65504.0)
    h = x.to(tl.float16)
    up = (h.to(tl.int16, bitcast=True).to(tl.int32) + 1).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) < x, up, h)


def half_down(x):
    """``kv_quant._half_down``: the largest float16 <= ``x`` (float32), saturated at +-float16 max."""
    x = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
    # One step toward -inf: positive -> bits - 1; +0 -> 0x8001 (-smallest subnormal); negative or -0 -> bits + 1.
    down_bits = tl.where(bits > 0, bits - 1, tl.where(bits == 0, -32767, bits + 1))
    down = down_bits.to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) > x, down, h)


def cast_rn(x, DTYPE: tl.constexpr):
    """``x`` in ``DTYPE`` rounded to nearest, ties to even, as torch's ``.to(dtype)``: bfloat16 through the float32
    bits (triton's interpreter truncates float32 -> bfloat16), other dtypes by a plain cast."""
    if DTYPE == tl.bfloat16:
        u = x.to(tl.float32).to(tl.uint32, bitcast=True)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


def float8_bits(x, E4M3: tl.constexpr):
    """Bits (uint8) of float32 ``x`` (finite, within range) rounded to the nearest float8, ties to even:
    e4m3fn (4 exponent bits, bias 7, 3 mantissa bits) or e5m2 (5, bias 15, 2)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    u = a.to(tl.int32, bitcast=True)
    # Normal range: rebias the exponent, add just under half an ulp plus the kept lsb (ties to even), truncate.
    # Below the smallest normal: adding 2^k, whose float32 ulp is the float8 subnormal step, rounds there (in
    # hardware, to nearest even); the low bits of the sum are the code.
    if E4M3:
        normal = (u - (120 << 23) + 0x7FFFF + ((u >> 20) & 1)) >> 20
        subnormal = (a + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)  # 2^14: ulp 2^-9
        code = tl.where(a < 0.015625, subnormal, normal)  # smallest normal 2^-6
    else:
        normal = (u - (112 << 23) + 0xFFFFF + ((u >> 21) & 1)) >> 21
        subnormal = (a + 128.0).to(tl.int32, bitcast=True) - (134 << 23)  # 2^7: ulp 2^-16
        code = tl.where(a < 6.103515625e-05, subnormal, normal)  # smallest normal 2^-14
    return (code | sign).to(tl.uint8)


def value_scale_step(k):
    """``kv_quant.VALUE_SCALE_STEPS[k]`` (float32 ``2^(-k/3)``) of int ``k`` in ``[0, 15]`` (a tensor): a float32
    cube root of ``1 / 2^(k % 3)`` times ``2^-(k // 3)``, built from its bits (exact)."""
    k = k.to(tl.int32)
    r = k % 3
    root = tl.where(r == 0, 1.0, tl.where(r == 1, CUBE_ROOT_HALF, CUBE_ROOT_QUARTER))
    return root * ((127 - k // 3) << 23).to(tl.float32, bitcast=True)
