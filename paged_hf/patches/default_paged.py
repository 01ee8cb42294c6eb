"""``cache_implementation="paged"`` as the default of every ``generate()`` call that does not choose its own cache.

Off until ``paged_hf.enable_default_paged(cache_config)`` turns it on, or until ``import paged_hf`` finds
``PAGED_HF_DEFAULT_CACHE=paged`` in the environment (what ``paged-hf run`` sets, with its options as JSON in
``PAGED_HF_CACHE_CONFIG``). ``paged_hf.unregister()`` turns it off with the rest of the patches.

A call chooses its own cache, and is left as it is, when it passes a cache object (``cache`` or
``past_key_values``), names a ``cache_implementation`` (keyword, an explicit ``generation_config``, or the model's
``generation_config``), or turns ``use_cache`` off. The precedence is transformers' own: keyword, then the
explicit ``generation_config``, then the model's; ``"hybrid"`` counts as unset, as transformers treats it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping

from ..config import CacheConfig

SWITCH_ENV = "PAGED_HF_DEFAULT_CACHE"
CONFIG_ENV = "PAGED_HF_CACHE_CONFIG"
SWITCH_VALUES = ("paged", "")  # "" (or unset): off

# While on: {"cache_config": dict}; empty while off. Process-wide, like transformers' own registries.
_state: dict[str, dict] = {}


def checked_cache_config(cache_config: Mapping | None) -> dict:
    """A copy of ``cache_config``; unknown keys and bad values raise ``ValueError`` naming them."""
    if cache_config is not None and not isinstance(cache_config, Mapping):
        raise ValueError(f"cache_config must be a dict of {allowed_keys()} or None, got {cache_config!r}")
    options = dict(cache_config or {})
    CacheConfig.from_dict(options)
    return options


def enable(cache_config: Mapping | None = None) -> None:
    _state["cache_config"] = checked_cache_config(cache_config)


def disable() -> None:
    _state.clear()


def is_enabled() -> bool:
    return bool(_state)


def cache_config() -> dict | None:
    """The ``cache_config`` of the default (a copy), or None while the default is off."""
    return dict(_state["cache_config"]) if _state else None


def config_from_environment(environ: Mapping[str, str] = os.environ) -> dict | None:
    """The ``cache_config`` that the environment asks for, or None when ``PAGED_HF_DEFAULT_CACHE`` is off.

    Raises ``ValueError`` naming the variable for a bad switch value or a bad ``PAGED_HF_CACHE_CONFIG``.
    """
    switch = environ.get(SWITCH_ENV, "")
    if switch not in SWITCH_VALUES:
        raise ValueError(f"{SWITCH_ENV} must be 'paged' (on) or empty/unset (off), got {switch!r}")
    text = environ.get(CONFIG_ENV, "")
    if not switch:
        if text.strip():
            warnings.warn(f"{CONFIG_ENV} is set but {SWITCH_ENV} is not 'paged': generate() keeps its default "
                          f"cache; set {SWITCH_ENV}=paged to use it", RuntimeWarning, stacklevel=2)
        return None
    if not text.strip():
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{CONFIG_ENV} is not valid JSON ({error}): {text!r}") from None
    if not isinstance(options, dict):
        raise ValueError(f"{CONFIG_ENV} must be a JSON object with keys from {allowed_keys()}, got {text!r}")
    try:
        return checked_cache_config(options)
    except ValueError as error:
        raise ValueError(f"{CONFIG_ENV}: {error}") from None


def applies(model, args: tuple, kwargs: dict) -> bool:
    """True when the default is on and this ``generate(*args, **kwargs)`` call does not choose its cache."""
    return is_enabled() and not caller_chose_cache(model, args, kwargs)


def caller_chose_cache(model, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return True
    explicit = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    configs = [c for c in (explicit, getattr(model, "generation_config", None)) if c is not None]

    def effective(name: str):
        values = [kwargs.get(name), *(getattr(c, name, None) for c in configs)]
        return next((v for v in values if v is not None), None)

    return effective("cache_implementation") not in (None, "hybrid") or effective("use_cache") is False


def allowed_keys() -> list[str]:
    return list(CacheConfig.__dataclass_fields__)
