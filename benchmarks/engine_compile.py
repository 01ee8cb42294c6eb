"""Engine throughput, compiled forward (the default) vs ``enforce_eager=True``, side by side in one process.

A seeded mixed workload (``--requests`` prompts of real text, 16-128 tokens, outputs of 8-``--max-out`` tokens, EOS
ignored) runs through two engines over the same model, alternating eager / compiled for ``--rounds`` rounds; each
run reports generated tokens per wall-clock second and per CPU-second of this process. The compiled engine's
construction time is its warm-up (torch.compile of the forward). Greedy tokens of the two are compared per request
(float32: they must be equal). ``--linears packed unpacked`` adds a second pair of engines whose bfloat16 CPU linears
are not packed for oneDNN (``PAGED_HF_PACKED_LINEAR=0``), all four alternating: the gain of packing, in one run. The load average is printed before every run: the machine is shared.

``--profile`` adds a torch.profiler table of one decode-only step (``--requests`` sequences) per mode: where the time
goes when the compiled forward is not faster.

    PYTHONPATH=. python benchmarks/engine_compile.py --models stories260K smollm2 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import time

import torch

import paged_hf  # noqa: F401 - registers the "paged" attention
from paged_hf import PagedEngine, SamplingParams, packed_linear

from _common import ModelUnavailable, load_model, machine, markdown_table, text_prompts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def workload(tokenizer, count: int, max_out: int, seed: int = 0):
    rng = random.Random(seed)
    lengths = [rng.randint(16, 128) for _ in range(count)]
    prompts = [{"prompt_token_ids": ids} for ids in text_prompts(tokenizer, lengths, seed)]
    params = [SamplingParams(max_tokens=rng.randint(8, max_out), temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


def run(engine: PagedEngine, prompts, params) -> tuple[float, float, list[list[int]]]:
    wall, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(len(t) for t in tokens)
    return n / wall, n / cpu, tokens


def profile_decode_step(engine: PagedEngine, prompts, rows: int) -> str:
    """The profiler table of one step in which every running sequence decodes."""
    long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, long)
    while engine.get_stats()["num_waiting"]:
        engine.step()
    for _ in range(6):  # past every prompt chunk: decode-only steps
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def build(model, tokenizer, options, packed: bool) -> tuple[PagedEngine, PagedEngine, float]:
    """(eager, compiled, warm-up seconds) over ``model``, its bfloat16 CPU linears packed for oneDNN or not
    (``PAGED_HF_PACKED_LINEAR``; unpacked: on a copy of the model, so both kinds can run in one process)."""
    previous = os.environ.get(packed_linear.ENV)
    os.environ[packed_linear.ENV] = "1" if packed else "0"
    try:
        if not packed:
            model = copy.deepcopy(model)
        eager = PagedEngine(model, tokenizer, enforce_eager=True, **options)
        begin = time.perf_counter()
        compiled = PagedEngine(model, tokenizer, **options)
        return eager, compiled, time.perf_counter() - begin
    finally:
        if previous is None:
            os.environ.pop(packed_linear.ENV)
        else:
            os.environ[packed_linear.ENV] = previous


def bench(name: str, dtype_name: str, args) -> list[list]:
    model, tokenizer = load_model(name)
    model = model.to(args.device, DTYPES[dtype_name])
    prompts, params = workload(tokenizer, args.requests, args.max_out)
    options = dict(block_size=16, num_blocks=args.num_blocks, max_num_seqs=args.requests,
                   max_num_batched_tokens=512)
    engines, warm_ups = {}, {}
    for linears in sorted(args.linears, reverse=True):  # unpacked first: it copies the model before packing
        print(f"{name} {dtype_name} {linears}: compiling ({load()})", flush=True)
        eager, compiled, warm_ups[linears] = build(model, tokenizer, options, linears == "packed")
        if compiled.runner.compiled is None:
            print(f"{name} {dtype_name}: the forward did not compile; the 'compiled' engine runs eagerly")
        engines[(linears, "eager")], engines[(linears, "compiled")] = eager, compiled
    for engine in engines.values():  # first-call costs (allocator, lazy imports) out of the timed rounds
        run(engine, prompts[:2], params[:2])
    results = {key: [] for key in engines}
    tokens = {}
    for round_index in range(args.rounds):
        for key, engine in engines.items():
            before = load()
            wall, cpu, tokens[key] = run(engine, prompts, params)
            results[key].append((wall, cpu))
            print(f"  round {round_index} {key[0]:8s} {key[1]:8s} {wall:8.1f} tok/s  {cpu:8.1f} tok/CPU-s  ({before})",
                  flush=True)
    first = next(iter(engines))[0]  # the first kind of linears: the others' tokens are compared with its own
    rows = []
    for linears in {key[0]: None for key in engines}:
        medians = {mode: (statistics.median(w for w, _ in results[(linears, mode)]),
                          statistics.median(c for _, c in results[(linears, mode)])) for mode in ("eager", "compiled")}
        same = sum(a == b for a, b in zip(tokens[(linears, "eager")], tokens[(linears, "compiled")]))
        same_first = "/".join(str(sum(a == b for a, b in zip(tokens[(first, mode)], tokens[(linears, mode)])))
                              for mode in ("eager", "compiled"))
        rows.append([name, dtype_name, linears, f"{medians['eager'][0]:.1f}", f"{medians['compiled'][0]:.1f}",
                     f"{medians['compiled'][0] / medians['eager'][0]:.2f}x", f"{medians['eager'][1]:.1f}",
                     f"{medians['compiled'][1]:.1f}", f"{medians['compiled'][1] / medians['eager'][1]:.2f}x",
                     f"{warm_ups[linears]:.1f}", f"{same}/{len(prompts)}", f"{same_first} of {len(prompts)}"])
    if args.profile:
        for (linears, mode), engine in engines.items():
            print(f"\n### {name} {dtype_name}: one decode step of {args.requests} sequences, {mode}, {linears} "
                  f"({load()})\n")
            print(profile_decode_step(engine, prompts, args.profile_rows))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["stories260K"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-out", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the model and the KV pool go there)")
    parser.add_argument("--linears", nargs="+", default=["packed"], choices=["packed", "unpacked"],
                        help="bfloat16 CPU linears packed for oneDNN once (the default) and/or not "
                        "(PAGED_HF_PACKED_LINEAR=0), each its own pair of engines, alternating in one run")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=14)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {load()}")
    rows = []
    for name in args.models:
        for dtype_name in args.dtypes:
            try:
                rows += bench(name, dtype_name, args)
            except ModelUnavailable as why:
                print(f"{name}: skipped ({why})")
    print()
    print(markdown_table(["model", "dtype", "linears", "eager tok/s", "compiled tok/s", "ratio", "eager tok/CPU-s",
                          "compiled tok/CPU-s", "ratio", "warm-up s", "same tokens",
                          "same as the first linears' (eager/compiled)"], rows))
    print(f"\n(medians of {args.rounds} alternating rounds; {args.requests} requests; threads {args.threads}; "
          f"{load()})")


if __name__ == "__main__":
    main()
