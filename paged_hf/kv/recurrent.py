"""Recurrent layer states: what the linear-attention, state-space and short-convolution layers of hybrid models
(Qwen3.5, Qwen3-Next, LFM2, Granite 4, Falcon-H1, NemotronH, Bamba, Jamba, Zamba, ...) carry from one token to the
next in place of K/V.

transformers gives these layers one interface (``Cache.get_conv_state`` / ``update_conv_state`` /
``get_recurrent_state`` / ``update_recurrent_state``; layer types ``"conv"`` and ``"linear_attention"``, and
``"hybrid"`` for a layer that also attends). A layer keeps, per sequence and per ``state_idx``, a conv state
``[channels, kernel]`` (the last inputs of its causal convolution) and, for most, a recurrent state (fixed size,
whatever the sequence's length). Nothing here is paged: a state is one row per sequence.

``RecurrentStates`` holds every such layer's states of the engine's sequences in dense tensors ``[rows, ...]``,
indexed by the sequence's block-table row (``SequenceKV.row``: one per sequence that holds blocks). A forward's
writes are *staged* and land when it returns (``commit``); a forward that raised leaves every state as it was
(``discard``), so the engine can run the step again in parts, as it does for K/V, whose retries write the same
slots again.

``StateView`` is the ``Cache`` face one call of a layer sees: the states of some rows, all fresh (the sequences hold
no token yet: ``get_*`` answer None, as a new ``DynamicCache`` does) or all continuing. Its update rules are
transformers' ``LinearAttentionLayer``'s, so a layer computes exactly what it computes on ``DynamicCache``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

# layer types whose layers keep recurrent states (``HYBRID`` layers keep K/V too)
RECURRENT_LAYER_TYPES = ("conv", "linear_attention")
HYBRID_LAYER_TYPES = ("hybrid", "hybrid_sliding")
# layer types that store no K/V: the recurrent-only ones, and "dummy" (a MoE or MLP block, a layer reading another's)
NO_KV_LAYER_TYPES = RECURRENT_LAYER_TYPES + ("dummy",)


def kv_layers(text_config) -> list[int]:
    """Indices of the layers that store K/V (every layer but the recurrent-only and the "dummy" ones)."""
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    return [i for i, kind in enumerate(layer_types) if kind not in NO_KV_LAYER_TYPES]


def recurrent_layers(text_config) -> list[int]:
    """Indices of the layers that keep recurrent states (``conv``, ``linear_attention`` and ``hybrid`` layers)."""
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    return [i for i, kind in enumerate(layer_types) if kind in RECURRENT_LAYER_TYPES + HYBRID_LAYER_TYPES]


StateKey = tuple[str, int, int]  # (kind: "conv" or "recurrent", layer index, state_idx)


class RecurrentStates:
    """The recurrent states of ``layers``, one row per sequence row. The engine allocates every store up front for
    its running sequences (``allocate``, from the shapes one token through each mixer showed); a store written
    before it is allocated (the start probe's scratch pools) is made at its first write with as many rows as handed
    out. Stores
    grow with the rows (``ensure_rows``: by a quarter, which copies them, so the engine reserves enough); a new row
    is zeros, and a sequence's first forward never reads it (it is fresh)."""

    def __init__(self, layers: list[int]) -> None:
        self.layers = layers
        self.num_rows = 0
        self._stores: dict[StateKey, torch.Tensor] = {}
        self._staged: list[tuple[StateKey, torch.Tensor, torch.Tensor]] = []

    def allocate(self, shapes: dict[StateKey, tuple[tuple[int, ...], torch.dtype]], num_rows: int, device) -> None:
        """Makes each store ``[num_rows, *shape]`` (zeros) now."""
        self.num_rows = max(self.num_rows, num_rows)
        for key, (shape, dtype) in shapes.items():
            self._stores[key] = torch.zeros((self.num_rows, *shape), dtype=dtype, device=device)

    def ensure_rows(self, num_rows: int) -> None:
        """Every store has at least ``num_rows`` rows."""
        self.num_rows = max(self.num_rows, num_rows)
        for key, store in self._stores.items():
            if store.shape[0] < self.num_rows:
                grown = store.new_zeros((max(self.num_rows, store.shape[0] + store.shape[0] // 4), *store.shape[1:]))
                grown[: store.shape[0]] = store
                self._stores[key] = grown

    def read(self, key: StateKey, rows: torch.Tensor) -> torch.Tensor:
        """The states of ``rows`` (``[R]`` int64), a copy ``[R, ...]``. KeyError: nothing was ever written there
        (a continuing sequence always wrote its state in its earlier forwards)."""
        return self._stores[key].index_select(0, rows)

    def stage(self, key: StateKey, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Writes ``values`` ``[R, ...]`` to ``rows`` when the forward returns (``commit``)."""
        store = self._stores.get(key)
        if store is None:
            store = values.new_zeros((max(self.num_rows, int(rows.max()) + 1), *values.shape[1:]))
            self._stores[key] = store
        elif store.shape[1:] != values.shape[1:]:
            raise RuntimeError(f"layer {key[1]} wrote a {key[0]} state of shape {tuple(values.shape[1:])}, but its "
                               f"earlier ones were {tuple(store.shape[1:])}")
        self._staged.append((key, rows, values))

    def staged_shapes(self) -> dict[StateKey, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of one row of each store the staged writes go to (what ``allocate`` takes)."""
        return {key: (tuple(values.shape[1:]), values.dtype) for key, _, values in self._staged}

    def commit(self) -> None:
        """Lands the staged writes of the forward that just returned."""
        for key, rows, values in self._staged:
            self._stores[key].index_copy_(0, rows, values.to(self._stores[key].dtype))
        self._staged.clear()

    def discard(self) -> None:
        """Drops the staged writes of a forward that raised: every state stays as it was before it."""
        self._staged.clear()

    def row_copy(self, row: torch.Tensor, layer_idx: int) -> "RecurrentStates":
        """A one-row ``RecurrentStates`` holding copies of ``row``'s (``[1]`` int64) states of layer ``layer_idx``:
        a scratch whose commits the engine's states never see (``stage`` its stores back)."""
        copy = RecurrentStates([layer_idx])
        copy.num_rows = 1
        copy._stores = {key: self.read(key, row) for key in self._stores if key[1] == layer_idx}
        return copy

    def stage_copy(self, copy: "RecurrentStates", rows: torch.Tensor) -> None:
        """Stages the states of ``copy`` (a ``row_copy``, written since) to ``rows`` ``[1]``."""
        for key, store in copy._stores.items():
            self.stage(key, rows, store)

    def copy_row(self, src: int, dst: int) -> None:
        """Row ``dst`` takes row ``src``'s states (a forked sequence continues from its parent's)."""
        for store in self._stores.values():
            store[dst] = store[src]

    @property
    def nbytes(self) -> int:
        return sum(store.nbytes for store in self._stores.values())

    def view(self, rows: torch.Tensor, fresh: bool) -> "StateView":
        return StateView(self, rows, fresh)


def state_bytes(shapes: dict[StateKey, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes one sequence's states take, for ``RecurrentStates.allocate``'s ``shapes``."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())


class StateView:
    """The cache one call of a recurrent layer sees: the states of ``rows`` (``[R]`` int64, the call's batch rows in
    order). ``fresh``: the sequences hold no token yet (no previous state). The layer's in-place conv update (a
    decode's ``causal_conv1d_update``) writes into the copy ``get_conv_state`` returned, which ``finish`` stages."""

    def __init__(self, states: RecurrentStates, rows: torch.Tensor, fresh: bool) -> None:
        self.states = states
        self.rows = rows
        self.fresh = fresh
        self._held: dict[StateKey, torch.Tensor] = {}  # the copies handed out, and the states written since
        self._written: set[StateKey] = set()  # conv states written (a recurrent state held is always staged)

    def _held_copy(self, key: StateKey) -> torch.Tensor | None:
        """The rows' states under ``key``, one copy per call (None while fresh)."""
        if self.fresh:
            return None
        state = self._held.get(key)
        if state is None:
            state = self._held[key] = self.states.read(key, self.rows)
        return state

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._held_copy(("conv", layer_idx, state_idx))

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """transformers' ``LinearAttentionLayer.update_conv_state``: the states to convolve (the previous kernel
        columns, else zeros, before ``conv_states`` ``[R, C, q]``); the last kernel columns are kept."""
        previous = self.get_conv_state(layer_idx, state_idx)
        if previous is None:
            kernel = conv_kernel_size or conv_states.shape[-1]
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0))
        else:
            kernel = previous.shape[-1]
            full = torch.cat([previous, conv_states], dim=-1)
        key = ("conv", layer_idx, state_idx)
        self._held[key] = full[..., -kernel:]
        self._written.add(key)
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """A copy of the rows' states (the same one each time). A layer that updates it in place and never calls
        ``update_recurrent_state`` (Zamba's decode: transformers' layer hands out the stored tensor itself) has it
        staged by ``finish``."""
        return self._held_copy(("recurrent", layer_idx, state_idx))

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Keeps the last state for ``finish`` to stage (a list holds the states after each of the last tokens: the
        last one counts)."""
        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
        self._held[("recurrent", layer_idx, state_idx)] = last
        return last

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """A decode updated its conv state in place (the copy ``get_conv_state`` returned): staged by ``finish``."""
        self._written.add(("conv", layer_idx, state_idx))

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def finish(self) -> None:
        """Stages the states this call wrote, and the recurrent states it read (which it may have changed in
        place)."""
        for key, state in self._held.items():
            if key[0] == "recurrent" or key in self._written:
                self.states.stage(key, self.rows, state)


@dataclass
class RecurrentStep:
    """How a forward's packed row splits for the recurrent layers, built once per forward (``build_metadata``).

    ``decode_tokens`` / ``decode_rows`` ``[D]``: the token and state row of each continuing one-token sequence (the
    layers run them as one batch; ``decodes_are_first``: ``decode_tokens`` is ``0 .. D - 1``); ``pieces``: ``(first
    token, end token, fresh)`` of every other sequence (each runs alone), whose state rows are ``piece_rows`` ``[P]``.
    """

    decode_tokens: torch.Tensor
    decode_rows: torch.Tensor
    decodes_are_first: bool
    piece_rows: torch.Tensor
    pieces: list[tuple[int, int, bool]]

    @classmethod
    def of(cls, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, query_start_loc: torch.Tensor,
           move) -> "RecurrentStep":
        """From a forward's host tensors ``[S]`` (state rows, tokens held before, new tokens) and ``[S + 1]``
        (``query_start_loc``); ``move`` puts a host tensor on the forward's device."""
        starts_l, counts_l, locs = starts.tolist(), counts.tolist(), query_start_loc.tolist()
        decodes = [s for s, (start, count) in enumerate(zip(starts_l, counts_l)) if count == 1 and start > 0]
        batched = set(decodes)
        others = [s for s in range(len(starts_l)) if counts_l[s] and s not in batched]
        index = torch.tensor(decodes, dtype=torch.long)
        tokens = query_start_loc.index_select(0, index)
        return cls(move(tokens), move(rows.index_select(0, index)), tokens.tolist() == list(range(len(decodes))),
                   move(rows.index_select(0, torch.tensor(others, dtype=torch.long))),
                   [(locs[s], locs[s + 1], starts_l[s] == 0) for s in others])

    def all_fresh(self) -> "RecurrentStep":
        """The same step with every sequence fresh and alone (a scratch step, whose sequences never wrote a state)."""
        pieces = [(t, t + 1, True) for t in self.decode_tokens.tolist()]
        return RecurrentStep(self.decode_tokens[:0], self.decode_rows[:0], True,
                             torch.cat([self.decode_rows, self.piece_rows]),
                             pieces + [(a, b, True) for a, b, _ in self.pieces])
