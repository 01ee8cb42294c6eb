"""A ``PagedCache`` follows the attention the model actually runs, whatever config object it was built from.

A config is only data: people build caches from ``AutoConfig.from_pretrained``, from a copy, or from another
instance of the same model loaded with another attention. The cache must give the same logits as one built from the
model's own config (and, in ``auto``, those of ``DynamicCache``), in both directions: a ``"paged"`` model over a cache
built from an sdpa config, and an sdpa model over a cache built from a ``"paged"`` config.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import paged_hf
from paged_hf.quant import KV_CACHE_DTYPES

from models import STORIES, stories_model, stories_tokenizer, story_text_ids

CHUNK = 32


@pytest.fixture(scope="module")
def models():
    return {attention: stories_model(attention) for attention in ("sdpa", "paged")}


@pytest.fixture(scope="module")
def ids():
    return story_text_ids(stories_tokenizer(), 160)


@torch.no_grad()
def chunked_logits(model, ids, cache) -> torch.Tensor:
    """``[n, vocab]`` logits of ``ids`` fed in chunks of ``CHUNK`` with no mask, as a perplexity script does."""
    return torch.cat([model(input_ids=ids[None, b : b + CHUNK], cache=cache, use_cache=True).logits[0]
                      for b in range(0, len(ids), CHUNK)])


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("model_attention, config_attention", [("paged", "sdpa"), ("sdpa", "paged")])
def test_cache_from_a_config_of_the_other_attention_is_exact(models, ids, kv_cache_dtype, model_attention,
                                                             config_attention):
    model, other = models[model_attention], models[config_attention]
    assert other.config._attn_implementation == config_attention
    own = chunked_logits(model, ids, paged_hf.PagedCache(model.config, num_blocks=64, kv_cache_dtype=kv_cache_dtype))
    foreign = chunked_logits(model, ids, paged_hf.PagedCache(other.config, num_blocks=64,
                                                             kv_cache_dtype=kv_cache_dtype))
    torch.testing.assert_close(foreign, own, rtol=0, atol=0)
    if kv_cache_dtype == "auto":
        # the CPU prefill merges a later chunk's stored-key and own-key parts by their log-sum-exps: float rounding
        dense = chunked_logits(models["sdpa"], ids, DynamicCache())
        torch.testing.assert_close(foreign, dense, rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("config_attention", ["sdpa", "paged"])
def test_cache_from_autoconfig_follows_the_model(models, ids, config_attention):
    """A config loaded separately (``AutoConfig``) names no attention or another one: the model's decides."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(STORIES, attn_implementation=config_attention)
    dense = chunked_logits(models["sdpa"], ids, DynamicCache())
    for model in models.values():  # atol: the CPU prefill's log-sum-exp merge (the test above)
        logits = chunked_logits(model, ids, paged_hf.PagedCache(config, num_blocks=64))
        torch.testing.assert_close(logits, dense, rtol=1e-5, atol=3e-5)
