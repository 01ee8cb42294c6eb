"""``PagedCache``: the transformers ``Cache`` over a ``KVManager`` that ``generate`` and any attention drive.

Each batch row is one sequence (a ``SequenceKV``) holding only its real tokens: pads take no slot, whatever the
padding side. A forward is planned once, for every layer (``timeline_plan``): which of its ``[B, q]`` columns are
real tokens, their blocks (allocated, copy-on-write), and the ``AttentionMetadata``. Real tokens come from the 2D
attention mask, which the cache receives when transformers builds the forward's masks (``observe_forward``, called
by the ``patches`` hook before any layer runs: in ``generate`` that happens before the forward, outside a compiled
region); without a mask, the last position of each row says how many of its columns are real (left padding), and
without positions every column is real. Each layer's ``update`` (``PagedLayer``, whose ``LayerSource`` this cache
is) then only writes its K/V and hands the metadata to the attention through its ``kwargs`` (or, for a dense
attention, gathers the K/V into HF's padded layout).

``columns`` (``[B, seq_length]``) maps HF's padded timeline to real positions (-1 for a pad), so the dense views
(``layers[i].keys``), the dense attention path and ``crop`` all see the layout ``DynamicCache`` would hold.

A ``DynamicCache`` subclass: it grows on demand like one and offers its per-layer views, so code that expects the
default cache (``isinstance(cache, DynamicCache)``) takes it as such.
"""

from __future__ import annotations

from dataclasses import asdict
from enum import Enum

import torch
from transformers.cache_utils import (Cache, DummyLayer, DynamicCache, LinearAttentionLayer,
                                      get_layer_types_and_kwargs)

from .cache_layer import PagedLayer
from .config import CacheConfig
from .kernels import dispatch
from .kv import sizing
from .kv.growth import PagedCacheFullError
from .kv.manager import KVManager
from .kv.model_config import block_id_bytes, check_supported
from .kv.recurrent import HYBRID_LAYER_TYPES, RECURRENT_LAYER_TYPES
from .kv.sequence import SequenceKV
from .kv_stats import PagedCacheStats
from .metadata import METADATA_KEY, AttentionMetadata, drop_handed_steps, table_width
from .timeline import PaddedTimeline
from .timeline_plan import dense_layout, plan_forward

__all__ = ["PagedCache", "PagedCacheFullError", "PagedLayer", "METADATA_KEY"]


def _devices() -> list[torch.device]:
    """This machine's devices a pool could live on: the host and each CUDA device."""
    cuda = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return [torch.device("cpu"), *cuda]


class _Forward(Enum):
    """Where the cache is in a forward: no plan (IDLE), the next forward's plan ready (PLANNED), layers writing it
    (RUNNING)."""

    IDLE = "idle"
    PLANNED = "planned"
    RUNNING = "running"


class PagedCache(DynamicCache):
    """A paged KV cache that ``generate`` and any attention implementation can drive.

    Args:
        config: the model config (its decoder config gives layer types and sliding windows).
        block_size, num_blocks, kv_cache_dtype, memory_budget: see ``CacheConfig``.
        max_length: the longest a row will get (prompt + new tokens), when known (``generate`` passes it): block
            tables have that width from the start, so a compiled decode step keeps one shape.
        tp_size: the tensor-parallel size the model runs with (``generate`` passes ``model.tp_size``): each rank
            stores ``num_key_value_heads / tp_size`` heads, which is what ``memory_budget`` sizes.

    With ``attn_implementation="paged"`` the attention reads the blocks directly; with any other
    implementation ``update`` returns each row's K/V gathered into the dense, padded layout the mask expects. (int4:
    the paged attention reads each query's own block in full precision, as a decode step does; a dense view can
    only hold one value per token, so it reads what is stored: full blocks quantized, the rest exact.)
    """

    def __init__(
        self,
        config,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        memory_budget: int | None = None,
        max_length: int | None = None,
        tp_size: int = 1,
    ) -> None:
        self.cache_config = CacheConfig(block_size, num_blocks, kv_cache_dtype, memory_budget)
        self.text_config = config.get_text_config(decoder=True)
        check_supported(self.text_config, config)
        if num_blocks is None and memory_budget is not None:
            per_block = block_id_bytes(self.text_config, block_size, kv_cache_dtype, tp_size)
            num_blocks = memory_budget // per_block
            if num_blocks < 1:
                raise ValueError(
                    f"memory_budget={memory_budget} bytes is below one block of every layer ({per_block} bytes); "
                    f"raise memory_budget or lower block_size"
                )
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        self.kv = KVManager(self.text_config, block_size, kv_cache_dtype, num_blocks, tp_size=tp_size)
        sizing.check_fits_on(self.kv, _devices())  # a pool no device here can hold fails now, not at the first forward
        Cache.__init__(self, layers=self._make_layers())
        self._min_table_width = table_width(-(-max_length // block_size)) if max_length else 1
        self._last_layer = max(self.kv.group_of)
        self.rows: list[SequenceKV] = []  # one sequence per batch row
        self.timeline = PaddedTimeline()  # HF's padded [B, seq_length] columns over the rows
        self._metadata: AttentionMetadata | None = None
        self._dense_slots: list[tuple] = []  # per group, for a dense attention: [B, kv_length] slots, tail slots
        self._state = _Forward.IDLE
        self._written: set[int] = set()  # layers that wrote the running plan (finds a forward that was cut short)
        # The attention the model actually calls, from the config its mask builders get (observe_forward); until a
        # forward has been observed, the config this cache was built from. A config is only data: a cache built
        # from another config object (another instance, AutoConfig, a copy) must follow the model, not the copy.
        self._attention: str | None = None
        # This forward's masks: None (none built yet), "paged" (a plain one: None given, the paged attention derives
        # it), "dense" (one the paged attention does not express: the forward runs densely, ``answer_densely``) or
        # "mixed" (a plain one left to the paged attention, then one it does not express: each layer attends as its
        # mask says, ``mixed_masks``)
        self._masks: str | None = None

    def _make_layers(self) -> list:
        """A ``PagedLayer`` per attention layer. A recurrent layer keeps its states as on ``DynamicCache``
        (transformers' ``LinearAttentionLayer``: one row per batch row, fixed size; a ``"hybrid"`` layer has one
        beside its ``PagedLayer``), in ``self._recurrent``; a MoE or MLP block keeps nothing."""
        layer_types, layer_kwargs = get_layer_types_and_kwargs(self.text_config)
        self._recurrent: dict[int, LinearAttentionLayer] = {}
        layers = []
        for idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if layer_type in RECURRENT_LAYER_TYPES + HYBRID_LAYER_TYPES:
                self._recurrent[idx] = LinearAttentionLayer(number_of_states=kwargs.get("number_of_states", 1))
            if idx in self.kv.group_of:
                layers.append(PagedLayer(self, idx, self.kv.group_of[idx], self.kv.readers.get(idx, ()),
                                         self.kv.latent_dims.get(idx)))
            else:
                layers.append(self._recurrent.get(idx) or DummyLayer())
        return layers

    def _recurrent_layers(self) -> list[LinearAttentionLayer]:
        return list(self._recurrent.values())

    # ------------------------------------------------------- the recurrent layers' states (Cache's interface)
    def _states_of(self, layer_idx: int) -> LinearAttentionLayer:
        states = self._recurrent.get(layer_idx)
        if states is None:
            raise ValueError(f"layer {layer_idx} keeps no recurrent state (it is not a linear-attention, state-space "
                             f"or convolution layer)")
        return states

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        states = self._states_of(layer_idx)
        return states.conv_states[state_idx] if states.has_previous_state[state_idx] else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._states_of(layer_idx).update_conv_state(conv_states, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        states = self._states_of(layer_idx)
        return states.recurrent_states[state_idx] if states.has_previous_state[state_idx] else None

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._states_of(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        self._states_of(layer_idx).increase_count(state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return getattr(self._recurrent.get(layer_idx), "record_past", False)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        indices = self._recurrent if layer_idx is None else [layer_idx]
        return max((getattr(self._recurrent[i], "recurrent_states_to_keep", 0) or 0
                    for i in indices if self.is_recording_past(i)), default=0)

    def activate_past_recording(self, **kwargs) -> None:
        for states in self._recurrent.values():
            states.activate_past_recording(**kwargs)

    @property
    def seq_length(self) -> int:
        """Columns of HF's padded timeline."""
        return self.timeline.seq_length

    @property
    def columns(self) -> torch.Tensor:
        """``[B, seq_length]``: the real position of each column of each row, -1 for a pad."""
        return self.timeline.columns

    @property
    def num_tokens(self) -> list[int]:
        """Real tokens held per row."""
        return [seq.num_tokens for seq in self.rows]

    # ------------------------------------------------------------------------------------ the step
    def observe_forward(self, batch: int, query_len: int, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None, device, attention: str | None = None) -> None:
        """Plans the coming forward of ``[batch, query_len]`` tokens (called when its masks are built, before any
        layer runs). ``attention_mask``: HF's 2D mask over the padded timeline, or None. ``attention``: the
        ``_attn_implementation`` of the model running the forward (its mask builders' config), which decides
        whether layers hand the paged attention its metadata or return dense K/V. Planning twice for one forward
        (a full and a sliding mask) is a no-op."""
        if self._state is _Forward.PLANNED:
            return
        if attention is not None:
            self._attention = attention
        self._plan(batch, self.timeline.new_columns(batch, query_len, attention_mask, position_ids, self.num_tokens),
                   device)
        self._state = _Forward.PLANNED

    def _plan(self, batch: int, new: torch.Tensor, device) -> None:
        """Plans a forward of ``batch`` rows whose real columns are ``new`` ``[B, q]`` (``timeline_plan``)."""
        if not self.rows:
            self.rows = [self.kv.new_sequence() for _ in range(batch)]
            self.timeline.reset(batch)
        elif batch != len(self.rows):
            raise ValueError(
                f"PagedCache holds {len(self.rows)} sequences but the forward has batch size {batch}; "
                f"call cache.reset() to start a new batch"
            )
        self._masks = None
        drop_handed_steps()
        self._metadata, self._dense_slots = plan_forward(self.kv, self.rows, self.timeline, new, device,
                                                         self._min_table_width, dense=not self.reads_blocks)
        self._written = set()

    # ------------------------------------------------------------------ the layers' source (LayerSource)
    num_decodes = None  # no custom-op forward: that is the engine's

    @property
    def reads_blocks(self) -> bool:
        """Whether this forward's attention is the paged one (reads the blocks) rather than a dense one."""
        attention = self._attention if self._attention is not None else self.text_config._attn_implementation
        return attention == "paged" and self._masks not in ("dense", "mixed")

    @property
    def mixed_masks(self) -> bool:
        """Whether this forward's layers attend as their masks say: the paged attention where the mask was left to
        it (None), densely where it adds a part the paged attention does not express (Gemma 4's image tokens
        attending to each other both ways in its sliding layers, its full layers causal). Each layer then returns
        its dense K/V and hands its attention the step too (``LayerStep.dense``)."""
        return self._masks == "mixed"

    def answer_densely(self) -> bool:
        """The planned forward's mask adds a part the paged attention does not express (``attention.paged_mask``):
        its layers return their K/V in the padded layout that mask covers, for the exact dense attention. True the
        first time in a forward. Where an earlier mask of the forward was already left to the paged attention, the
        forward's masks are mixed (``mixed_masks``); ``NotImplementedError`` for a format with a full-precision tail
        there (a dense read writes the tails, which the paged attention must read as they were before the
        forward)."""
        if self._masks in ("dense", "mixed"):
            return False
        if self._state is not _Forward.PLANNED:
            raise RuntimeError("PagedCache.answer_densely: the forward's layers already began (a mask built after "
                               "the first layer runs cannot change how they attend)")
        if self._masks == "paged" and self.kv.has_tail:
            raise NotImplementedError(
                f"this forward's attention masks mix a plain causal mask with one that adds a non-causal part, which "
                f"the paged attention serves layer by layer for every kv_cache_dtype but "
                f"{self.kv.kv_format!r} (its full-precision tails); run this model with attn_implementation='sdpa' "
                f"on the PagedCache")
        query_len = self._metadata.query_len
        self._dense_slots = dense_layout(self.kv, self.rows, self.timeline, self.seq_length - query_len, query_len,
                                         self._metadata.device)
        self._masks = "mixed" if self._masks == "paged" else "dense"
        return True

    def leave_mask_to_paged(self) -> bool:
        """The planned forward got a plain mask: True when the paged attention derives it (its masks mixed or not),
        False when the forward already runs densely (then the dense attention needs that mask too)."""
        if self._masks == "dense":
            return False
        if self._masks != "mixed":
            self._masks = "paged"
        return True

    def _slots(self, group, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self._metadata.device if self._metadata is not None else "cpu"
        return self.timeline.slots(group, self.rows, first, count, self.kv.has_tail, device)

    def initialize_layer(self, layer: PagedLayer, key_states: torch.Tensor) -> None:
        sizing.allocate_layer(self.kv, layer.layer_idx, key_states.dtype, key_states.device, key_states.shape[1])

    def layer_metadata(self, layer: PagedLayer, key_states: torch.Tensor, kwargs: dict | None) -> AttentionMetadata:
        """The planned forward's metadata; a layer that finds no plan (or a new forward) plans it first."""
        if self._state is _Forward.PLANNED:
            self._state = _Forward.RUNNING
        elif self._state is _Forward.IDLE or layer.layer_idx in self._written:  # no plan, or a new forward
            batch, _, query_len, _ = key_states.shape
            position_ids = kwargs.get("position_ids") if kwargs else None
            new = self.timeline.new_columns(batch, query_len, None, position_ids, self.num_tokens)
            self._plan(batch, new, key_states.device)
            self._state = _Forward.RUNNING
        if not torch.compiler.is_compiling():
            self._written.add(layer.layer_idx)
        if not layer.is_initialized:  # after planning: a pool too small fails before any tensor is allocated
            self.initialize_layer(layer, key_states)
        if layer.layer_idx == self._last_layer:
            self._state = _Forward.IDLE
        return self._metadata

    def dense_kv(self, layer: PagedLayer, storage, group, fresh) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense attention's K/V ``[B, kv_heads, L, head_dim]`` in the padded layout its mask expects, contiguous
        as ``DynamicCache``'s are (GPT-NeoX-Japanese ``view``s them)."""
        if fresh is not None:  # a dense read sees what is stored: full blocks quantized, the rest from the tails
            storage.write_tails(fresh, group.store_plan)
        keys, values = storage.read_slots(*self._dense_slots[layer.group.index])  # [B, L, H, D]
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()

    def dense_view(self, layer: PagedLayer, which: int) -> torch.Tensor | None:
        """``layer``'s keys (``which=0``) or values as ``DynamicCache`` holds them (see ``PagedLayer``)."""
        storage = layer.group.storages.get(layer.layer_idx)
        if storage is None or not self.rows:
            return None
        window = layer.group.window
        first = 0 if window is None else max(self.seq_length - (window - 1), 0)
        slots, tail_slots = self._slots(layer.group, first, self.seq_length - first)
        states = storage.read_slots(slots.to(storage.device),
                                    None if tail_slots is None else tail_slots.to(storage.device))[which]  # [B,L,H,D]
        pads = (self.columns[:, first:] < 0).to(storage.device)
        return states.masked_fill(pads[:, :, None, None], 0).transpose(1, 2).contiguous()

    # ------------------------------------------------------------------------- generate's hooks
    def _select_rows(self, rows: list[int]) -> None:
        """Row ``i`` becomes old row ``rows[i]``, sharing its blocks (fork); unused rows are freed. A recurrent
        layer's rows are selected the same way (copied: they are small)."""
        for layer in self._recurrent_layers():
            layer.reorder_cache(torch.tensor(rows, dtype=torch.long))
        forks = [self.kv.fork(self.rows[r]) for r in rows]
        for seq in self.rows:
            self.kv.discard(seq)
        self.rows = forks
        self.timeline.select(rows)
        self._metadata, self._state = None, _Forward.IDLE

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues beam ``beam_idx[i]``; blocks are shared, never copied."""
        if self.rows:
            self._select_rows([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows:
            self._select_rows([row for row in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.rows:
            self._select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` columns of every row (assisted decoding's rollback); each row
        gives back the real tokens among them.

        A format with a full-precision tail (int4) that crops back into a block that was full (its codes written)
        dequantizes the kept tokens of that block into the row's tail: they keep the values the attention already
        read for them, and the block is quantized again, from those values and the new tokens, when it refills
        (``KVManager.truncate``)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove (as DynamicCache), got {tokens_to_remove}"
            )
        remove = -tokens_to_remove
        for layer in self._recurrent_layers():  # back to the states they recorded (activate_past_recording)
            layer.crop(tokens_to_remove)
        if remove == 0 or not self.rows:
            return
        dropped = self.timeline.crop(remove)
        for seq, count in zip(self.rows, dropped):
            self.kv.truncate(seq, seq.num_tokens - count)
        self._metadata, self._state = None, _Forward.IDLE

    def reset(self) -> None:
        """Frees every sequence's blocks; the pool tensors stay allocated for reuse."""
        for seq in self.rows:
            self.kv.discard(seq)
        for layer in self._recurrent_layers():
            layer.reset()
        self.rows = []
        self.timeline.reset()
        self._metadata, self._state = None, _Forward.IDLE

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of HF's padded timeline; while a forward is planned but not run, the columns before it (what
        the model and its mask builders expect to see as the past)."""
        return self.seq_length - self._metadata.query_len if self._state is _Forward.PLANNED else self.seq_length

    @property
    def is_compileable(self) -> bool:
        """Every forward is planned before its layers run and a layer's update is tensor work only, so the torch
        path compiles (fullgraph, one shape per decode step). The Triton kernels have not run under torch.compile
        on a GPU yet: a pool on them (CUDA) says False, so ``generate`` does not compile it by itself."""
        if not all(layer.is_compileable for layer in self._recurrent_layers()):
            return False
        storages = [s for g in self.kv.groups for s in g.storages.values()]
        if storages:
            return not any(s.kernels.triton for s in storages)
        return not (torch.cuda.is_available() and dispatch.triton_available())

    # ------------------------------------------------------------------------------- introspection
    def check_invariants(self) -> None:
        """Asserts the pool invariants and that each block's ref count equals the tables holding it."""
        self.kv.check_invariants()

    def stats(self) -> PagedCacheStats:
        """The pool (blocks used / total, bytes) and the bytes of the slots holding real tokens."""
        pool = self.kv.stats()
        live = 0
        per_token = 0
        for group in self.kv.groups:
            token_bytes = sum(s.bytes_per_token for s in group.storages.values())
            per_token += token_bytes
            filled: dict[int, int] = {}
            for seq in self.rows:
                table = seq.tables[group.index]
                for index, block in enumerate(table.blocks):
                    if block is not None:
                        count = min(group.block_size, table.num_tokens - index * group.block_size)
                        filled[block.block_id] = max(filled.get(block.block_id, 0), count)
            live += sum(filled.values()) * token_bytes
        if not per_token:  # no forward yet: the config's dtype
            per_token = sizing.block_id_bytes(self.kv) // self.kv.block_size
        tails = sum(1 for seq in self.rows if seq.num_tokens % self.kv.block_size)
        if tails and self.kv.has_tail:  # rows whose newest tokens sit in their tail rows
            dtype = next((s.dtype for g in self.kv.groups for s in g.storages.values()), None)
            live += tails * sizing.tail_bytes_per_row(self.kv, dtype)
        return PagedCacheStats(**asdict(pool), kv_cache_bytes_live=live, bytes_per_token=per_token)
