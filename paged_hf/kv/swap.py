"""The swap space: CPU blocks (one pool per layer group) and CPU tail slots that hold preempted sequences.

The pools are bookkeeping only until a copy needs storage: the CPU storages are made and grown by the swap-out
copies themselves (``storage_to_write``), by at least a quarter at a time and never past ``num_blocks``. So memory
follows use, not ``swap_space``, and a tensor-parallel follower, which runs the leader's copies without its pools,
grows its storages alike.
"""

from __future__ import annotations

from collections.abc import Callable

from ..block_pool import BlockPool
from ..quant import make_storage
from ..storage import KVStorage
from .copies import CopyKind, CopyLog
from .layer_groups import LayerGroup
from .sequence import SequenceKV, SwappedGroup


class SwapSpace:
    """``num_blocks`` CPU blocks per group (0: no swap) in ``kv_format``; each layer's CPU storage takes the heads
    and head size of its device storage."""

    def __init__(self, num_blocks: int, num_groups: int, kv_format: str, pin_memory: bool = False) -> None:
        self.num_blocks = num_blocks
        self.pin_memory = pin_memory  # CPU storages in pinned memory where the device is CUDA (async copies)
        self.num_groups = num_groups
        self.kv_format = kv_format
        self._pools: list[BlockPool] | None = None
        self._storages: list[dict[int, KVStorage]] | None = None
        self._free_tails: list[int] = []  # CPU tail slots handed back
        self._num_tails = 0

    @property
    def pools(self) -> list[BlockPool]:
        """One pool of swap blocks per group (made on first use; none without swap)."""
        if self._pools is None:
            self._pools = [BlockPool(self.num_blocks, enable_caching=False) for _ in range(self.num_groups)] \
                if self.num_blocks else []
        return self._pools

    def can_hold(self, seq: SequenceKV) -> bool:
        """Whether every group has a CPU block for each device block ``seq`` holds."""
        if not self.num_blocks:
            return False
        return all(sum(b is not None for b in t.blocks) <= p.num_free_blocks for t, p in zip(seq.tables, self.pools))

    def move_out(self, seq: SequenceKV, row: int | None, log: CopyLog) -> list[SwappedGroup]:
        """Takes CPU blocks (and, ``row`` given, a CPU tail slot for that tail row) for everything ``seq`` holds and
        records the copies; the caller then frees the device blocks."""
        cpu_tail = self._take_tail() if row is not None else None
        swapped = []
        for g, (table, pool) in enumerate(zip(seq.tables, self.pools)):
            held = [b for b in table.blocks if b is not None]
            cpu_blocks = pool.get_new_blocks(len(held))
            log.record(g, [(b.block_id, c.block_id) for b, c in zip(held, cpu_blocks)], CopyKind.SWAP_OUT)
            if cpu_tail is not None:
                log.record(g, [(row, cpu_tail)], CopyKind.SWAP_OUT_TAIL)
            swapped.append(SwappedGroup(table.num_tokens, table.num_freed, cpu_blocks, cpu_tail))
        return swapped

    def num_blocks_to_move_in(self, seq: SequenceKV) -> int:
        """Device blocks the worst group needs to bring swapped-out ``seq`` back."""
        return max(len(s.cpu_blocks) for s in seq.swapped)

    def move_in(self, seq: SequenceKV, groups: list[LayerGroup], log: CopyLog) -> None:
        """Refills ``seq``'s empty tables (row taken) with new device blocks, records the copies and releases the CPU
        side."""
        for g, (group, table, swapped) in enumerate(zip(groups, seq.tables, seq.swapped)):
            dev_blocks = group.pool.get_new_blocks(len(swapped.cpu_blocks))
            log.record(g, [(c.block_id, d.block_id) for c, d in zip(swapped.cpu_blocks, dev_blocks)],
                       CopyKind.SWAP_IN)
            table.restore(swapped.num_tokens, swapped.num_freed, dev_blocks)
            if swapped.cpu_tail is not None:
                log.record(g, [(swapped.cpu_tail, seq.row)], CopyKind.SWAP_IN_TAIL)
        self.release(seq.swapped)

    def release(self, swapped: list[SwappedGroup]) -> None:
        """Hands back the CPU blocks and tail slot of a swapped-out sequence (swapped in, or freed)."""
        for pool, group in zip(self.pools, swapped):
            pool.free_blocks(reversed(group.cpu_blocks))
        if swapped[0].cpu_tail is not None:
            self._free_tails.append(swapped[0].cpu_tail)

    def _take_tail(self) -> int:
        """A CPU tail slot (the copies that use it give every group's CPU storages tail rows up to it)."""
        if self._free_tails:
            return self._free_tails.pop()
        self._num_tails += 1
        return self._num_tails - 1

    def storage_to_write(self, group: int, layer_idx: int, device_storage: KVStorage, num_ids: int,
                         tails: bool, before_grow: Callable[[], None] | None = None) -> KVStorage:
        """Layer ``layer_idx``'s CPU storage of ``group``, made on first use and grown (by a quarter at least) to
        cover ``num_ids`` block ids (``tails``: tail rows); ``before_grow`` runs before an existing storage grows.
        With ``pin_memory`` and a CUDA ``device_storage`` its tensors are pinned."""
        if self._storages is None:
            self._storages = [{} for _ in range(self.num_groups)]
        storages = self._storages[group]
        storage = storages.get(layer_idx)
        changed = storage is None  # made or grown: tensors that may not be pinned yet
        if changed:
            heads, head_dim = device_storage.head_shape
            storage = storages[layer_idx] = make_storage(self.kv_format, 0, device_storage.block_size, heads, head_dim,
                                                         device_storage.dtype, "cpu", device_storage.shared_values)
        if tails:  # swap only (the host tier holds full blocks)
            storage.ensure_tail_rows(num_ids)
            changed = True
        elif storage.num_blocks < num_ids:
            if before_grow is not None and storage.num_blocks:
                before_grow()
            storage.grow(min(self.num_blocks, max(num_ids, storage.num_blocks + -(-storage.num_blocks // 4)))
                         - storage.num_blocks)
            changed = True
        if changed and self.pin_memory and device_storage.device.type == "cuda":
            _pin(storage)
        return storage

    def storage(self, group: int, layer_idx: int) -> KVStorage:
        """Layer ``layer_idx``'s CPU storage of ``group`` (a swap-in reads what a swap-out wrote)."""
        return self._storages[group][layer_idx]

    @property
    def nbytes(self) -> int:
        """Bytes of the CPU storages made so far (pool tensors and tail rows)."""
        return sum(s.nbytes + s.tail_nbytes for group in self._storages or [] for s in group.values())

    def check_invariants(self) -> None:
        for pool in self._pools or []:
            pool.check_invariants()


def _pin(storage: KVStorage) -> None:
    """Moves ``storage``'s CPU tensors (blocks and tail rows) to pinned memory, those not there yet (made or grown)."""
    for name, tensor in {**storage.tensors(), **storage.tail_tensors()}.items():
        if not tensor.is_pinned():
            setattr(storage, name, tensor.pin_memory())
