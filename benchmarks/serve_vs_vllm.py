"""One streaming client against `paged-hf serve` and `vllm serve`: TTFT and inter-token latency side by side.

Each server runs as its own process on a free loopback port, over the same model folder, with the same threads
(``--threads N``: paged_hf on cores 0..N-1 with one pinned OpenMP thread each, i.e. ``--cpu-threads-bind auto`` in a
process with that affinity; vLLM through ``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)``, with tcmalloc preloaded and
``VLLM_CPU_KVCACHE_SPACE`` as ``benchmarks/vs_vllm.py`` sets them), the same KV space, ``max_num_seqs``,
``max_num_batched_tokens`` and ``max_model_len``, chunked prefill and prefix caching on. The driver waits for
``/health``, sends an untimed warm-up (``--concurrency`` short requests at once, prompt lengths spread over the
range), then the timed workload: ``--requests`` streaming ``/v1/completions`` requests (token-id prompts cut from
the TinyStories sample, greedy, ``ignore_eos``), at most ``--concurrency`` in flight at once (a closed loop, not a
rate), and stops the server. Rounds alternate vLLM, paged_hf, vLLM, ... (``--pairs``); every round replays the same
seeded workload on a fresh server, so no round finds another's prefixes cached. The request, the SSE parsing and
the percentiles are ``benchmarks/serve.py``'s: TTFT = first chunk - send, ITL = the gaps between a request's
chunks, output tok/s = output tokens / (first send to last end); steps and tokens / step are the engine steps of
the timed run and the tokens they ran, from each server's /metrics (vLLM's ``vllm:iteration_tokens_total``
counts a step's computed prompt tokens and sampled tokens, paged_hf's ``paged_hf_engine_step_tokens`` its
forwarded prompt chunks and decode inputs: the same up to one token per prompt a step completes). The 1-minute
load average is printed before and after every timed run. vLLM is skipped, with the reason, where its venv
(``benchmarks/vs_vllm.py --setup-vllm``) is absent.

    PYTHONPATH=. python benchmarks/serve_vs_vllm.py                              # SmolLM2, 64 requests, 2 pairs
    PYTHONPATH=. python benchmarks/serve_vs_vllm.py --requests 32 --pairs 1      # a busy machine
    PYTHONPATH=. python benchmarks/serve_vs_vllm.py --background-load            # one core kept busy throughout
    PYTHONPATH=. python benchmarks/serve_vs_vllm.py --model stories260K --servers paged_hf --requests 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from serve import Record, one_request, parse_range, percentile
from vs_vllm import ROOT, VENV_PYTHON, _preload, model_folder, start_background_load, vllm_status, worker_env

SERVERS = ("vllm", "paged_hf")
LABELS = {"vllm": "vllm serve (CPU build)", "paged_hf": "paged-hf serve"}
SERVED_NAME = "bench-model"  # both servers answer to this name, so the client sends the same bodies


@dataclass
class Run:
    """One server's timed workload: its records and the context a figure needs."""

    server: str
    round: int
    startup_s: float
    records: list[Record]
    duration: float
    load_before: float
    load_after: float
    steps: tuple[float, float] | None = None  # engine steps of the timed run and the tokens they forwarded


# Each server's engine-step totals on /metrics: (series of the step count, series of the tokens those steps ran).
STEP_SERIES = {"vllm": ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum"),
               "paged_hf": ("paged_hf_engine_steps", "paged_hf_engine_step_tokens")}


async def step_totals(http, server: str, url: str) -> tuple[float, float] | None:
    """The server's engine steps so far and the tokens they forwarded (summed over label sets), or None where
    /metrics does not have them."""
    try:
        text = (await http.get(url + "/metrics")).text
    except Exception:  # noqa: BLE001 - the figure is optional: the table says n/a
        return None
    totals = []
    for name in STEP_SERIES[server]:
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if not values:
            return None
        totals.append(sum(map(float, values)))
    return tuple(totals)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(server: str, args, folder: Path, port: int) -> list[str]:
    """The command line of ``server`` with the shared engine settings."""
    shared = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
              "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--max-model-len", str(args.max_model_len), "--enable-prefix-caching"]
    if server == "vllm":
        return [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), *shared,
                "--enable-chunked-prefill", "--seed", "0"]
    # paged_hf: chunked prefill is how its scheduler always runs; the KV pool is the GiB vLLM gets. Its threads:
    # "auto" in a process whose affinity is cores 0..N-1 (``ServerProcess``) pins one OpenMP thread per core, as
    # "0-(N-1)" would; the list itself fails today (the OpenMP runtime binds the main thread to core 0 when torch
    # loads, and the engine then finds cores 1.. outside the process's affinity).
    return [sys.executable, "-m", "paged_hf_cli", "serve", str(folder), *shared, "--block-size",
            str(args.block_size), "--kv-cache-memory", str(args.kv_gib), "--cpu-threads-bind", "auto",
            "--log-level", "info"]


class ServerProcess:
    """A server in its own process group (vLLM starts child processes); ``stop`` ends the whole group."""

    def __init__(self, server: str, args, folder: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = log.open("w")
        cores = set(range(min(args.threads, os.cpu_count() or args.threads)))
        pin = None if server == "vllm" else (lambda: os.sched_setaffinity(0, cores))  # vLLM binds its own
        self.proc = subprocess.Popen(server_command(server, args, folder, self.port), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=worker_env(server, args, args.vllm_python),
                                     cwd=str(ROOT), start_new_session=True, preexec_fn=pin)

    async def wait_ready(self, http, timeout: float) -> float:
        """Seconds until ``/health`` answers 200; RuntimeError (with the log's end) if the process dies first."""
        started = time.perf_counter()
        while time.perf_counter() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}; the end of {self.log_path}:\n"
                                   + self.log_tail())
            try:
                if (await http.get(self.url + "/health", timeout=5.0)).status_code == 200:
                    return time.perf_counter() - started
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout:.0f} s; the end of {self.log_path}:\n" + self.log_tail())

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        return "\n".join("    " + line for line in self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


async def closed_loop(http, url: str, prompts, max_tokens, concurrency: int) -> tuple[list[Record], float]:
    """Every request, at most ``concurrency`` in flight; returns the records (in request order) and the duration."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt, n):
        async with gate:
            return await one_request(http, url, prompt, n, SERVED_NAME)

    records = await asyncio.gather(*(gated(p, n) for p, n in zip(prompts, max_tokens)))
    return records, max(r.end for r in records) - min(r.sent for r in records)


async def run_server(server: str, round_: int, args, folder: Path, workload, logs: Path) -> Run:
    import httpx  # noqa: PLC0415

    prompts, max_tokens, warmup = workload
    process = ServerProcess(server, args, folder, logs / f"{server}-r{round_}.log")
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as http:
            startup = await process.wait_ready(http, args.startup_timeout)
            for record in await asyncio.gather(*(one_request(http, process.url, p, 4, SERVED_NAME) for p in warmup)):
                if record.error:
                    raise RuntimeError(f"warm-up request failed: {record.error}")
            load_before = os.getloadavg()[0]
            steps_before = await step_totals(http, server, process.url)
            records, duration = await closed_loop(http, process.url, prompts, max_tokens, args.concurrency)
            load_after = os.getloadavg()[0]
            steps_after = await step_totals(http, server, process.url)
    finally:
        process.stop()
    steps = (None if steps_before is None or steps_after is None
             else (steps_after[0] - steps_before[0], steps_after[1] - steps_before[1]))
    return Run(server, round_, startup, records, duration, load_before, load_after, steps)


def row(run: Run) -> list:
    ok = [r for r in run.records if r.error is None]
    ttft = [1000 * (r.chunks[0] - r.sent) for r in ok]
    itl = [1000 * (b - a) for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    ms = lambda q, values: f"{percentile(values, q):.0f}"  # noqa: E731
    return [LABELS[run.server], run.round + 1, f"{run.load_before:.1f} -> {run.load_after:.1f}",
            f"{run.startup_s:.0f}", f"{len(ok)}/{len(run.records)}", f"{run.duration:.2f}",
            f"{sum(r.tokens for r in ok) / run.duration:.1f}", ms(50, ttft), ms(90, ttft), ms(50, itl), ms(90, itl),
            f"{run.steps[0]:.0f}" if run.steps else "n/a",
            f"{run.steps[1] / run.steps[0]:.1f}" if run.steps and run.steps[0] else "n/a"]


def summary(runs: list[Run]) -> list[str]:
    """paged_hf / vLLM on the medians over rounds, and how often the two servers streamed the same text."""
    by = {s: [r for r in runs if r.server == s] for s in SERVERS}
    if not by["vllm"] or not by["paged_hf"]:
        return []
    median = lambda server, f: statistics.median(f(r) for r in by[server])  # noqa: E731
    tok_s = lambda r: sum(x.tokens for x in r.records if x.error is None) / r.duration  # noqa: E731
    ttft = lambda r: percentile([x.chunks[0] - x.sent for x in r.records if x.error is None], 50)  # noqa: E731
    first_v, first_p = by["vllm"][0].records, by["paged_hf"][0].records
    same = sum(v.error is None and p.error is None and v.text == p.text for v, p in zip(first_v, first_p))
    ratio = lambda f: median("paged_hf", f) / median("vllm", f)  # noqa: E731
    return [f"paged_hf / vLLM, medians over rounds: output tok/s {ratio(tok_s):.2f}x, TTFT p50 {ratio(ttft):.2f}x "
            f"(lower is better)",
            f"same streamed text (greedy) in {same}/{len(first_p)} requests of the first round"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), stories260K, or an HF model folder")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of vllm,paged_hf")
    parser.add_argument("--requests", type=int, default=64, help="timed requests per run (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most (default %(default)s)")
    parser.add_argument("--pairs", type=int, default=2, help="alternating vLLM / paged_hf rounds (default 2)")
    parser.add_argument("--prompt-len", type=parse_range, default=(32, 256), metavar="LOW-HIGH")
    parser.add_argument("--output-len", type=parse_range, default=(16, 64), metavar="LOW-HIGH")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="threads of each server (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-gib", type=int, default=2, help="KV space of each server, GiB (default 2)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16, help="paged_hf's block (vLLM keeps its CPU default)")
    parser.add_argument("--vllm-python", type=Path, default=Path(os.environ.get("PAGED_HF_VLLM_PYTHON") or VENV_PYTHON),
                        help="the Python of vLLM's venv (default: $PAGED_HF_VLLM_PYTHON or %(default)s)")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to be ready")
    parser.add_argument("--log-dir", type=Path, default=None, help="the servers' logs (default: a temp dir)")
    parser.add_argument("--background-load", action="store_true",
                        help="a process spinning on the servers' last core for the whole run (vs_vllm.py's)")
    args = parser.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    bad = [s for s in args.servers if s not in SERVERS]
    if bad or not args.servers:
        parser.error(f"unknown server {bad}: choose from {', '.join(SERVERS)}")
    for name in ("requests", "concurrency", "pairs", "threads", "kv_gib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    import random  # noqa: PLC0415

    from transformers import AutoTokenizer  # noqa: PLC0415

    from _common import ModelUnavailable, machine, markdown_table, text_prompts  # noqa: PLC0415

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        folder = model_folder(args.model)
    except ModelUnavailable as reason:
        print(f"skipped: {reason}")
        return 0
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(args.seed)
    lengths = [rng.randint(*args.prompt_len) for _ in range(args.requests)]
    max_tokens = [rng.randint(*args.output_len) for _ in range(args.requests)]
    # untimed, 4 tokens each: as many prompts as run at once, lengths spread over the range (the shapes to come)
    count = min(args.concurrency, args.requests)
    low, high = args.prompt_len
    warm_lengths = [low + (high - low) * i // max(count - 1, 1) for i in range(count)]
    warmup = text_prompts(tokenizer, warm_lengths, -1 - args.seed)
    workload = (text_prompts(tokenizer, lengths, args.seed), max_tokens, warmup)
    args.max_model_len = -(-max(max(map(len, warmup)) + 4, *(p + n for p, n in zip(lengths, max_tokens))) // 16) * 16

    vllm_skip = vllm_status(args.vllm_python) if "vllm" in args.servers else None
    print(f"# paged-hf serve vs vllm serve: {folder.name}, {args.dtype}, {args.threads} threads, seed {args.seed}")
    print(machine())
    print(f"workload: {args.requests} streamed requests, at most {args.concurrency} in flight, prompts "
          f"{min(lengths)}-{max(lengths)} token ids ({sum(lengths)} in all), outputs {min(max_tokens)}-"
          f"{max(max_tokens)} ({sum(max_tokens)} in all), greedy, ignore_eos")
    print(f"both servers: chunked prefill + prefix caching, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, max_model_len {args.max_model_len}, KV {args.kv_gib} GiB")
    if vllm_skip:
        print(f"vLLM SKIPPED: {vllm_skip}")
    elif "vllm" in args.servers:
        preload, notes = _preload(args.vllm_python)
        print(f"vLLM: {args.vllm_python}; LD_PRELOAD {':'.join(preload) or '(none)'}"
              + "".join(f"; {n}" for n in notes))
    plan = [(s, r) for r in range(args.pairs) for s in SERVERS if s in args.servers and not (s == "vllm" and vllm_skip)]
    if not plan:
        return 0
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="serve_vs_vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{len(plan)} server runs; logs in {logs}\n", flush=True)

    runs, failed = [], 0
    background = start_background_load(args.threads) if args.background_load else None
    if background:
        print(f"background load: process {background.pid} spinning on core "
              f"{min(args.threads, os.cpu_count() or 1) - 1} for the whole run\n", flush=True)
    try:
        for step, (server, round_) in enumerate(plan, 1):
            try:
                run = asyncio.run(run_server(server, round_, args, folder, workload, logs))
            except RuntimeError as error:
                failed += 1
                print(f"[{step}/{len(plan)}] {LABELS[server]}, round {round_ + 1}: FAILED {error}", flush=True)
                continue
            runs.append(run)
            errors = [r.error for r in run.records if r.error]
            print(f"[{step}/{len(plan)}] {LABELS[server]}, round {round_ + 1}: ready in {run.startup_s:.0f} s, "
                  f"{len(run.records) - len(errors)}/{len(run.records)} completed in {run.duration:.1f} s"
                  + (f", {len(errors)} failed: {errors[0]}" if errors else ""), flush=True)
            failed += bool(errors)
    finally:
        if background:
            background.terminate()
            background.wait()

    headers = ["server", "round", "load before -> after", "ready s", "completed", "duration s", "output tok/s",
               "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "steps", "tokens / step"]
    print()
    print(markdown_table(headers, [row(r) for r in runs]) if runs else "no run completed")
    print()
    for line in summary(runs):
        print(f"- {line}")
    if vllm_skip:
        print(f"- no vLLM rows: {vllm_skip}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
