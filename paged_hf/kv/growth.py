"""Growing a growable pool (``PagedCache`` without ``num_blocks``), and the error a fixed pool raises when a forward
does not fit.

Policy: a pool grows by what is missing or by a quarter of its size, whichever is more (amortized O(1) copies per
block, at most ~20% of the pool idle after a grow); its storages grow one tensor at a time, and the growth is
checked against the device's available memory first.
"""

from __future__ import annotations

from .layer_groups import LayerGroup
from .model_config import available_memory

GROWTH_DIVISOR = 4  # a growable pool grows by at least 1 / GROWTH_DIVISOR of its size


class PagedCacheFullError(RuntimeError):
    """The fixed-size pool has too few free blocks for the next forward; nothing was allocated."""


def grow_group(group: LayerGroup, missing: int) -> None:
    """Grows ``group``'s pool and storages by ``missing`` blocks or by a quarter, whichever is more.
    ``PagedCacheFullError`` (nothing grown) when the device cannot hold the new blocks."""
    extra = max(missing, -(-group.pool.num_blocks // GROWTH_DIVISOR))
    if group.storages:
        storage = next(iter(group.storages.values()))
        layer_bytes = storage.nbytes // max(1, storage.num_blocks)
        largest = max(t.nbytes for s in group.storages.values() for t in s.tensors().values())
        needed = extra * layer_bytes * len(group.storages) + largest  # the new blocks + one tensor mid-copy
        available = available_memory(storage.device)
        if needed > available:
            raise PagedCacheFullError(
                f"PagedCache cannot grow its {group.name} pool by {extra} blocks: its layers need "
                f"{needed / 2**30:.2f} GiB more and {storage.device} has {available / 2**30:.2f} GiB available. "
                f"Set num_blocks or memory_budget to a pool that fits."
            )
    group.pool.grow(extra)
    for storage in group.storages.values():
        storage.grow(group.pool.num_blocks - storage.num_blocks)


def room_error(group: LayerGroup, needed: int, prompts: bool) -> Exception:
    """What a fixed pool raises when the next forward needs ``needed`` blocks of ``group``'s pool and fewer are free:
    ``ValueError`` when the forward holds the prompts (``prompts``: the pool can never hold the batch), else
    ``PagedCacheFullError``."""
    pool, block_size = group.pool, group.block_size
    if prompts:
        return ValueError(
            f"num_blocks={pool.num_blocks} is too small for the batch: its prompts need {needed} "
            f"blocks of {block_size} tokens in the {group.name} pool. Pass num_blocks >= {needed} "
            f"plus room for the new tokens (about batch_size * ceil(max_length / block_size) in all)"
        )
    return PagedCacheFullError(
        f"PagedCache is out of blocks: the next forward needs {needed} new blocks in the {group.name} "
        f"pool but only {pool.num_free_blocks} of num_blocks={pool.num_blocks} are free (block_size="
        f"{block_size}). Size the pool for the batch: about batch_size * ceil(max_length / "
        f"block_size) blocks, e.g. PagedCache(config, num_blocks=...) or cache_config={{'num_blocks': "
        f"...}}; or leave num_blocks and memory_budget unset to let it grow."
    )
