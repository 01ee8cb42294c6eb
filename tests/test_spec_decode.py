"""Speculative decoding (n-gram prompt lookup): the engine with ``speculative_config`` emits what it emits without.

Greedy: token for token (and logprobs) the tokens of the same engine without speculation, with chunked prefill,
prefix hits, forks, preemption by swap and by recompute in the mix, and every stop rule (stop tokens, EOS, stop
strings, ``max_tokens``, ``min_tokens``) placed at every position of an accepted run. Each test also checks that
drafts were proposed and accepted, so none of them passes with speculation silently off. Sampling keeping the
target's distribution is ``test_spec_decode_distribution.py``.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from paged_hf import PagedEngine, SamplingParams
from models import sample_stories, stories_model, stories_tokenizer, tiny_model, token_logprobs

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "min_acceptance_rate": 0.0, "auto_disable": False}


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


@pytest.fixture(scope="module")
def repeat_prompts():
    """Prompts that ask the model to continue text it has seen: "<story> <story's start>" (it copies the story)."""
    return [f"{s[:300]} {s[:60]}" for s in sample_stories()[:6]] + ["Once upon a time", "Tom had a red ball."]


def engines(model, tok, **options):
    base = PagedEngine(model, tok, enforce_eager=True, **options)
    spec = PagedEngine(model, tok, enforce_eager=True, speculative_config=NGRAM, **options)
    return base, spec


def run(engine, prompts, params):
    outs = engine.generate(prompts, params, use_tqdm=False)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
    return outs


def same(a, b, logprobs: bool = False):
    for x, y in zip(a, b):
        assert x.error is None and y.error is None
        for cx, cy in zip(x.outputs, y.outputs):
            assert cy.token_ids == cx.token_ids
            assert (cy.text, cy.finish_reason, cy.stop_reason) == (cx.text, cx.finish_reason, cx.stop_reason)
            if logprobs:
                torch.testing.assert_close(token_logprobs(cy), token_logprobs(cx), atol=2e-5, rtol=0)


def accepted(engine) -> int:
    stats = engine.get_stats()
    assert stats["spec_decode_num_drafts"] > 0
    return stats["spec_decode_num_accepted_tokens"]


# ------------------------------------------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("options", [
    dict(block_size=4, num_blocks=512),
    dict(block_size=4, num_blocks=512, max_num_batched_tokens=24),  # chunked prefill beside verified runs
    dict(block_size=16, num_blocks=16, preemption_mode="recompute", enable_prefix_caching=False),
    dict(block_size=8, num_blocks=30, preemption_mode="swap", swap_space=0.05),
], ids=["roomy", "chunked", "recompute", "swap"])
def test_greedy_stories_equals_no_speculation(stories, repeat_prompts, options):
    model, tok = stories
    base, spec = engines(model, tok, **options)
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)
    expected = run(base, repeat_prompts, params)
    got = run(spec, repeat_prompts, params)
    same(expected, got, logprobs=True)
    assert accepted(spec) > 20
    if options.get("num_blocks", 512) < 100:
        assert spec.get_stats()["preemption_count"] > 0


def test_compiled_forward_verifies_drafts_like_the_eager_one(stories, repeat_prompts):
    """The engine's default compiled forward (dynamic sizes) runs the 1 + k rows of verified runs too."""
    model, tok = stories
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = run(PagedEngine(model, tok, enforce_eager=True, block_size=16, num_blocks=256), repeat_prompts[:3],
                   params)
    compiled = PagedEngine(model, tok, enforce_eager=False, block_size=16, num_blocks=256, speculative_config=NGRAM)
    same(expected, run(compiled, repeat_prompts[:3], params))
    assert compiled.runner.compiled is not None and accepted(compiled) > 5


def test_prefix_hits_and_forks(stories, repeat_prompts):
    """The same prompts twice (the second round hits the first's blocks, verified drafts' blocks included) and
    ``n = 3`` greedy samples, which fork the prompt's blocks and then speculate apart."""
    model, tok = stories
    base, spec = engines(model, tok, block_size=4, num_blocks=512)
    params = SamplingParams(max_tokens=40, temperature=0.0, n=3)
    for _ in range(2):
        same(run(base, repeat_prompts[:4], params), run(spec, repeat_prompts[:4], params))
    assert spec.get_stats()["prefix_cache_hit_rate"] > 0.3
    assert accepted(spec) > 20


def test_blocks_accepted_drafts_fill_are_registered_in_the_step_that_verifies_them(stories, repeat_prompts):
    """With prefix caching, a running sequence's computed full blocks are registered after every step, those its
    accepted drafts filled included (the decode fast path registers a block only as a token fills it, so one left
    for later would never be): the engine's invariant check after each step."""
    model, tok = stories
    engine = PagedEngine(model, tok, enforce_eager=True, block_size=4, num_blocks=512, speculative_config=NGRAM)
    for prompt in repeat_prompts[:4]:
        engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert accepted(engine) > 20


def test_greedy_tiny_random_model_equals_no_speculation():
    """A random llama repeats itself soon: long accepted runs, across block boundaries of size 2."""
    model = tiny_model("llama", attn_implementation="sdpa")
    base, spec = engines(model, None, block_size=2, num_blocks=400, max_num_batched_tokens=16)
    prompts = [[1, 5, 9, 5, 9, 17], [1, 300, 42, 7]] + [[1, 10 + i, 20 + i, 10 + i, 20 + i] for i in range(6)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    same(run(base, prompts, params), run(spec, prompts, params))
    assert accepted(spec) > 50


@pytest.mark.parametrize("kv_cache_dtype, block_size", [("int8", 4), ("int4", 4), ("int4", 16)])
def test_quantized_kv_equals_no_speculation(kv_cache_dtype, block_size):
    """int4 keeps a partly full block in a full-precision tail row and quantizes it when it fills: its drafts
    never fill a block, so rollback rewinds the tail row only and every block is quantized from its own tokens."""
    model = tiny_model("llama", attn_implementation="sdpa")
    base, spec = engines(model, None, block_size=block_size, num_blocks=400, kv_cache_dtype=kv_cache_dtype)
    prompts = [[1, 5, 9, 5, 9, 17], [1, 300, 42, 7]] + [[1, 10 + i, 20 + i, 10 + i, 20 + i] for i in range(6)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second round hits the first's blocks
        same(run(base, prompts, params), run(spec, prompts, params))
    assert accepted(spec) > 50


def test_sliding_window_model_rolls_back_within_its_window():
    model = tiny_model("mistral", attn_implementation="sdpa")  # sliding_window 6
    base, spec = engines(model, None, block_size=2, num_blocks=300)
    prompts = [[1, 10 + i, 20 + i, 10 + i, 20 + i, 10 + i] for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    same(run(base, prompts, params), run(spec, prompts, params))
    assert accepted(spec) > 10


# ----------------------------------------------------------------------------------- stops inside an accepted run
@pytest.fixture(scope="module")
def looping():
    """A random llama (stories260K's vocabulary and tokenizer) that soon loops, so long runs of drafts are accepted:
    its greedy reference output, and the pair of engines."""
    model, tok = tiny_model("llama", attn_implementation="sdpa"), stories_tokenizer()
    prompt = [1, 400, 33, 87, 400, 33]
    base, spec = engines(model, tok, block_size=4, num_blocks=256)
    reference = run(base, [prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].outputs[0]
    return model, prompt, reference, base, spec


def test_max_tokens_at_every_position(looping):
    model, prompt, reference, base, spec = looping
    for n in range(1, 21):
        got = run(spec, [prompt], SamplingParams(max_tokens=n, temperature=0.0))[0].outputs[0]
        assert got.token_ids == reference.token_ids[:n] and got.finish_reason == "length"
    assert accepted(spec) > 10


def test_stop_token_and_min_tokens_at_every_position(looping):
    model, prompt, reference, base, spec = looping
    for position in range(1, 20):
        token = reference.token_ids[position]
        for min_tokens in (0, position + 2):
            params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[token], min_tokens=min_tokens)
            same(run(base, [prompt], params), run(spec, [prompt], params))
    assert accepted(spec) > 10


def test_stop_strings_at_every_position(looping):
    model, prompt, reference, base, spec = looping
    tok = spec.tokenizer
    for position in range(1, 20):
        piece = tok.decode(reference.token_ids[position - 1 : position + 1]).strip()
        if not piece:
            continue
        for include in (False, True):
            params = SamplingParams(max_tokens=30, temperature=0.0, stop=[piece], include_stop_str_in_output=include)
            same(run(base, [prompt], params), run(spec, [prompt], params))
    assert accepted(spec) > 10


def test_eos_inside_an_accepted_run(looping):
    """The model's EOS set to a token of its loop, with the loop in the prompt: the drafts propose the EOS token and
    the target accepts it, and the run ends there (or, under ``min_tokens``, the EOS is held back at the positions
    before it), as without speculation."""
    model, prompt, reference, base, _ = looping
    tok = base.tokenizer
    prompt = prompt + reference.token_ids[:12]
    saved = model.generation_config.eos_token_id
    try:
        total = 0
        for eos in sorted(set(reference.token_ids[4:12])):
            model.generation_config.eos_token_id = eos
            base, spec = engines(model, tok, block_size=4, num_blocks=256)
            for min_tokens in (0, 3, 7):
                params = SamplingParams(max_tokens=30, temperature=0.0, min_tokens=min_tokens)
                expected, got = run(base, [prompt], params), run(spec, [prompt], params)
                same(expected, got)
                assert got[0].outputs[0].finish_reason == "stop"
            total += spec.get_stats()["spec_decode_num_accepted_tokens"]
        assert total > 10
    finally:
        model.generation_config.eos_token_id = saved


def test_logits_processors_decode_without_drafts(looping):
    """A user's logits processor may keep state: its requests get no drafts (and the same tokens)."""
    model, prompt, reference, base, spec = looping
    before = spec.get_stats()["spec_decode_num_draft_tokens"]
    params = SamplingParams(max_tokens=20, temperature=0.0, logits_processors=[lambda ids, logits: logits])
    same(run(base, [prompt], params), run(spec, [prompt], params))
    assert spec.get_stats()["spec_decode_num_draft_tokens"] == before


def test_poor_acceptance_switches_proposals_off(stories):
    """Stories with no repeated context: the gate pauses proposals, so few draft tokens are verified per output
    token; with ``min_acceptance_rate=0`` the same run verifies many more."""
    model, tok = stories
    prompts = ["Once upon a time", "Lily and Tom", "The sun was", "A little dog"]
    params = SamplingParams(max_tokens=80, temperature=0.0)
    drafted = {}
    for rate in (0.0, 0.5):
        engine = PagedEngine(model, tok, enforce_eager=True, block_size=4, num_blocks=512,
                             speculative_config={**NGRAM, "min_acceptance_rate": rate})
        run(engine, prompts, params)
        drafted[rate] = engine.get_stats()["spec_decode_num_draft_tokens"]
    assert drafted[0.5] < drafted[0.0] / 2


# ---------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("config, message", [
    ({"method": "eagle"}, r"speculative_config\['method'\] must be one of \['ngram', 'draft_model'\]"),
    ({"method": "draft_model", "model": "/no/such/folder", "num_speculative_tokens": 2}, r"'model'\] must be a model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"'model'\] must be a loaded PreTrainedModel"),
    ({"method": "draft_model", "model": tiny_model("llama"), "prompt_lookup_max": 2}, r"'prompt_lookup_max'\] is for"),
    ({"method": "ngram", "model": tiny_model("llama")}, r"'model'\] is for method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens'\] must be an int in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min'] must be <="),
    ({"method": "ngram", "prompt_lookup_max": 0}, r"'prompt_lookup_max'\] must be an int in \[1, 64\], got 0"),
    ({"method": "ngram", "num_speculative_token": 2}, r"unknown key\(s\) \['num_speculative_token'\].*did you mean"),
    ({"num_speculative_tokens": 2}, "needs a 'method'"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_names_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        PagedEngine(tiny_model("llama"), None, speculative_config=config, num_blocks=8, enforce_eager=True)


def test_one_lookup_bound_alone_keeps_the_other_in_range():
    from paged_hf.engine.spec import SpeculativeConfig

    assert SpeculativeConfig.of({"method": "ngram", "prompt_lookup_min": 6}).prompt_lookup_max == 6
    assert SpeculativeConfig.of({"method": "ngram", "prompt_lookup_max": 2}).prompt_lookup_min == 1
    # None is the default, as in vLLM
    default = SpeculativeConfig.of({"method": "ngram"})
    given_none = SpeculativeConfig.of({"method": "ngram", "prompt_lookup_min": None, "prompt_lookup_max": None,
                                       "num_speculative_tokens": None})
    assert given_none == default


def test_throughput_switch_follows_the_faster_mode():
    """Each cycle opens with a probe alternating the two modes step by step; the faster one (speculation by
    MARGIN) runs the rest of the cycle."""
    from paged_hf.engine.spec.switch import CYCLE_STEPS, MARGIN, PROBE_STEPS, ThroughputSwitch

    switch = ThroughputSwitch()

    def cycle(rate_on: float, rate_off: float) -> list[bool]:
        modes = []
        while True:
            mode = switch.speculating()
            modes.append(mode)
            switch.record(mode, 1.0, int(rate_on if mode else rate_off), 4)
            if switch._step_in_cycle == 0:
                return modes

    probe = [True, False] * PROBE_STEPS
    assert cycle(rate_on=80, rate_off=100) == probe + [False] * (CYCLE_STEPS - 2 * PROBE_STEPS)
    assert not switch.winner and switch.rates == {True: 80.0, False: 100.0}
    assert cycle(rate_on=80, rate_off=100) == probe + [False] * (2 * CYCLE_STEPS - 2 * PROBE_STEPS)  # it held
    assert cycle(rate_on=150, rate_off=100) == probe + [True] * (CYCLE_STEPS - 2 * PROBE_STEPS)  # faster: on
    assert switch.winner and switch.cycle_steps == CYCLE_STEPS  # a new winner: short cycles again
    tie = int(100 * MARGIN) - 1  # faster, but by less than MARGIN: off
    assert cycle(rate_on=tie, rate_off=100) == probe + [False] * (CYCLE_STEPS - 2 * PROBE_STEPS)


def test_throughput_switch_probes_again_when_the_batch_changes():
    """A decision holds for the batch size it was measured at: 4 sequences probed, then 9 or 1 decoding, a new
    probe starts at the next step (and short cycles again); 2 to 8 keep it."""
    from paged_hf.engine.spec.switch import CYCLE_STEPS, PROBE_STEPS, ThroughputSwitch

    for size, probes_again in ((8, False), (2, False), (9, True), (1, True)):
        switch = ThroughputSwitch()
        for _ in range(2 * PROBE_STEPS):
            mode = switch.speculating()
            switch.record(mode, 1.0, 80 if mode else 100, 4)
        for _ in range(CYCLE_STEPS - 2 * PROBE_STEPS - 2):  # the cycle has 2 steps left
            switch.record(switch.speculating(), 1.0, 100, 4)
        assert switch.speculating() is False and switch.cycle_steps == CYCLE_STEPS
        switch.record(False, 1.0, 100, size)
        assert switch.speculating() is probes_again, size  # a probe opens with a speculating step


def test_throughput_switch_probes_less_while_the_winner_holds():
    """Where one mode keeps winning, its cycles double up to MAX_CYCLE_STEPS: the losing mode runs PROBE_STEPS of
    every MAX_CYCLE_STEPS steps in the end."""
    from paged_hf.engine.spec.switch import CYCLE_STEPS, MAX_CYCLE_STEPS, PROBE_STEPS, ThroughputSwitch

    switch = ThroughputSwitch()
    lengths, probes, steps = [], 0, 0
    while len(lengths) < 7:
        mode = switch.speculating()
        probes += mode
        switch.record(mode, 1.0, 80 if mode else 100, 4)
        steps += 1
        if switch._step_in_cycle == 0:
            lengths.append(steps)
            steps = 0
    assert lengths == [CYCLE_STEPS, 2 * CYCLE_STEPS, 4 * CYCLE_STEPS] + [MAX_CYCLE_STEPS] * 4
    assert not switch.winner and probes == 7 * PROBE_STEPS


def test_auto_disable_speculates_less_where_it_is_slower(monkeypatch):
    """With the switch on and speculation measured slower (a clock that charges each draft), the engine spends most
    decoding steps without drafts; the tokens stay the same."""
    import paged_hf.engine.spec.switch as switch_module

    model = tiny_model("llama", attn_implementation="sdpa")
    prompts = [[1, 10 + i, 20 + i, 10 + i, 20 + i] for i in range(4)]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    base = PagedEngine(model, None, enforce_eager=True, block_size=4, num_blocks=400)
    expected = run(base, prompts, params)
    drafted = {}
    for auto in (False, True):
        monkeypatch.setattr(switch_module, "CYCLE_STEPS", 16)  # cycles of a 4-step probe and 12 steps
        monkeypatch.setattr(switch_module, "PROBE_STEPS", 2)
        spec = PagedEngine(model, None, enforce_eager=True, block_size=4, num_blocks=400,
                           speculative_config={**NGRAM, "auto_disable": auto})
        assert spec.scheduler.speculator.clock is time.process_time  # a CPU engine times steps in CPU seconds
        clock = [0.0]

        def charged():  # each call 1 s, 11 s in a step that speculates: its tokens per second are fewer
            clock[0] += 1.0 + 10.0 * spec.scheduler._speculating
            return clock[0]

        spec.scheduler.speculator.clock = charged  # the step starts at one call, ends at the next
        got = run(spec, prompts, params)
        monkeypatch.undo()
        same(expected, got)
        drafted[auto] = spec.get_stats()["spec_decode_num_drafts"]
    assert drafted[True] < drafted[False] / 2


def _lookup_reference(tokens: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Prompt lookup written plainly: the longest suffix first, its latest earlier occurrence with ``k`` tokens
    after it, else its earliest one."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= len(tokens)]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start : start + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_ngram_lookup_equals_the_plain_reference(tokens, k, lookup_min, extra):
    from paged_hf.engine.spec.ngram import propose_ngram

    lookup_max = lookup_min + extra
    assert propose_ngram(tokens, k, lookup_max, lookup_min) == _lookup_reference(tokens, k, lookup_max, lookup_min)
