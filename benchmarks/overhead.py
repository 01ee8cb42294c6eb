"""Host overhead of one engine step: step wall time minus the model forward's wall time.

A step is schedule -> forward -> sample -> update. Everything but the forward is host work that a GPU waits on.
This measures it on stories260K (a tiny real model, so the forward is short and the host work shows) with every
sequence in decode: ``N`` requests are admitted and prefilled, then ``--steps`` decode steps are timed. The prompts
have 32 to 47 tokens (``i % 16`` more for request ``i``), so that, as in serving, each step gives a new block to
about one sequence in 16 (block size 16); ``--aligned`` gives every prompt 32 tokens, as before 2026-12-07's
thirteenth session: then every sequence grows in the same step, one in 16, which the median leaves out. Prefix
caching is off unless ``--prefix-caching`` (the engine's default: the blocks decodes fill are hashed and
registered before the next prefix lookup, none here). The forward is the call of the compiled model (dynamo's guard
check and the graph, the paged attention's per-layer work included; hooks on the model would send a compiled engine
back to eager), or, in an eager engine, the model's pre-hook to hook; the engine's planning before it is host work.
"scheduler" is ``engine.scheduler.schedule()`` alone.

``--compare REF`` runs the same measurement on commit ``REF`` of this repository (a temporary git worktree,
imported in a subprocess) and prints both side by side in one run, interleaved per batch size.

    python benchmarks/overhead.py                         # 1, 64, 256, 1024 running decodes
    python benchmarks/overhead.py --compare HEAD~5 --threads 1 --rounds 3   # alternating, medians of 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(num_seqs: int, steps: int, warmup: int, output_kind: str = "final_only", aligned: bool = False,
            prefix_caching: bool = False) -> dict:
    """Median per-step times (ms) with ``num_seqs`` decoding sequences; imports paged_hf from ``sys.path``.

    ``output_kind``: what each step returns per request ("final_only" as ``generate`` asks, "delta" as a stream,
    "cumulative"); an engine without output kinds returns cumulative outputs whatever is asked."""
    import inspect

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import load_model  # noqa: PLC0415

    import paged_hf  # noqa: PLC0415

    model, tokenizer = load_model("stories260K", attn_implementation="paged")
    prompts = [[1] + [(7 * i + j) % 500 + 3 for j in range(31 + (0 if aligned else i % 16))] for i in range(num_seqs)]
    engine = paged_hf.PagedEngine(
        model, tokenizer, max_num_seqs=max(num_seqs, 1), max_num_batched_tokens=max(2048, num_seqs),
        block_size=16, num_blocks=num_seqs * 8 + 32, enable_prefix_caching=prefix_caching, max_model_len=512,
    )
    params = paged_hf.SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    kind = {}
    if "output_kind" in inspect.signature(engine.add_request).parameters:
        from paged_hf.engine.request import RequestOutputKind  # noqa: PLC0415

        kind = {"output_kind": RequestOutputKind(output_kind)}
    for prompt in prompts:
        engine.add_request(prompt, params, **kind)

    forward_times: list[float] = []
    forward_cpu: list[float] = []  # the same in CPU time of this thread (steadier on a shared machine)
    compiled = getattr(getattr(engine, "runner", None), "compiled", None)
    if compiled is not None:  # hooks on the model would make the compiled forward fall back to eager
        graph = compiled.compiled

        def timed_graph(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            out = graph(*args, **kwargs)
            forward_times.append(time.perf_counter() - t0)
            forward_cpu.append(time.thread_time() - c0)
            return out

        compiled.compiled = timed_graph
    else:
        started = [0.0, 0.0]
        model.register_forward_pre_hook(lambda *_: started.__setitem__(slice(None), [time.perf_counter(),
                                                                                     time.thread_time()]))
        model.register_forward_hook(lambda *_: (forward_times.append(time.perf_counter() - started[0]),
                                                forward_cpu.append(time.thread_time() - started[1])))
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    schedule_times: list[float] = []

    def timed_schedule(*args, **kwargs):
        t0 = time.perf_counter()
        out = schedule(*args, **kwargs)
        schedule_times.append(time.perf_counter() - t0)
        return out

    scheduler.schedule = timed_schedule
    with torch.inference_mode():
        while engine.get_stats()["num_waiting"] or any_prefilling(engine):
            engine.step()
        for _ in range(warmup):
            engine.step()
        step_times, step_cpu, forward_times[:], forward_cpu[:], schedule_times[:] = [], [], [], [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            step_times.append(time.perf_counter() - t0)
            step_cpu.append(time.thread_time() - c0)
    assert len(forward_times) == steps, "every timed step must run exactly one forward"
    host = [s - f for s, f in zip(step_times, forward_times)]
    host_cpu = [s - f for s, f in zip(step_cpu, forward_cpu)]
    ms = lambda values: round(1e3 * statistics.median(values), 3)  # noqa: E731
    return {"num_seqs": num_seqs, "step": ms(step_times), "forward": ms(forward_times), "host": ms(host), "host_cpu": ms(host_cpu),
            "scheduler": ms(schedule_times), "running": engine.get_stats()["num_running"]}


def any_prefilling(engine) -> bool:
    """Whether a running sequence still has prompt tokens to compute (read through the public stats where possible)."""
    scheduler = engine.scheduler
    return any(seq.num_computed_tokens < len(seq.token_ids) - 1 for seq in scheduler.running)


def run_at(source: Path, args, num_seqs: int) -> dict:
    """``measure`` in a fresh interpreter importing paged_hf from ``source`` (a checkout root)."""
    env = {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = (f"import json, sys; sys.path.insert(0, {str(source)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r});"
            f"import torch; torch.set_num_threads({args.threads});"
            f"from overhead import measure; print('RESULT', json.dumps(measure({num_seqs}, {args.steps}, {args.warmup}, "
            f"{args.output_kind!r}, {args.aligned}, {args.prefix_caching})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=source)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"measurement at {source} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="measurements per tree and batch size, alternating")
    parser.add_argument("--compare", metavar="REF", default=None, help="a git commit to measure beside this tree")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="the engine's default: generated blocks registered before the next prefix lookup")
    parser.add_argument("--aligned", action="store_true",
                        help="every prompt 32 tokens: every sequence takes a block in the same step (default: staggered)")
    parser.add_argument("--output-kind", choices=["final_only", "delta", "cumulative"], default="final_only",
                        help="what each step returns per request (default: as generate asks)")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import machine  # noqa: PLC0415

    print(machine())
    sources = [("this tree", ROOT)]
    tmp = None
    if args.compare:
        tmp = tempfile.mkdtemp(prefix="overhead-")
        subprocess.run(["git", "worktree", "add", "--detach", tmp, args.compare], cwd=ROOT, check=True,
                       capture_output=True)
        sources.insert(0, (f"{args.compare}", Path(tmp)))
    try:
        rows = []
        for n in args.num_seqs:
            for _ in range(args.rounds):
                for label, source in sources:
                    result = run_at(source, args, n)
                    rows.append((label, result))
                    print(f"  {label:>10}  n={n:5d}  " + "  ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    finally:
        if tmp:
            subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=ROOT, capture_output=True)

    print(f"\nms per step (median of {args.steps} steps; with --rounds, the median of the rounds' medians); "
          "host = step - forward, in wall time and in this thread's CPU time")
    metrics = ("host", "host_cpu", "scheduler", "forward")
    header = "| running decodes | " + " | ".join(f"{label} {m}" for label, _ in sources for m in metrics) + " |"
    print(header)
    print("|" + "---|" * (1 + len(metrics) * len(sources)))
    for n in args.num_seqs:
        cells = []
        for label, _ in sources:
            results = [r for lab, r in rows if lab == label and r["num_seqs"] == n]
            cells += [f"{statistics.median(r[m] for r in results if m in r):.2f}" if any(m in r for r in results)
                      else "-" for m in metrics]
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
