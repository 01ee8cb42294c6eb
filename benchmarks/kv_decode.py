"""Decode wall time of the quantized KV formats on the torch path (CPU): int4 against int8.

SmolLM2-135M (float32, ``attn_implementation="paged"``), ``generate`` with ``cache_implementation="paged"``:
``--batch`` left-padded prompts of ``--prompt-len`` tokens, ``--new-tokens`` greedy tokens (EOS suppressed). The
formats run interleaved, ``--repeats`` rounds after a warm-up round; reported: the median seconds per round, the
decode milliseconds per step (a round minus the prefill-only round, over the new tokens) and the ratio to int8.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/kv_decode.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import paged_hf  # noqa: F401 - registers "paged"

from _common import MODEL_NAMES, load_model, machine, markdown_table


@torch.no_grad()
def run(model, ids, mask, fmt: str, new_tokens: int, block_size: int) -> float:
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged",
                   cache_config={"kv_cache_dtype": fmt, "block_size": block_size}, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int8,int4,auto")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", choices=MODEL_NAMES, default="smollm2",
                        help="stories260K: a quick run of the same code (default: %(default)s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    model, _ = load_model(args.model, attn_implementation="paged")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(min(100, vocab // 2), min(40000, vocab), (args.batch, args.prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    print(f"machine: {machine()}")
    print(f"command: PYTHONPATH=. python benchmarks/kv_decode.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    times = {(f, n): [] for f in formats for n in (1, args.new_tokens)}
    for round_ in range(args.repeats + 1):
        for fmt in formats:
            for n in (1, args.new_tokens):
                seconds = run(model, ids, mask, fmt, n, args.block_size)
                if round_:
                    times[fmt, n].append(seconds)
    rows = []
    base = None
    for fmt in formats:
        total, prefill = statistics.median(times[fmt, args.new_tokens]), statistics.median(times[fmt, 1])
        step_ms = (total - prefill) / (args.new_tokens - 1) * 1e3
        base = base or step_ms
        rows.append([fmt, f"{total:.2f}", f"{prefill:.2f}", f"{step_ms:.1f}", f"{step_ms / base:.2f}×"])
    print(f"\nbatch {args.batch}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, block size "
          f"{args.block_size}, {args.threads} thread(s); medians of {args.repeats} interleaved rounds\n")
    print(markdown_table(["kv_cache_dtype", "round s", "prefill-only s", "decode ms/step", f"vs {formats[0]}"],
                         rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
