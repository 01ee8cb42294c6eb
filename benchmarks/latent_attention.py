"""Multi-head latent attention on the engine: a DeepSeek-V2-Lite-shaped random model (16 heads, a 512-wide latent
and a 64-wide rotary key; dense MLPs and fewer layers, so that a CPU runs it), its greedy throughput on
``PagedEngine`` (compiled and eager) beside ``generate`` in static batches on ``DynamicCache``, in one run, and the
bytes a token takes in the latent cache beside expanded K/V.

    PYTHONPATH=. python benchmarks/latent_attention.py --layers 4 --requests 16 --dtype bfloat16
    PYTHONPATH=. python benchmarks/latent_attention.py --prompt-len 512-1024 --requests 8   # long prompts

The model is random: read the ratios and the token agreement, not the text.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import paged_hf  # noqa: F401 - registers the "paged" attention
from paged_hf import PagedEngine, SamplingParams

from _common import machine, markdown_table


def model_of(layers: int, dtype: torch.dtype, hidden: int = 2048, vocab: int = 32000):
    config = AutoConfig.for_model(
        "deepseek_v2", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=layers, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def workload(requests: int, vocab: int, prompt_len: tuple[int, int], seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens): prompts of ``prompt_len`` tokens (low, high), 16-64 outputs."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(requests):
        n = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=generator))
        out.append((torch.randint(3, vocab, (n,), generator=generator).tolist(),
                    int(torch.randint(16, 65, (1,), generator=generator))))
    return out


def run_generate(model, work, batch: int) -> tuple[float, list[list[int]]]:
    """Static batches of ``batch`` left-padded prompts, each run to its longest output (the others' extra tokens
    are generated and thrown away, as a static batch does); returns (seconds, each request's tokens)."""
    tokens, start = [], time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i: i + batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=max(n for _, n in chunk),
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 cache=DynamicCache(config=model.config))
        tokens += [out[j, width: width + n].tolist() for j, (_, n) in enumerate(chunk)]
    return time.perf_counter() - start, tokens


def run_engine(model, work, eager: bool) -> tuple[float, list[list[int]], float]:
    """(seconds of the timed pass, each request's tokens, seconds to start); a warm-up pass first."""
    start = time.perf_counter()
    engine = PagedEngine(model, None, max_num_seqs=16, max_num_batched_tokens=512, enforce_eager=eager)
    ready = time.perf_counter() - start
    prompts = [{"prompt_token_ids": ids} for ids, _ in work]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
    engine.generate(prompts[:4], params[:4], use_tqdm=False)
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [out.outputs[0].token_ids for out in outs], ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="generate's static batch size")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-len", default="32-256", help="prompt lengths, low-high")
    parser.add_argument("--engines", default="compiled,eager", help="which PagedEngine runs: compiled, eager")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = model_of(args.layers, dtype, args.hidden, args.vocab)
    config = model.config
    low, high = (int(n) for n in args.prompt_len.split("-"))
    work = workload(args.requests, args.vocab, (low, high))
    generated = sum(n for _, n in work)
    print(machine(), f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    size = dtype.itemsize
    latent = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * size
    expanded = config.num_hidden_layers * config.num_attention_heads * (
        config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * size
    print(f"bytes a token: latent rows {latent:,}, expanded K/V {expanded:,} ({expanded / latent:.1f}x)")
    seconds, reference = run_generate(model, work, args.batch)
    rows = [["generate, static batches of %d, DynamicCache" % args.batch, f"{generated / seconds:.1f}", "1.00x", "-",
             "-"]]
    for name, eager in (("PagedEngine, compiled", False), ("PagedEngine, eager", True)):
        if name.split(", ")[1] not in args.engines.split(","):
            continue
        seconds_engine, tokens, ready = run_engine(model, work, eager)
        same = sum(a == b for a, b in zip(tokens, reference))
        rows.append([name, f"{generated / seconds_engine:.1f}", f"{seconds / seconds_engine:.2f}x",
                     f"{same}/{len(work)}", f"{ready:.1f}"])
    print(f"load after {os.getloadavg()[0]:.1f}")
    print(markdown_table(["run", "generated tok/s", "vs generate", "greedy tokens equal", "start s"], rows))


if __name__ == "__main__":
    main()
