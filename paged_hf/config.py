"""User-facing configuration: frozen dataclasses that validate on construction.

Bad input raises ``ValueError`` naming the field and the allowed values, before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# Formats a block can hold. "auto" keeps the model's dtype; the others are quantized (see quant.py).
KV_CACHE_DTYPES = ("auto",)
MAX_BLOCK_SIZE = 1024


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class CacheConfig:
    """How a ``PagedCache`` lays out its pool.

    Attributes:
        block_size: tokens per block; a power of two in [1, 1024]. Default 16, as vLLM.
        num_blocks: blocks per layer group. ``None`` sizes the pool from ``memory_budget`` or, without one,
            lets it grow on demand (like ``DynamicCache``).
        kv_cache_dtype: storage format of the blocks, one of ``KV_CACHE_DTYPES``.
        memory_budget: bytes the pool may take over all layers (used when ``num_blocks`` is None).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    memory_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"block_size must be an int power of two in [1, {MAX_BLOCK_SIZE}], got {self.block_size!r}")
        if not _is_power_of_two(self.block_size) or self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}] (e.g. 8, 16, 32), got {self.block_size}"
            )
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1
        ):
            raise ValueError(f"num_blocks must be a positive int or None, got {self.num_blocks!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.memory_budget is not None and (
            isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int) or self.memory_budget < 1
        ):
            raise ValueError(f"memory_budget must be a positive number of bytes or None, got {self.memory_budget!r}")

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "CacheConfig":
        """Builds a config from ``generate(cache_config={...})``; unknown keys raise ``ValueError``."""
        options = dict(options or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"cache_config has unknown key(s) {unknown}; allowed keys are {allowed}")
        return cls(**options)
