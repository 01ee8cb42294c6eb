"""Torch core shared by the paged attention references: attention over block tables.

A batch whose scores fit one chunk (``SCORE_ELEMENTS_PER_CHUNK``) gathers its blocks once and calls torch's fused
``scaled_dot_product_attention`` with a position mask: the common CPU case, and the fastest torch way. Longer
contexts, softcap and attention sinks go one chunk of blocks at a time with an online softmax (the same algorithm
as the GPU kernels), so no dense copy of a whole batch's K/V beyond one chunk is ever built.

Blocks are dequantized as they are read (``read_blocks``: per-token scales or int4's per-block side data, as the
``KVFormat`` says). A format with a full-precision tail (int4) reads each query's *own block* in full precision: a
query at position ``p`` sees the keys before its block start ``p // block_size * block_size`` as stored (quantized
full blocks, also those this forward filled) and the keys of its own block, up to ``p``, exact: the ones older than
the forward from its sequence's tail row (as it was before the forward: the tail writes come after the attention),
the forward's own from its new K/V (``fresh_*``). So a decode step and a prefill chunk see the same values for the
same tokens, whatever the chunking; and since only full blocks are read quantized and a prefix hit shares full
blocks only, a prefix hit and a miss still attend to the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_format import kv_format as _kv_format
from .kv_quant import dequantize_block_values_ref, dequantize_channels_ref, dequantize_kv_ref
from .pool_tensors import PoolTensors

# Upper bound on the score elements (batch x query heads x queries x keys) held per chunk.
SCORE_ELEMENTS_PER_CHUNK = 1 << 22


def paged_attention_core(
    query: torch.Tensor, query_positions: torch.Tensor, pools: PoolTensors, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None, window_starts: torch.Tensor | None = None,
    tail_rows: torch.Tensor | None = None, fresh_keys: torch.Tensor | None = None,
    fresh_values: torch.Tensor | None = None, num_fresh: torch.Tensor | None = None, fresh_is_query: bool = False,
) -> torch.Tensor:
    """Causal attention of queries against the paged K/V of their sequences.

    Args:
        query: ``[B, num_heads, n, head_dim]``; query heads ``h`` read KV head ``h // (num_heads // num_kv_heads)``.
        query_positions: ``[B, n]`` int64 position of each query; a query attends keys at positions
            ``<= its own`` (and ``> position - sliding_window``). A negative position marks a padding query (output 0).
        pools: the layer's ``PoolTensors``: codes in the caches and the side data as its ``kv_format``'s module
            docstring lays it out (float16 scales per token; int4: key range codes and grid, value scale codes and
            maximum; each chunk is dequantized as it is read), and a tail format's ``[rows, block_size,
            num_kv_heads, head_dim]`` tail pools in the compute dtype.
        block_tables: ``[B, max_blocks]`` int block ids; entries past a sequence's length must be valid ids.
        seq_lens: ``[B]`` tokens held by each sequence (positions ``0 .. seq_len - 1``).
        sinks: ``[num_heads]`` attention-sink logits that join each softmax denominator, or None.
        window_starts: ``[B, n]`` the first key position each query sees, in place of ``sliding_window`` (a window
            measured over a padded timeline, where pads take window room), or None.
        tail_rows: formats with a full-precision tail: ``[B]`` each sequence's row of the tail pools, holding the
            tokens of its last block older than the forward (positions ``ctx // block_size * block_size .. ctx -
            1``, ``ctx = seq_lens - num_fresh``).
        fresh_keys, fresh_values, num_fresh: tail formats: the forward's new K/V of each sequence, ``[B, W,
            num_kv_heads, head_dim]`` (rotated as stored), its first ``num_fresh[b]`` entries at positions ``ctx ..
            seq_lens - 1``. A query reads its own block from the tail row and these (module docstring).
            ``fresh_is_query``: each sequence's one new token is its one query (a decode step: a shorter read).

    Returns ``[B, num_heads, n, head_dim]`` in ``query.dtype``; computed in float32.
    """
    batch, num_heads, num_queries, head_dim = query.shape
    block_size, num_kv_heads = pools.block_size, pools.num_kv_heads
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, f"{num_heads=} is not a multiple of {num_kv_heads=}"
    pools = KVPools(pools, tail_rows, fresh_keys, fresh_values, num_fresh, fresh_is_query)  # the reader of them
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
    steps = [(first, None) for first in range(0, num_blocks, blocks_per_chunk)]
    if pools.fmt.tail:  # then each query's own block, in full precision
        own = pools.own_blocks(seq_lens)
        steps.append((None, own))
        stored_below = pools.stored_below(row_positions, own[2][:, :1].view(batch, 1, 1))
    for first, own in steps:
        if own is None:
            k, v = pools.read(block_tables[:, first : first + blocks_per_chunk].long())
            key_positions = torch.arange(first * block_size, first * block_size + k.shape[2], device=q.device)
            key_positions = key_positions.view(1, 1, 1, -1)
            visible = key_positions <= row_positions.unsqueeze(-1)
            if pools.fmt.tail:
                visible &= key_positions < stored_below.unsqueeze(-1)
        else:
            k, v, own_positions, own_valid = own
            key_positions = own_positions.view(batch, 1, 1, -1)
            visible = pools.own_visible(key_positions, own_valid.view(batch, 1, 1, -1), row_positions.unsqueeze(-1))
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, kv_heads, rows, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if row_starts is not None:
            visible &= key_positions >= row_starts.unsqueeze(-1)
        elif sliding_window is not None:
            visible &= key_positions > (row_positions.unsqueeze(-1) - sliding_window)
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
    one_query = pools.fmt.tail and num_queries == 1  # decode: its own block replaces the block's codes, no concat
    k, v = pools.read(block_tables.long(), query_positions[:, 0] if one_query else None, seq_lens)  # [B, H, L, D]
    key_positions = torch.arange(k.shape[2], device=query.device).view(1, 1, -1)
    rows = query_positions.unsqueeze(-1)  # [B, n, 1]
    visible = key_positions <= rows
    if pools.fmt.tail and not one_query:  # stored keys before each query's own block, then its own block exact
        own_k, own_v, own_positions, own_valid = pools.own_blocks(seq_lens)
        visible &= key_positions < pools.stored_below(rows, own_positions[:, None, :1])
        own_positions = own_positions.unsqueeze(1)  # [B, 1, W]
        own_visible = pools.own_visible(own_positions, own_valid.unsqueeze(1), rows)
        k, v = torch.cat([k, own_k], dim=2), torch.cat([v, own_v], dim=2)
        key_positions = torch.cat([key_positions.expand(batch, 1, -1), own_positions], dim=2)
        visible = torch.cat([visible, own_visible], dim=2)
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
    """The pool operands of one attention call: ``read`` dequantizes blocks, ``own_blocks`` gives a tail format's
    full-precision window of each sequence's own blocks (tail row + new K/V)."""

    def __init__(self, pools: PoolTensors, tail_rows, fresh_keys=None, fresh_values=None, num_fresh=None,
                 fresh_is_query: bool = False) -> None:
        key_cache, value_cache, key_scale, value_scale, key_zero, value_zero, kv_format, key_tail, value_tail = pools
        self.fmt = _kv_format(kv_format)
        self.key = (key_cache, key_scale, key_zero, self.fmt.key_side)
        self.value = (value_cache, value_scale, value_zero, self.fmt.value_side)
        self.tails = (key_tail, value_tail)
        self.tail_rows = tail_rows
        self.fresh = (fresh_keys, fresh_values)
        self.num_fresh = num_fresh
        self.fresh_is_query = fresh_is_query
        self.block_size = key_cache.shape[1]
        if self.fmt.tail and any(t is None for t in (key_tail, value_tail, tail_rows, fresh_keys, fresh_values,
                                                      num_fresh)):
            raise ValueError(f"kv_format={kv_format!r} keeps a full-precision tail: pass pools with key_tail and "
                             f"value_tail, and tail_rows, fresh_keys, fresh_values and num_fresh")

    def read(self, ids: torch.Tensor, own_position: torch.Tensor | None = None,
             seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks ``ids`` ``[B, n]`` as float32 ``[B, kv_heads, n * block_size, head_dim]``, as stored (a
        tail format's partial last block reads whatever its codes hold: ``own_blocks`` gives its values).
        ``own_position`` ``[B]`` (a tail format, one query per sequence, with ``seq_lens``): the block holding that
        position reads the query's own block instead, exact (its keys past the query hold anything: a causal mask
        hides them)."""
        own = (None, None) if own_position is None else self._own_block_values(own_position, seq_lens)
        out = []
        for (cache, scale, zero, side), replace in zip((self.key, self.value), own):
            blocks = read_blocks(cache, scale, zero, self.fmt.name, ids, side)  # [B, n, bs, H, D]
            if replace is not None:
                index, exact, use = replace
                batch = torch.arange(ids.shape[0], device=ids.device)
                index = index.clamp(0, ids.shape[1] - 1)
                if use is not None:
                    exact = torch.where(use[:, None, None, None], exact, blocks[batch, index])
                blocks[batch, index] = exact
            out.append(blocks.flatten(1, 2).transpose(1, 2))
        return out[0], out[1]

    def _own_block_values(self, position: torch.Tensor, seq_lens: torch.Tensor) -> list:
        """Per K and V: ``(block index [B], exact values [B, bs, H, D], whether to use them [B] or None: all)`` of
        the block holding each query's ``position``: offsets before the forward's first position ``ctx`` from the
        tail row, later ones from the fresh K/V. A query older than the tail row's block (a pad column's) keeps the
        stored block."""
        bs = self.block_size
        device = self.fresh[0].device
        position = position.to(device).long()
        if self.fresh_is_query:  # a decode step: the tail row, with the query's own K/V at its offset
            rows, batch = self.tail_rows.to(device).long(), torch.arange(position.shape[0], device=device)
            out = []
            for tail, fresh in zip(self.tails, self.fresh):
                exact = tail[rows].float()
                exact[batch, position % bs] = fresh[:, 0].float()
                out.append((position // bs, exact, None))
            return out
        ctx = seq_lens.to(device).long() - self.num_fresh.to(device).long()
        first = ctx // bs * bs
        start = position.clamp_min(0) // bs * bs
        positions = start[:, None] + torch.arange(bs, device=device)[None, :]  # [B, bs]
        # index into [tail row (bs entries: positions first ..), fresh (W entries: positions ctx ..)]
        index = torch.where(positions < ctx[:, None], positions - first[:, None], bs + positions - ctx[:, None])
        index = index.clamp(0, bs + self.fresh[0].shape[1] - 1)
        rows = self.tail_rows.to(device).long()
        out = []
        for tail, fresh in zip(self.tails, self.fresh):
            window = torch.cat([tail[rows], fresh.to(tail.dtype)], dim=1)  # [B, bs + W, H, D]
            exact = window.gather(1, index[:, :, None, None].expand(-1, -1, *window.shape[2:])).float()
            out.append((start // bs, exact, position >= first))
        return out

    def stored_below(self, row_positions: torch.Tensor, window_first: torch.Tensor) -> torch.Tensor:
        """Tail formats: a row reads the stored (quantized) keys below this position: its own block's start, or the
        exact window's first position (``own_blocks``) for a row older than the window (a pad column's query)."""
        return torch.maximum(row_positions // self.block_size * self.block_size, window_first)

    def own_visible(self, positions: torch.Tensor, valid: torch.Tensor, row_positions: torch.Tensor) -> torch.Tensor:
        """Tail formats: which exact keys (``own_blocks``' ``positions`` / ``valid``) a row at ``row_positions`` sees:
        those of its own block, up to its position (all broadcast together)."""
        return valid & (positions <= row_positions) & (positions // self.block_size == row_positions // self.block_size)

    def own_blocks(self, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tail formats: the full-precision keys a sequence's queries may read in their own blocks, ``(k, v,
        positions, valid)``: K/V float32 ``[B, kv_heads, block_size + W, head_dim]``, their positions and whether
        they hold a token ``[B, block_size + W]``. Entries ``j < block_size``: offset ``j`` of the tail row, the
        block where the forward starts (valid below the forward's first position ``ctx``); then the ``W`` new
        tokens (the first ``num_fresh``)."""
        bs = self.block_size
        device = self.fresh[0].device
        num_fresh = self.num_fresh.to(device).long()
        ctx = seq_lens.to(device).long() - num_fresh
        first = ctx // bs * bs
        offsets = torch.arange(bs, device=device)
        width = self.fresh[0].shape[1]
        fresh_index = torch.arange(width, device=device)
        positions = torch.cat([first[:, None] + offsets[None, :], ctx[:, None] + fresh_index[None, :]], dim=1)
        valid = torch.cat([first[:, None] + offsets[None, :] < ctx[:, None], fresh_index[None, :] < num_fresh[:, None]],
                          dim=1)
        out = []
        rows = self.tail_rows.to(device).long()
        for tail, fresh in zip(self.tails, self.fresh):
            window = torch.cat([tail[rows].float(), fresh.float()], dim=1)  # [B, bs + W, H, D]
            out.append(window.transpose(1, 2))
        return out[0], out[1], positions, valid


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
