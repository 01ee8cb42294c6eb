"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict, checked once, as a frozen dataclass.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}`` proposes up to
``k`` tokens per decoding sequence by prompt lookup: the longest suffix of its tokens (``n`` down to ``m`` tokens)
that occurred before, continued by what followed it. The method ``"draft_model"`` is named by vLLM and refused here
with the methods that are supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("ngram",)
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
        method: "ngram" (prompt lookup over the sequence's own prompt and output tokens).
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

    def __post_init__(self) -> None:
        if self.method == "draft_model":
            raise ValueError(
                "speculative_config['method'] 'draft_model' is not supported by this engine yet; supported methods "
                f"are {list(SPECULATIVE_METHODS)}"
            )
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
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
        options = dict(value)
        if options.get("method") == "draft_model":
            cls(method="draft_model")  # refused by name, before its other keys (``model``) are looked at
        check_known("speculative_config", "key", options, [f.name for f in fields(cls)])
        if "method" not in options:
            raise ValueError(f"speculative_config needs a 'method', one of {list(SPECULATIVE_METHODS)}")
        if "prompt_lookup_min" in options and "prompt_lookup_max" not in options:
            options["prompt_lookup_max"] = max(options["prompt_lookup_min"], cls.prompt_lookup_max) \
                if isinstance(options["prompt_lookup_min"], int) else options["prompt_lookup_min"]
        if "prompt_lookup_max" in options and "prompt_lookup_min" not in options:
            options["prompt_lookup_min"] = min(options["prompt_lookup_max"], cls.prompt_lookup_min) \
                if isinstance(options["prompt_lookup_max"], int) else options["prompt_lookup_max"]
        return cls(**options)
