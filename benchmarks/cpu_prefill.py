"""The C++ CPU prefill attention's two paths side by side: its own flash attention (``paged_prefill``, where the CPU
has the products: oneDNN's brgemm on AVX-512 or AMX, the AVX2 panels on AVX2) against torch's flash kernel over
gathered blocks (``paged_prefill_flash``, the path it replaced), on the same steps, in one process, calls
alternating.

Steps: SmolLM2-135M's heads (9 query heads, 3 KV heads, head_dim 64) and a Llama-shaped GQA-4 (32 / 8, head_dim
128), block size 16, block tables a random permutation of the pool; first chunks (as in a prefill-heavy workload:
one step of 2,048 tokens over 2-3 prompts), later chunks after stored keys (chunked prefill, prefix hits), and many
short prompts. float32 and bfloat16. Columns: median wall ms of each path, the ratio (flash / own: > 1 is the
new path faster), and each path's largest distance to the float32 oracle (``paged_prefill_attention_ref``).

    PYTHONPATH=. python benchmarks/cpu_prefill.py                 # 2 threads
    PYTHONPATH=. python benchmarks/cpu_prefill.py --threads 1 --repeats 20
    PYTHONPATH=. python benchmarks/cpu_prefill.py --quick --repeats 1          # seconds: does it still run
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

from _common import machine, markdown_table  # noqa: E402

from paged_hf.kernels import cpu_ext  # noqa: E402
from paged_hf.kernels.paged_prefill_attention import paged_prefill_attention_ref  # noqa: E402
from paged_hf.kernels.pool_tensors import PoolTensors  # noqa: E402
from pools import random_block_tables, random_pools  # noqa: E402

BLOCK_SIZE = 16
HEADS = {"SmolLM2 9/3 x 64": (3, 3, 64), "GQA-4 32/8 x 128": (8, 4, 128)}  # name: (kv heads, group, head_dim)
# name: (stored keys before each chunk, the chunk's queries)
STEPS = {
    "first chunks 1000+700+348": [(0, 1000), (0, 700), (0, 348)],
    "one first chunk of 800": [(0, 800)],
    "later chunks 600+300, 0+900": [(600, 300), (0, 900)],
    "a 256 chunk after 1536 keys": [(1536, 256)],
    "16 prompts of 128": [(0, 128)] * 16,
}


def step(chunks, num_kv_heads, group, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [ctx + n for ctx, n in chunks]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lengths) + 4
    pools = PoolTensors(**random_pools("auto", num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype,
                                       seed=seed, key_offset=1.0))
    tables = random_block_tables(lengths, BLOCK_SIZE, num_blocks, gen)
    counts = [n for _, n in chunks]
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    query = torch.randn(sum(counts), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return query, pools, tables, torch.tensor(lengths), cu


def cases(quick: bool) -> tuple[dict, dict]:
    """(heads, steps) to run: all, or SmolLM2's heads and the short prompts (``--quick``, a smoke run)."""
    if not quick:
        return HEADS, STEPS
    return ({k: v for k, v in HEADS.items() if k.startswith("SmolLM2")},
            {k: v for k, v in STEPS.items() if k.startswith("16 prompts")})


def median_ms(calls: dict, repeats: int) -> dict:
    """Median wall milliseconds of each callable, run in turn (one warm-up call each first)."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this script shares with ``prefill_ab.py``: threads, repeats, the quick subset."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="SmolLM2's heads and the short prompts only (a smoke run)")


def kernels_ready(args) -> bool:
    """Sets torch's threads to ``args.threads``; whether the C++ kernels are built here (else says so)."""
    torch.set_num_threads(args.threads)
    if not cpu_ext.loaded():
        print("the C++ CPU kernels did not build here (no compiler?): nothing to compare")
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    heads, steps = cases(args.quick)
    if not kernels_ready(args):
        return 1
    own, flash, uses = (torch.ops.paged_hf_cpu.paged_prefill, torch.ops.paged_hf_cpu.paged_prefill_flash,
                        torch.ops.paged_hf_cpu.prefill_uses_own_flash)
    print(f"# CPU prefill attention: its own flash vs torch's flash kernel, {args.threads} threads")
    print(machine())
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for head_name, (num_kv_heads, group, head_dim) in heads.items():
            for step_name, chunks in steps.items():
                query, pools, tables, seq_lens, cu = step(chunks, num_kv_heads, group, head_dim, dtype)
                operands = (query, pools.key_cache, pools.value_cache, tables, seq_lens, cu, head_dim ** -0.5, None)
                if not uses(query, pools.key_cache):
                    rows.append([str(dtype).removeprefix("torch."), head_name, step_name, "-", "-", "not served here",
                                 "-", "-"])
                    continue
                want = paged_prefill_attention_ref(query, pools, tables, seq_lens, cu, head_dim ** -0.5).float()
                error = {name: (op(*operands).float() - want).abs().max().item()
                         for name, op in (("own", own), ("flash", flash))}
                ms = median_ms({"own": lambda: own(*operands), "flash": lambda: flash(*operands)}, args.repeats)
                rows.append([str(dtype).removeprefix("torch."), head_name, step_name, f"{ms['flash']:.2f}",
                             f"{ms['own']:.2f}", f"{ms['flash'] / ms['own']:.2f}x", f"{error['flash']:.1e}",
                             f"{error['own']:.1e}"])
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end\n")
    print(markdown_table(["dtype", "heads", "step", "torch flash ms", "own ms", "speed-up", "flash max err",
                          "own max err"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
