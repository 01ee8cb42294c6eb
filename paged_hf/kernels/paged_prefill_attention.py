"""Paged prefill attention: variable-length query chunks against their paged past plus themselves, causal."""

from __future__ import annotations

import torch

from .attention_ref import paged_attention_core


def paged_prefill_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    key_zero: torch.Tensor | None = None,
    value_zero: torch.Tensor | None = None,
    kv_format: str = "auto",
) -> torch.Tensor:
    """Torch reference.

    Args:
        query: ``[total_queries, num_heads, head_dim]``: sequence ``s`` owns rows
            ``cu_query_lens[s] : cu_query_lens[s + 1]``, its last ``q_len`` positions
            ``seq_lens[s] - q_len .. seq_lens[s] - 1`` (their K/V already stored).
        block_tables: ``[S, max_blocks]``; seq_lens: ``[S]``; cu_query_lens: ``[S + 1]`` int, starting at 0.

    Returns ``[total_queries, num_heads, head_dim]``.
    """
    out = torch.empty_like(query)
    starts = cu_query_lens.tolist()
    lengths = seq_lens.tolist()
    for seq, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        if end == start:
            continue
        positions = torch.arange(lengths[seq] - (end - start), lengths[seq], device=query.device).unsqueeze(0)
        chunk = paged_attention_core(
            query[start:end].transpose(0, 1).unsqueeze(0), positions, key_cache, value_cache,
            block_tables[seq : seq + 1], seq_lens[seq : seq + 1], scale, sliding_window, softcap, sinks,
            key_scale, value_scale, key_zero, value_zero, kv_format,
        )
        out[start:end] = chunk.squeeze(0).transpose(0, 1)
    return out
