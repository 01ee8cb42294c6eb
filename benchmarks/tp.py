"""Tensor parallelism: KV capacity and engine throughput at each ``--tensor-parallel-size``, as ratios to TP=1.

Each size builds ``PagedEngine.from_pretrained(MODEL, tensor_parallel_size=N)`` (this process leads; the others
start as local processes, or Ray actors with ``--backend ray``) with the same KV memory per rank
(``--kv-cache-memory`` GiB): each rank stores ``1/N`` of the KV heads, so the same per-rank memory holds ``N`` times
the tokens. Then one seeded workload (real text prompts, greedy, ``ignore_eos``: every request produces exactly its
output length) runs through ``generate`` after one untimed warm-up request; the table gives output tokens/s and
whether the tokens equal TP=1's. On CPU (gloo, 2 shared cores) TP only adds all-reduces, so throughput falls: the
capacity column is the point here, the throughput column is for a GPU run (NCCL).

    PYTHONPATH=. python benchmarks/tp.py                               # stories260K, TP 1 and 2
    PYTHONPATH=. python benchmarks/tp.py --model PATH --tensor-parallel-size 1,2,4 --requests 256
    paged-hf bench tp --tensor-parallel-size 1,2
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import STORIES, machine, markdown_table, prompt_lengths, text_prompts
from transformers import AutoConfig, AutoTokenizer

from paged_hf import PagedEngine, SamplingParams


def run_size(args, size: int, prompts: list[list[int]], outputs: list[int]) -> dict:
    engine = PagedEngine.from_pretrained(
        args.model, None, tensor_parallel_size=size, distributed_executor_backend=args.backend,
        model_kwargs={"dtype": getattr(torch, args.dtype)}, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens)
    try:
        stats = engine.get_stats()
        engine.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
        started = time.perf_counter()
        results = engine.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    finally:
        engine.shutdown()
    failed = [out.error for out in results if out.error]
    if failed:
        raise RuntimeError(f"TP={size}: {len(failed)} requests failed: {failed[0]}")
    return {"blocks": stats.kv_cache_total, "tokens": stats.kv_cache_total * args.block_size,
            "seconds": seconds, "tok_s": sum(outputs) / seconds,
            "token_ids": [out.outputs[0].token_ids for out in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(STORIES), help="a model folder (default: stories260K)")
    parser.add_argument("--tensor-parallel-size", default="1,2", help="sizes to compare, the first is the baseline")
    parser.add_argument("--backend", choices=["mp", "ray"], default="mp")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128), metavar=("LOW", "HIGH"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64), metavar=("LOW", "HIGH"))
    parser.add_argument("--kv-cache-memory", type=float, default=0.01, help="GiB of KV pool per rank")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this rank (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.tensor_parallel_size.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = text_prompts(tokenizer, prompt_lengths(args.requests, *args.prompt_len, args.seed), args.seed)
    outputs = prompt_lengths(args.requests, *args.output_len, args.seed + 1)
    config = AutoConfig.from_pretrained(args.model).get_text_config(decoder=True)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    print(machine())
    print(f"{args.model}: {kv_heads} KV heads, {args.requests} requests, prompts {args.prompt_len[0]}-"
          f"{args.prompt_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]}, "
          f"{args.kv_cache_memory} GiB of KV per rank, backend {args.backend}\n")
    results = {size: run_size(args, size, prompts, outputs) for size in sizes}
    base = results[sizes[0]]
    rows = [[size, kv_heads // size, r["blocks"], r["tokens"], f"{r['tokens'] / base['tokens']:.2f}x",
             f"{r['tok_s']:.1f}", f"{r['tok_s'] / base['tok_s']:.2f}x",
             "yes" if r["token_ids"] == base["token_ids"] else "NO"] for size, r in results.items()]
    print(markdown_table(["TP", "KV heads / rank", "blocks / rank", "tokens that fit", "capacity",
                          "output tok/s", "throughput", f"tokens == TP={sizes[0]}"], rows))


if __name__ == "__main__":
    main()
