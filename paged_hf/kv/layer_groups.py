"""Layer groups and their attention window, the rules stated once.

Layers that read the same tokens share block tables: one *group* for the full-attention layers and one per sliding
window, each with its own pool. What differs between groups is the window, and it decides three things, written
here only (as vLLM's ``FullAttentionManager`` / ``SlidingWindowManager`` and transformers' full / sliding cache
allocators do):

* ``blocks_to_hold(n)``: the most blocks one sequence of ``n`` tokens holds at once;
* ``first_needed(n)``: the first position a future query of a sequence of ``n`` tokens can see (every block wholly
  below it can be freed as the window slides);
* ``can_roll_back(num_freed, n)``: whether a table that freed ``num_freed`` leading blocks can roll back to ``n``
  tokens (the next forward must not need a freed block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers.cache_utils import get_layer_types_and_kwargs

from ..block_pool import BlockPool
from ..block_table import num_blocks_for
from ..block_table_rows import BlockTableRows
from ..storage import KVStorage
from .recurrent import NO_KV_LAYER_TYPES

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# recurrent layers that attend too: their K/V go to the group of the attention they name
ATTENTION_OF_HYBRID = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}


class FullAttention:
    """Every query sees every earlier token: a sequence keeps all its blocks."""

    window: int | None = None
    name = "full_attention"

    def blocks_to_hold(self, num_tokens: int, block_size: int) -> int:
        return num_blocks_for(num_tokens, block_size)

    def first_needed(self, num_tokens: int) -> int:
        return 0

    def can_roll_back(self, num_freed: int, block_size: int, num_tokens: int) -> bool:
        return True


class SlidingWindow:
    """A query at position ``p`` sees positions ``p - window + 1 .. p``: blocks below the next query's window are
    freed, so a sequence holds at most the window's blocks plus the one it straddles."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.name = f"sliding_attention(window={window})"

    def blocks_to_hold(self, num_tokens: int, block_size: int) -> int:
        return min(num_blocks_for(num_tokens, block_size), num_blocks_for(self.window, block_size) + 1)

    def first_needed(self, num_tokens: int) -> int:
        """The next query (position ``num_tokens``) sees ``num_tokens - window + 1`` on."""
        return num_tokens - (self.window - 1)

    def can_roll_back(self, num_freed: int, block_size: int, num_tokens: int) -> bool:
        return num_freed * block_size <= max(0, self.first_needed(num_tokens))


WindowPolicy = FullAttention | SlidingWindow


@dataclass
class LayerGroup:
    """Layers that read the same tokens through the same block tables (one pool, one table per sequence)."""

    index: int
    policy: WindowPolicy
    block_size: int
    layer_indices: list[int] = field(default_factory=list)
    pool: BlockPool | None = None
    storages: dict[int, KVStorage] = field(default_factory=dict)
    rows: BlockTableRows = field(default_factory=BlockTableRows)

    @property
    def window(self) -> int | None:
        """The sliding window in tokens; None: full attention."""
        return self.policy.window

    @property
    def name(self) -> str:
        return self.policy.name


def layer_groups(text_config, block_size: int) -> list[LayerGroup]:
    """The groups of a decoder config's attention layers, in the order of their first layer (layers without K/V
    belong to none). NotImplementedError for a layer type the paged cache cannot hold, or for a model with no
    attention layer (a state-space model)."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    groups: dict[int | None, LayerGroup] = {}
    for layer_idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if layer_type in NO_KV_LAYER_TYPES:
            continue
        layer_type = ATTENTION_OF_HYBRID.get(layer_type, layer_type)
        if layer_type not in SUPPORTED_LAYER_TYPES:
            raise NotImplementedError(
                f"PagedCache supports layer types {SUPPORTED_LAYER_TYPES}; layer {layer_idx} is {layer_type!r}"
            )
        window = kwargs.get("sliding_window") if layer_type == "sliding_attention" else None
        if window not in groups:
            policy = FullAttention() if window is None else SlidingWindow(window)
            groups[window] = LayerGroup(len(groups), policy, block_size)
        groups[window].layer_indices.append(layer_idx)
    if not groups:
        raise NotImplementedError(f"PagedCache pages attention K/V; no layer of {text_config.model_type!r} attends "
                                  f"(layer types {sorted(set(layer_types))})")
    return list(groups.values())
