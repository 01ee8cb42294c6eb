"""Structured outputs in the engine: every output matches its JSON schema, regex, choice, grammar or structural tag.

A random-weights tiny Llama with the stories260K tokenizer draws from nearly flat distributions, so it explores the
grammar far more than a trained model would. Checked: every finished output parses and validates (``jsonschema``)
for generated schemas; regex and choice outputs match; the unconstrained rows of a batch are token-exact with the
same batch without constrained rows; ``n > 1``, preemption by recompute and streaming; logprobs are the masked
distribution's (a plain forward's ``log_softmax`` over the allowed tokens); a request whose grammar is compiling
holds up no other; bad specs raise ``ParameterError`` naming ``structured_outputs``.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from paged_hf import PagedEngine, SamplingParams, StructuredOutputsParams
from paged_hf.config import ParameterError
from models import stories_tokenizer, tiny_model
from structured_schemas import json_schemas

xgr = pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'paged_hf[structured]')")

PROMPTS = ["Once upon a time", "The cat", "Tom and Sue went", "A big red ball"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 2}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", attn_implementation="paged"), stories_tokenizer()


def make_engine(tiny, **options) -> PagedEngine:
    model, tok = tiny
    return PagedEngine(model, tok, **{"block_size": 8, "num_blocks": 256, "enforce_eager": True, **options})


@pytest.fixture(scope="module")
def engine(tiny):
    return make_engine(tiny)


def constrained(max_tokens: int = 120, temperature: float = 1.0, seed: int | None = 0, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(**spec))


def assert_valid_json(completion, schema: dict) -> None:
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    jsonschema.validate(json.loads(completion.text), schema)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=json_schemas())
def test_every_output_validates_against_its_generated_schema(engine, schema):
    """Bounded schemas, so an output cut off by max_tokens is rare; it must then be exactly max_tokens long."""
    params = [constrained(max_tokens=200, seed=i, json=schema, disable_any_whitespace=True)
              for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        assert out.error is None
        if out.outputs[0].finish_reason == "length":
            assert len(out.outputs[0].token_ids) == 200
        else:
            assert_valid_json(out.outputs[0], schema)
    assert any(out.outputs[0].finish_reason == "stop" for out in outs)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


def test_free_whitespace_outputs_validate_and_a_cut_off_one_says_length(engine):
    """With any whitespace allowed (the default) the random model may ramble in whitespace: an output cut off by
    max_tokens says "length"; every "stop" is valid JSON."""
    outs = engine.generate(PROMPTS * 2, [constrained(max_tokens=60, seed=i, json=PERSON) for i in range(8)],
                           use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert "stop" in reasons
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            assert_valid_json(out.outputs[0], PERSON)
        else:
            assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 60


def test_max_tokens_mid_object_is_length_not_stop(engine):
    out = engine.generate(PROMPTS[0], constrained(max_tokens=4, json=PERSON, disable_any_whitespace=True),
                          use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_regex_choice_grammar_and_json_object(engine):
    regex = r"[a-c]{2,4}-\d{1,3}"
    choices = ["yes", "no", 'a "quoted" one', "üñï"]
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    cases = [(dict(regex=regex), lambda t: re.fullmatch(regex, t)), (dict(choice=choices), lambda t: t in choices),
             (dict(grammar=grammar), lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
             (dict(json_object=True), lambda t: isinstance(json.loads(t), dict))]
    for spec, check in cases:
        for temperature in (0.0, 1.0):
            for out in engine.generate(PROMPTS, [constrained(max_tokens=200, temperature=temperature, seed=i, **spec)
                                                 for i in range(4)], use_tqdm=False):
                text = out.outputs[0].text
                if out.outputs[0].finish_reason == "stop":
                    assert check(text), (spec, text)
                else:  # only json_object is unbounded
                    assert "json_object" in spec and out.outputs[0].finish_reason == "length"


# a structural tag: a fixed opening, then a JSON value held to PERSON, then free text
GREETING_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "Person: "}, {"type": "json_schema", "json_schema": PERSON},
    {"type": "const_string", "value": "."}]}}
# vLLM's older form: free text; after "<p>" a JSON value held to PERSON, closed by "</p>"; then free text again
LEGACY_TAG = {"structures": [{"begin": "<p>", "schema": PERSON, "end": "</p>"}], "triggers": ["<p>"]}


def test_structural_tags_hold_their_parts_in_both_forms(engine):
    for spec in (dict(structural_tag=GREETING_TAG), dict(structural_tag=json.dumps(GREETING_TAG))):
        for out in engine.generate(PROMPTS, [constrained(max_tokens=200, seed=i, **spec) for i in range(4)],
                                   use_tqdm=False):
            completion = out.outputs[0]
            assert completion.finish_reason == "stop", completion.text
            assert completion.text.startswith("Person: ") and completion.text.endswith("."), completion.text
            jsonschema.validate(json.loads(completion.text[len("Person: "):-1]), PERSON)
    # the older form's JSON is checked where the trigger opens it: a matcher of the compiled tag
    compiled = engine.grammars.compile(StructuredOutputsParams(structural_tag=LEGACY_TAG))
    for text, accepted in [('free text <p>{"name": "Ann", "age": 3}</p> more', True),
                           ('<p>{"name": "ann", "age": 3}', False), ('<p>{"age": 3}</p>', False),
                           ("no trigger at all", True)]:
        assert xgr.GrammarMatcher(compiled).accept_string(text) is accepted, text


def test_json_object_is_an_object_never_an_array():
    """OpenAI's ``{"type": "json_object"}`` promises an object, and vLLM compiles the schema ``{"type": "object"}``:
    an array (which xgrammar's built-in JSON grammar admits) is refused from its first character."""
    from xgrammar.testing import _is_grammar_accept_string as accepts
    from paged_hf.structured.grammar import build_grammar

    grammar = build_grammar(StructuredOutputsParams(json_object=True))
    assert accepts(grammar, '{"a": [1, {"b": null}]}') and accepts(grammar, "{}")
    assert not accepts(grammar, "[1, 2]") and not accepts(grammar, '"text"')
    tight = build_grammar(StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    assert accepts(tight, '{"a": 1}') and not accepts(tight, '{ "a": 1 }')  # one space after ':' and ',' only


def test_unconstrained_rows_are_token_exact_beside_constrained_ones(tiny):
    plain = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=1.0, seed=3),
             SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=4, logprobs=2)]
    alone = make_engine(tiny).generate(PROMPTS[:3], plain, use_tqdm=False)
    mixed_params = plain + [constrained(json=PERSON, seed=5), constrained(regex=r"\d{3}", temperature=0.0)]
    mixed = make_engine(tiny).generate(PROMPTS[:3] + PROMPTS[:2], mixed_params, use_tqdm=False)
    for a, m in zip(alone, mixed[:3]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs or [], m.outputs[0].logprobs or []):  # the forward may round apart
            assert x.keys() == y.keys()
            assert [e.logprob for e in x.values()] == pytest.approx([e.logprob for e in y.values()], abs=2e-5)
    assert mixed[2].outputs[0].logprobs is not None
    assert re.fullmatch(r"\d{3}", mixed[4].outputs[0].text)


def test_n_samples_each_follow_the_grammar(engine):
    out = engine.generate(PROMPTS[1], SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=1,
                                                     structured_outputs=StructuredOutputsParams(
                                                         json=PERSON, disable_any_whitespace=True)),
                          use_tqdm=False)[0]
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    for completion in out.outputs:
        assert_valid_json(completion, PERSON)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_each_matcher_in_step(tiny, mode):
    """Preempted sequences (recomputed or swapped) keep their tokens and so their matchers: the outputs equal a
    roomy pool's; run again, the prompts hit the prefix cache and give the same outputs."""
    params = [constrained(max_tokens=60, seed=i, json=PERSON, disable_any_whitespace=True) for i in range(4)] + \
             [constrained(max_tokens=40, seed=9, regex=r"[a-z ]{10,40}")]
    prompts = PROMPTS + ["Lily had a"]
    roomy = make_engine(tiny).generate(prompts, params, use_tqdm=False)
    tight = make_engine(tiny, block_size=4, num_blocks=24, preemption_mode=mode, max_num_seqs=5, swap_space=0.001)
    cramped = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.get_stats()
    assert stats["preemption_count"] > 0 and (stats["num_swapped_out"] > 0) == (mode == "swap")
    assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]
    again = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_stats()["prefix_cache_hit_rate"] > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in roomy]
    for out in cramped[:4]:
        assert_valid_json(out.outputs[0], PERSON)
    tight.check_invariants()


def test_streamed_deltas_add_up_to_valid_json(engine):
    params = constrained(seed=2, json=PERSON, disable_any_whitespace=True)
    text = "".join(engine.stream(PROMPTS[2], params))
    jsonschema.validate(json.loads(text), PERSON)
    assert text == engine.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0].text


def test_logprobs_are_those_of_the_masked_distribution(engine, tiny):
    model, tok = tiny
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=60, temperature=1.0, seed=7, logprobs=3,
                                                     structured_outputs=spec), use_tqdm=False)[0]
    completion, prompt_ids = out.outputs[0], out.prompt_token_ids
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + completion.token_ids])).logits[0].double()
    finally:
        model.set_attn_implementation("paged")
    compiled = engine.grammars.compile(spec)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
    for i, token in enumerate(completion.token_ids):
        row = logits[len(prompt_ids) - 1 + i].float().clone().unsqueeze(0)
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(row, bitmask)
        expected = torch.log_softmax(row[0].double(), dim=-1)
        entry = completion.logprobs[i]
        for tid, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[tid].item(), abs=2e-5)
        assert matcher.accept_token(token)


def test_ignore_eos_still_ends_where_the_grammar_ends(engine):
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0,
                                                     structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                          use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_min_tokens_yields_to_a_complete_value_as_vllm(engine):
    """Once the value is complete only the end token may follow; ``min_tokens`` would hold it back: the constraint
    wins (vLLM's outcome), the output ends there, valid, never a failed request."""
    choice = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, min_tokens=5,
                                                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                             use_tqdm=False)[0].outputs[0]
    assert (choice.finish_reason, choice.text in ("yes", "no")) == ("stop", True), (choice.finish_reason, choice.text)
    person = engine.generate(PROMPTS[1], SamplingParams(max_tokens=120, temperature=1.0, seed=2, min_tokens=100,
                                                        structured_outputs=StructuredOutputsParams(json=PERSON)),
                             use_tqdm=False)[0].outputs[0]
    assert person.finish_reason in ("stop", "length")
    if person.finish_reason == "stop":
        jsonschema.validate(json.loads(person.text), PERSON)


def test_stop_token_ids_end_an_output_only_where_its_grammar_can_end(engine):
    """A request's ``stop_token_ids`` are the grammar's stop tokens too (vLLM's rule): a token that would stop the
    output in the middle of a value is masked there, so a "stop" output is a complete value."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    first = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=choice),
                            use_tqdm=False)[0].outputs[0]
    stopper = first.token_ids[0]  # the value's first token: a stop token now
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=choice,
                                                     stop_token_ids=[stopper]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no"), (out.text, out.token_ids)
    assert stopper not in out.token_ids[:-1]


def test_a_compiling_grammar_holds_up_no_other_request(tiny, monkeypatch):
    engine = make_engine(tiny)
    release = threading.Event()
    compile_now = engine.grammars._compile

    def slow_compile(grammar, kind):
        release.wait(30)
        return compile_now(grammar, kind)

    monkeypatch.setattr(engine.grammars, "_compile", slow_compile)
    slow = engine.add_request(PROMPTS[0], constrained(json=PERSON, disable_any_whitespace=True))
    fast = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0))
    finished = set()
    for _ in range(100):
        finished |= {o.request_id for o in engine.step() if o.finished}
        if fast in finished:
            break
    assert fast in finished and slow not in finished
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == slow and out.finished:
                assert_valid_json(out.outputs[0], PERSON)
                finished.add(slow)
    assert slow in finished
    engine.check_invariants()


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(tiny, monkeypatch):
    """A compilation that fails after the request was queued fails that request (its output says why)."""
    from paged_hf.structured import GrammarError

    engine = make_engine(tiny)
    release = threading.Event()

    def broken(grammar, kind):
        release.wait(30)
        raise GrammarError(kind, "out of memory (planted)")

    monkeypatch.setattr(engine.grammars, "_compile", broken)
    doomed = engine.add_request(PROMPTS[0], constrained(regex="a+"))
    fine = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=5))
    release.set()
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[doomed].outputs[0].finish_reason == "error" and "planted" in finals[doomed].error
    assert finals[fine].outputs[0].finish_reason == "length"
    monkeypatch.undo()  # the failure was not cached: the next request compiles again
    assert re.fullmatch("a+", engine.generate(PROMPTS[0], constrained(regex="a+", max_tokens=5),
                                              use_tqdm=False)[0].outputs[0].text)
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0


def test_an_aborted_compiling_request_leaves_nothing(tiny, monkeypatch):
    engine = make_engine(tiny)
    release = threading.Event()
    compile_now = engine.grammars._compile
    monkeypatch.setattr(engine.grammars, "_compile", lambda g, k: (release.wait(30), compile_now(g, k))[1])
    request_id = engine.add_request(PROMPTS[0], constrained(regex="[ab]+"))
    engine.step()
    engine.abort(request_id)
    release.set()
    for _ in range(5):
        assert engine.step() == []
    assert not engine.has_unfinished_requests()
    engine.check_invariants()


@pytest.mark.parametrize("spec, message", [
    (dict(), "exactly one of"),
    (dict(json={"type": "object"}, regex="a"), "exactly one of"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1]), "structured_outputs.json must be a JSON schema"),
    (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(choice=["a", 1]), "structured_outputs.choice must be a non-empty list"),
    (dict(json_object="yes"), "structured_outputs.json_object must be a bool"),
    (dict(regex="a", disable_any_whitespace=True), "applies to json and json_object only"),
    (dict(structural_tag="{not json"), "structured_outputs.structural_tag is not valid JSON"),
    (dict(structural_tag=["<a>"]), "structured_outputs.structural_tag must be a structural tag (a JSON object)"),
])
def test_bad_specs_name_the_field(spec, message):
    with pytest.raises(ParameterError, match=re.escape(message)) as error:
        StructuredOutputsParams(**spec)
    assert error.value.param == "structured_outputs"


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "foo"}), 'Unsupported type "foo"'),
    (dict(regex="a("), "parenthesis is not closed"),
    (dict(grammar="root ::= missing"), 'Rule "missing" is not defined'),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "Format type not recognized"),
    (dict(structural_tag={"structures": "<a>", "triggers": ["<a>"]}), 'needs a list of {"begin", "schema", "end"}'),
])
def test_specs_the_backend_cannot_compile_are_refused_when_added(engine, spec, message):
    with pytest.raises(ParameterError, match=re.escape(message)) as error:
        engine.add_request("x", constrained(**spec))
    assert error.value.param == "structured_outputs" and f"structured_outputs.{next(iter(spec))}" in str(error.value)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ParameterError, match="structured_outputs must be a paged_hf.StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_equal_specs_share_one_compilation(engine):
    a = engine.grammars.submit(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = engine.grammars.submit(StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, '
                                                            '"type": "object"}'))
    assert a is b
    # but properties in another order are another grammar: they come out in their schema's order
    ab = {"type": "object", "properties": {"a": {"type": "integer", "enum": [1]}, "b": {"type": "integer", "enum": [2]}},
          "required": ["a", "b"]}
    ba = {**ab, "properties": dict(reversed(ab["properties"].items()))}
    assert StructuredOutputsParams(json=ab).key != StructuredOutputsParams(json=ba).key
    for schema in (ab, ba, ab):
        out = engine.generate(PROMPTS[0], constrained(40, 0.0, json=schema, disable_any_whitespace=True),
                              use_tqdm=False)[0].outputs[0]
        assert list(json.loads(out.text)) == list(schema["properties"]), out.text


@pytest.mark.xfail(strict=True, reason="xgrammar 0.2.9: a string with maxLength admits raw control characters, "
                                       "which JSON forbids (its length-bounded rule uses [^\"\\\\\\r\\n])")
def test_backend_length_bounded_strings_exclude_control_characters(engine):
    compiled = engine.grammars.compile(StructuredOutputsParams(json={"type": "string", "maxLength": 4}))
    assert not xgr.GrammarMatcher(compiled).accept_string('"\x12')


def test_llm_takes_the_same_sampling_params(tiny):
    from paged_hf import LLM

    model, tok = tiny
    llm = LLM(model, tok, block_size=8, num_blocks=128, enforce_eager=True)
    outs = llm.generate(PROMPTS[:2], constrained(seed=3, json=PERSON, disable_any_whitespace=True), use_tqdm=False)
    for out in outs:
        assert_valid_json(out.outputs[0], PERSON)


def test_constrained_requests_never_speculate_beside_ones_that_do(tiny):
    """With n-gram speculation on, a constrained request decodes one masked token a step (its drafts would be
    verified without the grammar), so its output still matches, while a plain request beside it speculates."""
    engine = make_engine(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                                                   "auto_disable": False})
    repeating = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
    regex = r"(ab){2,6}c"
    outs = engine.generate([repeating, repeating],
                           [SamplingParams(max_tokens=40, temperature=0.0),
                            constrained(max_tokens=40, temperature=0.0, regex=regex)], use_tqdm=False)
    assert re.fullmatch(regex, outs[1].outputs[0].text), outs[1].outputs[0].text
    assert engine.get_stats().spec_decode_num_drafts > 0  # the plain request did speculate
    engine.check_invariants()
