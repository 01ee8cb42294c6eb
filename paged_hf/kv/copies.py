"""Block copies: what kinds there are, the log that records them, and how one runs.

A copy is recorded when the blocks it fills are allocated (copy-on-write of a shared tail, swap out, swap in, a
fork's or a rollback's tail row, a cached block evicted to the host tier or loaded back from it) and runs before
the forward that needs it, in recorded order: every tensor-parallel rank runs the same list. Each ``CopyKind``
names where its sources and its destinations live, so ``src`` and ``dst`` always mean the same: ``dst[i] <- src[i]``,
in every layer of the copy's group.

On CUDA the host tier's copies (``OFFLOAD`` / ``LOAD``) are asynchronous: its host blocks live in pinned memory and
the transfers run on a ``SideStream``. Every access to a device block stays on the compute stream (the current one)
and every access to a host block on the side stream, each in recorded order, so the two streams meet only at the
staging copies: an offload gathers its device blocks on the compute stream (a later write of a reused block is
queued after that read) and the side stream waits for the gather before the device-to-host transfer; a load's
host-to-device transfer fills a staging tensor on the side stream and the compute stream waits for it before the
scatter into the device blocks (so the next forward reads the loaded bytes). The host thread waits for neither,
except before a host storage grows (the grow copies it on the CPU). Everywhere else copies run inline.
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


class HostStorages(SwapStorages, Protocol):
    """The CPU side of the host tier's copies (``kv.host_tier.HostTier``): also the side stream they run on."""

    def side_stream(self, device: torch.device) -> SideStream | None: ...


class SideStream:
    """A CUDA stream beside the compute stream (the current stream of ``device`` where a copy is issued).

    ``waits_for_compute`` / ``compute_waits``: one stream waits for the work queued so far on the other (an event,
    on the device: the host does not wait). ``lend``: a tensor made on one stream is used by the other, so the
    caching allocator keeps its memory until that use is done."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def waits_for_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def compute_waits(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def active(self):
        """A context in which kernels and copies are queued on the side stream."""
        return torch.cuda.stream(self.stream)

    def lend(self, tensor: torch.Tensor, to_side: bool) -> None:
        tensor.record_stream(self.stream if to_side else torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        """The host waits for every copy queued on the side stream."""
        self.stream.synchronize()


def cuda_side_stream(device: torch.device) -> SideStream | None:
    """A side stream for copies between ``device`` and host memory; None off CUDA (copies run inline there)."""
    return SideStream(device) if device.type == "cuda" else None


def apply_copy(copy: BlockCopy, storages: dict[int, KVStorage], swap: SwapStorages,
               host: HostStorages | None = None) -> None:
    """Runs ``copy`` in every layer of ``storages`` (its group's; the id tensors are made once); the CPU side is
    ``host`` (the host tier) for ``OFFLOAD`` / ``LOAD``, else ``swap``."""
    if not storages:
        return
    kind, device = copy.kind, next(iter(storages.values())).device
    if Place.HOST_BLOCKS in (kind.src, kind.dst):
        swap = host
        side = host.side_stream(device)
        if side is not None:
            (_offload_on_side if kind is CopyKind.OFFLOAD else _load_on_side)(copy, storages, host, side)
            return
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


def id_runs(ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(first id, first position in ids, length)`` of each run of consecutive ids: one slice copy moves a run
    between host memory and a staging tensor."""
    runs: list[tuple[int, int, int]] = []
    for at, block_id in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((block_id, at, 1))
    return runs


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or its bytes for float8 (which index ops do not take)."""
    return tensor.view(torch.uint8) if tensor.dtype.is_floating_point and tensor.element_size() == 1 else tensor


def _device_ids(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``ids`` on ``device`` without a host wait (a blocking copy would wait for the whole compute stream)."""
    ids = torch.tensor(ids, dtype=torch.long)
    return ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids


def _offload_on_side(copy: BlockCopy, storages: dict[int, KVStorage], host: HostStorages, side: SideStream) -> None:
    """``OFFLOAD``: gathers the device blocks on the compute stream, then moves them into the host blocks on
    ``side``. A staging tensor per pool tensor: ``[len(src), *block shape]``."""
    device = next(iter(storages.values())).device
    src = _device_ids(copy.src, device)
    staged = {idx: {name: _raw(t).index_select(0, src) for name, t in storage.tensors().items()}
              for idx, storage in storages.items()}
    side.waits_for_compute()
    runs = id_runs(copy.dst)
    with side.active():
        for idx, storage in storages.items():
            targets = host.storage_to_write(copy.group, idx, storage, max(copy.dst) + 1, False).tensors()
            for name, part in staged[idx].items():
                side.lend(part, to_side=True)
                target = _raw(targets[name])
                for first, at, n in runs:
                    target[first : first + n].copy_(part[at : at + n], non_blocking=True)


def _load_on_side(copy: BlockCopy, storages: dict[int, KVStorage], host: HostStorages, side: SideStream) -> None:
    """``LOAD``: moves the host blocks into staging tensors on ``side``, then scatters them into the device blocks
    on the compute stream once it has waited for them."""
    device = next(iter(storages.values())).device
    runs, staged = id_runs(copy.src), {}
    with side.active():
        for idx in storages:
            for name, source in host.storage(copy.group, idx).tensors().items():
                source = _raw(source)
                part = torch.empty((len(copy.src), *source.shape[1:]), dtype=source.dtype, device=device)
                for first, at, n in runs:
                    part[at : at + n].copy_(source[first : first + n], non_blocking=True)
                staged[idx, name] = part
    side.compute_waits()
    dst = _device_ids(copy.dst, device)
    for idx, storage in storages.items():
        for name, target in storage.tensors().items():
            part = staged[idx, name]
            side.lend(part, to_side=False)
            _raw(target).index_copy_(0, dst, part)
