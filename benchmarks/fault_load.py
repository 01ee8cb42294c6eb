"""The server under load with faults: concurrent clients of which one in eight sends a bad request and one in eight
disconnects mid-request; every good request must get the text of its solo run (greedy), every bad one a 4xx, and
the KV blocks must go back to 0.

Clients (``--clients``, all at once): slot ``i % 8 == 3`` sends a bad request (cycling through ``BAD_REQUESTS``:
an out-of-vocabulary id, NaN, logprobs 1000, an unknown model, malformed JSON, a lone surrogate, 10,000 stop
strings, a negative max_tokens, tools), slot 6 asks for 400 tokens (ignore_eos) and leaves (a stream after its first
event, a non-streaming request after ``--leave-after`` seconds), the other six send a good greedy request
(completion or chat, streamed or not, 8-32 tokens). The expected text of each good request comes from
``PagedEngine.generate`` on a second engine over the same model, one request at a time, before the load.

    PYTHONPATH=. python benchmarks/fault_load.py                      # stories260K, 64 clients
    PYTHONPATH=. python benchmarks/fault_load.py --clients 128 --seed 1

It prints the counts (requests and statuses by kind, good texts equal to their solo run, KV blocks in use once
idle, seconds from the last client to idle, the longest gap between two events of a good stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"

BAD_REQUESTS = [  # (path, JSON body or raw bytes)
    (COMPLETIONS, {"prompt": [1, 999999], "max_tokens": 16}),
    (COMPLETIONS, {"prompt": "Once upon a time", "temperature": "NaN"}),
    (COMPLETIONS, {"prompt": "Once upon a time", "logprobs": 1000}),
    (CHAT, {"model": "gpt-5", "messages": [{"role": "user", "content": "Hi"}]}),
    (COMPLETIONS, b'{"prompt": "Once upon a time", '),
    (COMPLETIONS, b'{"prompt": ["Once upon a time", "\\ud800"], "max_tokens": 400}'),
    (COMPLETIONS, {"prompt": "Once upon a time", "stop": [str(i) for i in range(10000)]}),
    (COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": -5}),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}),
]


@dataclass
class Case:
    kind: str  # "good", "bad" or "leave"
    path: str
    body: dict | bytes
    stream: bool
    expected: str | None = None


@dataclass
class Outcome:
    status: int | None = None
    text: str = ""
    error: str | None = None
    gaps: list[float] = field(default_factory=list)
    left: bool = False


def make_cases(openings: list[str], num_clients: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(num_clients):
        slot, prompt = i % 8, rng.choice(openings)
        if slot == 3:
            path, body = BAD_REQUESTS[(i // 8) % len(BAD_REQUESTS)]
            cases.append(Case("bad", path, body, stream=(i // 8) % 2 == 1 and isinstance(body, dict)))
        elif slot == 6:
            body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
            cases.append(Case("leave", COMPLETIONS, body, stream=(i // 8) % 2 == 0))
        else:
            body = {"max_tokens": rng.randint(8, 32), "temperature": 0, "ignore_eos": rng.random() < 0.5}
            if rng.random() < 0.25:
                cases.append(Case("good", CHAT, {**body, "messages": [{"role": "user", "content": prompt}]},
                                  stream=rng.random() < 0.5))
            else:
                cases.append(Case("good", COMPLETIONS, {**body, "prompt": prompt}, stream=rng.random() < 0.5))
    for case in cases:
        if case.stream and isinstance(case.body, dict):
            case.body = {**case.body, "stream": True}
    return cases


def fill_expected(engine, cases: list[Case]) -> None:
    """Each good case's solo greedy text, by ``engine.generate`` one request at a time."""
    from paged_hf import SamplingParams  # noqa: PLC0415

    for case in cases:
        if case.kind != "good":
            continue
        body = case.body
        prompt = body["messages"] if case.path == CHAT else body["prompt"]
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=body["ignore_eos"])
        case.expected = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


async def one_client(http, url: str, case: Case, leave_after: float) -> Outcome:
    import httpx  # noqa: PLC0415

    out = Outcome()
    kwargs = {"content": case.body} if isinstance(case.body, bytes) else {"json": case.body}
    try:
        if not case.stream:
            timeout = leave_after if case.kind == "leave" else None
            response = await http.post(url + case.path, timeout=timeout or http.timeout, **kwargs)
            out.status = response.status_code
            data = response.json()
            if response.status_code == 200:
                choice = data["choices"][0]
                out.text = choice["message"]["content"] if case.path == CHAT else choice["text"]
            else:
                out.error = data["error"]["message"]
            return out
        async with http.stream("POST", url + case.path, **kwargs) as response:
            out.status = response.status_code
            if response.status_code != 200:
                out.error = json.loads(await response.aread())["error"]["message"]
                return out
            last = None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                if last is not None:
                    out.gaps.append(now - last)
                last = now
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    out.error = event["error"]["message"]
                    continue
                choice = event["choices"][0] if event["choices"] else None
                if choice is not None:
                    out.text += (choice["delta"].get("content") or "") if case.path == CHAT else choice["text"]
                if case.kind == "leave":
                    out.left = True
                    return out  # leaves the stream open-ended: the context manager closes the connection
    except httpx.TimeoutException:
        out.left = True
    return out


async def run_clients(url: str, cases: list[Case], leave_after: float = 0.5) -> list[Outcome]:
    import httpx  # noqa: PLC0415

    limits = httpx.Limits(max_connections=len(cases) + 8, max_keepalive_connections=len(cases) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        return await asyncio.gather(*(one_client(http, url, c, leave_after) for c in cases))


def summarize(cases: list[Case], outcomes: list[Outcome]) -> dict:
    good = [(c, o) for c, o in zip(cases, outcomes) if c.kind == "good"]
    bad = [o for c, o in zip(cases, outcomes) if c.kind == "bad"]
    leave = [o for c, o in zip(cases, outcomes) if c.kind == "leave"]
    gaps = [g for c, o in good if c.stream for g in o.gaps]
    return {
        "requests": Counter(c.kind for c in cases),
        "statuses": {kind: Counter(o.status for c, o in zip(cases, outcomes) if c.kind == kind)
                     for kind in ("good", "bad", "leave")},
        "good_equal_solo": sum(o.status == 200 and o.error is None and o.text == c.expected for c, o in good),
        "good_mismatches": [(c.body, o.status, o.error, o.text, c.expected) for c, o in good
                            if not (o.status == 200 and o.error is None and o.text == c.expected)],
        "bad_4xx": sum(o.status is not None and 400 <= o.status < 500 for o in bad),
        "left": sum(o.left for o in leave),
        "max_stream_gap_s": max(gaps, default=0.0),
    }


def idle_after(engine_loop, timeout: float = 30.0) -> tuple[float, dict]:
    """Seconds until the engine holds no request, and its stats then (read from the loop's refreshed copy)."""
    started = time.monotonic()
    while True:
        stats = engine_loop.stats
        if stats.num_running == stats.num_waiting == 0 or time.monotonic() - started > timeout:
            time.sleep(0.6)  # the loop refreshes its stats while idle every 0.5 s
            return time.monotonic() - started - 0.6, dict(engine_loop.stats)
        time.sleep(0.02)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--leave-after", type=float, default=0.5, help="seconds a non-streaming leaver waits")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from _common import STORIES_TEXT, ModelUnavailable, load_model, machine  # noqa: PLC0415
    from paged_hf import PagedEngine  # noqa: PLC0415
    from paged_hf.server.app import build_app  # noqa: PLC0415
    from serve import Server  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    try:
        model, tok = load_model("stories260K")
    except ModelUnavailable as reason:
        print(f"skipped: {reason}")
        return 0
    tok.chat_template = CHAT_TEMPLATE
    stories = [s.strip() for s in STORIES_TEXT.read_text().split("<|endoftext|>") if s.strip()]
    openings = [s.split(". ")[0] + "." for s in stories][:16]
    cases = make_cases(openings, args.clients, args.seed)
    fill_expected(PagedEngine(model, tok, block_size=16, num_blocks=256, enable_prefix_caching=False), cases)
    engine = PagedEngine(model, tok, block_size=16, num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512)
    app = build_app(engine, "stories260K", max_queue_len=4 * args.clients)
    server = Server(app)
    print(f"# fault load: stories260K, {args.clients} clients at once, seed {args.seed}")
    print(machine())
    try:
        started = time.monotonic()
        outcomes = asyncio.run(run_clients(server.url, cases, args.leave_after))
        duration = time.monotonic() - started
        to_idle, stats = idle_after(app.state.engine_loop)
    finally:
        server.stop()
    report = summarize(cases, outcomes)
    print(f"duration {duration:.1f} s; requests {dict(report['requests'])}")
    for kind, statuses in report["statuses"].items():
        print(f"  {kind}: statuses {dict(statuses)}")
    print(f"good requests equal to their solo run: {report['good_equal_solo']} / {report['requests']['good']}")
    print(f"bad requests answered 4xx: {report['bad_4xx']} / {report['requests']['bad']}")
    print(f"clients that left mid-request: {report['left']} / {report['requests']['leave']}")
    print(f"KV blocks in use once idle: {stats['kv_cache_used']} (idle {to_idle:.2f} s after the last client)")
    print(f"longest gap between two events of a good stream: {report['max_stream_gap_s']:.3f} s")
    for mismatch in report["good_mismatches"][:5]:
        print("MISMATCH", mismatch)
    return 0 if not report["good_mismatches"] and stats["kv_cache_used"] == 0 else 1


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    sys.exit(main())
