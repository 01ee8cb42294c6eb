"""Quantization of blocks that fill, for formats with a full-precision tail (int4).

A sequence's newest, not yet full block lives in its tail row (the compute dtype). In the store where the block's
last slot is written, all its tokens exist: the older ones in the tail row, the rest among the store's new K/V.
``fill_blocks_ref`` (torch) and the Triton kernel here gather them and quantize the block as a whole: keys per
channel over the block's tokens on the block's grid (``kv_quant.quantize_channels_ref``), values per token with a
4-bit scale code on the block's maximum (``quantize_block_values_ref``). New
values are first rounded to the tail's dtype, as the tail holds them: a block's bytes then depend only on its
tokens' values, however the tokens arrived (one chunk, several, or decode steps).

``StorePlan`` is what a store of a tail format needs beside the new K/V (built once per forward by ``metadata``).
The kernel: one program per (filled block, KV head), in two passes per K and V, as both need the whole block's
extremes first: keys in chunks of channel pairs (all the block's tokens in a chunk), a pass for the grid (min and
max over the block), then one for each channel's range codes and its codes; values a pass for ``vmax`` (in chunks
of tokens, all channels of a token), then one over chunks of token pairs (the two nibbles of a scale-code byte)
trying the 16 scales per token. The same float32 operations and rounding as the reference (``_rounding``;
divisions ``div_rn``, no fused multiply-adds, the squared errors summed as integers), so the bytes are identical.
Decorated on first launch (see ``paged_decode_attention``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import _rounding, _tiles
from ._common import Kernels, Launch, PoolOperands, constexpr_globals, jit_unspecialized, next_pow2
from .kv_format import SIDE_CHANNEL, SIDE_TOKEN_CODE, kv_format as _kv_format
from .kv_quant import quantize_block_values_ref, quantize_channels_ref
from .pool_tensors import PoolTensors

_TILE_ELEMENTS = 2048  # float32 elements per [tokens, channel pairs] tile of a program
_CONSTANTS = ("SIDE_CHANNEL", "SIDE_TOKEN_CODE")


@dataclass(frozen=True)
class StorePlan:
    """Where a tail format's store puts each new token (index tensors on the pools' device).

    tail_slots: ``[n]`` int64, ``row * block_size + offset`` in the tail pools for a token whose block is not full
        after the store, -1 for a token of a block that fills.
    fill_blocks: ``[F]`` int64, the pool blocks that fill in this store;
    fill_rows: ``[F]`` the tail row of each (its sequence's row);
    fill_first: ``[F]`` the index among the new tokens that offset 0 of the block would have (negative when the
        block's first tokens are older);
    fill_tail: ``[F]`` how many of the block's first tokens come from the tail row (``0 .. block_size - 1``).
    """

    tail_slots: torch.Tensor
    fill_blocks: torch.Tensor
    fill_rows: torch.Tensor
    fill_first: torch.Tensor
    fill_tail: torch.Tensor

    @property
    def num_fills(self) -> int:
        return self.fill_blocks.shape[0]


def fill_blocks_ref(key, value, pools: PoolTensors, plan: StorePlan) -> None:
    """Torch reference: quantizes ``plan.fill_blocks`` of ``pools`` from their tail rows and ``key``/``value`` ``[n,
    H, D]`` (``kv_quant.quantize_channels_ref`` for keys, ``quantize_block_values_ref`` for values; the side pools
    as the format describes them for int4)."""
    if plan.num_fills == 0:
        return
    key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format, key_tail, value_tail = pools
    fmt = _kv_format(kv_format)
    block_size = key_cache.shape[1]
    offsets = torch.arange(block_size, device=key.device)
    from_tail = (offsets[None, :] < plan.fill_tail[:, None])[:, :, None, None]  # [F, bs, 1, 1]
    tail_index = plan.fill_rows[:, None] * block_size + offsets[None, :]
    new_index = (plan.fill_first[:, None] + offsets[None, :]).clamp(0, max(key.shape[0] - 1, 0))
    blocks = plan.fill_blocks.long()
    for states, tail, cache, scale, zero, side in (
        (key, key_tail, key_cache, key_scale, key_zero, fmt.key_side),
        (value, value_tail, value_cache, value_scale, value_zero, fmt.value_side),
    ):
        old = tail.view(-1, *tail.shape[2:])[tail_index]  # [F, bs, H, D]
        new = states[new_index].to(tail.dtype) if states.shape[0] else torch.zeros_like(old)
        x = torch.where(from_tail, old, new).float()
        quantize = quantize_channels_ref if side == "channel" else quantize_block_values_ref
        codes, new_scale, new_zero = quantize(x)
        for pool, data in ((cache, codes), (scale, new_scale), (zero, new_zero)):
            if pool is not None:
                pool.index_copy_(0, blocks, data)


def fill_launch(key, value, pools: PoolOperands, plan: StorePlan) -> Launch:
    """The launch of the fill kernel for ``plan`` (a grid of 0 programs when no block fills)."""
    k = _kernels()
    num_tokens, num_kv_heads, head_dim = key.shape
    for name in ("tail_slots", "fill_blocks", "fill_rows", "fill_first", "fill_tail"):
        t = getattr(plan, name)
        expected = num_tokens if name == "tail_slots" else plan.num_fills
        if t.dim() != 1 or t.shape[0] != expected or t.dtype not in (torch.int32, torch.int64) \
                or t.device != key.device:
            raise ValueError(f"plan.{name} must be int32/int64 [{expected}] on {key.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    block_size = pools.block_size
    t_pad = next_pow2(block_size)
    pairs_pad = next_pow2(head_dim // 2)
    key_pairs = max(1, min(pairs_pad, _TILE_ELEMENTS // t_pad))  # channel pairs per key chunk (all tokens)
    value_tokens = max(1, min(t_pad, _TILE_ELEMENTS // pairs_pad))  # tokens per chunk of the value maximum
    value_pairs = max(1, min(t_pad // 2, _TILE_ELEMENTS // (2 * pairs_pad)))  # token pairs per value chunk
    args = (
        key, value, *pools.tails, *pools.data, *pools.side, plan.fill_blocks, plan.fill_rows, plan.fill_first,
        plan.fill_tail, *key.stride(), *value.stride(), *pools.tail_strides, *pools.data_strides,
        *pools.side_strides,
    )
    meta = dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, T_PAD=t_pad, KEY_PAIRS=key_pairs,
                VALUE_TOKENS=value_tokens, VALUE_PAIRS=value_pairs, PAIRS_PAD=pairs_pad,
                KEY_SIDE=pools.meta["KEY_SIDE"], VALUE_SIDE=pools.meta["VALUE_SIDE"])
    # Fused multiply-adds would change the float32 rounding the codes must reproduce.
    return Launch(k.fill, (plan.num_fills, num_kv_heads), args, meta, dict(num_warps=4, enable_fp_fusion=False))


# ----------------------------------------------------------------------------------------------- kernels

tl = None  # triton.language, bound by _kernels()
row_max = row_min = row_sum = round_half_even = half_up = half_down = cast_rn = value_scale_step = None  # bound below


@functools.cache
def _kernels():
    """Decorates the fill kernel (and, compiled, its helpers) on first launch."""
    global tl, row_max, row_min, row_sum, round_half_even, half_up, half_down, cast_rn, value_scale_step
    global block_values, quantize_pairs, key_ranges, value_codes, squared_error_units, _fill_kernel
    import triton

    from ._common import triton_interpreting

    tiles, rounding = _tiles.bind(), _rounding.bind()
    tl = tiles.tl
    row_max, row_min, row_sum = tiles.row_max, tiles.row_min, tiles.row_sum
    round_half_even, half_up, half_down = rounding.round_half_even, rounding.half_up, rounding.half_down
    cast_rn, value_scale_step = rounding.cast_rn, rounding.value_scale_step
    constexpr_globals(globals(), _CONSTANTS)
    if not triton_interpreting():
        block_values, quantize_pairs = triton.jit(block_values), triton.jit(quantize_pairs)
        key_ranges, value_codes = triton.jit(key_ranges), triton.jit(value_codes)
        squared_error_units = triton.jit(squared_error_units)
    _fill_kernel = jit_unspecialized(_fill_kernel, (), ("FillBlocks", "FillRows", "FillFirst", "FillTail"))
    return Kernels(fill=_fill_kernel)


def block_values(X, XT, o, channels, ok, first, num_old, tail_row, head, stride_xn, stride_xh, stride_xd,
                 stride_tr, stride_to, stride_th, stride_td):
    """float32 ``[len(o), len(channels)]``: offsets ``o`` of a filling block, from its tail row (``o < num_old``)
    or from the new K/V (index ``first + o``, first rounded to the tail's dtype)."""
    old = (o < num_old)[:, None]
    new = tl.load(X + ((first + o)[:, None] * stride_xn + head * stride_xh + channels[None, :] * stride_xd),
                  mask=ok & ~old, other=0.0)
    new = cast_rn(new, XT.dtype.element_ty).to(tl.float32)
    kept = tl.load(XT + (tail_row * stride_tr + o[:, None] * stride_to + head * stride_th
                         + channels[None, :] * stride_td), mask=ok & old, other=0.0).to(tl.float32)
    return tl.where(old, kept, new)


def key_ranges(lowest, highest, base, step):
    """``kv_quant.quantize_channels_ref``'s range codes of channels with extremes ``lowest``/``highest`` on the grid
    ``base``, ``step`` (float32): ``(u_lo, u_hi, lo, s)``, the codes as float32, in the reference's operations."""
    flat = step == 0.0
    den = tl.where(flat, 1.0, step)
    num, den_b = tl.broadcast(lowest - base, den)
    u_lo = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(num, den_b)), 0.0), 255.0)
    num, den_b = tl.broadcast(highest - base, den)
    u_hi = tl.minimum(tl.maximum(tl.ceil(tl.math.div_rn(num, den_b)), 0.0), 255.0)
    u_lo = tl.where((base + step * u_lo > lowest) & (u_lo > 0.0), u_lo - 1.0, u_lo)
    u_hi = tl.where((base + step * u_hi < highest) & (u_hi < 255.0), u_hi + 1.0, u_hi)
    u_lo = tl.where(flat, 0.0, u_lo)
    u_hi = tl.where(flat, 0.0, u_hi)
    lo = base + step * u_lo
    hi = base + step * u_hi
    return u_lo, u_hi, lo, tl.math.div_rn(hi - lo, 15.0)


def quantize_pairs(even, odd, zero_even, zero_odd, scale_even, scale_odd):
    """Packed int4 codes ``q = round((x - z) / s)`` in ``[0, 15]`` (0 where ``s == 0``) of even/odd channels
    (low/high nibble)."""
    num, den = tl.broadcast(even - zero_even, tl.where(scale_even == 0.0, 1.0, scale_even))
    q_even = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(num, den)), 0.0), 15.0)
    q_even = tl.where(scale_even == 0.0, 0.0, q_even).to(tl.int32)
    num, den = tl.broadcast(odd - zero_odd, tl.where(scale_odd == 0.0, 1.0, scale_odd))
    q_odd = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(num, den)), 0.0), 15.0)
    q_odd = tl.where(scale_odd == 0.0, 0.0, q_odd).to(tl.int32)
    return (q_even | (q_odd << 4)).to(tl.uint8)


def squared_error_units(x, s, den, unit):
    """``((q s - x) / unit)^2 * 2^32`` truncated to int64, ``q = clamp(round(x / den), -8, 7)`` (``s``, ``den``,
    ``unit``: float32 scalars): the error terms of ``kv_quant.quantize_block_values_ref``."""
    num, den_b = tl.broadcast(x, den)
    q = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(num, den_b)), -8.0), 7.0)
    num, unit_b = tl.broadcast(q * s - x, unit)
    e = tl.math.div_rn(num, unit_b)
    return (e * e * 4294967296.0).to(tl.int64)


def value_codes(even, odd, vmax):
    """int4 values of tokens (rows; even/odd channels ``[N, P]`` float32) on the block's ``vmax`` (float32 scalar):
    ``(packed codes [N, P], scale codes [N] int32)``: per token, the ``k`` in ``0 .. 15`` whose codes ``clamp(
    round(x / s_k), -8, 7)``, ``s_k = vmax * 2^(-k/3)``, give the least squared error, summed as integers exactly
    as ``kv_quant.quantize_block_values_ref`` sums them (ties: the smallest ``k``); codes ``q + 8``."""
    steps = value_scale_step(tl.arange(0, 16))  # [16] float32, VALUE_SCALE_STEPS
    unit = tl.where(vmax == 0.0, 1.0, vmax)
    best = tl.full([even.shape[0]], 0, tl.int32)
    best_error = tl.full([even.shape[0]], 9223372036854775807, tl.int64)
    for k in range(16):
        s = vmax * row_sum(tl.where(tl.arange(0, 16) == k, steps, 0.0), 0)  # s_k (the sum adds zeros only)
        den = tl.where(s == 0.0, 1.0, s)
        error = row_sum(squared_error_units(even, s, den, unit), 1) + row_sum(squared_error_units(odd, s, den, unit), 1)
        better = error < best_error
        best = tl.where(better, k, best)
        best_error = tl.where(better, error, best_error)
    s = (vmax * value_scale_step(best))[:, None]
    den = tl.where(s == 0.0, 1.0, s)
    num, den_b = tl.broadcast(even, den)
    q_even = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(num, den_b)), -8.0), 7.0).to(tl.int32) + 8
    num, den_b = tl.broadcast(odd, den)
    q_odd = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(num, den_b)), -8.0), 7.0).to(tl.int32) + 8
    return (q_even | (q_odd << 4)).to(tl.uint8), best


def _fill_kernel(
    K, V, KT, VT, KC, VC, KS, VS, KZ, VZ, FillBlocks, FillRows, FillFirst, FillTail,
    stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd,
    stride_tr, stride_to, stride_th, stride_td,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_ksb, stride_ks1, stride_ks2, stride_vsb, stride_vso, stride_vsh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, T_PAD: tl.constexpr, KEY_PAIRS: tl.constexpr,
    VALUE_TOKENS: tl.constexpr, VALUE_PAIRS: tl.constexpr, PAIRS_PAD: tl.constexpr, KEY_SIDE: tl.constexpr,
    VALUE_SIDE: tl.constexpr,
):
    """One (filled block, KV head): its keys per channel on the block's grid, its values per token on the block's
    maximum (int4; the side pools as ``kv_format`` lays them out, strides as ``PoolOperands.side_strides``)."""
    fill = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    block = tl.load(FillBlocks + fill).to(tl.int64)
    tail_row = tl.load(FillRows + fill).to(tl.int64)
    first = tl.load(FillFirst + fill).to(tl.int64)
    num_old = tl.load(FillTail + fill).to(tl.int64)
    codes_base = block * stride_cb + head * stride_ch

    if KEY_SIDE == SIDE_CHANNEL:
        o = tl.arange(0, T_PAD).to(tl.int64)
        o_ok = o < BLOCK_SIZE
        # pass 1: the grid, base = down(min), step = up((max - base) / 255) over all tokens and channels
        lowest = row_min(tl.full([2], float("inf"), tl.float32), 0)
        highest = row_max(tl.full([2], float("-inf"), tl.float32), 0)
        for c0 in range(0, HEAD_DIM // 2, KEY_PAIRS):
            c = c0 + tl.arange(0, KEY_PAIRS).to(tl.int64)
            ok = o_ok[:, None] & (c < HEAD_DIM // 2)[None, :]
            even = block_values(K, KT, o, 2 * c, ok, first, num_old, tail_row, head, stride_kn, stride_kh,
                                stride_kd, stride_tr, stride_to, stride_th, stride_td)
            odd = block_values(K, KT, o, 2 * c + 1, ok, first, num_old, tail_row, head, stride_kn, stride_kh,
                               stride_kd, stride_tr, stride_to, stride_th, stride_td)
            low = tl.minimum(tl.where(ok, even, float("inf")), tl.where(ok, odd, float("inf")))
            high = tl.maximum(tl.where(ok, even, float("-inf")), tl.where(ok, odd, float("-inf")))
            lowest = tl.minimum(lowest, row_min(row_min(low, 1), 0))
            highest = tl.maximum(highest, row_max(row_max(high, 1), 0))
        base = half_down(lowest)
        step = half_up(tl.math.div_rn(highest - base.to(tl.float32), 255.0))
        grid = block * stride_ksb + head * stride_ks1  # key_zero [nb, H, 2]; range codes at HEAD_DIM x offsets
        tl.store(KZ + grid, base)
        tl.store(KZ + (grid + stride_ks2), step)
        b, st = base.to(tl.float32), step.to(tl.float32)
        # pass 2: each channel's range codes on the grid, then its codes
        for c0 in range(0, HEAD_DIM // 2, KEY_PAIRS):
            c = c0 + tl.arange(0, KEY_PAIRS).to(tl.int64)
            c_ok = c < HEAD_DIM // 2
            ok = o_ok[:, None] & c_ok[None, :]
            even = block_values(K, KT, o, 2 * c, ok, first, num_old, tail_row, head, stride_kn, stride_kh,
                                stride_kd, stride_tr, stride_to, stride_th, stride_td)
            odd = block_values(K, KT, o, 2 * c + 1, ok, first, num_old, tail_row, head, stride_kn, stride_kh,
                               stride_kd, stride_tr, stride_to, stride_th, stride_td)
            lo_even_code, hi_even_code, lo_even, s_even = key_ranges(
                row_min(tl.where(ok, even, float("inf")), 0), row_max(tl.where(ok, even, float("-inf")), 0), b, st)
            lo_odd_code, hi_odd_code, lo_odd, s_odd = key_ranges(
                row_min(tl.where(ok, odd, float("inf")), 0), row_max(tl.where(ok, odd, float("-inf")), 0), b, st)
            packed = quantize_pairs(even, odd, lo_even[None, :], lo_odd[None, :], s_even[None, :], s_odd[None, :])
            tl.store(KC + (codes_base + o[:, None] * stride_co + c[None, :] * stride_cd), packed, mask=ok)
            lo_codes = KS + (grid * HEAD_DIM + 2 * c)
            hi_codes = KS + ((grid + stride_ks2) * HEAD_DIM + 2 * c)
            tl.store(lo_codes, lo_even_code.to(tl.uint8), mask=c_ok)
            tl.store(lo_codes + 1, lo_odd_code.to(tl.uint8), mask=c_ok)
            tl.store(hi_codes, hi_even_code.to(tl.uint8), mask=c_ok)
            tl.store(hi_codes + 1, hi_odd_code.to(tl.uint8), mask=c_ok)

    if VALUE_SIDE == SIDE_TOKEN_CODE:
        c = tl.arange(0, PAIRS_PAD).to(tl.int64)
        c_ok = c < HEAD_DIM // 2
        # pass 1: vmax = up(max |x| / 7) over the block
        absmax = row_max(tl.full([2], 0.0, tl.float32), 0)
        for t0 in range(0, BLOCK_SIZE, VALUE_TOKENS):
            tokens = t0 + tl.arange(0, VALUE_TOKENS).to(tl.int64)
            tokens_ok = (tokens < BLOCK_SIZE)[:, None] & c_ok[None, :]
            # (names are per pass: triton types a name once, and the passes' tiles have other shapes)
            t_even = block_values(V, VT, tokens, 2 * c, tokens_ok, first, num_old, tail_row, head, stride_vn,
                                  stride_vh, stride_vd, stride_tr, stride_to, stride_th, stride_td)
            t_odd = block_values(V, VT, tokens, 2 * c + 1, tokens_ok, first, num_old, tail_row, head, stride_vn,
                                 stride_vh, stride_vd, stride_tr, stride_to, stride_th, stride_td)
            magnitude = tl.maximum(tl.where(tokens_ok, tl.abs(t_even), 0.0),
                                   tl.where(tokens_ok, tl.abs(t_odd), 0.0))
            absmax = tl.maximum(absmax, row_max(row_max(magnitude, 1), 0))
        vmax = half_up(tl.math.div_rn(absmax, 7.0))
        side = block * stride_vsb + head * stride_vsh  # value_zero [nb, H]; scale codes at BLOCK_SIZE // 2 x it
        tl.store(VZ + side, vmax)
        v = vmax.to(tl.float32)
        # pass 2: token pairs (2i, 2i + 1): codes, and the byte of their scale codes
        for p0 in range(0, BLOCK_SIZE // 2, VALUE_PAIRS):
            pair = p0 + tl.arange(0, VALUE_PAIRS).to(tl.int64)
            pair_ok = pair < BLOCK_SIZE // 2
            pairs_ok = pair_ok[:, None] & c_ok[None, :]
            scale_byte = tl.full([VALUE_PAIRS], 0, tl.int32)
            for half in range(2):
                pair_tokens = 2 * pair + half
                p_even = block_values(V, VT, pair_tokens, 2 * c, pairs_ok, first, num_old, tail_row, head,
                                      stride_vn, stride_vh, stride_vd, stride_tr, stride_to, stride_th, stride_td)
                p_odd = block_values(V, VT, pair_tokens, 2 * c + 1, pairs_ok, first, num_old, tail_row, head,
                                     stride_vn, stride_vh, stride_vd, stride_tr, stride_to, stride_th, stride_td)
                v_packed, k = value_codes(p_even, p_odd, v)
                tl.store(VC + (codes_base + pair_tokens[:, None] * stride_co + c[None, :] * stride_cd), v_packed,
                         mask=pairs_ok)
                scale_byte = scale_byte | (k << (4 * half))
            tl.store(VS + (side * (BLOCK_SIZE // 2) + pair * stride_vso), scale_byte.to(tl.uint8), mask=pair_ok)
