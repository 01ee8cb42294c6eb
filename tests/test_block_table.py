"""BlockTable: slot arithmetic, copy-on-write, fork, truncate, sliding-window frees, atomicity."""

import pytest
import torch

from kv_probe import block_ids, free_order
from paged_hf.block_pool import BlockPool, NoFreeBlocksError
from paged_hf.block_table import BlockTable, num_blocks_for


def expected_slots(block_ids, block_size, start, stop):
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def slot_of(table, position):
    """Where ``position`` of ``table`` lives: what the attention metadata computes from the table's row."""
    block = table.blocks[position // table.block_size]
    assert block is not None, f"position {position} was freed"
    return block.block_id * table.block_size + position % table.block_size


def append_slots(table, num_new_tokens):
    """``table.append`` plus the slots of the new positions, for checking the layout."""
    start = table.num_tokens
    copies = table.append(num_new_tokens)
    return [slot_of(table, p) for p in range(start, start + num_new_tokens)], copies


def snapshot(pool, *tables):
    return (
        free_order(pool),
        [b.ref_cnt for b in pool.blocks],
        [(block_ids(t), t.num_tokens) for t in tables],
    )


def test_num_blocks_for():
    assert [num_blocks_for(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert num_blocks_for(17, 16) == 2
    with pytest.raises(ValueError, match="block_size"):
        num_blocks_for(3, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        num_blocks_for(-1, 4)


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(BlockPool(2), 0)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("length", [1, 15, 16, 17])
def test_append_slots_in_one_call(block_size, length):
    pool = BlockPool(8)
    pool.get_new_blocks(1)  # make block ids differ from logical indices
    table = BlockTable(pool, block_size)
    assert table.num_new_blocks_needed(length) == num_blocks_for(length, block_size)
    slots, copies = append_slots(table, length)
    assert copies == []
    assert table.num_tokens == length
    assert len(table.blocks) == num_blocks_for(length, block_size)
    assert block_ids(table) == list(range(1, 1 + len(table.blocks)))
    assert slots == expected_slots(block_ids(table), block_size, 0, length)
    assert slots[0] == block_size  # block 1, offset 0
    assert [slot_of(table, p) for p in range(length)] == slots
    pool.check_invariants()


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("length", [1, 15, 16, 17])
def test_append_slots_token_by_token_matches_bulk(block_size, length):
    pool = BlockPool(8)
    table = BlockTable(pool, block_size)
    slots = []
    for _ in range(length):
        new, copies = append_slots(table, 1)
        assert copies == [] and len(new) == 1
        slots += new
    assert slots == expected_slots(block_ids(table), block_size, 0, length)
    assert len(set(slots)) == length


def test_append_across_boundary_after_prefill():
    pool = BlockPool(8)
    table = BlockTable(pool, 4)
    assert append_slots(table, 3) == ([0, 1, 2], [])
    assert table.num_new_blocks_needed(2) == 1
    assert append_slots(table, 2) == ([3, 4], [])  # fills block 0, opens block 1
    assert block_ids(table) == [0, 1]
    assert append_slots(table, 0) == ([], [])
    with pytest.raises(ValueError, match="num_new_tokens"):
        append_slots(table, -1)


def test_fork_of_partial_tail_copies_on_write():
    pool = BlockPool(8)
    parent = BlockTable(pool, 4)
    append_slots(parent, 6)  # blocks 0 (full), 1 (2 of 4)
    child = parent.fork()
    assert block_ids(child) == [0, 1] and child.num_tokens == 6
    assert [b.ref_cnt for b in pool.blocks[:2]] == [2, 2]
    assert child.num_new_blocks_needed(1) == 1  # the copy
    slots, copies = append_slots(child, 1)
    assert copies == [(1, 2)]
    assert slots == [2 * 4 + 2]
    assert block_ids(child) == [0, 2] and block_ids(parent) == [0, 1]
    assert [b.ref_cnt for b in pool.blocks[:3]] == [2, 1, 1]
    # The parent now owns block 1 alone: it writes in place.
    assert parent.num_new_blocks_needed(1) == 0
    assert append_slots(parent, 1) == ([1 * 4 + 2], [])
    pool.check_invariants()


def test_a_parent_that_appends_first_after_a_fork_copies_its_tail_too():
    """Either side of a fork copies a shared partial tail, the one that had it before included (its cached
    in-place flag must not outlive the fork), and the side left alone with the block writes it in place again."""
    pool = BlockPool(8)
    parent = BlockTable(pool, 4)
    append_slots(parent, 2)
    assert parent.append_in_tail()  # private: in place (3 of 4)
    child = parent.fork()
    assert not parent.append_in_tail() and not child.append_in_tail() and parent.num_tokens == 3
    slots, copies = append_slots(parent, 1)
    assert copies == [(0, 1)] and slots == [1 * 4 + 3]
    child.truncate(2)  # block 0 is the child's alone now: its next token goes in place
    assert child.append_in_tail() and child.num_tokens == 3
    pool.check_invariants()


def test_cow_and_new_block_in_one_append():
    pool = BlockPool(8)
    parent = BlockTable(pool, 4)
    append_slots(parent, 3)
    child = parent.fork()
    assert child.num_new_blocks_needed(3) == 2
    slots, copies = append_slots(child, 3)  # 1 into the copied tail, 2 into a new block
    assert copies == [(0, 1)]
    assert block_ids(child) == [1, 2]
    assert slots == [1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]


def test_fork_of_full_blocks_shares_without_copies():
    pool = BlockPool(8)
    parent = BlockTable(pool, 4)
    append_slots(parent, 8)
    child = parent.fork()
    assert child.num_new_blocks_needed(1) == 1
    slots, copies = append_slots(child, 1)
    assert copies == []
    assert block_ids(child) == [0, 1, 2] and slots == [8]
    assert [b.ref_cnt for b in pool.blocks[:3]] == [2, 2, 1]
    child.free()
    assert [b.ref_cnt for b in pool.blocks[:3]] == [1, 1, 0]
    parent.free()
    assert pool.num_used_blocks == 0
    pool.check_invariants()


def test_hashed_partial_tail_after_truncate_is_copied():
    pool = BlockPool(4)
    table = BlockTable(pool, 4)
    append_slots(table, 4)
    pool.cache_full_block(table.blocks[0], 77, [1, 2, 3, 4])
    table.truncate(2)  # block 0 is now a partial tail but its cached contents must survive
    slots, copies = append_slots(table, 1)
    assert copies == [(0, 1)] and slots == [1 * 4 + 2]
    assert pool.get_cached_block(77, [1, 2, 3, 4]) is pool.blocks[0]
    assert pool.blocks[0].ref_cnt == 0 and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_truncate_frees_trailing_blocks_in_reverse():
    pool = BlockPool(6)
    table = BlockTable(pool, 4)
    append_slots(table, 13)  # blocks 0..3
    table.truncate(5)
    assert table.num_tokens == 5 and block_ids(table) == [0, 1]
    assert free_order(pool) == [4, 5, 3, 2]
    table.truncate(5)  # no-op
    assert block_ids(table) == [0, 1]
    assert append_slots(table, 1) == ([1 * 4 + 1], [])
    table.truncate(0)
    assert table.blocks == [] and pool.num_used_blocks == 0
    with pytest.raises(ValueError, match="num_tokens"):
        table.truncate(1)
    with pytest.raises(ValueError, match="num_tokens"):
        table.truncate(-1)
    pool.check_invariants()


def test_free_releases_tail_first():
    pool = BlockPool(5)
    table = BlockTable(pool, 2)
    append_slots(table, 5)  # blocks 0, 1, 2
    table.free()
    assert table.blocks == [] and table.num_tokens == 0
    assert free_order(pool) == [3, 4, 2, 1, 0]
    table.free()  # freeing an empty table is a no-op
    assert pool.num_used_blocks == 0
    pool.check_invariants()


def test_free_blocks_before_sliding_window():
    pool = BlockPool(8)
    table = BlockTable(pool, 4)
    append_slots(table, 10)  # blocks 0, 1, 2 (2 of 4)
    table.free_blocks_before(3)  # block 0 still holds position 3
    assert block_ids(table) == [0, 1, 2]
    table.free_blocks_before(8)
    assert block_ids(table) == [-1, -1, 2]
    assert free_order(pool)[-2:] == [1, 0]  # freed tail first
    table.free_blocks_before(8)  # idempotent
    assert block_ids(table) == [-1, -1, 2] and pool.num_used_blocks == 1
    assert slot_of(table, 9) == 2 * 4 + 1
    assert table.blocks[5 // 4] is None and table.num_freed == 2
    with pytest.raises(ValueError, match="position"):
        table.free_blocks_before(11)
    # Appending continues after the freed prefix; the freed entries stay None.
    append_slots(table, 3)
    assert block_ids(table)[:2] == [-1, -1] and table.num_tokens == 13
    # Rolling back into freed blocks is refused; rolling back to held ones works.
    with pytest.raises(ValueError, match="num_tokens"):
        table.truncate(7)
    table.truncate(9)
    assert block_ids(table) == [-1, -1, 2]
    table.free()
    assert pool.num_used_blocks == 0 and table.num_tokens == 0 and table.blocks == []
    pool.check_invariants()


def test_free_blocks_before_whole_table_then_append():
    pool = BlockPool(4)
    table = BlockTable(pool, 2)
    append_slots(table, 4)
    table.free_blocks_before(4)
    assert block_ids(table) == [-1, -1] and pool.num_used_blocks == 0
    assert free_order(pool) == [2, 3, 1, 0]
    assert append_slots(table, 1) == ([2 * 2 + 0], [])  # the queue head: never-used block 2
    assert block_ids(table) == [-1, -1, 2]


def test_fork_keeps_freed_prefix():
    pool = BlockPool(8)
    table = BlockTable(pool, 2)
    append_slots(table, 5)
    table.free_blocks_before(4)
    child = table.fork()
    assert block_ids(child) == [-1, -1, 2]
    assert pool.blocks[2].ref_cnt == 2
    child.free()
    table.free()
    assert pool.num_used_blocks == 0
    pool.check_invariants()


def test_append_failure_changes_nothing():
    pool = BlockPool(3)
    parent = BlockTable(pool, 4)
    append_slots(parent, 6)  # blocks 0, 1
    child = parent.fork()
    before = snapshot(pool, parent, child)
    # The child needs a copy of block 1 plus one new block: 2 > 1 free.
    assert child.num_new_blocks_needed(3) == 2
    with pytest.raises(NoFreeBlocksError) as info:
        append_slots(child, 3)
    assert info.value.num_needed == 2 and info.value.num_free == 1
    assert snapshot(pool, parent, child) == before
    pool.check_invariants()
    # A smaller append fits.
    assert append_slots(child, 2) == ([2 * 4 + 2, 2 * 4 + 3], [(1, 2)])
    pool.check_invariants()


def test_append_failure_on_fresh_table():
    pool = BlockPool(2)
    table = BlockTable(pool, 4)
    with pytest.raises(NoFreeBlocksError):
        append_slots(table, 9)
    assert table.blocks == [] and table.num_tokens == 0 and pool.num_free_blocks == 2


def test_copied_block_table_rows_write_their_own_table():
    """A deep copy or a pickle of the rows (a cache copied for each continuation) writes through a view of its own
    table: the view is not copied apart from the tensor it shows."""
    import copy
    import pickle

    from paged_hf.block_table_rows import BlockTableRows

    rows = BlockTableRows(2, 4)
    rows.write(0, 0, [5, 6])
    for clone in (copy.deepcopy(rows), pickle.loads(pickle.dumps(rows))):
        clone.write(0, 2, [7])
        clone.write(5, 0, [9])  # grows the copy's table
        assert clone.gather(torch.tensor([0, 5]), 3).tolist() == [[5, 6, 7], [9, 0, 0]]
        assert rows.gather(torch.tensor([0]), 3).tolist() == [[5, 6, 0]]
