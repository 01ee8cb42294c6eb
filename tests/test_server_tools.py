"""Tool calls through the OpenAI-compatible server, as OpenAI's API and vLLM's server give them: ``tools`` reach the
chat template with the turns that called them (``tool_calls``) and answered them (role ``tool``); a named
``tool_choice`` and ``"required"`` hold the answer to the tools' schemas; ``"auto"`` reads hermes-format calls
(``<tool_call>{...}</tool_call>``) from the text, streamed or not. A random-weights tiny Llama (stories260K's
tokenizer) explores the schemas more than a trained model would; a regex forces the text an ``"auto"`` answer
parses."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
httpx = pytest.importorskip("httpx", reason="the tests send raw requests")
xgr = pytest.importorskip("xgrammar", reason="forced tool calls need xgrammar (pip install 'paged_hf[structured]')")
jsonschema = pytest.importorskip("jsonschema", reason="arguments are validated with jsonschema")

from paged_hf import PagedEngine  # noqa: E402
from paged_hf.server.app import build_app  # noqa: E402
from paged_hf.server.prompts import PromptTokenizer  # noqa: E402
from paged_hf.server.protocol import ChatCompletionRequest  # noqa: E402
from paged_hf.server.tools import ToolPlan, parse_hermes  # noqa: E402
from paged_hf.structured import StructuredOutputsParams  # noqa: E402
from paged_hf.structured.compiler import GrammarCompilerCache, logits_width  # noqa: E402
from models import stories_tokenizer, tiny_model  # noqa: E402
from test_server import Server  # noqa: E402
from test_server_errors import assert_error  # noqa: E402

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# renders the tools, the calls of earlier turns and the tool turns, so the tests can see what reached it
TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ NL }}{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
            "{% if m.tool_calls %}{% for c in m.tool_calls %} call {{ c['id'] }} {{ c['function']['name'] }}"
            "({{ c['function']['arguments']['city'] }}){% endfor %}{% endif %}"
            "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{{ NL }}{% endfor %}assistant:"
            ).replace("{{ NL }}", "{{ '\\n' }}")  # a newline right after a block tag would be trimmed
HISTORY = [*MESSAGES,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
FORCED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
ENGINE_OPTIONS = dict(block_size=8, num_blocks=512, max_num_seqs=16, enforce_eager=True)


@pytest.fixture(scope="module")
def tiny():
    tok = stories_tokenizer()
    tok.chat_template = TEMPLATE
    return tiny_model("llama", attn_implementation="paged"), tok


@pytest.fixture(scope="module")
def server(tiny):
    """A server with auto tool choice (hermes) and one without it."""
    model, tok = tiny
    auto = Server(build_app(PagedEngine(model, tok, **ENGINE_OPTIONS), "tiny", tool_call_parser="hermes"))
    plain = Server(build_app(PagedEngine(model, tok, **ENGINE_OPTIONS), "tiny"))
    try:
        yield auto.url, plain.url
    finally:
        auto.stop()
        plain.stop()


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + CHAT, json=body, timeout=300)


def stream(url: str, body: dict) -> list[dict]:
    """The stream's chunks (parsed), up to [DONE]."""
    chunks = []
    with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def streamed_calls(chunks: list[dict], index: int = 0) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) of choice ``index``, rebuilt from its deltas as OpenAI's clients do."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.get("id") or call["id"]
                call["name"] += delta.get("function", {}).get("name") or ""
                call["arguments"] += delta.get("function", {}).get("arguments") or ""
            reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


# ------------------------------------------------------------------------------------------ what the template sees

def test_tools_calls_and_tool_turns_reach_the_chat_template(tiny):
    _, tok = tiny
    body = ChatCompletionRequest(messages=HISTORY, tools=TOOLS, tool_choice="none")
    text = PromptTokenizer(tok, 512)._template(body.chat(), body.template_kwargs())
    assert text == ("tools: get_weather get_time\nuser: What is the weather in Paris?\n"
                    "assistant:  call call_1 get_weather(Paris)\ntool: Sunny, 21 C for call_1\nassistant:")


def test_history_and_tool_fields_that_cannot_be_used_are_400s(server):
    auto, plain = server
    bad_arguments = [MESSAGES[0], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0],
                                                                "function": {"name": "f", "arguments": "{oops"}}]}]
    assert_error(post(plain, {"messages": bad_arguments, "max_tokens": 2}), 400, "messages",
                 "messages.1.tool_calls.0.function.arguments is not JSON")
    assert_error(post(plain, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}), 400, "tool_choice",
                 "--enable-auto-tool-choice")
    assert_error(post(plain, {"messages": MESSAGES, "tool_choice": "required", "max_tokens": 2}), 400,
                 "tool_choice", "tool_choice needs tools")
    named = {"type": "function", "function": {"name": "get_news"}}
    assert_error(post(plain, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named}), 400, "tool_choice",
                 "not in tools")
    assert_error(post(plain, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}), 400, "tool_choice", "cannot be combined")
    assert_error(post(plain, {"messages": MESSAGES, "tools": [TOOLS[0], TOOLS[0]], "tool_choice": "none"}), 400,
                 "tools", "given twice")
    assert_error(post(plain, {"messages": MESSAGES, "functions": [TOOLS[0]["function"]]}), 400, "functions",
                 "deprecated")
    assert post(auto, {"messages": HISTORY, "tools": TOOLS, "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------------------ forced calls

def test_a_named_tool_choice_answers_one_call_whose_arguments_validate(server):
    _, plain = server
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = post(plain, body).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    # streamed: the call opens with its id and name, then its arguments grow to the same text
    chunks = stream(plain, body)
    content, (streamed,), reason = streamed_calls(chunks)
    assert (content, streamed["name"], streamed["arguments"], reason) == \
        ("", "get_weather", call["function"]["arguments"], "stop")
    first_call = next(c["choices"][0]["delta"]["tool_calls"][0] for c in chunks
                      if c["choices"][0]["delta"].get("tool_calls"))
    assert first_call["id"] == streamed["id"] and first_call["function"]["name"] == "get_weather"


def test_required_answers_calls_of_the_given_tools_at_most_one_without_parallel_calls(server):
    _, plain = server
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
            "temperature": 1.0, "seed": 3, "n": 4}
    finished = 0
    for choice in post(plain, body).json()["choices"]:
        if choice["finish_reason"] == "length":
            continue
        finished += 1
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
        for call in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert finished, "at least one sample must finish for the check to mean something"
    single = post(plain, {**body, "parallel_tool_calls": False}).json()["choices"]
    assert all(len(c["message"]["tool_calls"]) == 1 for c in single if c["finish_reason"] == "tool_calls")
    greedy = {**body, "n": 1, "temperature": 0}
    whole = post(plain, greedy).json()["choices"][0]
    content, calls, reason = streamed_calls(stream(plain, greedy))
    assert reason == whole["finish_reason"]
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]


# ------------------------------------------------------------------------------------------ auto: the hermes parser

def test_auto_reads_hermes_calls_from_the_text_streamed_or_not(server):
    auto, plain = server
    forced = f"Let me check\\. {FORCED_CALL}".replace("{", "\\{").replace("}", "\\}").replace("\n", "\\n")
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 0, "guided_regex": forced}
    choice = post(auto, body).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["content"] == "Let me check. " and choice["finish_reason"] == "tool_calls"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    content, (streamed,), reason = streamed_calls(stream(auto, body))
    assert (content, streamed["name"], streamed["arguments"], reason) == \
        ("Let me check. ", "get_weather", call["function"]["arguments"], "tool_calls")
    # without a call the answer is plain content, and "none" never parses
    plain_text = post(auto, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 12, "temperature": 0}).json()
    assert plain_text["choices"][0]["message"]["tool_calls"] == []
    none = post(auto, {**body, "tool_choice": "none"}).json()["choices"][0]
    assert none["message"]["content"].endswith("</tool_call>") and none["message"]["tool_calls"] == []


def test_hermes_parsing_of_whole_answers():
    two = FORCED_CALL + "\n" + FORCED_CALL.replace("get_weather", "get_time").replace(
        '"city": "Paris", "days": 2', '"zone": "UTC"')
    content, calls = parse_hermes("Sure. " + two)
    assert content == "Sure. " and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "UTC"}
    assert parse_hermes(FORCED_CALL)[0] is None  # nothing before the call: no content
    assert parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_hermes(FORCED_CALL[:-len("</tool_call>")])[1][0]["function"]["name"] == "get_weather"  # cut short
    plan = ToolPlan.of(TOOLS, "auto", False, "hermes")
    assert [c["function"]["name"] for c in plan.answer(two, "stop")[1]] == ["get_weather"]


@settings(max_examples=80, deadline=None)
@given(prefix=st.sampled_from(["", "Sure. ", "a < b and <tool", "<tool_cal"]),
       calls=st.integers(0, 2), cut=st.integers(0, len(FORCED_CALL) - 1), cuts=st.lists(st.integers(1, 400), max_size=12),
       parallel=st.booleans())
def test_a_streamed_auto_answer_equals_the_whole_one_wherever_its_deltas_split(prefix, calls, cut, cuts, parallel):
    """Also where max_tokens cut the answer inside a call (``cut`` characters of one more call): the calls before it
    are calls, its text content, streamed or not."""
    text = prefix + "\n".join([FORCED_CALL] * calls) + FORCED_CALL[:cut]
    reason = "length" if cut else "stop"
    plan = ToolPlan.of(TOOLS, "auto", parallel, "hermes")
    whole_content, whole_calls, whole_reason = plan.answer(text, reason)
    state, content, names = plan.stream(), "", []
    pieces, start = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces.append(text[start:cut])
        start = max(start, cut)
    for number, piece in enumerate(pieces):
        new, deltas = state.feed(piece, number == len(pieces) - 1)
        content += new
        names += [d["function"]["name"] for d in deltas]
    assert content == (whole_content or "")
    assert names == [c["function"]["name"] for c in whole_calls]
    assert state.finish_reason(reason) == whole_reason


# ------------------------------------------------------------------------------------ auto: strict tools (structural tag)
STRICT_TOOLS = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]  # get_time: not strict


def matcher_of(tiny, spec):
    """A fresh xgrammar matcher of ``spec`` compiled for the tiny model's vocabulary."""
    model, tok = tiny
    grammars = GrammarCompilerCache(tok, logits_width(model), [tok.eos_token_id])
    return lambda: xgr.GrammarMatcher(grammars.compile(spec))


@pytest.mark.parametrize("parallel", [True, False])
def test_strict_tools_under_auto_hold_calls_to_their_schemas_and_leave_text_free(tiny, parallel):
    plan = ToolPlan.of(STRICT_TOOLS, "auto", parallel, "hermes")
    assert ToolPlan.of(TOOLS, "auto", parallel, "hermes").constraint() is None  # no strict tool: calls read as written
    new = matcher_of(tiny, plan.constraint())
    weather_call = FORCED_CALL
    inline_call = FORCED_CALL.replace("\n", "")
    free_time_call = '<tool_call>{"name": "get_time", "arguments": {"anything": [1, "goes"]}}</tool_call>'
    for text, accepted in [
            ("Just words, no call.", True),
            (f"Let me check. {weather_call}", True),  # the layout Qwen's templates write
            (inline_call, True),  # and the inline one
            (free_time_call, True),  # a tool without strict: any JSON arguments
            (weather_call.replace("Paris", "paris"), False),  # the strict tool's pattern
            (weather_call.replace('"days": 2', '"days": 9'), False),  # its maximum
            (weather_call.replace(', "days": 2', ""), False),  # its required key
            ('<tool_call>\n{"name": "get_news", "arguments": {}}', False),  # a tool not given
            ("<tool_call>\nplain words", False)]:  # after the trigger, a call
        assert new().accept_string(text) is accepted, text
    # a second call: allowed with parallel calls, not without (the output must end after the first)
    second = new()
    assert second.accept_string(weather_call + free_time_call) is parallel
    ended = new()
    assert ended.accept_string(weather_call)
    assert ended.accept_token(tiny[1].eos_token_id)


def test_strict_auto_requests_run_and_a_response_format_beside_them_is_either_calls_or_its_json(server, tiny):
    auto, _ = server
    body = {"messages": MESSAGES, "tools": STRICT_TOOLS, "max_tokens": 24, "temperature": 0}
    choice = post(auto, body).json()["choices"][0]  # the random model writes no call: free text
    assert choice["message"]["tool_calls"] == [] and choice["message"]["content"]
    content, calls, _ = streamed_calls(stream(auto, body))
    assert (content, calls) == (choice["message"]["content"], [])
    # with a response_format too, the answer is calls of the tools or the format's JSON (vLLM's "or")
    answer = {"type": "object", "properties": {"reply": {"type": "string", "maxLength": 8}}, "required": ["reply"],
              "additionalProperties": False}
    spec = ToolPlan.of(STRICT_TOOLS, "auto", True, "hermes").constraint(StructuredOutputsParams(json=answer))
    new = matcher_of(tiny, spec)
    assert new().accept_string(FORCED_CALL) and new().accept_string('{"reply": "hi"}')
    assert not new().accept_string("free text") and not new().accept_string(FORCED_CALL.replace("Paris", "paris"))
    formatted = {**body, "max_tokens": 200, "temperature": 1.0,
                 "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}}
    finished = 0
    for seed in range(3):
        choice = post(auto, {**formatted, "seed": seed}).json()["choices"][0]
        message = choice["message"]
        if choice["finish_reason"] == "length":  # cut inside a call: nothing complete to check
            continue
        finished += 1
        if message["tool_calls"]:
            for call in message["tool_calls"]:
                if call["function"]["name"] == "get_weather":
                    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
        else:
            jsonschema.validate(json.loads(message["content"]), answer)
    assert finished
    assert_error(post(auto, {**body, "structured_outputs": {"json": answer, "disable_any_whitespace": True}}), 400,
                 "structured_outputs", "disable_any_whitespace cannot be combined with tool calls")


def test_a_structural_tag_response_format_holds_the_answer(server):
    auto, plain = server
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "City: "}, {"type": "json_schema", "json_schema": WEATHER}]}}
    for url in (auto, plain):
        for response_format in (tag, {"type": "structural_tag", "structures": [
                {"begin": "<w>", "schema": WEATHER, "end": "</w>"}], "triggers": ["<w>"]}):
            response = post(url, {"messages": MESSAGES, "max_tokens": 120, "temperature": 0,
                                  "response_format": response_format})
            assert response.status_code == 200, response.text
        text = post(url, {"messages": MESSAGES, "max_tokens": 120, "temperature": 0.0,
                          "structured_outputs": {"structural_tag": json.dumps(tag)}}).json()["choices"][0]
        assert text["message"]["content"].startswith("City: ") and text["finish_reason"] == "stop", text
        jsonschema.validate(json.loads(text["message"]["content"][len("City: "):]), WEATHER)
    assert_error(post(plain, {"messages": MESSAGES, "response_format": {"type": "structural_tag", "format": {
        "type": "nope"}}}), 400, "response_format", "Format type not recognized")
    assert_error(post(plain, {"messages": MESSAGES, "structural_tag": "{}"}), 400, "structural_tag",
                 "response_format {\"type\": \"structural_tag\", ...}")


def test_text_parts_are_joined_by_lines_as_vllm_joins_them():
    parts = [{"type": "text", "text": "First line."}, {"type": "text", "text": "Second line."}]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": parts}])
    assert body.chat() == [{"role": "user", "content": "First line.\nSecond line."}]


def test_the_developer_role_reaches_templates_that_know_it_and_is_system_for_the_others(tiny):
    """OpenAI's "developer" turn: a template that names the role (gpt-oss's tells system and developer apart) gets
    it as given, as vLLM hands it; any other template gets it as "system", the role it was trained on."""
    _, tok = tiny
    body = ChatCompletionRequest(messages=[{"role": "developer", "content": "Be brief."}, *MESSAGES])
    plain = PromptTokenizer(tok, 512)._template(body.chat(), body.template_kwargs())
    assert plain.startswith("system: Be brief.\n")
    saved = tok.chat_template
    try:  # the same tokenizer with a template that names the role
        tok.chat_template = TEMPLATE.replace("{{ m['role'] }}", "{{ 'dev' if m['role'] == 'developer' else m['role'] }}")
        assert PromptTokenizer(tok, 512)._template(body.chat(), body.template_kwargs()).startswith("dev: Be brief.")
    finally:
        tok.chat_template = saved
