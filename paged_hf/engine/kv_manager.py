"""Block bookkeeping of the engine: per-sequence tables, prefix caching, swap to CPU.

The pools and tensors belong to an ``EngineCache`` (one pool per layer group). Prefix caching needs every
group to be full attention (a sliding-window layer drops the blocks a later hit would need); on hybrid models
it is off. Policy: a hit never covers a whole prompt (the last prompt token is always computed); blocks are
freed tail first, so a finished sequence's tail is evicted before its shared prefix.
"""

from __future__ import annotations

import torch

from ..block_pool import BlockPool, KVBlock
from ..block_table import BlockTable, num_blocks_for
from ..hashing import hash_block_tokens
from ..quant import make_storage
from ..storage import copy_blocks_between
from .engine_cache import EngineCache
from .request import Sequence


class KVCacheManager:
    def __init__(self, cache: EngineCache, enable_prefix_caching: bool, swap_space_bytes: int) -> None:
        self.cache = cache
        self.groups = cache.groups
        self.block_size = cache.cache_config.block_size
        self.prefix_caching = enable_prefix_caching and all(g.window is None for g in self.groups)
        per_block = sum(cache.block_bytes(idx) for g in self.groups for idx in g.layer_indices)
        self.num_cpu_blocks = int(swap_space_bytes // per_block) if per_block else 0
        self._cpu_pools: list[BlockPool] | None = None  # built on the first swap (see cpu_pools)
        self._cpu_storages: list[dict] | None = None
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self._step_registered: list[KVBlock] = []  # blocks registered for the step being scheduled / run

    @property
    def cpu_pools(self) -> list[BlockPool]:
        """One pool of swap blocks per group, built on first use: a tiny model's 4 GiB swap space is ~200k blocks,
        about a second of Python objects that an engine which never swaps should not pay for."""
        if self._cpu_pools is None:
            self._cpu_pools = [BlockPool(self.num_cpu_blocks, enable_caching=False) for _ in self.groups] \
                if self.num_cpu_blocks else []
        return self._cpu_pools

    # ------------------------------------------------------------------------------- capacity
    @property
    def num_free_blocks(self) -> int:
        return min(g.pool.num_free_blocks for g in self.groups)

    @property
    def num_total_blocks(self) -> int:
        return self.groups[0].pool.num_blocks

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Blocks the worst group needs to hold one sequence of ``num_tokens`` tokens (a window group holds only
        its window)."""
        full = num_blocks_for(num_tokens, self.block_size)
        return max(full if g.window is None else min(full, num_blocks_for(g.window, self.block_size) + 1)
                   for g in self.groups)

    def blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks the worst group needs to give ``seq`` room for ``num_new_tokens`` more tokens."""
        return max(self._window_adjusted(g, t, seq).num_new_blocks_needed(num_new_tokens)
                   for g, t in zip(self.groups, seq.tables))

    def _window_adjusted(self, group, table: BlockTable, seq: Sequence) -> BlockTable:
        if group.window is not None:
            table.free_blocks_before(seq.num_computed_tokens - (group.window - 1))
        return table

    # ------------------------------------------------------------------------------ admission
    def _extra_keys(self, seq: Sequence) -> tuple:
        return (self.cache.kv_format, seq.request.cache_salt)

    def update_hashes(self, seq: Sequence) -> None:
        """Extends ``seq.block_hashes`` to every full block of its tokens."""
        bs = self.block_size
        while len(seq.block_hashes) < len(seq.token_ids) // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs : (i + 1) * bs], self._extra_keys(seq)))

    def find_prefix_hits(self, seq: Sequence) -> list[KVBlock]:
        """Cached blocks covering the longest computed prefix of ``seq`` (never its last token)."""
        if not self.prefix_caching:
            return []
        self.update_hashes(seq)
        bs, pool = self.block_size, self.groups[0].pool
        max_blocks = (len(seq.token_ids) - 1) // bs
        hits = []
        for i, block_hash in enumerate(seq.block_hashes[:max_blocks]):
            block = pool.get_cached_block(block_hash, seq.token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def admission_blocks(self, seq: Sequence, hits: list[KVBlock], num_new_tokens: int) -> int:
        """Free blocks admitting ``seq`` takes: new blocks plus hits that now sit in the free queue."""
        new = num_blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size) - len(hits)
        return new + sum(1 for b in hits if b.ref_cnt == 0)

    def admit(self, seq: Sequence, hits: list[KVBlock]) -> None:
        seq.tables = [BlockTable(g.pool, self.block_size) for g in self.groups]
        if hits:
            seq.tables[0].append_cached_blocks(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_blocks = len(hits)
        if seq.index == 0 or seq.request.params.n == 1:
            self.prefix_queried_tokens += len(seq.token_ids)
            self.prefix_hit_tokens += seq.num_computed_tokens

    # ---------------------------------------------------------------------------------- steps
    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Per group ``(slots, copies)`` for the next ``num_new_tokens`` tokens; the caller checked capacity."""
        return [self._window_adjusted(g, t, seq).append_slots(num_new_tokens) for g, t in zip(self.groups, seq.tables)]

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Registers in the prefix cache the full blocks among the first ``num_tokens`` of ``seq``.

        Called when a step is scheduled, for the tokens it will have computed: a request admitted later in the same
        step can then hit blocks that this step's forward fills, which is correct because every layer stores the
        whole step's K/V before it attends. ``end_step(failed=True)`` unregisters them if the forward fails.
        """
        if not self.prefix_caching:
            return
        full = num_tokens // self.block_size
        if full <= seq.num_cached_blocks:
            return
        self.update_hashes(seq)
        bs, pool, table = self.block_size, self.groups[0].pool, seq.tables[0]
        for i in range(seq.num_cached_blocks, full):
            block = table.blocks[i]
            if block.block_hash is None:
                pool.cache_full_block(block, seq.block_hashes[i], seq.token_ids[i * bs : (i + 1) * bs])
                if block.block_hash is not None:
                    self._step_registered.append(block)
        seq.num_cached_blocks = full

    def end_step(self, failed: bool) -> None:
        """Closes a step: after a failed forward, the blocks registered for it hold no K/V: unregister them."""
        if failed:
            for block in self._step_registered:
                if block.block_hash is not None:
                    self.groups[0].pool.uncache_block(block)
        self._step_registered = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (copy-on-write of the partial tail later)."""
        child.tables = [t.fork() for t in parent.tables]
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_blocks = parent.num_cached_blocks
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        for table in seq.tables:
            table.free()
        seq.tables = []
        if seq.swapped_blocks:
            for pool, blocks in zip(self.cpu_pools, seq.swapped_blocks):
                pool.free_blocks(reversed(blocks[2]))
        seq.swapped_blocks = []

    # ----------------------------------------------------------------------------------- swap
    def can_swap_out(self, seq: Sequence) -> bool:
        if not self.num_cpu_blocks:
            return False
        return all(sum(b is not None for b in t.blocks) <= p.num_free_blocks for t, p in zip(seq.tables, self.cpu_pools))

    def _cpu_storage(self, group_index: int, layer_idx: int):
        if self._cpu_storages is None:
            self._cpu_storages = []
            for group in self.groups:
                storages = {}
                for idx, dev in group.storages.items():
                    _, block_size, heads, _ = dev.key_cache.shape
                    storages[idx] = make_storage(self.cache.kv_format, self.num_cpu_blocks, block_size, heads,
                                                 self.cache.head_dim, dev.dtype, "cpu")
                self._cpu_storages.append(storages)
        return self._cpu_storages[group_index][layer_idx]

    def swap_out(self, seq: Sequence) -> None:
        """Moves ``seq``'s blocks to CPU and frees them on the device."""
        seq.swapped_blocks = []
        for gi, (group, table, cpu_pool) in enumerate(zip(self.groups, seq.tables, self.cpu_pools)):
            held = [b for b in table.blocks if b is not None]
            cpu_blocks = cpu_pool.get_new_blocks(len(held))
            src = torch.tensor([b.block_id for b in held], dtype=torch.long)
            dst = torch.tensor([b.block_id for b in cpu_blocks], dtype=torch.long)
            for idx, storage in group.storages.items():
                copy_blocks_between(storage, self._cpu_storage(gi, idx), src, dst)
            seq.swapped_blocks.append((table.num_tokens, len(table.blocks) - len(held), cpu_blocks))
            table.free()
        seq.tables = []

    def swap_in_blocks(self, seq: Sequence) -> int:
        return max(len(blocks) for _, _, blocks in seq.swapped_blocks)

    def swap_in(self, seq: Sequence) -> None:
        tables = []
        for gi, (group, (num_tokens, num_freed, cpu_blocks)) in enumerate(zip(self.groups, seq.swapped_blocks)):
            dev_blocks = group.pool.get_new_blocks(len(cpu_blocks))
            src = torch.tensor([b.block_id for b in cpu_blocks], dtype=torch.long)
            dst = torch.tensor([b.block_id for b in dev_blocks], dtype=torch.long)
            for idx, storage in group.storages.items():
                copy_blocks_between(self._cpu_storage(gi, idx), storage, src, dst)
            table = BlockTable(group.pool, self.block_size)
            table.restore(num_tokens, num_freed, dev_blocks)
            tables.append(table)
            self.cpu_pools[gi].free_blocks(reversed(cpu_blocks))
        seq.tables = tables
        seq.swapped_blocks = []
        seq.num_cached_blocks = 0  # the restored blocks are new copies: register them again when full

    def check_invariants(self, live: list[Sequence]) -> None:
        """Pool invariants, and ref counts equal to the tables of ``live`` sequences holding each block."""
        for gi, group in enumerate(self.groups):
            group.pool.check_invariants()
            refs: dict[int, int] = {}
            for seq in live:
                if seq.tables:
                    for block in seq.tables[gi].blocks:
                        if block is not None:
                            refs[block.block_id] = refs.get(block.block_id, 0) + 1
            for block in group.pool.blocks:
                assert block.ref_cnt == refs.get(block.block_id, 0), (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs.get(block.block_id, 0)} tables"
                )
        for pool in self._cpu_pools or []:
            pool.check_invariants()
