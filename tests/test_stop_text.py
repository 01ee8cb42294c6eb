"""What a request's text shows when something stops it, as vLLM shows it: a stop token's (or EOS's) text is left
out unless ``include_stop_str_in_output``; an unfinished output holds back the characters a stop string could still
take (no stream ever shows text that the final output then drops); a stop string counts only when it ends after
``min_tokens`` output tokens, and of two that end in one step the one that ends first wins; EOS listed among the stop
token ids gives no ``stop_reason``; a special token's logprob entry is named by its piece."""

from __future__ import annotations

import pytest

from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine.request import RequestOutputKind
from models import output_text, stories_model, stories_tokenizer

EOS = 2  # stories260K's "</s>"
PROMPT = "Lily and Tom"


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


@pytest.fixture(scope="module")
def plain(stories):
    """The greedy output of PROMPT without stops: (prompt ids, output ids, text)."""
    model, tok = stories
    out = PagedEngine(model, tok).generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                           use_tqdm=False)[0]
    return out.prompt_token_ids, out.outputs[0].token_ids, out.outputs[0].text


def run_kinds(engine, params) -> dict:
    """Every output of one request per output kind, stepped together."""
    ids = {kind: engine.add_request(PROMPT, params, output_kind=kind) for kind in RequestOutputKind}
    seen = {kind: [] for kind in RequestOutputKind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[next(k for k, rid in ids.items() if rid == out.request_id)].append(out.outputs[0])
    return seen


def test_a_stop_token_is_in_token_ids_but_not_in_the_text(stories, plain):
    model, tok = stories
    prompt_ids, output, _ = plain
    at = next(i for i in range(3, len(output)) if output[i] not in output[:i])  # its first occurrence
    engine = PagedEngine(model, tok)
    for include in (False, True):
        params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[output[at]],
                                include_stop_str_in_output=include)
        seen = run_kinds(engine, params)
        final = seen[RequestOutputKind.FINAL_ONLY][0]
        assert final.token_ids == output[: at + 1] and final.stop_reason == output[at]
        assert final.text == output_text(tok, prompt_ids, output[: at + 1 if include else at])
        assert "".join(d.text for d in seen[RequestOutputKind.DELTA]) == final.text
        assert seen[RequestOutputKind.CUMULATIVE][-1].text == final.text
    engine.check_invariants()


class _EosAt:
    """A logits processor that makes EOS the greedy choice at output position ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, output_ids, logits):
        if len(output_ids) == self.at:
            logits[EOS] = logits.max() + 10
        return logits


def test_eos_text_is_left_out_also_where_special_tokens_are_kept(stories, plain):
    model, tok = stories
    prompt_ids, output, _ = plain
    engine = PagedEngine(model, tok)
    params = SamplingParams(max_tokens=24, temperature=0.0, skip_special_tokens=False, logits_processors=[_EosAt(5)],
                            logprobs=2)
    final = engine.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert final.token_ids == output[:5] + [EOS] and final.finish_reason == "stop" and final.stop_reason is None
    assert final.text == output_text(tok, prompt_ids, output[:5]) and "</s>" not in final.text
    assert final.logprobs[5][EOS].decoded_token == "</s>"  # a special token is named by its piece
    # EOS listed among the stop token ids too: still EOS's end, with no stop_reason (vLLM checks EOS first)
    final = engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[EOS],
                                                     logits_processors=[_EosAt(5)]), use_tqdm=False)[0].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason is None


def test_no_output_shows_text_that_a_stop_string_then_removes(stories, plain):
    model, tok = stories
    _, output, text = plain
    words = text.split(" ")
    stop = " " + words[3] + " " + words[4][:2]  # spans tokens, so its start is decoded steps before its end
    assert stop in text
    engine = PagedEngine(model, tok)
    for include in (False, True):
        seen = run_kinds(engine, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop],
                                                include_stop_str_in_output=include))
        final = seen[RequestOutputKind.FINAL_ONLY][0]
        want = text[: text.index(stop) + (len(stop) if include else 0)]
        assert final.text == want and final.stop_reason == stop
        assert "".join(d.text for d in seen[RequestOutputKind.DELTA]) == want
        assert all(want.startswith(c.text) for c in seen[RequestOutputKind.CUMULATIVE])
        assert "".join(engine.stream(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                            stop=[stop], include_stop_str_in_output=include))) == want
    engine.check_invariants()


def test_a_stop_string_counts_only_where_it_ends_after_min_tokens(stories, plain):
    model, tok = stories
    prompt_ids, output, text = plain
    first = output_text(tok, prompt_ids, output[:1]).strip()  # "we": the first token's text, found nowhere later
    assert text.count(first) == 1
    engine = PagedEngine(model, tok)

    def final(**params):
        return engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **params),
                               use_tqdm=False)[0].outputs[0]

    assert final(stop=[first]).finish_reason == "stop"
    assert final(stop=[first], min_tokens=1).finish_reason == "length"  # it ended in token 1: held back
    # nor found later beside a longer stop string, whose search reaches back further
    held = final(stop=[first, "z" * 30], min_tokens=3)
    assert held.finish_reason == "length" and held.text == output_text(tok, prompt_ids, output[:12])


def test_of_two_stop_strings_ending_in_one_step_the_first_to_end_wins(stories, plain):
    """vLLM's rule (it matters when a step adds several tokens, or one token several characters): the stop that
    completes earliest, the first listed on a tie."""
    model, tok = stories
    prompt_ids, output, text = plain
    pieces = [output_text(tok, prompt_ids, output[: i + 1])[len(output_text(tok, prompt_ids, output[:i])):]
              for i in range(len(output))]
    piece = next(p for p in pieces if p.startswith(" ") and len(p) >= 4 and text.count(p) == 1
                 and text.count(p[1:3]) == 1 and text.count(p[-2:]) == 1)  # " They": one token, one occurrence
    early, late = piece[1:3], piece  # both end in that one token's text; ``early`` ends first
    same_end = piece[-2:]  # ends where ``late`` ends
    engine = PagedEngine(model, tok)
    for stops, want in (([late, early], early), ([early, late], early), ([late, same_end], late),
                        ([same_end, late], same_end)):
        out = engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stops),
                              use_tqdm=False)[0].outputs[0]
        assert out.stop_reason == want and out.text == text[: text.index(want)], (stops, out.stop_reason)


def test_a_newline_stop_ends_the_output_at_its_byte_fallback_token(stories):
    """A Llama-2-style tokenizer writes a newline as the byte-fallback token ``<0x0A>``, whose text the detokenizer
    holds back while a byte run could go on: the stop string it completes is found at that token (vLLM emits a
    complete character at once), not one token later (an extra token after the stop) nor never (the newline as the
    last token max_tokens allows: a length finish whose text ended in the stop string)."""
    model, tok = stories
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    engine = PagedEngine(model, tok, block_size=16, num_blocks=64)
    free = engine.generate([prompt], SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    newline = tok.convert_tokens_to_ids("<0x0A>")
    at = free.token_ids.index(newline)  # the output's first newline
    want = free.text[: free.text.index("\n")]
    for max_tokens in (80, at + 1):
        for include in (False, True):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=["\n"],
                                    include_stop_str_in_output=include)
            out = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == free.token_ids[: at + 1], (max_tokens, len(out.token_ids), at + 1)
            assert (out.finish_reason, out.stop_reason) == ("stop", "\n")
            assert out.text == want + ("\n" if include else "")
            assert "".join(engine.stream(prompt, params)) == out.text
    engine.check_invariants()


def test_top_k_zero_is_off_as_in_vllm():
    assert SamplingParams(top_k=0).top_k == -1
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


def test_an_added_token_marked_special_is_named_by_its_piece():
    """Tokens a tokenizer adds as special without naming them among its special tokens (SmolLM2's <repo_name>,
    ...): decoding skips them, so their logprob name is their piece (as vLLM's), never an empty string."""
    from tokenizers import AddedToken

    from paged_hf.engine.detokenizer import Decoder
    from models import stories_tokenizer

    tok = stories_tokenizer()
    tok.add_tokens([AddedToken("<repo_name>", special=True)])
    token = tok.convert_tokens_to_ids("<repo_name>")
    assert token not in tok.all_special_ids and tok.decode([token], skip_special_tokens=True) == ""
    decoder = Decoder(tok)
    assert decoder.token_text(token) == "<repo_name>" and token in decoder.special_tokens
