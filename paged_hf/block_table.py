"""Per-sequence block table: the logical -> physical block mapping of one sequence.

Invariants:

* ``len(blocks) == num_blocks_for(num_tokens, block_size)``; position ``p`` lives in
  ``blocks[p // block_size]`` at offset ``p % block_size``.
* ``None`` entries (blocks freed because they slid out of a sliding window) form a prefix
  of ``blocks``; every other entry holds one reference to its block.
* Append-only, except ``truncate`` (rollback) and ``free_blocks_before`` (sliding windows).
* Only a tail block that this table owns alone and that is not in the prefix cache is
  written in place; otherwise ``append`` copies it first (copy-on-write).
* ``_tail_private`` (read by ``append_in_tail`` only while the tail is partial) is True only if the tail
  block is this table's alone and unhashed; every method but ``append_in_tail`` sets it again. It stays
  true without the table's knowledge because a partial tail gains a reference only through this table's
  ``fork`` and is never hashed (the prefix cache registers full blocks; only ``truncate`` makes a full
  block partial again). A false value is only a slower path.

Prefix-cache hashing of full blocks is not done here (the engine does it).
"""

from __future__ import annotations

from paged_hf.block_pool import BlockPool, KVBlock


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-num_tokens // block_size)


def _writable_in_place(block: KVBlock) -> bool:
    """Whether a table holding ``block`` may write into it: it holds it alone, and it is not in the prefix cache."""
    return block.ref_cnt == 1 and block.block_hash is None


class BlockTable:
    """Blocks of one sequence, allocated from (and returned to) a shared ``BlockPool``."""

    __slots__ = ("pool", "block_size", "blocks", "_num_tokens", "_num_freed", "_tail_private")

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.blocks: list[KVBlock | None] = []
        self._num_tokens = 0
        self._num_freed = 0  # length of the None prefix of blocks
        self._tail_private = False  # see the module docstring

    @property
    def num_tokens(self) -> int:
        """Positions this table holds slots for (only the table's own methods change it)."""
        return self._num_tokens

    @property
    def num_freed(self) -> int:
        """Leading entries freed by ``free_blocks_before`` (``None`` in ``blocks``)."""
        return self._num_freed

    def _tail_needs_copy(self) -> bool:
        """True if the tail block is partially filled and must not be written in place
        (shared with another table, or registered in the prefix cache)."""
        if self.num_tokens % self.block_size == 0:
            return False
        tail = self.blocks[-1]
        assert tail is not None, "a partially filled tail block cannot have slid out"
        return not _writable_in_place(tail)

    def tail_has_room(self) -> bool:
        """Whether the next token goes into the tail block in place (the decode fast path)."""
        return self.num_tokens % self.block_size != 0 and _writable_in_place(self.blocks[-1])

    def append_in_tail(self) -> bool:
        """``append(1)`` when the token goes into the tail block in place (True: no block taken, nothing to copy);
        False, nothing changed, otherwise. The decode steady state, asked of every running sequence each step: it
        reads this table's own fields only (``_tail_private``), not its blocks, which a step's forward has evicted
        from the CPU's caches."""
        num_tokens = self._num_tokens
        if num_tokens % self.block_size == 0 or not self._tail_private:
            return False
        self._num_tokens = num_tokens + 1
        return True

    def append_new_block(self) -> KVBlock | None:
        """``append(1)`` for a table whose tail block is full (or that has none): the token starts a block, taken from
        the pool and returned (None, nothing changed, when the pool has no free block). A decode's growth, once a
        block per sequence, without ``append``'s general bookkeeping."""
        assert self._num_tokens % self.block_size == 0, "the next token goes into the tail block"
        if self.pool.num_free_blocks == 0:
            return None
        block = self.pool.get_new_blocks(1)[0]
        self.blocks.append(block)
        self._num_tokens += 1
        self._tail_private = True  # a fresh block: ref_cnt 1, no hash
        return block

    def _refresh_tail(self) -> None:
        """Sets ``_tail_private`` from the tail block itself (after any change but an in-place append)."""
        self._tail_private = bool(self.blocks) and self.blocks[-1] is not None and _writable_in_place(self.blocks[-1])

    def num_new_blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks ``append(num_new_tokens)`` would take from the pool, copy-on-write included."""
        if num_new_tokens == 1 and self.tail_has_room():
            return 0
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0:
            return 0
        grow = num_blocks_for(self.num_tokens + num_new_tokens, self.block_size) - len(self.blocks)
        return grow + int(self._tail_needs_copy())

    def append(self, num_new_tokens: int) -> list[tuple[int, int]]:
        """Reserves positions ``num_tokens .. num_tokens + num_new_tokens - 1`` (position ``p`` lives in
        ``blocks[p // block_size]`` at offset ``p % block_size``).

        Returns ``copies = [(src_block_id, dst_block_id)]``: copy-on-write replacements of the tail block, whose
        storage the caller must copy before writing. All blocks are allocated up front: on NoFreeBlocksError
        nothing changed.
        """
        if num_new_tokens == 1 and self.append_in_tail():
            return []
        num_needed = self.num_new_blocks_needed(num_new_tokens)
        if num_new_tokens == 0:
            return []
        new_blocks = self.pool.get_new_blocks(num_needed)  # may raise; nothing changed yet
        copies: list[tuple[int, int]] = []
        if self._tail_needs_copy():
            src, dst = self.blocks[-1], new_blocks.pop(0)
            assert src is not None
            self.blocks[-1] = dst
            self.pool.free_blocks([src])
            copies.append((src.block_id, dst.block_id))
        self.blocks.extend(new_blocks)
        self._num_tokens += num_new_tokens
        self._refresh_tail()
        assert len(self.blocks) == num_blocks_for(self.num_tokens, self.block_size)
        return copies

    def append_cached_blocks(self, blocks: list[KVBlock]) -> None:
        """Appends full blocks found in the prefix cache (one more reference each) to a block-aligned table."""
        assert self.num_tokens % self.block_size == 0, "cached blocks extend a block-aligned table only"
        self.pool.touch(blocks)
        self.blocks.extend(blocks)
        self._num_tokens += len(blocks) * self.block_size
        self._refresh_tail()

    def restore(self, num_tokens: int, num_freed: int, blocks: list[KVBlock]) -> None:
        """Refills an empty table with freshly allocated ``blocks`` (swap-in): ``num_freed`` ``None`` entries
        (slid out of a window) then ``blocks``, holding ``num_tokens`` tokens. Takes over their references."""
        assert not self.blocks and num_freed + len(blocks) == num_blocks_for(num_tokens, self.block_size)
        self.blocks = [None] * num_freed + list(blocks)
        self._num_freed = num_freed
        self._num_tokens = num_tokens
        self._refresh_tail()

    def fork(self) -> BlockTable:
        """A new table sharing every held block (one more reference each) and the same length."""
        child = BlockTable(self.pool, self.block_size)
        self.pool.touch(b for b in self.blocks if b is not None)
        child.blocks = list(self.blocks)
        child._num_tokens = self._num_tokens
        child._num_freed = self._num_freed
        self._refresh_tail()  # the tail is shared now: the next append copies it
        child._refresh_tail()
        return child

    def truncate(self, num_tokens: int) -> None:
        """Rolls back to ``num_tokens`` tokens; blocks wholly past the new end are freed, tail first.

        ValueError if ``num_tokens`` exceeds the current length or the new last token lies in a
        block already freed by ``free_blocks_before``.
        """
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"num_tokens must be in [0, {self.num_tokens}], got {num_tokens}")
        keep = num_blocks_for(num_tokens, self.block_size)
        if keep > 0 and self.blocks[keep - 1] is None:
            raise ValueError(
                f"cannot truncate to num_tokens={num_tokens}: position {num_tokens - 1} "
                f"was already freed by free_blocks_before"
            )
        dropped = [b for b in self.blocks[keep:] if b is not None]
        del self.blocks[keep:]
        self._num_freed = min(self._num_freed, keep)
        self._num_tokens = num_tokens
        self.pool.free_blocks(reversed(dropped))
        self._refresh_tail()

    def free_blocks_before(self, position: int) -> None:
        """Frees every block whose positions all lie below ``position`` (they become ``None``).

        Blocks are freed tail first. ValueError if ``position > num_tokens``.
        """
        if position > self.num_tokens:
            raise ValueError(f"position must be <= num_tokens={self.num_tokens}, got {position}")
        stop = max(position, 0) // self.block_size
        if stop <= self._num_freed:
            return
        dropped = self.blocks[self._num_freed:stop]
        self.blocks[self._num_freed:stop] = [None] * len(dropped)
        self._num_freed = stop
        self.pool.free_blocks(reversed(dropped))  # type: ignore[arg-type]
        self._refresh_tail()

    def free(self) -> None:
        """Releases every held block (tail first) and empties the table."""
        held = [b for b in self.blocks if b is not None]
        self.blocks = []
        self._num_tokens = 0
        self._num_freed = 0
        self._tail_private = False
        self.pool.free_blocks(reversed(held))
