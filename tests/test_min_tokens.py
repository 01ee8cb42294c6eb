"""``min_tokens`` holds EOS and the stop token ids back (vLLM's rule, transformers' ``min_new_tokens``): the sampler
gives them -inf until a row has ``min_tokens`` output tokens, greedy rows included, so they are never drawn early."""

from __future__ import annotations

import pytest
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import paged_hf
from paged_hf import PagedEngine, SamplingParams
from models import stories_model, stories_tokenizer

EOS = 2  # stories260K's
PROMPT = "Lily and Tom"


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


class _Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids, scores):
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


def hf_tokens(stories, min_new_tokens: int, bias: dict[int, float], eos: int, max_new_tokens: int = 24) -> list[int]:
    model, tok = stories
    ids = tok(PROMPT, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=min_new_tokens,
                         eos_token_id=eos, logits_processor=LogitsProcessorList([_Bias(bias)]),
                         cache=DynamicCache(config=model.config))
    return out[0, ids["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("min_tokens", [0, 1, 10])
def test_min_tokens_holds_eos_back_as_transformers_min_new_tokens(stories, min_tokens):
    """EOS made the argmax of every step (a +100 bias): the row stops right after ``min_tokens`` tokens."""
    engine = PagedEngine(*stories)
    params = SamplingParams(max_tokens=24, min_tokens=min_tokens, temperature=0.0, logit_bias={EOS: 100.0})
    completion = engine.generate([PROMPT], params)[0].outputs[0]
    assert completion.token_ids == hf_tokens(stories, min_tokens, {EOS: 100.0}, EOS)
    assert completion.token_ids[-1] == EOS and len(completion.token_ids) == min_tokens + 1
    assert EOS not in completion.token_ids[:-1]
    assert completion.finish_reason == "stop"


def test_min_tokens_holds_stop_token_ids_back(stories):
    engine = PagedEngine(*stories)
    stop = 432
    params = SamplingParams(max_tokens=24, min_tokens=10, temperature=0.0, stop_token_ids=[stop],
                            logit_bias={stop: 100.0})
    completion = engine.generate([PROMPT], params)[0].outputs[0]
    assert len(completion.token_ids) == 11 and completion.token_ids[-1] == stop
    assert stop not in completion.token_ids[:-1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.token_ids == hf_tokens(stories, 10, {stop: 100.0}, stop)


def test_min_tokens_equal_to_max_tokens_never_stops_early(stories):
    """Sampled rows too: EOS is never drawn while held back, whatever the temperature."""
    params = SamplingParams(n=4, max_tokens=12, min_tokens=12, temperature=1.0, seed=3, logit_bias={EOS: 100.0})
    llm_outputs = paged_hf.LLM(model=stories[0], tokenizer=stories[1]).generate([PROMPT], params)
    for completion in llm_outputs[0].outputs:
        assert len(completion.token_ids) == 12 and EOS not in completion.token_ids
        assert completion.finish_reason == "length"


def test_ignore_eos_with_min_tokens_still_holds_stop_token_ids(stories):
    engine = PagedEngine(*stories)
    params = SamplingParams(max_tokens=8, min_tokens=4, temperature=0.0, ignore_eos=True, stop_token_ids=[432],
                            logit_bias={EOS: 50.0, 432: 100.0})
    completion = engine.generate([PROMPT], params)[0].outputs[0]
    assert completion.token_ids[:4] == [EOS] * 4  # EOS is an ordinary token here; the stop id is held back
    assert completion.token_ids[4:] == [432] and completion.finish_reason == "stop"
