"""Parallel samples (``n > 1``) fork sample 0's blocks: a fork of a partly full tail block must copy it on write.

A seeded ``n=3`` request equals three seeded ``n=1`` requests, tokens and logprobs, and its logprobs equal a plain
transformers forward over prompt + output. Sample ``i`` of a request with ``seed=s`` samples with its own generator
seeded ``s + i``, so the ``n=1`` reference for sample ``i`` is the same request with ``seed=s + i``.

If the siblings shared the tail block instead of copying it, each would write its first token's K/V into the same
slot, and the samples that follow read a neighbour's K/V. That needs first tokens that differ (see ``SEED``) and
prefix caching off: with it on, sample 0 registers the tail block in the prefix cache as soon as it fills it, and a
hashed block is copied on write whatever its ref count, which hides a missing ref-count check.
"""

from __future__ import annotations

import pytest
import torch

from paged_hf import PagedEngine, SamplingParams
from models import stories_model, stories_tokenizer, story_openings, token_logprobs

SEED = 8  # samples 0 and 1 start with token 346, sample 2 with 359: a shared tail slot would be overwritten
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


@pytest.fixture(scope="module")
def prompt(stories):
    _, tok = stories
    text = story_openings()[2]  # "One day, a little boy named Tim went to the park."
    assert len(tok(text)["input_ids"]) % BLOCK_SIZE != 0, "the prompt must end mid-block"
    return text


def params(n: int, seed: int) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def references(stories, prompt):
    """Sample ``i``'s expected output: the request alone with n=1 and seed SEED + i, on a roomy pool."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=BLOCK_SIZE, num_blocks=64, enable_prefix_caching=False)
    return [engine.generate([prompt], params(1, SEED + i), use_tqdm=False)[0].outputs[0] for i in range(3)]


def forward_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """log_softmax of one plain forward (sdpa, no cache) over prompt + output, at each output token."""
    attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + output_ids])).logits[0]
    finally:
        model.set_attn_implementation(attention)
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(output_ids)]


@pytest.mark.parametrize(
    "options",
    [
        {"num_blocks": 16},  # exactly room for the three samples: every freed block of the warm-up is reused
        # without prefix caching: no block hash makes the shared tail look read-only, only its ref count does
        {"num_blocks": 16, "enable_prefix_caching": False},
        # a chunked prompt, then preemption of forked samples (their KV dropped, or swapped out and back)
        {"num_blocks": 12, "max_num_batched_tokens": 5, "preemption_mode": "recompute",
         "enable_prefix_caching": False},
        {"num_blocks": 12, "preemption_mode": "swap", "swap_space": 0.001},
    ],
    ids=["tight_pool", "no_prefix_caching", "chunked_recompute", "swap"],
)
def test_seeded_n3_equals_three_n1_runs(stories, prompt, references, options):
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=BLOCK_SIZE, **options)
    # a first request takes and frees blocks, so the n=3 request runs on reused blocks (stale K/V in them)
    engine.generate([story_openings()[4]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                    use_tqdm=False)
    out = engine.generate([prompt], params(3, SEED), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3, "three different samples"
    assert len({c.token_ids[0] for c in out.outputs}) > 1, "the first tokens must differ (see SEED)"
    for sample, expected in zip(out.outputs, references):
        assert sample.token_ids == expected.token_ids, f"sample {sample.index}"
        torch.testing.assert_close(token_logprobs(sample), token_logprobs(expected), atol=1e-5, rtol=0)
        # temperature 1, no top-k/p: the logprob is log_softmax of the model's logits
        torch.testing.assert_close(token_logprobs(sample), forward_logprobs(model, out.prompt_token_ids,
                                                                           sample.token_ids), atol=2e-5, rtol=0)
    stats = engine.get_stats()
    if options["num_blocks"] < 16:
        assert stats["preemption_count"] > 0, "the pool must be too small for the three samples"
    if options.get("preemption_mode") == "swap":
        assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


@pytest.mark.parametrize("max_tokens, stop", [(1, None), (4, "first")])
def test_samples_fork_when_sample_0_ends_on_its_first_token(stories, prompt, max_tokens, stop):
    """Sample 0 of an ``n = 3`` request ending on its first token (``max_tokens=1``, or its first token a stop
    token) freed its blocks before the other samples forked from them: they waited forever. Each sample gets its own
    first token, and the request finishes."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=BLOCK_SIZE, num_blocks=64, enable_prefix_caching=False)
    first = engine.generate(prompt, params(1, SEED), use_tqdm=False)[0].outputs[0].token_ids[0]
    sampled = SamplingParams(n=3, max_tokens=max_tokens, temperature=1.0, seed=SEED, ignore_eos=True,
                             stop_token_ids=[first] if stop else None)
    engine.add_request(prompt, sampled)
    for _ in range(3 * max_tokens + 2):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests(), "the request's other samples never forked"
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


@pytest.mark.parametrize("case", ["shared_prefix", "forked_samples"])
def test_a_swapped_sequence_that_needs_the_whole_pool_comes_back(case):
    """A sequence that held every block when it was swapped out (its own and the blocks it shared with a prompt or
    with its other samples) swaps back in once it is alone: it waited for one block more than the pool has, for
    good, and every request behind it waited too (generate never returned)."""
    from models import tiny_model

    model = tiny_model("llama", attn_implementation="paged")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefix = list(range(10, 26))  # 4 full blocks of 4
    if case == "shared_prefix":
        engine = PagedEngine(model, None, enforce_eager=True, block_size=4, num_blocks=5, preemption_mode="swap")
        prompts, params = [prefix, prefix + [30]], [greedy, greedy]  # the second: 17 + 3 = 5 blocks
    else:
        engine = PagedEngine(model, None, enforce_eager=True, block_size=4, num_blocks=3, preemption_mode="swap",
                             swap_space=0.01)
        prompts, params = [list(range(10, 19))], [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2)]
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    for _ in range(100):
        engine.step()
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), (len(engine.scheduler.swapped), engine.kv.num_free_blocks)
    assert engine.scheduler.num_swapped_in > 0
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
