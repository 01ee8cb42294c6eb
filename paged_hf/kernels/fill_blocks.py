"""Quantization of blocks that fill, for formats with a full-precision tail (int4).

A sequence's newest, not yet full block lives in its tail row (the compute dtype). In the store where the block's
last slot is written, all its tokens exist: the older ones in the tail row, the rest among the store's new K/V.
``fill_blocks_ref`` (torch) and the Triton kernel here gather them and quantize the block as a whole: keys per
channel over the block's tokens (``kv_quant.quantize_channels_ref``), values per token (``quantize_kv_ref``). New
values are first rounded to the tail's dtype, as the tail holds them: a block's bytes then depend only on its
tokens' values, however the tokens arrived (one chunk, several, or decode steps).

``StorePlan`` is what a store of a tail format needs beside the new K/V (built once per forward by ``metadata``).
The kernel: one program per (filled block, KV head); keys in chunks of channel pairs (all the block's tokens in a
chunk), values in chunks of tokens (all channels of a token); the same float32 math and rounding as the reference
(``_rounding``), so the bytes are identical. Decorated on first launch (see ``paged_decode_attention``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import _rounding, _tiles
from ._common import Kernels, Launch, PoolOperands, constexpr_globals, jit_unspecialized, next_pow2
from .kv_format import SIDE_CHANNEL, SIDE_TOKEN, kv_format as _kv_format
from .kv_quant import quantize_channels_ref, quantize_kv_ref

_TILE_ELEMENTS = 2048  # float32 elements per [tokens, channel pairs] tile of a program
_CONSTANTS = ("SIDE_CHANNEL", "SIDE_TOKEN")


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


def fill_blocks_ref(key, value, key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format,
                    key_tail, value_tail, plan: StorePlan) -> None:
    """Torch reference: quantizes ``plan.fill_blocks`` from their tail rows and ``key``/``value`` ``[n, H, D]``."""
    if plan.num_fills == 0:
        return
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
        codes, new_scale, new_zero = quantize_channels_ref(x) if side == "channel" else quantize_kv_ref(x, fmt.name)
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
    value_tokens = max(1, min(t_pad, _TILE_ELEMENTS // pairs_pad))  # tokens per value chunk (all channels)
    args = (
        key, value, *pools.tails, *pools.data, *pools.side, plan.fill_blocks, plan.fill_rows, plan.fill_first,
        plan.fill_tail, *key.stride(), *value.stride(), *pools.tail_strides, *pools.data_strides,
        *pools.side_strides,
    )
    meta = dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, T_PAD=t_pad, KEY_PAIRS=key_pairs,
                VALUE_TOKENS=value_tokens, PAIRS_PAD=pairs_pad, KEY_SIDE=pools.meta["KEY_SIDE"],
                VALUE_SIDE=pools.meta["VALUE_SIDE"])
    # Fused multiply-adds would change the float32 rounding the codes must reproduce.
    return Launch(k.fill, (plan.num_fills, num_kv_heads), args, meta, dict(num_warps=4, enable_fp_fusion=False))


# ----------------------------------------------------------------------------------------------- kernels

tl = None  # triton.language, bound by _kernels()
row_max = row_min = round_half_even = half_up = half_down = cast_rn = None  # helpers, bound by _kernels()


@functools.cache
def _kernels():
    """Decorates the fill kernel (and, compiled, its helpers) on first launch."""
    global tl, row_max, row_min, round_half_even, half_up, half_down, cast_rn, block_values, quantize_pairs
    global _fill_kernel
    import triton

    from ._common import triton_interpreting

    tiles, rounding = _tiles.bind(), _rounding.bind()
    tl = tiles.tl
    row_max, row_min = tiles.row_max, tiles.row_min
    round_half_even, half_up, half_down = rounding.round_half_even, rounding.half_up, rounding.half_down
    cast_rn = rounding.cast_rn
    constexpr_globals(globals(), _CONSTANTS)
    if not triton_interpreting():
        block_values, quantize_pairs = triton.jit(block_values), triton.jit(quantize_pairs)
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


def quantize_pairs(even, odd, zero_even, zero_odd, scale_even, scale_odd):
    """Packed int4 codes ``q = round((x - z) / s)`` in ``[0, 15]`` of even/odd channels (low/high nibble)."""
    s_even = tl.where(scale_even == 0.0, 1.0, scale_even)
    s_odd = tl.where(scale_odd == 0.0, 1.0, scale_odd)
    num, den = tl.broadcast(even - zero_even, s_even)
    q_even = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(num, den)), 0.0), 15.0).to(tl.int32)
    num, den = tl.broadcast(odd - zero_odd, s_odd)
    q_odd = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(num, den)), 0.0), 15.0).to(tl.int32)
    return (q_even | (q_odd << 4)).to(tl.uint8)


def _fill_kernel(
    K, V, KT, VT, KC, VC, KS, VS, KZ, VZ, FillBlocks, FillRows, FillFirst, FillTail,
    stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd,
    stride_tr, stride_to, stride_th, stride_td,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_ksb, stride_ks1, stride_ks2, stride_vsb, stride_vso, stride_vsh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, T_PAD: tl.constexpr, KEY_PAIRS: tl.constexpr,
    VALUE_TOKENS: tl.constexpr, PAIRS_PAD: tl.constexpr, KEY_SIDE: tl.constexpr, VALUE_SIDE: tl.constexpr,
):
    """One (filled block, KV head): its keys per channel, its values per token (int4, asymmetric)."""
    fill = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    block = tl.load(FillBlocks + fill).to(tl.int64)
    tail_row = tl.load(FillRows + fill).to(tl.int64)
    first = tl.load(FillFirst + fill).to(tl.int64)
    num_old = tl.load(FillTail + fill).to(tl.int64)
    codes_base = block * stride_cb + head * stride_ch

    if KEY_SIDE == SIDE_CHANNEL:  # z = down(min over tokens), s = up((max - z) / 15) per channel
        o = tl.arange(0, T_PAD).to(tl.int64)
        o_ok = o < BLOCK_SIZE
        for c0 in range(0, HEAD_DIM // 2, KEY_PAIRS):
            c = c0 + tl.arange(0, KEY_PAIRS).to(tl.int64)
            c_ok = c < HEAD_DIM // 2
            ok = o_ok[:, None] & c_ok[None, :]
            even = block_values(K, KT, o, 2 * c, ok, first, num_old, tail_row, head, stride_kn, stride_kh,
                                stride_kd, stride_tr, stride_to, stride_th, stride_td)
            odd = block_values(K, KT, o, 2 * c + 1, ok, first, num_old, tail_row, head, stride_kn, stride_kh,
                               stride_kd, stride_tr, stride_to, stride_th, stride_td)
            zero_even = half_down(row_min(tl.where(ok, even, float("inf")), 0))
            zero_odd = half_down(row_min(tl.where(ok, odd, float("inf")), 0))
            scale_even = half_up(tl.math.div_rn(row_max(tl.where(ok, even, float("-inf")), 0)
                                                - zero_even.to(tl.float32), 15.0))
            scale_odd = half_up(tl.math.div_rn(row_max(tl.where(ok, odd, float("-inf")), 0)
                                               - zero_odd.to(tl.float32), 15.0))
            packed = quantize_pairs(even, odd, zero_even.to(tl.float32)[None, :], zero_odd.to(tl.float32)[None, :],
                                    scale_even.to(tl.float32)[None, :], scale_odd.to(tl.float32)[None, :])
            tl.store(KC + (codes_base + o[:, None] * stride_co + c[None, :] * stride_cd), packed, mask=ok)
            side = block * stride_ksb + head * stride_ks1
            tl.store(KS + (side + 2 * c * stride_ks2), scale_even, mask=c_ok)
            tl.store(KS + (side + (2 * c + 1) * stride_ks2), scale_odd, mask=c_ok)
            tl.store(KZ + (side + 2 * c * stride_ks2), zero_even, mask=c_ok)
            tl.store(KZ + (side + (2 * c + 1) * stride_ks2), zero_odd, mask=c_ok)

    if VALUE_SIDE == SIDE_TOKEN:  # z = down(min over channels), s = up((max - z) / 15) per token
        c = tl.arange(0, PAIRS_PAD).to(tl.int64)
        c_ok = c < HEAD_DIM // 2
        for t0 in range(0, BLOCK_SIZE, VALUE_TOKENS):
            o = t0 + tl.arange(0, VALUE_TOKENS).to(tl.int64)
            o_ok = o < BLOCK_SIZE
            ok = o_ok[:, None] & c_ok[None, :]
            even = block_values(V, VT, o, 2 * c, ok, first, num_old, tail_row, head, stride_vn, stride_vh,
                                stride_vd, stride_tr, stride_to, stride_th, stride_td)
            odd = block_values(V, VT, o, 2 * c + 1, ok, first, num_old, tail_row, head, stride_vn, stride_vh,
                               stride_vd, stride_tr, stride_to, stride_th, stride_td)
            lowest = tl.minimum(row_min(tl.where(ok, even, float("inf")), 1),
                                row_min(tl.where(ok, odd, float("inf")), 1))
            highest = tl.maximum(row_max(tl.where(ok, even, float("-inf")), 1),
                                 row_max(tl.where(ok, odd, float("-inf")), 1))
            zero = half_down(lowest)
            scale = half_up(tl.math.div_rn(highest - zero.to(tl.float32), 15.0))
            z, s = zero.to(tl.float32)[:, None], scale.to(tl.float32)[:, None]
            packed = quantize_pairs(even, odd, z, z, s, s)
            tl.store(VC + (codes_base + o[:, None] * stride_co + c[None, :] * stride_cd), packed, mask=ok)
            side = block * stride_vsb + o * stride_vso + head * stride_vsh
            tl.store(VS + side, scale, mask=o_ok)
            tl.store(VZ + side, zero, mask=o_ok)
