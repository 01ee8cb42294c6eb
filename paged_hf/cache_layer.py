"""``PagedLayer``: one layer of a paged ``Cache`` (transformers' ``CacheLayerMixin``), the same for ``generate``'s
``PagedCache`` and the engine's ``EngineCache``. Its ``update`` stores the layer's new K/V where the forward's
``AttentionMetadata`` says and hands the ``"paged"`` attention a ``LayerStep`` (the engine's compiled forward: the
store op and an ``OpStep``). Where the metadata comes from is its ``LayerSource``'s, one per caller:

- ``PagedCache`` plans each forward over HF's padded timeline (the first layer to update plans it when the mask
  builders did not) and answers an attention that does not read blocks with the K/V gathered into that layout;
- ``EngineCache`` holds the metadata the engine's runner built for the step and needs the paged attention.
"""

from __future__ import annotations

import copy
import weakref

from typing import Protocol

import torch
from transformers.cache_utils import CacheLayerMixin

from . import ops
from .kv.layer_groups import LayerGroup
from .metadata import METADATA_KEY, AttentionMetadata, GroupMetadata, LayerStep, hand_step, write_layer_kv


class LayerSource(Protocol):
    """What a ``PagedLayer`` asks the cache it belongs to."""

    num_decodes: torch.Tensor | None  # the engine's compiled forward: the step's decode count ([1], CPU); else None

    def initialize_layer(self, layer: PagedLayer, key_states: torch.Tensor) -> None:
        """Allocates ``layer``'s pool tensors (the engine's exist from the start)."""

    def layer_metadata(self, layer: PagedLayer, key_states: torch.Tensor, kwargs: dict | None) -> AttentionMetadata:
        """The running forward's metadata, the layer's pool allocated; ``kwargs``: the layer's attention kwargs."""

    @property
    def reads_blocks(self) -> bool:
        """Whether the layers' attention is the paged one (then it gets a ``LayerStep``)."""

    @property
    def mixed_masks(self) -> bool:
        """Whether each layer returns its dense K/V and hands its attention a ``LayerStep`` too (``dense``): the
        attention reads the blocks where the layer's mask was left to it, else attends densely."""

    def dense_kv(self, layer: PagedLayer, storage, group: GroupMetadata, fresh) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns when the attention does not read blocks, or gets no kwargs (K/V stored)."""

    def dense_view(self, layer: PagedLayer, which: int) -> torch.Tensor | None:
        """The layer's keys (0) or values (1) as a ``DynamicCache`` layer holds them, or None."""

    def get_seq_length(self) -> int: ...


class PagedLayer(CacheLayerMixin):
    """One layer of a paged cache; the ``source`` owns the pools' manager and the forward's metadata.

    ``keys`` / ``values`` are *copies*: the layer's K/V gathered into the ``[batch, kv_heads, seq, head_dim]`` layout
    a ``DynamicCache`` layer holds (``PagedCache``: every column of the padded timeline, zeros for pads; a sliding
    layer its last ``window - 1`` columns), or None.

    ``latent_dim``: a multi-head latent attention layer (``kv.model_config.latent_dims``). Its model hands ``update``
    the latent ``[B, 1, q, latent_dim]`` as keys and the rotary key ``[B, 1, q, rope]`` as values; the layer stores
    them as one row ``[latent | rotary key]`` (its storage's keys, which its values share) and splits what it
    returns the same way.
    """

    is_croppable = True

    def __init__(self, source: LayerSource, layer_idx: int, group: LayerGroup, readers: tuple[int, ...] = (),
                 latent_dim: int | None = None) -> None:
        # not CacheLayerMixin.__init__: it would assign ``keys`` / ``values``, which are views here
        self._source = weakref.ref(source)
        self.layer_idx = layer_idx
        self.group = group
        # the later layers that attend over this one's K/V, storing none of their own (``KVManager.readers``)
        self.readers = readers
        self.latent_dim = latent_dim
        self.is_sliding = group.window is not None
        self._shapes_checked = False  # the first eager write's K/V matched the layer's pool (``_check_shapes``)

    @property
    def source(self) -> LayerSource:
        """The cache this layer belongs to, held weakly: the cache holds its layers, and a cycle between them would
        outlive the cache wherever the collector cannot see it (an engine's ``gc.freeze()`` of a cache alive then)."""
        source = self._source()
        if source is None:
            raise RuntimeError(f"layer {self.layer_idx} of a paged cache was used after its cache was dropped")
        return source

    def __getstate__(self) -> dict:  # copy.deepcopy (transformers' prompt-reuse recipe): a copy's layers hold it
        state = self.__dict__.copy()
        state["_source"] = self.source
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _source=weakref.ref(state["_source"]))

    def __deepcopy__(self, memo: dict) -> "PagedLayer":
        """A copy within a copy of its cache (``copy.deepcopy(cache)``). NotImplementedError for a layer copied
        alone: its blocks live in its cache's pools, which the copy would not share (a model that copies cache
        layers for layers it runs more than once, as Dory's loops do, needs a cache of its own layers)."""
        source = self.source
        if id(source) not in memo:
            raise NotImplementedError(
                f"layer {self.layer_idx} of a paged cache was copied without its cache (a model that copies cache "
                f"layers, as Dory's recurrent loops do): the paged cache cannot serve it; use DynamicCache")
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    @property
    def is_initialized(self) -> bool:
        """Whether the layer's pool tensors exist."""
        return self.layer_idx in self.group.storages

    @property
    def keys(self) -> torch.Tensor | None:
        return self._dense_part(0)

    @property
    def values(self) -> torch.Tensor | None:
        return self._dense_part(1)

    def _dense_part(self, which: int) -> torch.Tensor | None:
        """``dense_view``'s keys (0) or values (1); a latent layer's latent or rotary key, split from its rows."""
        if self.latent_dim is None:
            return self.source.dense_view(self, which)
        rows = self.source.dense_view(self, 0)
        return None if rows is None else _split_row(rows, self.latent_dim)[which]

    @property
    def device(self):
        storage = self.group.storages.get(self.layer_idx)
        return None if storage is None else storage.device

    @property
    def dtype(self):
        storage = self.group.storages.get(self.layer_idx)
        return None if storage is None else storage.dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocates the layer's pool tensors for states like ``key_states`` (heads, dtype, device)."""
        self.source.initialize_layer(self, key_states)

    def update(self, key_states, value_states, *args, kwargs: dict | None = None, **unused):
        """Stores ``key_states`` / ``value_states`` ``[B, kv_heads, q, head_dim]`` and returns what the attention
        reads: the states themselves beside a ``LayerStep`` in ``kwargs`` (without kwargs: handed to the
        attention by layer index, ``metadata.hand_step``), or the source's dense K/V."""
        source = self.source  # one read of the weak reference a forward
        metadata = source.layer_metadata(self, key_states, kwargs)
        group = metadata.groups[self.group.index]
        latent = self.latent_dim
        # what the layer stores as its keys and values: a latent layer's one row, [B, 1, q, latent + rope]
        stored = (key_states, value_states) if latent is None else (torch.cat((key_states, value_states), -1),) * 2
        if source.num_decodes is not None:  # compiled: the store and attention are ops
            step = ops.store_layer(metadata, group, self.layer_idx, *stored, source.num_decodes, source.native_ops)
            if latent is not None:
                step = step._replace(stored=(1, latent, value_states.shape[-1]), latent=latent)
            self._hand_over(kwargs, step)
            return key_states, value_states
        storage = self.group.storages[self.layer_idx]
        if not self._shapes_checked:  # once: a forward's layers write the same shapes every step
            _check_shapes(self.layer_idx, storage, key_states, value_states, latent)
            self._shapes_checked = True
        fresh = write_layer_kv(storage, metadata, group, *stored)
        if source.reads_blocks:
            self._hand_over(kwargs, LayerStep(metadata, group, self.group.index, storage, fresh, self.layer_idx,
                                              key_states, value_states, latent=latent))
            return key_states, value_states
        keys, values = source.dense_kv(self, storage, group, fresh)
        if latent is not None:
            keys, values = _split_row(keys, latent)
        if source.mixed_masks:  # no tail format: ``PagedCache.answer_densely``
            self._hand_over(kwargs, LayerStep(metadata, group, self.group.index, storage, None, self.layer_idx,
                                              keys, values, dense=True, latent=latent))
        return keys, values

    def _hand_over(self, kwargs: dict | None, step) -> None:
        """``step`` to this layer's attention: by layer index (``hand_step``: also how a forward finds an attention
        that never took its step), and in its kwargs where the model passes them; and to each of its ``readers`` by
        index, the last of them writing a tail format's tails."""
        if self.readers:
            last, step = step, step.without_tail_writes()
            for reader in self.readers:
                hand_step(reader, last if reader == self.readers[-1] else step, self.layer_idx)
        hand_step(self.layer_idx, step)
        if kwargs is not None:
            kwargs[METADATA_KEY] = step

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        seen = self.source.get_seq_length()
        if self.group.window is None:
            return seen + query_length, 0
        window = self.group.window
        kv_offset = max(seen - window + 1, 0)
        kv_length = (window - 1 + query_length) if seen >= window else seen + query_length
        return kv_length, kv_offset

    def get_seq_length(self) -> int:
        return self.source.get_seq_length()

    def get_max_length(self) -> int:
        return -1 if self.group.window is None else self.group.window

    def reset(self) -> None:  # the source resets its sequences as a whole
        pass


def _split_row(rows: torch.Tensor, latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent layer's rows ``[..., latent + rope]`` as the latent and the rotary key, each contiguous (as
    ``DynamicCache`` holds them)."""
    return rows[..., :latent_dim].contiguous(), rows[..., latent_dim:].contiguous()


def _check_shapes(layer_idx: int, storage, key_states: torch.Tensor, value_states: torch.Tensor,
                  latent_dim: int | None = None) -> None:
    """NotImplementedError, naming what differs, when a layer's new K/V ``[B, kv_heads, q, head_dim]`` do not fit its
    pool: values of another head size than keys (MiMo-V2's ``v_head_dim``), or layers whose KV heads or head size
    differ from what the config says of the layer (MiMo-V2's sliding layers, which its config does not set per
    layer); a latent layer's latent and rotary key that do not make its one-head row."""
    heads, head_dim = storage.head_shape
    got = (key_states.shape[1], key_states.shape[-1], value_states.shape[1], value_states.shape[-1])
    if latent_dim is not None:
        if got != (1, latent_dim, 1, head_dim - latent_dim):
            raise NotImplementedError(
                f"layer {layer_idx} is a multi-head latent attention layer (kv_lora_rank={latent_dim}, rows of "
                f"{head_dim}) but stores keys of {got[0]} heads x {got[1]} dims and values of {got[2]} heads x "
                f"{got[3]} dims: paged_hf expects its one-head latent as keys and its rotary key as values")
        return
    if got != (heads, head_dim, heads, head_dim):
        raise NotImplementedError(
            f"layer {layer_idx} stores keys of {got[0]} heads x {got[1]} dims and values of {got[2]} heads x "
            f"{got[3]} dims, but its KV pool holds {heads} heads x {head_dim} dims for both: paged_hf pages K and V "
            f"of one head size, the same in every layer of a group (as the config gives them)")
