"""Faults at run time (issue #12, items 2, 3, 10, 12): clients that leave, a prompt that takes seconds to tokenize,
a request whose forward raises while others stream, and an engine loop that dies."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'paged_hf[server]')")
httpx = pytest.importorskip("httpx", reason="the tests send raw requests")

from paged_hf import PagedEngine, SamplingParams  # noqa: E402
from models import output_text, story_openings  # noqa: E402
from test_engine_isolation import poisoned  # noqa: E402
from test_server import chat_stories  # noqa: E402
from test_server import serving as serve  # noqa: E402
from test_server_errors import COMPLETIONS, assert_error, assert_idle  # noqa: E402

STOP_WITHIN = 1.5  # seconds from the client leaving to the engine holding nothing


@pytest.fixture(scope="module")
def stories():
    return chat_stories()


def serving(stories, **options):
    """This file's server: a roomy pool, queue 16."""
    return serve(stories, 16, **{"block_size": 16, "num_blocks": 1024, "max_num_seqs": 32, **options})


async def stream_events(http, url: str, body: dict, on_first=None) -> tuple[list[str], float]:
    """The ``data:`` payloads of a stream and the longest gap between two of them; ``on_first`` runs (as a task)
    when the first arrives."""
    events, stamps, task = [], [], None
    async with http.stream("POST", url + COMPLETIONS, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                stamps.append(time.monotonic())
                if task is None and on_first is not None:
                    task = asyncio.ensure_future(on_first())
    if task is not None:
        await task
    return events, max(b - a for a, b in zip(stamps, stamps[1:]))


def test_a_client_that_leaves_a_non_streaming_n16_request_stops_it(stories):
    """Item 2: ``n=16, max_tokens=480`` ran to the end after its client had gone (464 KV blocks)."""
    with serving(stories) as server:
        body = {"prompt": story_openings()[1], "n": 16, "max_tokens": 480, "ignore_eos": True, "temperature": 1.0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server[0].url + COMPLETIONS, json=body, timeout=0.5)
        assert_idle(server, within=STOP_WITHIN)
        generated = server[1].get_stats()["generated_tokens"]
        assert generated < 16 * 480 // 2, f"{generated} of {16 * 480} tokens for a client that left"  # seen: ~1900


def test_tokenizing_a_huge_prompt_does_not_stall_a_running_stream(stories):
    """Item 3: a 4 MB prompt raised a concurrent stream's longest gap between events from 0.02 s to 5.1 s. Here the
    context is 600,000 tokens, so a 3 MB prompt passes the length pre-check and is tokenized (seconds) before it is
    refused (~880,000 tokens): in a worker thread, while the engine keeps streaming."""
    big = "Once upon a time there was a dog. " * 90_000
    with serving(stories, max_model_len=600_000) as server:
        async def main():
            async with httpx.AsyncClient(timeout=120) as http:
                refused = {}

                async def send_big():
                    started = time.monotonic()
                    refused["response"] = await http.post(server[0].url + COMPLETIONS,
                                                          json={"prompt": big, "max_tokens": 4})
                    refused["seconds"] = time.monotonic() - started

                body = {"prompt": story_openings()[0], "max_tokens": 480, "ignore_eos": True, "temperature": 0}
                events, gap = await stream_events(http, server[0].url, body, on_first=send_big)
                return events, gap, refused

        events, gap, refused = asyncio.run(main())
    assert_error(refused["response"], 400, "prompt", "maximum context length is 600000 tokens")
    assert refused["seconds"] > 1.0, "the prompt must take a while to tokenize, or the test shows nothing"
    assert events[-1] == "[DONE]" and len(events) > 100
    assert gap < 1.5, f"the stream stalled {gap:.2f} s while a prompt was tokenized"  # measured: 0.05-0.08 s


def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(stories):
    with serving(stories) as server:
        started = time.monotonic()
        response = httpx.post(server[0].url + COMPLETIONS, json={"prompt": "Once upon a time. " * 230_000},
                              timeout=60)
        assert_error(response, 400, "prompt", "characters long")
        assert time.monotonic() - started < 1.0  # tokenizing it would take ~5 s


def pick_poison(stories, prompt: str, max_tokens: int, text_tokens: int) -> tuple[int, str]:
    """A token that ``prompt``'s greedy continuation (ignore_eos, ``max_tokens``) never holds, and the text of the
    first ``text_tokens`` tokens of that continuation."""
    model, tok = stories
    out = PagedEngine(model, tok, block_size=16, num_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    seen = set(out.outputs[0].token_ids) | set(tok(prompt)["input_ids"])
    text = output_text(tok, out.prompt_token_ids, out.outputs[0].token_ids[:text_tokens])
    return next(t for t in range(300, 512) if t not in seen), text


def test_a_request_whose_forward_raises_fails_alone_and_its_stream_ends_with_the_error(stories):
    """Items 1 and 10: the failing stream's error event is its last before ``[DONE]`` (no "stop" chunk after it); a
    concurrent stream is untouched; a non-streaming request with a failing prompt gets a 500 and its other prompt
    is aborted."""
    model, _ = stories
    poison, alone = pick_poison(stories, story_openings()[0], 300, 64)
    doomed = {"prompt": story_openings()[2], "max_tokens": 64, "temperature": 0, "logit_bias": {str(poison): 100}}
    good = {"prompt": story_openings()[0], "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    with serving(stories) as server, poisoned(model, poison):
        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.gather(stream_events(http, server[0].url, doomed),
                                            stream_events(http, server[0].url, good))

        (bad_events, _), (good_events, _) = asyncio.run(main())
        mixed = httpx.post(server[0].url + COMPLETIONS, timeout=60, json={
            **doomed, "prompt": [story_openings()[0], story_openings()[2]], "max_tokens": 300, "ignore_eos": True})
        assert_error(mixed, 500, None, f"poisoned input: token {poison}")
        assert_idle(server, within=STOP_WITHIN)
    assert bad_events[-1] == "[DONE]"
    error = json.loads(bad_events[-2])["error"]
    assert error["type"] == "server_error" and f"poisoned input: token {poison}" in error["message"]
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in bad_events[:-2])
    chunks = [json.loads(e) for e in good_events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == alone
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_dead_engine_loop_answers_500_at_once_and_health_503(stories, caplog):
    """Item 12: the loop thread had no guard: handlers waited forever and /health said ok; nothing was logged."""
    with serving(stories) as server:
        running, engine = server
        real_step, calls = engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("scheduler bug")
            return real_step()

        engine.step = failing_step
        body = {"prompt": story_openings()[0], "max_tokens": 200, "ignore_eos": True}
        with caplog.at_level(logging.CRITICAL, logger="paged_hf"):
            async def main():
                async with httpx.AsyncClient(timeout=30) as http:
                    streamed = stream_events(http, running.url, body)
                    waiting = http.post(running.url + COMPLETIONS, json=body)
                    return await asyncio.gather(streamed, waiting)

            started = time.monotonic()
            (events, _), response = asyncio.run(main())
            assert time.monotonic() - started < 5
        assert_error(response, 500, None, "the engine loop died: RuntimeError: scheduler bug")
        assert events[-1] == "[DONE]" and "scheduler bug" in json.loads(events[-2])["error"]["message"]
        assert_error(httpx.post(running.url + COMPLETIONS, json=body, timeout=5), 500, None, "scheduler bug")
        assert_error(httpx.get(running.url + "/health"), 503, None, "scheduler bug", code="engine_dead")
        assert any(r.levelno == logging.CRITICAL and "engine loop died" in r.getMessage() and r.exc_info
                   for r in caplog.records)
