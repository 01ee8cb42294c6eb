"""``PagedLayer``: one layer's view of a ``PagedCache`` (transformers' ``CacheLayerMixin``): its dense K/V views,
its device and dtype, its mask sizes (full or sliding), and ``update``, which the cache runs. The cache owns the
pools and tables.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .kv.layer_groups import LayerGroup
from .kv.sizing import allocate_layer


class PagedLayer(CacheLayerMixin):
    """One layer's view of a ``PagedCache``; the cache owns the pools and tables.

    ``keys`` / ``values`` are *copies*: the layer's K/V gathered into the ``[batch, kv_heads, seq, head_dim]`` layout
    a ``DynamicCache`` layer holds (every column of the padded timeline, zeros for pads; a sliding layer its last
    ``window - 1`` columns).
    """

    is_croppable = True

    def __init__(self, cache: "PagedCache", layer_idx: int, group: LayerGroup) -> None:
        self.cache = cache
        self.layer_idx = layer_idx
        self.group = group
        self.is_sliding = group.window is not None
        self.is_initialized = False

    @property
    def keys(self) -> torch.Tensor | None:
        return self.cache._dense_view(self, 0)

    @property
    def values(self) -> torch.Tensor | None:
        return self.cache._dense_view(self, 1)

    @property
    def device(self):
        storage = self.group.storages.get(self.layer_idx)
        return None if storage is None else storage.device

    @property
    def dtype(self):
        storage = self.group.storages.get(self.layer_idx)
        return None if storage is None else storage.dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        allocate_layer(self.cache.kv, self.layer_idx, key_states.shape[1], key_states.dtype, key_states.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, kwargs: dict | None = None, **unused):
        return self.cache._update_layer(self, key_states, value_states, kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        seen = self.cache.get_seq_length()
        if self.group.window is None:
            return seen + query_length, 0
        window = self.group.window
        kv_offset = max(seen - window + 1, 0)
        kv_length = (window - 1 + query_length) if seen >= window else seen + query_length
        return kv_length, kv_offset

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1 if self.group.window is None else self.group.window

    def reset(self) -> None:  # the cache resets its sequences as a whole
        pass
