"""Per-forward attention metadata: built once per forward, on the model's device, read by every layer.

A forward runs ``S`` sequences; sequence ``s`` holds ``starts[s]`` tokens before it and adds ``counts[s]`` new ones,
packed sequence by sequence into ``n = sum(counts)`` token rows. Sequences ``0 .. num_decodes - 1`` add exactly one
token each (the batched decode path); the rest are prefill chunks (the varlen path). The engine schedules its
decodes first; ``generate`` runs either all-decode or all-prefill forwards.

Everything a layer needs is a tensor built here: no layer builds lists, splits batches in Python or syncs with the
host. Block tables come from the ``KVManager``'s persistent rows (one ``index_select``), and each new token's slot is
computed from them (``table[seq, pos // block_size] * block_size + pos % block_size``). The table width is rounded
up to a power of two, so it changes only as often as the longest sequence doubles.

Formats with a full-precision tail (int4) also get each sequence's tail row (its ``SequenceKV.row``) and a
``StorePlan`` per group: which new tokens stay in the tail and which blocks fill (and are quantized) in this forward.
All of it is computed here, on the host, with a few vectorized ops per forward (none per token).
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import operator
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .kernels import cpu_ext
from .kernels.fill_blocks import StorePlan
from .kv.manager import KVManager
from .kv.recurrent import RecurrentStep
from .kv.sequence import SequenceKV

# The layer kwargs entry the "paged" attention reads: a ``LayerStep``.
METADATA_KEY = "paged_hf_metadata"


@dataclass
class GroupMetadata:
    """One layer group's view of the forward."""

    block_tables: torch.Tensor  # [S, width] int32: block ids per sequence, 0 where none (never read)
    slot_mapping: torch.Tensor  # [n] int64: where each new token's K/V is written
    block_size: int
    window: int | None
    # [n]: the first position each new token sees, when the window is measured over a padded timeline (generate
    # with right padding or holes: pads take window room, as in HF's dense masks); None: ``window`` applies
    window_starts: torch.Tensor | None = None
    store_plan: StorePlan | None = None  # formats with a tail: where this forward's tokens go


@dataclass
class PadQueries:
    """Pad columns that come after real tokens of their row (right padding, holes). They store nothing, but HF's
    dense attention still computes their outputs (a right-padded row's next token is read from its last column), so
    the paged attention computes them too: column ``index[i]`` (flattened ``[B * q]``) of row ``rows[i]`` attends
    that row's tokens at positions ``<= positions[i]`` (its last real token)."""

    index: torch.Tensor  # [P] int64
    rows: torch.Tensor  # [P] int64: the sequence of each
    positions: torch.Tensor  # [P] int64
    window_starts: list[torch.Tensor | None]  # per layer group, as ``GroupMetadata.window_starts``
    # the layer groups whose attention they widen (Gemma 4's image queries: its sliding groups); None: every group
    groups: tuple[bool, ...] | None = None

    def widen(self, group_index: int) -> bool:
        """Whether these queries are attended again in layer group ``group_index``."""
        return self.groups is None or self.groups[group_index]


@dataclass
class AttentionMetadata:
    """One forward of a paged cache (see the module docstring).

    ``token_index`` maps the packed tokens to HF's ``[B, q]`` layout: ``None`` when every column is a new token
    (the engine's one row, or an unpadded batch), else the flattened column of each packed token (generate's padded
    rows: the columns the attention mask marks real).
    """

    num_seqs: int
    num_decodes: int
    num_tokens: int
    max_query_len: int
    seq_lens: torch.Tensor  # [S] int64: tokens held after this forward
    query_start_loc: torch.Tensor  # [S + 1] int64: cumulative counts
    prefill_query_start_loc: torch.Tensor | None  # [S - num_decodes + 1]: query_start_loc of the prefill part
    positions: torch.Tensor  # [n] int64: position of each new token
    token_seqs: torch.Tensor  # [n] int64: the sequence of each new token
    groups: list[GroupMetadata]
    device: torch.device
    batch_size: int = 1  # HF rows
    query_len: int = 0  # HF columns
    token_index: torch.Tensor | None = None
    pad_queries: PadQueries | None = None
    tail_rows: torch.Tensor | None = None  # [S] int64: each sequence's tail row (formats with a tail), else None
    recurrent: RecurrentStep | None = None  # how the recurrent layers split the row (a model with such layers)

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs

    def to(self, device) -> "AttentionMetadata":
        """A copy with every tensor on ``device`` (a tensor-parallel rank receives the leader's, built on the host)."""
        return _moved(self, torch.device(device))

    def select_new_tokens(self, states: torch.Tensor) -> torch.Tensor:
        """``[B, heads, q, head_dim]`` -> ``[n, heads, head_dim]``, the new tokens only."""
        flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])
        return flat if self.token_index is None else flat.index_select(0, self.token_index)

    def scatter_new_tokens(self, flat: torch.Tensor) -> torch.Tensor:
        """``[n, heads, head_dim]`` -> ``[B, q, heads, head_dim]``, zeros in padding columns."""
        if self.token_index is None:
            return flat.view(self.batch_size, self.query_len, *flat.shape[1:])
        out = flat.new_zeros((self.batch_size * self.query_len, *flat.shape[1:]))
        out.index_copy_(0, self.token_index, flat)
        return out.view(self.batch_size, self.query_len, *flat.shape[1:])

    def column_targets(self, group_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the query of each of HF's ``[B * q]`` columns attends in group ``group_index``: its sequence (-1: a
        pad before its row's first token, which attends nothing), the last position it sees, and the first (None
        where the group's window applies as it is); a new token sees up to itself, a pad after real tokens
        (``pad_queries``) up to its row's last one. For a query of some columns only (``attention``'s
        ``attend_columns``)."""
        num_columns, device = self.batch_size * self.query_len, self.positions.device
        index = self.token_index if self.token_index is not None else torch.arange(self.num_tokens, device=device)
        rows = torch.full((num_columns,), -1, dtype=torch.long, device=device).index_copy_(0, index, self.token_seqs)
        positions = torch.zeros(num_columns, dtype=torch.long, device=device).index_copy_(0, index, self.positions)
        pads, group = self.pad_queries, self.groups[group_index]
        if pads is not None and not pads.widen(group_index):
            pads = None
        if pads is not None:
            rows.index_copy_(0, pads.index, pads.rows)
            positions.index_copy_(0, pads.index, pads.positions)
        pad_starts = None if pads is None else pads.window_starts[group_index]
        if group.window_starts is None and pad_starts is None:
            return rows, positions, None
        # a window over a padded timeline: every column's first position, the window's where none is given
        starts = positions - (group.window - 1) if group.window is not None else torch.zeros_like(positions)
        if group.window_starts is not None:
            starts.index_copy_(0, index, group.window_starts)
        if pad_starts is not None:
            starts.index_copy_(0, pads.index, pad_starts)
        return rows, positions, starts


class LayerStep(NamedTuple):
    """What one layer's cache update hands its ``"paged"`` attention (the layer kwargs' ``METADATA_KEY``): the
    forward's metadata, the layer's group (and its index in ``metadata.groups``), the layer's storage, and, for a
    tail format, the forward's new K/V (``storage.FreshKV``: the attention writes the tails after it reads, where
    ``writes_tails``: the last of the layers reading the storage); ``layer``: the layer's index; ``key``, ``value``:
    the states the update stored and returned, which the attention must be handed as they are; ``dense``: those are
    the layer's dense K/V, for an attention whose mask the paged attention does not express (``PagedCache``'s
    ``mixed_masks``); ``latent``: the layer stores multi-head latent attention's rows, ``key`` and ``value`` being
    their latent and rotary key, which the model expands into the heads it hands the attention."""

    metadata: AttentionMetadata
    group: GroupMetadata
    group_index: int
    storage: object  # KVStorage
    fresh: object | None  # FreshKV
    layer: int
    key: torch.Tensor
    value: torch.Tensor
    writes_tails: bool = True
    dense: bool = False
    latent: int | None = None  # a multi-head latent attention layer's latent size (``PagedLayer.latent_dim``)

    def without_tail_writes(self) -> "LayerStep":
        """The step for a layer whose storage a later layer reads in the same forward (``PagedLayer.readers``): the
        tail rows must stay as they were before the forward until the last reader has read them."""
        return self._replace(writes_tails=False)

    @property
    def stored(self) -> tuple[int, int, int]:
        """The stored K/V's kv_heads, key head_dim and value head_dim (as ``OpStep.stored``)."""
        return self.key.shape[1], self.key.shape[-1], self.value.shape[-1]


class AttentionBypassed(NotImplementedError):
    """A layer's attention did not read the paged blocks its cache update wrote (it is not the ``"paged"``
    attention, or it was handed K/V that the model changed after storing them): its output would be wrong."""


class _HandedSteps(threading.local):
    """The steps handed over and not yet taken, by layer index, on this thread. Every layer's update hands its step
    over here (and in its kwargs where the model passes them: GPT-NeoX's and Falcon's attentions call
    ``cache.update`` without kwargs), and its attention takes it; a layer that reads another's K/V (Gemma 3n, Gemma
    4) takes the step its source handed it. Layers run one after another, so a step of a layer at or before the
    next update's was never read (``hand_step`` fails the forward by name)."""

    def __init__(self) -> None:
        self.steps: dict[int, LayerStep] = {}


_handed = _HandedSteps()
# The same while dynamo traces the engine's forward (its steps are ``ops.OpStep``s): a plain dict, which dynamo
# follows; each layer's entry is written and taken within the trace, so the compiled graph never touches it.
_traced: dict = {}


def _bypassed(layers) -> AttentionBypassed:
    return AttentionBypassed(
        f"layers {sorted(layers)} stored their K/V in the paged cache but their attention never read the paged "
        f"blocks: the model computes its attention outside transformers' attention interface, or not with "
        f"attn_implementation='paged', and would attend over the forward's new tokens alone. PagedEngine cannot "
        f"serve it; generate runs it on the PagedCache with a dense attention (attn_implementation='sdpa' or "
        f"'eager')")


def hand_step(layer_idx: int, step, updating: int | None = None) -> None:
    """Keeps ``step`` (a ``LayerStep``, or an ``OpStep`` while tracing) for layer ``layer_idx``'s attention, handed
    over by layer ``updating``'s cache update (default: its own); ``AttentionBypassed`` when the step of a layer at
    or before ``updating`` is still untaken (those handed to later layers reading another's K/V wait for them)."""
    steps = _traced if torch.compiler.is_compiling() else _handed.steps
    if steps:
        updating = layer_idx if updating is None else updating
        stale = [idx for idx in steps if idx <= updating]
        if stale:
            raise _bypassed(stale)
    steps[layer_idx] = step


def take_step(layer_idx: int | None):
    """The step handed over for layer ``layer_idx`` (once), else None."""
    if layer_idx is None:
        return None
    return _traced.pop(layer_idx, None) if torch.compiler.is_compiling() else _handed.steps.pop(layer_idx, None)


def drop_handed_steps() -> None:
    """Forgets this thread's untaken steps (a forward that raised between a layer's update and its attention), so
    no later forward's attention takes one: ``PagedCache`` at each forward it plans, ``handed_steps`` around the
    engine's."""
    _handed.steps.clear()
    _traced.clear()


@contextlib.contextmanager
def handed_steps():
    """Around an engine forward, eager or compiled: a step handed over but never taken (the last layer's: each
    earlier one is checked at the next update) fails the forward by name."""
    drop_handed_steps()
    try:
        yield
        left = {*_handed.steps, *_traced}
        if left:
            raise _bypassed(left)
    finally:
        drop_handed_steps()


def build_metadata(kv: KVManager, seqs: list[SequenceKV], starts: list[int], counts: list[int], num_decodes: int,
                   device, token_index: torch.Tensor | None = None, batch_size: int = 1,
                   query_len: int | None = None, min_width: int = 1) -> AttentionMetadata:
    """Metadata of a forward whose sequences ``seqs`` already have slots for their ``counts`` new tokens.

    ``starts[s]``: tokens ``seqs[s]`` held before the forward. The first ``num_decodes`` counts must be 1.
    ``min_width``: the narrowest block tables to build (a caller that knows its longest sequence keeps one shape).
    """
    num_seqs = len(seqs)
    rows = long_tensor([seq.row for seq in seqs])
    starts_t = long_tensor(starts)
    if num_decodes == num_seqs:  # one token per sequence: no expansion
        return decode_metadata(kv, rows, starts_t, max(starts, default=0) + 1, device, token_index, batch_size,
                               query_len, min_width)
    counts_t = long_tensor(counts)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(counts_t, 0, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    token_seq = torch.repeat_interleave(torch.arange(num_seqs), counts_t)
    positions = torch.arange(num_tokens) - query_start_loc[token_seq] + starts_t[token_seq]
    longest = max(map(operator.add, starts, counts), default=1)
    return _assemble(kv, rows, starts_t, counts_t, query_start_loc, token_seq, positions, longest, num_decodes,
                     max(counts, default=0), device, token_index, batch_size, query_len, min_width)


class DecodeLayout(NamedTuple):
    """What decode-only forwards of the same ``S`` sequences share: ``index`` ``[S]`` (row ``s`` is sequence ``s``'s
    only token), ``counts`` ``[S]`` ones, ``query_start_loc`` ``[S + 1]`` (``0 .. S``), ``num_rows``: one past the
    highest block-table row. Read-only: a forward's metadata holds these tensors."""

    index: torch.Tensor
    counts: torch.Tensor
    query_start_loc: torch.Tensor
    num_rows: int


def decode_layout(rows: torch.Tensor) -> DecodeLayout:
    """The ``DecodeLayout`` of sequences holding block-table ``rows`` (``[S]`` int64 host tensor)."""
    num_seqs = rows.shape[0]
    return DecodeLayout(torch.arange(num_seqs), torch.ones(num_seqs, dtype=torch.long), torch.arange(num_seqs + 1),
                        int(rows.max()) + 1 if num_seqs else 1)


def decode_metadata(kv: KVManager, rows: torch.Tensor, starts: torch.Tensor, longest: int, device,
                    token_index: torch.Tensor | None = None, batch_size: int = 1, query_len: int | None = None,
                    min_width: int = 1, layout: DecodeLayout | None = None) -> AttentionMetadata:
    """Metadata of a decode-only forward from tensors: sequence ``s`` holds block-table row ``rows[s]`` and adds one
    token at position ``starts[s]`` (``[S]`` int64 host tensors); ``longest``: ``max(starts) + 1``. A few tensor
    ops, whatever ``S`` (the runner's persistent decode batch calls it without any list, with the ``layout`` it
    keeps: ``decode_layout(rows)``)."""
    num_seqs = rows.shape[0]
    layout = layout or decode_layout(rows)
    return _assemble(kv, rows, starts, layout.counts, layout.query_start_loc, layout.index, starts, longest, num_seqs,
                     1 if num_seqs else 0, device, token_index, batch_size, query_len, min_width, layout.num_rows)


def _assemble(kv: KVManager, rows, starts_t, counts_t, query_start_loc, token_seq, positions, longest: int,
              num_decodes: int, max_query_len: int, device, token_index, batch_size: int, query_len: int | None,
              min_width: int, num_rows: int | None = None) -> AttentionMetadata:
    """The ``AttentionMetadata`` of a forward laid out by ``build_metadata`` / ``decode_metadata`` (host tensors);
    ``num_rows``: ``max(rows) + 1`` where the caller knows it."""
    num_seqs, num_tokens = rows.shape[0], positions.shape[0]
    decode_only = num_decodes == num_seqs
    target = torch.device(device)
    move = _host if target.type == "cpu" else (lambda tensor: tensor.to(target, non_blocking=True))
    seq_lens = starts_t + counts_t
    width = max(min_width, table_width(-(-longest // kv.block_size)))
    tails = _tail_plan(kv.block_size, rows, starts_t, counts_t, query_start_loc, token_seq, positions) \
        if kv.has_tail else None
    groups = []
    # a decode-only forward (row s holds token s) takes its tables and slots from one C++ call where it is built
    # (``cpu_ext.decode_slots_kernel``: the torch ops below, eight dispatches after a forward, cost 0.1 ms more)
    kernel = cpu_ext.decode_slots_kernel() if decode_only else None
    for group in kv.groups:
        if kernel is not None:
            tables, slots = kernel(group.rows.covering(rows, width, num_rows), rows, positions, kv.block_size, width)
        else:
            tables = group.rows.gather(rows, width, num_rows)
            slots = tables[token_seq, positions // kv.block_size].long() * kv.block_size + positions % kv.block_size
        plan = None if tails is None else tails.store_plan(tables, device)
        groups.append(GroupMetadata(move(tables), move(slots), kv.block_size, group.window, store_plan=plan))
    prefill_loc = None
    if 0 < num_decodes < num_seqs:
        prefill_loc = move(query_start_loc[num_decodes:] - num_decodes)
    return AttentionMetadata(
        num_seqs=num_seqs, num_decodes=num_decodes, num_tokens=num_tokens, max_query_len=max_query_len,
        seq_lens=move(seq_lens), query_start_loc=move(query_start_loc), prefill_query_start_loc=prefill_loc,
        positions=move(positions), token_seqs=move(token_seq), groups=groups, device=target, batch_size=batch_size,
        query_len=num_tokens if query_len is None else query_len, token_index=token_index,
        tail_rows=None if tails is None else move(rows),
        recurrent=None if kv.recurrent is None else RecurrentStep.of(rows, starts_t, counts_t, query_start_loc, move),
    )


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor for a forward on the host: itself (``.to`` is a dispatched op, a few us each after a forward)."""
    return tensor


@dataclass(frozen=True)
class TailPlan:
    """The host side of a tail format's ``StorePlan``s, the same for every group but the fill blocks: each fill's
    sequence (``fill_seq``) and block index in it (``fill_index``) look its block up in a group's tables."""

    tail_slots: torch.Tensor  # [n]: ``row * block_size + offset`` for a token left in its tail row, else -1
    fill_seq: torch.Tensor  # [F]: the sequence of each block that fills
    fill_index: torch.Tensor  # [F]: its block index in that sequence
    fill_rows: torch.Tensor  # [F]: its sequence's tail row
    fill_first: torch.Tensor  # [F]: the new-token index offset 0 of the block would have
    fill_tail: torch.Tensor  # [F]: how many of its first tokens come from the tail row

    def store_plan(self, tables: torch.Tensor, device) -> StorePlan:
        """The ``StorePlan`` of the group whose block tables are ``tables`` (``[S, width]``), on ``device``."""
        fill_blocks = tables[self.fill_seq, self.fill_index].long()
        return StorePlan(*(t.to(device, non_blocking=True) for t in (self.tail_slots, fill_blocks, self.fill_rows,
                                                                     self.fill_first, self.fill_tail)))


def _tail_plan(block_size: int, rows, starts, counts, query_start_loc, token_seq, positions) -> TailPlan:
    """The ``TailPlan`` of a forward (see ``kernels.fill_blocks.StorePlan``)."""
    ends = starts + counts
    full_ends = ends // block_size * block_size  # positions below: in full blocks after this forward
    tail_slots = torch.where(positions >= full_ends[token_seq],
                             rows[token_seq] * block_size + positions % block_size, -1)
    first = starts // block_size
    num_fills = ends // block_size - first  # blocks whose last slot this forward writes
    fill_seq = torch.repeat_interleave(torch.arange(len(rows)), num_fills)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    torch.cumsum(num_fills, 0, out=offsets[1:])
    fill_index = first[fill_seq] + torch.arange(fill_seq.shape[0]) - offsets[fill_seq]
    block_start = fill_index * block_size
    return TailPlan(
        tail_slots=tail_slots, fill_seq=fill_seq, fill_index=fill_index, fill_rows=rows[fill_seq],
        fill_first=query_start_loc[fill_seq] + block_start - starts[fill_seq],
        fill_tail=(starts[fill_seq] - block_start).clamp_min(0),
    )


def _moved(value, device: torch.device):
    """``value`` with its tensors on ``device``: dataclasses and lists of them are rebuilt, other values kept."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _moved(getattr(value, f.name), device) for f in dataclasses.fields(value)}
        if "device" in changes:
            changes["device"] = device
        return dataclasses.replace(value, **changes)
    return value


def long_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long)`` on the host, through a buffer: 3-4x faster for the few hundred ints
    of a step (``torch.tensor`` converts a list one element at a time)."""
    if not values:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


def table_width(num_blocks: int) -> int:
    """The block-table width for ``num_blocks`` blocks: the next power of two (at least 1), so that lengths in one
    bucket share a shape (a compiled step does not recompile for them)."""
    return 1 << max(0, num_blocks - 1).bit_length()


def write_layer_kv(storage, metadata: AttentionMetadata, group: GroupMetadata, key_states: torch.Tensor,
                   value_states: torch.Tensor):
    """Stores one layer's new K/V (``[B, kv_heads, q, head_dim]``, new tokens per ``metadata``) at their slots (a
    tail format: the blocks that fill, as the group's ``StorePlan`` says). Returns the storage's ``FreshKV`` (a tail
    format: its tail writes, ``storage.write_tails``, must follow the layer's attention), else None."""
    return storage.write(group.slot_mapping, metadata.select_new_tokens(key_states),
                         metadata.select_new_tokens(value_states), group.store_plan)
