"""User-facing configuration: frozen dataclasses that validate on construction.

Bad input raises ``ValueError`` naming the field and the allowed values, before anything is allocated.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .kernels.kv_format import kv_format
from .quant import KV_CACHE_DTYPES, canonical_kv_format

MAX_BLOCK_SIZE = 1024
MAX_SEED = 2**63 - 1  # seeds are int64, as vLLM's
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias: [-100, 100]


class ParameterError(ValueError):
    """A bad value for one named parameter; ``param`` names it (the server reports it as the error's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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
        kv_format(canonical_kv_format(self.kv_cache_dtype)).check_block_size(self.block_size)  # int4: even
        if self.memory_budget is not None and (
            isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int) or self.memory_budget < 1
        ):
            raise ValueError(f"memory_budget must be a positive int (bytes) or None, got {self.memory_budget!r}")
        if self.num_blocks is not None and self.memory_budget is not None:
            raise ValueError(f"give num_blocks or memory_budget, not both (got num_blocks={self.num_blocks} and "
                             f"memory_budget={self.memory_budget}): each sizes the pool")

    @classmethod
    def options_of(cls, cache_config) -> dict[str, Any]:
        """A copy of a ``cache_config`` argument as a dict ({} for None); ValueError naming it when it is not one."""
        if cache_config is not None and not isinstance(cache_config, Mapping):
            raise ValueError(f"cache_config must be a dict with keys from {[f.name for f in fields(cls)]} or None, "
                             f"got {type(cache_config).__name__} {cache_config!r:.100}")
        return dict(cache_config or {})

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "CacheConfig":
        """Builds a config from ``generate(cache_config={...})``; unknown keys raise ``ValueError``."""
        options = cls.options_of(options)
        check_known("cache_config", "key", options, [f.name for f in fields(cls)])
        return cls(**options)


def check_known(what: str, kind: str, options: Mapping[str, Any], allowed: list[str]) -> None:
    """ValueError naming each of ``options`` not in ``allowed``, the closest allowed name, and the allowed names."""
    unknown = sorted(set(options) - set(allowed))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
        if close:
            hints.append(f"{name!r}: did you mean {close[0]!r}?")
    raise ValueError(f"{what} has unknown {kind}(s) {unknown}" + (f" ({'; '.join(hints)})" if hints else "")
                     + f"; allowed {kind}s are {allowed}")


PREEMPTION_MODES = ("recompute", "swap", "auto")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")


def _check_int(name: str, value, minimum: int, allow_none: bool = False, maximum: int | None = None) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or \
            (maximum is not None and value > maximum):
        allowed = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
        raise ParameterError(name, f"{name} must be {allowed}" + (" or None" if allow_none else "") +
                             f", got {value!r}")


def _check_number(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    """A finite int or float in the range (NaN and infinities are refused: they would poison the logits)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParameterError(name, f"{name} must be a number, got {value!r}")
    bracket = "(" if low_open else "["
    if not math.isfinite(value):
        raise ParameterError(name, f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise ParameterError(name, f"{name} must be in {bracket}{low}, {high}], got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ParameterError(name, f"{name} must be a bool, got {value!r}")


CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "NONE")  # vLLM's cudagraph_mode values this engine has


def _capture_sizes(sizes) -> tuple[int, ...] | None:
    """``cudagraph_capture_sizes`` as a sorted tuple of distinct ints >= 1, or None."""
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple)) or not sizes or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ParameterError("cudagraph_capture_sizes", f"cudagraph_capture_sizes must be None or a non-empty list "
                             f"of ints >= 1, got {sizes!r}")
    return tuple(sorted(set(sizes)))


GIB = 1 << 30  # bytes
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
        kv_offloading_size: GiB of host memory for cached blocks evicted from the pool (vLLM's name; 0: none): a
            later prompt with their prefix copies them back instead of computing them (``kv/host_tier.py``).
        scheduling_policy: "fcfs", "priority" (lower ``priority`` value runs first) or "lpm" (SGLang's longest
            prefix match: within a priority level, the waiting request with the longest cached prefix first; in
            arrival order past ``LPM_MAX_WAITING`` waiting requests; without prefix caching it is "priority").
        cpu_threads_bind: the CPUs a CPU engine's forward runs on, one intra-op thread each: "auto" (the CPUs this
            process may use), "nobind" (leave torch's threads as they are) or a list such as "0-3" (vLLM's
            ``VLLM_CPU_OMP_THREADS_BIND``); see ``paged_hf.engine.threads``.
        enforce_eager: run the model's forward eagerly (vLLM's switch); False (the default) compiles it with
            torch.compile at engine start (``engine/compile.py``; a model that does not compile runs eagerly).
            True turns CUDA graphs off too.
        cudagraph_mode: on CUDA, "FULL_DECODE_ONLY" (the default; vLLM's name) captures decode-only steps as CUDA
            graphs at engine start, one per size of ``cudagraph_capture_sizes``; "NONE" runs them without graphs
            (still compiled). Other steps never use graphs (``engine/cuda_graphs.py``). Ignored on CPU.
        cudagraph_capture_sizes: the batch sizes captured (vLLM's name); a decode-only step of S sequences runs in
            the smallest size >= S, padded. None: 1, 2, 4, 8, ... below ``max_num_seqs``, and ``max_num_seqs``.
        speculative_config: vLLM's dict (``{"method": "ngram", "num_speculative_tokens": 4, ...}``), checked into a
            ``SpeculativeConfig`` (``engine/spec/config.py``); None: no speculative decoding.

    Limits on one request, checked by ``PagedEngine.add_request`` (a request past one gets a ``ValueError`` naming
    the parameter, before it is queued):
        max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's default, 20).
        max_n: the most parallel samples (``n``) of one request (OpenAI's limit, 128).
        max_stop_strings: the most ``stop`` strings of one request: each is searched at every step of it.
        limit_mm_per_prompt: ``{"image": N}``, the most images of one request (vLLM's name); None: no limit.
        max_num_encoder_input_tokens: the most image tokens the vision tower encodes in one step (vLLM's name; a
            chunk ends before an image past it, which waits for a later step); None: no limit beyond the step's.
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
    kv_offloading_size: float = 0.0
    preemption_mode: str = "auto"
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    max_n: int = 128
    max_stop_strings: int = 32
    cpu_threads_bind: str = "auto"
    enforce_eager: bool = False
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    limit_mm_per_prompt: Mapping[str, int] | None = None
    max_num_encoder_input_tokens: int | None = None
    speculative_config: Any = None  # a SpeculativeConfig after __post_init__ (or None)

    @classmethod
    def from_options(cls, what: str, options: Mapping[str, Any]) -> "EngineConfig":
        """Builds a config from ``what``'s keyword options (``PagedEngine(**options)``); an unknown option raises
        ``ValueError`` naming it and the closest valid one."""
        check_known(what, "option", options, [f.name for f in fields(cls)])
        return cls(**options)

    def __post_init__(self) -> None:
        from .engine.spec.config import SpeculativeConfig  # noqa: PLC0415 - the engine package imports this one
        from .engine.threads import check_cpu_threads_bind  # noqa: PLC0415

        CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks, kv_cache_dtype=self.kv_cache_dtype)
        check_cpu_threads_bind(self.cpu_threads_bind)
        _check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        if self.kv_cache_memory is not None:
            _check_number("kv_cache_memory", self.kv_cache_memory, 0.0, float("inf"), low_open=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1, allow_none=True)
        _check_number("swap_space", self.swap_space, 0.0, float("inf"))
        _check_number("kv_offloading_size", self.kv_offloading_size, 0.0, float("inf"))
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        object.__setattr__(self, "cudagraph_capture_sizes", _capture_sizes(self.cudagraph_capture_sizes))
        _check_int("max_logprobs", self.max_logprobs, 0)
        _check_int("max_n", self.max_n, 1)
        _check_int("max_stop_strings", self.max_stop_strings, 0)
        if self.limit_mm_per_prompt is not None:
            others = {k: v for k, v in self.limit_mm_per_prompt.items() if k != "image"} \
                if isinstance(self.limit_mm_per_prompt, Mapping) else None
            if others is None or any(v != 0 for v in others.values()):  # {"video": 0}: none, as vLLM's flag says
                raise ValueError(f"limit_mm_per_prompt must be None or {{'image': N}} (images are the only "
                                 f"modality; another one may only be 0), got {self.limit_mm_per_prompt!r}")
            _check_int("limit_mm_per_prompt['image']", self.limit_mm_per_prompt.get("image"), 0, allow_none=True)
        _check_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, 1, allow_none=True)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))


GREEDY_BELOW = 1e-5  # temperatures below it sample greedily
# Dividing float32 logits by a penalty outside this range overflows (inf, then NaN in the softmax); typical values
# are 1.0-2.0.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's names). ``temperature`` in [0, 2] (OpenAI's and vLLM's range); below
    ``GREEDY_BELOW`` (1e-5, as vLLM) it is greedy: the limit of sampling as the temperature goes to 0 (dividing
    float32 logits by 1e-45 would overflow to NaN). ``n > 1`` with greedy sampling gives n equal samples (OpenAI
    accepts it; vLLM refuses it). ``seed``: any int64; -1 means no seed, as vLLM's (clients send it for "random").

    ``logprobs=k``: each generated token's logprob (and its rank) plus the ``k`` most likely tokens';
    ``prompt_logprobs=k``: the same for every prompt token after the first. Logprobs are those of the model's raw
    distribution (before penalties, temperature and filtering), as a plain forward over prompt + output gives them.
    ``logit_bias``: {token id: bias in [-100, 100]} added to the logits before sampling (greedy too), as OpenAI's.
    ``allowed_token_ids``: only these tokens can be drawn (every other gets -inf before sampling), as vLLM's.
    ``bad_words``: words the output never forms, as vLLM's: each is tokenized alone and after a space, and the last
    token of such a sequence gets -inf wherever the output's newest tokens are the rest of it.
    ``skip_special_tokens=False`` keeps special tokens in the output text (``spaces_between_special_tokens`` is
    handed to tokenizers whose ``decode`` takes it); ``include_stop_str_in_output`` ends the text after the stop
    string that stopped it instead of before it; ``detokenize=False`` leaves the output's text (and the logprob
    entries' names) out: token ids only (vLLM's names and defaults).
    ``structured_outputs``: a ``paged_hf.StructuredOutputsParams`` (JSON schema, regex, choice, grammar or JSON
    object) the output must match: its logprobs are then those of the masked distribution, as vLLM's.

    Every value is checked here (types, ranges, finite numbers: NaN or inf is refused); the limits that depend on
    the model or the engine (token ids in the vocabulary, ``max_model_len``, ``EngineConfig.max_n`` ...) are checked
    by ``PagedEngine.add_request``. A bad value raises ``ParameterError`` (a ``ValueError``) naming the field.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: as many as the context (or a smaller KV pool) holds, fixed when added
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
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_outputs: Any = None  # a StructuredOutputsParams (paged_hf.structured)
    # ``(bad_words, their token sequences)`` (``engine.validation.bad_words_token_ids``), when a front end tokenized
    # them before queueing the request (the server does, in a handler's thread: never on the engine's); the engine
    # uses the sequences only while ``bad_words`` is still the words they came from (a ``dataclasses.replace`` of the
    # words makes them stale), and tokenizes the words otherwise. vLLM's SamplingParams has such a private field.
    _bad_words_token_ids: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 1, allow_none=True)
        _check_int("min_tokens", self.min_tokens, 0, maximum=self.max_tokens)
        _check_number("temperature", self.temperature, 0.0, 2.0)  # OpenAI's and vLLM's range
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ParameterError("top_k", f"top_k must be 0 or -1 (off) or an int >= 1, got {self.top_k!r}")
        if self.top_k == 0:  # vLLM's off, as transformers' top_k=0
            object.__setattr__(self, "top_k", -1)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("seed", self.seed, -MAX_SEED - 1, allow_none=True, maximum=MAX_SEED)
        if self.seed == -1:
            object.__setattr__(self, "seed", None)
        _check_int("logprobs", self.logprobs, 0, allow_none=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, allow_none=True)
        _check_bool("ignore_eos", self.ignore_eos)
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                     "detokenize"):
            _check_bool(name, getattr(self, name))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        if self.stop and not self.detokenize:
            raise ParameterError("stop", "stop strings need the output's text: they are refused with detokenize=False")
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        processors = self.logits_processors
        if processors is not None and (not isinstance(processors, (list, tuple)) or
                                       not all(callable(f) for f in processors)):
            raise ParameterError("logits_processors", f"logits_processors must be a list of callables "
                                                      f"f(output_token_ids, logits) -> logits, got {processors!r}")
        object.__setattr__(self, "logits_processors", tuple(processors or ()))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise ParameterError("allowed_token_ids", "allowed_token_ids is empty: no token could be drawn")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or \
                    not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ParameterError("bad_words", f"bad_words must be a list of non-blank strings, got "
                                                  f"{self.bad_words!r:.100}")
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if self.structured_outputs is not None:
            from .structured.params import StructuredOutputsParams  # noqa: PLC0415 - it imports this module

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ParameterError("structured_outputs", f"structured_outputs must be a "
                                                           f"paged_hf.StructuredOutputsParams or None, got "
                                                           f"{self.structured_outputs!r:.100}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that reads or changes the logits first (the sampler's argmax-only fast path; asked
        of every row at every step, so computed once)."""
        plain = self.__dict__.get("_plain_greedy")
        if plain is None:
            plain = (self.greedy and self.repetition_penalty == 1.0 and not self.presence_penalty
                     and not self.frequency_penalty and not self.logits_processors and self.logprobs is None
                     and not self.logit_bias and self.allowed_token_ids is None and not self.bad_words)
            object.__setattr__(self, "_plain_greedy", plain)
        return plain


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ParameterError("stop", f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stop)


def _token_ids(name: str, ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)) or \
            not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ParameterError(name, f"{name} must be a list of token ids >= 0, got {ids!r}")
    return tuple(ids)


def _logit_bias(bias) -> dict[int, float] | None:
    """``{token id: bias}`` as a new dict of int -> float; None or {} -> None."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ParameterError("logit_bias", f"logit_bias must be a mapping of token id -> bias, got {bias!r}")
    out = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ParameterError("logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                abs(value) > MAX_LOGIT_BIAS:
            raise ParameterError("logit_bias", f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                               f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {token}")
        out[token] = float(value)
    return out or None
