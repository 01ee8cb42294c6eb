"""Inputs found failing on Gemma 3n / Gemma 4 (and the models that share their layout) by a bug hunt, each against
its oracle: ``generate`` on ``DynamicCache`` + sdpa, greedy, EOS ignored."""

from __future__ import annotations

import pytest

from paged_hf import PagedEngine, SamplingParams
from models import token_logprobs
from test_shared_kv_models import FAMILIES, MAX_TOKENS, prompts, references, tiny_shared


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_n_samples_of_a_model_with_sliding_and_full_layers(family):
    """``n=2``: the second sample forks the first's blocks after the prompt, sharing its partial tail block. Once
    the first copied that tail (copy-on-write), the fork's tail is its own again, but its table's cached flag
    (``_tail_private``) still said shared: with more than one layer group (sliding and full), ``append_decodes``
    took ``tail_has_room()`` (True) and then ignored ``append_in_tail()``'s False, so the fork's tables never grew
    and the scheduler raised IndexError in the prefix cache. Both samples equal the greedy reference."""
    engine = PagedEngine(tiny_shared(family), None, block_size=4, num_blocks=128, enforce_eager=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0, n=2)
    outs = engine.generate(prompts(), params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, references(family)):
        assert len(out.outputs) == 2
        for sample in out.outputs:
            assert sample.token_ids == tokens
            assert token_logprobs(sample) == pytest.approx(logprobs, abs=2e-5)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
