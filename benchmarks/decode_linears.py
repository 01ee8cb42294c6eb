"""The bfloat16 linears of one decode step, streamed as the engine streams them: paged_hf's packed linear against
oneDNN's own product, side by side.

A decode step of ``M`` sequences multiplies ``M`` rows by every weight of the model once: 30 layers of SmolLM2-135M's
fused q/k/v (``960x576``), o (``576x576``), fused gate/up (``3072x576``) and down (``576x1536``), then the
``49152x576`` head (270 MB in bfloat16, each layer's weights its own, so that they stream from memory as a model's do,
not from a warm cache as one shape timed alone would). For each ``M`` the two ways alternate, ``--repeats`` times:

- ``paged_hf``: ``PackedLinear`` modules (``pack_linears``): the AMX tile copy for 64 rows or fewer where the CPU has
  AMX (``linear_tile_copies``), else oneDNN's packed product (a float32 copy on a CPU without bfloat16 products);
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` over each weight reordered once (what ``paged_hf`` ran before
  the tile path, and what vLLM's CPU build runs); on a CPU without oneDNN's bfloat16 products, over a float32 copy
  (the input widened, the product rounded to bfloat16), as ``paged_hf`` packs there.

The table shows each way's best milliseconds per step, the weight bytes it read per second, their ratio, and how
many outputs of the step differ between the two (bfloat16: by one ulp where the sums' order differs).

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/decode_linears.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from paged_hf.kernels import cpu_ext
from paged_hf.packed_linear import pack_linears, widens

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of one layer's products, in step order
HEAD = (49152, 576)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,16,32,48,64", help="token counts M, comma-separated")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [*SHAPES * args.layers, HEAD]
    modules = [torch.nn.Linear(n_in, n_out, bias=False).to(torch.bfloat16) for n_out, n_in in shapes]
    widen = bool(widens(torch.bfloat16))  # no bfloat16 products in oneDNN here: both ways run a float32 copy
    reordered = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().float() if widen else m.weight.detach(), 32)
                 for m in modules]
    pack_linears(torch.nn.ModuleList(modules))
    tiles = cpu_ext.loaded() and torch.ops.paged_hf_cpu.linear_tile_copies()
    weight_bytes = sum(n_out * n_in * 2 for n_out, n_in in shapes)
    print(f"{len(shapes)} weights, {weight_bytes / 2**20:.0f} MiB of bfloat16; AMX tile copies: {tiles}; "
          f"oneDNN: {'a float32 copy (no bfloat16 products on this CPU)' if widen else 'bfloat16'}; "
          f"threads {args.threads}; load {os.getloadavg()[0]:.2f}")

    def packed_step(inputs):
        return [m(inputs[m.in_features]) for m in modules]

    def onednn_step(inputs):
        if widen:
            return [torch.ops.mkldnn._linear_pointwise(inputs[m.in_features].float(), w, None, "none", [], "").to(
                torch.bfloat16) for m, w in zip(modules, reordered)]
        return [torch.ops.mkldnn._linear_pointwise(inputs[m.in_features], w, None, "none", [], "")
                for m, w in zip(modules, reordered)]

    print(f"{'M':>4} {'paged_hf ms':>12} {'GB/s':>6} {'onednn ms':>10} {'GB/s':>6} {'ratio':>6} {'outputs differing':>18}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {n_in: torch.randn(rows, n_in).to(torch.bfloat16) for n_in in {n_in for _, n_in in shapes}}
            best = {"paged_hf": float("inf"), "onednn": float("inf")}
            outputs = {}
            for _ in range(args.repeats + 1):  # the first round warms both
                for name, step in (("paged_hf", packed_step), ("onednn", onednn_step)):
                    begin = time.perf_counter()
                    outputs[name] = step(inputs)
                    best[name] = min(best[name], time.perf_counter() - begin)
            differing = sum(int((a != b).sum()) for a, b in zip(outputs["paged_hf"], outputs["onednn"]))
            total = sum(a.numel() for a in outputs["paged_hf"])
            ours, theirs = best["paged_hf"], best["onednn"]
            print(f"{rows:>4} {ours * 1e3:>12.2f} {weight_bytes / ours / 1e9:>6.1f} {theirs * 1e3:>10.2f} "
                  f"{weight_bytes / theirs / 1e9:>6.1f} {theirs / ours:>5.2f}x {differing:>9} of {total}")
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
