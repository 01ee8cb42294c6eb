"""Typed statistics of a KV cache and of the engine: one vocabulary for ``PagedCache.stats()``,
``PagedEngine.get_stats()``, the server's ``/metrics`` and the benchmarks.

Block counts are summed over layer groups (a hybrid model's full and sliding pools). The objects are frozen
dataclasses that are also read-only mappings (``stats["name"]``, ``dict(stats)``, ``stats.as_dict()``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass


class _StatsMapping(Mapping):
    """Read-only mapping view of a stats dataclass: its fields and derived ratios by name."""

    def __getitem__(self, name: str):
        if name not in self.as_dict():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KVCacheStats(_StatsMapping):
    """The pool of a ``KVManager``.

    kv_cache_used / kv_cache_total: blocks in use / in the pools; kv_cache_utilization: their ratio;
    kv_cache_cached_blocks: unused blocks kept for prefix hits; kv_cache_bytes: bytes of the pool tensors;
    prefix_cache_hit_rate: prompt tokens found cached / prompt tokens looked up (0 without prefix caching);
    prefix_cache_queries / prefix_cache_hits: those two token counts (vLLM's counters), prefix_cache_host_hits: the
    hit tokens whose blocks came from the host tier (the device tier's are the rest);
    host_cache_blocks_used / host_cache_blocks_total / host_cache_bytes: the host tier (``kv_offloading_size``; 0
    without one; blocks summed over groups, bytes of the host storages made so far);
    recurrent_state_bytes: the state rows of a hybrid model's recurrent layers (0 for a model without them; a
    ``PagedCache``'s are transformers' ``LinearAttentionLayer``s, not counted).
    """

    kv_cache_used: int
    kv_cache_total: int
    kv_cache_cached_blocks: int
    block_size: int
    kv_cache_dtype: str
    kv_cache_bytes: int
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_host_hits: int
    host_cache_blocks_used: int
    host_cache_blocks_total: int
    host_cache_bytes: int
    recurrent_state_bytes: int

    @property
    def kv_cache_utilization(self) -> float:
        return self.kv_cache_used / self.kv_cache_total if self.kv_cache_total else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "kv_cache_utilization": self.kv_cache_utilization}


@dataclass(frozen=True)
class PagedCacheStats(KVCacheStats):
    """``PagedCache.stats()``: the pool, plus the bytes of slots holding real tokens (pads never take one).

    kv_cache_bytes_live / kv_cache_bytes: how much of the allocated pool holds tokens (``live_fraction``).
    """

    kv_cache_bytes_live: int
    bytes_per_token: int  # one token's K and V in every layer

    @property
    def live_fraction(self) -> float:
        return self.kv_cache_bytes_live / self.kv_cache_bytes if self.kv_cache_bytes else 0.0

    def as_dict(self) -> dict:
        return {**super().as_dict(), "live_fraction": self.live_fraction}


@dataclass(frozen=True)
class EngineStats(KVCacheStats):
    """``PagedEngine.get_stats()``: the pool, the scheduler's queues and counters, and throughput."""

    num_running: int
    num_waiting: int
    num_swapped: int
    preemption_count: int
    num_swapped_out: int
    num_swapped_in: int
    generated_tokens: int
    generation_tokens_per_s: float
    num_steps: int = 0  # steps that ran a forward since start
    num_step_tokens: int = 0  # the tokens those steps forwarded: prompt chunks and decode inputs (drafts included)
    tensor_parallel_size: int = 1  # ranks the model and every KV block are split over (each holds its share)
    num_encoded_images: int = 0  # images encoded (tiles for Idefics3 / SmolVLM; again after a recompute)
    # speculative decoding (vLLM's counters; all 0 without it): verified runs with drafts, draft tokens, accepted
    # draft tokens, and per draft position j the runs whose draft j was accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        drafted = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafted if drafted else 0.0

    @property
    def spec_decode_acceptance_rate_per_pos(self) -> tuple[float, ...]:
        """Per draft position: the fraction of verified runs whose draft at that position was accepted."""
        runs = self.spec_decode_num_drafts
        return tuple(n / runs if runs else 0.0 for n in self.spec_decode_num_accepted_tokens_per_pos)

    def as_dict(self) -> dict:
        return {**super().as_dict(), "spec_decode_acceptance_rate": self.spec_decode_acceptance_rate,
                "spec_decode_acceptance_rate_per_pos": self.spec_decode_acceptance_rate_per_pos}
