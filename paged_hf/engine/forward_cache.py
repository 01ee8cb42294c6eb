"""The ``Cache`` the engine hands the model for one forward: its layers store K/V where the step's metadata says
and pass the metadata to the ``"paged"`` attention. The pools and tables are the engine's ``KVManager``'s; the
scheduler, not this object, decides what each forward holds."""

from __future__ import annotations

from transformers.cache_utils import Cache, CacheLayerMixin

from .. import ops
from ..kv.layer_groups import LayerGroup
from ..kv.manager import KVManager
from ..metadata import METADATA_KEY, AttentionMetadata, LayerStep, write_layer_kv


class _EngineLayer(CacheLayerMixin):
    def __init__(self, cache: "EngineCache", layer_idx: int, group: LayerGroup) -> None:
        super().__init__()
        self.cache, self.layer_idx, self.group = cache, layer_idx, group
        self.is_sliding = group.window is not None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the engine allocates its pools up front
        pass

    def update(self, key_states, value_states, *args, kwargs: dict | None = None, **unused):
        metadata = self.cache.metadata
        group = metadata.groups[self.group.index]
        storage = self.group.storages[self.layer_idx]
        if kwargs is None:
            raise RuntimeError(
                f"{type(self).__name__}: layer {self.layer_idx} called cache.update without kwargs, so the paged "
                f"attention cannot receive the step's block tables; the engine needs a model that passes kwargs"
            )
        if self.cache.num_decodes is not None:  # the compiled forward: the store and the attention are custom ops
            kwargs[METADATA_KEY] = ops.store_layer(metadata, group, self.layer_idx, key_states, value_states,
                                                   self.cache.num_decodes)
            return key_states, value_states
        fresh = write_layer_kv(storage, metadata, group, key_states, value_states)
        kwargs[METADATA_KEY] = LayerStep(metadata, group, self.group.index, storage, fresh)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class EngineCache(Cache):
    """One forward's view of a ``KVManager``: set ``metadata`` before calling the model. ``num_decodes``: None for
    the eager forward; for the compiled one, the step's ``metadata.num_decodes`` as a ``[1]`` CPU tensor: the
    layers then go through the custom ops of ``paged_hf.ops`` (whose arguments are tensors, so no step's count is
    a graph constant), with this cache's ``storages()`` bound."""

    def __init__(self, kv: KVManager) -> None:
        super().__init__(layers=[_EngineLayer(self, idx, kv.group_of[idx]) for idx in sorted(kv.group_of)])
        self.metadata: AttentionMetadata | None = None
        self.num_decodes: torch.Tensor | None = None
        self.kv = kv

    def storages(self) -> dict:
        """``{layer index: KVStorage}``: what the ops read (``ops.bind``)."""
        return {idx: group.storages[idx] for idx, group in self.kv.group_of.items()}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
