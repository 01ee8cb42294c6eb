"""Decode throughput of ``PagedEngine`` with CUDA graphs on (``cudagraph_mode="FULL_DECODE_ONLY"``, the default) and
off (``"NONE"``: the same compiled forward without graphs), side by side in one process; ``--modes`` can add
``eager`` (``enforce_eager=True``: neither compile nor graphs).

For each batch size ``B`` (``--batches``), ``B`` prompts of ``--prompt-len`` random token ids run twice through
each engine: with ``max_tokens=1`` (the prefill alone) and ``--new-tokens`` greedy tokens (EOS ignored). The decode
throughput is ``B * (new_tokens - 1) / (t_full - t_prefill)`` generated tokens per second (the best of
``--repeats``), and a decode step's time is its inverse times ``B``. Engines are built one after the other on one
model (a fixed ``num_blocks``), their start-up seconds reported (compile warm-up, and the capture for graphs: the
first compiled engine pays for the compile, later ones on the same model reuse its graph). Modes run in the order
given (by default graphs first: any advantage of caches warmed by an earlier engine goes to the baseline). Greedy
tokens of each mode are compared with the first mode's (bfloat16: a padded batch runs its GEMMs at another row
count, so near-ties of a random model may differ; float32 should agree).

The default model is a randomly initialised Llama shaped like SmolLM2-135M (30 layers, hidden 576, 9 heads, 3 KV
heads; no download needed; ``--layers`` shortens it): a launch-bound decode, which is what graphs fix.
``--model stories260K`` uses the real tiny model (``../shared``). ``--quick`` is a dry run for a CPU machine
(``benchmarks/gpu_session.sh``): a 2-layer model, batches 1 and 4, and, without CUDA, the padded static path
(``PAGED_HF_STATIC_DECODE=1``, mode ``static``) instead of graphs.

    PYTHONPATH=. python benchmarks/cuda_graphs.py                         # on a GPU: bf16, batches 1,8,32,128
    PYTHONPATH=. python benchmarks/cuda_graphs.py --modes graphs none eager --batches 1,64
    PYTHONPATH=. python benchmarks/cuda_graphs.py --quick                 # CPU dry run (a few seconds)

With ``OUT`` set, the table is also written to ``$OUT/cuda_graphs.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import transformers

import paged_hf  # noqa: F401 - registers the "paged" attention
from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine.cuda_graphs import STATIC_DECODE_ENV

from _common import load_model, machine, markdown_table

MODES = {  # mode -> (engine options, PAGED_HF_STATIC_DECODE)
    "graphs": ({}, "0"),
    "none": ({"cudagraph_mode": "NONE"}, "0"),
    "eager": ({"enforce_eager": True}, "0"),
    "static": ({}, "1"),  # the padded static path without graphs (any device)
}
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)


def build_model(name: str, dtype: torch.dtype, device: torch.device, layers: int | None = None):
    if name == "stories260K":
        model, _ = load_model("stories260K", "paged")
    else:
        torch.manual_seed(0)
        shape = dict(SMOLLM2_SHAPE if name == "smollm2-shape" else TINY_SHAPE)
        shape["num_hidden_layers"] = layers or shape["num_hidden_layers"]
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, attn_implementation="paged")).eval()
    return model.to(device, dtype)


def timed(engine: PagedEngine, prompts, params, repeats: int) -> tuple[float, list]:
    best, tokens = float("inf"), None
    for _ in range(repeats):
        if engine.model.device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        if engine.model.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
        tokens = [o.outputs[0].token_ids for o in outs]
    return best, tokens


def measure(model, mode: str, args, batches: list[int]) -> tuple[float, dict]:
    """(start-up seconds, {batch: (decode tok/s, tokens)}) of one engine in ``mode``."""
    options, static = MODES[mode]
    os.environ[STATIC_DECODE_ENV] = static
    longest = args.prompt_len + args.new_tokens
    num_blocks = max(batches) * -(-longest // args.block_size) + 8
    began = time.perf_counter()
    engine = PagedEngine(model, None, block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=max(batches),
                         max_num_batched_tokens=max(args.prompt_len * max(batches), 256), **options)
    startup = time.perf_counter() - began
    results = {}
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        prompts = [torch.randint(3, model.config.vocab_size, (args.prompt_len,), generator=generator).tolist()
                   for _ in range(batch)]
        full = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        timed(engine, prompts, full, 1)  # warm-up: the shapes of this batch
        prefill, _ = timed(engine, prompts, first, args.repeats)
        total, tokens = timed(engine, prompts, full, args.repeats)
        results[batch] = (batch * (args.new_tokens - 1) / max(total - prefill, 1e-9), tokens)
        print(f"{mode}, batch {batch}: {results[batch][0]:.0f} decode tok/s", flush=True)  # kept if cut short
    del engine
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return startup, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-shape", choices=("smollm2-shape", "stories260K", "tiny"))
    parser.add_argument("--modes", nargs="+", default=None, choices=sorted(MODES),
                        help="default: graphs none (CUDA), static none (CPU)")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None, help="the random models' layer count (default: 30 / 2)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--quick", action="store_true", help="a dry run: tiny model, batches 1,4, 8 new tokens")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.quick:
        args.model, args.batches, args.new_tokens, args.prompt_len, args.repeats = "tiny", "1,4", 8, 8, 1
    modes = args.modes or (["graphs", "none"] if cuda else ["static", "none"])
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    batches = [int(b) for b in args.batches.split(",")]
    print(machine())
    print(f"model {args.model} ({dtype}, {device}), prompts of {args.prompt_len} tokens, {args.new_tokens} new "
          f"tokens; modes {modes}")
    model = build_model(args.model, dtype, device, args.layers)
    runs = {}
    for mode in modes:
        runs[mode] = measure(model, mode, args, batches)
        print(f"{mode}: start-up {runs[mode][0]:.1f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
    base = modes[-1] if "none" not in modes else "none"
    rows = []
    for batch in batches:
        for mode in modes:
            rate, tokens = runs[mode][1][batch]
            ref_tokens = runs[modes[0]][1][batch][1]
            agree = sum(a == b for a, b in zip(tokens, ref_tokens)) / len(tokens)
            rows.append([batch, mode, f"{rate:.0f}", f"{1000 * batch / rate:.2f}",
                         f"{rate / runs[base][1][batch][0]:.2f}x", f"{agree:.0%}", f"{runs[mode][0]:.1f}"])
    table = markdown_table(["batch", "mode", "decode tok/s", "ms / decode step", f"vs {base}",
                            f"greedy = {modes[0]}", "start-up s"], rows)
    print(table)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "cuda_graphs.md"), "w") as f:
            f.write(f"{machine()}\n\nmodel {args.model} ({dtype}), modes {modes}\n\n{table}\n")


if __name__ == "__main__":
    main()
