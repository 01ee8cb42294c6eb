"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict, checked once, as a frozen dataclass.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}`` proposes up to
``k`` tokens per decoding sequence by prompt lookup: the longest suffix of its tokens (``n`` down to ``m`` tokens)
that occurred before, continued by what followed it. ``{"method": "draft_model", "model": m, "num_speculative_tokens":
k}`` proposes ``k`` tokens greedily with a small model ``m`` (a loaded ``PreTrainedModel`` or a folder) of the target's
vocabulary, on its own paged pool (``draft_model.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

SPECULATIVE_METHODS = ("ngram", "draft_model")
NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
MAX_SPECULATIVE_TOKENS = 16


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config[{name!r}] must be an int in [{low}, {high}], got {value!r}")


def _check_rate(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"speculative_config[{name!r}] must be a number in [0, 1], got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of the engine (vLLM's keys).

    Attributes:
        method: "ngram" (prompt lookup over the sequence's own prompt and output tokens) or "draft_model" (greedy
            proposals of a small model).
        model: the draft model of "draft_model": a loaded ``PreTrainedModel`` or the folder of one (loaded in the
            target's dtype, on its device); its vocabulary size must be the target's. None for "ngram".
        num_speculative_tokens: ``k``, the most tokens proposed per sequence and step, in [1, 16].
        prompt_lookup_max / prompt_lookup_min: the longest / shortest suffix n-gram looked up (vLLM's names);
            ``min <= max``, each in [1, 64]; given one alone, the other keeps its default (raised to fit).
        min_acceptance_rate: a sequence whose drafts are accepted less often than this stops proposing for a
            while (the pause doubles each time, up to 256 tokens), so poor acceptance costs little; 0 never pauses.
        auto_disable: the engine measures its decoding steps' tokens per second with and without speculation
            (short probes of the losing mode) and speculates only while that is faster (``switch.py``); False
            speculates at every step.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    min_acceptance_rate: float = 0.3
    auto_disable: bool = True
    model: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, (torch.nn.Module, str, os.PathLike)):
                raise ValueError("speculative_config['model'] must be a loaded PreTrainedModel or a model folder for "
                                 f"method 'draft_model', got {type(self.model).__name__}")
            if not isinstance(self.model, torch.nn.Module) and not os.path.isdir(self.model):
                raise ValueError(f"speculative_config['model'] must be a model folder, got {self.model!r} (not a "
                                 "folder)")
        elif self.model is not None:
            raise ValueError(f"speculative_config['model'] is for method 'draft_model', not {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config['prompt_lookup_min'] must be <= prompt_lookup_max ({self.prompt_lookup_max}), "
                f"got {self.prompt_lookup_min}"
            )
        _check_rate("min_acceptance_rate", self.min_acceptance_rate)
        if not isinstance(self.auto_disable, bool):
            raise ValueError(f"speculative_config['auto_disable'] must be a bool, got {self.auto_disable!r}")

    @classmethod
    def of(cls, value: "SpeculativeConfig | Mapping[str, Any] | None") -> "SpeculativeConfig | None":
        """``value`` as a config: None stays None, a dict is checked (unknown keys are refused by name)."""
        from ...config import check_known  # noqa: PLC0415 - config.py imports this module lazily

        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}} or None, got {type(value).__name__}")
        options = {key: v for key, v in value.items() if v is not None or key in ("method", "model")}  # None: default
        check_known("speculative_config", "key", options, [f.name for f in fields(cls)])
        if "method" not in options:
            raise ValueError(f"speculative_config needs a 'method', one of {list(SPECULATIVE_METHODS)}")
        if options["method"] == "draft_model":
            for key in NGRAM_KEYS:
                if key in options:
                    raise ValueError(f"speculative_config[{key!r}] is for method 'ngram', not 'draft_model'")
        # one bound given: the other follows it (a given bound is checked under its own name first)
        for given, other, pick in (("prompt_lookup_min", "prompt_lookup_max", max),
                                   ("prompt_lookup_max", "prompt_lookup_min", min)):
            if given in options and other not in options:
                _check_int(given, options[given], 1, 64)
                options[other] = pick(options[given], getattr(cls, other))
        return cls(**options)


def check_tensor_parallel(config: "SpeculativeConfig | None", tensor_parallel_size: int) -> None:
    """ValueError naming ``speculative_config['method']`` for a draft model under tensor parallelism (its pool and
    forwards live on one process; n-gram lookup runs on the leader and works at any size)."""
    if config is not None and config.method == "draft_model" and tensor_parallel_size > 1:
        raise ValueError(f"speculative_config['method'] 'draft_model' runs on one process, not under tensor "
                         f"parallelism (tensor_parallel_size={tensor_parallel_size}); use 'ngram'")
