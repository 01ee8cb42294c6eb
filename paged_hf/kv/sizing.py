"""What a ``KVManager``'s pools cost and their allocation: bytes per block and per tail row, the blocks one sequence
holds at once, whether the fixed pool fits a device, and making each layer's storage (sized like its group's pool).

Functions of the manager rather than its methods: the manager keeps sequences, growth, audit and stats; these read
its format, heads, groups and rows and change only the groups' storages.
"""

from __future__ import annotations

import torch

from ..quant import layer_block_bytes, make_storage
from ..quant import tail_bytes_per_row as _tail_bytes_per_row
from ..storage import KVStorage
from .model_config import available_memory, config_dtype


def block_id_bytes(kv, dtype: torch.dtype | None = None) -> int:
    """Bytes of one block id in every layer (what one more block per group costs), from the manager's layer shapes
    (``model_config.block_id_bytes`` is the same sum read from a config, before any manager exists)."""
    dtype = dtype or config_dtype(kv.text_config)
    return sum(layer_block_bytes(kv.kv_format, kv.block_size, heads, head_dim, dtype, idx in kv.latent_dims)
               for idx, (heads, head_dim) in kv.head_shapes.items())


def tail_bytes_per_row(kv, dtype: torch.dtype | None = None) -> int:
    """Bytes of one sequence row of the tail pools in every layer (0 for formats without a tail)."""
    dtype = dtype or config_dtype(kv.text_config)
    return sum(_tail_bytes_per_row(kv.kv_format, kv.block_size, heads, head_dim, dtype)
               for heads, head_dim in kv.head_shapes.values())


def blocks_to_hold(kv, num_tokens: int) -> int:
    """Blocks the worst group holds at once for one sequence of ``num_tokens`` tokens (a window group: its
    window's)."""
    return max(g.policy.blocks_to_hold(num_tokens, kv.block_size) for g in kv.groups)


def check_fits_on(kv, devices: list[torch.device], dtype=None) -> None:
    """ValueError unless the pool's blocks (a fixed pool's, a growable one's ``presize``) fit the device among
    ``devices`` with the most memory available. ``PagedCache`` asks this at construction over every device of the
    machine (the model's is not known yet), so a pool no device can hold fails there; the first layer asks again
    for the device it lands on."""
    num_blocks = kv.groups[0].pool.num_blocks
    if not num_blocks:  # a growable pool not sized yet: each growth checks itself
        return
    total = block_id_bytes(kv, dtype) * num_blocks
    available, device = max((available_memory(d), str(d)) for d in devices)
    if total > available:
        raise ValueError(
            f"the KV pool needs {total / 2**30:.2f} GiB ({num_blocks} blocks x {len(kv.group_of)} layers) but "
            f"{device} has {available / 2**30:.2f} GiB available: lower num_blocks / memory_budget"
        )


def allocate_layer(kv, layer_idx: int, dtype: torch.dtype, device, num_kv_heads: int | None = None) -> KVStorage:
    """Makes layer ``layer_idx``'s pool tensors (sized like its group's pool, with the layer's head size and KV
    heads, or ``num_kv_heads``: the heads a ``PagedCache`` layer's first write shows). The first layer checks that
    the whole pool fits the device, before anything is allocated."""
    group = kv.group_of[layer_idx]
    if not any(g.storages for g in kv.groups):
        check_fits_on(kv, [torch.device(device)], dtype)
    heads, head_dim = kv.head_shapes[layer_idx]
    storage = make_storage(kv.kv_format, group.pool.num_blocks, kv.block_size, num_kv_heads or heads, head_dim, dtype,
                           device, shared_values=layer_idx in kv.latent_dims)
    if kv.has_tail:
        storage.ensure_tail_rows(kv.num_rows)
    group.storages[layer_idx] = storage
    return storage


def allocate_all(kv, dtype: torch.dtype, device) -> None:
    """Makes every layer's pool tensors now (the engine's pool is sized once)."""
    for idx in sorted(kv.group_of):
        allocate_layer(kv, idx, dtype, device)
