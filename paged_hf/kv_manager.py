"""One KV allocator for ``generate`` and the engine: layer groups, block pools and tables, sliding windows,
copy-on-write, the prefix cache, swap to CPU and the invariant audit.

Layers that read the same tokens share block tables: one *group* for the full-attention layers and one per
sliding window, each with its own pool of ``num_blocks`` blocks. A ``SequenceKV`` is what one sequence holds: a
``BlockTable`` per group (the same positions in every group) and one row of each group's ``BlockTableRows``.
``PagedCache`` keeps one per batch row, the engine one per sequence that holds blocks.

Block copies (copy-on-write of a shared tail, swap out, swap in) are recorded as ``BlockCopy`` operations when
the blocks are allocated and applied by ``apply_copies`` before the forward that needs them, in recorded order
(every rank applies the same list under tensor parallelism).

Formats with a full-precision tail (int4): each sequence's newest, partial block lives in the tail row of its
block-table row (``SequenceKV.row``) in every layer, and the pool block holds codes only once it is full. The tail
row follows the sequence: a fork copies it to the child's row, swap moves it to a CPU tail slot and back, and a
rollback (``truncate``) into a block that was full dequantizes that block into the row (policy: the kept tokens
keep the values the attention already read; the block is quantized again when it refills). Only full blocks are
shared (forks share the partial block too, but copy it on write) or cached, so prefix hits stay exact.

Prefix caching works on full-attention models only (a sliding window drops the blocks a later hit would need).
Policy: blocks are freed tail first, so a finished sequence's tail is evicted before its shared prefix; a hit
never covers a whole prompt (its last token is always computed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from .block_pool import BlockPool, KVBlock
from .block_table import BlockTable, num_blocks_for
from .block_table_rows import BlockTableRows
from .hashing import extend_block_hashes
from .kv_stats import KVCacheStats
from .kernels.kv_format import KV_FORMATS
from .quant import check_kv_format, layer_block_bytes, make_storage, tail_bytes_per_row
from .storage import KVStorage, copy_blocks_between

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
STATE_SPACE_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")
GROWTH_DIVISOR = 4  # a growable pool grows by at least 1 / GROWTH_DIVISOR of its size


class PagedCacheFullError(RuntimeError):
    """The fixed-size pool has too few free blocks for the next forward; nothing was allocated."""


@dataclass
class LayerGroup:
    """Layers that read the same tokens through the same block tables (one pool, one table per sequence)."""

    index: int
    window: int | None  # None: full attention
    block_size: int
    layer_indices: list[int] = field(default_factory=list)
    pool: BlockPool | None = None
    storages: dict[int, KVStorage] = field(default_factory=dict)
    rows: BlockTableRows = field(default_factory=BlockTableRows)

    @property
    def name(self) -> str:
        return "full_attention" if self.window is None else f"sliding_attention(window={self.window})"


@dataclass
class SwappedGroup:
    """One group of a swapped-out sequence: its length, its window-freed prefix and the CPU blocks holding the rest."""

    num_tokens: int
    num_freed: int
    cpu_blocks: list[KVBlock]
    cpu_tail: int | None = None  # the CPU tail slot holding the sequence's tail row (formats with a tail)


class SequenceKV:
    """The KV one sequence holds: a ``BlockTable`` per group (empty while waiting or swapped) and a table row."""

    __slots__ = ("tables", "row", "block_hashes", "num_cached_blocks", "swapped")

    def __init__(self, tables: list[BlockTable], row: int) -> None:
        self.tables = tables
        self.row = row  # -1 while the sequence holds no device blocks
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of its tokens (prefix caching)
        self.num_cached_blocks = 0  # leading full blocks registered in the prefix cache
        self.swapped: list[SwappedGroup] | None = None

    @property
    def num_tokens(self) -> int:
        """Positions with a slot (the same in every group)."""
        return self.tables[0].num_tokens if self.tables else 0


@dataclass(frozen=True)
class BlockCopy:
    """``dst[i] <- src[i]`` for whole blocks of every layer of group ``group``.

    ``where``: "device" (copy-on-write inside the pool), "to_cpu" (swap out: device ids -> CPU ids) or
    "to_device" (swap in: CPU ids -> device ids). Tail rows (formats with a tail): "tail" (device row -> row, a
    fork), "tail_to_cpu" / "tail_to_device" (row -> CPU tail slot -> row, swap), "block_to_tail" (block id -> row:
    the block dequantized into the row, a rollback).
    """

    group: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    where: str


class KVManager:
    """The pools, storages and block tables of one model's KV cache.

    Args:
        text_config: the decoder config (layer types, sliding windows, heads).
        block_size, kv_cache_dtype: as ``CacheConfig``.
        num_blocks: blocks per group; None makes a growable pool (``reserve`` grows it, like ``DynamicCache``).
        enable_prefix_caching: hash full blocks and reuse them (full-attention models only; else it stays off).
        swap_space_bytes: CPU memory for swapped-out blocks (0: no swap).
        num_kv_heads: KV heads this process stores (tensor parallelism: its share); None takes the config's.
    """

    def __init__(self, text_config, block_size: int = 16, kv_cache_dtype: str = "auto", num_blocks: int | None = None,
                 enable_prefix_caching: bool = False, swap_space_bytes: int = 0,
                 num_kv_heads: int | None = None) -> None:
        check_supported(text_config)
        self.text_config = text_config
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.head_dim = head_dim_of(text_config)
        self.kv_format = check_kv_format(kv_cache_dtype, self.head_dim)
        self.num_kv_heads = num_kv_heads or getattr(text_config, "num_key_value_heads", None) \
            or text_config.num_attention_heads
        self.has_tail = KV_FORMATS[self.kv_format].tail
        self.groups = _layer_groups(text_config, block_size)
        self.group_of = {idx: group for group in self.groups for idx in group.layer_indices}
        self.growable = num_blocks is None
        for group in self.groups:  # a growable pool starts empty: ``reserve`` sizes it for the first forward
            group.pool = BlockPool(num_blocks or 0, enable_caching=enable_prefix_caching and num_blocks is not None)
        self.prefix_caching = enable_prefix_caching and all(g.window is None for g in self.groups)
        self._free_rows: list[int] = []
        self._num_rows = 0
        self._live: dict[int, SequenceKV] = {}  # id -> every sequence made and not freed
        self._pending: list[BlockCopy] = []
        self._step_registered: list[KVBlock] = []  # blocks hashed for the step being scheduled / run
        self.num_cpu_blocks = int(swap_space_bytes // self.bytes_per_block()) if swap_space_bytes else 0
        self._cpu_pools: list[BlockPool] | None = None
        self._cpu_storages: list[dict[int, KVStorage]] | None = None
        self._cpu_tail_free: list[int] = []  # CPU tail slots handed back (swap of a tail format)
        self._num_cpu_tails = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # ------------------------------------------------------------------------------------------ sizing
    def layer_block_bytes(self, dtype: torch.dtype | None = None, num_kv_heads: int | None = None) -> int:
        """Bytes of one block of one layer (K and V, scales and zeros included)."""
        return layer_block_bytes(self.kv_format, self.block_size, num_kv_heads or self.num_kv_heads, self.head_dim,
                               dtype or config_dtype(self.text_config))

    def bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block id in every layer (what one more block per group costs)."""
        return block_id_bytes(self.text_config, self.block_size, self.kv_cache_dtype, self.num_kv_heads, dtype)

    def tail_bytes_per_row(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one sequence row of the tail pools in every layer (0 for formats without a tail)."""
        return tail_bytes_per_row(self.kv_format, self.block_size, self.num_kv_heads, self.head_dim,
                                  dtype or config_dtype(self.text_config)) * len(self.group_of)

    @property
    def num_total_blocks(self) -> int:
        return self.groups[0].pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks every group can still allocate."""
        return min(g.pool.num_free_blocks for g in self.groups)

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Blocks the worst group needs for one sequence of ``num_tokens`` tokens (a window group: its window)."""
        full = num_blocks_for(num_tokens, self.block_size)
        return max(full if g.window is None else min(full, num_blocks_for(g.window, self.block_size) + 1)
                   for g in self.groups)

    # ----------------------------------------------------------------------------------------- storage
    def allocate_layer(self, layer_idx: int, num_kv_heads: int, dtype: torch.dtype, device) -> KVStorage:
        """Makes layer ``layer_idx``'s pool tensors (sized like its group's pool). The first layer checks that the
        whole pool fits the device, before anything is allocated."""
        group = self.group_of[layer_idx]
        if not any(g.storages for g in self.groups):
            self._check_fits(dtype, device, num_kv_heads)
        storage = make_storage(self.kv_format, group.pool.num_blocks, self.block_size, num_kv_heads, self.head_dim,
                               dtype, device)
        if self.has_tail:
            storage.ensure_tail_rows(self._num_rows)
        group.storages[layer_idx] = storage
        return storage

    def allocate_all(self, dtype: torch.dtype, device) -> None:
        """Makes every layer's pool tensors now (the engine's pool is sized once)."""
        for idx in sorted(self.group_of):
            self.allocate_layer(idx, self.num_kv_heads, dtype, device)

    def _check_fits(self, dtype, device, num_kv_heads: int) -> None:
        self.check_fits_on([torch.device(device)], dtype, num_kv_heads)

    def check_fits_on(self, devices: list[torch.device], dtype=None, num_kv_heads: int | None = None) -> None:
        """ValueError unless the fixed pool fits the device among ``devices`` with the most memory available.
        ``PagedCache`` asks this at construction over every device of the machine (the model's is not known yet),
        so a pool no device can hold fails there; the first layer asks again for the device it lands on."""
        if self.growable:
            return
        total = self.layer_block_bytes(dtype, num_kv_heads) * len(self.group_of) * self.groups[0].pool.num_blocks
        available, device = max((available_memory(d), str(d)) for d in devices)
        if total > available:
            raise ValueError(
                f"the KV pool needs {total / 2**30:.2f} GiB ({self.groups[0].pool.num_blocks} blocks x "
                f"{len(self.group_of)} layers) but {device} has {available / 2**30:.2f} GiB available: "
                f"lower num_blocks / memory_budget"
            )

    # --------------------------------------------------------------------------------------- sequences
    def new_sequence(self) -> SequenceKV:
        """An empty sequence with a table per group and a row of the block-table rows."""
        seq = SequenceKV([BlockTable(g.pool, self.block_size) for g in self.groups], self._take_row())
        self._live[id(seq)] = seq
        return seq

    def _take_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        self._num_rows += 1
        if self.has_tail:  # every row has a tail row in every layer
            for group in self.groups:
                for storage in group.storages.values():
                    storage.ensure_tail_rows(self._num_rows)
        return self._num_rows - 1

    @property
    def num_rows(self) -> int:
        """Rows handed out so far (each live sequence holds one; tail formats keep a tail row per row)."""
        return self._num_rows

    def cover_rows(self, num_rows: int) -> None:
        """Tail rows for ``num_rows`` rows in every layer: a tensor-parallel follower takes no rows itself, so the
        leader's count comes with each step."""
        if self.has_tail and num_rows > self._num_rows:
            self._num_rows = num_rows
            for group in self.groups:
                for storage in group.storages.values():
                    storage.ensure_tail_rows(num_rows)

    def _release_row(self, seq: SequenceKV) -> None:
        if seq.row >= 0:
            for group, table in zip(self.groups, seq.tables):
                group.rows.clear(seq.row, 0, len(table.blocks))
            self._free_rows.append(seq.row)
            seq.row = -1

    def _write_rows(self, seq: SequenceKV, starts: list[int]) -> None:
        """Copies each group's table entries from ``starts[g]`` on into the sequence's row (0 for freed)."""
        for group, table, start in zip(self.groups, seq.tables, starts):
            group.rows.write(seq.row, start, [0 if b is None else b.block_id for b in table.blocks[start:]])

    def free(self, seq: SequenceKV) -> None:
        """Releases every block the sequence holds (device, and CPU while swapped); it may be admitted again."""
        self._release_row(seq)
        for table in seq.tables:
            table.free()
        if seq.swapped is not None:
            for pool, swapped in zip(self.cpu_pools, seq.swapped):
                pool.free_blocks(reversed(swapped.cpu_blocks))
            if seq.swapped[0].cpu_tail is not None:
                self._cpu_tail_free.append(seq.swapped[0].cpu_tail)
            seq.swapped = None
        seq.num_cached_blocks = 0

    def discard(self, seq: SequenceKV) -> None:
        """Frees the sequence for good: the audit stops counting it."""
        self.free(seq)
        self._live.pop(id(seq), None)

    def fork(self, seq: SequenceKV) -> SequenceKV:
        """A new sequence sharing every block of ``seq`` (copy-on-write of a partial tail on the next append)."""
        child = SequenceKV([table.fork() for table in seq.tables], self._take_row())
        child.block_hashes = list(seq.block_hashes)
        child.num_cached_blocks = seq.num_cached_blocks
        self._live[id(child)] = child
        self._write_rows(child, [0] * len(self.groups))
        if self._has_partial_tail(seq):  # the child's tail row starts as a copy of the parent's
            for g in range(len(self.groups)):
                self._record(g, [(seq.row, child.row)], "tail")
        return child

    def _has_partial_tail(self, seq: SequenceKV) -> bool:
        return self.has_tail and seq.row >= 0 and seq.num_tokens % self.block_size != 0

    def slide_windows(self, seq: SequenceKV) -> None:
        """Frees the blocks no future query of a sliding-window group can see (all below ``num_tokens - window
        + 1``); they stay readable (row entries 0) for the attention of the forward that just used them."""
        for group, table in zip(self.groups, seq.tables):
            if group.window is not None:
                before = table.num_freed
                table.free_blocks_before(table.num_tokens - (group.window - 1))
                if table.num_freed > before:
                    group.rows.clear(seq.row, before, table.num_freed)

    def can_append(self, seq: SequenceKV, num_new_tokens: int) -> bool:
        """Whether every group has the blocks ``append(seq, num_new_tokens)`` would allocate (copy-on-write too)."""
        for group, table in zip(self.groups, seq.tables):
            if table.num_new_blocks_needed(num_new_tokens) > group.pool.num_free_blocks:
                return False
        return True

    def try_append(self, seq: SequenceKV, num_new_tokens: int) -> bool:
        """``append`` if every group has room (True), else nothing changes (False)."""
        if num_new_tokens == 1 and all(table.tail_has_room() for table in seq.tables):  # most decode steps
            for table in seq.tables:
                table.num_tokens += 1
            return True
        if not self.can_append(seq, num_new_tokens):
            return False
        self.append(seq, num_new_tokens)
        return True

    def reserve(self, seqs: list[SequenceKV], counts: list[int]) -> None:
        """Makes room for ``counts[i]`` more tokens of each of ``seqs``: grows a growable pool, else raises
        ``PagedCacheFullError`` (``ValueError`` when the pool cannot even hold the prompts) before allocating."""
        for g, group in enumerate(self.groups):
            needed = sum(seq.tables[g].num_new_blocks_needed(n) for seq, n in zip(seqs, counts))
            free = group.pool.num_free_blocks
            if needed <= free:
                continue
            if not self.growable:
                if not any(seq.num_tokens for seq in seqs):
                    raise ValueError(
                        f"num_blocks={group.pool.num_blocks} is too small for the batch: its prompts need {needed} "
                        f"blocks of {self.block_size} tokens in the {group.name} pool. Pass num_blocks >= {needed} "
                        f"plus room for the new tokens (about batch_size * ceil(max_length / block_size) in all)"
                    )
                raise PagedCacheFullError(
                    f"PagedCache is out of blocks: the next forward needs {needed} new blocks in the {group.name} "
                    f"pool but only {free} of num_blocks={group.pool.num_blocks} are free (block_size="
                    f"{self.block_size}). Size the pool for the batch: about batch_size * ceil(max_length / "
                    f"block_size) blocks, e.g. PagedCache(config, num_blocks=...) or cache_config={{'num_blocks': "
                    f"...}}; or leave num_blocks and memory_budget unset to let it grow."
                )
            self._grow(group, needed - free)

    def _grow(self, group: LayerGroup, missing: int) -> None:
        """Grows a growable pool by ``missing`` blocks, or by a quarter if that is more (amortized O(1) copies per
        block, at most ~20% of the pool idle after a grow); storages grow one tensor at a time."""
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

    def append(self, seq: SequenceKV, num_new_tokens: int) -> None:
        """Gives ``seq`` slots for ``num_new_tokens`` more tokens in every group (capacity was checked); records the
        copy-on-write copies and updates the sequence's rows."""
        if num_new_tokens <= 0:
            return
        for g, (group, table) in enumerate(zip(self.groups, seq.tables)):
            start = len(table.blocks)
            copies = table.append(num_new_tokens)
            if copies:
                start -= 1
                self._record(g, copies, "device")
            if len(table.blocks) > start:
                group.rows.write(seq.row, start, [b.block_id for b in table.blocks[start:]])

    def truncate(self, seq: SequenceKV, num_tokens: int) -> None:
        """Rolls ``seq`` back to ``num_tokens`` tokens (assisted decoding). RuntimeError if a sliding-window group
        already freed tokens the next forward would need."""
        for group, table in zip(self.groups, seq.tables):
            if group.window is not None and table.num_freed * group.block_size > max(0, num_tokens - (group.window - 1)):
                raise RuntimeError(
                    f"cannot roll back to {num_tokens} tokens: the sliding-window layers already freed tokens the next "
                    f"forward would need (window {group.window})"
                )
        bs = self.block_size
        refill = self.has_tail and num_tokens % bs != 0 and seq.num_tokens >= (num_tokens // bs + 1) * bs
        for g, (group, table) in enumerate(zip(self.groups, seq.tables)):
            held = len(table.blocks)
            table.truncate(num_tokens)
            group.rows.clear(seq.row, len(table.blocks), held)
            if refill:  # the new last block was full: its kept tokens go back to the tail row, dequantized
                self._record(g, [(table.blocks[-1].block_id, seq.row)], "block_to_tail")

    # ---------------------------------------------------------------------------------- block copies
    def _record(self, group: int, copies: list[tuple[int, int]], where: str) -> None:
        last = self._pending[-1] if self._pending else None
        src, dst = {s for s, _ in copies}, {d for _, d in copies}
        # Merge with the previous op when that keeps its in-order meaning: a batched copy reads every source before
        # writing, so no new source may be an earlier destination, no new destination an earlier source or
        # destination (e.g. a row freed by one fork and taken by the next).
        if last is not None and last.group == group and last.where == where \
                and not (src & set(last.dst)) and not (dst & set(last.src)) and not (dst & set(last.dst)):
            self._pending[-1] = BlockCopy(group, last.src + tuple(s for s, _ in copies),
                                          last.dst + tuple(d for _, d in copies), where)
        else:
            self._pending.append(BlockCopy(group, tuple(s for s, _ in copies), tuple(d for _, d in copies), where))

    def take_copies(self) -> list[BlockCopy]:
        """The copies recorded since the last call, in order (they must run before the next forward)."""
        copies, self._pending = self._pending, []
        return copies

    def apply_copies(self, copies: list[BlockCopy]) -> None:
        """Runs ``copies`` in order, in every layer of their group (the id tensors are made once per copy)."""
        for copy in copies:
            storages = self.groups[copy.group].storages
            if not storages:
                continue
            device = next(iter(storages.values())).device
            src_on_cpu, dst_on_cpu = copy.where in ("to_device", "tail_to_device"), copy.where in ("to_cpu", "tail_to_cpu")
            src = torch.tensor(copy.src, dtype=torch.long, device="cpu" if src_on_cpu else device)
            dst = torch.tensor(copy.dst, dtype=torch.long, device="cpu" if dst_on_cpu else device)
            for idx, storage in storages.items():
                if copy.where == "device":
                    storage.copy_blocks(src, dst)
                elif copy.where == "tail":
                    storage.copy_tails(src, dst)
                elif copy.where == "block_to_tail":
                    storage.block_to_tail(src, dst)
                elif copy.where in ("to_cpu", "tail_to_cpu"):
                    tails = copy.where == "tail_to_cpu"
                    cpu = self._cpu_storage(copy.group, idx, storage, max(copy.dst) + 1, tails)
                    copy_blocks_between(storage, cpu, src, dst, tails=tails)
                else:
                    copy_blocks_between(self._cpu_storages[copy.group][idx], storage, src, dst,
                                        tails=copy.where == "tail_to_device")

    # -------------------------------------------------------------------------------------- prefix cache
    def _update_hashes(self, seq: SequenceKV, token_ids: list[int], salt) -> None:
        extend_block_hashes(seq.block_hashes, token_ids, self.block_size, (self.kv_format, salt))

    def find_prefix_hits(self, seq: SequenceKV, token_ids: list[int], salt=None) -> list[KVBlock]:
        """Cached blocks covering the longest computed prefix of ``token_ids`` (never its last token)."""
        if not self.prefix_caching:
            return []
        self._update_hashes(seq, token_ids, salt)
        bs, pool = self.block_size, self.groups[0].pool
        hits = []
        for i, block_hash in enumerate(seq.block_hashes[: (len(token_ids) - 1) // bs]):
            block = pool.get_cached_block(block_hash, token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def admission_blocks(self, hits: list[KVBlock], num_new_tokens: int) -> int:
        """Free blocks admitting a sequence takes: new blocks plus hits that now sit in the free queue."""
        new = num_blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size) - len(hits)
        return new + sum(1 for b in hits if b.ref_cnt == 0)

    def admit(self, seq: SequenceKV, hits: list[KVBlock], num_prompt_tokens: int, count_query: bool) -> None:
        """Starts ``seq`` (empty) on its prefix hits; ``count_query``: count it in the hit-rate statistics."""
        if seq.row < 0:
            seq.row = self._take_row()
        if hits:
            seq.tables[0].append_cached_blocks(hits)
            self._write_rows(seq, [0] * len(self.groups))
        seq.num_cached_blocks = len(hits)
        if count_query:
            self.prefix_queried_tokens += num_prompt_tokens
            self.prefix_hit_tokens += len(hits) * self.block_size

    def cache_full_blocks(self, seq: SequenceKV, token_ids: list[int], num_tokens: int, salt=None) -> None:
        """Registers the full blocks among the first ``num_tokens`` of ``token_ids`` in the prefix cache.

        Called when a step is scheduled, for the tokens it will have computed: a sequence admitted later in the same
        step can then hit blocks this step's forward fills, which is correct because every layer stores the whole
        step's K/V before it attends. ``end_step(failed=True)`` unregisters them if the forward fails.
        """
        if not self.prefix_caching:
            return
        full = num_tokens // self.block_size
        if full <= seq.num_cached_blocks:
            return
        self._update_hashes(seq, token_ids, salt)
        bs, pool, table = self.block_size, self.groups[0].pool, seq.tables[0]
        for i in range(seq.num_cached_blocks, full):
            block = table.blocks[i]
            if block.block_hash is None:
                pool.cache_full_block(block, seq.block_hashes[i], token_ids[i * bs : (i + 1) * bs])
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

    # ---------------------------------------------------------------------------------------------- swap
    @property
    def cpu_pools(self) -> list[BlockPool]:
        """One pool of swap blocks per group (no storage behind it until blocks are used: see ``swap_out``)."""
        if self._cpu_pools is None:
            self._cpu_pools = [BlockPool(self.num_cpu_blocks, enable_caching=False) for _ in self.groups] \
                if self.num_cpu_blocks else []
        return self._cpu_pools

    def can_swap_out(self, seq: SequenceKV) -> bool:
        if not self.num_cpu_blocks:
            return False
        return all(sum(b is not None for b in t.blocks) <= p.num_free_blocks for t, p in zip(seq.tables, self.cpu_pools))

    def swap_out(self, seq: SequenceKV) -> None:
        """Moves ``seq``'s blocks to CPU blocks (the copies are recorded) and frees them on the device."""
        swapped = []
        cpu_tail = self._take_cpu_tail() if self._has_partial_tail(seq) else None
        for g, (group, table, cpu_pool) in enumerate(zip(self.groups, seq.tables, self.cpu_pools)):
            held = [b for b in table.blocks if b is not None]
            cpu_blocks = cpu_pool.get_new_blocks(len(held))
            self._record(g, [(b.block_id, c.block_id) for b, c in zip(held, cpu_blocks)], "to_cpu")
            if cpu_tail is not None:
                self._record(g, [(seq.row, cpu_tail)], "tail_to_cpu")
            swapped.append(SwappedGroup(table.num_tokens, table.num_freed, cpu_blocks, cpu_tail))
        self._release_row(seq)
        for table in seq.tables:
            table.free()
        seq.swapped = swapped
        seq.num_cached_blocks = 0  # swapped-in blocks are new copies: registered again when full

    def _take_cpu_tail(self) -> int:
        """A CPU tail slot (the copies that use it give every group's CPU storages tail rows up to it)."""
        if self._cpu_tail_free:
            return self._cpu_tail_free.pop()
        self._num_cpu_tails += 1
        return self._num_cpu_tails - 1

    def _cpu_storage(self, g: int, idx: int, device_storage: KVStorage, num_ids: int, tails: bool) -> KVStorage:
        """Layer ``idx``'s CPU swap storage of group ``g``, made on first use and grown (by a quarter at least) to
        cover ``num_ids`` block ids (``tails``: tail rows). Driven by the copies, so a tensor-parallel follower,
        which runs the leader's copies without its pools, grows its storages alike."""
        if self._cpu_storages is None:
            self._cpu_storages = [{} for _ in self.groups]
        storages = self._cpu_storages[g]
        storage = storages.get(idx)
        if storage is None:
            _, block_size, heads, _ = device_storage.key_cache.shape
            storage = storages[idx] = make_storage(self.kv_format, 0, block_size, heads, self.head_dim,
                                                   device_storage.dtype, "cpu")
        if tails:
            storage.ensure_tail_rows(num_ids)
        elif storage.num_blocks < num_ids:
            storage.grow(min(self.num_cpu_blocks, max(num_ids, storage.num_blocks + -(-storage.num_blocks // 4)))
                         - storage.num_blocks)
        return storage

    def swap_in_blocks(self, seq: SequenceKV) -> int:
        return max(len(s.cpu_blocks) for s in seq.swapped)

    def swap_in(self, seq: SequenceKV) -> None:
        """Brings a swapped-out sequence back into new device blocks (the copies are recorded)."""
        seq.row = self._take_row()
        for g, (group, table, swapped) in enumerate(zip(self.groups, seq.tables, seq.swapped)):
            dev_blocks = group.pool.get_new_blocks(len(swapped.cpu_blocks))
            self._record(g, [(c.block_id, d.block_id) for c, d in zip(swapped.cpu_blocks, dev_blocks)], "to_device")
            table.restore(swapped.num_tokens, swapped.num_freed, dev_blocks)
            self.cpu_pools[g].free_blocks(reversed(swapped.cpu_blocks))
            if swapped.cpu_tail is not None:
                self._record(g, [(swapped.cpu_tail, seq.row)], "tail_to_device")
        if seq.swapped[0].cpu_tail is not None:
            self._cpu_tail_free.append(seq.swapped[0].cpu_tail)
        seq.swapped = None
        self._write_rows(seq, [0] * len(self.groups))

    # ---------------------------------------------------------------------------------------- audit
    def check_invariants(self) -> None:
        """Pool invariants; each block's ref count equals the tables holding it; every held row mirrors its tables."""
        live = list(self._live.values())
        for g, group in enumerate(self.groups):
            group.pool.check_invariants()
            refs: dict[int, int] = {}
            for seq in live:
                for block in seq.tables[g].blocks:
                    if block is not None:
                        refs[block.block_id] = refs.get(block.block_id, 0) + 1
            for block in group.pool.blocks[: group.pool.high_water]:
                assert block.ref_cnt == refs.get(block.block_id, 0), (
                    f"{group.name}: block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{refs.get(block.block_id, 0)} tables hold it"
                )
            rows = [seq.row for seq in live if seq.row >= 0]
            assert len(rows) == len(set(rows)), f"two sequences share a block-table row: {sorted(rows)}"
            for seq in live:
                if seq.row >= 0:
                    expected = [0 if b is None else b.block_id for b in seq.tables[g].blocks]
                    actual = group.rows.table[seq.row, : len(expected)].tolist() if expected else []
                    assert actual == expected, f"{group.name}: row {seq.row} holds {actual}, its table {expected}"
        for pool in self._cpu_pools or []:
            pool.check_invariants()

    # ---------------------------------------------------------------------------------------- stats
    def stats(self) -> KVCacheStats:
        pools = [g.pool for g in self.groups]
        return KVCacheStats(
            kv_cache_used=sum(p.num_used_blocks for p in pools),
            kv_cache_total=sum(p.num_blocks for p in pools),
            kv_cache_cached_blocks=sum(p.num_cached_blocks for p in pools),
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_bytes=sum(s.nbytes + s.tail_nbytes for g in self.groups for s in g.storages.values()),
            prefix_cache_hit_rate=self.prefix_hit_tokens / self.prefix_queried_tokens
            if self.prefix_queried_tokens else 0.0,
        )


def _layer_groups(text_config, block_size: int) -> list[LayerGroup]:
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    groups: dict[int | None, LayerGroup] = {}
    for layer_idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if layer_type not in SUPPORTED_LAYER_TYPES:
            raise NotImplementedError(
                f"PagedCache supports layer types {SUPPORTED_LAYER_TYPES}; layer {layer_idx} is {layer_type!r}"
            )
        window = kwargs.get("sliding_window") if layer_type == "sliding_attention" else None
        if window not in groups:
            groups[window] = LayerGroup(len(groups), window, block_size)
        groups[window].layer_indices.append(layer_idx)
    return list(groups.values())


def block_id_bytes(text_config, block_size: int, kv_cache_dtype: str, num_kv_heads: int | None = None,
                   dtype: torch.dtype | None = None) -> int:
    """Bytes one block id takes in every layer of a model (K and V, scales and zeros), at ``dtype`` (default: the
    config's) with ``num_kv_heads`` heads (default: the config's)."""
    head_dim = head_dim_of(text_config)
    heads = num_kv_heads or getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    layer = layer_block_bytes(check_kv_format(kv_cache_dtype, head_dim), block_size, heads, head_dim,
                            dtype or config_dtype(text_config))
    return layer * text_config.num_hidden_layers


def local_kv_heads(text_config, tp_size: int = 1) -> int:
    """KV heads one tensor-parallel rank stores: the config's, split ``tp_size`` ways. ValueError (naming both
    numbers) when ``tp_size`` does not divide them."""
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tp_size!r}")
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the model's num_key_value_heads={heads}: each rank must "
            f"hold whole KV heads; choose a divisor of {heads}"
        )
    return heads // tp_size


def head_dim_of(text_config) -> int:
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def config_dtype(text_config) -> torch.dtype:
    dtype = getattr(text_config, "dtype", None) or torch.float32
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))


def available_memory(device: torch.device) -> int:
    """Bytes a new allocation can take on ``device``: free device memory on CUDA, available RAM on the host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - a platform without sysconf
        return 1 << 62


def check_supported(text_config, config=None) -> None:
    """NotImplementedError for models the paged cache cannot serve: encoder-decoder and state-space models."""
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"PagedCache supports decoder-only models; {type(config).__name__} is an encoder-decoder model"
        )
    model_type = getattr(text_config, "model_type", "")
    if model_type in STATE_SPACE_MODEL_TYPES or getattr(text_config, "layer_types", None) is None and any(
        hasattr(text_config, attr) for attr in ("ssm_state_size", "state_size", "mamba_expand")
    ):
        raise NotImplementedError(
            f"PagedCache holds attention K/V; {model_type!r} is a state-space model with no KV cache to page"
        )
