"""``PaddedTimeline``: HF's padded ``[B, seq_length]`` timeline over a ``PagedCache``'s rows.

``generate`` lays a batch out as padded rows: pads (left, right, holes) take columns but no KV slot. The timeline
maps each column to its row's real position (-1 for a pad), which is what the planner of a forward needs beyond the
engine's metadata: which of a forward's columns are real (from the 2D mask, or from the positions), the first
position a sliding window sees when HF's masks count columns rather than tokens, and the slots a dense attention
(or a dense view, or ``crop``) reads for a range of columns. It holds no blocks: the cache's sequences do.
"""

from __future__ import annotations

import torch


class PaddedTimeline:
    """``columns`` ``[B, seq_length]``: the real position of each column of each row, -1 for a pad."""

    def __init__(self) -> None:
        self.columns = torch.zeros((0, 0), dtype=torch.long)
        self.seq_length = 0

    def reset(self, batch: int = 0) -> None:
        self.columns = torch.zeros((batch, 0), dtype=torch.long)
        self.seq_length = 0

    def new_columns(self, batch: int, query_len: int, attention_mask, position_ids, held: list[int]) -> torch.Tensor:
        """``[B, q]`` bool: which of a forward's ``q`` columns are real tokens. ``held``: real tokens per row so far
        (empty before the first forward). From HF's 2D mask when it covers the timeline; without one, the last
        position of each row says how many of its columns are real (left padding); without positions, all are."""
        if attention_mask is not None and attention_mask.dim() == 2 \
                and attention_mask.shape[-1] == self.seq_length + query_len:
            new = attention_mask[:, -query_len:].to("cpu", torch.bool)
            return new.expand(batch, -1) if new.shape[0] == 1 and batch > 1 else new
        columns = torch.arange(query_len)
        if position_ids is None:
            return torch.ones((batch, query_len), dtype=torch.bool)
        positions = position_ids[0] if position_ids.dim() == 3 else position_ids  # multimodal RoPE: [3, B, q]
        last = positions[:, -1].to("cpu")
        if last.numel() == 1:
            last = last.expand(batch)
        counts = last + 1 - torch.tensor(held or [0] * batch)
        counts = torch.where((counts >= 1) & (counts <= query_len), counts, torch.full_like(counts, query_len))
        return columns.unsqueeze(0) >= (query_len - counts).unsqueeze(1)  # left padding: the last columns are real

    def append(self, new: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """Adds a forward's columns (``new`` ``[B, q]``, rows holding ``starts`` real tokens before it); returns
        ``[B, q]`` positions (a pad column gets its row's last real position, -1 before any)."""
        positions = torch.tensor(starts).unsqueeze(1) + new.long().cumsum(1) - 1
        self.columns = torch.cat([self.columns, torch.where(new, positions, -1)], dim=1)
        self.seq_length += new.shape[1]
        return positions

    def window_starts(self, windows: list[int | None], seen: int, query_len: int) -> list[torch.Tensor | None]:
        """Per sliding group (``windows``), ``[B, q]``: the first real position each of the last forward's columns
        (``seen ..``) sees when its window counts timeline columns (HF's masks), where that differs from counting
        real tokens: a pad after a real token somewhere in the timeline. None elsewhere (the plain window)."""
        if all(w is None for w in windows):
            return [None] * len(windows)
        real = self.columns >= 0
        if not bool((~real & (real.cumsum(1) > 0)).any()):
            return [None] * len(windows)
        before = real.long().cumsum(1) - real.long()  # real tokens in columns < c
        columns = torch.arange(seen, seen + query_len)
        return [None if window is None else before[:, (columns - window + 1).clamp_min(0)] for window in windows]

    @staticmethod
    def mask_window(window: int | None, seen: int, query_len: int) -> tuple[int, int]:
        """``(first column, number of columns)`` HF's mask covers for a group of ``window`` (``get_mask_sizes``)."""
        if window is None:
            return 0, seen + query_len
        first = max(seen - window + 1, 0)
        return first, (window - 1 + query_len) if seen >= window else seen + query_len

    def slots(self, group, seqs, first: int, count: int, has_tail: bool,
              device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, count]`` slots of columns ``first ..`` in ``group``'s pool for the rows' sequences ``seqs``; pads
        and positions with no block map to slot 0. A tail format (``has_tail``) also gets ``[B, count]`` tail slots:
        ``row * block_size + offset`` for the positions in a row's partial last block (they live in its tail row),
        -1 elsewhere; else None."""
        positions = self.columns[:, first : first + count]
        block_size = group.block_size
        rows = torch.tensor([s.row for s in seqs])
        width = max(1, max((len(s.tables[group.index].blocks) for s in seqs), default=1))
        tables = group.rows.gather(rows, width).long()
        clamped = positions.clamp_min(0)
        blocks = tables.gather(1, (clamped // block_size).clamp_max(width - 1))
        slots = torch.where(positions >= 0, blocks * block_size + clamped % block_size, 0)
        tail_slots = None
        if has_tail:
            full_end = torch.tensor([s.num_tokens for s in seqs]) // block_size * block_size
            in_tail = (positions >= 0) & (clamped >= full_end[:, None])
            tail_slots = torch.where(in_tail, rows[:, None] * block_size + clamped % block_size, -1).to(device)
        return slots.to(device), tail_slots

    def select(self, rows: list[int]) -> None:
        """Row ``i`` becomes old row ``rows[i]``."""
        self.columns = self.columns[torch.tensor(rows, dtype=torch.long)]

    def crop(self, remove: int) -> list[int]:
        """Drops the last ``remove`` columns; returns the real tokens each row loses."""
        if remove > self.seq_length:
            raise ValueError(f"cannot crop {remove} tokens from a cache of {self.seq_length}")
        dropped = (self.columns[:, -remove:] >= 0).sum(1).tolist()
        self.columns = self.columns[:, :-remove]
        self.seq_length -= remove
        return dropped
