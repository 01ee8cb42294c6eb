"""Structured outputs in ``PagedEngine``: steady-state decode throughput with every row constrained vs none, and
the first-request latency of a schema the engine has not seen.

Throughput: ``--batch`` requests of real-text prompts (``--prompt-len`` tokens) decode greedily; once every one is
past its prompt, ``--steps`` steps are timed; the two engines (constrained, unconstrained) step in turn, so that
both see the same load, and median step times are compared. Constrained rows follow a JSON schema for an array of at least 1,000
small objects (so none can end inside the window): each step fills one grammar bitmask row per sequence, masks the
logits and advances each matcher. Unconstrained rows ignore EOS and take the plain greedy path. ``--rounds`` fresh
pairs of engines (the issue's goal: under 10% slower).

First request (``--latency-rounds``): one request on an idle engine with a new schema (a property name no earlier request used), time to
its first token, against the same request once the schema is cached; and the compile time alone (parse +
``GrammarCompiler.compile_grammar``) of a new schema.

    PYTHONPATH=. python benchmarks/structured.py                          # SmolLM2-135M, batch 32
    PYTHONPATH=. python benchmarks/structured.py --model stories260K --batch 2 --steps 2 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MODEL_NAMES, ModelUnavailable, load_model, prompt_lengths, source_version, text_prompts  # noqa: E402

import paged_hf  # noqa: E402
from paged_hf import SamplingParams, StructuredOutputsParams  # noqa: E402


def item_schema(name: str = "name") -> dict:
    return {"type": "object", "properties": {name: {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                             "ok": {"type": "boolean"}},
            "required": [name, "age", "ok"]}


LONG_ARRAY = StructuredOutputsParams(json={"type": "array", "items": item_schema(), "minItems": 1000})


def steady_engine(model, tokenizer, prompts, constrained: bool, max_tokens: int) -> paged_hf.PagedEngine:
    """An engine with every request of ``prompts`` past its prompt: each step from here decodes every row."""
    engine = paged_hf.PagedEngine(model, tokenizer, max_num_seqs=len(prompts), enable_prefix_caching=False,
                                  max_num_batched_tokens=4096, num_blocks=len(prompts) * (max_tokens // 16 + 8))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            structured_outputs=LONG_ARRAY if constrained else None)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(seq.num_computed_tokens < len(seq.request.prompt_token_ids) for seq in engine.scheduler.running) \
            or engine.scheduler.waiting or engine.scheduler.compiling:
        engine.step()
    engine.step()
    return engine


def step_times(engines: dict[bool, paged_hf.PagedEngine], steps: int) -> dict[bool, list[float]]:
    """Seconds of each of ``steps`` decode steps per engine, the engines stepping in turn (so that both see the same
    load on a shared machine)."""
    times = {key: [] for key in engines}
    for _ in range(steps):
        for key, engine in engines.items():
            before = engine.get_stats()["generated_tokens"]
            started = time.perf_counter()
            engine.step()
            times[key].append(time.perf_counter() - started)
            made = engine.get_stats()["generated_tokens"] - before
            assert made == len(engine.scheduler.running) == len(engine.requests), "every row must decode every step"
    return times


def first_request(model, tokenizer, prompt, rounds: int) -> dict[str, float]:
    """Median ms: time to first token with a new schema, with the same schema cached, and its compile alone. The
    engine builds its tokenizer tables for xgrammar first (once per engine: not a per-schema cost)."""
    engine = paged_hf.PagedEngine(model, tokenizer, max_num_seqs=4, num_blocks=256)
    engine.grammars.compile(StructuredOutputsParams(regex="warm"))
    cold, warm, compile_ms = [], [], []
    for i in range(rounds):
        spec = StructuredOutputsParams(json=item_schema(f"field_{os.getpid()}_{i}"))
        for times in (cold, warm):
            started = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, structured_outputs=spec),
                            use_tqdm=False)
            times.append((time.perf_counter() - started) * 1e3)
        fresh = StructuredOutputsParams(json=item_schema(f"other_{os.getpid()}_{i}"))
        started = time.perf_counter()
        engine.grammars.compile(fresh)
        compile_ms.append((time.perf_counter() - started) * 1e3)
    return {"new schema": statistics.median(cold), "cached schema": statistics.median(warm),
            "compile alone": statistics.median(compile_ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=MODEL_NAMES)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-rounds", type=int, default=5, help="new schemas timed for the first request")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_model(args.model, attn_implementation="paged")
    except ModelUnavailable as why:
        print(f"skipped {args.model}: {why}")
        return 0
    prompts = text_prompts(tokenizer, prompt_lengths(args.batch, args.prompt_len, args.prompt_len, 0), 0)
    max_tokens = args.steps + 8
    times = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            engines = {c: steady_engine(model, tokenizer, prompts, c, max_tokens) for c in (True, False)}
            for key, values in step_times(engines, args.steps).items():
                times[key] += values
            del engines
        latency = first_request(model, tokenizer, prompts[0], args.latency_rounds)
    rate = {key: args.batch / statistics.median(values) for key, values in times.items()}
    plain, masked = rate[False], rate[True]
    print(f"# structured outputs: {args.model}, batch {args.batch}, {args.steps} decode steps x {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads, {source_version()}, load {os.getloadavg()[0]:.2f}")
    print("\n| rows | median step ms | decode tok/s | vs unconstrained |\n| --- | ---: | ---: | ---: |")
    for key, name in ((False, "unconstrained"), (True, "every row JSON-schema constrained")):
        print(f"| {name} | {statistics.median(times[key]) * 1e3:.1f} | {rate[key]:.1f} | "
              f"{rate[key] / plain:.2f}x |")
    print(f"\nconstrained rows decode {(1 - masked / plain) * 100:+.1f}% slower (goal: under 10%)")
    print("\n| first request (max_tokens=1, idle engine) | ms (median) |\n| --- | ---: |")
    for name, ms in latency.items():
        print(f"| {name} | {ms:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
