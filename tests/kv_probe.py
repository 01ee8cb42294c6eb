"""Test-only reads of the KV bookkeeping that the package itself never needs.

``block_ids``: a table's physical ids (-1 where a block slid out of a window); ``free_order``: a pool's free blocks in
the order ``get_new_blocks`` hands them out (fresh ids, then the recycled queue, LRU); ``read_blocks``: a storage's
K and V of whole blocks, through its public ``read_slots``.
"""

from __future__ import annotations

import torch


def block_ids(table) -> list[int]:
    """``table``'s physical block ids, ``-1`` for blocks freed by ``free_blocks_before``."""
    return [-1 if b is None else b.block_id for b in table.blocks]


def free_order(pool) -> list[int]:
    """The ids of ``pool``'s free blocks, first handed out first: never-used ids, then the free queue head to tail
    (without caching, the free queue first)."""
    fresh, recycled = list(range(pool.high_water, pool.num_blocks)), [b.block_id for b in pool._recycled.blocks()]
    return fresh + recycled if pool.enable_caching else recycled + fresh


def read_blocks(storage, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of blocks ``ids`` (any shape ``S``) as ``[*S, block_size, num_kv_heads, head_dim]`` (dequantized; a
    tail format's partial block reads its codes)."""
    slots = ids.unsqueeze(-1) * storage.block_size + torch.arange(storage.block_size)
    return storage.read_slots(slots)
