"""Triton kernels of the paged path on a CUDA GPU: achieved bandwidth of paged decode, quantized formats vs
float16, the kernels vs torch SDPA on a dense cache, plus a correctness spot check against the torch references.

- Copy bandwidth: a large ``Tensor.copy_`` in the same run (bytes read + written / time): the ceiling to compare to.
- Paged decode: KV bytes read (codes + scales/zeros of every token of every sequence, K and V) / kernel time, as
  a fraction of the copy bandwidth, for contexts 1k..32k and batches 1..64 (float16 pools).
- Formats: int8 / fp8 / int4 vs float16 pools at long contexts (time and speed-up).
- SDPA: ``torch.nn.functional.scaled_dot_product_attention`` on a dense ``[B, kv_heads, L, D]`` cache of the same
  lengths (GQA), one query token.
- Prefill: a causal chunk against its paged past vs SDPA on the dense equivalent.

Timing: CUDA events around each call, warm-up calls first, the L2 cache flushed before every timed call (a
256 MiB write), median of ``--repeats``. Shapes: 8 KV heads x group 4 (32 query heads), head_dim 128, block size
16, float16 queries, block tables a random permutation of the pool (fragmented). Writes a markdown report to
stdout and, when ``OUT`` is set, to ``$OUT/kernels.md``.

    python benchmarks/gpu_kernels.py                 # the full run (a few minutes on an H100/H200)
    python benchmarks/gpu_kernels.py --quick         # fewer shapes and repeats, bf16-only spot check
    python benchmarks/gpu_kernels.py --tune          # sweep the decode kernel's tile/partition/warps/stages instead
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 8, 4, 128, 16
DTYPE = torch.float16
FLUSH_BYTES = 256 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--formats", nargs="+", default=["auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4"])
    parser.add_argument("--long-contexts", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="contexts 1k/8k, batches 1/16, 7 repeats")
    parser.add_argument("--tune", action="store_true",
                        help="only sweep the decode kernel's tile size, partition size, warps and stages")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu_kernels.py measures the Triton kernels on a CUDA GPU; no CUDA device is visible here "
              "(torch.cuda.is_available() is False). Nothing measured.", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError:
        print("benchmarks/gpu_kernels.py needs triton (pip install triton). Nothing measured.", file=sys.stderr)
        return 2
    if args.quick:
        args.contexts, args.batches, args.long_contexts, args.repeats = [1024, 8192], [1, 16], [8192], 7

    from paged_hf.kernels.copy_blocks import copy_blocks  # noqa: PLC0415
    from paged_hf.kernels.paged_decode_attention import paged_decode_attention  # noqa: PLC0415
    from paged_hf.kernels.paged_prefill_attention import paged_prefill_attention  # noqa: PLC0415

    bench = Bench(args.repeats)
    device = torch.device("cuda")
    if args.tune:
        text = "\n".join(tune_decode(bench, device, args.formats, max(args.long_contexts))) + "\n"
        print(text)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
            (Path(os.environ["OUT"]) / "kernels_tune.md").write_text(text)
        return 0
    report = [f"# Paged attention kernels: {torch.cuda.get_device_name(0)}", "",
              f"torch {torch.__version__}, "
              f"triton {sys.modules['triton'].__version__}; {NUM_KV_HEADS} KV heads x group {GROUP}, head_dim "
              f"{HEAD_DIM}, block size {BLOCK_SIZE}, {str(DTYPE).split('.')[-1]} queries; median of {args.repeats}, "
              "L2 flushed before each call.", ""]
    started = time.time()

    report += ["## Correctness spot check (compiled kernels vs torch references, same pools)", ""]
    report += spot_check(device, quick=args.quick)

    copy_gbs = bench.copy_bandwidth(device)
    report += ["", "## Copy bandwidth", "",
               f"`Tensor.copy_` of 2 GiB: **{copy_gbs:.0f} GB/s** (bytes read + written per second).", ""]

    # --- decode bandwidth, float16 pools
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            case = DecodeCase(batch, context, "auto", device)
            sec = bench.time(lambda: paged_decode_attention(case.query, **case.kwargs))
            sdpa_sec = bench.time(case.sdpa()) if case.dense_fits() else float("nan")
            gbs = case.kv_bytes / sec / 1e9
            rows.append([batch, context, f"{case.kv_bytes / 2**20:.1f}", f"{sec * 1e6:.1f}", f"{gbs:.0f}",
                         f"{gbs / copy_gbs:.0%}", *_vs(sdpa_sec, sec)])
            del case
            torch.cuda.empty_cache()
    report += ["## Paged decode, float16 pools", "",
               "Bandwidth = KV bytes read / kernel time; fraction of the copy bandwidth above. SDPA: the same "
               "lengths as a dense cache (speed-up = SDPA time / paged time).", ""]
    report += table(["batch", "context", "KV MiB", "paged us", "GB/s", "of copy", "SDPA dense us", "speed-up"],
                    rows)

    # --- quantized formats at long contexts
    rows = []
    for context in args.long_contexts:
        for batch in sorted({min(args.batches), max(args.batches)}):
            base_sec = None
            for kv_format in args.formats:
                case = DecodeCase(batch, context, kv_format, device)
                sec = bench.time(lambda: paged_decode_attention(case.query, **case.kwargs))
                base_sec = sec if kv_format == "auto" else base_sec
                gbs = case.kv_bytes / sec / 1e9
                rows.append([batch, context, kv_format, f"{case.kv_bytes / 2**20:.1f}", f"{sec * 1e6:.1f}",
                             f"{gbs:.0f}", f"{gbs / copy_gbs:.0%}",
                             f"{base_sec / sec:.2f}x" if base_sec is not None else "-"])
                del case
                torch.cuda.empty_cache()
    report += ["", "## Quantized pools at long contexts", "",
               "speed-up = float16 (\"auto\") time / this format's time, same batch and context.", ""]
    report += table(["batch", "context", "format", "KV MiB", "paged us", "GB/s", "of copy", "vs fp16"], rows)

    # --- prefill chunks
    rows = []
    for past, chunk in ((0, 2048), (8192, 512), (30720, 2048)):
        for kv_format in ("auto", "int8"):
            case = PrefillCase(past, chunk, kv_format, device)
            sec = bench.time(lambda: paged_prefill_attention(case.query, **case.kwargs))
            sdpa_sec = bench.time(case.sdpa()) if kv_format == "auto" else float("nan")
            rows.append([past, chunk, kv_format, f"{sec * 1e6:.1f}", f"{case.flops / sec / 1e12:.1f}",
                         *_vs(sdpa_sec, sec)])
            del case
            torch.cuda.empty_cache()
    report += ["", "## Paged prefill (one sequence: a causal chunk after `past` tokens)", "",
               "TFLOP/s counts the visible (causal) score and value products. SDPA: dense K/V of the whole "
               "sequence with the chunk's causal mask.", ""]
    report += table(["past", "chunk", "format", "paged us", "TFLOP/s", "SDPA dense us", "speed-up"], rows)

    # --- store and block copy
    rows = []
    for kv_format in args.formats:
        tokens = 8192
        pools = make_pools(kv_format, tokens // BLOCK_SIZE + 8, device)
        key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        value = torch.randn_like(key)
        slots = torch.randperm(tokens + 8 * BLOCK_SIZE, device=device)[:tokens]
        sec = bench.time(lambda: store_whole(key, value, slots, pools))  # int4: whole blocks fill
        written = sum(t.nbytes for t in pools.block_tensors()) * tokens / (tokens + 8 * BLOCK_SIZE)
        moved = key.nbytes * 2 + written
        ids = torch.randperm(tokens // BLOCK_SIZE, device=device)
        pairs = min(64, ids.numel() // 2)
        src, dst = ids[:pairs], ids[pairs : 2 * pairs]
        tensors = pools.block_tensors()
        copy_sec = bench.time(lambda: copy_blocks(src, dst, tensors))
        copied = 2 * sum(t[0].nbytes for t in tensors) * pairs
        rows.append([kv_format, tokens, f"{sec * 1e6:.1f}", f"{moved / sec / 1e9:.0f}", f"{copy_sec * 1e6:.1f}",
                     f"{copied / copy_sec / 1e9:.0f}"])
        del pools, tensors
        torch.cuda.empty_cache()
    report += ["", "## Store (quantize + scatter) and block copy", "",
               "store GB/s: input K/V read + pool bytes written; copy: 64 blocks of every pool tensor, bytes read + "
               "written (small: launch-bound).", ""]
    report += table(["format", "tokens", "store us", "store GB/s", "copy 64 blocks us", "copy GB/s"], rows)

    report += ["", f"Total benchmark time: {time.time() - started:.0f} s."]
    text = "\n".join(report) + "\n"
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "kernels.md").write_text(text)
    return 0


# ------------------------------------------------------------------------------------------------ timing


class Bench:
    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def time(self, fn, warmup: int = 3) -> float:
        """Median seconds of ``fn()`` (CUDA events), L2 flushed before each timed call."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def copy_bandwidth(self, device) -> float:
        """GB/s of a 2 GiB device-to-device ``copy_`` (read + write bytes)."""
        src = torch.empty(2 << 30, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        seconds = self.time(lambda: dst.copy_(src))
        del src, dst
        return 2 * (2 << 30) / seconds / 1e9


def _vs(other_seconds: float, seconds: float) -> list[str]:
    """The other side's time in us and its ratio to ours, or dashes when it was not measured."""
    if other_seconds != other_seconds:  # NaN
        return ["-", "-"]
    return [f"{other_seconds * 1e6:.1f}", f"{other_seconds / seconds:.2f}x"]


def table(headers, rows) -> list[str]:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return lines


# ------------------------------------------------------------------------------------------------ cases


def block_fill_plan(first_block: int, num_blocks: int, device):
    """A tail format's ``StorePlan`` for ``num_blocks * BLOCK_SIZE`` new tokens that fill blocks ``first_block ..``
    whole, in order (no token stays in a tail row)."""
    from paged_hf.kernels.fill_blocks import StorePlan  # noqa: PLC0415

    fills = torch.arange(num_blocks, device=device)
    return StorePlan(torch.full((num_blocks * BLOCK_SIZE,), -1, device=device), fills + first_block,
                     torch.zeros_like(fills), fills * BLOCK_SIZE, torch.zeros_like(fills))


def store_whole(key, value, slots, pools, first_block: int = 0) -> None:
    """Stores ``key``/``value`` at ``slots``; a tail format (int4) quantizes whole blocks instead: the tokens fill
    blocks ``first_block ..`` in order (``slots`` unused)."""
    from paged_hf.kernels.store_kv import store_kv  # noqa: PLC0415

    plan = {}
    if pools.key_tail is not None:
        plan = {"plan": block_fill_plan(first_block, key.shape[0] // BLOCK_SIZE, key.device)}
    store_kv(key, value, slots, pools, **plan)


def tail_operands(pools, num_seqs: int, num_tokens: int, device) -> dict:
    """A tail format's attention operands beside the pools: every sequence on tail row 0, and random new K/V of the
    forward's ``num_tokens`` queries (what the store hands the attention); nothing for other formats."""
    if pools.key_tail is None:
        return {}
    fresh = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=pools.key_tail.dtype, device=device)
    return dict(tail_rows=torch.zeros(num_seqs, dtype=torch.long, device=device), fresh_key=fresh[0],
                fresh_value=fresh[1])


def make_pools(kv_format: str, num_blocks: int, device):
    """Pools of random K/V in ``kv_format`` (quantized on the GPU by the store kernel; int4: whole blocks, one tail
    row)."""
    from paged_hf.quant import make_storage  # noqa: PLC0415

    storage = make_storage(kv_format, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, DTYPE, device)
    storage.ensure_tail_rows(1)
    operands = storage.pool_tensors()
    tokens = num_blocks * BLOCK_SIZE
    step = 1 << 16
    for first in range(0, tokens, step):
        n = min(step, tokens - first)
        key = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        store_whole(key, torch.randn_like(key), torch.arange(first, first + n, device=device), operands,
                    first // BLOCK_SIZE)
    return operands


def bytes_per_token(pools) -> float:
    """Pool bytes of one token (K and V, codes and side data, a block's shared side data spread over its tokens)."""
    cache = pools.key_cache
    return sum(t.nbytes for t in pools.block_tensors()) / (cache.shape[0] * cache.shape[1])


class DecodeCase:
    """``batch`` sequences of ``context`` tokens each in fragmented paged pools, one query token each."""

    def __init__(self, batch: int, context: int, kv_format: str, device) -> None:
        blocks_per_seq = -(-context // BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq
        self.pools = make_pools(kv_format, num_blocks, device)
        tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
        self.batch, self.context, self.device = batch, context, device
        self.query = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=DTYPE, device=device)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.kwargs = dict(block_tables=tables, seq_lens=seq_lens, scale=HEAD_DIM ** -0.5, pools=self.pools,
                           **tail_operands(self.pools, batch, batch, device))
        self.kv_bytes = batch * context * bytes_per_token(self.pools)

    def dense_fits(self) -> bool:
        free, _ = torch.cuda.mem_get_info()
        return 2 * self.batch * self.context * NUM_KV_HEADS * HEAD_DIM * 2 < free * 0.8

    def sdpa(self):
        shape = (self.batch, NUM_KV_HEADS, self.context, HEAD_DIM)
        key = torch.randn(shape, dtype=DTYPE, device=self.device)
        value = torch.randn_like(key)
        query = self.query.unsqueeze(2)  # [B, heads, 1, D]
        self._dense = (key, value)
        return lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, enable_gqa=True)


class PrefillCase:
    """One sequence: ``past`` tokens already cached, then a causal chunk of ``chunk`` queries (stored too)."""

    def __init__(self, past: int, chunk: int, kv_format: str, device) -> None:
        total = past + chunk
        num_blocks = -(-total // BLOCK_SIZE)
        self.pools = make_pools(kv_format, num_blocks, device)
        tables = torch.randperm(num_blocks, device=device).view(1, num_blocks).to(torch.int32)
        self.query = torch.randn(chunk, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=DTYPE, device=device)
        self.kwargs = dict(block_tables=tables, seq_lens=torch.tensor([total], device=device),
                           cu_query_lens=torch.tensor([0, chunk], device=device), scale=HEAD_DIM ** -0.5,
                           pools=self.pools, **tail_operands(self.pools, 1, chunk, device))
        visible = chunk * past + chunk * (chunk + 1) / 2
        self.flops = 4 * visible * NUM_KV_HEADS * GROUP * HEAD_DIM
        self.past, self.chunk, self.device = past, chunk, device

    def sdpa(self):
        total = self.past + self.chunk
        key = torch.randn(1, NUM_KV_HEADS, total, HEAD_DIM, dtype=DTYPE, device=self.device)
        value = torch.randn_like(key)
        query = self.query.transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, D]
        rows = torch.arange(self.past, total, device=self.device).view(-1, 1)
        mask = torch.arange(total, device=self.device).view(1, -1) <= rows
        self._dense = (key, value, mask)
        return lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                                        enable_gqa=True)


def tune_decode(bench: Bench, device, formats, context: int) -> list[str]:
    """Decode time over BLOCK_N x PARTITION_SIZE x num_warps x num_stages (module settings, restored after)."""
    from paged_hf.kernels import paged_decode_attention as decode  # noqa: PLC0415

    saved = (decode.BLOCK_N, decode.PARTITION_SIZE, dict(decode.DECODE_OPTIONS))
    rows = []
    try:
        for kv_format in formats:
            for batch in (4, 64):
                case = DecodeCase(batch, context, kv_format, device)
                results = []
                for block_n, partition, warps, stages in itertools.product((32, 64), (256, 512, 1024), (4, 8), (1, 2)):
                    decode.BLOCK_N, decode.PARTITION_SIZE = block_n, partition
                    decode.DECODE_OPTIONS.update(num_warps=warps, num_stages=stages)
                    sec = bench.time(lambda: decode.paged_decode_attention(case.query, **case.kwargs))
                    results.append((sec, block_n, partition, warps, stages))
                results.sort()
                best = results[0]
                default = next(r for r in results if r[1:] == (saved[0], saved[1], saved[2]["num_warps"],
                                                                saved[2]["num_stages"]))
                rows.append([kv_format, batch, context, f"{best[0] * 1e6:.1f}", *best[1:],
                             f"{default[0] * 1e6:.1f}", f"{case.kv_bytes / best[0] / 1e9:.0f}"])
                del case
                torch.cuda.empty_cache()
    finally:
        decode.BLOCK_N, decode.PARTITION_SIZE = saved[0], saved[1]
        decode.DECODE_OPTIONS.clear()
        decode.DECODE_OPTIONS.update(saved[2])
    return ["# Decode tuning", "", f"Best of BLOCK_N (32, 64) x partition (256, 512, 1024) x warps (4, 8) x stages "
            f"(1, 2); defaults BLOCK_N={saved[0]}, partition={saved[1]}, {saved[2]}.", "",
            *table(["format", "batch", "context", "best us", "BLOCK_N", "partition", "warps", "stages",
                    "default us", "best GB/s"], rows)]


def spot_check(device, quick: bool = False) -> list[str]:
    """Max |kernel - reference| of decode (several partitions), prefill and store on small GPU cases (``quick``:
    bfloat16 queries only; the kernel tests cover the rest)."""
    from paged_hf.kernels.paged_decode_attention import (  # noqa: PLC0415
        paged_decode_attention, paged_decode_attention_ref,
    )
    from paged_hf.kernels.paged_prefill_attention import (  # noqa: PLC0415
        paged_prefill_attention, paged_prefill_attention_ref,
    )
    from paged_hf.kernels.store_kv import store_kv, store_kv_ref  # noqa: PLC0415
    from paged_hf.quant import make_storage  # noqa: PLC0415

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    formats = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4")
    # float16/bfloat16 for every format; float32 (slow to compile: IEEE float32 dots) for "auto" only
    combos = [(f, d) for f in formats for d in (torch.float16, torch.bfloat16)] + [("auto", torch.float32)]
    if quick:  # each combination compiles its own variants (seconds each): keep the session short
        combos = [(f, d) for f, d in combos if d == torch.bfloat16]
    for kv_format, dtype in combos:
        storage = make_storage(kv_format, 400, BLOCK_SIZE, 2, HEAD_DIM, dtype, device)
        key = torch.randn(400 * BLOCK_SIZE, 2, HEAD_DIM, device=device, generator=gen)
        value = torch.randn(key.shape, device=device, generator=gen)
        slots = torch.randperm(key.shape[0], device=device, generator=gen)
        ref_storage = make_storage(kv_format, 400, BLOCK_SIZE, 2, HEAD_DIM, dtype, device)
        plan = {}
        if storage.has_tail:  # int4: every block filled whole (from the tokens in order)
            plan = {"plan": block_fill_plan(0, 400, device)}
            for one in (storage, ref_storage):
                one.ensure_tail_rows(4)
            storage.key_tail.normal_(generator=gen)  # the rows the attention reads (both sides read these pools)
            storage.value_tail.normal_(generator=gen)
        store_kv(key.to(dtype), value.to(dtype), slots, storage.pool_tensors(), **plan)
        store_kv_ref(key.to(dtype), value.to(dtype), slots, ref_storage.pool_tensors(), **plan)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(storage.tensors().values(), ref_storage.tensors().values()))
        pools = dict(pools=storage.pool_tensors())
        if storage.has_tail:
            pools["tail_rows"] = torch.arange(4, device=device)
        lengths = torch.tensor([1, 17, 700, 1500], device=device)
        tables = torch.randperm(400, device=device, generator=gen).view(4, 100)
        query = torch.randn(4, 2 * GROUP, HEAD_DIM, device=device, generator=gen).to(dtype)
        sinks = torch.randn(2 * GROUP, device=device, generator=gen)
        options = dict(scale=HEAD_DIM ** -0.5, sliding_window=600, softcap=30.0, sinks=sinks)
        fresh = {}
        if storage.has_tail:  # the queries' own new K/V
            fresh = dict(fresh_key=torch.randn(4, 2, HEAD_DIM, device=device, generator=gen).to(dtype),
                         fresh_value=torch.randn(4, 2, HEAD_DIM, device=device, generator=gen).to(dtype))
        out = paged_decode_attention(query, block_tables=tables, seq_lens=lengths, **pools, **options, **fresh)
        ref = paged_decode_attention_ref(query, block_tables=tables, seq_lens=lengths, **pools, **options, **fresh)
        decode_err = (out.float() - ref.float()).abs().max().item()
        cu = torch.tensor([0, 1, 18, 318, 318], device=device)  # chunks of 1, 17, 300 and 0 queries
        pq = torch.randn(318, 2 * GROUP, HEAD_DIM, device=device, generator=gen).to(dtype)
        plens = torch.tensor([5, 40, 1000, 20], device=device)
        if storage.has_tail:
            fresh = dict(fresh_key=torch.randn(318, 2, HEAD_DIM, device=device, generator=gen).to(dtype),
                         fresh_value=torch.randn(318, 2, HEAD_DIM, device=device, generator=gen).to(dtype))
        out = paged_prefill_attention(pq, block_tables=tables, seq_lens=plens, cu_query_lens=cu, **pools,
                                      **options, **fresh)
        ref = paged_prefill_attention_ref(pq, block_tables=tables, seq_lens=plens, cu_query_lens=cu, **pools,
                                          **options, **fresh)
        prefill_err = (out.float() - ref.float()).abs().max().item()
        rows.append([kv_format, str(dtype).split(".")[-1], "yes" if same else "NO", f"{decode_err:.1e}",
                     f"{prefill_err:.1e}"])
    return table(["format", "dtype", "store bytes equal", "decode max err", "prefill max err"], rows)


if __name__ == "__main__":
    sys.exit(main())
