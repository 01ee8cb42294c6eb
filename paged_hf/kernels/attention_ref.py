"""Torch core shared by the paged attention references: attention over block tables.

A batch whose scores fit one chunk (``SCORE_ELEMENTS_PER_CHUNK``) gathers its blocks once and calls torch's fused
``scaled_dot_product_attention`` with a position mask: the common CPU case, and the fastest torch way. Longer
contexts, softcap and attention sinks go one chunk of blocks at a time with an online softmax (the same algorithm
as the GPU kernels), so no dense copy of a whole batch's K/V beyond one chunk is ever built.

Blocks are dequantized as they are read (``read_blocks``: per-token scales or int4's per-block side data, as the
``KVFormat`` says); a format with a full-precision tail reads each sequence's partial last block from its tail row
instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_format import kv_format as _kv_format
from .kv_quant import dequantize_block_values_ref, dequantize_channels_ref, dequantize_kv_ref

# Upper bound on the score elements (batch x query heads x queries x keys) held per chunk.
SCORE_ELEMENTS_PER_CHUNK = 1 << 22


def paged_attention_core(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    value_zero: torch.Tensor | None = None,
    kv_format: str = "auto",
    window_starts: torch.Tensor | None = None,
    key_tail: torch.Tensor | None = None,
    value_tail: torch.Tensor | None = None,
    tail_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries against the paged K/V of their sequences.

    Args:
        query: ``[B, num_heads, n, head_dim]``; query heads ``h`` read KV head ``h // (num_heads // num_kv_heads)``.
        query_positions: ``[B, n]`` int64 position of each query; a query attends keys at positions
            ``<= its own`` (and ``> position - sliding_window``). A negative position marks a padding query (output 0).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[B, max_blocks]`` int block ids; entries past a sequence's length must be valid ids.
        seq_lens: ``[B]`` tokens held by each sequence (positions ``0 .. seq_len - 1``).
        sinks: ``[num_heads]`` attention-sink logits that join each softmax denominator, or None.
        key_scale, value_scale, key_zero, value_zero, kv_format: for quantized pools: codes in the caches and the
            side data as ``kv_format``'s module docstring lays it out (float16 scales per token; int4: key range
            codes and grid, value scale codes and maximum); each chunk is dequantized as it is read.
        window_starts: ``[B, n]`` the first key position each query sees, in place of ``sliding_window`` (a window
            measured over a padded timeline, where pads take window room), or None.
        key_tail, value_tail, tail_rows: formats with a full-precision tail: ``[rows, block_size, num_kv_heads,
            head_dim]`` pools in the compute dtype and ``[B]`` each sequence's row; positions from
            ``seq_lens // block_size * block_size`` on are read there (the last block is not full yet).

    Returns ``[B, num_heads, n, head_dim]`` in ``query.dtype``; computed in float32.
    """
    batch, num_heads, num_queries, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, f"{num_heads=} is not a multiple of {num_kv_heads=}"
    pools = KVPools(key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format, key_tail,
                    value_tail, tail_rows)
    num_blocks = block_tables.shape[1]
    if not torch.compiler.is_compiling():  # read only the blocks that hold tokens (a host sync: eager only)
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
        num_blocks = min(num_blocks, -(-max_len // block_size))
    keys_per_chunk = max(block_size, SCORE_ELEMENTS_PER_CHUNK // max(1, batch * num_heads * num_queries))
    blocks_per_chunk = max(1, keys_per_chunk // block_size)
    if num_blocks <= blocks_per_chunk and softcap is None and sinks is None:
        return _single_chunk_attention(query, query_positions, pools, block_tables[:, :num_blocks], seq_lens, scale,
                                       sliding_window, window_starts)

    q = query.float().reshape(batch, num_kv_heads, group * num_queries, head_dim)

    rows = group * num_queries
    if sinks is None:
        running_max = torch.full((batch, num_kv_heads, rows), float("-inf"), device=q.device)
        running_sum = torch.zeros((batch, num_kv_heads, rows), device=q.device)
    else:  # the sink is one more logit per head: start the softmax from it
        sink = sinks.float().view(1, num_kv_heads, group, 1).expand(batch, -1, -1, num_queries)
        running_max = sink.reshape(batch, num_kv_heads, rows).clone()
        running_sum = torch.ones((batch, num_kv_heads, rows), device=q.device)
    acc = torch.zeros((batch, num_kv_heads, rows, head_dim), device=q.device)

    # [B, 1, group * n]: the position of each score row, as the rows are laid out (group-major).
    row_positions = query_positions.unsqueeze(1).expand(batch, group, num_queries).reshape(batch, 1, rows)
    row_starts = None
    if window_starts is not None:
        row_starts = window_starts.unsqueeze(1).expand(batch, group, num_queries).reshape(batch, 1, rows)
    for first in range(0, num_blocks, blocks_per_chunk):
        k, v = pools.read(block_tables[:, first : first + blocks_per_chunk].long(), first, seq_lens)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, kv_heads, rows, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        key_positions = torch.arange(first * block_size, first * block_size + k.shape[2], device=q.device)
        visible = key_positions.view(1, 1, 1, -1) <= row_positions.unsqueeze(-1)
        if row_starts is not None:
            visible &= key_positions.view(1, 1, 1, -1) >= row_starts.unsqueeze(-1)
        elif sliding_window is not None:
            visible &= key_positions.view(1, 1, 1, -1) > (row_positions.unsqueeze(-1) - sliding_window)
        scores = scores.masked_fill(~visible, float("-inf"))

        chunk_max = torch.maximum(running_max, scores.amax(-1))
        safe_max = torch.where(torch.isinf(chunk_max), torch.zeros_like(chunk_max), chunk_max)
        probs = torch.exp(scores - safe_max.unsqueeze(-1))
        correction = torch.exp(running_max - safe_max)
        running_sum = running_sum * correction + probs.sum(-1)
        acc = acc * correction.unsqueeze(-1) + torch.matmul(probs, v)
        running_max = chunk_max

    out = acc / running_sum.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    out = out.masked_fill((row_positions < 0).view(batch, 1, rows, 1), 0.0)
    return out.view(batch, num_heads, num_queries, head_dim).to(query.dtype)


def _single_chunk_attention(query, query_positions, pools, block_tables, seq_lens, scale, sliding_window,
                            window_starts) -> torch.Tensor:
    """``paged_attention_core`` for a batch whose keys are read at once: one gather, one fused SDPA call."""
    batch, num_heads, num_queries, head_dim = query.shape
    k, v = pools.read(block_tables.long(), 0, seq_lens)  # [B, kv_heads, L, D]
    key_positions = torch.arange(k.shape[2], device=query.device).view(1, 1, -1)
    rows = query_positions.unsqueeze(-1)  # [B, n, 1]
    visible = key_positions <= rows
    if window_starts is not None:
        visible &= key_positions >= window_starts.unsqueeze(-1)
    elif sliding_window is not None:
        visible &= key_positions > rows - sliding_window
    out = F.scaled_dot_product_attention(query.float(), k, v, attn_mask=visible.unsqueeze(1), scale=scale,
                                         enable_gqa=num_heads != k.shape[1])
    # a padding query (negative position) sees no key: its row is undefined (NaN) in SDPA; it must be 0
    out = out.masked_fill((query_positions < 0).view(batch, 1, num_queries, 1), 0.0)
    return out.to(query.dtype)


class KVPools:
    """The pool operands of one attention call; ``read`` dequantizes blocks (and substitutes tails)."""

    def __init__(self, key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format, key_tail,
                 value_tail, tail_rows) -> None:
        self.fmt = _kv_format(kv_format)
        self.key = (key_cache, key_scale, key_zero, self.fmt.key_side)
        self.value = (value_cache, value_scale, value_zero, self.fmt.value_side)
        self.tails = (key_tail, value_tail)
        self.tail_rows = tail_rows
        self.block_size = key_cache.shape[1]
        if self.fmt.tail and (key_tail is None or value_tail is None or tail_rows is None):
            raise ValueError(f"kv_format={kv_format!r} keeps a full-precision tail: pass key_tail, value_tail and "
                             f"tail_rows")

    def read(self, ids: torch.Tensor, first: int, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks ``ids`` ``[B, n]`` (block ``first + j`` of each sequence) as float32
        ``[B, kv_heads, n * block_size, head_dim]``."""
        out = []
        for (cache, scale, zero, side), tail in zip((self.key, self.value), self.tails):
            blocks = read_blocks(cache, scale, zero, self.fmt.name, ids, side)  # [B, n, bs, H, D]
            if self.fmt.tail:  # the block holding a sequence's partial tail: read its tail row instead
                index = torch.arange(first, first + ids.shape[1], device=ids.device)
                seq_lens = seq_lens.to(ids.device).long()
                is_tail = (index[None, :] == seq_lens[:, None] // self.block_size) \
                    & (seq_lens % self.block_size != 0)[:, None]
                rows = tail[self.tail_rows.to(tail.device).long()].float()  # [B, bs, H, D]
                blocks = torch.where(is_tail[:, :, None, None, None], rows[:, None], blocks)
            out.append(blocks.flatten(1, 2).transpose(1, 2))
        return out[0], out[1]


def read_blocks(cache, scale, zero, kv_format: str, ids: torch.Tensor, side: str = "token") -> torch.Tensor:
    """Blocks ``ids`` of one pool as float32 ``[*ids.shape, block_size, num_kv_heads, head_dim]``; ``side``: the
    pool's ``KVFormat`` side ("token": a float16 scale per token ``[num_blocks, block_size, heads]``; int4's
    "channel": key range codes ``[num_blocks, heads, 2, head_dim]`` and grid ``[num_blocks, heads, 2]``, and
    "token_code": value scale codes ``[num_blocks, heads, block_size // 2]`` and maximum ``[num_blocks, heads]``, in
    ``scale`` and ``zero``)."""
    if kv_format == "auto":
        return cache[ids].float()
    raw = cache.view(torch.uint8) if cache.element_size() == 1 and cache.dtype.is_floating_point else cache
    codes = raw[ids].view(cache.dtype)  # float8 has no CPU indexing kernel: index its bytes
    if side == "channel":
        return dequantize_channels_ref(codes, scale[ids], zero[ids], torch.float32)
    if side == "token_code":
        return dequantize_block_values_ref(codes, scale[ids], zero[ids], torch.float32)
    return dequantize_kv_ref(codes, scale[ids], None if zero is None else zero[ids], kv_format, torch.float32)
