"""The OpenAI-compatible server, driven by the real `openai` client over 127.0.0.1.

Texts are checked against ``generate`` or ``PagedEngine.generate``. A dropped client and logprobs: see
``test_server_contract.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
uvicorn = pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'paged_hf[server]')")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")
httpx = pytest.importorskip("httpx", reason="the backpressure test sends raw requests")

from paged_hf import PagedEngine, SamplingParams  # noqa: E402
from paged_hf.server.app import build_app  # noqa: E402
from models import output_text, stories_model, stories_tokenizer, story_openings  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


class Server:
    """uvicorn in a thread on a free loopback port; stopped by the fixture."""

    def __init__(self, app) -> None:
        self.app = app
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def chat_stories():
    """stories260K (sdpa) and its tokenizer, with a plain chat template."""
    tok = stories_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return stories_model("sdpa"), tok


@contextlib.contextmanager
def serving(stories, max_queue_len: int, max_request_bytes: int | None = None, **engine_options):
    """``(running Server, engine)``: the app over a fresh ``PagedEngine(**engine_options)`` of ``stories``, served
    until the block ends."""
    model, tok = stories
    engine = PagedEngine(model, tok, **engine_options)
    limits = {} if max_request_bytes is None else {"max_request_bytes": max_request_bytes}
    running = Server(build_app(engine, "stories260K", max_queue_len=max_queue_len, **limits))
    try:
        yield running, engine
    finally:
        running.stop()


@pytest.fixture(scope="module")
def stories():
    return chat_stories()


@pytest.fixture(scope="module")
def server(stories):
    with serving(stories, 64, block_size=8, max_num_seqs=16, max_num_batched_tokens=256) as served:
        yield served
    stories[0].set_attn_implementation("sdpa")


@pytest.fixture()
def client(server):
    running, _ = server
    return openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(server, name: str) -> float:
    text = httpx.get(server[0].url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def greedy_reference(stories, prompt: str, max_tokens: int, add_special_tokens: bool = True) -> str:
    model, tok = stories
    attn = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    ids = tok(prompt, return_tensors="pt", add_special_tokens=add_special_tokens)
    out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
    model.set_attn_implementation(attn)
    return output_text(tok, ids["input_ids"][0].tolist(), out[0, ids["input_ids"].shape[1]:].tolist())


def engine_texts(stories, prompts: list, params: list[SamplingParams]) -> list[list[str]]:
    """The text of every sample of each request, by ``PagedEngine.generate`` on a second engine over the same model
    (call it while the server is idle)."""
    model, tok = stories
    outs = PagedEngine(model, tok, block_size=8, num_blocks=256).generate(prompts, params, use_tqdm=False)
    return [[c.text for c in out.outputs] for out in outs]


def test_completions_greedy_equal_generate(stories, client):
    prompt = story_openings()[0]
    expected = greedy_reference(stories, prompt, 24)
    out = client.completions.create(model="stories260K", prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected
    assert out.usage.completion_tokens == 24 and out.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="stories260K", prompt=prompt, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected
    chunks = list(client.completions.create(model="stories260K", prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_chat_stop_and_n(stories, client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    out = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=20, temperature=0)
    text = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant" and text
    prompt = CHAT_TEMPLATE.replace("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
                                   "user: Tell me a story.\n")
    # as transformers does, the chat template's text is tokenized without extra special tokens
    assert text == greedy_reference(stories, prompt, 20, add_special_tokens=False)
    chunks = list(client.chat.completions.create(model="stories260K", messages=messages, max_tokens=20,
                                                 temperature=0, stream=True, n=2))
    # each choice opens with a role-only chunk (as vLLM and OpenAI send it), then only content
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert (mine[0].delta.role, mine[0].delta.content, mine[0].finish_reason) == ("assistant", "", None)
        assert all(c.delta.role is None for c in mine[1:]) and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == text
    stop = greedy_reference(stories, story_openings()[0], 24).split()[2]
    stopped = client.completions.create(model="stories260K", prompt=story_openings()[0], max_tokens=24,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    several = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=8,
                                        temperature=1.0, n=3, seed=5)
    (expected,) = engine_texts(stories, ["Once upon a time"], [SamplingParams(n=3, max_tokens=8, temperature=1.0,
                                                                              seed=5)])
    assert len(set(expected)) > 1, "seed 5 must give different samples"
    assert [c.text for c in sorted(several.choices, key=lambda c: c.index)] == expected
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories260K"]


def test_invalid_request_is_400_naming_the_field(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="stories260K", prompt="Hi", max_tokens=4, top_p=0)
    assert info.value.body["param"] == "top_p"
    response = httpx.post(server[0].url + "/v1/completions", json={"prompt": "Hi", "max_tokens": "many"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    response = httpx.post(server[0].url + "/v1/completions", json={"prompt": "word " * 600, "max_tokens": 4})
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]


def test_load_32_streaming_clients_then_no_blocks_in_use(stories, server):
    running, engine = server
    cases = [(story_openings()[i % 5], 8 + i % 9) for i in range(128)]
    distinct = sorted(set(cases))
    texts = engine_texts(stories, [p for p, _ in distinct], [SamplingParams(max_tokens=n, temperature=0)
                                                             for _, n in distinct])
    expected = {case: text for case, (text,) in zip(distinct, texts)}

    async def one(http, i):
        prompt, max_tokens = cases[i]
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        async with http.stream("POST", running.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        return "".join(c["choices"][0]["text"] for c in chunks)

    async def main():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            semaphore = asyncio.Semaphore(32)

            async def bounded(i):
                async with semaphore:
                    return await one(http, i)

            return await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(128))), timeout=600)

    streamed = asyncio.run(main())
    assert streamed == [expected[case] for case in cases]
    time.sleep(0.6)
    assert metric(server, "paged_hf_kv_cache_blocks_used") == 0
    assert metric(server, "paged_hf_time_to_first_token_seconds_count") >= 128


def test_a_request_that_can_never_run_is_a_400_even_while_the_queue_is_full(server):
    """503 + Retry-After says "retry later": a request the engine would refuse whatever its state (ids outside the
    vocabulary, a prompt past the context, a logit_bias outside the vocabulary) gets its 400 naming the field
    instead, full queue or not."""
    running, _ = server
    loop = running.app.state.engine_loop
    with loop._lock:
        loop._pending += loop.max_queue_len  # the queue is full
    try:
        url = running.url + "/v1/completions"
        assert httpx.post(url, json={"prompt": "Once", "max_tokens": 2}, timeout=60).status_code == 503
        for body, param in (({"prompt": [1, 600]}, "prompt"), ({"prompt": [1] + [5] * 600}, "prompt"),
                            ({"prompt": "Once", "logit_bias": {"9999": 1}}, "logit_bias"),
                            ({"prompt": "Once", "allowed_token_ids": [9999]}, "allowed_token_ids")):
            response = httpx.post(url, json=body, timeout=60)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    finally:
        with loop._lock:
            loop._pending -= loop.max_queue_len


def test_flood_past_queue_limit_gets_503_and_admitted_requests_finish(stories):
    model, tok = stories
    attn = model.config._attn_implementation  # the module's server (if running) needs it back
    engine = PagedEngine(model, tok, block_size=8, max_num_seqs=2, max_num_batched_tokens=64)
    running = Server(build_app(engine, "stories260K", max_queue_len=4))
    try:
        async def main():
            async with httpx.AsyncClient(timeout=300) as http:
                body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(http.post(running.url + "/v1/completions", json=body)
                                              for _ in range(40)))

        responses = asyncio.run(main())
        codes = [r.status_code for r in responses]
        assert 503 in codes and 200 in codes
        assert all(r.headers.get("retry-after") == "1" for r in responses if r.status_code == 503)
        (expected,) = engine_texts(stories, ["Once upon a time"], [SamplingParams(max_tokens=32, temperature=0,
                                                                                  ignore_eos=True)])
        texts = [r.json()["choices"][0]["text"] for r in responses if r.status_code == 200]
        assert texts == expected * codes.count(200)
        time.sleep(0.6)
        assert engine.get_stats()["kv_cache_used"] == 0
    finally:
        running.stop()
        model.set_attn_implementation(attn)


def test_first_token_keeps_its_space_in_text_stream_and_logprobs(stories, client):
    """SentencePiece: the first output token's leading space is part of the text, the first streamed chunk and the
    first logprobs entry, as in ``decode(prompt + output)`` (it was decoded alone, without the prompt)."""
    whole = client.completions.create(model="stories260K", prompt="Lily and Tom", max_tokens=6, temperature=0,
                                      logprobs=2)
    text = whole.choices[0].text
    assert text.startswith(" were") and text == greedy_reference(stories, "Lily and Tom", 6)
    assert "".join(whole.choices[0].logprobs.tokens) == text
    assert all(name.startswith(" ") for name in whole.choices[0].logprobs.top_logprobs[0])
    chunks = [c.choices[0].text for c in client.completions.create(
        model="stories260K", prompt="Lily and Tom", max_tokens=6, temperature=0, stream=True) if c.choices]
    assert chunks[0].startswith(" we") and "".join(chunks) == text
