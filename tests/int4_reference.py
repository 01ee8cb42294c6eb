"""An independent reference of what the int4 KV cache means, for tests: a ``DynamicCache`` that keeps every token
in full precision, and an attention that gives each query the values the paged cache gives it.

Per row (no padding): positions ``< (length // block_size) * block_size`` are in full blocks, stored as int4 stores
them: keys quantized per channel over the block (``kv_quant.quantize_channels_ref``), values rotated, quantized per
token on the block's maximum (``quantize_block_values_ref``) and rotated back. A query at position ``p`` reads the
keys before its own block (``p // block_size * block_size``) as stored, and its own block's keys exact
(``own_block_attention``, the "paged" attention's policy). ``policy="stored"`` instead hands any attention the K/V
as stored (full blocks quantized, the rest exact): what a dense attention over a ``PagedCache`` reads. ``crop``
follows ``PagedCache.crop``'s policy: cropping back into a full block keeps its tokens at their dequantized values
(the block is quantized again, from them and the new tokens, when it refills). Beam search reorders rows
(``DynamicCache``'s own ``reorder_cache``): a row's quantized blocks are
recomputed from its values, as a fork of the paged cache shares them.

It recomputes every block at every forward and builds dense K/V: slow, and written for clarity, not speed.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer

from paged_hf.kernels.kv_quant import (
    dequantize_block_values_ref, dequantize_channels_ref, quantize_block_values_ref, quantize_channels_ref,
)
from paged_hf.rotation import kv_rotation, rotate, unrotate


def fake_quantize_blocks(keys: torch.Tensor, values: torch.Tensor, block_size: int) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """``[B, H, n * block_size, D]`` K/V -> the same, dequantized block by block as int4 stores them."""
    batch, heads, length, head_dim = keys.shape
    rotation = kv_rotation(head_dim, keys.device)
    # [B, H, n, bs, D] -> [B, n, bs, H, D]: a block's tokens, then heads, as the quantizers take them
    k = keys.float().view(batch, heads, -1, block_size, head_dim).permute(0, 2, 3, 1, 4)
    v = values.float().view(batch, heads, -1, block_size, head_dim).permute(0, 2, 3, 1, 4)
    k = dequantize_channels_ref(*quantize_channels_ref(k))
    v = unrotate(dequantize_block_values_ref(*quantize_block_values_ref(rotate(v, rotation))), rotation)
    back = (0, 3, 1, 2, 4)
    return (k.permute(back).reshape(batch, heads, length, head_dim).to(keys.dtype),
            v.permute(back).reshape(batch, heads, length, head_dim).to(values.dtype))


def own_block_attention(block_size: int) -> str:
    """Registers and returns the name of an attention that reads, for each query, the keys before its own
    block fake-quantized and its own block exact (``key``/``value``: a row's full-precision K/V, queries its last
    positions; unpadded rows; sliding window and softcap as the model passes them)."""
    name = f"int4_reference_{block_size}"

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  softcap=None, **kwargs):
        length, num_queries = key.shape[-2], query.shape[-2]
        full = length // block_size * block_size
        k_stored, v_stored = fake_quantize_blocks(key[..., :full, :], value[..., :full, :], block_size)
        positions = torch.arange(length - num_queries, length, device=query.device)[:, None]  # [n, 1]
        stored = torch.arange(full, device=query.device)[None, :]
        exact = torch.arange(length, device=query.device)[None, :]
        mask = torch.cat([stored // block_size < positions // block_size,
                          (exact // block_size == positions // block_size) & (exact <= positions)], dim=1)
        if sliding_window is not None:  # keys > position - window
            mask &= torch.cat([stored, exact], dim=1) > positions - sliding_window
        group = query.shape[1] // key.shape[1]
        keys = torch.cat([k_stored, key], dim=-2).float().repeat_interleave(group, dim=1)
        values = torch.cat([v_stored, value], dim=-2).float().repeat_interleave(group, dim=1)
        scores = query.float() @ keys.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ values
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)  # (again: the same function of the same block size)
    return name


class Int4ReferenceLayer(DynamicLayer):
    def __init__(self, block_size: int, policy: str) -> None:
        super().__init__()
        self.block_size = block_size
        self.policy = policy

    def update(self, key_states, value_states, *args, **kwargs):
        super().update(key_states, value_states, *args, **kwargs)  # full precision
        if self.policy == "own_block":  # own_block_attention quantizes
            return self.keys, self.values
        full = self.keys.shape[-2] // self.block_size * self.block_size
        k, v = fake_quantize_blocks(self.keys[..., :full, :], self.values[..., :full, :], self.block_size)
        return torch.cat([k, self.keys[..., full:, :]], dim=-2), torch.cat([v, self.values[..., full:, :]], dim=-2)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        length = self.keys.shape[-2]
        kept = length + tokens_to_remove  # tokens_to_remove < 0
        start = kept // self.block_size * self.block_size
        if kept % self.block_size and length >= start + self.block_size:  # back into a full block
            k, v = fake_quantize_blocks(self.keys[..., start : start + self.block_size, :],
                                        self.values[..., start : start + self.block_size, :], self.block_size)
            self.keys = torch.cat([self.keys[..., :start, :], k, self.keys[..., start + self.block_size :, :]], -2)
            self.values = torch.cat([self.values[..., :start, :], v, self.values[..., start + self.block_size :, :]],
                                    -2)
        super().crop(tokens_to_remove)


class Int4ReferenceCache(DynamicCache):
    """``DynamicCache`` with ``Int4ReferenceLayer`` layers (every layer keeps all its tokens; unpadded rows).
    ``policy``: "own_block" (run the model with ``own_block_attention(block_size)``) or "stored" (any attention)."""

    def __init__(self, config, block_size: int, policy: str = "own_block") -> None:
        if policy not in ("own_block", "stored"):
            raise ValueError(f"policy must be 'own_block' or 'stored', got {policy!r}")
        super().__init__(config=config)
        self.layers = [Int4ReferenceLayer(block_size, policy) for _ in range(config.num_hidden_layers)]
