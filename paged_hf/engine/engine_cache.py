"""The engine's cache: a ``PagedCache`` whose step plans come from the scheduler instead of ``position_ids``.

Each engine forward is one HF row holding every scheduled sequence's new tokens back to back; the plan names
the sequences, their lengths and slots, and the ``"paged"`` attention reads it from the layer's kwargs.
"""

from __future__ import annotations

import torch

from ..block_pool import BlockPool
from ..cache import PagedCache
from ..quant import make_storage
from ..step_plan import StepPlan


class EngineCache(PagedCache):
    def __init__(self, config, block_size: int, num_blocks: int, kv_cache_dtype: str, dtype: torch.dtype, device):
        super().__init__(config, block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype)
        for group in self.groups:  # the engine keeps finished blocks as a prefix cache
            group.pool = BlockPool(num_blocks, enable_caching=True)
        cfg = self.text_config
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        for layer in self.layers:  # allocated up front: the engine's pool is sized once
            layer.group.storages[layer.layer_idx] = make_storage(
                self.kv_format, num_blocks, block_size, num_kv_heads, self.head_dim, dtype, device
            )
            layer.is_initialized = True

    def begin_step(self, plan: StepPlan) -> None:
        """Installs the plan every layer's ``update`` of the next forward uses."""
        self._plan = plan

    def _plan_step(self, key_states, kwargs):
        raise RuntimeError("EngineCache: call begin_step(plan) before each forward; the engine plans its steps")
