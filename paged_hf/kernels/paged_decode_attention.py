"""Paged decode attention: one query token per sequence against that sequence's blocks."""

from __future__ import annotations

import torch

from .attention_ref import paged_attention_core


def paged_decode_attention_ref(
    query: torch.Tensor,
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
) -> torch.Tensor:
    """Torch reference.

    Args:
        query: ``[S, num_heads, head_dim]``, the token at position ``seq_lens[s] - 1`` of each sequence.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the query's own K/V is
            already stored. Quantized pools add ``key_scale`` .. ``kv_format`` (see ``paged_attention_core``).
        block_tables: ``[S, max_blocks]`` int32/int64.
        seq_lens: ``[S]`` tokens held per sequence, the query's own included (>= 1).

    Returns ``[S, num_heads, head_dim]``.
    """
    positions = (seq_lens.long() - 1).unsqueeze(1)
    out = paged_attention_core(
        query.unsqueeze(2), positions, key_cache, value_cache, block_tables, seq_lens,
        scale, sliding_window, softcap, sinks, key_scale, value_scale, key_zero, value_zero, kv_format,
    )
    return out.squeeze(2)
