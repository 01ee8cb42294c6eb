"""The planner of ``generate``'s forwards: one forward of ``[B, q]`` columns over a ``PagedCache``'s rows, laid out
on HF's padded timeline, becomes the ``AttentionMetadata`` its ``PagedLayer``s read (the engine's runner builds its
own from the scheduler's step instead).

Per forward, once for every layer: the rows' windows slide, the pool makes room (grows or raises before anything is
allocated), each row gets slots for its real tokens (pads take none) and the copies run; then the metadata is built
for the real tokens and given what the padded timeline adds to it: each group's first visible position per token
where HF's sliding-window masks count columns rather than tokens, the pad columns' queries (they attend as their
row's last real token), and, for an attention that reads no blocks, the slots of each group's dense layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kv.manager import KVManager
from .kv.sequence import SequenceKV
from .metadata import AttentionMetadata, PadQueries, build_metadata
from .timeline import PaddedTimeline


class TimelinePlan(NamedTuple):
    """One planned forward: its metadata, and per group the ``(slots [B, kv_length], tail slots or None)`` a dense
    attention reads (empty when the attention reads the blocks)."""

    metadata: AttentionMetadata
    dense_slots: list[tuple]


def plan_forward(kv: KVManager, rows: list[SequenceKV], timeline: PaddedTimeline, new: torch.Tensor, device,
                 min_width: int, dense: bool) -> TimelinePlan:
    """Plans the forward whose real columns are ``new`` (``[B, q]`` bool, one row per sequence of ``rows``), appending
    them to ``timeline``. ``min_width``: the narrowest block tables; ``dense``: the attention reads no blocks."""
    batch, query_len = len(rows), new.shape[1]
    counts = new.sum(1).tolist()
    starts = [seq.num_tokens for seq in rows]
    for seq in rows:
        kv.slide_windows(seq)
    kv.reserve(rows, counts)  # grows or raises before anything is allocated
    for seq, count in zip(rows, counts):
        kv.append(seq, count)
    kv.apply_copies(kv.take_copies())
    token_index = None if bool(new.all()) else new.flatten().nonzero().squeeze(1).to(device)
    metadata = build_metadata(kv, rows, starts, counts, num_decodes=batch if all(c == 1 for c in counts) else 0,
                              device=device, token_index=token_index, batch_size=batch, query_len=query_len,
                              min_width=min_width)
    seen = timeline.seq_length
    positions = timeline.append(new, starts)  # a pad: its row's last real one
    starts_of = timeline.window_starts([g.window for g in kv.groups], seen, query_len)  # per group: [B, q] or None
    for group, first_seen in zip(metadata.groups, starts_of):
        if first_seen is not None:
            flat = first_seen.flatten()
            group.window_starts = (flat if token_index is None else flat[token_index.cpu()]).to(device)
    pads = ~new & (positions >= 0)
    if bool(pads.any()):
        index = pads.flatten().nonzero().squeeze(1)
        metadata.pad_queries = PadQueries(
            index.to(device), (index // query_len).to(device), positions.flatten()[index].to(device),
            [None if s is None else s.flatten()[index].to(device) for s in starts_of],
        )
    return TimelinePlan(metadata, dense_layout(kv, rows, timeline, seen, query_len, device) if dense else [])


def dense_layout(kv: KVManager, rows: list[SequenceKV], timeline: PaddedTimeline, seen: int, query_len: int,
                 device) -> list[tuple]:
    """Every group's dense layout of the forward of ``query_len`` columns after ``seen`` (once per forward): the
    ``(slots [B, kv_length], tail slots or None)`` its mask covers."""
    return [timeline.slots(group, rows, *timeline.mask_window(group.window, seen, query_len), kv.has_tail, device)
            for group in kv.groups]
