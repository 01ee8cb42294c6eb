"""Paged decode attention: one query token per sequence against that sequence's blocks.

``paged_decode_attention_ref`` is the torch reference (the test oracle);
``paged_decode_attention`` is the Triton kernel with the same signature (flash-decoding):

- grid ``(sequences, kv_heads, partitions)``: a program holds the ``group`` query heads that share one KV head
  (GQA: each K/V tile is read once for the whole group) and walks one partition of ``partition_size`` tokens
  of its sequence in tiles of ``BLOCK_N`` tokens, gathering each token's slot through the block table, so the
  tile size does not depend on the block size;
- K/V codes enter the dots as loaded and their scales and zero points apply around them (``_tiles``); a format
  with a full-precision tail (int4) reads the query's own block exact, from the tail row and the query's own new
  K/V (``fresh_key`` / ``fresh_value``), in the same pass; scores and the online softmax (running max, sum,
  accumulator) are float32;
- each partition writes its partial max, sum and unnormalized output; a reduce kernel rescales and sums them
  (and adds the attention sink, once). A batch whose block tables span a single partition skips the reduce.
  The partition count comes from the block-table width, not from ``seq_lens``: no device-to-host sync. So the
  partials are allocated for the widest table, but a program whose partition starts at or past its sequence's
  length exits before reading or writing anything (the reduce reads only the partitions below the length): one
  long sequence batched with many short ones costs the short ones no partial traffic. Sizing the partials to the
  lengths themselves would need ``seq_lens`` on the host (a sync, or a host-side length from the step plan).

The Triton functions are decorated on first launch (``_kernels()``), not at import: ``import paged_hf`` imports
this module without needing triton, and ``TRITON_INTERPRET`` (which ``triton.jit`` reads when it decorates) takes
effect whenever it was set before the first launch.
"""

from __future__ import annotations

import functools

import torch

from . import _tiles
from ._common import (  # noqa: F401 - dot_mode, triton_interpreting: re-exported for callers of this module
    Kernels, Launch, check_fresh, check_index, check_pools, check_query, check_sinks, check_tail_rows, dot_mode,
    feature_meta, jit_unspecialized, next_pow2, triton_interpreting,
)
from .attention_ref import paged_attention_core
from .pool_tensors import PoolTensors

PARTITION_SIZE = 512  # tokens per flash-decoding partition
BLOCK_N = 64  # tokens per K/V tile inside a program
# Launch options of the decode kernel. maxnreg=255 lets ptxas use the registers it needs (up to 244 here): left to
# itself it sometimes stopped at 128 and spilled (8-56 bytes per thread, sm_90; benchmarks/RESULTS.md).
DECODE_OPTIONS = dict(num_warps=4, num_stages=2, maxnreg=255, enable_fp_fusion=True)
# head_dim > 128: [32, 256] K/V tiles (the bytes of a [64, 128] one); [64, 256] ones spilled at 4 warps.
WIDE_HEAD_BLOCK_N = 32
WIDE_HEAD_DECODE_OPTIONS = dict(num_warps=4, num_stages=2, maxnreg=255, enable_fp_fusion=True)
_REDUCE_CHUNK = 32  # partitions merged per step of the reduce kernel
# Integers that follow the batch (partition count, block-table width): not specialized by triton (== 1, multiple
# of 16), so one compiled variant serves every batch (see ``warmup``).
DECODE_NO_SPECIALIZE = ("num_parts", "stride_bt")


def paged_decode_attention_ref(
    query: torch.Tensor, pools: PoolTensors, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    sliding_window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
    tail_rows: torch.Tensor | None = None, fresh_key: torch.Tensor | None = None,
    fresh_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference.

    Args:
        query: ``[S, num_heads, head_dim]``, the token at position ``seq_lens[s] - 1`` of each sequence.
        pools: the layer's ``PoolTensors`` (``[num_blocks, block_size, num_kv_heads, head_dim]`` K/V, a quantized
            format's side data, a tail format's tail pools); the query's own K/V is already stored.
        block_tables: ``[S, max_blocks]`` int32/int64.
        seq_lens: ``[S]`` tokens held per sequence, the query's own included (>= 1).
        tail_rows, fresh_key, fresh_value: tail formats: ``[S]`` each sequence's tail row (see
            ``paged_attention_core``) and ``[S, num_kv_heads, head_dim]`` each query's own K/V as the store got
            them (``storage.FreshKV``).

    Returns ``[S, num_heads, head_dim]``.
    """
    positions = (seq_lens.long() - 1).unsqueeze(1)
    fresh = {}
    if fresh_key is not None:
        fresh = dict(fresh_keys=fresh_key.unsqueeze(1), fresh_values=fresh_value.unsqueeze(1),
                     num_fresh=torch.ones_like(positions[:, 0]), fresh_is_query=True)
    out = paged_attention_core(query.unsqueeze(2), positions, pools, block_tables, seq_lens, scale, sliding_window,
                               softcap, sinks, tail_rows=tail_rows, **fresh)
    return out.squeeze(2)


# ----------------------------------------------------------------------------------------------- launcher


def paged_decode_attention(
    query: torch.Tensor, pools: PoolTensors, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    sliding_window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
    tail_rows: torch.Tensor | None = None, fresh_key: torch.Tensor | None = None,
    fresh_value: torch.Tensor | None = None, *, partition_size: int | None = None,
) -> torch.Tensor:
    """Triton flash-decoding; the arguments and result of ``paged_decode_attention_ref``.

    ``partition_size`` (keyword only, a multiple of the tile of ``decode_tiles``, 64 tokens; default
    ``PARTITION_SIZE``) is the number of tokens one program reads; tests shrink it to reach the multi-partition
    path with short sequences.
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for launch in _decode_launches(query, pools, block_tables, seq_lens, scale, sliding_window, softcap, sinks, out,
                                   partition_size, tail_rows, fresh_key, fresh_value):
        launch()
    return out


def _decode_launches(query, pools, block_tables, seq_lens, scale, sliding_window, softcap, sinks, out,
                     partition_size=None, tail_rows=None, fresh_key=None, fresh_value=None) -> list[Launch]:
    k = _kernels()
    num_seqs, num_heads, head_dim = check_query(query, "query")
    pools = check_pools(query, pools, head_dim)
    group = num_heads // pools.num_kv_heads
    if group * pools.num_kv_heads != num_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={pools.num_kv_heads}")
    check_index(block_tables, "block_tables", 2, query.device)
    check_index(seq_lens, "seq_lens", 1, query.device)
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"query has {num_seqs} sequences but block_tables {tuple(block_tables.shape)}, "
            f"seq_lens {tuple(seq_lens.shape)}"
        )
    tail_rows = check_tail_rows(tail_rows, pools, num_seqs, query.device)
    fresh_key, fresh_value, fresh_strides = check_fresh(fresh_key, fresh_value, pools, num_seqs, head_dim,
                                                         query.device)
    check_sinks(sinks, num_heads, query.device)
    partition = PARTITION_SIZE if partition_size is None else int(partition_size)
    block_n, options = decode_tiles(head_dim)
    block_n = key_tile(block_n, pools)
    if partition <= 0 or partition % block_n:
        raise ValueError(f"partition_size must be a positive multiple of {block_n}, got {partition}")
    max_tokens = block_tables.shape[1] * pools.block_size
    num_parts = max(1, -(-max_tokens // partition))
    direct = num_parts == 1

    g_pad = max(16, next_pow2(group))  # tl.dot needs >= 16 rows
    d_pad = max(16, next_pow2(head_dim))
    if direct:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_parts, head_dim), dtype=torch.float32, device=query.device)
    flags = feature_meta(sliding_window, softcap, sinks)
    window = int(sliding_window) if sliding_window is not None else 0
    cap = float(softcap) if softcap is not None else 1.0
    args = (
        query, *pools.data, *pools.side, *pools.tails, fresh_key, fresh_value, block_tables, seq_lens, tail_rows,
        sinks, out, part_m, part_l, part_acc, float(scale), cap, window, num_heads, num_parts, partition,
        *query.stride(), *pools.data_strides, *pools.side_strides, *pools.tail_strides, *fresh_strides,
        block_tables.stride(0), *out.stride(),
    )
    meta = dict(
        GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=d_pad, PADDED=head_dim < d_pad,
        BLOCK_SIZE=pools.block_size, BLOCK_N=block_n, **pools.meta,
        DOT=dot_mode(query.dtype), DIRECT=direct, **flags,
    )
    launches = [Launch(k.decode, (num_seqs, pools.num_kv_heads, num_parts), args, meta, options)]
    if not direct:
        reduce_args = (part_m, part_l, part_acc, seq_lens, sinks, out, num_heads, num_parts, partition, *out.stride())
        reduce_meta = dict(
            HEAD_DIM=head_dim, D_PAD=d_pad, CHUNK=_REDUCE_CHUNK, USE_SINKS=sinks is not None
        )
        options = dict(num_warps=4, enable_fp_fusion=True)
        launches.append(Launch(k.reduce, (num_seqs, num_heads), reduce_args, reduce_meta, options))
    return launches


def key_tile(block_n: int, pools) -> int:
    """The key tile for ``pools``: per-channel key ranges (int4) keep a tile inside one block, the block size when it
    is smaller than ``block_n`` but at least 16 (``tl.dot``'s smallest): the tiles the compile report measured (the
    query was scaled per channel of one block then; the keys are now dequantized per token's block, so a tile
    spanning blocks, as below 16, is read alike: ``_tiles``)."""
    if pools.fmt.key_side == "channel" and 16 <= pools.block_size < block_n:
        return pools.block_size
    return block_n


def decode_tiles(head_dim: int) -> tuple[int, dict]:
    """``(BLOCK_N, launch options)`` of the decode kernel for ``head_dim`` (module settings, which
    ``benchmarks/kernels.py --tune`` varies, up to 128; ``WIDE_HEAD_*`` above)."""
    if head_dim <= 128:
        return BLOCK_N, dict(DECODE_OPTIONS)
    return WIDE_HEAD_BLOCK_N, dict(WIDE_HEAD_DECODE_OPTIONS)


# ----------------------------------------------------------------------------------------------- kernels
# Plain functions until ``_kernels()`` decorates them (their bodies read ``tl`` and the jitted helpers from this
# module's globals, which is where both triton's compiler and its interpreter look them up).

tl = None  # triton.language, bound by _kernels()
attend_sequence = row_max = row_sum = None  # _tiles' helpers, bound by _kernels()


@functools.cache
def _kernels():
    """Decorates this module's kernels (once, at the first launch); their helpers come from ``_tiles``."""
    global tl, attend_sequence, row_max, row_sum, _decode_kernel, _decode_reduce_kernel
    helpers = _tiles.bind()
    tl = helpers.tl
    attend_sequence = helpers.attend_sequence
    row_max, row_sum = helpers.row_max, helpers.row_sum
    _decode_kernel = jit_unspecialized(_decode_kernel, DECODE_NO_SPECIALIZE, ("BlockTables", "SeqLens", "TailRows"))
    _decode_reduce_kernel = jit_unspecialized(_decode_reduce_kernel, ("num_parts",), ("SeqLens",))
    return Kernels(decode=_decode_kernel, reduce=_decode_reduce_kernel)


def _decode_kernel(
    Q, KC, VC, KS, VS, KZ, VZ, KT, VT, NK, NV, BlockTables, SeqLens, TailRows, Sinks, Out, PartM, PartL, PartAcc,
    scale, softcap, window, num_heads, num_parts, partition,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_ksb, stride_ks1, stride_ks2, stride_vsb, stride_vso, stride_vsh,
    stride_tr, stride_to, stride_th, stride_td,
    stride_nn, stride_nh, stride_nd,
    stride_bt,
    stride_os, stride_oh, stride_od,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    CODES: tl.constexpr, KEY_SIDE: tl.constexpr, VALUE_SIDE: tl.constexpr, ZERO: tl.constexpr, TAIL: tl.constexpr,
    DOT: tl.constexpr, DIRECT: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
):
    """One (sequence, KV head, partition): the GROUP query heads of the KV head against the partition's tokens."""
    # Index math in int64: no overflow on large pools (and the interpreter skips its int32 overflow checks).
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(SeqLens + seq).to(tl.int64)
    start = part * partition
    if not DIRECT:
        if start >= seq_len:  # a partition past the sequence: the reduce reads none of its partials
            return
    end = tl.minimum(start + partition, seq_len)
    lo = start
    if USE_WINDOW:  # the query (position seq_len - 1) sees keys > seq_len - 1 - window
        lo = tl.maximum(lo, seq_len - window)

    g = tl.arange(0, G_PAD)
    heads = kv_head * GROUP + g  # [G_PAD] int64
    row_ok = g < GROUP
    d = tl.arange(0, D_PAD).to(tl.int64)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + (seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd),
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if DOT == 1:
        q = q.to(tl.float32)
    q_sum = row_sum(q.to(tl.float32), 1)  # the share of per-token key zero points in each score: z * sum(q)
    row_pos = seq_len - 1 + g * 0

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, D_PAD], 0.0, tl.float32)
    table = BlockTables + seq * stride_bt
    acc, m_i, l_i = attend_sequence(
        acc, m_i, l_i, q, q_sum, row_pos, KC, VC, KS, VS, KZ, VZ, KT, VT, NK, NV, TailRows, seq, seq_len - 1, seq,
        seq_len - 1, seq_len - 1, table, kv_head, lo, end, scale, softcap, window, stride_cb, stride_co, stride_ch,
        stride_cd, stride_ksb, stride_ks1, stride_ks2, stride_vsb, stride_vso, stride_vsh, stride_tr, stride_to,
        stride_th, stride_td, stride_nn, stride_nh, stride_nd, HEAD_DIM, D_PAD, PADDED, BLOCK_SIZE, BLOCK_N, CODES,
        KEY_SIDE, VALUE_SIDE, ZERO, DOT, USE_WINDOW, USE_SOFTCAP, TAIL,
    )

    if DIRECT:
        if USE_SINKS:  # the sink is one more logit of each head's softmax
            sink = tl.load(Sinks + heads, mask=row_ok, other=0.0).to(tl.float32)
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_all)
            l_i = l_i * alpha + tl.exp(sink - m_all)
            acc = acc * alpha[:, None]
        out = acc / tl.maximum(l_i, 1.1754943508222875e-38)[:, None]
        tl.store(
            Out + (seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od),
            out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part_row = (seq * num_heads + heads) * num_parts + part  # [G_PAD]: row (seq, head, part) of the partials
        tl.store(PartM + part_row, m_i, mask=row_ok)
        tl.store(PartL + part_row, l_i, mask=row_ok)
        tl.store(PartAcc + (part_row[:, None] * HEAD_DIM + d[None, :]), acc, mask=row_ok[:, None] & d_ok[None, :])


def _decode_reduce_kernel(
    PartM, PartL, PartAcc, SeqLens, Sinks, Out, num_heads, num_parts, partition,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CHUNK: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Merges the partitions of one (sequence, query head): rescale each partial to the global max, sum."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(SeqLens + seq).to(tl.int64)
    used = tl.minimum((seq_len + partition - 1) // partition, num_parts)  # later partitions hold no token
    base = (seq * num_heads + head) * num_parts
    d = tl.arange(0, D_PAD).to(tl.int64)
    d_ok = d < HEAD_DIM
    c = tl.arange(0, CHUNK).to(tl.int64)
    m_all = row_max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
    l_all = row_sum(tl.full([CHUNK], 0.0, tl.float32), 0)
    acc = tl.full([D_PAD], 0.0, tl.float32)
    for first in range(0, used, CHUNK):
        rows = base + first + c
        ok = first + c < used
        pm = tl.load(PartM + rows, mask=ok, other=float("-inf"))
        pl = tl.load(PartL + rows, mask=ok, other=0.0)
        pa = tl.load(PartAcc + (rows[:, None] * HEAD_DIM + d[None, :]), mask=ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m_all, row_max(pm, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(pm - m_safe)
        alpha = tl.exp(m_all - m_safe)
        l_all = l_all * alpha + row_sum(pl * w, 0)
        acc = acc * alpha + row_sum(pa * w[:, None], 0)
        m_all = m_new
    if USE_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32)
        m_fin = tl.maximum(m_all, sink)
        alpha = tl.exp(m_all - m_fin)
        l_all = l_all * alpha + tl.exp(sink - m_fin)
        acc = acc * alpha
    out = acc / tl.maximum(l_all, 1.1754943508222875e-38)
    tl.store(Out + (seq * stride_os + head * stride_oh + d * stride_od), out.to(Out.dtype.element_ty), mask=d_ok)
