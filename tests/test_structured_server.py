"""Structured outputs through the OpenAI-compatible server: ``response_format`` (json_object, json_schema), vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and ``structured_outputs``; streamed
and not; every finished output validates, a greedy one equals ``PagedEngine.generate``'s, and a spec that cannot
be used is a 400 naming its field. A random-weights tiny Llama (stories260K's tokenizer, a plain chat template)
explores each grammar more than a trained model would."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'paged_hf[server]')")
httpx = pytest.importorskip("httpx", reason="the tests send raw requests")
pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'paged_hf[structured]')")
jsonschema = pytest.importorskip("jsonschema", reason="outputs are validated with jsonschema")

from paged_hf import PagedEngine, SamplingParams, StructuredOutputsParams  # noqa: E402
from models import stories_tokenizer, tiny_model  # noqa: E402
from structured_schemas import json_schemas  # noqa: E402
from test_server import CHAT_TEMPLATE, serving  # noqa: E402
from test_server_errors import assert_error  # noqa: E402

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
ENGINE_OPTIONS = dict(block_size=8, num_blocks=512, max_num_seqs=16, enforce_eager=True)


@pytest.fixture(scope="module")
def tiny():
    tok = stories_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tiny_model("llama", attn_implementation="paged"), tok


@pytest.fixture(scope="module")
def server(tiny):
    with serving(tiny, 16, **ENGINE_OPTIONS) as served:
        yield served


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server[0].url + path, json=body, timeout=120)


def texts(response: httpx.Response, chat: bool) -> list[tuple[str, str]]:
    assert response.status_code == 200, response.text
    return [(c["message"]["content"] if chat else c["text"], c["finish_reason"]) for c in response.json()["choices"]]


def assert_all_valid(outputs: list[tuple[str, str]], schema: dict) -> None:
    """Every finished output validates; at least one of them finished, so the check is never vacuous (a sampled
    output of random weights may run to ``length`` inside a long string, so the count is over all of them)."""
    assert any(reason == "stop" for _, reason in outputs), outputs
    for text, reason in outputs:
        assert reason in ("stop", "length"), reason
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=json_schemas())
def test_every_output_validates_through_response_format_and_guided_json(server, schema):
    chat = post(server, CHAT, {"messages": MESSAGES, "max_tokens": 200, "temperature": 1.0, "seed": 1, "n": 3,
                               "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "thing", "schema": schema}}})
    completion = post(server, COMPLETIONS, {"prompt": ["Once upon", "The dog"], "max_tokens": 200, "seed": 2, "n": 2,
                                            "temperature": 1.0, "guided_json": json.dumps(schema),
                                            "guided_decoding_backend": "xgrammar"})
    assert_all_valid(texts(chat, chat=True) + texts(completion, chat=False), schema)


def test_a_greedy_guided_completion_equals_the_engine(server, tiny):
    model, tok = tiny
    body = {"prompt": "Once upon a time", "max_tokens": 80, "temperature": 0.0}
    got = texts(post(server, COMPLETIONS, {**body, "guided_json": PERSON}), chat=False)[0]
    engine = PagedEngine(model, tok, **ENGINE_OPTIONS)
    want = engine.generate("Once upon a time", SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=
                                                              StructuredOutputsParams(json=PERSON)), use_tqdm=False)
    assert got == (want[0].outputs[0].text, want[0].outputs[0].finish_reason)


def test_regex_choice_grammar_json_object_and_structured_outputs(server):
    grammar = 'root ::= "(" [1-9] ("+" [1-9])* ")"'
    cases = [({"guided_regex": r"[a-c]{2,4}-\d{1,3}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-\d{1,3}", t)),
             ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"guided_grammar": grammar}, lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
             ({"structured_outputs": {"regex": r"\d{4}"}}, lambda t: re.fullmatch(r"\d{4}", t)),
             ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict))]
    for extra, check in cases:
        chat = "response_format" in extra
        body = {"messages": MESSAGES} if chat else {"prompt": "Once upon a time"}
        outputs = texts(post(server, CHAT if chat else COMPLETIONS,
                             {**body, "max_tokens": 120, "n": 3, "temperature": 1.0, "seed": 3, **extra}), chat)
        for text, reason in outputs:
            assert reason in ("stop", "length") and (reason == "length" or check(text)), (extra, text)
        assert any(reason == "stop" for _, reason in outputs), (extra, outputs)


def test_a_streamed_guided_output_adds_up_to_valid_json(server):
    body = {"messages": MESSAGES, "max_tokens": 120, "temperature": 1.0, "seed": 4, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    parts, reasons = [], []
    with httpx.stream("POST", server[0].url + CHAT, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice["delta"].get("content") or "")
                reasons.append(choice["finish_reason"])
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(parts)), PERSON)


def strict_json(text: str):
    """JSON as strict parsers (JavaScript's, OpenAI's SDKs) read it: no Infinity or NaN."""
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_masked_tokens_are_vllms_floor_not_infinity(server):
    """A constraint masks tokens to -inf; ``top_logprobs`` beyond the allowed tokens carries them: as -9999.0 (vLLM's
    floor), whole or streamed, never ``-Infinity`` (not JSON) or a 500."""
    completion = {"prompt": "Yes or no?", "max_tokens": 4, "temperature": 0, "guided_choice": ["yes", "no"],
                  "logprobs": 3}
    chat = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "guided_choice": ["yes", "no"],
            "logprobs": True, "top_logprobs": 3}
    found = []
    for path, body in ((COMPLETIONS, completion), (CHAT, chat)):
        response = post(server, path, body)
        assert response.status_code == 200, response.text
        logprobs = strict_json(response.text)["choices"][0]["logprobs"]
        if path == COMPLETIONS:
            found += [v for top in logprobs["top_logprobs"] for v in top.values()]
        else:
            found += [alt["logprob"] for entry in logprobs["content"] for alt in entry["top_logprobs"]]
        with httpx.stream("POST", server[0].url + path, json={**body, "stream": True}, timeout=120) as streamed:
            for line in streamed.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    strict_json(line[6:])
    assert -9999.0 in found and min(found) == -9999.0


@pytest.mark.parametrize("path, body, param, message", [
    (COMPLETIONS, {"guided_json": {"type": "foo"}}, "guided_json", 'guided_json: cannot be compiled (xgrammar): '
                                                                   'Unsupported type "foo"'),
    (COMPLETIONS, {"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
    (COMPLETIONS, {"guided_choice": ["a", 2]}, "guided_choice", "guided_choice must be a non-empty list of strings"),
    (COMPLETIONS, {"guided_grammar": "root ::= nothing"}, "guided_grammar", 'Rule "nothing" is not defined'),
    (COMPLETIONS, {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "give one structured output"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs", "frobnicate"),
    (COMPLETIONS, {"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs",
     "structured_outputs.json: cannot be compiled"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "response_format.json_schema.schema is required"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "give one structured output"),
])
def test_unusable_specs_are_400_naming_the_field(server, path, body, param, message):
    base = {"prompt": "Once upon a time"} if path == COMPLETIONS else {"messages": MESSAGES}
    assert_error(post(server, path, {**base, "max_tokens": 4, **body}), 400, param, message)
    engine = server[1]
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
