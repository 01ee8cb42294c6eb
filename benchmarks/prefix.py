"""Prefix caching in ``PagedEngine``: many requests sharing one long system prompt, with and without the cache.

Workload: ``--requests`` requests = one shared system prompt (real text from the TinyStories sample, repeated
and cut to ``--system-tokens``) + a distinct ``--question-tokens`` question each (the sample cut at seeded
offsets), ``max_tokens`` ``--max-tokens``, greedy, EOS ignored. All requests arrive at once.

For ``enable_prefix_caching`` off and on, on a fresh engine whose pool can hold every request at once:
- peak KV blocks in use (``get_stats()["kv_cache_used"]`` polled after every ``step()``), with the number of
  requests running at that peak;
- time to first token (``RequestOutput.metrics.time_to_first_token``): mean, p50, p90 — the burst's TTFT is
  mostly queueing behind the other prefills, so also:
- single-request TTFT, cold vs warm: one request on a fresh engine (cold), then the same system prompt with a
  new question on that now warm engine (a prefix hit); ``--repeats`` fresh engines, medians reported;
- total time of the burst, and whether the greedy tokens with and without the cache are identical.

With ``max_num_batched_tokens`` 512 the burst is admitted a few requests per step, so without the cache only a
handful of requests are resident at the peak (the peak measures the scheduler as much as the memory). The
``--resident`` table (on by default) therefore also runs the burst with a token budget that admits every request
in the first step: without the cache that is the footprint of all requests at once; with the cache it is
measured twice, on a cold engine (the requests are admitted before any block of the shared prefix is computed,
so nothing can be shared) and after one earlier request with the same system prompt warmed the cache.

    PYTHONPATH=. python benchmarks/prefix.py                              # stories260K: 400-token system prompt
    PYTHONPATH=. python benchmarks/prefix.py --model smollm2 --requests 16   # 1,024-token system prompt
    PYTHONPATH=. python benchmarks/prefix.py --suite   # random models: the burst (full, sliding), the host tier

stories260K has 512 positions, so its default system prompt is 400 tokens (400 + 64 + 8 = 472 fit);
SmolLM2's default is 1,024 tokens (it has 2,048 positions).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

import paged_hf  # noqa: F401
from paged_hf import PagedEngine, SamplingParams

from _common import ModelUnavailable, load_model, machine, markdown_table, text_token_ids

GOAL_BLOCKS = 0.85  # >= 85% fewer peak blocks with prefix caching
GOAL_TTFT = 5.0  # a prefix hit >= 5x faster to first token
MODEL_ALIASES = {"stories": "stories260K", "stories260K": "stories260K", "smollm2": "smollm2"}
DEFAULT_SYSTEM_TOKENS = {"stories260K": 400, "smollm2": 1024}


def build_prompts(tokenizer, args) -> tuple[list[int], list[list[int]]]:
    """The shared system prompt and ``requests + 2 * repeats`` distinct questions (the last ones for the
    cold/warm single-request runs). Questions differ in their first tokens, so they share no block beyond
    the system prompt."""
    stream = text_token_ids(tokenizer)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    body = args.system_tokens - (1 if adds_bos else 0)
    system = ([bos] if adds_bos else []) + (stream * (2 + body // len(stream)))[:body]
    rng = random.Random(args.seed)
    repeated = stream * (2 + args.question_tokens // len(stream))
    questions, heads = [], set()
    while len(questions) < args.requests + 2 * args.repeats:
        start = rng.randrange(len(stream))
        question = repeated[start : start + args.question_tokens]
        head = tuple(question[:8])
        if head not in heads:
            heads.add(head)
            questions.append(question)
    return system, questions


def make_engine(model, tokenizer, args, caching: bool, num_blocks: int, budget: int | None = None) -> PagedEngine:
    return PagedEngine(model, tokenizer, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=budget or args.max_num_batched_tokens, enable_prefix_caching=caching,
                       num_blocks=num_blocks, swap_space=0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_burst(model, tokenizer, system, questions, args, caching: bool, num_blocks: int, budget: int | None = None,
              warm_question: list[int] | None = None) -> dict:
    """The burst on a fresh engine; ``warm_question``: one request with the same system prompt runs to completion
    first (not timed), so the burst starts with the prefix already cached."""
    engine = make_engine(model, tokenizer, args, caching, num_blocks, budget)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    if warm_question is not None:
        engine.generate([system + warm_question], params, use_tqdm=False)
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    ids = [engine.add_request(system + q, params) for q in questions]
    finished = {}
    peak, peak_running, steps = 0, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        stats = engine.get_stats()
        if stats["kv_cache_used"] > peak:
            peak, peak_running = stats["kv_cache_used"], stats["num_running"]
    wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    outs = [finished[i] for i in ids]
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    ttft = [o.metrics.time_to_first_token for o in outs]
    stats = engine.get_stats()
    return dict(peak=peak, peak_running=peak_running, steps=steps, wall=wall, cpu=cpu, ttft=ttft,
                tokens=[list(o.outputs[0].token_ids) for o in outs],
                cached=sum(o.metrics.num_prefix_cached_tokens or 0 for o in outs),
                hit_rate=stats["prefix_cache_hit_rate"], preemptions=stats["preemption_count"])


def single_ttft(model, tokenizer, system, question_pairs, args, num_blocks: int) -> list[tuple[float, float, int, int]]:
    """Per repeat: a fresh engine runs system + question A (cold), then system + question B (warm)."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows = []
    for cold_q, warm_q in question_pairs:
        engine = make_engine(model, tokenizer, args, True, num_blocks)
        cold = engine.generate([system + cold_q], params, use_tqdm=False)[0]
        warm = engine.generate([system + warm_q], params, use_tqdm=False)[0]
        rows.append((cold.metrics.time_to_first_token, warm.metrics.time_to_first_token,
                     cold.metrics.num_prefix_cached_tokens or 0, warm.metrics.num_prefix_cached_tokens or 0))
    return rows


def burst_table(runs: dict, reference: dict | None, base: int) -> str:
    """One row per run; ``base``: the blocks of the burst without sharing; ``reference``: the run without caching."""
    rows = []
    for label, r in runs.items():
        same = "" if reference is None else f"{sum(a == b for a, b in zip(reference['tokens'], r['tokens']))}/{len(r['tokens'])}"
        rows.append([label, f"{r['peak']} ({r['peak_running']})", f"{1 - r['peak'] / base:.1%}",
                     f"{statistics.mean(r['ttft']):.2f}", f"{statistics.median(r['ttft']):.2f}",
                     f"{percentile(r['ttft'], 0.9):.2f}", f"{r['wall']:.1f}", f"{r['cpu']:.1f}", r["steps"],
                     f"{r['hit_rate']:.1%}", same])
    headers = ["prefix caching", "peak KV blocks (running then)", "fewer blocks than off", "TTFT mean s",
               "TTFT p50 s", "TTFT p90 s", "total wall s", "total CPU s", "steps", "prefix hit rate",
               "greedy tokens = off"]
    return markdown_table(headers, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="stories", choices=sorted(MODEL_ALIASES))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=None,
                        help="shared prefix length (default: 400 for stories260K, 1024 for smollm2)")
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="fresh engines for the cold/warm single-request TTFT")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s; see throughput.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--admission", choices=("chunked", "all", "both"), default="both",
                        help="chunked: the burst under --max-num-batched-tokens; all: a budget that admits every "
                             "request in the first step (all resident); both (default). Each runs the full "
                             "no-cache prefill once")
    parser.add_argument("--bursts", default="off,cold,warm",
                        help="with --admission all/both, the all-at-once bursts to run (comma-separated): off = no "
                             "prefix caching (a full prefill per request), cold = caching on, nothing cached yet "
                             "(the burst shares what its first request computes), warm = the prefix cached by one "
                             "earlier request. Default: all three")
    suite = parser.add_argument_group("--suite", "the burst and the host tier on random models (_prefix_suite.py)")
    suite.add_argument("--suite", action="store_true", help="run _prefix_suite.py's workloads instead")
    suite.add_argument("--hidden", type=int, default=384, help="hidden size of the random models")
    suite.add_argument("--window", type=int, default=256, help="the sliding model's window")
    suite.add_argument("--tenants", type=int, default=16)
    suite.add_argument("--tenant-tokens", type=int, default=256)
    suite.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.suite:
        from _prefix_suite import run_suite  # noqa: PLC0415 - only this mode needs it

        args.system_tokens = args.system_tokens or 1024
        print(machine())
        return run_suite(args)
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    name = MODEL_ALIASES[args.model]
    args.system_tokens = args.system_tokens or DEFAULT_SYSTEM_TOKENS[name]
    try:
        model, tokenizer = load_model(name)
    except ModelUnavailable as reason:
        print(f"skipped {name}: {reason}")
        return 0
    limit = getattr(model.config, "max_position_embeddings", None)
    needed = args.system_tokens + args.question_tokens + args.max_tokens
    if limit is not None and needed > limit:
        print(f"error: a request needs {needed} positions, {name} has {limit}; lower --system-tokens", file=sys.stderr)
        return 2
    system, questions = build_prompts(tokenizer, args)
    burst, singles = questions[: args.requests], questions[args.requests :]
    pairs = [(singles[2 * i], singles[2 * i + 1]) for i in range(args.repeats)]
    per_request = -(-needed // args.block_size)
    num_blocks = args.requests * (per_request + 1)  # every request at once, without sharing, fits
    shared_blocks = len(system) // args.block_size
    all_budget = sum(len(system) + len(q) for q in burst) + len(system) + args.question_tokens

    print(f"# prefix caching: {name}, {args.requests} requests")
    print(machine())
    print(f"system prompt {len(system)} tokens ({shared_blocks} full blocks of {args.block_size}), questions "
          f"{args.question_tokens} tokens, max_tokens {args.max_tokens}, greedy, EOS ignored; engine: max_num_seqs "
          f"{args.max_num_seqs}, {num_blocks} blocks (holds every request unshared), swap off")

    print("warm-up ...", flush=True)  # lazy imports and first-call costs, out of every timed run
    make_engine(model, tokenizer, args, True, num_blocks).generate(
        [system[:32] + questions[0][:8]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)

    chunked, resident = {}, {}
    if args.admission in ("chunked", "both"):
        for label, caching in (("off", False), ("on", True)):
            chunked[label] = run_burst(model, tokenizer, system, burst, args, caching, num_blocks)
            print(f"chunked burst, prefix caching {label}: {chunked[label]['wall']:.1f} s", flush=True)
    if args.admission in ("all", "both"):
        kinds = {"off": ("off", False, None), "cold": ("on, cold burst", True, None),
                 "warm": ("on, prefix warmed by 1 request", True, singles[-1])}
        wanted = [k.strip() for k in args.bursts.split(",") if k.strip()]
        if not wanted or any(k not in kinds for k in wanted):
            parser.error(f"--bursts takes a comma-separated subset of {sorted(kinds)}, got {args.bursts!r}")
        for label, caching, warm_q in (kinds[k] for k in wanted):
            resident[label] = run_burst(model, tokenizer, system, burst, args, caching, num_blocks, all_budget, warm_q)
            print(f"all-at-once burst, prefix caching {label}: {resident[label]['wall']:.1f} s", flush=True)
    singles_rows = single_ttft(model, tokenizer, system, pairs, args, num_blocks)
    cold = statistics.median(r[0] for r in singles_rows)
    warm = statistics.median(r[1] for r in singles_rows)
    print("single requests done", flush=True)

    if chunked:
        print(f"\nBurst of {len(burst)} requests, max_num_batched_tokens {args.max_num_batched_tokens} "
              f"(requests admitted as the token budget allows):\n")
        print(burst_table(chunked, chunked["off"], chunked["off"]["peak"]))
        off, on = chunked["off"], chunked["on"]
        print(f"\n- peak blocks {off['peak']} -> {on['peak']} ({1 - on['peak'] / off['peak']:.1%} fewer), with "
              f"{off['peak_running']} and {on['peak_running']} requests resident at the peak (the token budget, not "
              f"memory, sets how many are resident: compare the all-at-once table); blocks per resident request: "
              f"{off['peak'] / max(1, off['peak_running']):.1f} -> {on['peak'] / max(1, on['peak_running']):.1f}")
        print(f"- mean TTFT {statistics.mean(off['ttft']):.2f} s -> {statistics.mean(on['ttft']):.2f} s "
              f"({statistics.mean(off['ttft']) / statistics.mean(on['ttft']):.1f}x); total {off['wall']:.1f} s -> "
              f"{on['wall']:.1f} s ({off['wall'] / on['wall']:.1f}x); prompt tokens served from the cache: "
              f"{on['cached']} of {sum(len(system) + len(q) for q in burst)}")
    if resident:
        print(f"\nBurst of {len(burst)} requests, max_num_batched_tokens {all_budget} (every request admitted and "
              f"prefilled in the first step: all resident at once):\n")
        unshared = len(burst) * per_request  # every request's blocks, nothing shared: what "off" holds
        base = resident["off"]["peak"] if "off" in resident else unshared
        print(burst_table(resident, resident.get("off"), base))
        ceiling = 1 - (shared_blocks + len(burst) * (per_request - shared_blocks)) / unshared
        print(f"\n- without sharing the {len(burst)} requests hold {unshared} blocks"
              f"{'' if 'off' in resident else ' (computed: no off run)'}; the most sharing this shape allows, "
              f"1 - (shared + N x unique) / (N x per request), is {ceiling:.1%} fewer")
        for label in ("on, prefix warmed by 1 request", "on, cold burst"):
            if label in resident:
                fewer = 1 - resident[label]["peak"] / base
                print(f"- {label}: {base} -> {resident[label]['peak']} blocks, {fewer:.1%} fewer (goal >= "
                      f"{GOAL_BLOCKS:.0%}: {'met' if fewer >= GOAL_BLOCKS else 'MISSED'})")
    print(f"\n- single request: cold TTFT {cold:.3f} s, warm (prefix hit) {warm:.3f} s (medians of {len(pairs)}): "
          f"{cold / warm:.1f}x faster (goal >= {GOAL_TTFT:.0f}x: {'met' if cold / warm >= GOAL_TTFT else 'MISSED'}); "
          f"per repeat (cold s, warm s, warm tokens from the cache): "
          + ", ".join(f"({c:.3f}, {w:.3f}, {h})" for c, w, _, h in singles_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
