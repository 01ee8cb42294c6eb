"""Store of new K/V into the paged pools, quantizing on the way.

``store_kv_ref`` is the torch reference (``kv_quant.quantize_kv_ref`` + ``index_copy_``: what
``QuantizedKVStorage.write`` does); ``store_kv`` the Triton kernel with the same signature, bit-identical codes,
scales and zeros:

- one program per ``_STORE_ROWS`` (token, KV head) vectors, one per tile row (K, then V);
- float32 math in the reference's order, with IEEE-rounded divisions (``tl.math.div_rn``: the default Triton
  division is approximate on GPUs) and round-half-to-even (``torch.round``) through the 1.5 * 2^23 trick;
- float16 side data rounded like ``_half_up`` / ``_half_down`` (round to nearest, then one float16 step by bits);
- float8 codes encoded from the float32 bits with round-to-nearest-even, as torch's float32 -> float8
  conversion (normal range: mantissa rounding on the bits; subnormal range: an add that rounds at the float8
  subnormal step), stored as bytes (no float8 type needed in the kernel);
- int4: even and odd elements loaded as two tiles, packed ``even | odd << 4``.

Slots must be valid (``0 <= slot < num_blocks * block_size``, no padding ``-1``) and distinct, as for
``index_copy_``. Decorated on first launch (see ``paged_decode_attention``).
"""

from __future__ import annotations

import functools

import torch

from . import paged_decode_attention as _decode
from .kv_quant import quantize_kv_ref
from .paged_decode_attention import Launch, check_pools

_STORE_ROWS = 32  # (token, head) vectors per program


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    value_zero: torch.Tensor | None = None,
    kv_format: str = "auto",
) -> None:
    """Torch reference: writes ``key``/``value`` ``[n, num_kv_heads, head_dim]`` into ``slots`` ``[n]`` (int64,
    ``block_id * block_size + offset``) of the pools, in place.

    ``"auto"``: cast to the pool dtype. Quantized formats: the codes, float16 scales (and int4 zeros) of
    ``kv_quant.quantize_kv_ref``; float8 pools are written through uint8 views (CPU index ops lack float8).
    """
    slots = slots.long()
    for states, cache, scale, zero in ((key, key_cache, key_scale, key_zero), (value, value_cache, value_scale,
                                                                                  value_zero)):
        if kv_format == "auto":
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, states.to(cache.dtype))
            continue
        data, new_scale, new_zero = quantize_kv_ref(states, kv_format)
        for pool, new in ((cache, data), (scale, new_scale), (zero, new_zero)):
            if pool is not None and new is not None:
                _bytes(pool).view(-1, *pool.shape[2:]).index_copy_(0, slots, _bytes(new))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    value_zero: torch.Tensor | None = None,
    kv_format: str = "auto",
) -> None:
    """Triton store; the arguments and effect of ``store_kv_ref``."""
    for launch in _store_launches(
        key, value, slots, key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format
    ):
        launch()


def _store_launches(
    key, value, slots, key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format
) -> list[Launch]:
    k = _kernels()
    for name, states in (("key", key), ("value", value)):
        if states.dim() != 3 or not states.dtype.is_floating_point or states.dtype.itemsize == 1:
            raise ValueError(f"{name} must be a float [n, num_kv_heads, head_dim] tensor, got {states.dtype} "
                             f"{tuple(states.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    num_tokens, num_kv_heads, head_dim = key.shape
    pools = check_pools(key, key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format, head_dim)
    if value.device != key.device:
        raise ValueError(f"value is on {value.device}, key on {key.device}")
    if pools.num_kv_heads != num_kv_heads:
        raise ValueError(f"pools hold {pools.num_kv_heads} KV heads, key has {num_kv_heads}")
    if kv_format == "int4" and head_dim % 2:
        raise ValueError(f"int4 packs two values per byte: head_dim must be even, got head_dim={head_dim}")
    if slots.shape != (num_tokens,) or slots.dtype not in (torch.int32, torch.int64) or slots.device != key.device:
        raise ValueError(f"slots must be int32/int64 [{num_tokens}] on {key.device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")
    slots = slots.contiguous()
    cols = head_dim // 2 if kv_format == "int4" else head_dim  # int4: one column per packed pair
    h_pad = _decode._next_pow2(num_kv_heads)
    block_t = max(1, _STORE_ROWS // h_pad)
    args = (
        key, value, slots, *pools.data, *pools.side, num_tokens,
        *key.stride(), *value.stride(), *pools.data_strides, *pools.side_strides,
    )
    meta = dict(
        NUM_HEADS=num_kv_heads, COLS=cols, H_PAD=h_pad, C_PAD=_decode._next_pow2(cols), BLOCK_T=block_t,
        BLOCK_SIZE=pools.block_size, FORMAT=_decode.KV_FORMAT_IDS[kv_format],
    )
    # Fused multiply-adds would change the float32 rounding the codes must reproduce.
    grid = (-(-num_tokens // block_t),)
    return [Launch(k.store, grid, args, meta, dict(num_warps=4, enable_fp_fusion=False))]


# ----------------------------------------------------------------------------------------------- kernels

tl = None  # triton.language, bound by _kernels()
row_max = row_min = None  # the decode module's reductions, bound by _kernels()


@functools.cache
def _kernels():
    """Decorates the store kernel (and, compiled, its helpers) on first launch."""
    global tl, row_max, row_min, store_vectors, half_up, half_down, round_half_even, float8_bits, _store_kernel
    import triton

    helpers = _decode._kernels()
    tl = _decode.tl
    row_max, row_min = helpers.row_max, helpers.row_min
    if not _decode.triton_interpreting():
        store_vectors = triton.jit(store_vectors)
        half_up, half_down = triton.jit(half_up), triton.jit(half_down)
        round_half_even, float8_bits = triton.jit(round_half_even), triton.jit(float8_bits)
    _store_kernel = _decode.jit_unspecialized(_store_kernel, ("num_tokens",), ("Slots",))  # any count, any slice
    return _decode._Kernels(store=_store_kernel)


def _store_kernel(
    K, V, Slots, KC, VC, KS, VS, KZ, VZ, num_tokens,
    stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_sb, stride_so, stride_sh,
    NUM_HEADS: tl.constexpr, COLS: tl.constexpr, H_PAD: tl.constexpr, C_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr, FORMAT: tl.constexpr,
):
    """BLOCK_T tokens x their KV heads: one row per (token, head) vector."""
    r = tl.arange(0, BLOCK_T * H_PAD).to(tl.int64)
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + r // H_PAD
    head = r % H_PAD
    rows_ok = (token < num_tokens) & (head < NUM_HEADS)
    slot = tl.load(Slots + token, mask=rows_ok, other=0).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_co + head * stride_ch
    side = block * stride_sb + offset * stride_so + head * stride_sh
    store_vectors(K, token * stride_kn + head * stride_kh, stride_kd, KC, KS, KZ, dst, side, rows_ok, stride_cd,
                  COLS, C_PAD, FORMAT)
    store_vectors(V, token * stride_vn + head * stride_vh, stride_vd, VC, VS, VZ, dst, side, rows_ok, stride_cd,
                  COLS, C_PAD, FORMAT)


def store_vectors(
    X, src, stride_xd, Cache, Scale, Zero, dst, side, rows_ok, stride_cd,
    COLS: tl.constexpr, C_PAD: tl.constexpr, FORMAT: tl.constexpr,
):
    """Quantizes one ``[head_dim]`` vector per row: from element ``src`` of ``X`` into element ``dst`` of the
    codes (``side`` of the scale/zero pools). ``COLS``: the columns of a code row (``head_dim``, or
    ``head_dim // 2`` packed pairs for int4)."""
    c = tl.arange(0, C_PAD).to(tl.int64)
    ok = rows_ok[:, None] & (c < COLS)[None, :]
    codes = Cache + (dst[:, None] + c[None, :] * stride_cd)
    if FORMAT == 4:  # int4 (asymmetric): z = down(min), s = up((max - z) / 15), q = round((x - z) / s)
        even = tl.load(X + (src[:, None] + (2 * c)[None, :] * stride_xd), mask=ok, other=0.0).to(tl.float32)
        odd = tl.load(X + (src[:, None] + (2 * c + 1)[None, :] * stride_xd), mask=ok, other=0.0).to(tl.float32)
        lowest = tl.minimum(row_min(tl.where(ok, even, float("inf")), 1), row_min(tl.where(ok, odd, float("inf")), 1))
        highest = tl.maximum(row_max(tl.where(ok, even, float("-inf")), 1),
                             row_max(tl.where(ok, odd, float("-inf")), 1))
        zero = half_down(lowest)
        z = zero.to(tl.float32)
        scale = half_up(tl.math.div_rn(highest - z, 15.0))
        s = scale.to(tl.float32)
        divisor = tl.where(s == 0.0, 1.0, s)[:, None]
        num, den = tl.broadcast(even - z[:, None], divisor)
        q_even = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(num, den)), 0.0), 15.0).to(tl.int32)
        num, den = tl.broadcast(odd - z[:, None], divisor)
        q_odd = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(num, den)), 0.0), 15.0).to(tl.int32)
        tl.store(codes, (q_even | (q_odd << 4)).to(tl.uint8), mask=ok)
        tl.store(Zero + side, zero, mask=rows_ok)
        tl.store(Scale + side, scale, mask=rows_ok)
    else:
        x = tl.load(X + (src[:, None] + c[None, :] * stride_xd), mask=ok, other=0.0)
        if FORMAT == 0:  # auto: a cast to the pool dtype
            tl.store(codes, x.to(Cache.dtype.element_ty), mask=ok)
        else:
            x = x.to(tl.float32)
            absmax = row_max(tl.abs(x), 1)
            if FORMAT == 1:  # int8: s = up(absmax / 127), q = round(x / s)
                scale = half_up(tl.math.div_rn(absmax, 127.0))
            elif FORMAT == 2:  # fp8 e4m3fn: s = up(absmax / 448), q = x / s as float8
                scale = half_up(tl.math.div_rn(absmax, 448.0))
            else:  # fp8 e5m2: s = up(absmax / 57344)
                scale = half_up(tl.math.div_rn(absmax, 57344.0))
            s = scale.to(tl.float32)
            num, den = tl.broadcast(x, tl.where(s == 0.0, 1.0, s)[:, None])
            q = tl.math.div_rn(num, den)
            if FORMAT == 1:
                code = tl.minimum(tl.maximum(round_half_even(q), -127.0), 127.0).to(tl.int8)
            elif FORMAT == 2:
                code = float8_bits(tl.minimum(tl.maximum(q, -448.0), 448.0), True)
            else:
                code = float8_bits(tl.minimum(tl.maximum(q, -57344.0), 57344.0), False)
            tl.store(codes, code, mask=ok)
            tl.store(Scale + side, scale, mask=rows_ok)


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
