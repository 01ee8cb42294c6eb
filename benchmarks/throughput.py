"""Offline throughput on a mixed workload: HF static batching vs HF continuous batching vs ``PagedEngine``.

A seeded workload of ``--requests`` requests: prompts of real text (the TinyStories sample, cut at random offsets)
of 16-256 tokens and outputs of 8-128 tokens, EOS ignored so every request produces exactly its requested
number of tokens. Three systems run it side by side in one process:

(a) ``model.generate`` in static, left-padded batches of ``--batch-size`` in arrival order; a batch runs until its
    longest request is done (the other rows' extra tokens are waste: only requested tokens count as output).
(b) transformers' own continuous batching (``generation/continuous_batching``), sdpa, in a tuned config
    (page 16 instead of the default 256, which builds a multi-GB mask on CPU). Two ways in:
    (b1) ``model.generate_batch(inputs, GenerationConfig(max_new_tokens=...))``: one ``max_new_tokens`` for the
         whole call, so every request runs to the longest one (only requested tokens count);
    (b2) the same manager (``model.init_continuous_batching``) fed with ``add_request(ids, max_new_tokens=n)``,
         which does take a length per request: the fairest form of (b).
(c) ``PagedEngine.generate`` with a ``SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)`` per request.

Throughput = requested output tokens / seconds. The machine is shared, so the table gives both wall-clock
tokens/s and tokens per CPU-second of this process (``time.process_time``, all threads): the second is far
less sensitive to other jobs' load. Each system gets one small warm-up call first (lazy imports, allocator).
Greedy outputs of (b) and (c) are compared, request by request, with (a)'s.

    PYTHONPATH=. python benchmarks/throughput.py                         # stories260K, 128 requests
    PYTHONPATH=. python benchmarks/throughput.py --model smollm2 --requests 32
    PYTHONPATH=. python benchmarks/throughput.py --cb-sweep              # times a few continuous-batching configs

``--threads`` defaults to 1: on 2 cores shared with other jobs, torch's 2-thread OpenMP runs here were up to
25x slower (threads spin waiting for a descheduled peer).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field

import torch

import paged_hf  # noqa: F401 - registers the "paged" attention
from paged_hf import PagedEngine, SamplingParams

from _common import ModelUnavailable, load_model, machine, markdown_table, text_token_ids

GOAL_VS_STATIC = 3.0
GOAL_VS_CB = 1.5
MODEL_ALIASES = {"stories": "stories260K", "stories260K": "stories260K", "smollm2": "smollm2"}


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, count: int, max_tokens: int | None = None) -> "Workload":
        lengths = self.max_tokens[:count] if max_tokens is None else [max_tokens] * min(count, len(self.prompts))
        return Workload(self.prompts[:count], lengths)


@dataclass
class Result:
    name: str
    wall: float
    cpu: float
    output_tokens: int  # requested tokens only
    computed_tokens: int  # tokens the system actually generated (>= output_tokens when it over-generates)
    outputs: list[list[int]] = field(default_factory=list)  # requested tokens per request, in workload order
    note: str = ""
    error: str | None = None

    @property
    def wall_rate(self) -> float:
        return self.output_tokens / self.wall

    @property
    def cpu_rate(self) -> float:
        return self.output_tokens / self.cpu


def make_workload(tokenizer, args) -> Workload:
    """Seeded prompts of real text (BOS + a cut of the sample at a random offset) and output lengths."""
    stream = text_token_ids(tokenizer)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    rng = random.Random(args.seed)
    prompts, max_tokens = [], []
    for _ in range(args.requests):
        length = rng.randint(args.min_prompt, args.max_prompt)
        body = length - 1 if adds_bos else length
        start = rng.randrange(len(stream))
        repeated = stream * (2 + body // len(stream))
        prompts.append(([bos] if adds_bos else []) + repeated[start : start + body])
        max_tokens.append(rng.randint(args.min_out, args.max_out))
    return Workload(prompts, max_tokens)


class Clock:
    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


# ------------------------------------------------------------------------------------------------ (a)
def run_static(model, tokenizer, work: Workload, batch_size: int) -> Result:
    """``generate`` over static left-padded batches in arrival order; each batch runs to its longest request."""
    model.set_attn_implementation("sdpa")
    pad = tokenizer.pad_token_id
    outputs: list[list[int]] = []
    computed = 0
    with Clock() as clock, torch.inference_mode():
        for first in range(0, len(work.prompts), batch_size):
            rows = work.prompts[first : first + batch_size]
            wanted = work.max_tokens[first : first + batch_size]
            width = max(map(len, rows))
            input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
            # eos_token_id=None: no early stop and no EOS suppression, the same tokens as ignore_eos elsewhere
            seqs = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max(wanted),
                                  do_sample=False, eos_token_id=None, pad_token_id=pad)
            new = seqs[:, width:]
            computed += new.numel()
            outputs.extend(new[i, :n].tolist() for i, n in enumerate(wanted))
    return Result(f"(a) HF generate, static batches of {batch_size}", clock.wall, clock.cpu,
                  work.output_tokens, computed, outputs)


# ------------------------------------------------------------------------------------------------ (b)
def cb_config(args, page_size=None, num_blocks=None, max_batch_tokens=None):
    from transformers import ContinuousBatchingConfig  # noqa: PLC0415

    return ContinuousBatchingConfig(
        page_size=page_size or args.cb_page_size,
        num_blocks=num_blocks or args.cb_num_blocks,
        max_batch_tokens=max_batch_tokens or args.cb_max_batch_tokens,
    )


def cb_label(cfg) -> str:
    return f"page {cfg.page_size}, num_blocks {cfg.num_blocks}, max_batch_tokens {cfg.max_batch_tokens}"


def run_generate_batch(model, tokenizer, work: Workload, args, cfg=None) -> Result:
    """(b1) ``generate_batch``: one ``max_new_tokens`` (the longest request's) for the whole call."""
    from transformers import GenerationConfig  # noqa: PLC0415

    model.set_attn_implementation("sdpa")
    cfg = cfg or cb_config(args)
    longest = max(work.max_tokens)
    gen = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    name = "(b1) HF generate_batch (one max_new_tokens)"
    try:
        with Clock() as clock:
            results = model.generate_batch(inputs=work.prompts, generation_config=gen, continuous_batching_config=cfg)
    except Exception as error:  # noqa: BLE001 - reported in the table, the other systems still run
        return Result(name, 0.0, 0.0, 0, 0, error=f"{type(error).__name__}: {error}")
    ordered = list(results.values())  # generate_batch returns the results in input order
    failed = [r.request_id for r in ordered if r.error is not None]
    if len(ordered) != len(work.prompts) or failed:
        return Result(name, clock.wall, clock.cpu, 0, 0,
                      error=f"{len(ordered)} results for {len(work.prompts)} requests; failed: {failed[:5]}")
    outputs = [list(r.generated_tokens[:n]) for r, n in zip(ordered, work.max_tokens)]
    computed = sum(len(r.generated_tokens) for r in ordered)
    return Result(name, clock.wall, clock.cpu, work.output_tokens, computed, outputs,
                  note=f"{cb_label(cfg)}; every request runs to {longest} tokens")


def run_cb_manager(model, tokenizer, work: Workload, args, cfg=None) -> Result:
    """(b2) the continuous-batching manager with a ``max_new_tokens`` per request."""
    from transformers import GenerationConfig  # noqa: PLC0415

    model.set_attn_implementation("sdpa")
    cfg = cfg or cb_config(args)
    gen = GenerationConfig(max_new_tokens=max(work.max_tokens), do_sample=False, eos_token_id=-1,
                           pad_token_id=tokenizer.pad_token_id)
    name = "(b2) HF continuous batching, per-request max_new_tokens"
    try:
        with Clock() as setup:  # timed apart, as for (c)
            manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
            manager.start()
        try:
            with Clock() as clock:  # from the first request in to the last result out
                ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                       for i, (p, n) in enumerate(zip(work.prompts, work.max_tokens))]
                done: dict = {}
                while len(done) < len(ids):
                    result = manager.get_result(timeout=1)
                    if result is not None and result.is_finished():
                        done[result.request_id] = result
                    elif result is None and not manager.is_running():
                        raise RuntimeError(f"the generation thread stopped with {len(done)}/{len(ids)} requests done")
        finally:
            manager.stop(block=True, timeout=30)  # not timed: the loop thread's exit can wait on its idle timeout
            manager.destroy()
    except Exception as error:  # noqa: BLE001
        return Result(name, 0.0, 0.0, 0, 0, error=f"{type(error).__name__}: {error}")
    failed = [rid for rid in ids if done[rid].error is not None]
    if failed:
        return Result(name, clock.wall, clock.cpu, 0, 0, error=f"failed requests: {failed[:5]}: {done[failed[0]].error}")
    outputs = [list(done[rid].generated_tokens) for rid in ids]
    bad = [i for i, (o, n) in enumerate(zip(outputs, work.max_tokens)) if len(o) != n]
    note = cb_label(cfg) + (f"; {len(bad)} requests with a wrong length" if bad else "")
    note += f"; building and starting the manager took {setup.wall:.2f} s wall (not in the table)"
    return Result(name, clock.wall, clock.cpu, work.output_tokens, sum(map(len, outputs)),
                  [o[:n] for o, n in zip(outputs, work.max_tokens)], note=note)


# ------------------------------------------------------------------------------------------------ (c)
def engine_blocks(work: Workload, block_size: int) -> int:
    """A pool that holds every request of the workload at once (no preemption), +1 block of slack each."""
    return sum(-(-(len(p) + n) // block_size) + 1 for p, n in zip(work.prompts, work.max_tokens))


def run_engine(model, tokenizer, work: Workload, args) -> Result:
    options = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True,
                   num_blocks=engine_blocks(work, args.block_size))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.max_tokens]
    name = "(c) PagedEngine, per-request max_tokens"
    with Clock() as setup:  # timed apart: a server builds its engine once
        engine = PagedEngine(model, tokenizer, **options)
    with Clock() as clock:
        outs = engine.generate(work.prompts, params, use_tqdm=False)
    model.set_attn_implementation("sdpa")
    errors = [o.error for o in outs if getattr(o, "error", None)]
    if errors:
        return Result(name, clock.wall, clock.cpu, 0, 0, error=f"{len(errors)} failed requests: {errors[0]}")
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    stats = engine.get_stats()
    note = (f"block {args.block_size}, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
            f"{args.max_num_batched_tokens}, {options['num_blocks']} blocks; preemptions {stats['preemption_count']}; "
            f"building the engine took {setup.wall:.2f} s wall / {setup.cpu:.2f} s CPU (not in the table)")
    return Result(name, clock.wall, clock.cpu, work.output_tokens, sum(map(len, outputs)), outputs, note=note)


# ------------------------------------------------------------------------------------------------ report
def compare(reference: Result, other: Result, indices: list[int]) -> str:
    if other.error or reference.error or not other.outputs:
        return "n/a"
    same = sum(reference.outputs[i] == other.outputs[i] for i in indices)
    return f"{same}/{len(indices)}"


def first_divergence(reference: Result, other: Result, indices: list[int]) -> list[str]:
    lines = []
    for i in indices:
        a, b = reference.outputs[i], other.outputs[i]
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            lines.append(f"request {i}: first differs at output token {at} of {len(a)}")
    return lines


def ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x" if denominator else "n/a"


def report(results: list[Result], static: Result, cb: Result | None, engine: Result, indices: list[int]) -> None:
    cb_tag = "(b)" if cb is None else cb.name.split()[0]
    headers = ["system", "wall s", "CPU s", "out tok/s (wall)", "out tok/s (CPU)", "generated / requested",
               "vs (a) wall / CPU", f"vs {cb_tag} wall / CPU", f"greedy = (a) ({len(indices)} checked)"]
    rows = []
    for r in results:
        if r.error:
            rows.append([r.name, "failed", "", "", "", "", "", "", ""])
            continue
        vs_cb = "n/a" if cb is None or cb.error else (
            f"{ratio(r.wall_rate, cb.wall_rate)} / {ratio(r.cpu_rate, cb.cpu_rate)}")
        rows.append([
            r.name, f"{r.wall:.1f}", f"{r.cpu:.1f}", f"{r.wall_rate:.1f}", f"{r.cpu_rate:.1f}",
            f"{r.computed_tokens}/{r.output_tokens}",
            f"{ratio(r.wall_rate, static.wall_rate)} / {ratio(r.cpu_rate, static.cpu_rate)}", vs_cb,
            "(reference)" if r is static else compare(static, r, indices),
        ])
    print()
    print(markdown_table(headers, rows))
    print()
    for r in results:
        if r.error:
            print(f"- {r.name} FAILED: {r.error}")
        elif r.note:
            print(f"- {r.name}: {r.note}")
    if not engine.error and not static.error:
        goal_a = engine.wall_rate / static.wall_rate
        line = f"goals: (c)/(a) = {goal_a:.2f}x wall (goal >= {GOAL_VS_STATIC}x: {'met' if goal_a >= GOAL_VS_STATIC else 'MISSED'})"
        if cb is not None and not cb.error:
            goal_b = engine.wall_rate / cb.wall_rate
            line += f"; (c)/{cb.name.split()[0]} = {goal_b:.2f}x wall (goal >= {GOAL_VS_CB}x: {'met' if goal_b >= GOAL_VS_CB else 'MISSED'})"
        print(line)
    for r in results:
        if r is not static and not r.error and r.outputs:
            for line in first_divergence(static, r, indices)[:5]:
                print(f"  {r.name} vs (a): {line}")


def cb_sweep(model, tokenizer, work: Workload, args) -> None:
    """Times (b2) in a few configs on the first 32 requests (outputs capped at 64) to pick the default."""
    sub = Workload(work.prompts[:32], [min(n, 64) for n in work.max_tokens[:32]])
    grid = [(16, 256, 256), (16, 512, 256), (16, 512, 512), (16, 1024, 512), (32, 256, 512), (64, 128, 512),
            (16, 512, 128)]
    rows = []
    for page, blocks, batch_tokens in grid:
        r = run_cb_manager(model, tokenizer, sub, args, cb_config(args, page, blocks, batch_tokens))
        rows.append([page, blocks, batch_tokens, r.error or f"{r.wall:.1f}", "" if r.error else f"{r.cpu:.1f}",
                     "" if r.error else f"{r.cpu_rate:.1f}"])
        print(f"  sweep {page=} {blocks=} {batch_tokens=}: {rows[-1][3:]}", flush=True)
    print(markdown_table(["page_size", "num_blocks", "max_batch_tokens", "wall s", "CPU s", "tok/CPU-s"], rows))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="stories", choices=sorted(MODEL_ALIASES))
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-out", type=int, default=8)
    parser.add_argument("--max-out", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="(a): static batch size")
    parser.add_argument("--cb-page-size", type=int, default=16)
    parser.add_argument("--cb-num-blocks", type=int, default=512)
    parser.add_argument("--cb-max-batch-tokens", type=int, default=256)
    parser.add_argument("--cb", choices=("both", "manager", "generate_batch", "none"), default="both",
                        help="which forms of (b) to run (default: %(default)s)")
    parser.add_argument("--cb-sweep", action="store_true", help="time a few (b2) configs on 32 requests, then exit")
    parser.add_argument("--block-size", type=int, default=16, help="(c)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="(c)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="(c)")
    parser.add_argument("--check", type=int, default=0, help="requests whose greedy tokens are compared (0: all)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    name = MODEL_ALIASES[args.model]
    try:
        model, tokenizer = load_model(name)
    except ModelUnavailable as reason:
        print(f"skipped {name}: {reason}")
        return 0
    work = make_workload(tokenizer, args)
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(p) + n for p, n in zip(work.prompts, work.max_tokens))
    if limit is not None and longest > limit:
        print(f"error: a request needs {longest} positions, {name} has {limit}", file=sys.stderr)
        return 2
    print(f"# throughput: {name}, {args.requests} requests, seed {args.seed}")
    print(machine())
    prompt_tokens = sum(map(len, work.prompts))
    print(f"prompts {args.min_prompt}-{args.max_prompt} tokens ({prompt_tokens} in all), outputs "
          f"{args.min_out}-{args.max_out} tokens ({work.output_tokens} requested), EOS ignored, greedy, fp32")

    if args.cb_sweep:
        run_cb_manager(model, tokenizer, work.head(4, 4), args)  # warm-up
        cb_sweep(model, tokenizer, work, args)
        return 0

    warm = work.head(4, 4)
    print("warm-up ...", flush=True)
    run_static(model, tokenizer, warm, args.batch_size)
    run_engine(model, tokenizer, warm, args)
    if args.cb != "none":
        run_cb_manager(model, tokenizer, warm, args)

    results = []
    static = run_static(model, tokenizer, work, args.batch_size)
    print(f"(a) done in {static.wall:.1f} s", flush=True)
    results.append(static)
    cb = None
    if args.cb in ("both", "generate_batch"):
        r = run_generate_batch(model, tokenizer, work, args)
        print(f"(b1) done in {r.wall:.1f} s" + (f" ERROR {r.error}" if r.error else ""), flush=True)
        results.append(r)
        cb = r
    if args.cb in ("both", "manager"):
        r = run_cb_manager(model, tokenizer, work, args)
        print(f"(b2) done in {r.wall:.1f} s" + (f" ERROR {r.error}" if r.error else ""), flush=True)
        results.append(r)
        cb = r
    engine = run_engine(model, tokenizer, work, args)
    print(f"(c) done in {engine.wall:.1f} s" + (f" ERROR {engine.error}" if engine.error else ""), flush=True)
    results.append(engine)

    count = len(work.prompts) if args.check <= 0 else min(args.check, len(work.prompts))
    indices = sorted(random.Random(args.seed + 1).sample(range(len(work.prompts)), count))
    report(results, static, cb, engine, indices)
    return 0


if __name__ == "__main__":
    sys.exit(main())
