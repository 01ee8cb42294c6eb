"""What the clients people already use send and read, against a real ``paged-hf serve`` over HTTP, driven by the
``openai`` client where it has the field (raw JSON where a client sends JSON the openai client cannot, e.g. nulls).

Prompt logprobs are checked against a plain forward's ``log_softmax`` over the same tokens; texts against the
engine's own answer (``PagedEngine.generate``) on the same model folder. lm-eval and guidellm themselves:
``test_lm_eval.py`` and ``test_guidellm.py``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'paged_hf[server]')")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")
httpx = pytest.importorskip("httpx", reason="raw JSON bodies")
import torch  # noqa: E402
import transformers  # noqa: E402
from served import Served, stories_folder  # noqa: E402

from paged_hf import PagedEngine, SamplingParams  # noqa: E402
from paged_hf.engine.detokenizer import Decoder  # noqa: E402
from paged_hf.engine.request import Logprob  # noqa: E402
from paged_hf.server.logprobs import ChoiceLogprobs  # noqa: E402

PROMPT = "Once upon a time, there was a little girl named Lily. She"
SERVE_ARGS = ("--num-blocks", "256", "--max-model-len", "512", "--log-level", "debug")
EOS = 2  # stories260K's </s>
TOLERANCE = 1e-4  # logprobs: the server's forward (batched, paged) against a plain one: float32 rounding, ~1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return stories_folder(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def served(folder, tmp_path_factory):
    server = Served(folder, *SERVE_ARGS, log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder)


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=60)


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward: row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_scores_prompt(model, ids: list[int], legacy: dict, k: int = 1) -> None:
    """``legacy`` (OpenAI's completions logprobs for an echoed prompt) is a plain forward's: the chosen tokens'
    logprobs, and the ``k`` best of each position among its top_logprobs."""
    expected = forward_logprobs(model, ids)
    assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None
    got = legacy["token_logprobs"][1:len(ids)]
    want = [expected[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert got == pytest.approx(want, abs=TOLERANCE)
    for i in range(1, len(ids)):
        best = torch.topk(expected[i - 1], k).values.tolist()
        top = sorted(legacy["top_logprobs"][i].values(), reverse=True)
        assert top[:k] == pytest.approx(best, abs=TOLERANCE)
    offsets = legacy["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(offsets[i + 1] - offsets[i] == len(legacy["tokens"][i]) for i in range(len(offsets) - 1))


def engine_text(hf, prompt, **params) -> str:
    model, tok = hf
    engine = PagedEngine(model, tok, num_blocks=64)
    return engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


# ----------------------------------------------------------------------------------- 1. echo and prompt logprobs

def test_echo_with_max_tokens_0_scores_the_prompt_like_a_forward(client, hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    response = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                         temperature=0)
    choice = response.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    legacy = choice.logprobs.model_dump()
    assert len(legacy["tokens"]) == len(ids) and "".join(legacy["tokens"]) == PROMPT
    assert_scores_prompt(model, ids, legacy)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 0)


def test_echo_with_completion_is_the_prompt_then_the_completion(client, hf):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1; the prompt part is a forward's, the
    completion part what the same request without echo answers."""
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    echoed = client.completions.create(model="stories260K", prompt=ids, max_tokens=3, echo=True, logprobs=2,
                                       temperature=0).choices[0]
    plain = client.completions.create(model="stories260K", prompt=ids, max_tokens=3, logprobs=2,
                                      temperature=0).choices[0]
    legacy = echoed.logprobs.model_dump()
    assert len(legacy["tokens"]) == len(ids) + 3
    assert_scores_prompt(model, ids, legacy, k=2)
    assert legacy["token_logprobs"][len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=TOLERANCE)
    assert echoed.text.endswith(plain.text) and echoed.text.startswith(tok.decode(ids, skip_special_tokens=True))


def test_echo_top_logprobs_never_show_a_beaten_token_as_the_best(hf):
    """lm-eval's ``is_greedy`` is ``token_logprob == max(top_logprobs.values())``, and ``top_logprobs`` is keyed by
    text: two tokens of one name keep one value. A byte token held back in context ("") and the end token (which
    decode skips: "") shared a name, as do "A" and its byte token <0x41>; the token, listed last, overwrote the
    better one and looked greedy. A special token is named by its piece (as vLLM), and the token comes first, so a
    same-named alternative keeps its own value (vLLM's order)."""
    _, tok = hf
    decode = Decoder(tok)
    byte, letter, letter_byte = tok.convert_tokens_to_ids(["<0xE2>", "A", "<0x41>"])
    ids = tok("Lily said")["input_ids"] + [letter, byte]
    entries = [None] * (len(ids) - 2) + [{letter_byte: Logprob(-0.2, 1), letter: Logprob(-3.0, 7)},
                                         {EOS: Logprob(-0.1, 1), byte: Logprob(-5.0, 40)}]
    legacy = ChoiceLogprobs(decode).completion(ids, entries, top=1)
    assert legacy["tokens"][-2:] == ["A", ""]  # the byte waits for the rest of its character
    assert legacy["top_logprobs"][-2] == {"A": -0.2}  # <0x41>'s own value, the best one
    assert legacy["top_logprobs"][-1] == {"": -5.0, "</s>": -0.1}
    for token_logprob, top in zip(legacy["token_logprobs"][-2:], legacy["top_logprobs"][-2:]):
        assert token_logprob < max(top.values())  # neither token is greedy


def test_echoed_text_is_its_tokens(client):
    choice = client.completions.create(model="stories260K", prompt="Once upon a", max_tokens=3, echo=True,
                                       logprobs=0, temperature=0).choices[0]
    assert "".join(choice.logprobs.tokens) == choice.text


def test_batched_token_prompts_echo_each_prompt(client, hf):
    model, tok = hf
    prompts = [tok(p)["input_ids"] for p in (PROMPT, "The little dog wagged its tail", "One day")]
    response = client.completions.create(model="stories260K", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for ids, choice in zip(prompts, response.choices):
        assert_scores_prompt(model, ids, choice.logprobs.model_dump())
    assert response.usage.completion_tokens == 0


def test_streamed_echo_equals_the_whole_answer(client, hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    whole = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=4, echo=True, logprobs=1,
                                      temperature=0).choices[0]
    chunks = list(client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=4, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs and len(streamed) == len(ids) + 4
    scored = list(client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                            stream=True))
    assert "".join(c.choices[0].text for c in scored) == PROMPT
    parts = [c.choices[0].logprobs.model_dump() for c in scored]
    assert_scores_prompt(model, ids, {key: [x for part in parts for x in part[key]]
                                      for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")})


def test_vllm_prompt_logprobs_field(client, hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    choice = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2}).model_dump()["choices"][0]
    entries = choice["prompt_logprobs"]
    expected = forward_logprobs(model, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        assert entries[i][str(ids[i])]["logprob"] == pytest.approx(expected[i - 1, ids[i]].item(), abs=TOLERANCE)
        ranked = sorted((e["rank"], e["logprob"]) for e in entries[i].values() if e["rank"] <= 2)
        assert [lp for _, lp in ranked] == pytest.approx(torch.topk(expected[i - 1], 2).values.tolist(),
                                                         abs=TOLERANCE)


def test_max_tokens_0_needs_echo(served):
    response = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


# ---------------------------------------------------------------------------------- 2. OpenAI's reference fields

NO_EFFECT_CHAT = {"store": True, "metadata": {"team": "eval"}, "service_tier": "auto", "parallel_tool_calls": False,
                  "prompt_cache_key": "k1", "safety_identifier": "u-1", "user": "u-1", "modalities": ["text"],
                  "verbosity": "medium", "reasoning_effort": "low", "prompt_cache_retention": "24h",
                  "response_format": {"type": "text"}, "tool_choice": "none"}
CHAT_FIELDS = ["audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
               "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls",
               "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort",
               "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
               "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
               "web_search_options"]
COMPLETION_FIELDS = ["best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
                     "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p",
                     "user", "response_format"]
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def test_fields_that_change_nothing_are_accepted_and_logged(client, served):
    plain = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=6, temperature=0)
    given = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=6, temperature=0,
                                           **NO_EFFECT_CHAT, stream=False)
    assert given.choices[0].message.content == plain.choices[0].message.content
    streamed = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True,
                                                                           "include_obfuscation": False})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain.choices[0].message.content
    time.sleep(0.2)
    assert "accepted, changing nothing here: store, metadata, service_tier, safety_identifier, prompt_cache_key, " \
           "prompt_cache_retention, user" in served.logged()


@pytest.mark.parametrize("path, fields, base", [
    ("/v1/chat/completions", CHAT_FIELDS, {"messages": MESSAGES}),
    ("/v1/completions", COMPLETION_FIELDS, {"prompt": PROMPT}),
])
def test_every_reference_field_null_is_the_default(served, path, fields, base):
    plain = post(served, path, {**base, "max_tokens": 5, "temperature": 0}).json()
    nulls = post(served, path, {**base, **{f: None for f in fields}, "max_tokens": 5, "temperature": 0})
    assert nulls.status_code == 200, nulls.text
    text = (lambda c: c["message"]["content"]) if "chat" in path else (lambda c: c["text"])
    assert text(nulls.json()["choices"][0]) == text(plain["choices"][0])
    assert post(served, path, {**base, "max_tokens": 2, "stream": True, "stream_options": {
        "include_usage": None, "include_obfuscation": None, "continuous_usage_stats": None}}).status_code == 200


def test_message_fields_null_are_the_default(served):
    history = [{"role": "user", "content": "Hi", "name": None},
               {"role": "assistant", "content": "Hello.", "refusal": None, "tool_calls": None, "function_call": None,
                "audio": None},
               {"role": "user", "content": "Tell me a story."}]
    plain = [{k: v for k, v in m.items() if v is not None} for m in history]
    got = post(served, "/v1/chat/completions", {"messages": history, "max_tokens": 4, "temperature": 0})
    want = post(served, "/v1/chat/completions", {"messages": plain, "max_tokens": 4, "temperature": 0})
    assert got.status_code == 200 and got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    calls = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]  # no function
    refused = post(served, "/v1/chat/completions", {"messages": calls, "max_tokens": 1})
    assert refused.status_code == 400 and "messages.0.tool_calls" in refused.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}), ("functions", [{"name": "f"}]),
    ("modalities", ["text", "audio"]), ("verbosity", "low"), ("structural_tag", {"type": "structural_tag"}),
    ("guided_whitespace_pattern", " *"),
])
def test_fields_that_would_change_the_answer_are_refused_by_name(served, field, value):
    response = post(served, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
    assert "not supported" in response.json()["error"]["message"]


# --------------------------------------------------------------------------------- 3. continuous usage in chunks

def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(served):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    prompt_tokens = events[-1]["usage"]["prompt_tokens"]
    assert all("usage" in e and e["usage"]["prompt_tokens"] == prompt_tokens for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == list(range(1, 6)) and events[-1]["usage"]["completion_tokens"] == 5
    assert all(e["usage"]["total_tokens"] == prompt_tokens + e["usage"]["completion_tokens"] for e in events)


# ------------------------------------------------------------------------------------------- 4. vLLM's extras

def completion(client, **fields):
    """A completion of PROMPT, vLLM's fields in the body (the openai client's extra_body, as vLLM's docs show)."""
    named = {k: fields.pop(k) for k in ("max_tokens", "temperature", "seed", "stop", "logit_bias", "prompt")
             if k in fields}
    return client.completions.create(model="stories260K", **{"prompt": PROMPT, **named}, extra_body=fields)


def test_vllm_sampling_extras_match_the_engine(client, hf):
    for fields in ({"repetition_penalty": 1.3}, {"top_k": 5, "min_p": 0.1}):
        got = completion(client, max_tokens=12, temperature=1.0, seed=7, **fields).choices[0].text
        assert got == engine_text(hf, PROMPT, max_tokens=12, temperature=1.0, seed=7, **fields)
    off = [completion(client, max_tokens=12, temperature=1.0, seed=7, top_k=k).choices[0].text for k in (0, -1)]
    assert off[0] == off[1] == engine_text(hf, PROMPT, max_tokens=12, temperature=1.0, seed=7)


def test_stop_token_ids_min_tokens_ignore_eos_and_special_tokens(client, hf):
    _, tok = hf
    greedy = completion(client, max_tokens=8, temperature=0, logprobs=0).choices[0]
    ids = tok(greedy.text, add_special_tokens=False)["input_ids"]
    stop_at = tok(PROMPT + greedy.text)["input_ids"][len(tok(PROMPT)["input_ids"]) + 2]
    stopped = completion(client, max_tokens=8, temperature=0, stop_token_ids=[stop_at]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.model_dump()["stop_reason"] == stop_at and ids
    forced = {"logit_bias": {str(EOS): 100}, "max_tokens": 4, "temperature": 0}
    assert completion(client, **forced).usage.completion_tokens == 1  # </s> at once
    assert completion(client, **forced, min_tokens=3).usage.completion_tokens >= 3
    kept = completion(client, **forced, ignore_eos=True, skip_special_tokens=False).choices[0]
    assert kept.text == "</s>" * 4 and kept.finish_reason == "length"
    assert completion(client, **forced, ignore_eos=True).choices[0].text == ""


def test_include_stop_str_in_output(client):
    text = completion(client, max_tokens=20, temperature=0).choices[0].text
    stop = text.split()[2]
    cut = completion(client, max_tokens=20, temperature=0, stop=[stop]).choices[0].text
    kept = completion(client, max_tokens=20, temperature=0, stop=[stop], include_stop_str_in_output=True)
    assert kept.choices[0].text == cut + stop and kept.choices[0].finish_reason == "stop"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, hf):
    _, tok = hf
    ids = tok(PROMPT)["input_ids"]
    cut = completion(client, max_tokens=6, temperature=0, truncate_prompt_tokens=5)
    assert cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == completion(client, prompt=ids[-5:], max_tokens=6, temperature=0).choices[0].text
    chat = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4


def test_request_id_names_the_response(client):
    assert completion(client, max_tokens=1, request_id="eval-17").id == "cmpl-eval-17"
    chat = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=1,
                                          extra_body={"request_id": "eval-18"})
    assert chat.id == "chatcmpl-eval-18"


def test_chat_template_kwargs_and_add_generation_prompt_reach_the_template(client, served):
    plain = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=1)
    given = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"preamble": "A short story."}})
    assert given.usage.prompt_tokens > plain.usage.prompt_tokens
    tokenized = post(served, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"preamble": "A short story."}})
    assert tokenized.json()["count"] == given.usage.prompt_tokens
    bare = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=1,
                                          extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens < plain.usage.prompt_tokens  # "assistant:" left out


def test_prefix_caching_per_request(client, served):
    long_prompt = PROMPT * 4  # several full blocks
    completion(client, prompt=long_prompt, max_tokens=1)
    reused = post(served, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1}).json()["usage"]
    skipped = post(served, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1,
                                               "enable_prefix_caching": False}).json()["usage"]
    assert reused["prompt_tokens_details"]["cached_tokens"] >= 32
    assert skipped["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("guided_json", {"type": "foo"}),
                                          ("guided_choice", []), ("guided_regex", "a("),
                                          ("guided_decoding_backend", "outlines"), ("frobnicate", 1)])
def test_what_does_not_map_is_refused_by_name(served, field, value):
    response = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_vllm_defaults_are_accepted(served):
    body = {"prompt": PROMPT, "max_tokens": 2, "use_beam_search": False, "enable_prefix_caching": True, "top_k": -1,
            "skip_special_tokens": True, "spaces_between_special_tokens": True, "length_penalty": 1.0,
            "include_stop_str_in_output": False, "truncate_prompt_tokens": -1, "priority": 0, "ignore_eos": False}
    assert post(served, "/v1/completions", body).status_code == 200


@pytest.fixture(scope="module")
def priority_served(folder, tmp_path_factory):
    server = Served(folder, "--num-blocks", "256", "--scheduling-policy", "priority", "--max-num-seqs", "1",
                    "--allow-unknown-fields", "--served-model-name", "tiny-stories",
                    log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def test_priority_orders_waiting_requests(priority_served):
    """One sequence at a time: while a long request runs (streamed, so that its first chunk says it runs), a
    low-priority request and then a high-priority one wait; the high-priority one (the lower number, as vLLM)
    runs first. The long one takes ~0.7 s here; both wait within ~0.1 s of its start."""
    url = priority_served.url + "/v1/completions"
    finished = {}

    def send(name: str, priority: int) -> None:
        body = {"prompt": PROMPT, "max_tokens": 20, "ignore_eos": True, "priority": priority}
        assert httpx.post(url, json=body, timeout=120).status_code == 200
        finished[name] = time.monotonic()

    long = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(2) as pool, httpx.stream("POST", url, json=long, timeout=120) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        pool.submit(send, "low", 5)
        time.sleep(0.05)
        pool.submit(send, "high", -5)
        for _ in lines:
            pass
        finished["long"] = time.monotonic()
    assert finished["long"] < finished["high"] < finished["low"], finished


def test_allow_unknown_fields_ignores_them_with_a_warning(priority_served):
    body = {"model": "tiny-stories", "prompt": PROMPT, "max_tokens": 2, "frobnicate": 1,
            "stream_options": None, "mystery": {"a": 1}}
    assert httpx.post(priority_served.url + "/v1/completions", json=body, timeout=60).status_code == 200
    time.sleep(0.2)
    assert "ignoring the unknown request field frobnicate" in priority_served.logged()
    assert "ignoring the unknown request field mystery" in priority_served.logged()


# --------------------------------------------------------------------------------------- 5. chat logprobs' bytes

def test_chat_logprob_bytes_are_each_tokens_own(client, hf):
    _, tok = hf
    content = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=2).choices[0]
    for entry in content.logprobs.content:
        assert bytes(entry.bytes) == entry.token.encode()
        assert all(bytes(alt.bytes) == alt.token.encode() for alt in entry.top_logprobs)
    # a byte-fallback token alone is part of a character: OpenAI's "bytes:" name, and its one byte
    byte_c3 = tok.convert_tokens_to_ids("<0xC3>")
    partial = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=1, logprobs=True,
                                             logit_bias={str(byte_c3): 100}).choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in partial] == [("bytes:\\xc3", [0xC3])]


def test_chat_logprobs_have_an_entry_for_the_end_of_turn_token_as_vllm(client):
    # one entry per completion token (vLLM's rule), the end token's named by its piece, though its text is left out
    for extra in ({}, {"skip_special_tokens": False}):
        choice = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=4, logprobs=True,
                                                logit_bias={str(EOS): 100}, extra_body=extra)
        assert choice.choices[0].finish_reason == "stop" and choice.choices[0].message.content == ""
        assert [(e.token, bytes(e.bytes)) for e in choice.choices[0].logprobs.content] == [("</s>", b"</s>")]
        assert choice.usage.completion_tokens == 1


# ------------------------------------------------------------------------------- 6. tokenizer routes and models

def test_tokenize_and_detokenize(served, hf):
    _, tok = hf
    ids = tok(PROMPT)["input_ids"]
    got = post(served, "/tokenize", {"model": "stories260K", "prompt": PROMPT, "return_token_strs": True}).json()
    assert got == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                   "token_strs": tok.convert_ids_to_tokens(ids)}
    assert post(served, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"] == ids[1:]
    # special tokens kept, as tokenizer.decode (and vLLM) keep them: the BOS marker comes back
    assert post(served, "/detokenize", {"model": "stories260K", "tokens": ids}).json() == {"prompt": tok.decode(ids)}
    assert tok.decode(ids) != PROMPT and tok.decode(ids).endswith(PROMPT)
    bad = post(served, "/detokenize", {"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    chat = post(served, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == tok(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False)["input_ids"]
    info = httpx.get(served.url + "/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["model_max_length"] == 512 and "assistant:" in info["chat_template"]


def test_models_by_id_and_the_served_name(client, priority_served):
    assert client.models.retrieve("stories260K").id == "stories260K"  # the folder's name by default
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    renamed = openai.OpenAI(base_url=priority_served.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in renamed.models.list()] == ["tiny-stories"]
    assert renamed.models.retrieve("tiny-stories").max_model_len == 512
