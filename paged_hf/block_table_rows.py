"""The block tables of one layer group's live sequences as one host tensor: one row per sequence.

``table[row, i]`` is the id of block ``i`` of the sequence that holds ``row``, and 0 where it holds none (past its
end, or slid out of a sliding window: attention never reads those positions, and block 0 is a valid id to read).
The ``KVManager`` updates rows in place as blocks are appended, copied on write, slid out or freed, so a forward
gathers its block tables with one ``index_select`` instead of rebuilding them from Python lists.
"""

from __future__ import annotations

import torch

TABLE_DTYPE = torch.int32


class BlockTableRows:
    """``table``: ``[num_rows, width]`` int32 on the host; both dimensions grow by doubling. Writes go through
    ``_entries``, a NumPy view of the same memory: a row's new block id is a slice assignment, not two torch ops
    (5 us, once a block per sequence: the decode steps of 256 sequences write 16 rows a step)."""

    def __init__(self, num_rows: int = 8, width: int = 16) -> None:
        self._set(torch.zeros((max(1, num_rows), max(1, width)), dtype=TABLE_DTYPE))

    def _set(self, table: torch.Tensor) -> None:
        self.table = table
        self._entries = table.numpy()

    def __getstate__(self) -> dict:
        return {"table": self.table}

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy`` of a cache, a pickle) writes through a view of its own table, not of the
        original's copied separately."""
        self._set(state["table"])

    def _ensure(self, num_rows: int, width: int) -> None:
        rows, cols = self.table.shape
        if num_rows <= rows and width <= cols:
            return
        while rows < num_rows:
            rows *= 2
        while cols < width:
            cols *= 2
        grown = torch.zeros((rows, cols), dtype=TABLE_DTYPE)
        grown[: self.table.shape[0], : self.table.shape[1]] = self.table
        self._set(grown)

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Sets ``table[row, start : start + len(block_ids)]``."""
        if block_ids:
            self._ensure(row + 1, start + len(block_ids))
            self._entries[row, start : start + len(block_ids)] = block_ids

    def clear(self, row: int, start: int = 0, stop: int | None = None) -> None:
        """Zeroes ``table[row, start:stop]`` (entries the row's sequence no longer holds)."""
        if row < self.table.shape[0]:
            self._entries[row, start:stop] = 0

    def gather(self, rows: torch.Tensor, width: int, num_rows: int | None = None) -> torch.Tensor:
        """``[len(rows), width]``: the tables of ``rows`` (int64 host tensor), zero-padded to ``width`` columns.
        ``num_rows``: ``max(rows) + 1``, where the caller knows it."""
        return self.covering(rows, width, num_rows)[:, :width].index_select(0, rows)

    def covering(self, rows: torch.Tensor, width: int, num_rows: int | None = None) -> torch.Tensor:
        """The whole table, grown to hold ``rows`` and ``width`` columns (``gather``'s arguments)."""
        if num_rows is None:
            num_rows = int(rows.max()) + 1 if rows.numel() else 1
        self._ensure(num_rows, width)
        return self.table
