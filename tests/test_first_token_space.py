"""The first generated token keeps its leading space with SentencePiece tokenizers (stories260K; the Llama-2 /
Mistral kind): the engine decodes the output with the prompt's last tokens as context, as vLLM's incremental
detokenizer does, so prompt + text reads as ``tokenizer.decode(prompt + output)``."""

from __future__ import annotations

import pytest

import paged_hf
from paged_hf import PagedEngine, SamplingParams
from models import output_text, stories_model, stories_tokenizer, story_openings

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


def test_llm_text_keeps_the_first_space(stories):
    model, tok = stories
    out = paged_hf.LLM(model=model, tokenizer=tok).generate(["Lily and Tom"], GREEDY)[0]
    text = out.outputs[0].text
    assert text.startswith(" were playing")
    assert "Lily and Tom" + text == tok.decode(out.prompt_token_ids + out.outputs[0].token_ids,
                                               skip_special_tokens=True)


@pytest.mark.parametrize("stop", [None, ["zzz"]])  # a stop string makes the text per step
def test_engine_text_and_stream_equal_decode_of_prompt_plus_output(stories, stop):
    model, tok = stories
    engine = PagedEngine(model, tok)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=stop)
    for prompt in story_openings() + ["Lily and Tom", "Once"]:
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        expected = output_text(tok, out.prompt_token_ids, out.outputs[0].token_ids)
        assert out.outputs[0].text == expected
        assert "".join(engine.stream(prompt, params)) == expected


@pytest.mark.parametrize("stop", [None, ["zzz"]])
def test_a_prompt_ending_in_a_byte_fallback_character_keeps_the_first_space(stories, stop):
    """A prompt ending in "é" as byte-fallback tokens (<0xC3><0xA9>, a whole character, as a tokenizer without the
    piece gives it): the output's first word-start token (" to", forced) keeps its space, as decode(prompt + output)
    has it; vLLM's text has it too."""
    model, tok = stories
    ids = tok("Lily said caf")["input_ids"] + tok.convert_tokens_to_ids(["<0xC3>", "<0xA9>"])
    assert tok.decode(ids, skip_special_tokens=True).endswith("café")
    to = tok.convert_tokens_to_ids("\u2581to")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, allowed_token_ids=[to], stop=stop)
    out = PagedEngine(model, tok).generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert out.outputs[0].text == output_text(tok, ids, out.outputs[0].token_ids) == " to to to"


def test_logprob_tokens_are_named_in_context(stories):
    model, tok = stories
    engine = PagedEngine(model, tok)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = engine.generate(["Lily and Tom"], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    first = completion.logprobs[0]
    assert first[completion.token_ids[0]].decoded_token == " we"
    assert all(entry.decoded_token.startswith(" ") for entry in first.values())
    named = "".join(entry[t].decoded_token for entry, t in zip(completion.logprobs, completion.token_ids))
    assert named == completion.text
    prompt_named = [entry[t].decoded_token for entry, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    assert "".join(prompt_named) == " Lily and Tom"
