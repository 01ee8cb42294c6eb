"""Per-forward metadata of a paged cache: built once per forward, read by every layer.

HF hands each layer ``[B, heads, q, head_dim]`` states. The plan names the *sequences* of the forward and which
of those ``B * q`` columns are their new tokens, packed sequence by sequence into ``n = sum(new_counts)`` tokens:
- generate (``PagedCache``): one sequence per row; row ``b``'s new tokens are its last ``new_counts[b]`` columns
  (the rest is left padding);
- the engine: ``B == 1`` and the ``q`` columns are the sequences' tokens back to back (no padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class GroupPlan:
    """Where one layer group writes this forward, and the block tables its attention reads."""

    slots: torch.Tensor  # [n] int64 slot of each new real token
    copy_src: torch.Tensor | None  # [c] blocks to copy before writing (copy-on-write), or None
    copy_dst: torch.Tensor | None
    block_ids: list[list[int]]  # per row, after allocation; -1 for blocks freed by a sliding window
    block_size: int
    device: torch.device

    @staticmethod
    def build(group, slots: list[int], copies: list[tuple[int, int]], device) -> "GroupPlan":
        src = dst = None
        if copies:
            src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=device)
            dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=device)
        return GroupPlan(
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            copy_src=src,
            copy_dst=dst,
            block_ids=[table.block_ids for table in group.tables],
            block_size=group.block_size,
            device=device,
        )

    @cached_property
    def block_tables(self) -> torch.Tensor:
        """``[B, max_blocks]`` int64, -1 where a row has no block."""
        width = max(1, max((len(ids) for ids in self.block_ids), default=1))
        rows = [ids + [-1] * (width - len(ids)) for ids in self.block_ids]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @cached_property
    def readable_block_tables(self) -> torch.Tensor:
        """``block_tables`` with -1 replaced by block 0, for kernels that read every entry they are given."""
        return self.block_tables.clamp_min(0)


@dataclass
class StepPlan:
    """One forward of a ``PagedCache``: token counts per row and each group's plan."""

    batch_size: int  # HF rows
    query_len: int  # HF columns
    new_counts: list[int]  # per sequence: tokens written this forward
    num_tokens: list[int]  # per sequence: tokens held after this forward
    groups: dict[int, GroupPlan]
    device: torch.device
    token_index: torch.Tensor | None = None  # [n] column of each new token in the flattened [B * q]; None: all
    seq_length_before: int = 0  # generate layout: columns of HF's padded timeline before this forward
    written_layers: set[int] = field(default_factory=set)
    _dense: dict[int, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def left_padded_index(new_counts: list[int], query_len: int, device) -> torch.Tensor | None:
        """``token_index`` of the generate layout: row ``b``'s last ``new_counts[b]`` columns."""
        if all(n == query_len for n in new_counts):
            return None
        index = [row * query_len + col for row, count in enumerate(new_counts)
                 for col in range(query_len - count, query_len)]
        return torch.tensor(index, dtype=torch.long, device=device)

    @cached_property
    def decode_only(self) -> bool:
        """Every sequence writes exactly one token (the batched decode path)."""
        return all(n == 1 for n in self.new_counts)

    @cached_property
    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(self.num_tokens, dtype=torch.long, device=self.device)

    @cached_property
    def cu_query_lens(self) -> torch.Tensor:
        cumulative = [0]
        for count in self.new_counts:
            cumulative.append(cumulative[-1] + count)
        return torch.tensor(cumulative, dtype=torch.long, device=self.device)

    def select_new_tokens(self, states: torch.Tensor) -> torch.Tensor:
        """``[B, heads, q, head_dim]`` -> ``[n, heads, head_dim]``, the real tokens only."""
        flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])
        return flat if self.token_index is None else flat.index_select(0, self.token_index)

    def scatter_new_tokens(self, flat: torch.Tensor) -> torch.Tensor:
        """``[n, heads, head_dim]`` -> ``[B, q, heads, head_dim]``, zeros in padding columns."""
        if self.token_index is None:
            return flat.view(self.batch_size, self.query_len, *flat.shape[1:])
        out = flat.new_zeros((self.batch_size * self.query_len, *flat.shape[1:]))
        out.index_copy_(0, self.token_index, flat)
        return out.view(self.batch_size, self.query_len, *flat.shape[1:])

    def dense_slots(self, group_plan: GroupPlan, window: int | None) -> torch.Tensor:
        """``[B, L]`` slot of each column HF's mask expects (``get_mask_sizes`` before this forward).

        Padding columns map to slot 0: the mask hides them and the pool holds no NaN.
        """
        key = id(group_plan)
        if key not in self._dense:
            seq_after = self.seq_length_before + self.query_len
            first = 0 if window is None else max(self.seq_length_before - window + 1, 0)
            columns = torch.arange(first, seq_after, device=self.device)
            pads = seq_after - self.seq_lens
            positions = columns.unsqueeze(0) - pads.unsqueeze(1)  # real position of each column, < 0 for pads
            clamped = positions.clamp_min(0)
            tables = group_plan.block_tables
            block_index = (clamped // group_plan.block_size).clamp_max(tables.shape[1] - 1)
            blocks = tables.gather(1, block_index)
            slots = blocks * group_plan.block_size + clamped % group_plan.block_size
            self._dense[key] = torch.where((positions >= 0) & (blocks >= 0), slots, torch.zeros_like(slots))
        return self._dense[key]
