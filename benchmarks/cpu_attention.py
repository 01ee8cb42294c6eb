"""CPU paged attention: the float32 oracle (``attention_ref``, the CPU path before ``cpu_attention``) vs the
production path (``kernels.cpu_attention``), side by side in one process.

- Decode: batches 1, 8, 32, 128 at contexts 128 .. 1024, one query per sequence.
- Prefill: chunks 32 .. 512 at the end of a context (a first chunk: context 0), 1 and 4 sequences.
- float32 and bfloat16 pools and queries; ``auto`` (the model dtype) for the grid, int8 and int4 on a few shapes.
- SmolLM2-135M's head shapes: 9 query heads, 3 KV heads, head_dim 64; block size 16; block tables a random
  permutation of the pool.
- End to end (``--e2e``): ``PagedEngine`` on SmolLM2, greedy, ``--requests`` prompts of real text, with the oracle
  forced (``PAGED_HF_KERNELS=reference``) vs the default CPU path, float32 (greedy tokens compared) and bfloat16.

Timing: the two paths alternate call by call, ``--repeats`` timed calls each after a warm-up, the median kept;
"speed-up" is oracle time / production time, in CPU seconds of this process (``time.process_time``: the cores are
shared, and other jobs stretch wall time several-fold) and in wall seconds. The load average is printed with each
table. The end-to-end table gives wall tokens/s and the CPU-time ratio.

    PYTHONPATH=. python benchmarks/cpu_attention.py --threads 1,2          # kernels only (a few minutes)
    PYTHONPATH=. python benchmarks/cpu_attention.py --threads 1 --e2e      # plus the engine on SmolLM2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _common import load_model, machine, markdown_table, prompt_lengths, text_prompts  # noqa: E402

from paged_hf.kernels.cpu_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu  # noqa: E402
from paged_hf.kernels.kv_format import kv_format as get_format  # noqa: E402
from paged_hf.kernels.paged_decode_attention import paged_decode_attention_ref  # noqa: E402
from paged_hf.kernels.paged_prefill_attention import paged_prefill_attention_ref  # noqa: E402
from pools import kernel_args, random_pools  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DECODE = [(1, 1024), (8, 128), (8, 1024), (32, 128), (32, 512), (32, 1024), (128, 256), (128, 1024)]
PREFILL = [(1, 0, 128), (1, 0, 512), (1, 512, 32), (1, 512, 128), (1, 512, 512), (4, 256, 128), (4, 768, 256)]
QUANT_DECODE, QUANT_PREFILL = [(32, 512), (128, 1024)], [(1, 512, 128), (4, 768, 256)]


def load() -> str:
    return "load average %.1f %.1f %.1f" % os.getloadavg()


def alternate(calls: dict, repeats: int) -> dict:
    """``{name: (median wall seconds, median CPU seconds of this process)}`` of each callable, the callables run in
    turn (one warm-up call each first). CPU seconds (all threads, ``time.process_time``) are what the table's
    speed-up uses: other jobs' load stretches wall time many times over on these shared cores, CPU time far less."""
    for call in calls.values():
        call()
    times = {name: ([], []) for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            wall, cpu = time.perf_counter(), time.process_time()
            call()
            times[name][0].append(time.perf_counter() - wall)
            times[name][1].append(time.process_time() - cpu)
    return {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in times.items()}


def timing_row(t: dict) -> list[str]:
    (ref_wall, ref_cpu), (cpu_wall, cpu_cpu) = t["ref"], t["cpu"]
    return [f"{ref_cpu * 1e3:.2f}", f"{cpu_cpu * 1e3:.2f}", f"**{ref_cpu / cpu_cpu:.2f}x**",
            f"{ref_wall / cpu_wall:.2f}x"]


def operands(kv_format, dtype, seq_lens, seed=0) -> dict:
    """Pools sized to the batch, block tables a random permutation, int4's tail rows; ``seq_lens`` per sequence."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(needed) + 1
    ops = random_pools(kv_format, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, seed=seed,
                       num_rows=len(seq_lens), key_offset=1.0)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(needed):
        tables[s, :n] = order[used : used + n]
        used += n
    if get_format(kv_format).tail:
        ops["tail_rows"] = torch.arange(len(seq_lens))
    return dict(kernel_args(ops), block_tables=tables, seq_lens=torch.tensor(seq_lens), scale=HEAD_DIM ** -0.5)


def decode_case(kv_format, dtype, batch, context):
    ops = operands(kv_format, dtype, [context] * batch)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM).to(dtype)
    if "tail_rows" in ops:
        ops.update(fresh_key=torch.randn(batch, NUM_KV_HEADS, HEAD_DIM).to(dtype),
                   fresh_value=torch.randn(batch, NUM_KV_HEADS, HEAD_DIM).to(dtype))
    return (lambda: paged_decode_attention_ref(query, **ops)), (lambda: paged_decode_attention_cpu(query, **ops))


def prefill_case(kv_format, dtype, batch, context, chunk):
    ops = operands(kv_format, dtype, [context + chunk] * batch)
    total = batch * chunk
    query = torch.randn(total, NUM_HEADS, HEAD_DIM).to(dtype)
    ops["cu_query_lens"] = torch.arange(0, total + 1, chunk)
    if "tail_rows" in ops:
        ops.update(fresh_key=torch.randn(total, NUM_KV_HEADS, HEAD_DIM).to(dtype),
                   fresh_value=torch.randn(total, NUM_KV_HEADS, HEAD_DIM).to(dtype))
    return (lambda: paged_prefill_attention_ref(query, **ops)), (lambda: paged_prefill_attention_cpu(query, **ops))


def kernel_tables(threads: int, repeats: int, formats: list[str]) -> str:
    torch.set_num_threads(threads)
    lines = [f"### {threads} thread(s); {load()} at start", ""]
    rows = []
    for kv_format in formats:
        decode, prefill = (DECODE, PREFILL) if kv_format == "auto" else (QUANT_DECODE, QUANT_PREFILL)
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            for batch, context in decode:
                ref, cpu = decode_case(kv_format, dtype, batch, context)
                t = alternate({"ref": ref, "cpu": cpu}, repeats)
                rows.append([kv_format, name, "decode", batch, context, "1", *timing_row(t)])
            for batch, context, chunk in prefill:
                ref, cpu = prefill_case(kv_format, dtype, batch, context, chunk)
                t = alternate({"ref": ref, "cpu": cpu}, repeats)
                rows.append([kv_format, name, "prefill", batch, context, chunk, *timing_row(t)])
            print(f"  {kv_format} {name} done ({load()})", file=sys.stderr)
    lines.append(markdown_table(["format", "dtype", "kind", "seqs", "context", "queries/seq", "oracle CPU ms",
                                 "production CPU ms", "speed-up (CPU time)", "speed-up (wall)"], rows))
    lines += ["", f"{load()} at end", ""]
    return "\n".join(lines)


def end_to_end(threads: int, requests: int, new_tokens: int, repeats: int) -> str:
    """PagedEngine on SmolLM2 with the oracle forced vs the production path, float32 and bfloat16."""
    from paged_hf import PagedEngine, SamplingParams  # noqa: PLC0415

    torch.set_num_threads(threads)
    model, tokenizer = load_model("smollm2")
    prompts = text_prompts(tokenizer, prompt_lengths(requests, 32, 256, seed=0), seed=0)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)

    def run(kernels: str):
        os.environ["PAGED_HF_KERNELS"] = kernels  # read once, when the engine makes its pools
        engine = PagedEngine(model, tokenizer, block_size=16, max_num_seqs=requests, max_num_batched_tokens=512)
        start, cpu = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, params, use_tqdm=False)
        seconds = (time.perf_counter() - start, time.process_time() - cpu)
        model.set_attn_implementation("sdpa")
        return seconds, [list(o.outputs[0].token_ids) for o in outs]

    lines = [f"### End to end: PagedEngine, SmolLM2-135M, {requests} requests (prompts 32-256 tokens of real text), "
             f"{new_tokens} greedy tokens each, {threads} thread(s); {load()} at start", ""]
    rows = []
    saved = os.environ.get("PAGED_HF_KERNELS")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            model.to(dtype)
            times = {"reference": [], "torch": []}
            tokens = {}
            for _ in range(repeats):
                for kernels in times:
                    seconds, tokens[kernels] = run(kernels)
                    times[kernels].append(seconds)
            (ref, ref_cpu), (cpu, cpu_cpu) = ([statistics.median(x) for x in zip(*times[k])] for k in times)
            same = sum(a == b for a, b in zip(tokens["reference"], tokens["torch"]))
            out_tokens = requests * new_tokens
            rows.append([str(dtype).removeprefix("torch."), f"{out_tokens / ref:.1f}", f"{out_tokens / cpu:.1f}",
                         f"{ref / cpu:.2f}x", f"**{ref_cpu / cpu_cpu:.2f}x**", f"{same}/{requests}"])
    finally:
        if saved is None:
            os.environ.pop("PAGED_HF_KERNELS", None)
        else:
            os.environ["PAGED_HF_KERNELS"] = saved
    lines.append(markdown_table(["dtype", "oracle tok/s (wall)", "production tok/s (wall)", "speed-up (wall)",
                                 "speed-up (CPU time)", "greedy tokens equal"], rows))
    lines += ["", f"{load()} at end", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", default="auto,int8,int4")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--e2e", action="store_true", help="also run PagedEngine on SmolLM2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--e2e-repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"# CPU paged attention: oracle vs production\n\n{machine()}\n")
    for threads in [int(t) for t in args.threads.split(",")]:
        if not args.skip_kernels:
            print(kernel_tables(threads, args.repeats, args.formats.split(",")), flush=True)
        if args.e2e:
            print(end_to_end(threads, args.requests, args.new_tokens, args.e2e_repeats), flush=True)


if __name__ == "__main__":
    main()
