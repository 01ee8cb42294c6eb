"""The ``"paged"`` attention implementation: reads K/V straight from a ``PagedCache``'s blocks.

``PagedCache.update`` puts the step's plan into the layer's ``kwargs`` (the same dict transformers then passes
to the attention function). Without a plan (no cache, another cache class, or a model that calls ``update``
without ``kwargs``) the function attends densely over the K/V and mask it was given, so a model loaded with
``attn_implementation="paged"`` works everywhere.
"""

from __future__ import annotations

import itertools

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .cache import METADATA_KEY
from .kernels.dispatch import decode_attention, prefill_attention
from .rotation import rotate, unrotate

ATTENTION_NAME = "paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention signature. ``query`` is ``[B, heads, q, head_dim]``; returns ``[B, q, heads, head_dim]``."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    metadata = kwargs.get(METADATA_KEY)
    if metadata is None:
        if softcap is None and s_aux is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scale)
        return dense_attention(query, key, value, attention_mask, scale, softcap, s_aux), None

    plan, group_plan, storage, window = metadata
    flat = plan.select_new_tokens(query)  # [n, heads, head_dim], packed by sequence
    out = paged_attention(flat, plan, group_plan, storage, scale, window, softcap, s_aux)
    return plan.scatter_new_tokens(out), None


def paged_attention(flat_query, plan, group_plan, storage, scale, window, softcap, sinks) -> torch.Tensor:
    """Attention of a plan's packed new tokens ``[n, heads, head_dim]`` over their sequences' blocks.

    One-token sequences go through the batched decode path; longer ones through the varlen prefill path.
    Triton kernels on CUDA, the torch references elsewhere (``PAGED_HF_KERNELS=torch|triton`` forces either).
    A storage whose vectors are stored rotated (quantized formats) gets the query rotated the same way (scores
    are unchanged) and the output rotated back, in float32.
    """
    rotation = storage.rotation
    query = flat_query if rotation is None else rotate(flat_query, rotation)
    options = dict(scale=scale, sliding_window=window, softcap=softcap, sinks=sinks, **storage.attention_operands())
    out = _attend(query, plan, group_plan, options)
    return out if rotation is None else unrotate(out, rotation).to(flat_query.dtype)


def _attend(query, plan, group_plan, options) -> torch.Tensor:
    tables, seq_lens = group_plan.readable_block_tables, plan.seq_lens
    if plan.decode_only:
        return decode_attention(query, block_tables=tables, seq_lens=seq_lens, **options)
    decode_seqs = [s for s, n in enumerate(plan.new_counts) if n == 1]
    if len(decode_seqs) < 2:
        return prefill_attention(query, block_tables=tables, seq_lens=seq_lens, cu_query_lens=plan.cu_query_lens,
                                 **options)
    # mixed step (engine): the decodes through the batched decode path, the prefill chunks through the varlen one
    out = torch.empty_like(query)
    starts = plan.cu_query_lens
    decode_rows = starts[decode_seqs]
    decode_index = torch.tensor(decode_seqs, device=query.device)
    out[decode_rows] = decode_attention(
        query[decode_rows], block_tables=tables[decode_index], seq_lens=seq_lens[decode_index], **options
    )
    prefill_seqs = [s for s, n in enumerate(plan.new_counts) if n > 1]
    prefill_index = torch.tensor(prefill_seqs, dtype=torch.long, device=query.device)
    lengths = [plan.new_counts[s] for s in prefill_seqs]
    rows = torch.cat([torch.arange(int(starts[s]), int(starts[s]) + n) for s, n in zip(prefill_seqs, lengths)])
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.long)
    out[rows] = prefill_attention(
        query[rows], block_tables=tables[prefill_index], seq_lens=seq_lens[prefill_index], cu_query_lens=cu, **options
    )
    return out


def dense_attention(query, key, value, attention_mask, scale, softcap=None, sinks=None) -> torch.Tensor:
    """Plain attention over dense K/V with an HF mask (bool: True = attend; float: additive), softcap and sinks."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def paged_mask(*args, **kwargs):
    """Mask builder registered for ``"paged"``: the paged path derives its masks from positions and block
    tables, the dense fallback needs sdpa's mask, so build that one."""
    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)


def unregister_attention() -> None:
    AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)
    AttentionMaskInterface._global_mapping.pop(ATTENTION_NAME, None)
