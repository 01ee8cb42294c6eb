"""The host tier of the prefix cache: the bytes of cached blocks evicted from a device pool, kept in host memory.

When a device pool evicts a cached block (hashed, unreferenced, taken for new use), its bytes in every layer of its
group (every pool tensor of the format: codes and scales as stored) are copied to a host block (``CopyKind.OFFLOAD``,
recorded in the copy log at the eviction, so it runs before any copy or forward that writes the reused block). The
host blocks are keyed by (group, block hash) with the block's token ids, bounded (``num_blocks`` per group, like the
swap space) and evicted least recently used first. A prefix lookup that misses the device pool asks here; a hit is
copied back into a new device block (``CopyKind.LOAD``) before the forward and registered in the pool again.

The host storages are those of a ``SwapSpace`` of the same size (made and grown by the copies as they are used), so a
tensor-parallel follower, which replays the leader's copies without its bookkeeping, grows its own alike. On CUDA
they are pinned and the copies run asynchronously on a side stream (``copies.SideStream``, made at the first copy;
``side_factory`` makes it, a test may give a fake); before a host storage grows the host waits for that stream.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..block_pool import KVBlock
from ..storage import KVStorage
from .copies import CopyKind, CopyLog, SideStream, cuda_side_stream
from .swap import SwapSpace


class HostTier:
    """``num_blocks`` host blocks per group for evicted cached blocks; their copies go to ``log``."""

    side_factory = staticmethod(cuda_side_stream)  # device -> the side stream of the copies, or None (inline copies)

    def __init__(self, num_blocks: int, num_groups: int, kv_format: str, log: CopyLog) -> None:
        self.num_blocks = num_blocks
        self.space = SwapSpace(num_blocks, num_groups, kv_format, pin_memory=True)
        self.log = log
        self._side: SideStream | None = None
        self._side_made = False
        # per group: block hash -> (host block, token ids), least recently used first
        self._entries: list[OrderedDict[int, tuple[KVBlock, tuple[int, ...]]]] = [OrderedDict()
                                                                                  for _ in range(num_groups)]
        self._pinned: set[tuple[int, int]] = set()  # entries an admission is copying in: not evictable meanwhile
        self.num_offloaded = 0  # blocks copied out of a device pool
        self.num_loaded = 0  # blocks copied back in (host-tier hits)

    @classmethod
    def sized(cls, num_bytes: float, block_id_bytes: int, groups, kv_format: str, log: CopyLog) -> HostTier | None:
        """A host tier of ``num_bytes`` (blocks of ``block_id_bytes``, every layer), or None when none fits."""
        num_blocks = int(num_bytes // block_id_bytes)
        return cls(num_blocks, len(groups), kv_format, log) if num_blocks > 0 else None

    @property
    def num_used_blocks(self) -> int:
        return sum(len(entries) for entries in self._entries)

    def evict_hook(self, group: int):
        """The callback a device pool of ``group`` calls with each cached block it evicts (``BlockPool.on_evict``)."""
        return lambda block: self.offload(group, block)

    def offload(self, group: int, block: KVBlock) -> None:
        """Keeps the bytes of ``block`` (cached, being evicted from the device pool) under its hash; an entry already
        there is only refreshed (same tokens, same bytes). With every host block pinned the block is dropped."""
        entries = self._entries[group]
        if block.block_hash in entries:
            entries.move_to_end(block.block_hash)
            return
        pool = self.space.pools[group]
        if pool.num_free_blocks == 0 and not self._evict_one(group):
            return
        host_block = pool.get_new_blocks(1)[0]
        self.log.record(group, [(block.block_id, host_block.block_id)], CopyKind.OFFLOAD)
        entries[block.block_hash] = (host_block, block.token_ids)
        self.num_offloaded += 1

    def _evict_one(self, group: int) -> bool:
        """Frees the least recently used unpinned host block of ``group``; False if there is none."""
        entries = self._entries[group]
        for block_hash in entries:
            if (group, block_hash) not in self._pinned:
                host_block, _ = entries.pop(block_hash)
                self.space.pools[group].free_blocks([host_block])
                return True
        return False

    def contains(self, group: int, block_hash: int, token_ids) -> bool:
        """Whether the host tier holds the block of ``block_hash`` with these ``token_ids`` (a collision is a miss)."""
        entry = self._entries[group].get(block_hash)
        return entry is not None and entry[1] == tuple(token_ids)

    def pin(self, keys: list[tuple[int, int]]) -> None:
        """Keeps ``keys`` (group, hash) from eviction while an admission allocates the device blocks they go to."""
        self._pinned.update(keys)

    def load(self, group: int, pairs: list[tuple[int, int]]) -> None:
        """Records the copies of the host blocks of ``pairs`` ((block hash, device block id)) into their device
        blocks, unpins them and marks them recently used."""
        copies, entries = [], self._entries[group]
        for block_hash, block_id in pairs:
            self._pinned.discard((group, block_hash))
            entries.move_to_end(block_hash)
            copies.append((entries[block_hash][0].block_id, block_id))
        if copies:
            self.log.record(group, copies, CopyKind.LOAD)
            self.num_loaded += len(copies)

    # the ``HostStorages`` protocol of ``copies.apply_copy``
    def side_stream(self, device: torch.device) -> SideStream | None:
        """The stream the copies to and from ``device`` run on (the pool's device: one per tier), or None."""
        if not self._side_made:
            self._side, self._side_made = self.side_factory(device), True
        return self._side

    def storage_to_write(self, group: int, layer_idx: int, device_storage: KVStorage, num_ids: int,
                         tails: bool) -> KVStorage:
        wait = self._side.synchronize if self._side is not None else None  # a grow reads the storage on the CPU
        return self.space.storage_to_write(group, layer_idx, device_storage, num_ids, tails, before_grow=wait)

    def storage(self, group: int, layer_idx: int) -> KVStorage:
        return self.space.storage(group, layer_idx)

    @property
    def nbytes(self) -> int:
        """Bytes of the host storages made so far (never more than ``num_blocks`` blocks per group)."""
        return self.space.nbytes

    def check_invariants(self) -> None:
        """Every entry holds one host block, each host block in use is one entry's, and nothing stays pinned."""
        self.space.check_invariants()
        used = sum(p.num_used_blocks for p in self.space.pools)
        if used != self.num_used_blocks or self._pinned:
            raise AssertionError(f"host tier: {used} host blocks in use for {self.num_used_blocks} entries, "
                                 f"{len(self._pinned)} pinned")
