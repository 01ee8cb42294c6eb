"""``PagedCache``: a ``transformers.Cache`` whose K/V live in a block pool.

Each batch row is one sequence with its own block table. Layers that see the same tokens share tables: one
*group* for the full-attention layers and one per sliding window. Within a forward, the first ``update`` plans
the step once for every layer (new token counts, slots, copy-on-write copies); each layer's ``update`` then
only writes its K/V and hands the plan to the attention.

Left padding: ``generate`` gives pad tokens position 0 and real tokens positions ``0 .. n-1``, so the last
position of each row says how many of the chunk's tokens are real; pad tokens take no slot. Row ``b``'s real
tokens are always the last ``num_tokens[b]`` columns of HF's padded timeline of ``seq_length`` columns.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from .block_pool import BlockPool, NoFreeBlocksError
from .block_table import BlockTable
from .config import CacheConfig
from .step_plan import GroupPlan, StepPlan
from .quant import bytes_per_block, check_kv_format, make_storage

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
STATE_SPACE_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")
METADATA_KEY = "paged_hf_metadata"
GROWTH_DIVISOR = 4  # a growable pool grows by at least 1 / GROWTH_DIVISOR of its size


class PagedCacheFullError(RuntimeError):
    """The fixed-size pool has too few free blocks for the next forward; nothing was allocated."""


class LayerGroup:
    """Layers that read the same tokens through the same block tables (one pool, one table per row)."""

    def __init__(self, window: int | None, block_size: int) -> None:
        self.window = window  # None: full attention
        self.block_size = block_size
        self.layer_indices: list[int] = []
        self.pool: BlockPool | None = None
        self.tables: list[BlockTable] = []
        self.storages: dict[int, KVStorage] = {}

    @property
    def name(self) -> str:
        return "full_attention" if self.window is None else f"sliding_attention(window={self.window})"

    def free_tables(self) -> None:
        for table in self.tables:
            table.free()
        self.tables = []


class PagedLayer(CacheLayerMixin):
    """One layer's view of a ``PagedCache``; the cache owns the pools and tables."""

    is_croppable = True

    def __init__(self, cache: "PagedCache", layer_idx: int, group: LayerGroup) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.group = group
        self.is_sliding = group.window is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache._init_storage(self, key_states)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, kwargs: dict | None = None, **unused):
        return self.cache._update_layer(self, key_states, value_states, kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        seen = self.cache.seq_length
        if self.group.window is None:
            return seen + query_length, 0
        window = self.group.window
        kv_offset = max(seen - window + 1, 0)
        kv_length = (window - 1 + query_length) if seen >= window else seen + query_length
        return kv_length, kv_offset

    def get_seq_length(self) -> int:
        return self.cache.seq_length

    def get_max_length(self) -> int:
        return -1 if self.group.window is None else self.group.window

    def reset(self) -> None:  # the cache resets groups as a whole
        pass


class PagedCache(Cache):
    """A paged KV cache that ``generate`` and any attention implementation can drive.

    Args:
        config: the model config (its decoder config gives layer types and sliding windows).
        block_size, num_blocks, kv_cache_dtype, memory_budget: see ``CacheConfig``.

    With ``attn_implementation="paged"`` the attention reads the blocks directly; with any other
    implementation ``update`` returns each row's K/V gathered into the dense, left-padded layout the mask expects.
    """

    def __init__(
        self,
        config,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        memory_budget: int | None = None,
    ) -> None:
        self.cache_config = CacheConfig(block_size, num_blocks, kv_cache_dtype, memory_budget)
        self.text_config = config.get_text_config(decoder=True)
        _check_supported(config, self.text_config)
        self.head_dim = _head_dim(self.text_config)
        self.kv_format = check_kv_format(kv_cache_dtype, self.head_dim)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(self.text_config)
        self.groups: list[LayerGroup] = []
        by_window: dict[int | None, LayerGroup] = {}
        layers = []
        for layer_idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if layer_type not in SUPPORTED_LAYER_TYPES:
                raise NotImplementedError(
                    f"PagedCache supports layer types {SUPPORTED_LAYER_TYPES}; layer {layer_idx} is {layer_type!r}"
                )
            window = kwargs.get("sliding_window") if layer_type == "sliding_attention" else None
            if window not in by_window:
                by_window[window] = LayerGroup(window, self.cache_config.block_size)
                self.groups.append(by_window[window])
            by_window[window].layer_indices.append(layer_idx)
            layers.append(PagedLayer(self, layer_idx, by_window[window]))
        super().__init__(layers=layers)
        self.seq_length = 0  # columns of HF's padded timeline
        self.num_tokens: list[int] = []  # real tokens held per row
        self._plan: StepPlan | None = None
        self._fixed_num_blocks = self._initial_num_blocks()
        if self._fixed_num_blocks is not None:
            for group in self.groups:
                group.pool = BlockPool(self._fixed_num_blocks, enable_caching=False)

    # ----------------------------------------------------------------------------------------- sizing
    def _initial_num_blocks(self) -> int | None:
        cfg = self.cache_config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.memory_budget is None:
            return None  # grows on demand
        per_block = sum(self.block_bytes(idx) for group in self.groups for idx in group.layer_indices)
        num_blocks = cfg.memory_budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"memory_budget={cfg.memory_budget} bytes is below one block of every layer ({per_block} bytes); "
                f"raise memory_budget or lower block_size"
            )
        return num_blocks

    def block_bytes(self, layer_idx: int) -> int:
        cfg = self.text_config
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dtype = getattr(cfg, "dtype", None) or torch.float32
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
        return bytes_per_block(self.kv_format, self.cache_config.block_size, num_kv_heads, _head_dim(cfg), dtype)

    def _init_storage(self, layer: PagedLayer, key_states: torch.Tensor) -> None:
        group = layer.group
        num_blocks = group.pool.num_blocks if group.pool is not None else 1
        _, num_kv_heads, _, head_dim = key_states.shape
        group.storages[layer.layer_idx] = make_storage(
            self.kv_format, num_blocks, self.cache_config.block_size, num_kv_heads, head_dim,
            key_states.dtype, key_states.device,
        )

    def _ensure_capacity(self, group: LayerGroup, needed: int) -> None:
        """Makes ``needed`` blocks allocatable in ``group``: grows a growable pool, else raises before allocating."""
        free = group.pool.num_free_blocks if group.pool is not None else 0
        if needed <= free:
            return
        if self._fixed_num_blocks is not None and not any(self.num_tokens):
            raise ValueError(
                f"num_blocks={group.pool.num_blocks} is too small for the batch: its prompts need {needed} blocks "
                f"of {self.cache_config.block_size} tokens in the {group.name} pool. Pass num_blocks >= {needed} "
                f"plus room for the new tokens (about batch_size * ceil(max_length / block_size) in all)"
            )
        if self._fixed_num_blocks is not None:
            raise PagedCacheFullError(
                f"PagedCache is out of blocks: the next forward needs {needed} new blocks in the {group.name} pool "
                f"but only {free} of num_blocks={group.pool.num_blocks} are free (block_size="
                f"{self.cache_config.block_size}). Size the pool for the batch: about batch_size * "
                f"ceil(max_length / block_size) blocks, e.g. PagedCache(config, num_blocks=...) or "
                f"cache_config={{'num_blocks': ...}}; or leave num_blocks and memory_budget unset to let it grow."
            )
        current = group.pool.num_blocks if group.pool is not None else 0
        # grow by at least a quarter: amortized O(1) copies per block, at most ~20% of the pool idle after a grow
        extra = max(needed - free, -(-current // GROWTH_DIVISOR))
        if group.pool is None:
            group.pool = BlockPool(extra, enable_caching=False)
        else:
            group.pool.grow(extra)
        for storage in group.storages.values():
            storage.grow(group.pool.num_blocks - storage.num_blocks)

    # ------------------------------------------------------------------------------------ the step
    def _new_token_counts(self, position_ids: torch.Tensor | None, batch: int, query_len: int) -> list[int]:
        """Real (non-pad) tokens of each row in this forward, read from the last position of each row."""
        if position_ids is None:
            return [query_len] * batch
        positions = position_ids[0] if position_ids.dim() == 3 else position_ids  # multimodal RoPE: [3, B, q]
        last = positions[:, -1].tolist()
        if len(last) == 1:
            last = last * batch
        counts = []
        for row in range(batch):
            held = self.num_tokens[row] if self.num_tokens else 0
            new = int(last[row]) + 1 - held
            counts.append(new if 1 <= new <= query_len else query_len)
        return counts

    def _plan_step(self, key_states: torch.Tensor, kwargs: dict | None) -> StepPlan:
        batch, _, query_len, _ = key_states.shape
        if not self.num_tokens:
            self.num_tokens = [0] * batch
        elif batch != len(self.num_tokens):
            raise ValueError(
                f"PagedCache holds {len(self.num_tokens)} sequences but the forward has batch size {batch}; "
                f"call cache.reset() to start a new batch"
            )
        position_ids = kwargs.get("position_ids") if kwargs else None
        new_counts = self._new_token_counts(position_ids, batch, query_len)
        held = list(self.num_tokens)

        for group in self.groups:
            if group.pool is None:  # first allocation of a growable pool
                self._ensure_capacity(group, sum(-(-n // group.block_size) for n in new_counts))
            if not group.tables:
                group.tables = [BlockTable(group.pool, group.block_size) for _ in range(batch)]
            if group.window is not None:
                for row, table in enumerate(group.tables):
                    table.free_blocks_before(held[row] - (group.window - 1))
            needed = sum(t.num_new_blocks_needed(n) for t, n in zip(group.tables, new_counts))
            self._ensure_capacity(group, needed)

        device = key_states.device
        group_plans = {}
        for group in self.groups:
            slots, copies = [], []
            for table, count in zip(group.tables, new_counts):
                row_slots, row_copies = table.append_slots(count)
                slots.extend(row_slots)
                copies.extend(row_copies)
            group_plans[id(group)] = GroupPlan.build(group, slots, copies, device)

        self.num_tokens = [h + n for h, n in zip(held, new_counts)]
        plan = StepPlan(
            batch_size=batch,
            query_len=query_len,
            new_counts=new_counts,
            num_tokens=list(self.num_tokens),
            groups=group_plans,
            device=device,
            token_index=StepPlan.left_padded_index(new_counts, query_len, device),
            seq_length_before=self.seq_length,
        )
        self.seq_length += query_len
        return plan

    def _update_layer(self, layer: PagedLayer, key_states, value_states, kwargs: dict | None):
        if self._plan is None or layer.layer_idx in self._plan.written_layers:
            self._plan = self._plan_step(key_states, kwargs)
        if not layer.is_initialized:  # after planning: a pool too small fails before any tensor is allocated
            layer.lazy_initialization(key_states, value_states)
        plan = self._plan
        plan.written_layers.add(layer.layer_idx)
        group_plan = plan.groups[id(layer.group)]
        storage = layer.group.storages[layer.layer_idx]
        if group_plan.copy_src is not None:
            storage.copy_blocks(group_plan.copy_src, group_plan.copy_dst)
        new_k, new_v = plan.select_new_tokens(key_states), plan.select_new_tokens(value_states)
        storage.write(group_plan.slots, new_k, new_v)

        if kwargs is not None and self.text_config._attn_implementation == "paged":
            kwargs[METADATA_KEY] = (plan, group_plan, storage, layer.group.window)
            return key_states, value_states
        gather_slots = plan.dense_slots(group_plan, layer.group.window)
        keys, values = storage.read_slots(gather_slots)  # [B, L, H, D]
        return keys.transpose(1, 2), values.transpose(1, 2)

    # ------------------------------------------------------------------------- generate's hooks
    def _select_rows(self, rows: list[int]) -> None:
        """Row ``i`` becomes old row ``rows[i]``, sharing its blocks (fork); unused rows are freed."""
        for group in self.groups:
            forks = [group.tables[r].fork() for r in rows] if group.tables else []
            group.free_tables()
            group.tables = forks
        self.num_tokens = [self.num_tokens[r] for r in rows] if self.num_tokens else []
        self._plan = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues beam ``beam_idx[i]``; blocks are shared, never copied."""
        if self.num_tokens:
            self._select_rows([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.num_tokens:
            self._select_rows([row for row in range(len(self.num_tokens)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.num_tokens:
            self._select_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` tokens of every row (assisted decoding's rollback)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove (as DynamicCache), got {tokens_to_remove}"
            )
        remove = -tokens_to_remove
        if remove == 0 or not self.num_tokens:
            return
        if remove > self.seq_length:
            raise ValueError(f"cannot crop {remove} tokens from a cache of {self.seq_length}")
        kept = [max(n - remove, 0) for n in self.num_tokens]
        for group in self.groups:
            for row, table in enumerate(group.tables):
                if group.window is not None:
                    first_held = next((i for i, b in enumerate(table.blocks) if b is not None), len(table.blocks))
                    if first_held * group.block_size > max(0, kept[row] - (group.window - 1)):
                        raise RuntimeError(
                            f"cannot crop {remove} tokens: the sliding-window layers already freed tokens the "
                            f"next forward would need (window {group.window})"
                        )
                table.truncate(kept[row])
        self.num_tokens = kept
        self.seq_length -= remove
        self._plan = None

    def reset(self) -> None:
        """Frees every sequence's blocks; the pool tensors stay allocated for reuse."""
        for group in self.groups:
            group.free_tables()
        self.num_tokens = []
        self.seq_length = 0
        self._plan = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_length

    @property
    def is_compileable(self) -> bool:
        return False

    # ------------------------------------------------------------------------------- introspection
    def check_invariants(self) -> None:
        """Asserts the pool invariants and that each block's ref count equals the tables holding it."""
        for group in self.groups:
            if group.pool is None:
                continue
            group.pool.check_invariants()
            refs: dict[int, int] = {}
            for table in group.tables:
                for block in table.blocks:
                    if block is not None:
                        refs[block.block_id] = refs.get(block.block_id, 0) + 1
            for block in group.pool.blocks:
                assert block.ref_cnt == refs.get(block.block_id, 0), (
                    f"{group.name}: block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{refs.get(block.block_id, 0)} tables hold it"
                )

    def stats(self) -> dict:
        """Blocks used / total, bytes allocated and bytes holding live tokens, over all groups."""
        blocks_used = blocks_total = bytes_allocated = bytes_live = 0
        for group in self.groups:
            if group.pool is None:
                continue
            blocks_used += group.pool.num_used_blocks
            blocks_total += group.pool.num_blocks
            bytes_allocated += sum(s.nbytes for s in group.storages.values())
            token_bytes = sum(s.bytes_per_token for s in group.storages.values())
            filled: dict[int, int] = {}
            for table in group.tables:
                for index, block in enumerate(table.blocks):
                    if block is not None:
                        count = min(group.block_size, table.num_tokens - index * group.block_size)
                        filled[block.block_id] = max(filled.get(block.block_id, 0), count)
            bytes_live += sum(filled.values()) * token_bytes
        return {
            "blocks_used": blocks_used,
            "blocks_total": blocks_total,
            "block_size": self.cache_config.block_size,
            "kv_cache_dtype": self.cache_config.kv_cache_dtype,
            "bytes_per_token_per_layer": self.block_bytes(0) // self.cache_config.block_size,
            "bytes_allocated": bytes_allocated,
            "bytes_live": bytes_live,
            "utilization": bytes_live / bytes_allocated if bytes_allocated else 0.0,
        }


def _head_dim(text_config) -> int:
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def _check_supported(config, text_config) -> None:
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"PagedCache supports decoder-only models; {type(config).__name__} is an encoder-decoder model"
        )
    model_type = getattr(text_config, "model_type", "")
    if model_type in STATE_SPACE_MODEL_TYPES or getattr(text_config, "layer_types", None) is None and any(
        hasattr(text_config, attr) for attr in ("ssm_state_size", "state_size", "mamba_expand")
    ):
        raise NotImplementedError(
            f"PagedCache holds attention K/V; {model_type!r} is a state-space model with no KV cache to page"
        )
