"""Static decode buffers: a decode-only step of ``S`` sequences run at a bucket size ``B >= S``, every input of the
forward living in tensors allocated once per bucket (what a CUDA graph replays, ``cuda_graphs.py``).

A bucket's ``AttentionMetadata`` is built once, over its own tensors, and never rebuilt: a step copies its rows into
them (``StaticDecode.load``). Rows ``S .. B - 1`` are *padding*: token 0 at position 0 of a one-token sequence whose
block table is the layer group's **scratch block** (one block appended to every pool of the group past the ids its
``BlockPool`` hands out, ``add_scratch_blocks``), so a padded row writes its K/V into the scratch block only, reads
only it, and its logits are dropped. No real sequence ever holds the scratch block.

Per bucket (``B`` rows, the widest block table ``W`` of ``max_model_len``): ``input_ids [1, B]``, ``positions [B]``,
``seq_lens [B]``, ``query_start_loc = arange(B + 1)``, ``token_seqs = arange(B)``, per group ``block_tables [B, W]``
int32 and ``slot_mapping [B]``, the logits rows ``keep = arange(B)``; the decode count is ``B`` (``num_decodes`` of
the metadata, constant: a bucket is decode-only). A format with a tail (int4) adds ``tail_rows [B]``
(padding reads row 0, which exists whenever a sequence does) and a ``StorePlan`` per group whose five tensors are
``[B]``: a decode fills at most one block per sequence, so the step's ``F <= S`` fills come first and the other
``B - F`` entries fill the scratch block from the padded rows; padding stores nothing in the tails (slot -1).

Table columns past a step's own width keep the ids an earlier step left (valid ids, past ``seq_lens``: never read).
"""

from __future__ import annotations

import torch

from ..block_table_rows import TABLE_DTYPE
from ..kernels.fill_blocks import StorePlan
from ..kv.manager import KVManager
from ..metadata import AttentionMetadata, GroupMetadata, table_width


def capture_sizes(max_num_seqs: int, sizes=None) -> tuple[int, ...]:
    """The bucket sizes, ascending: ``sizes`` (vLLM's ``cudagraph_capture_sizes``; those above ``max_num_seqs``
    dropped) or the powers of two below ``max_num_seqs`` and ``max_num_seqs`` itself."""
    if sizes is not None:
        return tuple(sorted({int(s) for s in sizes if s <= max_num_seqs}))
    powers = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return tuple(powers + [max_num_seqs])


def add_scratch_blocks(kv: KVManager) -> list[int]:
    """Appends one block to every pool tensor of each layer group (past the ids its ``BlockPool`` hands out) and
    returns each group's scratch block id. Idempotent: a group that has it already is left alone."""
    ids = []
    for group in kv.groups:
        scratch = group.pool.num_blocks
        for storage in group.storages.values():
            if storage.num_blocks == scratch:
                storage.grow(1)
            if storage.num_blocks != scratch + 1:
                raise RuntimeError(f"layer group {group.index}: a pool of {storage.num_blocks} blocks beside a "
                                   f"BlockPool of {scratch}: no room for the scratch block")
        ids.append(scratch)
    return ids


class StaticDecode:
    """One bucket's buffers and its ``AttentionMetadata`` over them (see the module docstring)."""

    def __init__(self, kv: KVManager, size: int, max_model_len: int, scratch: list[int], device) -> None:
        device = torch.device(device)
        self.size = size
        self.block_size = kv.block_size
        self.width = table_width(-(-max_model_len // kv.block_size))
        self.scratch = scratch
        self.filled = size  # rows [0, filled) may hold a real sequence's values: padded again by the next load
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros((1, size), **long)
        self.position_ids = torch.zeros((1, size), **long)
        self.keep = torch.arange(size, **long)
        groups = []
        for group, block in zip(kv.groups, scratch):
            plan = None
            if kv.has_tail:
                plan = StorePlan(torch.full((size,), -1, **long), torch.full((size,), block, **long),
                                 *(torch.zeros(size, **long) for _ in range(3)))
            groups.append(GroupMetadata(torch.full((size, self.width), block, dtype=TABLE_DTYPE, device=device),
                                        torch.zeros(size, **long), kv.block_size, group.window, store_plan=plan))
        self.metadata = AttentionMetadata(
            num_seqs=size, num_decodes=size, num_tokens=size, max_query_len=1, seq_lens=torch.ones(size, **long),
            query_start_loc=torch.arange(size + 1, **long), prefill_query_start_loc=None,
            positions=self.position_ids[0], token_seqs=torch.arange(size, **long), groups=groups, device=device,
            query_len=size, tail_rows=torch.zeros(size, **long) if kv.has_tail else None)
        self.pad(0)

    def pad(self, start: int) -> None:
        """Makes rows ``start .. filled - 1`` padding (see the module docstring)."""
        if start >= self.filled:
            return
        rows = slice(start, self.filled)
        meta = self.metadata
        self.input_ids[0, rows] = 0
        self.position_ids[0, rows] = 0
        meta.seq_lens[rows] = 1
        if meta.tail_rows is not None:
            meta.tail_rows[rows] = 0
        for group, block in zip(meta.groups, self.scratch):
            group.block_tables[rows, 0] = block
            group.slot_mapping[rows] = block * self.block_size
            if group.store_plan is not None:  # and a decode's fills sit in its first entries: scratch ones from here
                plan = group.store_plan
                plan.tail_slots[rows] = -1
                plan.fill_blocks[start:] = block
                for entries in (plan.fill_rows, plan.fill_first, plan.fill_tail):
                    entries[start:] = 0
        self.filled = start

    def fits(self, metadata: AttentionMetadata) -> bool:
        """Whether a step's metadata can run in this bucket: decode-only, at most ``size`` sequences, tables no
        wider, no per-token window starts or pad queries (``generate``'s layouts)."""
        return (metadata.decode_only and metadata.num_seqs <= self.size and metadata.token_index is None
                and metadata.pad_queries is None
                and all(g.block_tables.shape[1] <= self.width and g.window_starts is None for g in metadata.groups))

    def load(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Copies a decode-only step (``input_ids [S]``, its metadata on the buffers' device) into rows ``0 .. S -
        1`` and pads the rest."""
        s = metadata.num_seqs
        meta = self.metadata
        self.pad(s)
        self.input_ids[0, :s].copy_(input_ids, non_blocking=True)
        self.position_ids[0, :s].copy_(metadata.positions, non_blocking=True)
        meta.seq_lens[:s].copy_(metadata.seq_lens, non_blocking=True)
        if meta.tail_rows is not None:
            meta.tail_rows[:s].copy_(metadata.tail_rows, non_blocking=True)
        for static, group, block in zip(meta.groups, metadata.groups, self.scratch):
            static.block_tables[:s, : group.block_tables.shape[1]].copy_(group.block_tables, non_blocking=True)
            static.slot_mapping[:s].copy_(group.slot_mapping, non_blocking=True)
            if static.store_plan is not None:
                _load_plan(static.store_plan, group.store_plan, s, block)
        self.filled = s


def _load_plan(static: StorePlan, plan: StorePlan, num_seqs: int, scratch: int) -> None:
    """A decode's ``StorePlan`` into the bucket's: its ``F <= S`` fills first; the entries after them stay (or
    become) fills of the scratch block (from the step's first tokens: they read, and write the scratch block only)."""
    static.tail_slots[:num_seqs].copy_(plan.tail_slots, non_blocking=True)
    fills = plan.num_fills
    for name in ("fill_blocks", "fill_rows", "fill_first", "fill_tail"):
        getattr(static, name)[:fills].copy_(getattr(plan, name), non_blocking=True)
    rest = slice(fills, num_seqs)  # pad(num_seqs) made the entries from num_seqs on scratch fills
    static.fill_blocks[rest] = scratch
    for name in ("fill_rows", "fill_first", "fill_tail"):
        getattr(static, name)[rest] = 0
