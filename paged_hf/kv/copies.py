"""Block copies: what kinds there are, the log that records them, and how one runs.

A copy is recorded when the blocks it fills are allocated (copy-on-write of a shared tail, swap out, swap in, a
fork's or a rollback's tail row, a cached block evicted to the host tier or loaded back from it) and runs before
the forward that needs it, in recorded order: every tensor-parallel rank runs the same list. Each ``CopyKind``
names where its sources and its destinations live, so ``src`` and ``dst`` always mean the same: ``dst[i] <- src[i]``,
in every layer of the copy's group.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from ..storage import KVStorage, copy_blocks_between


class Place(Enum):
    """Where a copy's ids point: pool blocks or tail rows (formats with a tail), on the device or in swap (CPU)."""

    DEVICE_BLOCKS = ("block", False)
    CPU_BLOCKS = ("block", True)
    DEVICE_TAILS = ("tail", False)
    CPU_TAILS = ("tail", True)
    HOST_BLOCKS = ("host", True)  # the prefix cache's host tier (``kv.host_tier``)

    def __init__(self, what: str, on_cpu: bool) -> None:
        self.tails = what == "tail"
        self.on_cpu = on_cpu


class CopyKind(Enum):
    """A kind of copy: (where ``src`` ids point, where ``dst`` ids point)."""

    COPY_ON_WRITE = (Place.DEVICE_BLOCKS, Place.DEVICE_BLOCKS)  # a shared partial tail block, before a write
    SWAP_OUT = (Place.DEVICE_BLOCKS, Place.CPU_BLOCKS)  # a preempted sequence's blocks to swap
    SWAP_IN = (Place.CPU_BLOCKS, Place.DEVICE_BLOCKS)  # back into new device blocks
    FORK_TAIL = (Place.DEVICE_TAILS, Place.DEVICE_TAILS)  # a fork's tail row starts as its parent's
    SWAP_OUT_TAIL = (Place.DEVICE_TAILS, Place.CPU_TAILS)  # a swapped sequence's tail row to a CPU tail slot
    SWAP_IN_TAIL = (Place.CPU_TAILS, Place.DEVICE_TAILS)  # and back into its new row
    ROLLBACK_TO_TAIL = (Place.DEVICE_BLOCKS, Place.DEVICE_TAILS)  # a refilled block, dequantized into the row
    OFFLOAD = (Place.DEVICE_BLOCKS, Place.HOST_BLOCKS)  # an evicted cached block to the host tier
    LOAD = (Place.HOST_BLOCKS, Place.DEVICE_BLOCKS)  # a host-tier hit back into a new device block

    def __init__(self, src: Place, dst: Place) -> None:
        self.src = src
        self.dst = dst


@dataclass(frozen=True)
class BlockCopy:
    """``dst[i] <- src[i]`` in every layer of group ``group``; ``kind`` says what the ids point at."""

    group: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    kind: CopyKind


class CopyLog:
    """The copies recorded since the last ``take``, in order."""

    def __init__(self) -> None:
        self._pending: list[BlockCopy] = []

    def record(self, group: int, pairs: list[tuple[int, int]], kind: CopyKind) -> None:
        """Records ``(src, dst)`` pairs of one kind in ``group``. Merges them into the previous copy when that keeps
        its in-order meaning: a batched copy reads every source before writing, so no new source may be an earlier
        destination, no new destination an earlier source or destination (e.g. a row freed by one fork and taken
        by the next)."""
        last = self._pending[-1] if self._pending else None
        src, dst = tuple(s for s, _ in pairs), tuple(d for _, d in pairs)
        if last is not None and last.group == group and last.kind is kind and not (set(src) & set(last.dst)) \
                and not (set(dst) & set(last.src)) and not (set(dst) & set(last.dst)):
            self._pending[-1] = BlockCopy(group, last.src + src, last.dst + dst, kind)
        else:
            self._pending.append(BlockCopy(group, src, dst, kind))

    def take(self) -> list[BlockCopy]:
        """The recorded copies, in order; the log starts empty again."""
        copies, self._pending = self._pending, []
        return copies


class SwapStorages(Protocol):
    """The CPU side of swap copies (``kv.swap.SwapSpace``)."""

    def storage_to_write(self, group: int, layer_idx: int, device_storage: KVStorage, num_ids: int,
                         tails: bool) -> KVStorage: ...

    def storage(self, group: int, layer_idx: int) -> KVStorage: ...


def apply_copy(copy: BlockCopy, storages: dict[int, KVStorage], swap: SwapStorages,
               host: SwapStorages | None = None) -> None:
    """Runs ``copy`` in every layer of ``storages`` (its group's; the id tensors are made once); the CPU side is
    ``host`` (the host tier) for ``OFFLOAD`` / ``LOAD``, else ``swap``."""
    if not storages:
        return
    kind, device = copy.kind, next(iter(storages.values())).device
    if Place.HOST_BLOCKS in (kind.src, kind.dst):
        swap = host
    src = torch.tensor(copy.src, dtype=torch.long, device="cpu" if kind.src.on_cpu else device)
    dst = torch.tensor(copy.dst, dtype=torch.long, device="cpu" if kind.dst.on_cpu else device)
    for idx, storage in storages.items():
        if kind is CopyKind.COPY_ON_WRITE:
            storage.copy_blocks(src, dst)
        elif kind is CopyKind.FORK_TAIL:
            storage.copy_tails(src, dst)
        elif kind is CopyKind.ROLLBACK_TO_TAIL:
            storage.block_to_tail(src, dst)
        elif kind.dst.on_cpu:  # swap out: the CPU side grows to cover the destinations
            cpu = swap.storage_to_write(copy.group, idx, storage, max(copy.dst) + 1, kind.dst.tails)
            copy_blocks_between(storage, cpu, src, dst, tails=kind.dst.tails)
        else:  # swap in
            copy_blocks_between(swap.storage(copy.group, idx), storage, src, dst, tails=kind.src.tails)
