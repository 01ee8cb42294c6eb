"""``PagedCache``: the transformers ``Cache`` over a ``KVManager`` that ``generate`` and any attention drive.

Each batch row is one sequence (a ``SequenceKV``). Within a forward, the first ``update`` plans the step once for
every layer (new token counts, blocks, copy-on-write copies, the ``AttentionMetadata``); each layer's ``update``
then only writes its K/V and hands the metadata to the attention through its ``kwargs``.

Left padding: ``generate`` gives pad tokens position 0 and real tokens positions ``0 .. n-1``, so the last
position of each row says how many of the chunk's tokens are real; pad tokens take no slot. Row ``b``'s real
tokens are always the last ``num_tokens[b]`` columns of HF's padded timeline of ``seq_length`` columns.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import CacheConfig
from .kv_manager import KVManager, LayerGroup, PagedCacheFullError, SequenceKV, block_id_bytes, check_supported
from .kv_stats import PagedCacheStats
from .metadata import METADATA_KEY, AttentionMetadata, build_metadata, write_layer_kv

__all__ = ["PagedCache", "PagedCacheFullError", "PagedLayer", "METADATA_KEY"]


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
        self.cache.kv.allocate_layer(self.layer_idx, key_states.shape[1], key_states.dtype, key_states.device)
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

    def reset(self) -> None:  # the cache resets its sequences as a whole
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
        check_supported(self.text_config, config)
        if num_blocks is None and memory_budget is not None:
            per_block = block_id_bytes(self.text_config, block_size, kv_cache_dtype)
            num_blocks = memory_budget // per_block
            if num_blocks < 1:
                raise ValueError(
                    f"memory_budget={memory_budget} bytes is below one block of every layer ({per_block} bytes); "
                    f"raise memory_budget or lower block_size"
                )
        self.kv = KVManager(self.text_config, block_size, kv_cache_dtype, num_blocks)
        super().__init__(layers=[PagedLayer(self, idx, self.kv.group_of[idx]) for idx in sorted(self.kv.group_of)])
        self.seq_length = 0  # columns of HF's padded timeline
        self.rows: list[SequenceKV] = []  # one sequence per batch row
        self._metadata: AttentionMetadata | None = None
        self._written: set[int] = set()  # layers that wrote the current metadata's tokens

    @property
    def num_tokens(self) -> list[int]:
        """Real tokens held per row."""
        return [seq.num_tokens for seq in self.rows]

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
            held = self.rows[row].num_tokens if self.rows else 0
            new = int(last[row]) + 1 - held
            counts.append(new if 1 <= new <= query_len else query_len)
        return counts

    def _plan_step(self, key_states: torch.Tensor, kwargs: dict | None) -> AttentionMetadata:
        batch, _, query_len, _ = key_states.shape
        if not self.rows:
            self.rows = [self.kv.new_sequence() for _ in range(batch)]
        elif batch != len(self.rows):
            raise ValueError(
                f"PagedCache holds {len(self.rows)} sequences but the forward has batch size {batch}; "
                f"call cache.reset() to start a new batch"
            )
        position_ids = kwargs.get("position_ids") if kwargs else None
        counts = self._new_token_counts(position_ids, batch, query_len)
        starts = self.num_tokens
        for seq in self.rows:
            self.kv.slide_windows(seq)
        self.kv.reserve(self.rows, counts)  # grows or raises before anything is allocated
        for seq, count in zip(self.rows, counts):
            self.kv.append(seq, count)
        self.kv.apply_copies(self.kv.take_copies())
        device = key_states.device
        metadata = build_metadata(
            self.kv, self.rows, starts, counts, num_decodes=batch if all(c == 1 for c in counts) else 0,
            device=device, token_index=_left_padded_index(counts, query_len, device), batch_size=batch,
            query_len=query_len, seq_length_before=self.seq_length,
        )
        self.seq_length += query_len
        return metadata

    def _update_layer(self, layer: PagedLayer, key_states, value_states, kwargs: dict | None):
        if self._metadata is None or layer.layer_idx in self._written:
            self._metadata = self._plan_step(key_states, kwargs)
            self._written = set()
        if not layer.is_initialized:  # after planning: a pool too small fails before any tensor is allocated
            layer.lazy_initialization(key_states, value_states)
        metadata = self._metadata
        self._written.add(layer.layer_idx)
        group = metadata.groups[layer.group.index]
        storage = layer.group.storages[layer.layer_idx]
        write_layer_kv(storage, metadata, group, key_states, value_states)
        if kwargs is not None and self.text_config._attn_implementation == "paged":
            kwargs[METADATA_KEY] = (metadata, group, storage)
            return key_states, value_states
        keys, values = storage.read_slots(metadata.dense_slots(group))  # [B, L, H, D]
        return keys.transpose(1, 2), values.transpose(1, 2)

    # ------------------------------------------------------------------------- generate's hooks
    def _select_rows(self, rows: list[int]) -> None:
        """Row ``i`` becomes old row ``rows[i]``, sharing its blocks (fork); unused rows are freed."""
        forks = [self.kv.fork(self.rows[r]) for r in rows]
        for seq in self.rows:
            self.kv.discard(seq)
        self.rows = forks
        self._metadata = None

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
        """Removes the last ``-tokens_to_remove`` tokens of every row (assisted decoding's rollback)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove (as DynamicCache), got {tokens_to_remove}"
            )
        remove = -tokens_to_remove
        if remove == 0 or not self.rows:
            return
        if remove > self.seq_length:
            raise ValueError(f"cannot crop {remove} tokens from a cache of {self.seq_length}")
        for seq in self.rows:
            self.kv.truncate(seq, max(seq.num_tokens - remove, 0))
        self.seq_length -= remove
        self._metadata = None

    def reset(self) -> None:
        """Frees every sequence's blocks; the pool tensors stay allocated for reuse."""
        for seq in self.rows:
            self.kv.discard(seq)
        self.rows = []
        self.seq_length = 0
        self._metadata = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_length

    @property
    def is_compileable(self) -> bool:
        return False

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
            per_token = self.kv.bytes_per_block() // self.kv.block_size
        return PagedCacheStats(**asdict(pool), kv_cache_bytes_live=live, bytes_per_token=per_token)


def _left_padded_index(counts: list[int], query_len: int, device) -> torch.Tensor | None:
    """Generate's layout: the flattened ``[B * q]`` column of each row's last ``counts[b]`` columns (None: all)."""
    if all(n == query_len for n in counts):
        return None
    counts_t = torch.tensor(counts)
    columns = torch.arange(query_len)
    keep = columns.unsqueeze(0) >= (query_len - counts_t).unsqueeze(1)  # [B, q]
    return keep.flatten().nonzero().squeeze(1).to(device)
