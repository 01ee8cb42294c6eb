"""The audit of a ``KVManager``'s bookkeeping across its pools and sequences (each pool audits itself too).

Checked: every pool's own invariants (``BlockPool.check_invariants``); each block's ref count equals the number of
tables holding it; no two sequences share a block-table row; every held row mirrors its tables; a table that would
write its partial tail in place (``BlockTable.append_in_tail``) owns it alone and it is not in the prefix cache. A
failure raises ``KVInvariantError``, an ``AssertionError`` raised explicitly, so the audit runs under ``python -O``
too.
"""

from __future__ import annotations

from .layer_groups import LayerGroup
from .sequence import SequenceKV


class KVInvariantError(AssertionError):
    """The KV bookkeeping is inconsistent (a bug, never bad input)."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise KVInvariantError(message)


def check_manager(groups: list[LayerGroup], live: list[SequenceKV]) -> None:
    """Audits ``groups``' pools and rows against the tables of the ``live`` sequences (every one not discarded)."""
    rows = [seq.row for seq in live if seq.row >= 0]
    _check(len(rows) == len(set(rows)), f"two sequences share a block-table row: {sorted(rows)}")
    for g, group in enumerate(groups):
        group.pool.check_invariants()
        refs: dict[int, int] = {}
        for seq in live:
            for block in seq.tables[g].blocks:
                if block is not None:
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in group.pool.blocks[: group.pool.high_water]:
            _check(block.ref_cnt == refs.get(block.block_id, 0),
                   f"{group.name}: block {block.block_id} has ref_cnt {block.ref_cnt} but "
                   f"{refs.get(block.block_id, 0)} tables hold it")
        for seq in live:
            table = seq.tables[g]
            if table.num_tokens % table.block_size and table._tail_private:  # noqa: SLF001 - the audit reads it
                tail = table.blocks[-1]
                _check(tail.ref_cnt == 1 and tail.block_hash is None,
                       f"{group.name}: a table would write block {tail.block_id} in place (ref_cnt {tail.ref_cnt}, "
                       f"hash {tail.block_hash})")
            if seq.row >= 0:
                expected = [0 if b is None else b.block_id for b in seq.tables[g].blocks]
                actual = group.rows.table[seq.row, : len(expected)].tolist() if expected else []
                _check(actual == expected, f"{group.name}: row {seq.row} holds {actual}, its table {expected}")
