"""The serving step shape driven in-process, stepped by the thread that loaded the model or by another one.

Why ``paged-hf serve``'s loop thread must keep the process's only OpenMP team: libgomp lets an idle OpenMP thread
spin before it sleeps only while the process's OpenMP threads fit its CPUs, and each thread that runs parallel work
keeps a team of its own. Three variants, each in a fresh process (a team lives as long as its thread):

- ``main``: the main thread loads the model and steps (an offline script);
- ``thread``: the main thread loads it (its team stays), a second thread steps (the server before the fix);
- ``released``: the same, the main thread calling ``release_openmp_team()`` before the second starts (the server).

The workload is ``serve_vs_vllm.py``'s shape without HTTP: token-id prompts of 35-253 tokens, 16-64 greedy output
tokens, EOS ignored, at most 16 in flight (a closed loop: each finished request admits the next), max_num_seqs 64,
max_num_batched_tokens 2048; an untimed round of 16 first. Each process runs ``--threads`` intra-op threads on cores
0..N-1 with tcmalloc preloaded where found, as ``vs_vllm.py`` runs paged_hf. Prints ms per step, tokens per step and
the CPU seconds of the stepping thread and of the rest of the process, per variant and round; the variants alternate.

    PYTHONPATH=. python benchmarks/engine_thread.py                    # SmolLM2 float32, 2 threads, 2 rounds
    PYTHONPATH=. python benchmarks/engine_thread.py --dtype bfloat16 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

from vs_vllm import ROOT, VENV_PYTHON, model_folder, worker_env

VARIANTS = ("main", "thread", "released")


def _thread_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def run_variant(args) -> dict:
    """One variant in this process: the engine built here, stepped here or in a second thread."""
    cores = set(range(min(args.threads, os.cpu_count() or args.threads)))
    os.sched_setaffinity(0, cores)
    import torch  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    from paged_hf import LLM, SamplingParams  # noqa: PLC0415
    from paged_hf.engine.threads import release_openmp_team  # noqa: PLC0415

    llm = LLM(model=str(model_folder(args.model)), dtype=args.dtype, seed=0, enable_prefix_caching=True,
              max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=320, block_size=16, kv_cache_memory=2.0)
    engine = llm.llm_engine
    rng = random.Random(args.seed)

    def request():
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(35, 253))]
        return prompt, SamplingParams(max_tokens=rng.randint(16, 64), temperature=0.0, ignore_eos=True)

    def closed_loop(total: int, salt: str) -> int:
        """``total`` requests, 16 in flight; returns the steps."""
        added = 0
        for _ in range(min(16, total)):
            engine.add_request(*request(), cache_salt=salt)
            added += 1
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and added < total:
                    engine.add_request(*request(), cache_salt=salt)
                    added += 1
            steps += 1
        return steps

    closed_loop(16, "warm-up")  # in this thread: its team exists from here on, as in the server
    result = {}

    def timed():
        before, tokens = _thread_seconds(), engine.get_stats()["num_step_tokens"]
        started = time.perf_counter()
        steps = closed_loop(args.requests, "timed")
        result.update(seconds=time.perf_counter() - started, steps=steps,
                      tokens=engine.get_stats()["num_step_tokens"] - tokens, stepper=threading.get_native_id())
        after = _thread_seconds()
        result["cpu"] = {tid: after[tid] - before.get(tid, 0.0) for tid in after}

    if args.variant == "main":
        timed()
    else:
        if args.variant == "released":
            result["released"] = release_openmp_team()
        stepper = threading.Thread(target=timed)
        stepper.start()
        stepper.join()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), stories260K, or an HF model folder")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three variants, alternating")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child process: run this one, print its JSON
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0
    if not Path("/proc/self/task").is_dir() or not hasattr(os, "sched_setaffinity"):
        print("engine_thread.py needs Linux (/proc/self/task, sched_setaffinity)")
        return 0
    for name in ("threads", "requests", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: {sorted(unknown)} are not among {', '.join(VARIANTS)}")
    model_folder(args.model)  # written once, before any timed process
    env = worker_env("paged_hf", args, VENV_PYTHON)
    print(f"# the serving step shape in-process: {args.model}, {args.dtype}, {args.threads} threads, "
          f"{args.requests} requests, 16 in flight; LD_PRELOAD={env.get('LD_PRELOAD', '(none)')}")
    print("| variant | round | load before | steps | tokens / step | ms / step | stepping thread CPU s | "
          "other threads CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for round_ in range(1, args.rounds + 1):
        for variant in variants:
            load = os.getloadavg()[0]
            command = [sys.executable, __file__, "--variant", variant, "--model", args.model, "--dtype", args.dtype,
                       "--threads", str(args.threads), "--requests", str(args.requests), "--seed", str(args.seed)]
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(ROOT))
            if done.returncode != 0:
                print(f"| {variant} | {round_} | {load:.1f} | failed: {done.stderr.strip().splitlines()[-1:]} |||||")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            stepper = r["cpu"].pop(str(r["stepper"]))
            others = sum(r["cpu"].values())
            print(f"| {variant} | {round_} | {load:.1f} | {r['steps']} | {r['tokens'] / r['steps']:.1f} | "
                  f"{1000 * r['seconds'] / r['steps']:.1f} | {stepper:.1f} | {others:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
