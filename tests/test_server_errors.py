"""The server as a hostile client finds it (issue #12): every error is OpenAI-shaped JSON with the right status and
names its field, every parameter is honoured or refused by name, a bad request fails alone, and nothing it sends
leaves a request running or a block held."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'paged_hf[server]')")
httpx = pytest.importorskip("httpx", reason="the tests send raw requests")

from paged_hf import PagedEngine, SamplingParams  # noqa: E402
from models import output_text, story_openings  # noqa: E402
from test_server import chat_stories, serving  # noqa: E402

ENGINE_OPTIONS = dict(block_size=8, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=256, max_n=4,
                      max_stop_strings=8)


@pytest.fixture(scope="module")
def stories():
    return chat_stories()


@pytest.fixture(scope="module")
def server(stories):
    with serving(stories, 16, **ENGINE_OPTIONS) as served:
        yield served


def solo_text(stories, prompt, **params) -> str:
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=8, num_blocks=256)
    return engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


def post(server, path: str, body=None, content: bytes | None = None, **kwargs) -> httpx.Response:
    return httpx.post(server[0].url + path, json=body, content=content, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None, message: str = "", code=None) -> dict:
    """The response is ``status`` with OpenAI's error object naming ``param``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert message in error["message"], error
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if code is not None:
        assert error["code"] == code
    return error


def assert_idle(server, within: float = 2.0) -> None:
    """No request runs or waits and no block is held (within ``within`` seconds)."""
    _, engine = server
    deadline = time.monotonic() + within
    while True:
        stats = engine.get_stats()
        if stats["num_running"] == stats["num_waiting"] == stats["kv_cache_used"] == 0:
            return
        assert time.monotonic() < deadline, f"still busy: {dict(stats)}"
        time.sleep(0.02)


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


# ---------------------------------------------------------------------------------------- 1: fails alone
def test_a_bad_token_id_fails_alone_among_concurrent_completions(stories, server):
    """Item 1: four good completions all got 500 IndexError when one client sent ``[1, 999999]``."""
    prompts = story_openings()[:4]

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            good = [http.post(server[0].url + COMPLETIONS, json={"prompt": p, "max_tokens": 16, "temperature": 0})
                    for p in prompts]
            bad = http.post(server[0].url + COMPLETIONS, json={"prompt": [1, 999999], "max_tokens": 16})
            return await asyncio.gather(*good, bad)

    *good, bad = asyncio.run(main())
    assert [r.json()["choices"][0]["text"] for r in good] == [solo_text(stories, p, max_tokens=16, temperature=0)
                                                              for p in prompts]
    assert_error(bad, 400, "prompt", "must be in [0, 512) (the model's vocabulary), got 999999")
    assert_idle(server)


# ------------------------------------------------------------------------------- 4, 10: bodies and bytes
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_malformed_bodies_are_400_json_without_byte_offsets(server, path):
    """Item 10: malformed JSON reported a byte offset as ``param``; invalid UTF-8 got ``{"detail": ...}``."""
    assert_error(post(server, path, content=b'{"prompt": "Hi", '), 400, None, "not valid JSON")
    assert_error(post(server, path, content=b'{"prompt": "\xff\xfe"}'), 400, None, "not valid UTF-8")
    assert_error(post(server, path, content=b'{"prompt": "Hi", "temperature": NaN}'), 400, None, "NaN")
    assert_error(post(server, path, content=b'["not", "an", "object"]'), 400, None, "must be a JSON object")
    assert_error(post(server, path, content=b""), 400, None, "not valid JSON")
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # 200 KB, deeper than Python's parser recurses
    assert_error(post(server, path, content=deep), 400, None, "nested too deeply")
    deep = b'{"prompt": "Hi", "logit_bias": {"1": 0}, "x": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b"}"
    assert post(server, path, content=deep).status_code == 400


def test_lone_surrogates_are_400_and_stop_the_other_prompts(server):
    """Item 4: ``"\\ud800"`` gave a plain-text 500 and the earlier prompts of the request kept running."""
    lone = b'"\\ud800"'
    body = b'{"prompt": ["Once upon a time", ' + lone + b'], "max_tokens": 400, "ignore_eos": true}'
    assert_error(post(server, COMPLETIONS, content=body), 400, "prompt", "lone surrogate")
    assert_idle(server, within=0.0)  # refused before any prompt was queued
    chat = b'{"messages": [{"role": "user", "content": ' + lone + b'}]}'
    assert_error(post(server, CHAT, content=chat), 400, "messages", "lone surrogate")
    assert_error(post(server, COMPLETIONS, content=b'{"prompt": "Hi", ' + lone + b': 1}'), 400, None,
                 "lone surrogate")


def test_a_prompt_the_engine_refuses_aborts_the_prompts_queued_before_it(server):
    """Item 3 (multi-prompt half): the prompts of one request are queued all or none."""
    body = {"prompt": [[1, 2, 3], [1, 999999]], "max_tokens": 400, "ignore_eos": True}
    assert_error(post(server, COMPLETIONS, body), 400, "prompt", "vocabulary")
    assert_idle(server, within=0.0)


# --------------------------------------------------------------------------- 5, 6, 7, 8, 9: values, names
@pytest.mark.parametrize("path, body, status, param, message", [
    (COMPLETIONS, {"logprobs": 1000}, 400, "logprobs", "at most 20 (max_logprobs), got 1000"),
    (COMPLETIONS, {"logprobs": -1}, 400, "logprobs", "logprobs must be an int >= 0, got -1"),
    (COMPLETIONS, {"echo": True, "logprobs": 21}, 400, "logprobs", "at most 20 (max_logprobs), got 21"),
    (CHAT, {"logprobs": True, "top_logprobs": 1000}, 400, "top_logprobs", "at most 20 (max_logprobs), got 1000"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", "top_logprobs must be an int >= 0"),
    (CHAT, {"top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    (COMPLETIONS, {"temperature": "NaN"}, 400, "temperature", "finite"),
    (CHAT, {"top_p": "NaN"}, 400, "top_p", "finite"),
    (COMPLETIONS, {"presence_penalty": "Infinity"}, 400, "presence_penalty", "finite"),
    (COMPLETIONS, {"stop": 5}, 400, "stop", "stop"),
    (COMPLETIONS, {"stop": [str(i) for i in range(10000)]}, 400, "stop", "at most 8 are allowed"),
    (COMPLETIONS, {"n": 5}, 400, "n", "at most 4 (max_n)"),
    (COMPLETIONS, {"model": "gpt-5"}, 404, "model", "The model `gpt-5` does not exist."),
    (CHAT, {"model": "gpt-5"}, 404, "model", "does not exist"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", "must not be empty"),
    (COMPLETIONS, {"prompt": [[]]}, 400, "prompt", "non-empty list of token ids"),
    (COMPLETIONS, {"prompt": "word " * 600}, 400, "prompt", "max_model_len=512 leaves no room"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages", "maximum context length"),
    (COMPLETIONS, {"suffix": "The end."}, 400, "suffix", "suffix is not supported"),
    (COMPLETIONS, {"max_tokens": 0}, 400, "max_tokens", "0 is allowed only with echo: true"),
    (COMPLETIONS, {"best_of": 3}, 400, "best_of", "best_of must equal n"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "needs a server started with --enable-auto-tool-choice"),
    (CHAT, {"tool_choice": "auto"}, 400, "tool_choice", "tool_choice needs tools"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "none"}, 400, "tools",
     "tools.0.function.name"),
    (CHAT, {"response_format": {"type": "grammar"}}, 400, "response_format", "response_format.type must be one of"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     400, "response_format", 'response_format.json_schema.schema: cannot be compiled (xgrammar): Unsupported type'),
    (COMPLETIONS, {"guided_regex": "a(", "max_tokens": 4}, 400, "guided_regex", "parenthesis is not closed"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages", "this server takes no images: its model has no processor"),
    (COMPLETIONS, {"frobnicate": 1}, 400, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi", "tool_call_ids": "x"}]}, 400, "messages",
     "Unrecognized request argument supplied: messages.0.tool_call_ids"),
    (COMPLETIONS, {"max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    (COMPLETIONS, {"logit_bias": {"dog": 5}}, 400, "logit_bias", "token ids"),
    (COMPLETIONS, {"logit_bias": {"5000": 5}}, 400, "logit_bias", "in [0, 512)"),
    (COMPLETIONS, {"logit_bias": {"5": 500}}, 400, "logit_bias", "[-100, 100]"),
    (COMPLETIONS, {"stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed with stream"),
    (COMPLETIONS, {"prompt": ["Hi"] * 17}, 400, "prompt", "queues at most 16 requests"),
])
def test_bad_values_get_the_right_status_naming_the_field(server, path, body, status, param, message):
    """Items 5-9: 500 for logprobs 1000 / NaN, 200 for an unknown model, an empty
    prompt list answered with no choices, ignored tools / response_format / suffix / best_of, and 503 + Retry-After
    for a request that can never fit the queue."""
    base = {"prompt": "Once upon a time"} if path == COMPLETIONS else {"messages": MESSAGES}
    response = post(server, path, {**base, "max_tokens": 4, **body} if "max_completion_tokens" not in body
                    else {**base, **body})
    assert_error(response, status, param, message, code="model_not_found" if status == 404 else None)
    assert "retry-after" not in response.headers
    assert_idle(server, within=0.0)


def test_max_logprobs_is_the_limit_of_logprobs_and_top_logprobs(stories):
    """``--max-logprobs 30`` (the engine's max_logprobs) raises the limit of every logprobs field, as in vLLM: a
    fixed 20 refused ``logprobs`` / ``top_logprobs`` past it while ``prompt_logprobs`` took 30."""
    with serving(stories, 16, **ENGINE_OPTIONS, max_logprobs=30) as served:
        body = {"prompt": "Once upon a time", "max_tokens": 1, "logprobs": 25, "echo": True, "temperature": 0}
        choice = post(served, COMPLETIONS, body).json()["choices"][0]
        assert all(len(top) >= 25 for top in choice["logprobs"]["top_logprobs"][1:])
        body = {"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": 25}
        assert len(post(served, CHAT, body).json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
        assert_error(post(served, CHAT, {**body, "top_logprobs": 31}), 400, "top_logprobs", "at most 30")
        assert_idle(served, within=0.0)


def test_bodies_past_the_limit_are_413_at_once(server):
    """Item 3: a 20 MB body took 24.6 s to be rejected."""
    started = time.monotonic()
    big = json.dumps({"prompt": "a" * (20 * 2**20)}).encode()
    assert_error(post(server, COMPLETIONS, content=big), 413, None, "at most 16777216", code="request_too_large")

    def chunks():  # no Content-Length: the server counts the bytes as they come
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 2**20
        yield b'"}'

    assert_error(post(server, COMPLETIONS, content=chunks()), 413, None, "at most 16777216")
    assert time.monotonic() - started < 10  # measured: ~0.3 s for both on this machine


def test_routes_and_methods_that_do_not_exist_answer_in_the_same_shape(server):
    assert_error(httpx.get(server[0].url + "/v1/engines"), 404, None, "Not Found")
    assert_error(httpx.get(server[0].url + COMPLETIONS), 405, None, "Method Not Allowed")


# ----------------------------------------------------------------------------- 8: parameters are honoured
def test_seed_and_logit_bias_are_honoured(stories, server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
    texts = [post(server, COMPLETIONS, {**body, "seed": s}).json()["choices"][0]["text"] for s in (7, 7, 8)]
    assert texts[0] == texts[1] == solo_text(stories, "Once upon a time", max_tokens=12, temperature=1.0, seed=7)
    assert texts[2] != texts[0]
    model, tok = stories
    dog = tok("dog", add_special_tokens=False)["input_ids"][-1]
    biased = post(server, COMPLETIONS, {**body, "seed": 7, "logit_bias": {str(dog): 100}}).json()
    assert biased["choices"][0]["text"] == solo_text(stories, "Once upon a time", max_tokens=12, temperature=1.0,
                                                     seed=7, logit_bias={dog: 100})
    assert biased["choices"][0]["text"] == output_text(tok, tok("Once upon a time")["input_ids"], [dog] * 12)
    only = post(server, COMPLETIONS, {**body, "allowed_token_ids": [dog]}).json()  # vLLM's fields
    assert only["choices"][0]["text"] == biased["choices"][0]["text"]
    unbiased = post(server, COMPLETIONS, {**body, "seed": 7, "logit_bias": {str(dog): 100}, "bad_words": ["dog"]})
    assert "dog" not in unbiased.json()["choices"][0]["text"]


def test_bad_words_are_tokenized_off_the_engine_thread(server, monkeypatch):
    """A client's bad_words (which may be megabytes) are tokenized in a handler's worker thread: the engine thread,
    which steps every other request, never tokenizes them."""
    _, engine = server
    encode, threads = engine.tokenizer.encode, []

    def recording(text, *args, **kwargs):
        if "zebra" in text:
            threads.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", recording)
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "bad_words": ["zebra stripes"]}
    assert post(server, COMPLETIONS, body).status_code == 200
    assert threads and "paged-hf-engine" not in threads, threads


def test_a_default_max_tokens_fills_a_small_pool_not_past_it(stories):
    """On a pool that holds fewer tokens than the context, a chat completion without max_tokens (the context's room,
    vLLM's default) gets the room the pool leaves: a 200 with a length finish, never a 400 the client could not
    avoid; an explicit max_tokens past the pool is a 400 naming max_tokens."""
    with serving(stories, 16, block_size=8, num_blocks=24, enforce_eager=True) as (running, engine):
        assert engine.max_sequence_len == 24 * 8 + 1 < engine.max_model_len
        out = post((running, engine), CHAT, {"messages": MESSAGES, "ignore_eos": True, "temperature": 0}).json()
        assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == engine.max_sequence_len
        assert out["choices"][0]["finish_reason"] == "length"
        assert_error(post((running, engine), COMPLETIONS, {"prompt": "Once", "max_tokens": 300}), 400, "max_tokens",
                     "could never finish")


def test_max_tokens_is_filled_in_from_the_room_the_prompt_leaves(server):
    """Without max_tokens a completion gets vLLM's (and OpenAI's) 16 tokens or what fits, a chat completion the
    room its prompt leaves (vLLM's default); nothing is cut."""
    prompt = [1] + [400] * 499
    out = post(server, COMPLETIONS, {"prompt": prompt, "ignore_eos": True, "temperature": 0}).json()
    assert out["usage"]["completion_tokens"] == 12 and out["choices"][0]["finish_reason"] == "length"
    out = post(server, COMPLETIONS, {"prompt": "Once upon a time", "ignore_eos": True, "temperature": 0}).json()
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"
    out = post(server, CHAT, {"messages": MESSAGES, "ignore_eos": True, "temperature": 0}).json()
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == 512
    assert out["choices"][0]["finish_reason"] == "length"
    # a max_tokens past the context stops at it with a length finish (vLLM 0.32 caps it so; OpenAI answers 400)
    out = post(server, COMPLETIONS, {"prompt": prompt, "max_tokens": 10**9, "ignore_eos": True, "temperature": 0})
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] == 12 and out.json()["choices"][0]["finish_reason"] == "length"
    out = post(server, CHAT, {"messages": MESSAGES, "max_completion_tokens": 10**9, "ignore_eos": True,
                              "temperature": 0}).json()
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == 512


def test_min_tokens_is_checked_against_the_default_max_tokens_of_its_endpoint(server):
    """A chat completion without max_tokens may ask min_tokens past a completion's 16: its max_tokens is the room
    its prompt leaves (vLLM's), not 16. A completion without max_tokens gets 16, so min_tokens=20 is a 400, as
    vLLM's."""
    out = post(server, CHAT, {"messages": MESSAGES, "min_tokens": 20, "stop": ["."], "temperature": 0})
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] >= 20
    assert_error(post(server, COMPLETIONS, {"prompt": "Once", "min_tokens": 20}), 400, "min_tokens", "[0, 16]")


def stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server[0].url + path, json={**body, "stream": True}, timeout=60) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streamed_logprobs_equal_the_whole_responses(server):
    """Streams carry each token's logprobs in the chunk that carries it; together they equal the whole response's."""
    body = {"prompt": story_openings()[0], "max_tokens": 24, "temperature": 0, "logprobs": 3}
    whole = post(server, COMPLETIONS, body).json()["choices"][0]["logprobs"]
    parts = [c["choices"][0]["logprobs"] for c in stream(server, COMPLETIONS, body) if c["choices"][0]["logprobs"]]
    joined = {key: [v for part in parts for v in part[key]] for key in whole}
    assert joined["tokens"] == whole["tokens"] and joined["text_offset"] == whole["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-5)  # a prefix hit or not
    assert [sorted(t) for t in joined["top_logprobs"]] == [sorted(t) for t in whole["top_logprobs"]]
    assert len(whole["tokens"]) == 24
    assert all(len(top) in (3, 4) for top in whole["top_logprobs"])
    body = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    response = post(server, CHAT, body).json()
    whole = response["choices"][0]
    chunks = stream(server, CHAT, body)
    content = [entry for c in chunks if c["choices"][0]["logprobs"] for entry in c["choices"][0]["logprobs"]["content"]]
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in content] == \
        [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in whole["logprobs"]["content"]]
    assert [e["logprob"] for e in content] == pytest.approx([e["logprob"] for e in whole["logprobs"]["content"]],
                                                            abs=1e-5)
    assert len(content) == response["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in content) == whole["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 and bytes(e["bytes"]).decode() == e["token"] for e in content)
