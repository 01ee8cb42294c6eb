"""What one sequence holds in the KV cache: a ``BlockTable`` per layer group (the same positions in every group),
its row of the groups' ``BlockTableRows``, its prefix-cache hashes and, while swapped out, its CPU blocks.
``PagedCache`` keeps one per batch row, the engine one per sequence that holds blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..block_pool import KVBlock
from ..block_table import BlockTable


@dataclass
class SwappedGroup:
    """One group of a swapped-out sequence: its length, its window-freed prefix and the CPU blocks holding the rest."""

    num_tokens: int
    num_freed: int
    cpu_blocks: list[KVBlock]
    cpu_tail: int | None = None  # the CPU tail slot holding the sequence's tail row (formats with a tail)


class SequenceKV:
    """The KV one sequence holds: a ``BlockTable`` per group (empty while waiting or swapped) and a table row."""

    __slots__ = ("tables", "row", "block_hashes", "num_cached_blocks", "swapped")

    def __init__(self, tables: list[BlockTable], row: int) -> None:
        self.tables = tables
        self.row = row  # -1 while the sequence holds no device blocks
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of its tokens (prefix caching)
        self.num_cached_blocks = 0  # leading full blocks registered in the prefix cache
        self.swapped: list[SwappedGroup] | None = None

    @property
    def num_tokens(self) -> int:
        """Positions with a slot (the same in every group)."""
        return self.tables[0].num_tokens if self.tables else 0
