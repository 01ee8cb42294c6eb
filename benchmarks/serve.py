"""Online serving: throughput and TTFT / ITL percentiles of the OpenAI-compatible server at several request rates.

The benchmark builds the project's own server (``paged_hf.server.app.build_app`` over a ``PagedEngine``) and runs
it with uvicorn in a background thread on 127.0.0.1, in this process, as ``tests/test_server.py`` does. An
asyncio client (``httpx.AsyncClient``) then sends a seeded workload of ``--requests`` streaming requests
(``stream: true``, server-sent events) to ``/v1/completions`` at each rate of ``--rates``: Poisson arrivals
(exponential gaps) at that many requests per second, ``inf`` = all at once. Each request sends its prompt as a
list of token ids (real text: the TinyStories sample cut at a random offset, BOS first where the tokenizer adds
one), ``temperature: 0`` and the vLLM-style ``ignore_eos: true``, so it produces exactly its ``max_tokens``.
Prompt and output lengths are drawn once from ``--prompt-len`` / ``--output-len``; every rate runs the same
lengths at fresh text offsets, so a rate does not replay the previous rate's prompts from the prefix cache.

Per request the client records: the send time, the first SSE chunk (TTFT: the server sends its first chunk with
the first token), every later chunk (ITL = the gaps between chunks; the server sends one chunk per engine step
that added text, so a gap spans one token, or more where a token added no text), and the end. The stream
carries no ``usage``: a request that ends with ``finish_reason: "length"`` counts its ``max_tokens`` (the engine
stops there and nowhere else under ``ignore_eos``); any other ending counts its chunks. Duration runs from the
first send to the last end; output tok/s = output tokens / duration. While a rate runs, ``/metrics`` is polled
for the peak of KV blocks in use; once the server is idle again the gauge is read once more (it must be 0).
One untimed warm-up request runs first. Client, server and engine share this process (and its GIL), as a
single-process deployment would; ``--threads`` (default 1) sets torch's threads: on 2 shared cores, 2 OpenMP
threads were many times slower (see ``throughput.py``).

    PYTHONPATH=. python benchmarks/serve.py                         # SmolLM2-135M, 64 requests, rates 0.3,0.5,inf
    PYTHONPATH=. python benchmarks/serve.py --model stories --requests 16 --rates 4,inf      # a quick check
    PYTHONPATH=. python benchmarks/serve.py --max-num-batched-tokens 2048 --kv-cache-dtype int8

The default rates are per model: SmolLM2-135M in fp32 on one CPU thread serves about 0.6 requests/s of this
workload (all at once), so its defaults are one rate at half that, one near it and ``inf`` (about 9 minutes in
all with loading); stories260K serves about 10 requests/s, so its defaults are 2,4,8,inf. The TinyStories sample
is short (about 900 SmolLM2 tokens), so a few prompts of a rate start at the same offset and share blocks through
the prefix cache: the notes under the table give the hit rate (a few percent); ``--no-prefix-caching`` rules it out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from paged_hf import PagedEngine
from paged_hf.quant import KV_CACHE_DTYPES

from _common import ModelUnavailable, load_model, machine, markdown_table, text_prompts

MODEL_ALIASES = {"stories": "stories260K", "stories260K": "stories260K", "smollm2": "smollm2"}
DEFAULT_RATES = {"stories260K": "2,4,8,inf", "smollm2": "0.3,0.5,inf"}


@dataclass
class Record:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival time of every SSE chunk carrying a choice
    end: float = 0.0
    finish_reason: str | None = None
    tokens: int = 0
    error: str | None = None
    text: str = ""  # the streamed text, joined


class Server:
    """uvicorn running ``app`` in a daemon thread on a free loopback port."""

    def __init__(self, app) -> None:
        import uvicorn  # noqa: PLC0415

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need a range LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def parse_rates(text: str) -> list[float]:
    rates = [math.inf if r.strip() == "inf" else float(r) for r in text.split(",")]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive numbers or inf, got {text!r}")
    return rates


async def one_request(http, url: str, prompt: list[int], max_tokens: int, model: str) -> Record:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    record = Record(sent=time.perf_counter())
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, event = time.perf_counter(), json.loads(line[6:])
                if "error" in event:
                    record.error = event["error"]["message"]
                    continue
                record.chunks.append(now)
                record.text += event["choices"][0].get("text") or ""
                record.finish_reason = event["choices"][0]["finish_reason"] or record.finish_reason
    except Exception as error:  # noqa: BLE001 - counted as a failed request
        record.error = f"{type(error).__name__}: {error}"
    record.end = time.perf_counter()
    if record.error is None and not record.chunks:
        record.error = "no chunks"
    record.tokens = max_tokens if record.finish_reason == "length" else len(record.chunks)
    return record


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else math.nan


async def run_rate(http, url: str, model: str, prompts, max_tokens, rate: float, seed: int):
    """Sends every request at its Poisson arrival time; returns the records, the duration and the peak blocks used."""
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for _ in prompts:
        offsets.append(at)
        at += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    peak, done = 0.0, asyncio.Event()

    async def poll():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, metric((await http.get(url + "/metrics")).text, "paged_hf_kv_cache_blocks_used"))
            await asyncio.sleep(0.5)

    async def delayed(offset, prompt, n):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await one_request(http, url, prompt, n, model)

    poller = asyncio.create_task(poll())
    start = time.perf_counter()
    records = await asyncio.gather(*(delayed(o, p, n) for o, p, n in zip(offsets, prompts, max_tokens)))
    duration = max(r.end for r in records) - min(r.sent for r in records)
    done.set()
    await poller
    return records, duration, peak


async def idle_metrics(http, url: str, timeout: float = 10.0) -> str:
    """``/metrics`` once no request runs or waits (or after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await http.get(url + "/metrics")).text
        busy = metric(text, "paged_hf_requests_running") + metric(text, "paged_hf_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def row(rate: float, records: list[Record], duration: float, peak: float, idle_blocks: float) -> list:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttft = [1000 * (r.chunks[0] - r.sent) for r in ok]
    itl = [1000 * (b - a) for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    ms = lambda q, values: f"{percentile(values, q):.0f}"  # noqa: E731
    return [rate_label(rate), len(records), len(ok), f"{duration:.1f}", f"{tokens / duration:.1f}",
            f"{len(ok) / duration:.2f}", ms(50, ttft), ms(99, ttft), ms(50, itl), ms(99, itl), f"{peak:.0f}",
            f"{idle_blocks:.0f}"]


def note(rate: float, records: list[Record], idle: str) -> str:
    """Server counters after the rate, and what the client saw beyond the table."""
    ok = [r for r in records if r.error is None]
    errors = [r.error for r in records if r.error]
    short = sum(r.finish_reason != "length" for r in ok)
    text = (f"rate {rate_label(rate)}: preemptions so far {metric(idle, 'paged_hf_preemptions'):.0f}, prefix-cache "
            f"hit rate so far {metric(idle, 'paged_hf_prefix_cache_hit_rate'):.3f}, SSE chunks / output tokens "
            f"{sum(len(r.chunks) for r in ok)} / {sum(r.tokens for r in ok)}")
    if short:
        text += f", {short} ended before max_tokens (their chunks counted as tokens)"
    if errors:
        text += f", {len(errors)} failed: {errors[0]}"
    return text


async def bench(server_url: str, model: str, tokenizer, args, lengths, max_tokens) -> None:
    import httpx  # noqa: PLC0415

    limits = httpx.Limits(max_connections=args.requests + 8, max_keepalive_connections=args.requests + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as http:
        warm = await one_request(http, server_url, text_prompts(tokenizer, [lengths[0]], args.seed - 1)[0], 4, model)
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        rows, notes = [], []
        for index, rate in enumerate(args.rates):
            prompts = text_prompts(tokenizer, lengths, args.seed + 1000 * (index + 1))
            records, duration, peak = await run_rate(http, server_url, model, prompts, max_tokens, rate,
                                                     args.seed + index)
            idle = await idle_metrics(http, server_url)
            rows.append(row(rate, records, duration, peak, metric(idle, "paged_hf_kv_cache_blocks_used")))
            notes.append(note(rate, records, idle))
            print(f"rate {rate_label(rate)}: {rows[-1][2]}/{len(records)} completed in {duration:.1f} s", flush=True)
    headers = ["rate req/s", "requests", "completed", "duration s", "output tok/s", "req/s", "TTFT p50 ms",
               "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "peak KV blocks", "KV blocks idle"]
    print()
    print(markdown_table(headers, rows))
    print()
    for line in notes:
        print(f"- {line}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=sorted(MODEL_ALIASES))
    parser.add_argument("--requests", type=int, default=64, help="requests per rate (default: %(default)s)")
    parser.add_argument("--rates", type=parse_rates, default=None,
                        help="comma-separated requests/s, inf = all at once (default: "
                             + "; ".join(f"{m} {r}" for m, r in DEFAULT_RATES.items()) + ")")
    parser.add_argument("--prompt-len", type=parse_range, default=(32, 256), metavar="LOW-HIGH",
                        help="prompt tokens (default: 32-256)")
    parser.add_argument("--output-len", type=parse_range, default=(16, 64), metavar="LOW-HIGH",
                        help="max_tokens (default: 16-64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV blocks; default: enough for every request at once; 0: the engine sizes the pool "
                             "from free memory (on CPU, 90%% of available RAM, capped by max_num_seqs x max_model_len)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-queue-len", type=int, default=256)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    import transformers  # noqa: PLC0415

    from paged_hf.server.app import build_app  # noqa: PLC0415 - needs the server extras

    transformers.logging.set_verbosity_error()
    name = MODEL_ALIASES[args.model]
    args.rates = args.rates or parse_rates(DEFAULT_RATES[name])
    try:
        model, tokenizer = load_model(name)
    except ModelUnavailable as reason:
        print(f"skipped {name}: {reason}")
        return 0
    rng = random.Random(args.seed)
    lengths = [rng.randint(*args.prompt_len) for _ in range(args.requests)]
    max_tokens = [rng.randint(*args.output_len) for _ in range(args.requests)]
    limit = model.config.max_position_embeddings
    if max(p + n for p, n in zip(lengths, max_tokens)) > limit:
        print(f"error: prompt + output lengths exceed {name}'s {limit} positions", file=sys.stderr)
        return 2
    if args.num_blocks is None:  # every request at once, +1 block of slack each: no preemption
        args.num_blocks = sum(-(-(p + n) // args.block_size) + 1 for p, n in zip(lengths, max_tokens))
    engine = PagedEngine(model, tokenizer, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks or None,
                         kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.prefix_caching)
    stats = engine.get_stats()
    print(f"# serve: {name}, {args.requests} requests per rate, seed {args.seed}")
    print(machine())
    print(f"engine: block_size {args.block_size}, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, num_blocks {stats['kv_cache_total']}"
          f"{' (engine-sized)' if not args.num_blocks else ''}, kv_cache_dtype {args.kv_cache_dtype}, "
          f"prefix caching {'on' if args.prefix_caching else 'off'}, fp32")
    print(f"workload: prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens ({sum(lengths)} per rate), outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens ({sum(max_tokens)} per rate), greedy, ignore_eos, "
          f"streamed; rates {','.join(map(rate_label, args.rates))} req/s", flush=True)
    server = Server(build_app(engine, name, args.max_queue_len))
    try:
        asyncio.run(bench(server.url, name, tokenizer, args, lengths, max_tokens))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
