"""A bad request fails alone: refused before it is queued when it can be seen to be bad (token ids, lengths, limits,
NaN), and isolated when its forward raises (the others go on with exactly the tokens of their solo runs)."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from paged_hf import PagedEngine, SamplingParams
from paged_hf.config import ParameterError
from models import stories_model, stories_tokenizer, story_openings, tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


def solo_tokens(stories, prompt, params=GREEDY) -> list[int]:
    """The greedy tokens of ``prompt`` run alone on a fresh engine."""
    model, tok = stories
    out = PagedEngine(model, tok, block_size=4, num_blocks=64).generate([prompt], params, use_tqdm=False)[0]
    assert out.error is None
    return out.outputs[0].token_ids


def assert_all_freed(engine: PagedEngine) -> None:
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
    assert not engine.requests


# -------------------------------------------------------------------------------------- refused up front
def test_out_of_vocabulary_ids_are_refused_and_the_rest_of_the_batch_completes(stories):
    """The issue's reproduction: ``generate(["Once upon a time", "The dog", [1, 999]])`` failed all three."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    with pytest.raises(ParameterError, match=r"must be in \[0, 512\) \(the model's vocabulary\), got 999") as info:
        engine.add_request([1, 999], GREEDY)
    assert info.value.param == "prompt" and not engine.requests
    with pytest.raises(ParameterError, match="the model's vocabulary"):  # generate checks every prompt first
        engine.generate(["Once upon a time", "The dog", [1, 999]], GREEDY, use_tqdm=False)
    assert not engine.requests
    outs = engine.generate(["Once upon a time", "The dog"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [solo_tokens(stories, p) for p in ("Once upon a time",
                                                                                       "The dog")]
    assert_all_freed(engine)


NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("prompt, params, param, message", [
    ([], {}, "prompt", "non-empty list of token ids"),
    ({"prompt_token_ids": []}, {}, "prompt", "prompt is empty"),
    ([1, -3], {}, "prompt", r"must be in \[0, 512\)"),
    ([1, 2.5], {}, "prompt", "non-empty list of token ids"),
    ({"prompt_token_ids": [1, 2.5]}, {}, "prompt", "must be ints"),
    ([1] * 64, {}, "prompt", "max_model_len=64 leaves no room"),
    ([1, 2], {"logprobs": 21}, "logprobs", r"at most 20 \(max_logprobs\)"),
    ([1, 2], {"prompt_logprobs": 21}, "prompt_logprobs", r"at most 20 \(max_logprobs\)"),
    ([1, 2], {"n": 9}, "n", r"at most 8 \(max_n\)"),
    ([1, 2], {"stop": [str(i) for i in range(5)]}, "stop", r"at most 4 are allowed \(max_stop_strings\)"),
    ([1, 2], {"logit_bias": {512: 1.0}}, "logit_bias", r"in \[0, 512\)"),
    ([1, 2], {"allowed_token_ids": [3, 512]}, "allowed_token_ids", r"in \[0, 512\)"),
    # fields that together rule out every token (the sampler's rules): a 400 before the request runs, not its failure
    ([1, 2], {"allowed_token_ids": [2], "min_tokens": 3}, "allowed_token_ids", "min_tokens=3 holds back"),  # EOS
    ([1, 2], {"allowed_token_ids": [7, 9], "stop_token_ids": [7, 9], "min_tokens": 1}, "allowed_token_ids",
     "holds back"),
    ([1, 2], {"allowed_token_ids": [400], "bad_words": ["x"]}, "allowed_token_ids", "one-token bad_words"),
])
def test_the_engine_refuses_what_it_cannot_run_naming_the_field(stories, prompt, params, param, message):
    model, tok = stories
    if params.get("bad_words") == ["x"]:  # a one-token word, and only it allowed
        word = tok.decode([400]).strip()
        assert tok.encode(word, add_special_tokens=False) == [400]
        params = {**params, "bad_words": [word]}
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64, max_model_len=64, max_n=8, max_stop_strings=4)
    with pytest.raises(ParameterError, match=message) as info:
        engine.add_request(prompt, SamplingParams(**params))
    assert info.value.param == param
    assert_all_freed(engine)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_past_the_vocabulary_are_refused_where_max_logprobs_allows_them(stories, field):
    """With ``max_logprobs`` above the vocabulary (512), k = 512 gives every token; k = 513 is a ``ParameterError``
    naming the field before the request is queued, not a ``topk`` error raised out of a step that strands it."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64, max_logprobs=1000)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1, **{field: 512}), use_tqdm=False)[0]
    entry = out.prompt_logprobs[1] if field == "prompt_logprobs" else out.outputs[0].logprobs[0]
    assert sorted(lp.rank for lp in entry.values()) == list(range(1, 513))
    with pytest.raises(ParameterError, match=r"at most 512 \(the model's vocabulary\), got 513") as info:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, **{field: 513}))
    assert info.value.param == field
    assert_all_freed(engine)


@pytest.mark.parametrize("field, value", [
    ("temperature", NAN), ("temperature", INF), ("top_p", NAN), ("min_p", NAN), ("presence_penalty", NAN),
    ("frequency_penalty", -INF), ("repetition_penalty", NAN), ("repetition_penalty", INF),
    ("repetition_penalty", 1e-40), ("repetition_penalty", 1e3), ("stop", 5),
    ("stop", [""]), ("stop_token_ids", 7), ("logit_bias", {3: 101}), ("logit_bias", {3: NAN}),
    ("logit_bias", {"3": 1}), ("logit_bias", [3]), ("seed", 2**63), ("seed", -2**63 - 1), ("ignore_eos", "no"), ("min_tokens", 17),
    ("logits_processors", [3]), ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", 5),
    ("bad_words", "dog"), ("bad_words", [" "]), ("bad_words", [3]), ("detokenize", 0),
])
def test_sampling_params_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(ParameterError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_logit_bias_steers_greedy_and_sampling(stories):
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    plain = solo_tokens(stories, "Once upon a time")
    target = next(t for t in range(100, 512) if t not in plain)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, logit_bias={target: 100})
        assert engine.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids == [target] * 6
    banned = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={plain[2]: -100})
    tokens = engine.generate(["Once upon a time"], banned, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[:2] == plain[:2] and plain[2] not in tokens
    assert_all_freed(engine)


def test_allowed_token_ids_restrict_greedy_and_sampling_to_them(stories):
    """vLLM's ``allowed_token_ids``: every drawn token is one of them, greedy and sampled draws are those of a
    logits processor that masks the others, and the other requests of the batch are unchanged."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    plain = solo_tokens(stories, "Once upon a time")
    allowed = [t for t in range(100, 140) if t not in plain][:5]

    def only_allowed(_, logits):
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[allowed] = True
        return logits.masked_fill(~keep, float("-inf"))

    options = [dict(temperature=0.0), dict(temperature=1.0, seed=3)]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, allowed_token_ids=allowed, **o) for o in options]
    oracle = [SamplingParams(max_tokens=8, ignore_eos=True, logits_processors=[only_allowed], **o) for o in options]
    outs = engine.generate(["Once upon a time"] * 5, params + oracle + [GREEDY], use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(set(t) <= set(allowed) for t in tokens[:2]) and len(set(tokens[0])) > 1
    assert tokens[:2] == tokens[2:4] and tokens[4] == plain
    assert_all_freed(engine)


def contains(tokens: list[int], run: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(run)]) == run for i in range(len(tokens) - len(run) + 1))


def test_bad_words_are_never_formed_and_change_nothing_before(stories):
    """vLLM's ``bad_words``: the output never forms a bad word's tokens (its last token is banned where the others
    end the output), and runs as it would without it up to the first place the word would complete."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    plain = solo_tokens(stories, "Once upon a time")
    words = {}  # word -> its tokens, for the output's words that are one run of its tokens
    for word in tok.decode(plain).split():
        ids = tuple(tok.encode(word, add_special_tokens=False))
        if word.isalpha() and contains(plain, ids):
            words.setdefault(len(ids) > 1, (word, ids))
    assert set(words) == {False, True}, words  # a one-token and a several-token word
    for word, ids in words.values():
        end = next(i for i in range(len(plain)) if tuple(plain[i - len(ids) + 1 : i + 1]) == ids)
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_tokens=12, temperature=temperature, seed=5, ignore_eos=True, bad_words=[word])
            tokens = engine.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
            assert not contains(tokens, ids), (word, tokens)
            if temperature == 0.0:
                assert tokens[:end] == plain[:end] and tokens[end] != plain[end]
    assert_all_freed(engine)


def test_bad_words_tokenized_for_other_words_are_tokenized_again(stories):
    """A front end tokenizes ``bad_words`` off the engine thread (``SamplingParams._bad_words_token_ids``); params
    whose words were replaced since hold stale sequences, and the engine tokenizes the words they hold now."""
    from paged_hf.engine.validation import bad_words_token_ids, tokenized_bad_words

    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64, enforce_eager=True)
    _, _, first = engine.check_request([1, 5], SamplingParams(bad_words=["dog"]))
    assert tokenized_bad_words(first) == bad_words_token_ids(("dog",), tok)
    _, _, second = engine.check_request([1, 5], dataclasses.replace(first, bad_words=["cat"]))
    assert tokenized_bad_words(second) == bad_words_token_ids(("cat",), tok) != tokenized_bad_words(first)


def test_detokenize_false_gives_token_ids_alone_and_negative_seeds_are_seeds(stories):
    """vLLM's ``detokenize=False``: the same tokens, no text, logprob entries unnamed; stop strings, which need the
    text, are refused by name. A negative seed (vLLM takes any int64) reproduces like any other, except -1: no seed,
    as vLLM's SamplingParams reads it (clients send seed=-1 for "random")."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    named, bare = engine.generate(["Once upon a time"] * 2, [params, dataclasses.replace(params, detokenize=False)],
                                  use_tqdm=False)
    assert bare.outputs[0].token_ids == named.outputs[0].token_ids and named.outputs[0].text
    assert bare.outputs[0].text == ""
    assert all(lp.decoded_token is None for entry in bare.outputs[0].logprobs for lp in entry.values())
    assert all(lp.decoded_token is None for entry in bare.prompt_logprobs[1:] for lp in entry.values())
    assert all(lp.decoded_token for entry in named.outputs[0].logprobs for lp in entry.values())
    with pytest.raises(ParameterError, match="stop strings need the output's text") as info:
        SamplingParams(stop=["x"], detokenize=False)
    assert info.value.param == "stop"
    sampled = [SamplingParams(max_tokens=8, temperature=1.0, seed=seed) for seed in (-2, -2, -2**63)]
    runs = [o.outputs[0].token_ids for o in engine.generate(["Once upon a time"] * 3, sampled, use_tqdm=False)]
    assert runs[0] == runs[1] != runs[2]
    unseeded = SamplingParams(max_tokens=8, temperature=1.0, seed=-1)
    assert unseeded.seed is None
    torch.manual_seed(0)
    runs = [o.outputs[0].token_ids for o in engine.generate(["Once upon a time"] * 4, unseeded, use_tqdm=False)]
    assert len(set(map(tuple, runs))) > 1, "seed=-1 draws like no seed"
    assert_all_freed(engine)


def test_a_tiny_temperature_samples_the_best_token_and_nan_logits_fail_their_request_alone(stories):
    """``temperature=1e-45`` passes validation (positive, finite) but overflowed the tempered logits to inf: the
    softmax gave NaN and ``torch.multinomial`` raised for the whole batch, killing the server's engine loop (found
    by tests/test_server_fuzz.py). It now draws the greedy token; a request whose logits processor returns NaN
    fails alone with a ValueError while a sampled and a greedy request beside it complete."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    plain = solo_tokens(stories, "Once upon a time")
    tiny = SamplingParams(max_tokens=12, temperature=1e-45, seed=1, ignore_eos=True)
    assert engine.generate(["Once upon a time"], tiny, use_tqdm=False)[0].outputs[0].token_ids == plain

    def poison(_tokens, logits):
        return logits * math.nan

    bad = SamplingParams(max_tokens=12, temperature=1.0, logits_processors=[poison])
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True)
    outs = engine.generate(["Once upon a time", "The dog", "Once upon a time"], [bad, sampled, GREEDY],
                           use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "NaN or inf" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) == 12 and outs[1].error is None
    assert outs[2].outputs[0].token_ids == plain
    # greedy too (an argmax of NaN would be token 0, silently), on the batch's fast path and beside sampled rows
    greedy_bad = SamplingParams(max_tokens=12, temperature=0.0, logits_processors=[poison])
    for batch in ([greedy_bad, GREEDY], [greedy_bad, sampled, GREEDY]):
        outs = engine.generate(["Once upon a time"] * len(batch), batch, use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "error" and "not finite" in outs[0].error
        assert outs[-1].outputs[0].token_ids == plain
    assert_all_freed(engine)


# ---------------------------------------------------------------------------------- isolated at run time
@contextlib.contextmanager
def poisoned(model, poison: int):
    """The model's forward raises whenever ``poison`` is among its input ids (a stand-in for a request that makes a
    forward fail: a kernel fault on its shapes, a bad adapter, ...)."""
    def hook(module, args):
        if (args[0] == poison).any():
            raise RuntimeError(f"poisoned input: token {poison}")

    handle = model.get_input_embeddings().register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def pick_poison(references) -> int:
    seen = {t for ref in references for t in ref}
    return next(t for t in range(300, 512) if t not in seen)


@pytest.mark.parametrize("options", [
    {"block_size": 4},
    {"block_size": 4, "max_num_batched_tokens": 7},  # the poisoned prompt's chunk fails in a later step
    {"block_size": 4, "enable_prefix_caching": False, "max_num_seqs": 3},
], ids=["one_step", "chunked", "no_prefix_cache"])
def test_a_forward_that_raises_for_one_request_fails_it_alone(stories, options):
    model, tok = stories
    good = story_openings()[:4]
    references = [solo_tokens(stories, p) for p in good]
    poison = pick_poison(references)
    bad_prompt = tok(good[0])["input_ids"] + [poison] + tok("and the sun")["input_ids"][1:]
    engine = PagedEngine(model, tok, num_blocks=64, **options)
    with poisoned(model, poison):
        outs = engine.generate(good[:2] + [bad_prompt] + good[2:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2] + outs[3:]] == references
    assert outs[2].outputs[0].finish_reason == "error" and f"poisoned input: token {poison}" in outs[2].error
    assert_all_freed(engine)


def test_a_request_that_fails_in_decode_fails_alone(stories):
    """The culprit's prompt is fine; the token it samples (forced by its logit_bias) makes its next forward raise,
    in the middle of everyone's decodes."""
    model, tok = stories
    good = story_openings()[:4]
    references = [solo_tokens(stories, p) for p in good]
    poison = pick_poison(references)
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    doomed = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={poison: 100})
    with poisoned(model, poison):
        outs = engine.generate(good + [good[1]], [GREEDY] * 4 + [doomed], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:4]] == references
    assert outs[4].outputs[0].finish_reason == "error" and outs[4].outputs[0].token_ids == [poison]
    assert_all_freed(engine)


def test_a_request_whose_sampling_fails_in_decode_leaves_the_seeded_draws_of_the_others_as_alone(stories):
    """A logits processor raising in a steady decode step fails its request; the step's other rows keep the draw
    they made beside it: a seeded request's tokens are those of its solo run, and a processor of a surviving row
    sees each position once."""
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = solo_tokens(stories, story_openings()[0], seeded)
    calls = []

    def counting(output_ids, logits):
        calls.append(len(output_ids))
        return logits

    def failing(output_ids, logits):
        if len(output_ids) == 3:
            raise RuntimeError("this processor fails at the 4th token")
        return logits

    model, tok = stories
    params = [dataclasses.replace(seeded, logits_processors=[counting]),
              dataclasses.replace(seeded, seed=None, logits_processors=[failing])]
    outs = PagedEngine(model, tok, block_size=4, num_blocks=64).generate(story_openings()[:2], params,
                                                                          use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and "fails at the 4th token" in outs[1].error
    assert outs[0].outputs[0].token_ids == alone
    assert calls == list(range(12)), "one call per position, the failing step's included"


def test_prompt_logprobs_over_nan_logits_fail_their_request_alone(stories):
    """A model whose logits turn NaN at a prompt position (here the last kept row of the prefill step, one of the
    scoring request's prompt rows): that request fails with an error naming its prompt positions instead of
    handing NaN logprobs out (JSON cannot carry them), draws no token, and the request beside it is its solo run."""
    model, tok = stories
    scoring = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=3, temperature=0.0)
    alone = solo_tokens(stories, story_openings()[1], plain)

    def poison(module, args, out):
        if out.shape[1] > 2:  # the prefill step: the ends of both prompts, then the scoring prompt's rows
            out = out.clone()
            out[0, -1] = float("nan")
        return out

    handle = model.lm_head.register_forward_hook(poison)
    try:
        engine = PagedEngine(model, tok, block_size=4, num_blocks=64, enforce_eager=True)
        outs = engine.generate(story_openings()[:2], [scoring, plain], use_tqdm=False)
    finally:
        handle.remove()
    assert outs[0].outputs[0].finish_reason == "error" and "hold NaN or +inf" in outs[0].error
    assert outs[0].outputs[0].token_ids == [] and not any(outs[0].prompt_logprobs or ())  # no entry handed out
    assert outs[1].error is None and outs[1].outputs[0].token_ids == alone
    assert_all_freed(engine)


def test_a_request_reading_the_prefix_a_failing_request_writes_in_the_same_step_computes_it_again(stories):
    """Admitted in one step, ``reader`` hits the prefix blocks ``writer`` fills in that very forward. The writer's
    forward raises, so those blocks never get their K/V: the reader must not read them, and gets its solo tokens."""
    model, tok = stories
    prefix = tok(story_openings()[0])["input_ids"][:8]  # two blocks of 4
    reader = prefix + tok("a big dog")["input_ids"][1:]
    bystander = story_openings()[3]
    references = [solo_tokens(stories, p) for p in (reader, bystander)]
    poison = pick_poison(references)
    writer = prefix + [poison] + tok("went to the park")["input_ids"][1:]
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    with poisoned(model, poison):
        ids = [engine.add_request(p, GREEDY) for p in (writer, reader, bystander)]
        done = {o.request_id: o for o in engine.step() if o.finished}
        assert engine.requests[ids[1]].metrics.num_prefix_cached_tokens == 8, "the reader hit the writer's blocks"
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "poisoned" in done[ids[0]].error
    assert [done[i].outputs[0].token_ids for i in ids[1:]] == references
    assert_all_freed(engine)


def test_a_hybrid_reader_of_a_full_block_a_failing_request_writes_in_the_same_step_computes_it_again():
    """Gemma2 (sliding window of 6 first, then full): the reader's sliding group hits older cached blocks while its
    full group hits the block the failing writer fills this step. ``y`` leaves its prefix cached (the window freed its
    first blocks early, the full group frees its last blocks first), ``z`` then evicts two blocks of each pool: the
    full group loses block 5, the sliding group blocks 0 and 1. So ``writer`` computes block 5 again, registered in
    the full pool only (the sliding pool still holds ``y``'s), and ``reader``, admitted in the same step, hits 24
    tokens through it: it must not read that block of the failed writer, and gets its solo tokens and logprobs."""
    model = tiny_model("gemma2")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    generator = torch.Generator().manual_seed(0)
    prefix, y_tail, z, r_tail = (torch.randint(3, 300, (n,), generator=generator).tolist() for n in (24, 1, 41, 3))
    poison = 400
    reader, writer = prefix + r_tail, prefix + [poison]

    def fresh() -> PagedEngine:
        return PagedEngine(model, None, block_size=4, num_blocks=16, max_num_batched_tokens=8, enforce_eager=True)

    solo = fresh().generate([reader], params, use_tqdm=False)[0].outputs[0]
    engine = fresh()
    engine.generate([prefix + y_tail], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    engine.generate([z], SamplingParams(max_tokens=1), use_tqdm=False)
    with poisoned(model, poison):
        ids = [engine.add_request(p, params) for p in (writer, reader)]
        done = {o.request_id: o for o in engine.step() if o.finished}
        assert engine.requests[ids[1]].metrics.num_prefix_cached_tokens == 24, "the reader hit the writer's block"
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "poisoned" in done[ids[0]].error
    out = done[ids[1]].outputs[0]
    assert out.token_ids == solo.token_ids
    assert [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(
        [lp[t].logprob for lp, t in zip(solo.logprobs, solo.token_ids)], abs=2e-5)
    assert_all_freed(engine)


def test_the_isolated_failure_is_logged(stories, caplog):
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    poison = pick_poison([])
    with poisoned(model, poison), caplog.at_level("WARNING", logger="paged_hf"):
        engine.generate(["Once upon a time", [1, poison, 5]], GREEDY, use_tqdm=False)
    messages = [r.getMessage() for r in caplog.records if r.name == "paged_hf"]
    assert any("running them in parts" in m for m in messages)
    assert any(m.startswith("request ") and "poisoned input" in m for m in messages)
    assert any("isolated 1 failing sequence(s)" in m for m in messages)
    assert_all_freed(engine)


def logprob_table(entries) -> list[dict[int, float]]:
    """{token id: logprob} per position (None positions dropped): the one place reading the entries' format."""
    return [{t: lp.logprob for t, lp in entry.items()} for entry in entries if entry is not None]


def test_the_survivors_of_an_isolated_step_keep_their_logprobs_and_prompt_logprobs(stories):
    """The merged rows of the sub-batches (sampled rows and prompt-logprob rows) land on the right requests."""
    model, tok = stories
    good = story_openings()[:3]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    solo = [PagedEngine(model, tok, block_size=4, num_blocks=64).generate([p], params, use_tqdm=False)[0]
            for p in good]
    poison = pick_poison([o.outputs[0].token_ids for o in solo])
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    with poisoned(model, poison):
        outs = engine.generate([good[0], [1, poison, 7, 9], good[1], good[2]], params, use_tqdm=False)
    assert "poisoned" in outs[1].error
    for out, ref in zip(outs[:1] + outs[2:], solo):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for got, want in zip(logprob_table(out.outputs[0].logprobs) + logprob_table(out.prompt_logprobs),
                             logprob_table(ref.outputs[0].logprobs) + logprob_table(ref.prompt_logprobs)):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=2e-5)
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert_all_freed(engine)


@contextlib.contextmanager
def poisoned_late(model, poison: int):
    """Like ``poisoned``, but the forward raises in its last decoder layer: the layers before it have stored their
    K/V (and, for int4, written their tail rows) when it fails."""
    seen = {"poison": False}

    def note(module, args):
        seen["poison"] = bool((args[0] == poison).any())

    def fail(module, *args, **kwargs):
        if seen["poison"]:
            raise RuntimeError(f"poisoned input: token {poison}")

    handles = [model.get_input_embeddings().register_forward_pre_hook(note),
               model.model.layers[-1].register_forward_pre_hook(fail)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def test_an_int4_chunk_that_refills_its_tail_row_computes_again_after_a_failed_step(stories):
    """int4: a prompt chunk that starts inside a block (its older tokens in the tail row) and leaves tokens in a later
    block writes that tail row after each layer's attention. When the step fails in its last layer, the earlier
    layers' tail rows already hold the new tokens, so a retry would quantize the block from them: the sequence
    computes its tokens again instead, and ends with its solo tokens and logprobs."""
    model, tok = stories
    options = dict(block_size=4, num_blocks=64, kv_cache_dtype="int4", max_num_batched_tokens=9)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    long_prompt = story_openings()[2]
    solo = PagedEngine(model, tok, **options).generate([long_prompt], params, use_tqdm=False)[0].outputs[0]
    poison = pick_poison([solo.token_ids])
    doomed = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={poison: 100})
    engine = PagedEngine(model, tok, **options)
    with poisoned_late(model, poison):
        ids = [engine.add_request("Once upon", doomed), engine.add_request(long_prompt, params)]
        first = engine.step()  # the doomed prefill (3 tokens) + the long prompt's tokens 0..5: a tail of 2
        assert not any(o.finished for o in first)
        done = {}
        while engine.has_unfinished_requests():  # the doomed decode fails beside the chunk 6..13 (tail rewritten)
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "poisoned" in done[ids[0]].error
    got = done[ids[1]].outputs[0]
    assert got.token_ids == solo.token_ids
    got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
    want_lp = [step[t].logprob for step, t in zip(solo.logprobs, solo.token_ids)]
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-3, (got_lp, want_lp)
    assert_all_freed(engine)
