"""``KVManager``: the one KV allocator of ``generate`` (``PagedCache``) and of the engine. It owns the sequences
(their tables and block-table rows), their growth, the audit and the statistics, and holds the pieces with a job of
their own: the layer groups (``layer_groups``), the copy log (``copies``), the prefix cache (``prefix_cache``) and
the swap space (``swap``); what its pools cost and their allocation are ``sizing``'s.

Is there room? Each client asks one question:

* ``PagedCache`` asks ``reserve(seqs, counts)`` before a forward: it grows a growable pool, or raises
  ``PagedCacheFullError`` with nothing allocated.
* The engine asks ``has_room(blocks_per_group)``: ``try_append`` (and ``append_decodes``, the same for many
  decodes in one pass) asks it for the running sequences; the scheduler
  asks it for admissions and swap-ins as ``cost <= num_free_blocks`` (the same question with one count for every
  group), the cost from ``PrefixCache.admission_blocks`` or ``num_swap_in_blocks``.

Formats with a full-precision tail (int4): each sequence's newest, partial block lives in the tail row of its
block-table row (``SequenceKV.row``) in every layer, and the pool block holds codes only once it is full. The tail
row follows the sequence: a fork copies it to the child's row, swap moves it to a CPU tail slot and back, and a
rollback (``truncate``) into a block that was full dequantizes that block into the row (policy: the kept tokens
keep the values the attention already read; the block is quantized again when it refills). Only full blocks are
shared (forks share the partial block too, but copy it on write) or cached, so prefix hits stay exact.

Policy: blocks are freed tail first, so a finished sequence's tail is evicted before its shared prefix.
"""

from __future__ import annotations

from ..block_pool import BlockPool
from ..block_table import BlockTable
from ..kernels.kv_format import KV_FORMATS
from ..kv_stats import KVCacheStats
from ..quant import check_kv_format
from .audit import check_manager
from .copies import BlockCopy, CopyKind, CopyLog, apply_copy
from .growth import PagedCacheFullError, grow_group, room_error
from .layer_groups import layer_groups
from .host_tier import HostTier
from .model_config import check_supported, kv_sources, latent_dims, layer_head_shapes
from .prefix_cache import PrefixCache
from .prefix_hit import PrefixHit
from .recurrent import RecurrentStates, recurrent_layers
from .rows import RowAllocator
from .sequence import SequenceKV
from .sizing import block_id_bytes
from .swap import SwapSpace

__all__ = ["KVManager", "PagedCacheFullError", "SequenceKV"]


class KVManager:
    """The pools, storages and block tables of one model's KV cache.

    Args:
        text_config: the decoder config (layer types, sliding windows, heads).
        block_size, kv_cache_dtype: as ``CacheConfig``.
        num_blocks: blocks per group; None makes a growable pool (``reserve`` grows it, like ``DynamicCache``).
        enable_prefix_caching: hash full blocks and reuse them (every layer-group mix; a fixed pool only).
        swap_space_bytes: CPU memory for swapped-out blocks (0: no swap).
        kv_offloading_bytes: host memory for cached blocks evicted from the pool (0: none; ``kv.host_tier``).
        tp_size: the tensor-parallel size: this process stores ``1 / tp_size`` of each layer's KV heads.
        recurrent_states: keep the recurrent layers' states of a hybrid model, a row per sequence row (the engine;
            a ``PagedCache`` leaves them to transformers' ``LinearAttentionLayer``s).
    """

    def __init__(self, text_config, block_size: int = 16, kv_cache_dtype: str = "auto", num_blocks: int | None = None,
                 enable_prefix_caching: bool = False, swap_space_bytes: int = 0,
                 tp_size: int = 1, kv_offloading_bytes: int = 0,
                 recurrent_states: bool = False) -> None:
        check_supported(text_config)
        self.text_config = text_config
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.tp_size = tp_size
        # {layer: (KV heads this process stores, head size)} of every layer that stores K/V
        self.head_shapes = layer_head_shapes(text_config, tp_size)
        # {layer: latent size} of the multi-head latent attention layers (one row a token serves as key and value)
        self.latent_dims = latent_dims(text_config)
        # {layer: the later layers that read its K/V and store none} (Gemma 3n's and Gemma 4's shared layers)
        self.readers: dict[int, tuple[int, ...]] = {}
        for reader, source in sorted(kv_sources(text_config).items()):
            self.readers[source] = (*self.readers.get(source, ()), reader)
        self.groups = layer_groups(text_config, block_size)  # NotImplementedError: no layer attends
        # the format's canonical name; ValueError where a layer's head size rules it out (int4: an odd one)
        self.kv_format = next(iter({check_kv_format(kv_cache_dtype, head_dim)
                                    for _, head_dim in self.head_shapes.values()}))
        self.has_tail = KV_FORMATS[self.kv_format].tail
        self.group_of = {idx: group for group in self.groups for idx in group.layer_indices}
        self.growable = num_blocks is None
        layers = recurrent_layers(text_config)
        # the recurrent layers' states (``recurrent_states``); None: not kept here, or every layer attends. A cached
        # block would hold K/V without the states after it, so prefix caching is off with them (the engine says so)
        self.recurrent = RecurrentStates(layers) if layers and recurrent_states else None
        enable_prefix_caching = enable_prefix_caching and not layers
        for group in self.groups:  # a growable pool starts empty: ``reserve`` sizes it for the first forward
            group.pool = BlockPool(num_blocks or 0, enable_caching=enable_prefix_caching and num_blocks is not None)
        self.copies = CopyLog()
        caching = enable_prefix_caching and num_blocks is not None
        host = HostTier.sized(kv_offloading_bytes if caching else 0, block_id_bytes(self), self.groups,
                              self.kv_format, self.copies)
        self.prefix_cache = PrefixCache(self.groups, block_size, self.kv_format, caching, host)
        num_cpu_blocks = int(swap_space_bytes // block_id_bytes(self)) if swap_space_bytes else 0
        self.swap = SwapSpace(num_cpu_blocks, len(self.groups), self.kv_format)
        self.rows = RowAllocator(self.groups, self.has_tail, self.recurrent)
        self._live: dict[int, SequenceKV] = {}  # id -> every sequence made and not freed

    @property
    def prefix_caching(self) -> bool:
        """Whether full blocks are hashed and reused (asked, not just enabled: off for a growable pool)."""
        return self.prefix_cache.enabled

    # ------------------------------------------------------------------------------------------- room
    @property
    def num_total_blocks(self) -> int:
        """Blocks every group has (the smallest pool; the engine's pools are all the same size)."""
        return min(g.pool.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        """Blocks every group can still allocate (the smallest pool's free and cached blocks)."""
        return min(g.pool.num_free_blocks for g in self.groups)

    def has_room(self, blocks_per_group: list[int]) -> bool:
        """The engine's question: whether group ``g`` can allocate ``blocks_per_group[g]`` blocks, for every ``g``."""
        return all(n <= g.pool.num_free_blocks for n, g in zip(blocks_per_group, self.groups))

    def presize(self, num_blocks: int) -> None:
        """Gives a growable pool, before its first forward, ``num_blocks`` blocks per group: a user whose need is
        known (``generate``'s call) allocates once, and the pool still grows past that if a later forward needs it."""
        if not self.growable or any(group.storages for group in self.groups):
            raise RuntimeError("presize applies to a growable pool before its first forward")
        for group in self.groups:
            group.pool.grow(max(num_blocks - group.pool.num_blocks, 0))

    # --------------------------------------------------------------------------------------- sequences
    def new_sequence(self) -> SequenceKV:
        """An empty sequence with a table per group and a row of the block-table rows."""
        seq = SequenceKV([BlockTable(g.pool, self.block_size) for g in self.groups], self.rows.take())
        self._live[id(seq)] = seq
        return seq

    def live_sequences(self) -> list[SequenceKV]:
        """Every sequence made and not discarded (what the audit counts)."""
        return list(self._live.values())

    @property
    def num_rows(self) -> int:
        """Rows handed out so far (each live sequence holds one; tail formats keep a tail row per row)."""
        return self.rows.num_rows

    def cover_rows(self, num_rows: int) -> None:
        """Tail rows for ``num_rows`` rows in every layer: a tensor-parallel follower takes no rows itself, so the
        leader's count comes with each step."""
        self.rows.cover(num_rows)

    def free(self, seq: SequenceKV) -> None:
        """Releases every block the sequence holds (device, and CPU while swapped); it may be admitted again."""
        self.rows.release(seq)
        for table in seq.tables:
            table.free()
        if seq.swapped is not None:
            self.swap.release(seq.swapped)
            seq.swapped = None
        seq.num_cached_blocks = 0

    def discard(self, seq: SequenceKV) -> None:
        """Frees the sequence for good: the audit stops counting it."""
        self.free(seq)
        self._live.pop(id(seq), None)

    def fork(self, seq: SequenceKV) -> SequenceKV:
        """A new sequence sharing every block of ``seq`` (copy-on-write of a partial tail on the next append)."""
        child = SequenceKV([table.fork() for table in seq.tables], self.rows.take())
        child.block_hashes = list(seq.block_hashes)
        child.num_cached_blocks = seq.num_cached_blocks
        self._live[id(child)] = child
        self.rows.write(child)
        if self.recurrent is not None:  # the child goes on from the parent's states
            self.recurrent.copy_row(seq.row, child.row)
        if self._has_partial_tail(seq):  # the child's tail row starts as a copy of the parent's
            for g in range(len(self.groups)):
                self.copies.record(g, [(seq.row, child.row)], CopyKind.FORK_TAIL)
        return child

    def _has_partial_tail(self, seq: SequenceKV) -> bool:
        return self.has_tail and seq.row >= 0 and seq.num_tokens % self.block_size != 0

    # ------------------------------------------------------------------------------------------ growth
    def slide_windows(self, seq: SequenceKV) -> None:
        """Frees the blocks no future query can see (``policy.first_needed``: a sliding window's); they stay
        readable (row entries 0) for the attention of the forward that just used them."""
        for group, table in zip(self.groups, seq.tables):
            before = table.num_freed
            table.free_blocks_before(group.policy.first_needed(table.num_tokens))
            if table.num_freed > before:
                group.rows.clear(seq.row, before, table.num_freed)

    def max_chunk(self, num_tokens: int) -> int:
        """The most tokens one forward can add to a sequence of ``num_tokens`` tokens with every group's whole pool
        to itself: a group holds its blocks from ``first_needed(num_tokens)``'s on (a sliding window's, once
        ``slide_windows`` freed those behind it) to the last new token's. A full group never limits a request
        ``add_request`` accepted; a sliding group limits a prompt whose blocks exceed its pool, which is then
        computed in chunks, freeing the blocks behind its window as it goes."""
        bs = self.block_size
        return min((max(0, g.policy.first_needed(num_tokens)) // bs + g.pool.num_blocks) * bs - num_tokens
                   for g in self.groups)

    def try_append(self, seq: SequenceKV, num_new_tokens: int) -> bool:
        """``append`` if every group has room (True), else nothing changes (False)."""
        if num_new_tokens == 1:  # most steps: a decode
            return self.append_decodes([seq]) == 1
        return self._try_grow(seq, num_new_tokens)

    def _try_grow(self, seq: SequenceKV, num_new_tokens: int) -> bool:
        if num_new_tokens == 1 and len(self.groups) == 1 and seq.num_tokens % self.block_size == 0:
            # a decode's growth: the token starts a block, nothing to copy (``append``'s general bookkeeping cost
            # 6 us of a decode step's 16 growths at 256 sequences)
            table = seq.tables[0]
            block = table.append_new_block()
            if block is None:
                return False
            self.groups[0].rows.write(seq.row, len(table.blocks) - 1, [block.block_id])
            return True
        if not self.has_room([table.num_new_blocks_needed(num_new_tokens) for table in seq.tables]):
            return False
        self.append(seq, num_new_tokens)
        return True

    def decode_tables(self, seqs: list[SequenceKV]) -> list[BlockTable] | None:
        """The tables ``append_decodes`` reads for ``seqs``, for a caller that asks it again for the same sequences
        (each holds its tables as long as it holds blocks): with one group, each sequence's table; else None."""
        return [seq.tables[0] for seq in seqs] if len(self.groups) == 1 else None

    def append_decodes(self, seqs: list[SequenceKV], grow: bool = True, tables: list[BlockTable] | None = None) -> int:
        """``try_append(seq, 1)`` for each of ``seqs`` in turn, as long as it succeeds; returns how many did. The
        first that did not (no room: nothing changed) and those after it are left as they were. ``grow=False``
        also stops at the first token that needs a block (or a copy of its tail): only in-place appends, which take
        no block from the pool. A token that goes into the tail block of every group in place (most of them) reads
        one object, its table (``tables``: ``decode_tables(seqs)``, kept by the caller): the decode steady state,
        asked of every running sequence each step, after a forward that evicted the host's caches. Registering the
        blocks the tokens fill in the prefix cache is the caller's (the scheduler defers it to its next lookup)."""
        if len(self.groups) == 1:
            for i, table in enumerate(tables or self.decode_tables(seqs)):
                if not table.append_in_tail() and not (grow and self._try_grow(seqs[i], 1)):
                    return i
            return len(seqs)
        for i, seq in enumerate(seqs):
            if all(table.tail_has_room() for table in seq.tables):
                for table in seq.tables:
                    if not table.append_in_tail():  # its flag still says shared (a fork whose sharer copied the
                        table.append(1)  # tail since): in place all the same, and the flag refreshed
            elif not (grow and self._try_grow(seq, 1)):
                return i
        return len(seqs)

    def reserve(self, seqs: list[SequenceKV], counts: list[int]) -> None:
        """``PagedCache``'s question: makes room for ``counts[i]`` more tokens of each of ``seqs``. Grows a growable
        pool, else raises ``PagedCacheFullError`` (``ValueError`` when the pool cannot even hold the prompts)
        before allocating."""
        for g, group in enumerate(self.groups):
            needed = sum(seq.tables[g].num_new_blocks_needed(n) for seq, n in zip(seqs, counts))
            free = group.pool.num_free_blocks
            if needed <= free:
                continue
            if not self.growable:
                raise room_error(group, needed, prompts=not any(seq.num_tokens for seq in seqs))
            grow_group(group, needed - free)

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
                self.copies.record(g, copies, CopyKind.COPY_ON_WRITE)
            if len(table.blocks) > start:
                group.rows.write(seq.row, start, [b.block_id for b in table.blocks[start:]])

    def truncate(self, seq: SequenceKV, num_tokens: int) -> None:
        """Rolls ``seq`` back to ``num_tokens`` tokens (assisted decoding). RuntimeError if a sliding-window group
        already freed tokens the next forward would need."""
        for group, table in zip(self.groups, seq.tables):
            if not group.policy.can_roll_back(table.num_freed, group.block_size, num_tokens):
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
                self.copies.record(g, [(table.blocks[-1].block_id, seq.row)], CopyKind.ROLLBACK_TO_TAIL)

    # ------------------------------------------------------------------------------------ block copies
    def take_copies(self) -> list[BlockCopy]:
        """The copies recorded since the last call, in order (they must run before the next forward)."""
        return self.copies.take()

    def apply_copies(self, copies: list[BlockCopy]) -> None:
        """Runs ``copies`` in order, in every layer of their group."""
        for copy in copies:
            apply_copy(copy, self.groups[copy.group].storages, self.swap, self.prefix_cache.host)

    # ------------------------------------------------------------------------------------ prefix cache
    def find_prefix_hit(self, seq: SequenceKV, token_ids: list[int], salt=None) -> PrefixHit:
        """The longest cached prefix of ``token_ids`` every group can serve (never its last token)."""
        return self.prefix_cache.find_hit(seq, token_ids, salt)

    def admission_blocks(self, hit: PrefixHit, num_new_tokens: int) -> list[int]:
        """Free blocks admitting a sequence on ``hit`` takes in each group (``PrefixCache.admission_blocks``)."""
        return self.prefix_cache.admission_blocks(hit, num_new_tokens)

    def admit(self, seq: SequenceKV, hit: PrefixHit, token_ids: list[int], count_query: bool) -> None:
        """Starts ``seq`` (empty) on its prefix hit; ``count_query``: count it in the hit-rate statistics."""
        if seq.row < 0:
            seq.row = self.rows.take()
        self.prefix_cache.admit(seq, hit, token_ids, count_query)
        self.rows.write(seq)

    def cache_full_blocks(self, seq: SequenceKV, token_ids: list[int], num_tokens: int, salt=None,
                          computed: bool = False) -> None:
        """Registers ``seq``'s full blocks among its first ``num_tokens`` (see ``PrefixCache.cache_full_blocks``)."""
        self.prefix_cache.cache_full_blocks(seq, token_ids, num_tokens, salt, computed)

    def end_step(self, failed: bool) -> None:
        """Closes a step (a failed one unregisters the blocks registered for it)."""
        self.prefix_cache.end_step(failed)

    # -------------------------------------------------------------------------------------------- swap
    def can_swap_out(self, seq: SequenceKV) -> bool:
        """Whether the swap space has room for every block ``seq`` holds (never with recurrent states: they are
        not swapped)."""
        return self.recurrent is None and self.swap.can_hold(seq)

    def swap_out(self, seq: SequenceKV) -> None:
        """Moves ``seq``'s blocks to CPU blocks (the copies are recorded) and frees them on the device."""
        swapped = self.swap.move_out(seq, seq.row if self._has_partial_tail(seq) else None, self.copies)
        self.rows.release(seq)
        for table in seq.tables:
            table.free()
        seq.swapped = swapped
        seq.num_cached_blocks = 0  # swapped-in blocks are new copies: registered again when full

    def num_swap_in_blocks(self, seq: SequenceKV) -> int:
        """Device blocks the worst group needs to swap ``seq`` back in."""
        return self.swap.num_blocks_to_move_in(seq)


    def swap_in(self, seq: SequenceKV) -> None:
        """Brings a swapped-out sequence back into new device blocks (the copies are recorded)."""
        seq.row = self.rows.take()
        self.swap.move_in(seq, self.groups, self.copies)
        seq.swapped = None
        self.rows.write(seq)

    # ------------------------------------------------------------------------------------ audit, stats
    def check_invariants(self) -> None:
        """Raises ``KVInvariantError`` (an AssertionError, even under ``python -O``) if the bookkeeping is wrong:
        pool invariants; each block's ref count equals the tables holding it; every held row mirrors its tables."""
        check_manager(self.groups, self.live_sequences())
        self.swap.check_invariants()
        self.prefix_cache.check_invariants()

    def stats(self) -> KVCacheStats:
        pools = [g.pool for g in self.groups]
        return KVCacheStats(
            kv_cache_used=sum(p.num_used_blocks for p in pools),
            kv_cache_total=sum(p.num_blocks for p in pools),
            kv_cache_cached_blocks=sum(p.num_cached_blocks for p in pools),
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_bytes=sum(s.nbytes + s.tail_nbytes for g in self.groups for s in g.storages.values()),
            recurrent_state_bytes=0 if self.recurrent is None else self.recurrent.nbytes,
            prefix_cache_hit_rate=self.prefix_cache.hit_rate,
            **self.prefix_cache.counters(),
        )
