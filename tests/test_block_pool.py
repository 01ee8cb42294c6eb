"""BlockPool, FreeBlockQueue and block hashing."""

import time

import pytest

from paged_hf.block_pool import BlockPool, FreeBlockQueue, KVBlock, NoFreeBlocksError
from kv_probe import free_order
from paged_hf.hashing import extend_block_hashes, hash_block_tokens


def queue_ids(pool: BlockPool) -> list[int]:
    return free_order(pool)


# ---------------------------------------------------------------- FreeBlockQueue


def test_free_queue_popleft_append_remove_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5
    assert [b.block_id for b in q.blocks()] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert [b.block_id for b in q.blocks()] == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q.blocks()] == [1, 3, 4, 2, 0]
    q.remove(blocks[0])  # tail
    q.remove(blocks[1])  # head
    assert [b.block_id for b in q.blocks()] == [3, 4, 2]
    assert len(q) == 3


def test_free_queue_popleft_empty_raises():
    q = FreeBlockQueue([])
    with pytest.raises(IndexError):
        q.popleft()
    b = KVBlock(0)
    q.append(b)
    assert q.popleft() is b
    assert len(q) == 0


# ---------------------------------------------------------------- allocation order


def test_new_pool_and_allocation_ids():
    pool = BlockPool(6)
    assert pool.num_blocks == 6 and pool.num_free_blocks == 6 and pool.num_used_blocks == 0
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert queue_ids(pool) == [3, 4, 5]
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 3
    pool.check_invariants()


def test_free_in_reverse_order_evicts_tail_first():
    pool = BlockPool(4)
    seq = pool.get_new_blocks(3)  # ids 0, 1, 2
    pool.free_blocks(reversed(seq))
    assert queue_ids(pool) == [3, 2, 1, 0]
    # The next allocation takes the never-used block, then the sequence's tail block.
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]
    pool.check_invariants()


def test_shared_block_returns_to_queue_only_at_ref_zero():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and b.block_id not in queue_ids(pool)
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and queue_ids(pool)[-1] == b.block_id
    pool.check_invariants()


def test_get_zero_blocks_and_negative():
    pool = BlockPool(2)
    assert pool.get_new_blocks(0) == []
    with pytest.raises(ValueError, match="num_blocks"):
        pool.get_new_blocks(-1)


def test_no_free_blocks_error_leaves_pool_unchanged():
    pool = BlockPool(4)
    used = pool.get_new_blocks(2)
    pool.cache_full_block(used[0], 11, [1, 2])
    pool.free_blocks([used[0]])  # cached, at the queue tail
    before = (queue_ids(pool), [b.ref_cnt for b in pool.blocks], used[0].block_hash)
    with pytest.raises(NoFreeBlocksError) as info:
        pool.get_new_blocks(4)
    assert info.value.num_needed == 4 and info.value.num_free == 3
    assert "4" in str(info.value) and "3" in str(info.value)
    assert (queue_ids(pool), [b.ref_cnt for b in pool.blocks], used[0].block_hash) == before
    assert pool.get_cached_block(11, [1, 2]) is used[0]
    pool.check_invariants()


def test_num_blocks_must_not_be_negative_and_an_empty_pool_grows():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-3)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(2.5)
    pool = BlockPool(0)  # a growable cache's pool before its first forward
    assert pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    pool.grow(2)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]
    pool.check_invariants()


def test_huge_pool_constructs_without_an_object_per_block():
    start = time.perf_counter()
    pool = BlockPool(10_000_000)
    # ~5 s with an object per block; the bound is loose so that a loaded machine cannot fail it
    assert time.perf_counter() - start < 1.0
    assert pool.num_free_blocks == 10_000_000
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    pool.free_blocks(reversed(got))
    assert pool.num_free_blocks == 10_000_000 and pool.num_used_blocks == 0
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 4]  # fresh before recycled
    pool.check_invariants()  # O(blocks made), not O(num_blocks)


def test_grow_adds_fresh_blocks_handed_out_before_recycled_ones():
    pool = BlockPool(2)
    a = pool.get_new_blocks(1)
    pool.free_blocks(a)  # queue: 1 (fresh), 0 (recycled)
    pool.grow(3)
    assert pool.num_blocks == 5
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3, 4]
    assert queue_ids(pool) == [1, 2, 3, 4, 0]  # never-used ids first: a recycled (maybe cached) block lives longest
    pool.grow(0)
    assert pool.num_blocks == 5
    with pytest.raises(ValueError, match="num_new_blocks"):
        pool.grow(-1)
    pool.check_invariants()


# ---------------------------------------------------------------- prefix caching


def test_cache_hit_is_verified_against_tokens():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, 1234, [5, 6, 7, 8])
    assert b.block_hash == 1234 and b.token_ids == (5, 6, 7, 8)
    assert pool.get_cached_block(1234, [5, 6, 7, 8]) is b
    assert pool.get_cached_block(1234, (5, 6, 7, 9)) is None  # a collision: same hash, other tokens
    assert pool.get_cached_block(999, [5, 6, 7, 8]) is None
    assert b.ref_cnt == 1  # lookups do not touch
    pool.check_invariants()


def test_touch_removes_cached_block_from_middle_of_queue():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, 100 + i, [i])
    pool.free_blocks(blocks)
    assert queue_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.num_cached_blocks == 5 and pool.num_used_blocks == 0
    hit = pool.get_cached_block(102, [2])
    assert hit is blocks[2]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_hash == 102
    assert queue_ids(pool) == [0, 1, 3, 4]
    assert pool.num_cached_blocks == 4 and pool.num_used_blocks == 1
    pool.check_invariants()


def test_reuse_of_cached_block_evicts_its_hash():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 7, [1])
    pool.free_blocks([a])
    assert pool.num_cached_blocks == 1
    (c,) = pool.get_new_blocks(1)
    assert c is a
    assert c.block_hash is None and c.token_ids is None and c.ref_cnt == 1
    assert pool.get_cached_block(7, [1]) is None
    assert pool.num_cached_blocks == 0
    pool.check_invariants()


def test_duplicate_hash_keeps_existing_entry():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 42, [1, 2])
    pool.cache_full_block(b, 42, [1, 2])
    assert b.block_hash is None and b.token_ids is None
    assert pool.get_cached_block(42, [1, 2]) is a
    pool.check_invariants()


def test_cache_full_block_twice_is_an_internal_error():
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, 1, [0])
    with pytest.raises(AssertionError):
        pool.cache_full_block(a, 2, [0])


def test_caching_disabled():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, 5, [1])
    assert a.block_hash is None
    assert pool.get_cached_block(5, [1]) is None
    pool.check_invariants()


def test_without_caching_freed_blocks_go_first_so_the_ids_in_use_stay_low():
    """The swap space's pools have no caching, and its CPU storage grows to ``high_water``: handing out fresh ids before
    freed ones made it grow with every swap-out (up to the whole swap space) where it must follow the most held."""
    pool = BlockPool(1000, enable_caching=False)
    for _ in range(50):
        held = pool.get_new_blocks(7)
        pool.free_blocks(reversed(held[3:]))
        pool.free_blocks(held[:3])
        assert queue_ids(pool)[:7] == [b.block_id for b in pool._recycled.blocks()]
    assert pool.high_water == 7
    more = pool.get_new_blocks(9)  # the 7 freed, then 2 fresh
    assert sorted(b.block_id for b in more) == list(range(9)) and pool.high_water == 9
    pool.check_invariants()


def test_check_invariants_detects_corruption():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.check_invariants()
    a.ref_cnt = 0  # used block not in queue with ref 0
    with pytest.raises(AssertionError, match="ref_cnt"):
        pool.check_invariants()
    a.ref_cnt = 1
    a.block_hash = 9  # hashed without map entry / token ids
    with pytest.raises(AssertionError):
        pool.check_invariants()


# ---------------------------------------------------------------- hashing


def test_hash_is_deterministic_and_64_bit():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert h == hash_block_tokens(None, (1, 2, 3, 4))
    assert 0 <= h < 2**64
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h
    assert hash_block_tokens(None, [4, 3, 2, 1]) != h


def test_hash_values_are_pinned():
    # Fixed values: the hash must not depend on the process (PYTHONHASHSEED), run or machine (token ids are encoded
    # as 64-bit little-endian integers since 2026-12-07: these values changed with that encoding).
    assert hash_block_tokens(None, [1, 2, 3], ("lora", 7)) == 4929132317351959778
    assert hash_block_tokens(12345, [0]) == 318160708144797255
    assert extend_block_hashes([], list(range(8)), 4) == [13532639754521349108, 3381610061461840826]
    assert hash_block_tokens(None, [1, 2], ["a", ["b"]]) == hash_block_tokens(None, [1, 2], ("a", ("b",)))


def test_hash_chaining_parent_and_extra_keys():
    base = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(0, [1, 2]) != base  # None parent is not parent 0
    assert hash_block_tokens(base, [1, 2]) != hash_block_tokens(base + 1, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("a",)) != base
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1, 2], ("b",))
    assert hash_block_tokens(None, [1, 2], ("1",)) != hash_block_tokens(None, [1, 2], (1,))
    with pytest.raises(ValueError, match="extra_keys"):
        hash_block_tokens(None, [1], (object(),))
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(None, [1.5])


def test_block_hashes_chain_full_blocks_only_and_extend():
    tokens = list(range(10))
    hashes = extend_block_hashes([], tokens, 4)
    assert len(hashes) == 2  # tokens 8, 9 form a partial tail: not hashed
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]
    assert extend_block_hashes([], tokens[:8], 4) == hashes
    assert extend_block_hashes([], tokens[:3], 4) == []
    # Same second block after a different first block: different hash.
    other = extend_block_hashes([], [9, 9, 9, 9, 4, 5, 6, 7], 4)
    assert other[1] != hashes[1]
    assert extend_block_hashes([], tokens, 4, extra_keys=("x",)) != hashes
    grown = extend_block_hashes([], tokens[:5], 4)  # one block, then extended as tokens arrive
    assert extend_block_hashes(grown, tokens, 4) is grown and grown == hashes
    with pytest.raises(ValueError, match="block_size"):
        extend_block_hashes([], tokens, 0)


def test_uncache_block_in_use_and_cached():
    pool = BlockPool(4)
    used, cached = pool.get_new_blocks(2)
    pool.cache_full_block(used, 11, (1, 2))
    pool.cache_full_block(cached, 12, (3, 4))
    pool.free_blocks([cached])
    assert pool.num_cached_blocks == 1
    pool.uncache_block(used)  # still in use: only the hash goes
    pool.uncache_block(cached)  # in the free queue: it becomes a plain free block
    assert used.block_hash is None and cached.block_hash is None and used.ref_cnt == 1
    assert pool.get_cached_block(11, (1, 2)) is None and pool.get_cached_block(12, (3, 4)) is None
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 3
    pool.check_invariants()
    with pytest.raises(AssertionError, match="not hashed"):
        pool.uncache_block(used)
