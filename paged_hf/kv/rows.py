"""Sequence rows: each sequence that holds device blocks holds one row, the same index in every group's
``BlockTableRows`` and, for a format with a full-precision tail (int4), in every layer's tail pools. Rows are
reused (last freed, first taken); the tail pools and the recurrent states grow with the number of rows ever handed
out.
"""

from __future__ import annotations

from .layer_groups import LayerGroup
from .recurrent import RecurrentStates
from .sequence import SequenceKV


class RowAllocator:
    """Hands out rows and keeps each held row equal to its sequence's tables (0 where a block is freed)."""

    def __init__(self, groups: list[LayerGroup], has_tail: bool, states: RecurrentStates | None = None) -> None:
        self.groups = groups
        self.has_tail = has_tail
        self.states = states  # recurrent layers' states: a row for each row handed out
        self.num_rows = 0  # rows handed out so far
        self._free: list[int] = []

    def take(self) -> int:
        if self._free:
            return self._free.pop()
        self.num_rows += 1
        self._cover_tails()
        return self.num_rows - 1

    def cover(self, num_rows: int) -> None:
        """Tail rows for ``num_rows`` rows in every layer (a tensor-parallel follower takes no rows itself)."""
        if self.has_tail and num_rows > self.num_rows:
            self.num_rows = num_rows
            self._cover_tails()

    def _cover_tails(self) -> None:
        """Every layer's tail pools (and the recurrent states) hold a row for each row handed out (after a layer's
        storage is made, too)."""
        if self.states is not None:
            self.states.ensure_rows(self.num_rows)
        if self.has_tail:
            for group in self.groups:
                for storage in group.storages.values():
                    storage.ensure_tail_rows(self.num_rows)

    def release(self, seq: SequenceKV) -> None:
        """Clears and hands back ``seq``'s row (it then holds none: -1)."""
        if seq.row >= 0:
            for group, table in zip(self.groups, seq.tables):
                group.rows.clear(seq.row, 0, len(table.blocks))
            self._free.append(seq.row)
            seq.row = -1

    def write(self, seq: SequenceKV, start: int = 0) -> None:
        """Copies each group's table entries from ``start`` on into ``seq``'s row (0 for freed entries)."""
        for group, table in zip(self.groups, seq.tables):
            group.rows.write(seq.row, start, [0 if b is None else b.block_id for b in table.blocks[start:]])
