"""User-facing configuration: frozen dataclasses that validate on construction.

Bad input raises ``ValueError`` naming the field and the allowed values, before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


from .quant import KV_CACHE_DTYPES
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


PREEMPTION_MODES = ("recompute", "swap", "auto")
SCHEDULING_POLICIES = ("fcfs", "priority")


def _check_int(name: str, value, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_number(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")


DEFAULT_CPU_KV_CACHE_GIB = 4.0  # the KV pool of an auto-sized engine on CPU (vLLM's CPU default too)


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of ``PagedEngine``, with vLLM's names.

    Attributes:
        block_size, kv_cache_dtype: as ``CacheConfig``.
        num_blocks: KV blocks per layer group; None sizes the pool from ``kv_cache_memory`` or
            ``gpu_memory_utilization``.
        kv_cache_memory: GiB the KV pool may take; None: on CUDA ``gpu_memory_utilization`` of the free device
            memory, on CPU ``DEFAULT_CPU_KV_CACHE_GIB`` (capped at half the available RAM, which also holds the
            model and its activations).
        gpu_memory_utilization: fraction of the device's free memory the KV pool may take (CUDA).
        max_num_seqs: sequences running at once. max_num_batched_tokens: tokens per forward (chunked prefill).
        max_model_len: longest prompt + output; None takes the model's ``max_position_embeddings``.
        enable_prefix_caching: reuse the KV of full blocks whose token prefix was already computed.
        swap_space: GiB of CPU memory for swapped-out blocks. preemption_mode: "recompute", "swap" or "auto".
        scheduling_policy: "fcfs" or "priority" (lower ``priority`` value runs first).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    swap_space: float = 4.0
    preemption_mode: str = "auto"
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks, kv_cache_dtype=self.kv_cache_dtype)
        _check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        if self.kv_cache_memory is not None:
            _check_number("kv_cache_memory", self.kv_cache_memory, 0.0, float("inf"), low_open=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1, allow_none=True)
        _check_number("swap_space", self.swap_space, 0.0, float("inf"))
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's names). ``temperature == 0`` is greedy.

    ``logprobs=k``: each generated token's logprob (and its rank) plus the ``k`` most likely tokens';
    ``prompt_logprobs=k``: the same for every prompt token after the first. Logprobs are those of the model's raw
    distribution (before penalties, temperature and filtering), as a plain forward over prompt + output gives them.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    logits_processors: tuple | list | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        _check_number("temperature", self.temperature, 0.0, float("inf"))
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, float("inf"), low_open=True)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("seed", self.seed, 0, allow_none=True)
        _check_int("logprobs", self.logprobs, 0, allow_none=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, allow_none=True)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        stop_ids = tuple(self.stop_token_ids or ())
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that reads or changes the logits first (the sampler's argmax-only fast path)."""
        return (self.temperature == 0.0 and self.repetition_penalty == 1.0 and not self.presence_penalty
                and not self.frequency_penalty and not self.logits_processors and self.logprobs is None)
