"""Prefix caching on sliding-window and hybrid models: tokens (and their logprobs) with a hit equal those of the miss.

Tiny random Mistral (every layer a window of 6), Gemma2 (sliding and full alternate), Gemma3-shaped (two sliding
layers, one full), Qwen2 with windows past its first layer, Llama as the full-attention baseline, and stories260K.
Block size 4, windows of 6: prompts share a 24-token prefix, so a hit spans several windows, and the sliding groups
have freed (and may have evicted) the blocks before their window. Chunked prefill and preemption (recompute, swap)
change when blocks are freed and hit. Logprobs agree to 2e-5; with an int8 or int4 pool, to a tenth of the pool's
own distance from the unquantized run (``FLIP_SHARE``): the hit's prefix was computed in other steps than the
miss's, their linears round its K/V differently by an ulp (a GEMM's row count), and a code at a rounding boundary
may flip (gemma3-int8 once did: 5.5e-5, against a format distance of 8.2e-3).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from paged_hf import PagedEngine, SamplingParams
from models import _COMMON, stories_model, tiny_model, token_logprobs
from test_quant_end_to_end import FLIP_SHARE

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
SHARED = 24  # tokens of the common prefix: six blocks of 4, four windows of 6


def gemma3_model():
    config = transformers.Gemma3TextConfig(**{
        **_COMMON, "sliding_window": 6, "head_dim": 16, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


_models: dict = {}


def model_of(name: str):
    if name not in _models:
        if name == "gemma3":
            _models[name] = gemma3_model()
        elif name == "qwen2-window":  # the first layer full, the others windows of 6 (a full group first)
            _models[name] = tiny_model("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1)
        else:
            _models[name] = stories_model() if name == "stories" else tiny_model(name)
    return _models[name]


def prompts(num: int = 5, shared: int = SHARED, seed: int = 0) -> list[list[int]]:
    """``num`` prompts: one shared prefix, then distinct tails of 3 to 9 tokens."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 512, (shared,), generator=generator).tolist()
    return [prefix + torch.randint(3, 512, (3 + 2 * i,), generator=generator).tolist() for i in range(num)]


def run(model, batch, caching: bool, **options) -> list:
    """The first prompt alone (it fills the cache), then the rest as one batch."""
    engine = PagedEngine(model, None, enable_prefix_caching=caching, **{"block_size": 4, "num_blocks": 96, **options})
    outs = engine.generate(batch[:1], GREEDY, use_tqdm=False) + engine.generate(batch[1:], GREEDY, use_tqdm=False)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
    return outs, engine


def format_error(quantized: list, unquantized: list) -> float:
    """The quantized pool's own distance from the unquantized one: the largest logprob difference over the outputs
    whose greedy tokens agree (a random tiny model may fork under quantization)."""
    same = [(q, u) for q, u in zip(quantized, unquantized) if q.outputs[0].token_ids == u.outputs[0].token_ids]
    assert same, "every output forked under quantization: no distance to measure"
    logprobs = lambda out: torch.tensor(token_logprobs(out.outputs[0]))  # noqa: E731
    return max((logprobs(q) - logprobs(u)).abs().max().item() for q, u in same)


OPTIONS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 5},
    "recompute": {"num_blocks": 12, "preemption_mode": "recompute", "max_num_batched_tokens": 11},
    "swap": {"num_blocks": 12, "preemption_mode": "swap", "swap_space": 0.001, "max_num_batched_tokens": 11},
    "int8": {"kv_cache_dtype": "int8", "max_num_batched_tokens": 7},  # a hit reads the bytes the miss stored
    "int4": {"kv_cache_dtype": "int4", "max_num_batched_tokens": 7},  # and the full-precision tail rows
}
SMALL_POOL = {"mistral": 9}  # a window group holds few blocks per sequence: a smaller pool makes the hits preempt


@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gemma3", "qwen2-window", "stories"])
def test_hit_equals_miss(family, options):
    model, batch, config = model_of(family), prompts(), dict(OPTIONS[options])
    if "num_blocks" in config:
        config["num_blocks"] = SMALL_POOL.get(family, config["num_blocks"])
    misses, _ = run(model, batch, False, **config)
    hits, engine = run(model, batch, True, **config)
    tolerance = 2e-5
    if "kv_cache_dtype" in config:  # a code at a rounding boundary may flip between the runs (see FLIP_SHARE)
        unquantized, _ = run(model, batch, False, **{k: v for k, v in config.items() if k != "kv_cache_dtype"})
        tolerance = max(tolerance, FLIP_SHARE * format_error(misses, unquantized))
    for miss, hit in zip(misses, hits):
        assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
        torch.testing.assert_close(token_logprobs(hit.outputs[0]), token_logprobs(miss.outputs[0]), atol=tolerance,
                                   rtol=0)
    cached = [out.num_cached_tokens for out in hits[1:]]
    assert max(cached) >= SHARED - 4 > 6, f"the hits must span more than a window, got {cached}"
    stats = engine.get_stats()
    assert stats["prefix_cache_hits"] >= sum(cached)
    if "preemption_mode" in config:
        assert stats["preemption_count"] > 0, "the small pool must preempt"
