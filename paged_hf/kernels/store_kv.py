"""Store of new K/V into the paged pools, quantizing on the way.

``store_kv_ref`` is the torch reference; ``store_kv`` the Triton launcher with the same signature, bit-identical
codes, scales and zeros. What a store does follows the ``KVFormat``:

- formats without a tail ("auto", int8, fp8): every new token is written at its slot (``kv_quant.quantize_kv_ref``
  per token for quantized formats);
- formats with a full-precision tail (int4): the ``StorePlan`` says which blocks fill (``fill_blocks``: quantized
  as a whole from the tail row's older tokens and the new ones) and which new tokens stay in their sequence's tail
  row (their block is not full after this forward: written in the compute dtype at ``plan.tail_slots``). The tail
  writes are a second call, ``store_tails`` / ``store_tails_ref``, made after the forward's attention: the attention
  reads each query's own block in full precision, its older tokens from the tail row as it was before the forward,
  which the tail writes may overwrite (``attention_ref``).

The Triton store kernel (this module): one program per ``_STORE_ROWS`` (token, KV head) vectors, one per tile row
(K, then V); float32 math in the reference's order, with IEEE-rounded divisions (``tl.math.div_rn``: the default
Triton division is approximate on GPUs) and round-half-to-even (``torch.round``) through the 1.5 * 2^23 trick;
float16 side data rounded like ``_half_up`` / ``_half_down``; float8 codes encoded from the float32 bits with
round-to-nearest-even (``_rounding``), stored as bytes (no float8 type needed in the kernel). Slots must be valid
(``0 <= slot < num_blocks * block_size``) and distinct, as for ``index_copy_``; a slot of -1 stores nothing (tail
writes only). Decorated on first launch (see ``paged_decode_attention``).
"""

from __future__ import annotations

import functools

import torch

from . import _rounding, _tiles
from . import fill_blocks as _fill
from ._common import Kernels, Launch, check_pools, constexpr_globals, jit_unspecialized, next_pow2, triton_interpreting
from .fill_blocks import StorePlan, fill_blocks_ref
from .kv_format import CODES_E4M3, CODES_E5M2, CODES_INT8, CODES_MODEL, kv_format as _kv_format
from .kv_quant import quantize_kv_ref
from .pool_tensors import PoolTensors

__all__ = ["StorePlan", "store_kv", "store_kv_ref", "store_tails", "store_tails_ref"]

_STORE_ROWS = 32  # (token, head) vectors per program
_CONSTANTS = ("CODES_E4M3", "CODES_E5M2", "CODES_INT8", "CODES_MODEL")


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, pools: PoolTensors,
                 plan: StorePlan | None = None) -> None:
    """Torch reference: writes ``key``/``value`` ``[n, num_kv_heads, head_dim]`` into the pools, in place.

    Formats without a tail: at ``slots`` ``[n]`` (int64, ``block_id * block_size + offset``); "auto" casts to the pool
    dtype, quantized formats store the codes and float16 side data of ``kv_quant.quantize_kv_ref`` (float8 pools
    through uint8 views: CPU index ops lack float8). Tail formats: the blocks that fill, as ``plan`` says (``slots``
    unused; the tail writes are ``store_tails_ref``), see the module docstring.
    """
    key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format, key_tail, value_tail = pools
    fmt = _kv_format(kv_format)
    if fmt.tail:
        if plan is None or key_tail is None or value_tail is None:
            raise ValueError(f"kv_format={kv_format!r} keeps a full-precision tail: its store needs key_tail, "
                             f"value_tail and a StorePlan")
        fill_blocks_ref(key, value, pools, plan)
        return
    slots = slots.long()
    for states, cache, scale, zero in ((key, key_cache, key_scale, key_zero), (value, value_cache, value_scale,
                                                                                  value_zero)):
        if not fmt.quantized:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, states.to(cache.dtype))
            continue
        data, new_scale, new_zero = quantize_kv_ref(states, kv_format)
        for pool, new in ((cache, data), (scale, new_scale), (zero, new_zero)):
            if pool is not None and new is not None:
                _bytes(pool).view(-1, *pool.shape[2:]).index_copy_(0, slots, _bytes(new))


def store_tails_ref(key: torch.Tensor, value: torch.Tensor, pools: PoolTensors, plan: StorePlan) -> None:
    """Torch reference: writes the new tokens whose block is not full after the forward (``plan.tail_slots >= 0``)
    into the tail pools ``[rows, block_size, num_kv_heads, head_dim]`` of ``pools``, cast to their dtype.
    ``key``/``value``: the forward's ``[n, num_kv_heads, head_dim]``, as its store got them."""
    if torch.compiler.is_compiling():
        _store_tails_static(key, value, pools, plan)
        return
    tail = plan.tail_slots >= 0
    store_kv_ref(key[tail], value[tail], plan.tail_slots[tail], PoolTensors(pools.key_tail, pools.value_tail))


def _store_tails_static(key: torch.Tensor, value: torch.Tensor, pools: PoolTensors, plan: StorePlan) -> None:
    """``store_tails_ref`` with no shape that depends on the values, for a compiled ``generate`` (inductor fails on
    the unbacked sizes the boolean index makes; eager, that index is the faster: 66 against 116 us a layer at 16
    tokens): every token writes, a token without a tail slot the first kept token's slot and vector (row 0's own
    vector when none is kept), so a slot written twice gets the same vector twice."""
    if key.shape[0] == 0 or pools.key_tail.shape[0] == 0:  # nothing to write, or no tail row exists yet
        return
    kept = plan.tail_slots >= 0
    first = kept.int().argmax().view(1)  # the first kept token (0 when none is), as an index tensor: no .item()
    any_kept = kept.any()
    slots = torch.where(kept, plan.tail_slots, torch.where(any_kept, plan.tail_slots.index_select(0, first), 0))
    slots = slots.long()
    for states, tail in ((key, pools.key_tail), (value, pools.value_tail)):
        rows = tail.view(-1, *tail.shape[2:])
        states = states.to(tail.dtype)
        spare = torch.where(any_kept, states.index_select(0, first), rows[:1])
        rows.index_copy_(0, slots, torch.where(kept[:, None, None], states, spare))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def store_kv(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, pools: PoolTensors,
             plan: StorePlan | None = None) -> None:
    """Triton store; the arguments and effect of ``store_kv_ref``."""
    for launch in _store_launches(key, value, slots, pools, plan):
        launch()


def _store_launches(key, value, slots, pools: PoolTensors, plan=None) -> list[Launch]:
    for name, states in (("key", key), ("value", value)):
        if states.dim() != 3 or not states.dtype.is_floating_point or states.dtype.itemsize == 1:
            raise ValueError(f"{name} must be a float [n, num_kv_heads, head_dim] tensor, got {states.dtype} "
                             f"{tuple(states.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if value.device != key.device:
        raise ValueError(f"value is on {value.device}, key on {key.device}")
    head_dim = key.shape[2]
    pools = check_pools(key, pools, head_dim)
    if pools.num_kv_heads != key.shape[1]:
        raise ValueError(f"pools hold {pools.num_kv_heads} KV heads, key has {key.shape[1]}")
    if not pools.fmt.tail:
        return [_vector_store(key, value, slots, pools.data, pools.side, pools.data_strides, pools.side_strides[:3],
                              pools.block_size, pools.fmt.codes)]
    if not isinstance(plan, StorePlan):
        raise ValueError(f"kv_format={pools.fmt.name!r} keeps a full-precision tail: its store needs a StorePlan")
    return [_fill.fill_launch(key, value, pools, plan)]


def store_tails(key: torch.Tensor, value: torch.Tensor, pools: PoolTensors, plan: StorePlan) -> None:
    """Triton tail writes; the arguments and effect of ``store_tails_ref``."""
    _tail_launch(key, value, pools.key_tail, pools.value_tail, plan)()


def _tail_launch(key, value, key_tail, value_tail, plan: StorePlan) -> Launch:
    if key.shape != value.shape or key.dim() != 3 or key_tail.shape[2:] != key.shape[1:] \
            or value_tail.shape != key_tail.shape:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and the tail pools "
                         f"{tuple(key_tail.shape)} / {tuple(value_tail.shape)} do not match")
    strides = tuple(key_tail.stride())
    if tuple(value_tail.stride()) != strides:
        raise ValueError("key_tail and value_tail must share their strides")
    return _vector_store(key, value, plan.tail_slots, (key_tail, value_tail), (None,) * 4, strides, (0, 0, 0),
                         key_tail.shape[1], CODES_MODEL)


def _vector_store(key, value, slots, data, side, data_strides, side_strides, block_size, codes) -> Launch:
    """One launch of the store kernel: every token's vectors into ``slots`` of ``data`` (codes and per-token side
    data, or the compute dtype for ``codes == CODES_MODEL``)."""
    k = _kernels()
    num_tokens, num_kv_heads, head_dim = key.shape
    if slots.shape != (num_tokens,) or slots.dtype not in (torch.int32, torch.int64) or slots.device != key.device:
        raise ValueError(f"slots must be int32/int64 [{num_tokens}] on {key.device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")
    cols = head_dim
    h_pad = next_pow2(num_kv_heads)
    block_t = max(1, _STORE_ROWS // h_pad)
    args = (key, value, slots.contiguous(), *data, *side, num_tokens, *key.stride(), *value.stride(), *data_strides,
            *side_strides)
    meta = dict(NUM_HEADS=num_kv_heads, COLS=cols, H_PAD=h_pad, C_PAD=next_pow2(cols), BLOCK_T=block_t,
                BLOCK_SIZE=block_size, CODES=codes)
    # Fused multiply-adds would change the float32 rounding the codes must reproduce.
    grid = (-(-num_tokens // block_t),)
    return Launch(k.store, grid, args, meta, dict(num_warps=4, enable_fp_fusion=False))


# ----------------------------------------------------------------------------------------------- kernels

tl = None  # triton.language, bound by _kernels()
row_max = round_half_even = half_up = float8_bits = cast_rn = None  # helpers, bound by _kernels()


@functools.cache
def _kernels():
    """Decorates the store kernel (and, compiled, its helpers) on first launch."""
    global tl, row_max, round_half_even, half_up, float8_bits, cast_rn, store_vectors, _store_kernel
    import triton

    tiles, rounding = _tiles.bind(), _rounding.bind()
    tl = tiles.tl
    row_max = tiles.row_max
    round_half_even, half_up, float8_bits = rounding.round_half_even, rounding.half_up, rounding.float8_bits
    cast_rn = rounding.cast_rn
    constexpr_globals(globals(), _CONSTANTS)
    if not triton_interpreting():
        store_vectors = triton.jit(store_vectors)
    _store_kernel = jit_unspecialized(_store_kernel, ("num_tokens",), ("Slots",))  # any count, any slice
    return Kernels(store=_store_kernel)


def _store_kernel(
    K, V, Slots, KC, VC, KS, VS, KZ, VZ, num_tokens,
    stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_sb, stride_so, stride_sh,
    NUM_HEADS: tl.constexpr, COLS: tl.constexpr, H_PAD: tl.constexpr, C_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr, CODES: tl.constexpr,
):
    """BLOCK_T tokens x their KV heads: one row per (token, head) vector; a slot of -1 stores nothing."""
    r = tl.arange(0, BLOCK_T * H_PAD).to(tl.int64)
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + r // H_PAD
    head = r % H_PAD
    rows_ok = (token < num_tokens) & (head < NUM_HEADS)
    slot = tl.load(Slots + token, mask=rows_ok, other=0).to(tl.int64)
    rows_ok = rows_ok & (slot >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_co + head * stride_ch
    side = block * stride_sb + offset * stride_so + head * stride_sh
    store_vectors(K, token * stride_kn + head * stride_kh, stride_kd, KC, KS, KZ, dst, side, rows_ok, stride_cd,
                  COLS, C_PAD, CODES)
    store_vectors(V, token * stride_vn + head * stride_vh, stride_vd, VC, VS, VZ, dst, side, rows_ok, stride_cd,
                  COLS, C_PAD, CODES)


def store_vectors(
    X, src, stride_xd, Cache, Scale, Zero, dst, side, rows_ok, stride_cd,
    COLS: tl.constexpr, C_PAD: tl.constexpr, CODES: tl.constexpr,
):
    """Quantizes one ``[head_dim]`` vector per row: from element ``src`` of ``X`` into element ``dst`` of the
    codes (``side`` of the scale pool). Per-token formats (int8, fp8) and the compute dtype (tail writes); int4
    blocks are quantized by ``fill_blocks``."""
    c = tl.arange(0, C_PAD).to(tl.int64)
    ok = rows_ok[:, None] & (c < COLS)[None, :]
    codes = Cache + (dst[:, None] + c[None, :] * stride_cd)
    x = tl.load(X + (src[:, None] + c[None, :] * stride_xd), mask=ok, other=0.0)
    if CODES == CODES_MODEL:  # a cast to the pool dtype (rounded to nearest, as torch)
        tl.store(codes, cast_rn(x, Cache.dtype.element_ty), mask=ok)
    else:
        x = x.to(tl.float32)
        absmax = row_max(tl.abs(x), 1)
        if CODES == CODES_INT8:  # int8: s = up(absmax / 127), q = round(x / s)
            scale = half_up(tl.math.div_rn(absmax, 127.0))
        elif CODES == CODES_E4M3:  # fp8 e4m3fn: s = up(absmax / 448), q = x / s as float8
            scale = half_up(tl.math.div_rn(absmax, 448.0))
        else:  # fp8 e5m2: s = up(absmax / 57344)
            scale = half_up(tl.math.div_rn(absmax, 57344.0))
        s = scale.to(tl.float32)
        num, den = tl.broadcast(x, tl.where(s == 0.0, 1.0, s)[:, None])
        q = tl.math.div_rn(num, den)
        if CODES == CODES_INT8:
            code = tl.minimum(tl.maximum(round_half_even(q), -127.0), 127.0).to(tl.int8)
        elif CODES == CODES_E4M3:
            code = float8_bits(tl.minimum(tl.maximum(q, -448.0), 448.0), True)
        else:
            code = float8_bits(tl.minimum(tl.maximum(q, -57344.0), 57344.0), False)
        tl.store(codes, code, mask=ok)
        tl.store(Scale + side, scale, mask=rows_ok)
