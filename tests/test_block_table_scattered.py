"""BlockTable slots when a sequence's blocks are not consecutive in the pool (the normal case once blocks are freed
and reused): ``test_block_table.py`` builds its tables from a fresh pool, where block ids come out 0, 1, 2, ... and
a slot computed from the first block's id (``first_id * block_size + position``) looks right.

Every check here compares slots with the definition, ``block_ids[p // block_size] * block_size + p % block_size``,
on tables whose block ids are not consecutive, and checks that no two live positions share a slot.
"""

from __future__ import annotations

import pytest

from paged_hf.block_pool import BlockPool
from paged_hf.block_table import BlockTable


def expected_slots(table: BlockTable, start: int, stop: int) -> list[int]:
    bs, ids = table.block_size, table.block_ids
    return [ids[p // bs] * bs + p % bs for p in range(start, stop)]


def consecutive(ids: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(ids, ids[1:]))


def assert_slots_are_a_bijection(*tables: BlockTable) -> None:
    """Each held position has the slot of its definition (``slot``), and no two positions of the tables share one."""
    seen = set()
    for table in tables:
        slots = [table.slot(p) for p in range(table.num_tokens)]
        assert slots == expected_slots(table, 0, table.num_tokens)
        seen.update(slots)
    assert len(seen) == sum(t.num_tokens for t in tables), "two positions share a slot"


def scattered_pool(block_size=4) -> tuple[BlockPool, BlockTable]:
    """A full pool of 9 blocks grown by three tables in turn; the first and the third are freed: the free queue is
    6, 3, 0, 8, 5, 2 (each table frees its tail first), and the second table keeps 1, 4, 7."""
    pool = BlockPool(9)
    tables = [BlockTable(pool, block_size) for _ in range(3)]
    for _ in range(3):
        for table in tables:
            table.append_slots(block_size)
    tables[0].free()
    tables[2].free()
    assert tables[1].block_ids == [1, 4, 7] and pool.num_free_blocks == 6
    return pool, tables[1]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_interleaved_growth_gives_each_table_scattered_blocks(block_size):
    pool = BlockPool(64)
    a, b = BlockTable(pool, block_size), BlockTable(pool, block_size)
    slots_a, slots_b = [], []
    for step, length in enumerate([3, 1, block_size, 2 * block_size + 1, 1, block_size - 1 or 1]):
        for table, slots in ((a, slots_a), (b, slots_b)):
            start = table.num_tokens
            new, copies = table.append_slots(length + step % 2)
            assert copies == [] and new == expected_slots(table, start, table.num_tokens)
            slots.extend(new)
    assert not consecutive(a.block_ids) and not consecutive(b.block_ids)
    assert slots_a == expected_slots(a, 0, a.num_tokens) and slots_b == expected_slots(b, 0, b.num_tokens)
    assert_slots_are_a_bijection(a, b)
    pool.check_invariants()


@pytest.mark.parametrize("start", [0, 1, 3, 4])
def test_one_append_across_reused_blocks(start):
    """A single ``append_slots`` call whose run spans several blocks that are not neighbours in the pool."""
    pool, held = scattered_pool()
    table = BlockTable(pool, 4)
    if start:
        table.append_slots(start)
    new, copies = table.append_slots(13)
    assert copies == []
    assert not consecutive(table.block_ids), table.block_ids
    assert new == expected_slots(table, start, start + 13)
    assert_slots_are_a_bijection(table, held)
    pool.check_invariants()


def test_copy_on_write_into_a_reused_block():
    pool, held = scattered_pool()
    parent = BlockTable(pool, 4)
    parent.append_slots(6)  # two reused blocks, the second half full
    child = parent.fork()
    new, copies = child.append_slots(5)  # the copied tail, then a new block
    (src, dst), = copies
    assert src == parent.block_ids[1] and dst == child.block_ids[1] and dst != src
    assert new == expected_slots(child, 6, 11)
    assert not consecutive(child.block_ids), child.block_ids
    parent_new, parent_copies = parent.append_slots(3)  # the parent owns its tail alone again: in place
    assert parent_copies == [] and parent_new == expected_slots(parent, 6, 9)
    # shared positions 0..3 have the same slots in both; every other position is the table's own
    assert [parent.slot(p) for p in range(4)] == [child.slot(p) for p in range(4)]
    own = {child.slot(p) for p in range(4, 11)} | {parent.slot(p) for p in range(4, 9)}
    assert len(own) == 12 and not own & {held.slot(p) for p in range(held.num_tokens)}
    pool.check_invariants()


def test_truncate_then_regrow_on_reused_blocks():
    pool, held = scattered_pool()
    table = BlockTable(pool, 4)
    table.append_slots(14)
    table.truncate(5)
    other = BlockTable(pool, 4)
    other.append_slots(7)  # takes the blocks the truncate freed, among others
    new, _ = table.append_slots(10)
    assert new == expected_slots(table, 5, 15)
    assert not consecutive(table.block_ids), table.block_ids
    assert_slots_are_a_bijection(table, other, held)
    pool.check_invariants()
