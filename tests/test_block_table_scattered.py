"""Slots when a sequence's blocks are not consecutive in the pool (the normal case once blocks are freed and
reused). A fresh pool hands out ids 0, 1, 2, ..., where a slot computed from the first block's id
(``first_id * block_size + position``) looks right; these tables hold scattered ids.

Every check compares the slot mapping the attention metadata computes (``metadata.build_metadata``, from the
persistent block-table rows) with the definition, ``block_ids[p // block_size] * block_size + p % block_size``,
and checks that no two live positions share a slot and that the rows equal a rebuild from the tables.
"""

from __future__ import annotations

import pytest
import torch

from kv_probe import block_ids
from models import tiny_model
from paged_hf.kv.manager import KVManager
from paged_hf.metadata import build_metadata


@pytest.fixture(scope="module")
def config():
    return tiny_model("llama").config


def definition(seq, block_size: int, start: int, stop: int) -> list[int]:
    ids = block_ids(seq.tables[0])
    return [ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def consecutive(ids: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(ids, ids[1:]))


def append(kv: KVManager, seq, count: int) -> list[int]:
    """Appends ``count`` tokens to ``seq`` and returns the slots the metadata gives them."""
    start = seq.num_tokens
    kv.append(seq, count)
    kv.apply_copies(kv.take_copies())
    metadata = build_metadata(kv, [seq], [start], [count], num_decodes=int(count == 1), device="cpu")
    return metadata.groups[0].slot_mapping.tolist()


def assert_slots_are_a_bijection(kv: KVManager, *seqs) -> None:
    """One forward over every held position of ``seqs``: each gets its definition's slot, no two share one."""
    bs = kv.block_size
    metadata = build_metadata(kv, list(seqs), [0] * len(seqs), [s.num_tokens for s in seqs], 0, "cpu")
    slots = metadata.groups[0].slot_mapping.tolist()
    expected = [slot for s in seqs for slot in definition(s, bs, 0, s.num_tokens)]
    assert slots == expected
    assert len(set(slots)) == len(slots), "two positions share a slot"
    kv.check_invariants()  # includes: every row equals its table


def scattered(config, block_size=4):
    """A full pool of 9 blocks grown by three sequences in turn; the first and third are freed: the second keeps
    blocks 1, 4, 7 and the free queue holds the others, scattered."""
    kv = KVManager(config, block_size, "auto", num_blocks=9)
    seqs = [kv.new_sequence() for _ in range(3)]
    for _ in range(3):
        for seq in seqs:
            kv.append(seq, block_size)
    kv.discard(seqs[0])
    kv.discard(seqs[2])
    assert block_ids(seqs[1].tables[0]) == [1, 4, 7] and kv.num_free_blocks == 6
    return kv, seqs[1]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_interleaved_growth_gives_each_sequence_scattered_blocks(config, block_size):
    kv = KVManager(config, block_size, "auto", num_blocks=64)
    a, b = kv.new_sequence(), kv.new_sequence()
    for step, length in enumerate([3, 1, block_size, 2 * block_size + 1, 1, block_size - 1 or 1]):
        for seq in (a, b):
            start = seq.num_tokens
            new = append(kv, seq, length + step % 2)
            assert new == definition(seq, block_size, start, seq.num_tokens)
    assert not consecutive(block_ids(a.tables[0])) and not consecutive(block_ids(b.tables[0]))
    assert_slots_are_a_bijection(kv, a, b)


@pytest.mark.parametrize("start", [0, 1, 3, 4])
def test_one_append_across_reused_blocks(config, start):
    """A single append whose run spans several blocks that are not neighbours in the pool."""
    kv, held = scattered(config)
    seq = kv.new_sequence()
    if start:
        append(kv, seq, start)
    new = append(kv, seq, 13)
    assert not consecutive(block_ids(seq.tables[0])), block_ids(seq.tables[0])
    assert new == definition(seq, 4, start, start + 13)
    assert_slots_are_a_bijection(kv, seq, held)


def test_copy_on_write_into_a_reused_block(config):
    kv, held = scattered(config)
    parent = kv.new_sequence()
    append(kv, parent, 6)  # two reused blocks, the second half full
    child = kv.fork(parent)
    kv.append(child, 5)  # the copied tail, then a new block
    (copy,) = kv.take_copies()
    assert copy.src == (block_ids(parent.tables[0])[1],) and copy.dst == (block_ids(child.tables[0])[1],)
    assert copy.dst != copy.src and not consecutive(block_ids(child.tables[0]))
    metadata = build_metadata(kv, [child], [6], [5], 0, "cpu")
    assert metadata.groups[0].slot_mapping.tolist() == definition(child, 4, 6, 11)
    assert append(kv, parent, 3) == definition(parent, 4, 6, 9)  # the parent owns its tail alone again
    assert not kv.take_copies()
    assert definition(parent, 4, 0, 4) == definition(child, 4, 0, 4)  # the shared first block
    own = set(definition(child, 4, 4, 11)) | set(definition(parent, 4, 4, 9))
    assert len(own) == 12 and not own & set(definition(held, 4, 0, held.num_tokens))
    kv.check_invariants()


def test_truncate_then_regrow_on_reused_blocks(config):
    kv, held = scattered(config)
    seq = kv.new_sequence()
    append(kv, seq, 14)
    kv.truncate(seq, 5)
    other = kv.new_sequence()
    append(kv, other, 7)  # takes the blocks the truncate freed, among others
    assert append(kv, seq, 10) == definition(seq, 4, 5, 15)
    assert not consecutive(block_ids(seq.tables[0])), block_ids(seq.tables[0])
    assert_slots_are_a_bijection(kv, seq, other, held)


def test_rows_after_many_appends_and_frees_equal_a_rebuild(config):
    """The persistent rows, updated in place through appends, forks, copy-on-write, truncation, window frees and
    frees, equal block tables rebuilt from scratch (what the metadata gathers for a forward)."""
    kv = KVManager(tiny_model("mistral").config, 2, "auto", num_blocks=200)  # sliding window 6
    generator = torch.Generator().manual_seed(0)
    live = []
    for step in range(300):
        action = int(torch.randint(0, 6, (1,), generator=generator))
        if action <= 2 or not live:
            seq = kv.new_sequence() if action == 0 or not live else live[int(torch.randint(0, len(live), (1,),
                                                                                          generator=generator))]
            if seq not in live:
                live.append(seq)
            kv.slide_windows(seq)
            count = int(torch.randint(1, 5, (1,), generator=generator))
            kv.try_append(seq, count)
        elif action == 3:
            live.append(kv.fork(live[int(torch.randint(0, len(live), (1,), generator=generator))]))
        elif action == 4:
            seq = live[int(torch.randint(0, len(live), (1,), generator=generator))]
            if seq.num_tokens > 1 and seq.tables[0].num_freed == 0:
                kv.truncate(seq, seq.num_tokens - 1)
        else:
            kv.discard(live.pop(int(torch.randint(0, len(live), (1,), generator=generator))))
        kv.take_copies()
    assert live
    width = max(len(s.tables[0].blocks) for s in live)
    rows = torch.tensor([s.row for s in live])
    gathered = kv.groups[0].rows.gather(rows, width)
    rebuilt = torch.tensor([[max(b, 0) for b in block_ids(s.tables[0])] + [0] * (width - len(s.tables[0].blocks))
                            for s in live], dtype=gathered.dtype)
    assert torch.equal(gathered, rebuilt)
    kv.check_invariants()
