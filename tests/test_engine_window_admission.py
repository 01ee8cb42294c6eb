"""A sliding-window model whose prompt needs more blocks than the pool holds, but whose window does not.

``add_request`` accepts such a request (a sliding group holds only its window's blocks), so admission must be able to
start it: the scheduler computes the prompt in chunks its pool holds, freeing the blocks behind the window as it
goes. Tiny random Mistral (every layer a window of 6), block size 4, a 5-block pool (20 slots), prompts of 40 and
more tokens, with the default chunk budget (larger than the prompt) and one of 17 tokens (more than the pool holds
beside the window). The engines run eagerly: what is checked is the scheduling (the compiled forward of sliding
window chunks is `test_engine_families.py`'s). Each run is a step loop bounded in steps and seconds, so a request
that waits forever fails the test instead of hanging it.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache

from paged_hf import PagedEngine, SamplingParams
from models import tiny_model

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, ids: list[int]) -> list[int]:
    """Greedy tokens of ``generate`` on a ``DynamicCache`` with sdpa."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                         cache=DynamicCache(config=model.config))
    return out[0, len(ids):].tolist()


def run_bounded(engine: PagedEngine, seconds: float = 30.0, max_steps: int = 500) -> dict[str, list[int]]:
    """Steps until every request finishes; fails if that takes more than ``max_steps`` steps or ``seconds``."""
    tokens: dict[str, list[int]] = {}
    start, steps = time.monotonic(), 0
    while engine.has_unfinished_requests():
        assert steps < max_steps and time.monotonic() - start < seconds, (
            f"not finished after {steps} steps: {engine.get_stats()['num_waiting']} request(s) still waiting")
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        steps += 1
    return tokens


@pytest.fixture(scope="module")
def mistral():
    return tiny_model("mistral")


@pytest.mark.parametrize("num_tokens", [40, 41, 57])
# the default budget (bigger than any prompt), and chunks the pool cannot hold beside the window
@pytest.mark.parametrize("budget", [2048, 17])
def test_a_prompt_longer_than_the_pool_runs_in_chunks_the_window_frees(mistral, num_tokens, budget):
    engine = PagedEngine(mistral, None, block_size=4, num_blocks=5, max_num_batched_tokens=budget,
                         enforce_eager=True)
    ids = prompt(num_tokens)
    request_id = engine.add_request(ids, GREEDY)
    assert run_bounded(engine)[request_id] == reference(mistral, ids)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


def test_long_prompts_queued_together_all_finish(mistral):
    """Several such prompts at once (one at a time fits the pool) all finish with the reference's tokens."""
    engine = PagedEngine(mistral, None, block_size=4, num_blocks=5, enforce_eager=True)
    batch = [prompt(40 + 3 * i, seed=i) for i in range(3)]
    ids = [engine.add_request(p, GREEDY) for p in batch]
    tokens = run_bounded(engine)
    assert [tokens[i] for i in ids] == [reference(mistral, p) for p in batch]
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


def test_the_same_long_prompt_again_starts_on_its_cached_window(mistral):
    """Run again, the prompt hits the blocks its window left cached, and computes only past them."""
    engine = PagedEngine(mistral, None, block_size=4, num_blocks=5, enforce_eager=True)
    ids = prompt(41)
    for _ in range(2):
        request_id = engine.add_request(ids, GREEDY)
        assert run_bounded(engine)[request_id] == reference(mistral, ids)
    assert engine.get_stats()["prefix_cache_hit_rate"] > 0
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
