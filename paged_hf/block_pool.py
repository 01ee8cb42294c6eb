"""Pool of fixed-size KV blocks with reference counts, a free queue and a prefix cache.

Every block is in exactly one state:

* free:   ``ref_cnt == 0``, unhashed, in the free queue;
* cached: ``ref_cnt == 0``, hashed,   in the free queue (reusable on a prefix hit, evictable);
* used:   ``ref_cnt >= 1``, not in the free queue (hashed or not).

``free + cached + used == num_blocks`` always. A block has a hash iff the hash map points to it.
The pool knows nothing about requests or tensors: a block is just an id into the storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVBlock:
    """One block of KV storage. ``block_hash`` and ``token_ids`` are set together, only on full blocks."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_cnt 0, in eviction order (head = evicted first).

    O(1) popleft, append, and remove from the middle. A block is in the queue iff its
    ``prev_free`` and ``next_free`` links are set (sentinels bound both ends).
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinel before the first block
        self._tail = KVBlock(-1)  # sentinel after the last block
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None and block.next_free is not None

    def popleft(self) -> KVBlock:
        """Removes and returns the head block. IndexError if the queue is empty."""
        if self._len == 0:
            raise IndexError("popleft from an empty FreeBlockQueue")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlinks ``block``, which must be in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVBlock) -> None:
        """Links ``block`` (not in the queue) at the tail: it is evicted last."""
        assert block.prev_free is None and block.next_free is None, f"{block} is already queued"
        last = self._tail.prev_free
        assert last is not None
        last.next_free, self._tail.prev_free = block, block
        block.prev_free, block.next_free = last, self._tail
        self._len += 1

    def blocks(self) -> list[KVBlock]:
        """The queued blocks, head to tail (O(n); for tests and invariant checks)."""
        out = []
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None and len(out) <= self._len, "free queue links are broken"
            out.append(node)
            node = node.next_free
        return out


class NoFreeBlocksError(RuntimeError):
    """Raised by ``BlockPool.get_new_blocks`` when fewer blocks are free than needed; nothing changed."""

    def __init__(self, num_needed: int, num_free: int) -> None:
        super().__init__(f"need {num_needed} free KV blocks but only {num_free} are free")
        self.num_needed = num_needed
        self.num_free = num_free


class BlockPool:
    """Owns the blocks, the free queue and the hash -> block map. No requests, no tensors.

    ``blocks[i].block_id == i``. With ``enable_caching=False`` no block is ever hashed.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)  # read-only for callers: the pool keeps it consistent
        self._cached: dict[int, KVBlock] = {}
        self._num_cached = 0  # hashed blocks with ref_cnt 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Allocatable blocks: free + cached."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Hashed blocks with ref_cnt 0 (in the free queue, reusable on a prefix hit)."""
        return self._num_cached

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pops ``num_blocks`` from the free queue head, each returned with ref_cnt 1 and no hash.

        A popped cached block is evicted (its hash leaves the map). Raises NoFreeBlocksError,
        changing nothing, if fewer than ``num_blocks`` are free.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self.free_queue):
            raise NoFreeBlocksError(num_blocks, len(self.free_queue))
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0, f"{block} was queued with ref_cnt != 0"
            if block.block_hash is not None:
                self._drop_hash(block)
                self._num_cached -= 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 join the queue tail in the given order.

        Pass a sequence's blocks tail first so its tail is evicted first.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"freeing {block} with ref_cnt 0"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self._num_cached += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Adds one reference to each block; a block at ref_cnt 0 (a prefix hit) leaves the queue first."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached -= 1
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: int, token_ids: Sequence[int]) -> None:
        """Registers a used, full, unhashed block under ``block_hash`` with its ``token_ids``.

        If another block already holds ``block_hash``, the map keeps that one and ``block``
        stays unhashed (no de-duplication). No-op when caching is disabled.
        """
        if not self.enable_caching:
            return
        assert block.ref_cnt >= 1, f"caching {block}, which is not in use"
        assert block.block_hash is None, f"{block} is already hashed"
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        """The block under ``block_hash`` if its stored tokens equal ``token_ids``, else None.

        Does not touch the block (call ``touch`` to take a reference).
        """
        if not self.enable_caching:
            return None
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def uncache_block(self, block: KVBlock) -> None:
        """Drops the hash of a hashed block (used or cached): its content is not what the hash promised."""
        assert block.block_hash is not None, f"{block} is not hashed"
        self._drop_hash(block)
        if block.ref_cnt == 0:
            self._num_cached -= 1

    def evict_cached_blocks(self) -> int:
        """Drops the hash of every ref-0 block (they become plain free blocks); returns how many."""
        evicted = [b for b in self._cached.values() if b.ref_cnt == 0]
        for block in evicted:
            self._drop_hash(block)
        self._num_cached -= len(evicted)
        return len(evicted)

    def grow(self, num_new_blocks: int) -> None:
        """Adds ``num_new_blocks`` free blocks with the next ids, appended at the queue tail."""
        if num_new_blocks < 0:
            raise ValueError(f"num_new_blocks must be >= 0, got {num_new_blocks}")
        start = len(self.blocks)
        for block_id in range(start, start + num_new_blocks):
            block = KVBlock(block_id)
            self.blocks.append(block)
            self.free_queue.append(block)

    def _drop_hash(self, block: KVBlock) -> None:
        assert block.block_hash is not None and self._cached.get(block.block_hash) is block
        del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def check_invariants(self) -> None:
        """Raises AssertionError (even under ``python -O``) if the pool's bookkeeping is inconsistent."""
        queued = self.free_queue.blocks()
        _check(len(queued) == len(self.free_queue), f"free queue links hold {len(queued)} blocks, length says "
               f"{len(self.free_queue)}")
        queued_ids = {b.block_id for b in queued}
        _check(len(queued_ids) == len(queued), "a block appears twice in the free queue")
        num_cached = 0
        for i, block in enumerate(self.blocks):
            _check(block.block_id == i, f"blocks[{i}] has block_id {block.block_id}")
            in_queue = block.block_id in queued_ids
            _check(in_queue == (block in self.free_queue), f"{block} has stale free-queue links")
            _check(block.ref_cnt >= 0 and in_queue == (block.ref_cnt == 0),
                   f"{block}: in free queue = {in_queue} but ref_cnt = {block.ref_cnt}")
            _check((block.block_hash is None) == (block.token_ids is None),
                   f"{block}: block_hash and token_ids must be set together")
            if block.block_hash is not None:
                _check(self.enable_caching, f"{block} is hashed but caching is disabled")
                _check(self._cached.get(block.block_hash) is block, f"{block} is hashed but not in the hash map")
                num_cached += block.ref_cnt == 0
        for block_hash, block in self._cached.items():
            _check(block.block_hash == block_hash, f"hash map entry {block_hash} points to {block}")
            _check(0 <= block.block_id < len(self.blocks) and self.blocks[block.block_id] is block,
                   f"hash map entry {block_hash} points to a block outside the pool")
        # Every block is counted once: used (ref >= 1) + free/cached (queued) == num_blocks.
        _check(self.num_used_blocks == sum(b.ref_cnt > 0 for b in self.blocks), "used-block count is wrong")
        _check(num_cached == self._num_cached,
               f"cached-block counter is {self._num_cached} but {num_cached} blocks are cached")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)
