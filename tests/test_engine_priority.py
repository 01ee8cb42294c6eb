"""``scheduling_policy="priority"``: a lower ``priority`` value runs first and is preempted last (vLLM's rule).

The requests arrive in the order opposite to their priority, so first-come-first-served would give the other
order: each test fails under "fcfs" as well as under a reversed priority order.
"""

from __future__ import annotations

import pytest

from paged_hf import PagedEngine, SamplingParams
from models import stories_model, stories_tokenizer, story_openings

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# request id -> priority, in arrival order: the least important arrives first
PRIORITIES = {"low": 2, "mid": 1, "high": 0}


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


@pytest.fixture(scope="module")
def prompts():
    openings = story_openings()
    return {"low": openings[0], "mid": openings[2], "high": openings[3]}  # 16, 19 and 22 tokens


@pytest.fixture(scope="module")
def references(stories, prompts):
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64, enable_prefix_caching=False)
    return {rid: engine.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for rid, p in prompts.items()}


def run(engine: PagedEngine, prompts: dict) -> tuple[list[str], dict]:
    """Adds the requests in arrival order, steps to the end; returns the finishing order and the final outputs."""
    for rid, prompt in prompts.items():
        engine.add_request(prompt, GREEDY, request_id=rid, priority=PRIORITIES[rid])
    order, finals = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                finals[out.request_id] = out
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
    return order, finals


@pytest.mark.parametrize("policy, expected", [("priority", ["high", "mid", "low"]), ("fcfs", ["low", "mid", "high"])])
def test_with_room_for_one_sequence_the_higher_priority_finishes_first(stories, prompts, references, policy,
                                                                       expected):
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64, max_num_seqs=1, scheduling_policy=policy)
    order, finals = run(engine, prompts)
    assert order == expected
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == references


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_under_pressure_the_lowest_priority_is_preempted_first(stories, prompts, references, preemption_mode):
    model, tok = stories
    # all three are admitted (5 + 5 + 6 prompt blocks), but growing to 8 + 9 + 10 blocks does not fit 18
    engine = PagedEngine(model, tok, block_size=4, num_blocks=18, scheduling_policy="priority",
                         preemption_mode=preemption_mode, swap_space=0.001)
    order, finals = run(engine, prompts)
    preemptions = {rid: out.metrics.num_preemptions for rid, out in finals.items()}
    assert engine.get_stats()["preemption_count"] > 0
    assert preemptions["high"] == 0, preemptions
    assert preemptions["low"] >= max(preemptions["mid"], 1), preemptions
    assert order[0] == "high"
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == references
