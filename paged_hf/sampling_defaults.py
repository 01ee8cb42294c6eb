"""Default sampling parameters from a model's ``generation_config``, as vLLM takes them (``--generation-config``):
"auto" reads the model's own, "vllm" none, a folder its ``generation_config.json``. Only the values the config sets
count (transformers' unset fields are None), so a model whose config says nothing samples with vLLM's defaults."""

from __future__ import annotations

import os
from dataclasses import replace

from .config import SamplingParams

# (generation_config field, SamplingParams field)
GENERATION_DEFAULTS = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                       ("repetition_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"),
                       ("frequency_penalty", "frequency_penalty"), ("max_new_tokens", "max_tokens"))
CHOICES = ("auto", "vllm")


def check_generation_config(generation_config) -> None:
    """ValueError naming ``generation_config`` unless it is "auto", "vllm" or a folder (checked before a model
    loads)."""
    if generation_config not in CHOICES and not (isinstance(generation_config, (str, os.PathLike))
                                                 and os.path.isdir(generation_config)):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                         f"got {generation_config!r}")


def generation_defaults(model, generation_config="auto") -> dict:
    """``{SamplingParams field: value}`` the chosen generation config sets (``generation_config``: "auto", "vllm"
    or a folder holding generation_config.json); ValueError naming the argument for anything else."""
    check_generation_config(generation_config)
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        config = getattr(model, "generation_config", None)
    else:
        from transformers import GenerationConfig  # noqa: PLC0415

        config = GenerationConfig.from_pretrained(generation_config)
    defaults = {}
    for theirs, ours in GENERATION_DEFAULTS:
        value = getattr(config, theirs, None)
        if value is not None:
            defaults[ours] = -1 if ours == "top_k" and value == 0 else value
    return defaults


def default_sampling_params(model, generation_config="auto") -> SamplingParams:
    """``SamplingParams()`` with the chosen generation config's values."""
    return replace(SamplingParams(), **generation_defaults(model, generation_config))
