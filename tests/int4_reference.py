"""An independent reference of what the int4 KV cache means, for tests: a ``DynamicCache`` that keeps every token
in full precision and hands the attention each row's K/V with its full blocks fake-quantized.

Per row (no padding), positions ``< (length // block_size) * block_size`` are in full blocks: keys quantized per
channel over the block (``kv_quant.quantize_channels_ref``), values rotated, quantized per token on the block's
maximum (``quantize_block_values_ref``) and rotated back;
the rest (the tail) is exact. ``crop`` follows ``PagedCache.crop``'s policy: cropping back into a full block keeps
its tokens at their dequantized values (the block is quantized again, from them and the new tokens, when it
refills). Beam search reorders rows (``DynamicCache``'s own ``reorder_cache``): a row's quantized blocks are
recomputed from its values, as a fork of the paged cache shares them.

It recomputes every block at every forward and builds dense K/V: slow, and written for clarity, not speed.
"""

from __future__ import annotations

import torch
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


class Int4ReferenceLayer(DynamicLayer):
    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size

    def update(self, key_states, value_states, *args, **kwargs):
        super().update(key_states, value_states, *args, **kwargs)  # full precision
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
    """``DynamicCache`` with ``Int4ReferenceLayer`` layers (full-attention models, unpadded rows)."""

    def __init__(self, config, block_size: int) -> None:
        super().__init__(config=config)
        self.layers = [Int4ReferenceLayer(block_size) for _ in range(config.num_hidden_layers)]
