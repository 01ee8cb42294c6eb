"""Pool of fixed-size KV blocks with reference counts, a free queue and a prefix cache.

Every block is in exactly one state:

* free:   ``ref_cnt == 0``, unhashed, in the free queue;
* cached: ``ref_cnt == 0``, hashed,   in the free queue (reusable on a prefix hit, evictable);
* used:   ``ref_cnt >= 1``, not in the free queue (hashed or not).

``free + cached + used == num_blocks`` always. A block has a hash iff the hash map points to it.
The pool knows nothing about requests or tensors: a block is just an id into the storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


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

    Blocks are made lazily: ids ``>= next_fresh`` have never been handed out, so they are free, unhashed and need
    no Python object (a pool of 10 million blocks costs nothing to construct). ``get_new_blocks`` hands out fresh
    ids first, in id order, then recycled blocks from the head of the free queue (LRU: a cached block survives as
    long as possible). With ``enable_caching=False`` no block is ever hashed, and recycled blocks go first: the ids
    in use stay as low as the most blocks held at once, so storage that grows with ``high_water`` (the swap space's)
    follows use.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.enable_caching = enable_caching
        self._num_blocks = num_blocks
        self._next_fresh = 0  # ids >= this were never handed out
        self._made: list[KVBlock] = []  # the objects of ids < len(_made); made on first use
        self._recycled = FreeBlockQueue([])  # blocks freed since they were handed out, eviction order
        self._cached: dict[int, KVBlock] = {}
        self._num_cached = 0  # hashed blocks with ref_cnt 0
        self.on_evict: Callable[[KVBlock], None] | None = None  # called with each cached block before it is evicted

    def block(self, block_id: int) -> KVBlock:
        """The object of ``block_id`` (made on first access)."""
        if not 0 <= block_id < self._num_blocks:
            raise IndexError(f"block_id {block_id} is outside the pool of {self._num_blocks} blocks")
        made = self._made
        if block_id >= len(made):
            made.extend(KVBlock(i) for i in range(len(made), block_id + 1))
        return made[block_id]

    @property
    def blocks(self) -> "_BlockList":
        """Every block, by id (``blocks[i].block_id == i``); iterating makes every object (tests, audits)."""
        return _BlockList(self)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Allocatable blocks: free + cached."""
        return self._num_blocks - self._next_fresh + len(self._recycled)

    @property
    def num_used_blocks(self) -> int:
        return self._next_fresh - len(self._recycled)

    @property
    def num_cached_blocks(self) -> int:
        """Hashed blocks with ref_cnt 0 (in the free queue, reusable on a prefix hit)."""
        return self._num_cached

    @property
    def high_water(self) -> int:
        """Ids below this have been handed out at least once (storage behind the pool must cover them)."""
        return self._next_fresh

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Hands out ``num_blocks`` blocks, each with ref_cnt 1 and no hash: fresh ids first, then the free queue's
        head (a popped cached block is evicted: ``on_evict`` sees it, then its hash leaves the map); without caching,
        the free queue's first. Raises NoFreeBlocksError, changing nothing, if fewer than ``num_blocks`` are free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(num_blocks, self.num_free_blocks)
        recycled = 0 if self.enable_caching else min(num_blocks, len(self._recycled))
        fresh = min(num_blocks - recycled, self._num_blocks - self._next_fresh)
        out = []
        if fresh:
            first = self._next_fresh
            self.block(first + fresh - 1)  # makes the objects
            out = self._made[first : first + fresh]
            for block in out:
                block.ref_cnt = 1
            self._next_fresh += fresh
        for _ in range(num_blocks - fresh):
            block = self._recycled.popleft()
            assert block.ref_cnt == 0, f"{block} was queued with ref_cnt != 0"
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
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
                self._recycled.append(block)
                if block.block_hash is not None:
                    self._num_cached += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Adds one reference to each block; a block at ref_cnt 0 (a prefix hit) leaves the queue first."""
        for block in blocks:
            if block.ref_cnt == 0:
                assert block.block_id < self._next_fresh, f"{block} was never handed out"
                self._recycled.remove(block)
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

    def grow(self, num_new_blocks: int) -> None:
        """Adds ``num_new_blocks`` fresh blocks with the next ids (handed out before any recycled block)."""
        if num_new_blocks < 0:
            raise ValueError(f"num_new_blocks must be >= 0, got {num_new_blocks}")
        self._num_blocks += num_new_blocks

    def _drop_hash(self, block: KVBlock) -> None:
        assert block.block_hash is not None and self._cached.get(block.block_hash) is block
        del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def check_invariants(self) -> None:
        """Raises AssertionError (even under ``python -O``) if the pool's bookkeeping is inconsistent.

        Costs O(blocks made so far), never O(num_blocks): fresh ids without an object are free by construction.
        """
        queued = self._recycled.blocks()
        _check(len(queued) == len(self._recycled), f"free queue links hold {len(queued)} blocks, length says "
               f"{len(self._recycled)}")
        queued_ids = {b.block_id for b in queued}
        _check(len(queued_ids) == len(queued), "a block appears twice in the free queue")
        _check(0 <= self._next_fresh <= self._num_blocks, f"next fresh id {self._next_fresh} is outside the pool")
        num_cached = num_used = 0
        for i, block in enumerate(self._made):
            _check(block.block_id == i, f"blocks[{i}] has block_id {block.block_id}")
            if i >= self._next_fresh:
                _check(block.ref_cnt == 0 and block.block_hash is None and block not in self._recycled,
                       f"{block} was never handed out but is not plain free")
                continue
            in_queue = block.block_id in queued_ids
            _check(in_queue == (block in self._recycled), f"{block} has stale free-queue links")
            _check(block.ref_cnt >= 0 and in_queue == (block.ref_cnt == 0),
                   f"{block}: in free queue = {in_queue} but ref_cnt = {block.ref_cnt}")
            _check((block.block_hash is None) == (block.token_ids is None),
                   f"{block}: block_hash and token_ids must be set together")
            num_used += block.ref_cnt > 0
            if block.block_hash is not None:
                _check(self.enable_caching, f"{block} is hashed but caching is disabled")
                _check(self._cached.get(block.block_hash) is block, f"{block} is hashed but not in the hash map")
                num_cached += block.ref_cnt == 0
        _check(len(self._made) >= self._next_fresh, "a handed-out block has no object")
        for block_hash, block in self._cached.items():
            _check(block.block_hash == block_hash, f"hash map entry {block_hash} points to {block}")
            _check(0 <= block.block_id < len(self._made) and self._made[block.block_id] is block,
                   f"hash map entry {block_hash} points to a block outside the pool")
        # Every block is counted once: used (ref >= 1) + free/cached (queued or fresh) == num_blocks.
        _check(self.num_used_blocks == num_used, "used-block count is wrong")
        _check(num_cached == self._num_cached,
               f"cached-block counter is {self._num_cached} but {num_cached} blocks are cached")


class _BlockList(Sequence):
    """``pool.blocks``: a read-only list of every block by id, made on access."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_blocks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._pool.block(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        return self._pool.block(index)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)
