"""The server against random bodies (hypothesis) and under load with faults (``benchmarks/fault_load.py``'s
scenario): never a 500, never an error that is not OpenAI's JSON, every good request its solo text, KV blocks back
to 0 and ``/health`` ok afterwards."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'paged_hf[server]')")
httpx = pytest.importorskip("httpx", reason="the tests send raw requests")

from paged_hf import PagedEngine  # noqa: E402
from models import story_openings  # noqa: E402
from test_server import chat_stories, serving  # noqa: E402
from test_server_errors import assert_idle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fault_load  # noqa: E402


@pytest.fixture(scope="module")
def stories():
    return chat_stories()


@pytest.fixture(scope="module")
def server(stories):
    """A short context (64 tokens) and n <= 4, so that any request a fuzzer builds finishes in a fraction of a second."""
    with serving(stories, 64, max_request_bytes=1 << 16, block_size=8, num_blocks=256, max_num_seqs=16,
                 max_model_len=64, max_n=4, max_stop_strings=8) as served:
        yield served


# ------------------------------------------------------------------------------------------------ bodies
LONE = ["\ud800", "a\udfffb", "\udbff"]
text = st.one_of(st.text(max_size=12), st.sampled_from(LONE + ["Once upon a time", "", "The dog"]))
number = st.one_of(st.integers(-3, 40), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]))
scalar = st.one_of(st.none(), st.booleans(), number, text)
anything = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(text, inner, max_size=4)), max_leaves=12)
token_ids = st.lists(st.one_of(st.integers(0, 511), st.integers(-5, 2**40)), max_size=8)
prompt = st.one_of(text, token_ids, st.lists(text, max_size=3), st.lists(token_ids, max_size=3), anything)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
                                 "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=2),
                                     anything)},
                                optional={"name": text, "tool_call_id": text})
FIELDS = {
    "model": st.sampled_from(["stories260K", "gpt-5", None]), "max_tokens": st.one_of(st.integers(0, 24), number),
    "temperature": number, "top_p": number, "top_k": number, "min_p": number, "n": st.integers(-1, 6),
    "stream": st.booleans(), "stream_options": st.one_of(st.just({"include_usage": True}), anything),
    "stop": st.one_of(text, st.lists(text, max_size=10), number), "seed": number, "presence_penalty": number,
    "frequency_penalty": number, "repetition_penalty": number, "logprobs": st.one_of(st.integers(-1, 6), st.booleans(),
                                                                                     number),
    "top_logprobs": st.one_of(st.integers(-1, 22), number), "echo": st.booleans(), "suffix": text,
    "best_of": st.integers(0, 5), "ignore_eos": st.one_of(st.booleans(), anything),
    "stop_token_ids": st.one_of(token_ids, anything), "min_tokens": st.integers(-1, 30),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-3, 600).map(str), text), number, max_size=3),
                            anything),
    "tools": anything, "response_format": st.one_of(st.just({"type": "text"}), anything), "user": text,
    "max_completion_tokens": st.integers(0, 24), "unknown_field": anything,
}
shaped = st.fixed_dictionaries({}, optional={"prompt": prompt, "messages": st.lists(message, max_size=3),
                                             **FIELDS})


@st.composite
def bodies(draw, path: str) -> bytes:
    """Raw bytes, any JSON, fields of any shape, or (half the time) a valid body with up to two fields changed."""
    kind = draw(st.sampled_from(["valid"] * 6 + ["shaped", "shaped", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "valid":
        value = {"max_tokens": draw(st.integers(1, 16)), "temperature": draw(st.sampled_from([0, 0.7, 1.0])),
                 "stream": draw(st.booleans())}
        opening = st.sampled_from(story_openings()[:3])
        if path.endswith("chat/completions"):
            value["messages"] = [{"role": "user", "content": draw(st.one_of(opening, text))}]
        else:
            value["prompt"] = draw(st.one_of(opening, opening, text, st.lists(st.one_of(opening, text), max_size=3),
                                             st.lists(st.integers(3, 511), min_size=1, max_size=8), token_ids))
        for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
            value[name] = draw(FIELDS[name])
    else:
        value = draw(shaped if kind == "shaped" else anything)
    return json.dumps(value, ensure_ascii=draw(st.booleans()), allow_nan=True).encode("utf-8", "surrogatepass")


def test_random_bodies_never_get_a_500_or_a_non_json_error(server):
    running, engine = server

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def post_one(data):
        path = data.draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
        body = data.draw(bodies(path))
        with httpx.stream("POST", running.url + path, content=body, timeout=60) as response:
            raw = response.read()
        assert response.status_code in (200, 400, 404, 413), (response.status_code, raw[:300])
        event(f"status {response.status_code}")
        if response.status_code != 200:
            error = json.loads(raw)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            return
        if response.headers["content-type"].startswith("text/event-stream"):
            events = [line[len("data: "):] for line in raw.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert all("error" not in json.loads(e) for e in events[:-1]), events
        else:
            assert json.loads(raw)["choices"]

    post_one()
    # afterwards: nothing held, the server healthy
    assert_idle(server, within=5.0)
    assert httpx.get(running.url + "/health").json() == {"status": "ok"}
    engine.check_invariants()


# ---------------------------------------------------------------------------------------- load with faults
def test_64_clients_with_bad_requests_and_disconnects(stories):
    """One in eight sends a bad request, one in eight leaves mid-request: the good ones get their solo texts."""
    model, tok = stories
    cases = fault_load.make_cases(story_openings(), 64, seed=0)
    fault_load.fill_expected(PagedEngine(model, tok, block_size=16, num_blocks=256, enable_prefix_caching=False),
                             cases)
    with serving(stories, 256, block_size=16, num_blocks=2048, max_num_seqs=64,
                 max_num_batched_tokens=512) as (running, engine):
        outcomes = asyncio.run(fault_load.run_clients(running.url, cases, leave_after=0.5))
        to_idle, stats = fault_load.idle_after(running.app.state.engine_loop, timeout=10)
        health = httpx.get(running.url + "/health").json()
        metrics = running.app.state.engine_loop.on_output.__self__
        unfinished = dict(metrics._last)  # what the metrics keep per request: nothing once every request is gone
    report = fault_load.summarize(cases, outcomes)
    assert report["requests"] == {"good": 48, "bad": 8, "leave": 8}
    assert report["good_equal_solo"] == 48, report["good_mismatches"][:3]
    assert report["bad_4xx"] == 8 and report["left"] == 8
    assert to_idle < 1.5, f"idle only {to_idle:.2f} s after the last client: the leavers kept running"
    assert stats["kv_cache_used"] == 0 and health == {"status": "ok"}
    assert not unfinished, f"the metrics kept {len(unfinished)} requests that left"
    engine.check_invariants()
