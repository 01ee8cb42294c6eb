"""The ``Cache`` the engine hands the model for one forward: its ``PagedLayer``s store K/V where the step's
metadata says and pass it to the ``"paged"`` attention. The pools and tables are the engine's ``KVManager``'s; the
scheduler, not this object, decides what each forward holds."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DummyLayer

from .. import ops
from ..cache_layer import PagedLayer
from ..kernels import cpu_ext
from ..kv.manager import KVManager
from ..metadata import AttentionMetadata


class EngineCache(Cache):
    """One forward's view of a ``KVManager`` and the ``LayerSource`` of its layers: set ``metadata`` before calling
    the model. ``num_decodes``: None for the eager forward; for the compiled one, the step's
    ``metadata.num_decodes`` as a ``[1]`` CPU tensor: the layers then go through the custom ops of ``paged_hf.ops``
    (whose arguments are tensors, so no step's count is a graph constant), with this cache's ``pools()`` bound.
    ``native_ops``: the format is "auto" and ``paged_hf_cpu``'s C++ store and attention are built, so a CPU forward
    in float32 or bfloat16 takes them (``ops.store_layer``); a plain bool, the same for a warm-up's scratch cache and
    the engine's, so the graph traced over one serves the other."""

    reads_blocks = True  # the engine's model runs the paged attention
    mixed_masks = False

    def __init__(self, kv: KVManager) -> None:
        # a layer without K/V (recurrent: its mixer reads ``recurrent_step``; or a MoE block) holds a DummyLayer
        super().__init__(layers=[PagedLayer(self, idx, kv.group_of[idx], kv.readers.get(idx, ()),
                                            kv.latent_dims.get(idx))
                                 if idx in kv.group_of else DummyLayer()
                                 for idx in range(kv.text_config.num_hidden_layers)])
        self.metadata: AttentionMetadata | None = None
        self.num_decodes: torch.Tensor | None = None
        self.kv = kv
        self.native_ops = kv.kv_format == "auto" and cpu_ext.loaded()
        self._pools: ops.BoundPools | None = None

    @property
    def recurrent_step(self) -> tuple | None:
        """``(RecurrentStates, RecurrentStep)`` of the forward running, for the recurrent layers' mixers
        (``engine.recurrent_mixers``); None for a model without them."""
        if self.kv.recurrent is None or self.metadata is None:
            return None
        return self.kv.recurrent, self.metadata.recurrent

    def storages(self) -> dict:
        """``{layer index: KVStorage}``: what the ops read."""
        return {idx: group.storages[idx] for idx, group in self.kv.group_of.items()}

    def pools(self) -> ops.BoundPools:
        """What the compiled forward binds (``ops.bind``). Built once (the engine allocates its pools once; a growable
        pool, whose tensors ``reserve`` may replace, is read again each time)."""
        if self._pools is not None:
            return self._pools
        pools = ops.pools(self.storages())
        if not self.kv.growable:
            self._pools = pools
        return pools

    def initialize_layer(self, layer: PagedLayer, key_states: torch.Tensor) -> None:
        """Nothing: the engine allocates its pools up front."""

    def layer_metadata(self, layer: PagedLayer, key_states: torch.Tensor, kwargs: dict | None) -> AttentionMetadata:
        return self.metadata

    def dense_kv(self, layer: PagedLayer, storage, group, fresh):
        raise RuntimeError(f"{type(self).__name__}: layer {layer.layer_idx} asked for dense K/V; the engine's "
                           f"attention reads the blocks")

    def dense_view(self, layer: PagedLayer, which: int) -> None:
        """None: the engine's layers keep no dense K/V."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
