"""Device code shared by the paged attention kernels (decode and prefill): one pass over a sequence's keys.

``attend_blocks`` walks positions ``[lo, hi)`` of the quantized (or "auto") blocks in tiles of ``BLOCK_N`` tokens
gathered through the block table. Formats with ``KVFormat.tail`` read each query's own block in full precision
instead (``attention_ref``'s policy): ``attend_exact`` walks its positions, those older than the forward from the
sequence's tail row (as it was before the forward), the forward's own from its new K/V; the blocks are then read
only where a key's block precedes the query's (``OWN_NONE`` / ``OWN_BEFORE`` / ``OWN_SAME``: which keys of a source
a row sees, beside causality and the window). All update the same online softmax (running max ``m_i``, sum
``l_i``, float32 accumulator), so a query reads its quantized blocks and its own block in one pass;
``attend_sequence`` splits a key range between them (what both kernels call).

K/V codes enter the dots as loaded (int8, float8 decoded from their bits, int4 nibbles; exact in the query's dtype)
and the side data applies around them:

- per-token scales (and zero points) scale the scores and probabilities: ``q . (c s + z) = (q . c) s + z sum(q)``,
  ``sum_j p_j (c_j s_j + z_j) = sum_j (p_j s_j) c_j + sum_j p_j z_j``; int4 values (``load_value_code_side``) take
  each token's ``s = vmax * 2^(-k/3)`` from its 4-bit scale code ``k`` (``value_scale``) and its block's ``vmax``
  (``value_zero``), and ``z = -8 s`` (codes ``q + 8``);
- per-channel key ranges (int4 keys, over a block; ``channel_ranges`` reads each channel's range codes in
  ``key_scale`` and its block's grid in ``key_zero``): a tile's keys are dequantized (``lo + s c`` with each token's
  block's ranges) before the dot. Scaling the query per channel instead (``(q * s) . c + q . lo``, exact codes in
  the dot) cost more registers once ``s`` and ``lo`` were computed from codes rather than loaded: compiled for
  sm_90 it spilled at head_dim 256 (up to 1 KiB), where the dequantized keys take 142-185 registers.

Plain functions here; the kernel modules decorate them on first launch (``bind``). Interpreted, they stay plain
Python (the interpreter re-patches ``triton.language`` on every call of a jitted function) and the reductions go
to ``tl.reduce`` with triton's own combine functions (this also works when triton was imported before
``TRITON_INTERPRET`` was set: then ``tl.max``, ``tl.sum``... are compiled-mode functions the interpreter cannot
call; the kernels use none of them).
"""

from __future__ import annotations

import functools

from ._common import Kernels, constexpr_globals, triton_interpreting
from .kv_format import CODES_E4M3, CODES_E5M2, CODES_INT4, CODES_INT8, SIDE_CHANNEL, SIDE_TOKEN, SIDE_TOKEN_CODE

_CONSTANTS = ("CODES_E4M3", "CODES_E5M2", "CODES_INT4", "CODES_INT8", "SIDE_CHANNEL", "SIDE_TOKEN",
              "SIDE_TOKEN_CODE", "OWN_NONE", "OWN_BEFORE", "OWN_SAME")

tl = None  # triton.language, bound by bind()
_STD_MAX = _STD_MIN = _STD_SUM = None  # triton's own combine functions (interpreter reductions)
row_max = row_min = row_sum = None  # bound by bind()
value_scale_step = None  # _rounding's, bound by bind()

_HELPERS = ("kv_columns", "load_kv_codes", "load_kv_side", "dot", "softcap_scores", "online_softmax",
            "key_scores", "add_values", "attend_blocks", "attend_exact", "attend_sequence", "channel_ranges",
            "load_value_code_side")
# Which keys of a source a row sees, beside causality and the window (``online_softmax``'s ``OWN``): all; those
# in a block before the row's own (the quantized blocks of a tail format); those in the row's own block (its
# full-precision reads).
OWN_NONE, OWN_BEFORE, OWN_SAME = 0, 1, 2


@functools.cache
def bind() -> Kernels:
    """Imports triton, binds ``tl`` and decorates the helpers (once). Returns them by name."""
    global tl, _STD_MAX, _STD_MIN, _STD_SUM, row_max, row_min, row_sum, value_scale_step
    import triton
    import triton.language as language

    from . import _rounding

    tl = language
    value_scale_step = _rounding.bind().value_scale_step
    g = globals()
    constexpr_globals(g, _CONSTANTS)
    if triton_interpreting():
        standard = language.standard
        combines = [getattr(standard, name, None) for name in ("_elementwise_max", "_elementwise_min", "_sum_combine")]
        if all(combines):
            _STD_MAX, _STD_MIN, _STD_SUM = combines
            row_max, row_min, row_sum = _interpreted_max, _interpreted_min, _interpreted_sum
        else:  # another triton layout: tl.max & co. (fine when triton was imported with TRITON_INTERPRET set)
            row_max, row_min, row_sum = _max, _min, _sum
    else:
        for name in _HELPERS:
            g[name] = triton.jit(g[name])
        row_max, row_min, row_sum = triton.jit(_max), triton.jit(_min), triton.jit(_sum)
    return Kernels(tl=tl, row_max=row_max, row_min=row_min, row_sum=row_sum, **{name: g[name] for name in _HELPERS})


def _max(x, axis):
    return tl.max(x, axis)


def _min(x, axis):
    return tl.min(x, axis)


def _sum(x, axis):
    return tl.sum(x, axis)


def _interpreted_max(x, axis):
    return tl.reduce(x, axis, _STD_MAX)


def _interpreted_min(x, axis):
    return tl.reduce(x, axis, _STD_MIN)


def _interpreted_sum(x, axis):
    return tl.reduce(x, axis, _STD_SUM)


def kv_columns(stride_cd, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CODES: tl.constexpr):
    """The code columns of a token's row: element offsets and which are real. int4: ``D_PAD // 2`` bytes of two
    codes each (contiguous, so the loads vectorize; ``load_kv_codes`` interleaves the nibbles)."""
    if CODES == CODES_INT4:
        c = tl.arange(0, D_PAD // 2)
        return c.to(tl.int64) * stride_cd, c < HEAD_DIM // 2
    else:
        c = tl.arange(0, D_PAD)
        return c.to(tl.int64) * stride_cd, c < HEAD_DIM


def load_kv_codes(Cache, row_off, valid, cols, col_ok, CODES: tl.constexpr, PADDED: tl.constexpr):
    """K or V codes of ``row_off.shape[0]`` tokens as ``[N, D_PAD]``: the pool's values for "auto", else the codes
    as float16 (int8, int4 nibbles) or float32 (float8 values); exact, also in bfloat16, the dtype the dots may
    take them in. ``row_off``: each token's element offset; ``valid``: which tokens to read (others give 0);
    ``cols, col_ok``: from ``kv_columns``; ``PADDED``: whether ``head_dim < D_PAD`` (else a row mask alone, so
    loads vectorize)."""
    if PADDED:
        mask = valid[:, None] & col_ok[None, :]
    else:
        mask = valid[:, None]
    raw = tl.load(Cache + (row_off[:, None] + cols[None, :]), mask=mask, other=0)
    if CODES == CODES_INT4:  # low nibble = even column, high nibble = odd column
        byte = raw.to(tl.int32)
        x = tl.reshape(tl.join((byte & 15).to(tl.float16), (byte >> 4).to(tl.float16)),
                       (raw.shape[0], 2 * raw.shape[1]))
    elif CODES == CODES_E4M3 or CODES == CODES_E5M2:  # float8 bits (uint8): the float16 of the same value
        bits = raw.to(tl.int32)
        if CODES == CODES_E4M3:  # e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits: scaled by 2^-8 as float16
            magnitude = ((bits & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        else:  # e5m2: the top byte of a float16
            magnitude = ((bits & 0x7F) << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x = tl.where(bits >= 128, -magnitude, magnitude)  # float32: a float16 -> bfloat16 cast of e5m2 values
        # compiled for sm_90 into a long sequence that spilled (300-400 bytes per thread)
    elif CODES == CODES_INT8:  # through float16: triton's interpreter converts integers to bfloat16 wrongly
        x = raw.to(tl.float16)
    else:  # the compute dtype
        x = raw
    return x


def load_kv_side(Scale, Zero, side_off, valid, ZERO: tl.constexpr):
    """Per-token scale and zero point (0 without zero points) of each token, float32 ``[N]``, 0 where not valid."""
    s = tl.load(Scale + side_off, mask=valid, other=0.0).to(tl.float32)
    if ZERO:
        z = tl.load(Zero + side_off, mask=valid, other=0.0).to(tl.float32)
    else:
        z = s * 0.0
    return s, z


def dot(a, b, DOT: tl.constexpr):
    """``a @ b`` with float32 accumulation; ``DOT``: see ``_common.dot_mode``."""
    if DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def softcap_scores(s, cap):
    """``tanh(s / cap) * cap`` (tanh from exp: the interpreter has no libdevice)."""
    t = s / cap
    e = tl.exp(-2.0 * tl.abs(t))
    th = (1.0 - e) / (1.0 + e)
    return tl.where(t < 0, -th, th) * cap


def online_softmax(s, m_i, l_i, pos, valid, row_pos, row_block, window, scale, softcap, USE_WINDOW: tl.constexpr,
                   USE_SOFTCAP: tl.constexpr, OWN: tl.constexpr):
    """Scales (and softcaps) raw scores ``s`` ``[M, N]``, masks keys not visible from each row (causal, window,
    ``OWN`` against ``row_block``, the first position of each row's own block: the module docstring), and advances
    the online softmax: returns ``(p, alpha, m_new, l_new)``."""
    s = s * scale
    if USE_SOFTCAP:
        s = softcap_scores(s, softcap)
    if OWN == OWN_BEFORE:  # implies causal
        visible = valid[None, :] & (pos[None, :] < row_block[:, None])
    elif OWN == OWN_SAME:
        visible = valid[None, :] & (pos[None, :] <= row_pos[:, None]) & (pos[None, :] >= row_block[:, None])
    else:
        visible = valid[None, :] & (pos[None, :] <= row_pos[:, None])
    if USE_WINDOW:
        visible = visible & (pos[None, :] > row_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, row_max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + row_sum(p, 1)


def channel_ranges(KS, KZ, grid, d, mask, stride_ks2, HEAD_DIM: tl.constexpr):
    """int4 keys: ``(base, step, u_lo, du)`` float32 of channels ``d`` (broadcast with ``grid``, the element offsets
    of their blocks' grids ``[base, step]`` in ``KZ``, real blocks; the range codes ``u_lo``, ``u_hi`` in ``KS`` at
    ``HEAD_DIM`` times the grid's offsets, plus the channel; ``du = u_hi - u_lo``, codes read as 0 where not
    ``mask``): a key channel is ``lo + s c`` with ``lo = base + step u_lo`` and ``s = step du / 15``
    (``kv_quant.key_ranges_ref``)."""
    base = tl.load(KZ + grid).to(tl.float32)
    step = tl.load(KZ + (grid + stride_ks2)).to(tl.float32)
    u_lo = tl.load(KS + (grid * HEAD_DIM + d), mask=mask, other=0).to(tl.float32)
    u_hi = tl.load(KS + ((grid + stride_ks2) * HEAD_DIM + d), mask=mask, other=0).to(tl.float32)
    return base, step, u_lo, u_hi - u_lo


def key_scores(q, q_sum, KC, KS, KZ, table, tile, pos, valid, kv_head, cols, col_ok,
               stride_cb, stride_co, stride_ch, stride_ksb, stride_ks1, stride_ks2,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr, CODES: tl.constexpr, KEY_SIDE: tl.constexpr, ZERO: tl.constexpr,
               DOT: tl.constexpr):
    """Raw scores ``q . k`` ``[M, BLOCK_N]`` of the tile at position ``tile`` (its keys at ``pos``, ``valid``)."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
    k = load_kv_codes(KC, row_off, valid, cols, col_ok, CODES, PADDED)
    if KEY_SIDE == SIDE_CHANNEL:  # int4: each channel lo + s c over its block, dequantized before the dot
        d = tl.arange(0, D_PAD).to(tl.int64)
        base, step, u_lo, du = channel_ranges(KS, KZ, (block * stride_ksb + kv_head * stride_ks1)[:, None],
                                              d[None, :], valid[:, None] & (d < HEAD_DIM)[None, :], stride_ks2,
                                              HEAD_DIM)
        keys = (base + step * u_lo) + (step * du * (1.0 / 15.0)) * k.to(tl.float32)
        s = dot(q, tl.trans(keys.to(q.dtype)), DOT)
    else:
        s = dot(q, tl.trans(k.to(q.dtype)), DOT)
        if KEY_SIDE == SIDE_TOKEN:
            side_off = block * stride_ksb + (pos % BLOCK_SIZE) * stride_ks1 + kv_head * stride_ks2
            k_scale, k_zero = load_kv_side(KS, KZ, side_off, valid, ZERO)
            s = s * k_scale[None, :]
            if ZERO:
                s = s + q_sum[:, None] * k_zero[None, :]
    return s, block


def load_value_code_side(VS, VZ, block, offset, kv_head, valid, stride_vsb, stride_vso, stride_vsh,
                         BLOCK_SIZE: tl.constexpr):
    """int4 values: each token's scale ``s = vmax * 2^(-k/3)`` (its 4-bit code ``k`` in ``VS``, its block's ``vmax``
    in ``VZ``) and zero point ``-8 s`` (codes ``q + 8``), float32 ``[N]``, 0 where not ``valid``."""
    side = block * stride_vsb + kv_head * stride_vsh  # vmax [nb, H]; scale codes at BLOCK_SIZE // 2 x it
    vmax = tl.load(VZ + side, mask=valid, other=0.0).to(tl.float32)
    byte = tl.load(VS + (side * (BLOCK_SIZE // 2) + (offset // 2) * stride_vso), mask=valid, other=0).to(tl.int32)
    k = (byte >> (4 * (offset % 2)).to(tl.int32)) & 15
    s = vmax * value_scale_step(k)
    return s, -8.0 * s


def add_values(acc, p, alpha, VC, VS, VZ, block, pos, valid, kv_head, cols, col_ok, stride_cb, stride_co,
               stride_ch, stride_vsb, stride_vso, stride_vsh, dtype, PADDED: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, CODES: tl.constexpr, VALUE_SIDE: tl.constexpr, ZERO: tl.constexpr,
               DOT: tl.constexpr):
    """``acc * alpha + p @ v`` for the tile's values (codes in the dot, per-token scales on ``p``, zero points
    added as ``sum_j p_j z_j``)."""
    offset = pos % BLOCK_SIZE
    v = load_kv_codes(VC, block * stride_cb + offset * stride_co + kv_head * stride_ch, valid, cols, col_ok, CODES,
                      PADDED).to(dtype)
    if VALUE_SIDE == SIDE_TOKEN or VALUE_SIDE == SIDE_TOKEN_CODE:
        if VALUE_SIDE == SIDE_TOKEN_CODE:
            v_scale, v_zero = load_value_code_side(VS, VZ, block, offset, kv_head, valid, stride_vsb, stride_vso,
                                                   stride_vsh, BLOCK_SIZE)
        else:
            v_scale, v_zero = load_kv_side(VS, VZ, block * stride_vsb + offset * stride_vso + kv_head * stride_vsh,
                                           valid, ZERO)
        if v.dtype == tl.float16:  # p * s / top in [0, 1], top a power of two >= max(s): no float16 underflow
            top = tl.exp2(tl.ceil(tl.log2(tl.maximum(row_max(v_scale, 0), 5.9604644775390625e-08))))
            acc = (acc * (alpha / top)[:, None] + dot((p * (v_scale / top)[None, :]).to(v.dtype), v, DOT)) * top
        else:  # bfloat16 (float32's range), float32
            acc = acc * alpha[:, None] + dot((p * v_scale[None, :]).to(v.dtype), v, DOT)
        if ZERO or VALUE_SIDE == SIDE_TOKEN_CODE:
            acc = acc + row_sum(p * v_zero[None, :], 1)[:, None]
    else:
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT)
    return acc


def attend_blocks(acc, m_i, l_i, q, q_sum, row_pos, row_block, KC, VC, KS, VS, KZ, VZ, table, kv_head, lo, hi, scale,
                  softcap,
                  window, stride_cb, stride_co, stride_ch, stride_cd, stride_ksb, stride_ks1, stride_ks2,
                  stride_vsb, stride_vso, stride_vsh,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, CODES: tl.constexpr, KEY_SIDE: tl.constexpr, VALUE_SIDE: tl.constexpr,
                  ZERO: tl.constexpr, DOT: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                  OWN: tl.constexpr):
    """The online softmax over the block pool's keys at positions ``[lo, hi)`` (rows see keys ``<= row_pos``; with
    ``OWN == OWN_BEFORE`` only those before their own block)."""
    cols, col_ok = kv_columns(stride_cd, HEAD_DIM, D_PAD, CODES)
    n = tl.arange(0, BLOCK_N).to(tl.int64)
    for tile in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        pos = tile + n
        valid = (pos >= lo) & (pos < hi)
        s, block = key_scores(q, q_sum, KC, KS, KZ, table, tile, pos, valid, kv_head, cols, col_ok,
                              stride_cb, stride_co, stride_ch, stride_ksb, stride_ks1, stride_ks2,
                              HEAD_DIM, D_PAD, PADDED, BLOCK_SIZE, BLOCK_N, CODES, KEY_SIDE, ZERO, DOT)
        p, alpha, m_i, l_i = online_softmax(s, m_i, l_i, pos, valid, row_pos, row_block, window, scale, softcap,
                                            USE_WINDOW, USE_SOFTCAP, OWN)
        acc = add_values(acc, p, alpha, VC, VS, VZ, block, pos, valid, kv_head, cols, col_ok, stride_cb, stride_co,
                         stride_ch, stride_vsb, stride_vso, stride_vsh, q.dtype, PADDED, BLOCK_SIZE, CODES,
                         VALUE_SIDE, ZERO, DOT)
    return acc, m_i, l_i


def attend_exact(acc, m_i, l_i, q, row_pos, row_block, KT, VT, NK, NV, tail_base, fresh_base, context, lo, hi, stride_to,
                 stride_td, stride_nn, stride_nd, scale, softcap, window, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, USE_WINDOW: tl.constexpr,
                 USE_SOFTCAP: tl.constexpr):
    """The online softmax over full-precision keys at positions ``[lo, hi)``, each row seeing those of its own block
    only: a position before ``context`` at offset ``pos % BLOCK_SIZE`` of the tail row (element ``tail_base`` of
    ``KT``/``VT``, offsets at ``stride_to``), a later one at row ``pos - context`` of the forward's new K/V (element
    ``fresh_base`` of ``NK``/``NV``, rows at ``stride_nn``); channels at ``stride_td`` / ``stride_nd``. Keys and
    values in the compute dtype, straight into the dots."""
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    KT, VT, NK, NV = KT + tail_base, VT + tail_base, NK + fresh_base, NV + fresh_base  # 64-bit once
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + n
        valid = pos < hi
        old = pos < context
        # the tile's offsets fit 32 bits: within a tail row, within a forward's new K/V
        off_tail = ((pos % BLOCK_SIZE).to(tl.int32) * stride_to)[:, None] + (d * stride_td)[None, :]
        off_fresh = ((pos - context).to(tl.int32) * stride_nn)[:, None] + (d * stride_nd)[None, :]
        from_tail = (valid & old)[:, None] & d_ok[None, :]
        from_fresh = (valid & ~old)[:, None] & d_ok[None, :]
        k = tl.where(from_tail, tl.load(KT + off_tail, mask=from_tail, other=0.0),
                     tl.load(NK + off_fresh, mask=from_fresh, other=0.0)).to(q.dtype)
        s = dot(q, tl.trans(k), DOT)
        p, alpha, m_i, l_i = online_softmax(s, m_i, l_i, pos, valid, row_pos, row_block, window, scale, softcap,
                                            USE_WINDOW, USE_SOFTCAP, OWN_SAME)
        v = tl.where(from_tail, tl.load(VT + off_tail, mask=from_tail, other=0.0),
                     tl.load(NV + off_fresh, mask=from_fresh, other=0.0)).to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT)
    return acc, m_i, l_i


def attend_sequence(acc, m_i, l_i, q, q_sum, row_pos, KC, VC, KS, VS, KZ, VZ, KT, VT, NK, NV, TailRows, seq, context,
                    fresh_base, first_pos, last_pos, table, kv_head, lo, hi, scale, softcap, window, stride_cb,
                    stride_co, stride_ch, stride_cd, stride_ksb, stride_ks1, stride_ks2, stride_vsb, stride_vso,
                    stride_vsh, stride_tr, stride_to, stride_th, stride_td, stride_nn, stride_nh, stride_nd,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PADDED: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CODES: tl.constexpr, KEY_SIDE: tl.constexpr,
                    VALUE_SIDE: tl.constexpr, ZERO: tl.constexpr, DOT: tl.constexpr, USE_WINDOW: tl.constexpr,
                    USE_SOFTCAP: tl.constexpr, TAIL: tl.constexpr):
    """The online softmax over keys ``[lo, hi)`` of sequence ``seq`` for rows at positions ``first_pos ..
    last_pos``: from the blocks; with ``TAIL`` the rows' own blocks exact, positions before ``context`` (the tokens
    the sequence held before the forward) from its tail row, the rest from the new K/V ``NK``/``NV``, whose token
    ``i`` (position ``context + i``) sits at row ``fresh_base + i``."""
    if TAIL:
        own_lo = (first_pos // BLOCK_SIZE) * BLOCK_SIZE  # the first row's own block
        own_hi = (last_pos // BLOCK_SIZE) * BLOCK_SIZE  # the last row's
        row_block = (row_pos // BLOCK_SIZE) * BLOCK_SIZE  # each row's (a padding row, at -1, sees nothing anyway)
        acc, m_i, l_i = attend_blocks(
            acc, m_i, l_i, q, q_sum, row_pos, row_block, KC, VC, KS, VS, KZ, VZ, table, kv_head, lo, tl.minimum(hi, own_hi),
            scale, softcap, window, stride_cb, stride_co, stride_ch, stride_cd, stride_ksb, stride_ks1, stride_ks2,
            stride_vsb, stride_vso, stride_vsh, HEAD_DIM, D_PAD, PADDED, BLOCK_SIZE, BLOCK_N, CODES, KEY_SIDE,
            VALUE_SIDE, ZERO, DOT, USE_WINDOW, USE_SOFTCAP, OWN_BEFORE,
        )
        tail_row = tl.load(TailRows + seq).to(tl.int64)
        acc, m_i, l_i = attend_exact(
            acc, m_i, l_i, q, row_pos, row_block, KT, VT, NK, NV, tail_row * stride_tr + kv_head * stride_th,
            fresh_base * stride_nn + kv_head * stride_nh, context, tl.maximum(lo, own_lo), hi, stride_to, stride_td,
            stride_nn, stride_nd, scale, softcap, window, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, DOT, USE_WINDOW,
            USE_SOFTCAP,
        )
    else:
        acc, m_i, l_i = attend_blocks(
            acc, m_i, l_i, q, q_sum, row_pos, row_pos, KC, VC, KS, VS, KZ, VZ, table, kv_head, lo, hi, scale, softcap,
            window, stride_cb, stride_co, stride_ch, stride_cd, stride_ksb, stride_ks1, stride_ks2,
            stride_vsb, stride_vso, stride_vsh, HEAD_DIM, D_PAD, PADDED, BLOCK_SIZE, BLOCK_N, CODES, KEY_SIDE,
            VALUE_SIDE, ZERO, DOT, USE_WINDOW, USE_SOFTCAP, OWN_NONE,
        )
    return acc, m_i, l_i
