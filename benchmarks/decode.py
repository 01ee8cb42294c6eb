"""Wall time of greedy ``generate``: HF ``DynamicCache`` + sdpa (the baseline) vs ``PagedCache`` with the paged
attention and with sdpa, measured side by side in one run; with ``--compile``, also transformers' compiled decode
(``compile_config``) on ``StaticCache`` + sdpa and on ``PagedCache`` + paged (inductor on CPU), whose compile time
(the warm-up call minus a timed one) is reported apart.

For each model and batch size: one warm-up call per config, then ``--repeats`` rounds that each run the three
configs back to back (the order rotates every round, so drift in the machine's load spreads evenly). The table
gives each config's median, its ratio to the baseline's median and the median of its per-round ratios. Every
call's tokens are compared with the baseline's warm-up output: the three configs must be token-identical. Every
row generates exactly ``--new-tokens`` tokens (EOS suppressed); prompts are real text of mixed lengths, left-padded.

    PYTHONPATH=. python benchmarks/decode.py                                  # both models, batch 1 and 8
    PYTHONPATH=. python benchmarks/decode.py --models stories260K --repeats 5
    PYTHONPATH=. python benchmarks/decode.py --compile                        # + the compiled rows
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig

import paged_hf  # noqa: F401 - registers attn_implementation="paged" and cache_implementation="paged"

from _common import (
    MODEL_NAMES, ModelUnavailable, greedy_kwargs, load_model, machine, make_batch, markdown_table,
    prompt_lengths, try_pyplot,
)

GOAL = 1.25  # paged within 1.25x of DynamicCache's wall time


@dataclass(frozen=True)
class Setup:
    name: str
    attn_implementation: str
    cache: str  # "dynamic" (transformers' default), "paged" or "static"
    compiled: bool = False


EAGER_SETUPS = (
    Setup("DynamicCache + sdpa", "sdpa", "dynamic"),
    Setup("PagedCache + paged", "paged", "paged"),
    Setup("PagedCache + sdpa", "sdpa", "paged"),
)
COMPILED_SETUPS = (
    Setup("StaticCache + sdpa + compile", "sdpa", "static", compiled=True),
    Setup("PagedCache + paged + compile", "paged", "paged", compiled=True),
)
SETUPS = EAGER_SETUPS  # main() adds COMPILED_SETUPS with --compile


@dataclass
class Timing:
    model: str
    batch: int
    setup: Setup
    seconds: list[float] = field(default_factory=list)
    compile_seconds: float | None = None  # compiled setups: the warm-up call's extra time

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def generate_once(model, batch, gen_kwargs, setup: Setup, block_size: int) -> tuple[float, torch.Tensor]:
    model.set_attn_implementation(setup.attn_implementation)
    extra = {}
    if setup.cache == "paged":
        extra = {"cache_implementation": "paged", "cache_config": {"block_size": block_size}}
    elif setup.cache == "static":
        extra = {"cache_implementation": "static"}
    if setup.compiled:  # transformers' own auto-compile of the decode forward (also on CPU)
        config = CompileConfig(fullgraph=True, dynamic=False)
        config._compile_all_devices = True
        extra["compile_config"] = config
    else:
        extra["disable_compile"] = True  # a compileable cache must not switch compilation on by itself
    start = time.perf_counter()
    with torch.inference_mode():
        sequences = model.generate(**batch, **gen_kwargs, **extra)
    return time.perf_counter() - start, sequences


def bench_batch(model, tokenizer, name: str, batch_size: int, args) -> tuple[list[Timing], list[str]]:
    """Times the three setups on one batch; returns the timings and any token mismatches found."""
    lengths = prompt_lengths(batch_size, args.min_len, args.max_len, args.seed)
    batch = make_batch(tokenizer, lengths, args.seed)
    gen_kwargs = greedy_kwargs(tokenizer, args.new_tokens)
    print(f"{name}, batch {batch_size}: prompt lengths {lengths}, padded to {batch['input_ids'].shape[1]}", flush=True)
    timings = [Timing(name, batch_size, setup) for setup in SETUPS]
    warmups: dict[str, float] = {}
    mismatches: list[str] = []
    reference = None
    schedule = [("warm-up", i) for i in range(len(SETUPS))]
    for round_index in range(args.repeats):
        schedule += [(round_index, (round_index + k) % len(SETUPS)) for k in range(len(SETUPS))]
    for round_index, i in schedule:
        seconds, sequences = generate_once(model, batch, gen_kwargs, SETUPS[i], args.block_size)
        expected_width = batch["input_ids"].shape[1] + args.new_tokens
        if sequences.shape[1] != expected_width:
            mismatches.append(f"{SETUPS[i].name}: {sequences.shape[1]} columns, expected {expected_width}")
        if reference is None:
            reference = sequences
        elif not torch.equal(sequences, reference):
            rows = (sequences != reference).any(-1).nonzero().flatten().tolist()
            mismatches.append(f"{SETUPS[i].name} (round {round_index}): rows {rows} differ from DynamicCache + sdpa")
        if round_index != "warm-up":
            timings[i].seconds.append(seconds)
        else:
            warmups[SETUPS[i].name] = seconds
        print(f"  {round_index!s:>7}  {SETUPS[i].name:<20} {seconds:8.2f} s", flush=True)
    for timing in timings:
        if timing.setup.compiled:
            timing.compile_seconds = warmups[timing.setup.name] - timing.median
    return timings, mismatches


def paired_ratio(timing: Timing, baseline: Timing) -> float:
    """Median over rounds of this config's time / the baseline's time in the same round: robust to load drift
    between rounds, since the three configs of a round run back to back."""
    return statistics.median(t / b for t, b in zip(timing.seconds, baseline.seconds))


def table(timings: list[Timing], new_tokens: int) -> str:
    rows = []
    for group_start in range(0, len(timings), len(SETUPS)):
        group = timings[group_start : group_start + len(SETUPS)]
        baseline = group[0].median
        for timing in group:
            rows.append([
                timing.model, timing.batch, timing.setup.name, f"{timing.median:.3f}",
                f"{timing.batch * new_tokens / timing.median:.1f}", f"{timing.median / baseline:.2f}x",
                f"{paired_ratio(timing, group[0]):.2f}x",
                "-" if timing.compile_seconds is None else f"{timing.compile_seconds:.1f}",
                ", ".join(f"{s:.2f}" for s in timing.seconds),
            ])
    headers = [
        "model", "batch", "config", "median s", "tokens/s", "ratio vs DynamicCache", "per-round ratio (median)",
        "compile s", "runs (s)",
    ]
    return markdown_table(headers, rows)


def plot(timings: list[Timing], path: str) -> None:
    plt = try_pyplot()
    if plt is None:
        return
    labels = sorted({(t.model, t.batch) for t in timings}, key=lambda mb: (mb[0], mb[1]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(SETUPS)
    for k, setup in enumerate(SETUPS):
        ratios = []
        for model, batch in labels:
            group = [t for t in timings if (t.model, t.batch) == (model, batch)]
            ratios.append(group[k].median / group[0].median)
        ax.bar([x + k * width for x in range(len(labels))], ratios, width, label=setup.name)
    ax.axhline(GOAL, color="k", linestyle="--", label=f"goal {GOAL}x")
    ax.set_xticks([x + width for x in range(len(labels))], [f"{m}\nbatch {b}" for m, b in labels])
    ax.set_ylabel("wall time / DynamicCache + sdpa")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help=f"comma-separated, from {MODEL_NAMES}")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--min-len", type=int, default=16, help="shortest prompt, in tokens")
    parser.add_argument("--max-len", type=int, default=256, help="longest prompt, in tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart of the ratios")
    parser.add_argument("--compile", action="store_true",
                        help="add compiled decode: StaticCache + sdpa and PagedCache + paged (inductor)")
    args = parser.parse_args(argv)
    global SETUPS
    SETUPS = EAGER_SETUPS + (COMPILED_SETUPS if args.compile else ())
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODEL_NAMES]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {MODEL_NAMES}")
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)

    print(f"# Decode wall time\n\nmachine: {machine()}")
    print(f"greedy, {args.new_tokens} new tokens, block_size {args.block_size}, {args.repeats} timed rounds\n")
    timings: list[Timing] = []
    problems: list[str] = []
    for name in models:
        try:
            model, tokenizer = load_model(name, attn_implementation="sdpa")
        except ModelUnavailable as reason:
            print(f"skipped {name}: {reason}")
            continue
        for batch_size in batches:
            found, mismatches = bench_batch(model, tokenizer, name, batch_size, args)
            timings += found
            problems += [f"{name} batch {batch_size}: {m}" for m in mismatches]
        del model
    if not timings:
        print("no model available: nothing measured")
        return 0

    print()
    print(table(timings, args.new_tokens))
    print()
    if problems:
        print("outputs NOT token-identical:\n  " + "\n  ".join(problems))
    else:
        print(f"outputs token-identical: the {len(SETUPS)} configs (and every repeat) produced the same tokens")
    for k in range(0, len(timings), len(SETUPS)):
        baseline, paged = timings[k], timings[k + 1]
        ratio, paired = paged.median / baseline.median, paired_ratio(paged, baseline)
        verdict = "within" if max(ratio, paired) <= GOAL else "outside"
        print(
            f"{paged.model} batch {paged.batch}: PagedCache + paged is {ratio:.2f}x DynamicCache by medians, "
            f"{paired:.2f}x by per-round ratios ({verdict} the {GOAL}x goal)"
        )
    if args.plot:
        plot(timings, args.plot)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
