"""Paged prefill attention: variable-length query chunks against their paged past plus themselves, causal.

``paged_prefill_attention_ref`` is the torch reference; ``paged_prefill_attention`` the Triton kernel with the same
signature:

- grid ``(query tiles, kv_heads)`` over the packed queries, without a device-to-host sync: sequence ``s`` owns
  tiles ``cu_query_lens[s] // BLOCK_Q + s ..`` (at least ``ceil(q_len / BLOCK_Q)`` of them, so the grid is
  ``total_queries // BLOCK_Q + S``); a program finds its sequence by counting the first tiles <= its own (a
  loop over the batch, so no constexpr follows the batch size) and does nothing if its tile lies past its
  sequence's queries;
- a program's rows are ``BLOCK_Q`` consecutive queries x the ``group`` query heads of its KV head (GQA: each K/V
  tile is read once for the group), against the keys ``[0 or window start, last query position]`` in tiles of
  ``BLOCK_N`` tokens gathered through the block table, their codes in the dots and their scales around them
  (``_tiles``); a format with a full-precision tail reads each row's own block exact instead, from the sequence's
  tail row and the forward's new K/V (``fresh_key`` / ``fresh_value``); causal (and window) masked per row, online
  softmax in float32 starting from the sink logit when there are sinks.

Kernels are decorated on first launch (see ``paged_decode_attention``), with the helpers of ``_tiles``.
"""

from __future__ import annotations

import functools

import torch

from . import _tiles
from . import attention_ref as _attention_ref
from . import paged_decode_attention as _decode
from ._common import (
    Kernels, Launch, check_fresh, check_index, check_pools, check_query, check_sinks, check_tail_rows, dot_mode,
    feature_meta, jit_unspecialized, next_pow2,
)
from .attention_ref import paged_attention_core
from .pool_tensors import PoolTensors

# Rows (queries x group heads) per program, keys per tile and launch options by head_dim and format: the
# [BLOCK_M, head_dim] float32 accumulator, the query and the K/V tiles (codes unpacked, scales) must fit 255
# registers a thread. Compiled for sm_90 (the compile report in benchmarks/RESULTS.md): 64-key tiles at 4 warps
# spilled from head_dim 128 on, and the quantized formats sat at 255 registers at 4 warps everywhere; at 8 warps they
# fit with 32-key tiles up to head_dim 128 (64-key ones at 64, but for int4, whose nibble interleave costs more) and
# 16-key tiles at 256, where int4 needs 32-row programs. ``maxnreg=255`` lets ptxas use the registers it needs:
# left to itself it sometimes stopped at 128 and spilled. int4 keys per channel, when the query was scaled per channel
# in each tile: at head_dim 256, 32-row programs spilled 2 KiB at 8 warps and 16-row ones 408 bytes; 16 rows at 4
# warps fit (254 registers, no spill). The keys are now dequantized per tile instead: 185 registers there.
_OPTIONS = dict(num_warps=8, num_stages=2, maxnreg=255, enable_fp_fusion=True)
PREFILL_TILES = (  # (largest head_dim, kv formats (None: any), BLOCK_M, BLOCK_N, launch options)
    (64, ("int4",), 64, 32, _OPTIONS),
    (64, None, 64, 64, _OPTIONS),
    (128, None, 64, 32, _OPTIONS),
    (1 << 30, ("int4",), 16, 32, dict(_OPTIONS, num_warps=4)),
    (1 << 30, None, 64, 16, _OPTIONS),
)
SEQ_CHUNK = 64  # sequences scanned per step when a program looks up its sequence
# Integers that follow the batch: not specialized by triton, so one compiled variant serves every batch.
PREFILL_NO_SPECIALIZE = ("num_seqs", "stride_bt")


def paged_prefill_attention_ref(
    query: torch.Tensor, pools: PoolTensors, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor, scale: float, sliding_window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None, tail_rows: torch.Tensor | None = None,
    fresh_key: torch.Tensor | None = None, fresh_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference.

    Args:
        query: ``[total_queries, num_heads, head_dim]``: sequence ``s`` owns rows
            ``cu_query_lens[s] : cu_query_lens[s + 1]``, its last ``q_len`` positions
            ``seq_lens[s] - q_len .. seq_lens[s] - 1`` (their K/V already stored).
        block_tables: ``[S, max_blocks]``; seq_lens: ``[S]``; cu_query_lens: ``[S + 1]`` int, starting at 0.
        pools, tail_rows: see ``paged_decode_attention_ref``; ``fresh_key`` / ``fresh_value``
            ``[total_queries, num_kv_heads, head_dim]``: the queries' own K/V (tail formats).

    Returns ``[total_queries, num_heads, head_dim]``.
    """
    out = torch.empty_like(query)
    starts = cu_query_lens.tolist()
    lengths = seq_lens.tolist()
    spans = [(s, a, b) for s, (a, b) in enumerate(zip(starts[:-1], starts[1:])) if b > a]
    for batch in _batches(spans, lengths, query.shape[1]):
        # the batch's query chunks, padded to its longest; padding rows get position -1 (they attend nothing)
        width = max(b - a for _, a, b in batch)
        padded = query.new_zeros(len(batch), width, *query.shape[1:])
        positions = torch.full((len(batch), width), -1, dtype=torch.long, device=query.device)
        for row, (seq, a, b) in enumerate(batch):
            padded[row, : b - a] = query[a:b]
            positions[row, : b - a] = torch.arange(lengths[seq] - (b - a), lengths[seq], device=query.device)
        index = torch.tensor([seq for seq, _, _ in batch], device=block_tables.device)
        fresh = {}
        if fresh_key is not None:  # each sequence's new K/V, padded like its queries
            fresh_keys = fresh_key.new_zeros(len(batch), width, *fresh_key.shape[1:])
            fresh_values = fresh_value.new_zeros(len(batch), width, *fresh_value.shape[1:])
            for row, (_, a, b) in enumerate(batch):
                fresh_keys[row, : b - a], fresh_values[row, : b - a] = fresh_key[a:b], fresh_value[a:b]
            num_fresh = torch.tensor([b - a for _, a, b in batch], device=query.device)
            fresh = dict(fresh_keys=fresh_keys, fresh_values=fresh_values, num_fresh=num_fresh)
        chunk = paged_attention_core(
            padded.transpose(1, 2), positions, pools, block_tables[index], seq_lens[index], scale, sliding_window,
            softcap, sinks, tail_rows=None if tail_rows is None else tail_rows[index], **fresh,
        ).transpose(1, 2)
        for row, (_, a, b) in enumerate(batch):
            out[a:b] = chunk[row, : b - a]
    return out


def _batches(spans: list, lengths: list[int], num_heads: int) -> list[list]:
    """Consecutive sequences grouped so each group's padded scores fit one chunk of ``paged_attention_core``."""
    groups, current, width, keys = [], [], 0, 0
    for span in spans:
        seq, a, b = span
        new_width, new_keys = max(width, b - a), max(keys, lengths[seq])
        if current and (len(current) + 1) * num_heads * new_width * new_keys > _attention_ref.SCORE_ELEMENTS_PER_CHUNK:
            groups.append(current)
            current, new_width, new_keys = [], b - a, lengths[seq]
        current.append(span)
        width, keys = new_width, new_keys
    return groups + [current] if current else groups


def paged_prefill_attention(
    query: torch.Tensor, pools: PoolTensors, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor, scale: float, sliding_window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None, tail_rows: torch.Tensor | None = None,
    fresh_key: torch.Tensor | None = None, fresh_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton varlen prefill; the arguments and result of ``paged_prefill_attention_ref``.

    ``cu_query_lens`` must be consistent with ``query`` (``cu_query_lens[-1] == query.shape[0]``, non-decreasing)
    and each ``q_len <= seq_len``; this is not checked on the device.
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for launch in _prefill_launches(query, pools, block_tables, seq_lens, cu_query_lens, scale, sliding_window,
                                    softcap, sinks, out, tail_rows, fresh_key, fresh_value):
        launch()
    return out


def _prefill_launches(query, pools, block_tables, seq_lens, cu_query_lens, scale, sliding_window, softcap, sinks, out,
                      tail_rows=None, fresh_key=None, fresh_value=None) -> list[Launch]:
    k = _kernels()
    total, num_heads, head_dim = check_query(query, "query")
    pools = check_pools(query, pools, head_dim)
    group = num_heads // pools.num_kv_heads
    if group * pools.num_kv_heads != num_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={pools.num_kv_heads}")
    for name, t, dim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1),
                         ("cu_query_lens", cu_query_lens, 1)):
        check_index(t, name, dim, query.device)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or cu_query_lens.shape[0] != num_seqs + 1:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} needs block_tables [{num_seqs}, max_blocks] and cu_query_lens "
            f"[{num_seqs + 1}], got {tuple(block_tables.shape)} and {tuple(cu_query_lens.shape)}"
        )
    block_tables, seq_lens, cu_query_lens = block_tables.contiguous(), seq_lens.contiguous(), cu_query_lens.contiguous()
    tail_rows = check_tail_rows(tail_rows, pools, num_seqs, query.device)
    fresh_key, fresh_value, fresh_strides = check_fresh(fresh_key, fresh_value, pools, total, head_dim, query.device)
    check_sinks(sinks, num_heads, query.device)
    flags = feature_meta(sliding_window, softcap, sinks)

    block_m, block_n, options = prefill_tiles(head_dim, pools.fmt.name)
    block_n = _decode.key_tile(block_n, pools)
    g_pad = next_pow2(group)
    block_m = max(block_m, g_pad)
    block_q = block_m // g_pad
    d_pad = max(16, next_pow2(head_dim))
    num_tiles = total // block_q + num_seqs
    args = (
        query, *pools.data, *pools.side, *pools.tails, fresh_key, fresh_value, block_tables, seq_lens, cu_query_lens,
        tail_rows, sinks, out, float(scale), float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0, num_seqs,
        *query.stride(), *pools.data_strides, *pools.side_strides, *pools.tail_strides, *fresh_strides,
        block_tables.stride(0), *out.stride(),
    )
    meta = dict(
        GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, D_PAD=d_pad,
        PADDED=head_dim < d_pad, BLOCK_SIZE=pools.block_size, BLOCK_N=block_n, **pools.meta,
        DOT=dot_mode(query.dtype), SEQ_CHUNK=SEQ_CHUNK, **flags,
    )
    return [Launch(k.prefill, (num_tiles, pools.num_kv_heads), args, meta, options)]


def prefill_tiles(head_dim: int, kv_format: str) -> tuple[int, int, dict]:
    """``(BLOCK_M, BLOCK_N, launch options)`` of the prefill kernel for ``head_dim`` and ``kv_format``
    (``PREFILL_TILES``; BLOCK_M before padding to the group)."""
    block_m, block_n, options = next((m, n, o) for top, formats, m, n, o in PREFILL_TILES
                                     if head_dim <= top and (formats is None or kv_format in formats))
    return block_m, block_n, dict(options)


# ----------------------------------------------------------------------------------------------- kernels

tl = None  # triton.language, bound by _kernels()
attend_sequence = row_sum = None  # _tiles' helpers, bound by _kernels()


@functools.cache
def _kernels():
    """Decorates the prefill kernel on first launch; its helpers come from ``_tiles``."""
    global tl, attend_sequence, row_sum, _prefill_kernel
    helpers = _tiles.bind()
    tl = helpers.tl
    attend_sequence, row_sum = helpers.attend_sequence, helpers.row_sum
    _prefill_kernel = jit_unspecialized(_prefill_kernel, PREFILL_NO_SPECIALIZE,
                                        ("BlockTables", "SeqLens", "CuQueryLens", "TailRows"))
    return Kernels(prefill=_prefill_kernel)


def _prefill_kernel(
    Q, KC, VC, KS, VS, KZ, VZ, KT, VT, NK, NV, BlockTables, SeqLens, CuQueryLens, TailRows, Sinks, Out,
    scale, softcap, window, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_ksb, stride_ks1, stride_ks2, stride_vsb, stride_vso, stride_vsh,
    stride_tr, stride_to, stride_th, stride_td,
    stride_nn, stride_nh, stride_nd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CODES: tl.constexpr, KEY_SIDE: tl.constexpr, VALUE_SIDE: tl.constexpr,
    ZERO: tl.constexpr, TAIL: tl.constexpr, DOT: tl.constexpr, SEQ_CHUNK: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
):
    """One (query tile, KV head): BLOCK_Q queries x GROUP heads against their causal (windowed) keys."""
    tile = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    # The sequence of this tile: the last one whose first tile (cu_query_lens[s] // BLOCK_Q + s) is <= tile,
    # counted SEQ_CHUNK sequences at a time (a loop, not a batch-sized tile: one variant serves every batch).
    c = tl.arange(0, SEQ_CHUNK).to(tl.int64)
    seq = tile * 0 - 1
    for first in range(0, num_seqs, SEQ_CHUNK):
        s_idx = first + c
        in_batch = s_idx < num_seqs
        starts = tl.load(CuQueryLens + s_idx, mask=in_batch, other=0).to(tl.int64)
        seq += row_sum((in_batch & (starts // BLOCK_Q + s_idx <= tile)).to(tl.int64), 0)
    q_start = tl.load(CuQueryLens + seq).to(tl.int64)
    q_len = tl.load(CuQueryLens + seq + 1).to(tl.int64) - q_start
    seq_len = tl.load(SeqLens + seq).to(tl.int64)
    first_query = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # index of the tile's first query in the chunk
    context = seq_len - q_len  # position of the chunk's first query

    r = tl.arange(0, BLOCK_M).to(tl.int64)
    qi = first_query + r // G_PAD
    g = r % G_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    row_pos = tl.where(row_ok, context + qi, -1)  # -1: sees no key
    d = tl.arange(0, D_PAD).to(tl.int64)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + ((q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd),
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if DOT == 1:
        q = q.to(tl.float32)
    q_sum = row_sum(q.to(tl.float32), 1)  # the share of per-token key zero points in each score: z * sum(q)

    if USE_SINKS:  # the sink is one more logit of each head's softmax: start from it
        m_i = tl.load(Sinks + heads, mask=row_ok, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)

    # Keys [lo, hi): up to the tile's last query (none for a tile past the chunk); from the window start of
    # its first query.
    hi = tl.where(first_query < q_len, context + tl.minimum(first_query + BLOCK_Q, q_len), 0)
    lo = hi * 0
    if USE_WINDOW:
        lo = tl.maximum(lo, context + first_query - window + 1)
    table = BlockTables + seq * stride_bt
    acc, m_i, l_i = attend_sequence(
        acc, m_i, l_i, q, q_sum, row_pos, KC, VC, KS, VS, KZ, VZ, KT, VT, NK, NV, TailRows, seq, context, q_start,
        context + first_query, hi - 1, table, kv_head, lo, hi, scale, softcap, window, stride_cb, stride_co,
        stride_ch, stride_cd, stride_ksb, stride_ks1, stride_ks2, stride_vsb, stride_vso, stride_vsh, stride_tr,
        stride_to, stride_th, stride_td, stride_nn, stride_nh, stride_nd, HEAD_DIM, D_PAD, PADDED, BLOCK_SIZE,
        BLOCK_N, CODES, KEY_SIDE, VALUE_SIDE, ZERO, DOT, USE_WINDOW, USE_SOFTCAP, TAIL,
    )

    out = acc / tl.maximum(l_i, 1.1754943508222875e-38)[:, None]
    tl.store(
        Out + ((q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od),
        out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )
