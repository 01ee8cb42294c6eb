"""The server's promises that ``test_server.py`` could not see fail: a client that leaves stops its request at once,
and logprobs asked for come back equal to the engine's.

Disconnects: a dedicated server whose stories260K engine allows 4096 tokens, and a request for ``MAX_TOKENS`` tokens
(ignore_eos) that would run for seconds. Its client leaves after the first chunk (streaming) or after
``CLIENT_TIMEOUT`` (non-streaming); the engine must hold no request within ``STOP_WITHIN`` seconds and must have
generated far fewer tokens than asked.
"""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'paged_hf[server]')")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")
httpx = pytest.importorskip("httpx", reason="the disconnect tests send raw requests")

from paged_hf import PagedEngine, SamplingParams  # noqa: E402
from models import story_openings  # noqa: E402
from test_server import chat_stories, serving  # noqa: E402

ENGINE_OPTIONS = dict(block_size=16, num_blocks=512, max_model_len=4096, max_num_seqs=4)
MAX_TOKENS = 2000  # ~9 s of decoding alone on this 2-core machine (~220 tokens/s)
CLIENT_TIMEOUT = 0.5  # the non-streaming client gives up after this many seconds
STOP_WITHIN = 1.5  # seconds from the client leaving to the engine holding nothing


def logprob_entries(completion) -> list[tuple[float, dict[int, float]]]:
    """(logprob of the sampled token, {token id: logprob} of the top alternatives) per token of a
    ``CompletionOutput``: the one place that knows the engine's logprobs format."""
    return [(entry[token].logprob, {tid: lp.logprob for tid, lp in entry.items() if lp.rank <= len(entry)})
            for entry, token in zip(completion.logprobs, completion.token_ids)]


@pytest.fixture(scope="module")
def stories():
    return chat_stories()


@pytest.fixture(scope="module")
def server(stories):
    with serving(stories, 8, **ENGINE_OPTIONS) as served:
        yield served


@pytest.fixture()
def idle_server(server):
    """The server, idle before the test; after it, whatever the test left running is aborted (so that a failed
    disconnect test does not leave a request decoding for the rest of the session)."""
    running, engine = server
    assert wait_until_idle(running, time.monotonic() + 30), "the server is still busy from an earlier test"
    yield running, engine
    for request_id in list(engine.requests):
        running.app.state.engine_loop.abort(request_id)
    assert wait_until_idle(running, time.monotonic() + 30)


def metrics(running) -> dict[str, float]:
    text = httpx.get(running.url + "/metrics").text
    return {name: float(value) for name, value in re.findall(r"^(paged_hf_\w+) (\S+)$", text, re.M)}


def wait_until_idle(running, deadline: float) -> float | None:
    """The time at which the engine holds no request and no block, or None if that is not so by ``deadline``."""
    while True:
        now = time.monotonic()
        m = metrics(running)
        if m["paged_hf_requests_running"] == m["paged_hf_requests_waiting"] == m["paged_hf_kv_cache_blocks_used"] == 0:
            return now
        if now > deadline:
            return None
        time.sleep(0.02)


def long_request(stream: bool) -> dict:
    return {"prompt": story_openings()[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def assert_stopped_soon(running, engine, generated_before: int, left: float) -> None:
    stopped = wait_until_idle(running, left + STOP_WITHIN)
    assert stopped is not None, f"the request still ran {STOP_WITHIN} s after its client left"
    generated = engine.get_stats()["generated_tokens"] - generated_before  # the engine is idle: safe to read
    assert generated < MAX_TOKENS // 4, f"{generated} of {MAX_TOKENS} tokens generated for a client that left"


def test_dropped_stream_stops_its_request(idle_server):
    running, engine = idle_server
    before = engine.get_stats()["generated_tokens"]
    with httpx.stream("POST", running.url + "/v1/completions", json=long_request(stream=True), timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first chunk arrived: leave mid-stream
    left = time.monotonic()
    assert_stopped_soon(running, engine, before, left)


def test_dropped_non_streaming_request_stops(idle_server):
    running, engine = idle_server
    before = engine.get_stats()["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(running.url + "/v1/completions", json=long_request(stream=False), timeout=CLIENT_TIMEOUT)
    left = time.monotonic()
    assert_stopped_soon(running, engine, before, left)


# ----------------------------------------------------------------------------------------------------- logprobs

def engine_logprobs(stories, prompt, max_tokens: int, top: int):
    """The engine's own answer, on a second engine over the same model (the server's is idle meanwhile)."""
    model, tok = stories
    engine = PagedEngine(model, tok, **ENGINE_OPTIONS)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=top)
    out = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return out.text, logprob_entries(out)


def test_metrics_count_the_engine_steps_and_their_tokens(idle_server):
    """``paged_hf_engine_steps`` / ``paged_hf_engine_step_tokens`` are the engine's totals: a request of 8 tokens
    adds at least its prompt (one chunk or more) and 7 decode steps (a salt of its own: no prefix hit)."""
    running, engine = idle_server
    before = metrics(running)
    prompt = story_openings()[0]
    response = httpx.post(running.url + "/v1/completions", timeout=60,
                          json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                "cache_salt": f"steps-{time.monotonic_ns()}"})
    assert response.status_code == 200
    assert wait_until_idle(running, time.monotonic() + 30) is not None
    after, stats = metrics(running), engine.get_stats()  # idle: safe to read
    assert after["paged_hf_engine_steps"] == stats["num_steps"] >= before["paged_hf_engine_steps"] + 8
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    assert after["paged_hf_engine_step_tokens"] - before["paged_hf_engine_step_tokens"] == prompt_tokens + 7
    assert after["paged_hf_engine_step_tokens"] == stats["num_step_tokens"]


def test_completion_logprobs_equal_the_engines(stories, idle_server):
    running, _ = idle_server
    prompt = story_openings()[0]
    text, expected = engine_logprobs(stories, prompt, 8, 2)
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    choice = client.completions.create(model="stories260K", prompt=prompt, max_tokens=8, temperature=0,
                                       logprobs=2).choices[0]
    assert choice.text == text
    got = choice.logprobs
    assert len(got.tokens) == len(expected) and "".join(got.tokens) == text
    assert got.token_logprobs == pytest.approx([lp for lp, _ in expected], abs=1e-5)
    assert [sorted(t.values()) for t in got.top_logprobs] == [
        pytest.approx(sorted(top.values()), abs=1e-5) for _, top in expected
    ]


def test_chat_logprobs_equal_the_engines(stories, idle_server):
    running, _ = idle_server
    messages = [{"role": "user", "content": "Tell me a story."}]
    text, expected = engine_logprobs(stories, messages, 8, 2)
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    choice = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=2).choices[0]
    assert choice.message.content == text
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp for lp, _ in expected], abs=1e-5)
    assert [sorted(t.logprob for t in c.top_logprobs) for c in content] == [
        pytest.approx(sorted(top.values()), abs=1e-5) for _, top in expected
    ]
