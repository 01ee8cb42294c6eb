"""Compiles every production variant of the paged kernels for sm_90 (H100/H200) here, without a GPU, and reports
registers, spills, stack and shared memory per variant.

The variants are what a layer launches (``paged_hf.kernels.warmup.layer_launches``: decode direct, decode over
partitions + reduce, prefill, store, block copy) for bf16 and fp16 models, head_dim 64/128/256 and every
``kv_cache_dtype``; 8 KV heads x group 4, block size 16 (group and block size change no tile shape). Identical
variants (same triton cache key) are compiled once. ``--features`` adds layers with sliding window + softcap +
sinks. ``--before`` feeds the quantized formats float32 queries, as the attention did before issue #17 (the
rotated query stayed float32).

    python benchmarks/compile_report.py                      # the whole grid (~3-5 min on one core)
    python benchmarks/compile_report.py --before             # what the path compiled before #17
    python benchmarks/compile_report.py --head-dims 128 --formats int8 --kernels prefill --full

Needs triton with its NVIDIA backend and ptxas (triton's wheel carries one); no CUDA device. Exit status 1 when
a bf16/fp16-query variant spills or needs more shared memory than sm_90 has. Prints a summary grid of the
attention kernels (``--full``: every variant too); with ``OUT`` set, writes the full table to
``$OUT/compile_report.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the CPU interpreter

import torch  # noqa: E402

NUM_KV_HEADS, GROUP, BLOCK_SIZE = 8, 4, 16
FORMATS = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4")
KERNEL_NAMES = {"_decode_kernel": "decode", "_decode_reduce_kernel": "reduce", "_prefill_kernel": "prefill",
                "_store_kernel": "store", "_fill_kernel": "fill", "_copy_kernel": "copy"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--kernels", nargs="+", default=sorted(set(KERNEL_NAMES.values())))
    parser.add_argument("--features", action="store_true", help="also layers with window + softcap + sinks")
    parser.add_argument("--before", action="store_true", help="float32 queries for quantized formats (pre-#17)")
    parser.add_argument("--jobs", type=int, default=1, help="compiles in parallel (processes)")
    parser.add_argument("--full", action="store_true", help="also print the table of every variant")
    parser.add_argument("--summary-of", metavar="REPORT.md", help="only re-render the summary of a report's table")
    args = parser.parse_args()
    if args.summary_of:
        print("\n".join(summary(parse_table(Path(args.summary_of).read_text()))))
        return 0

    from paged_hf.kernels import aot  # noqa: PLC0415

    missing = aot.ptxas_available()
    if missing:
        print(f"compile_report: {missing}. Nothing compiled.", file=sys.stderr)
        return 2
    variants = collect(args)
    _LAUNCHES[:] = [v[0] for v in variants.values()]
    started = time.time()
    if args.jobs > 1:  # forked workers inherit the prepared launches; they compile by index
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_compile, range(len(_LAUNCHES))))
    else:
        results = [_compile(i) for i in range(len(_LAUNCHES))]
    rows, failures = [], []
    for (_, label, query_dtype), result in zip(variants.values(), results):
        ok = result.spills == 0 and result.shared <= aot.SM90_MAX_SHARED
        if not ok and query_dtype != "float32":
            failures.append(label)
        rows.append([label, query_dtype, result.registers, f"{result.spill_stores} / {result.spill_loads}",
                     result.stack, f"{result.shared / 1024:.1f}", f"{result.num_warps}/{result.num_stages}",
                     f"{result.seconds:.1f}", "ok" if ok else "**SPILLS**" if result.spills else "**SMEM**"])
    import triton  # noqa: PLC0415

    title = f"# sm_90 compile report{' (before #17: float32 queries for quantized formats)' if args.before else ''}"
    header = [title, "", f"triton {triton.__version__}, torch {torch.__version__}; {NUM_KV_HEADS} KV heads x group "
              f"{GROUP}, block size {BLOCK_SIZE}; {len(rows)} distinct variants compiled in "
              f"{time.time() - started:.0f} s ({args.jobs} process{'es' if args.jobs > 1 else ''}).", ""]
    full = table(["variant", "query", "registers", "spill st / ld", "stack", "shared KiB", "warps/stages",
                  "compile s", ""], rows)
    full += ["", "Spills and stack: bytes per thread; shared: KiB per program (sm_90 limit "
             f"{aot.SM90_MAX_SHARED // 1024} KiB).", "",
             f"bf16/fp16 variants that spill or exceed shared memory: {', '.join(failures) or 'none'}."]
    text = "\n".join(header + summary(parse_table("\n".join(full))) + ([""] + full if args.full else [])) + "\n"
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "compile_report.md").write_text("\n".join(header + full) + "\n")
    return 1 if failures else 0


def parse_table(text: str) -> list[dict]:
    """The rows of a report's full table as dicts (kernel, format, head_dim, features, query, registers, spills,
    shared KiB)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6 or not cells[2].isdigit():
            continue
        words = cells[0].split()
        stores, loads = (int(x) for x in cells[3].split("/"))
        rows.append(dict(
            kernel=words[0], format=words[1] if len(words) > 2 else "-",
            head_dim=next((int(w[1:]) for w in words if w.startswith("d") and w[1:].isdigit()), 0),
            features="+win/cap/sinks" in words, query=cells[1], registers=int(cells[2]), spills=stores + loads,
            shared=float(cells[5]),
        ))
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Attention kernels as a grid: one row per kernel x format, one column per head_dim x model dtype; a cell
    is ``registers / spill bytes (stores + loads) / shared KiB`` of the variant that model runs (``*``: float32
    queries: both model dtypes run that variant)."""
    attention = [r for r in rows if r["kernel"] in ("decode", "decode-parts", "prefill")]
    head_dims = sorted({r["head_dim"] for r in attention})
    dtypes = [d for d in ("bfloat16", "float16") if any(r["query"] in (d, "float32") for r in attention)]
    cells: dict = {}
    for r in attention:
        for dtype in dtypes if r["query"] == "float32" else [r["query"]]:
            mark = "*" if r["query"] == "float32" else ""
            spill = f"**{r['spills']}**" if r["spills"] else "0"
            cells[r["kernel"], r["format"], r["features"], r["head_dim"], dtype] = (
                f"{r['registers']} / {spill} / {r['shared']:.0f}{mark}")
    keys = sorted({k[:3] for k in cells}, key=lambda k: (k[2], ("decode", "decode-parts", "prefill").index(k[0]),
                                                          FORMATS.index(k[1]) if k[1] in FORMATS else 9))
    out = [f"Attention kernels, registers / spill bytes per thread / shared KiB (`*`: float32 queries, which a bf16 "
           "and an fp16 model then both run):", ""]
    out += table(["kernel", "format"] + [f"d{d} {t.replace('float', 'fp').replace('bfp16', 'bf16')}"
                                         for d in head_dims for t in dtypes],
                 [[k[0] + (" +win/cap/sinks" if k[2] else ""), k[1]]
                  + [cells.get((*k, d, t), "-") for d in head_dims for t in dtypes] for k in keys])
    others = [r for r in rows if r not in attention]
    if others:
        spilling = [f"{r['kernel']} {r['format']} d{r['head_dim']}" for r in others if r["spills"]]
        out += ["", f"Reduce, store and copy: {len(others)} variants, registers <= "
                f"{max(r['registers'] for r in others)}, shared <= {max(r['shared'] for r in others):.1f} KiB, "
                f"spilling: {', '.join(spilling) or 'none'}."]
    return out


def collect(args) -> dict:
    """Distinct variants of the grid: triton cache key -> (launch, label, query dtype)."""
    from paged_hf.kernels import aot  # noqa: PLC0415
    from paged_hf.kernels.warmup import example_pools, layer_launches  # noqa: PLC0415

    layers = [(None, None, False)]
    if args.features:
        layers.append((4096, 30.0, True))
    variants: dict = {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for head_dim in args.head_dims:
            for kv_format in args.formats:
                query_dtype = torch.float32 if args.before and kv_format != "auto" else dtype
                # what the storage hands its store: the compute dtype ("auto"; int4's tails), else rotated float32
                store_dtype = dtype if kv_format in ("auto", "int4") else torch.float32
                for window, softcap, sinks in layers:
                    operands = example_pools(kv_format, 40, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype)
                    heads = NUM_KV_HEADS * GROUP
                    launches = layer_launches(
                        operands, heads, query_dtype, sliding_window=window, softcap=softcap,
                        sinks=torch.zeros(heads) if sinks else None, store_dtype=store_dtype,
                    )
                    seen_decode = 0
                    for launch in launches:
                        kernel = KERNEL_NAMES[launch.kernel.fn.__name__]
                        if kernel == "decode":
                            seen_decode += 1
                            kernel = "decode" if seen_decode == 1 else "decode-parts"
                        if kernel.split("-")[0] not in args.kernels:
                            continue
                        key = aot.variant_key(launch)
                        if key in variants:
                            continue
                        label = _label(kernel, kv_format, head_dim, launch, window is not None)
                        variants[key] = (launch, label, _input_dtype(kernel, launch))
    return variants


def _label(kernel: str, kv_format: str, head_dim: int, launch, features: bool) -> str:
    if kernel == "reduce":
        return f"reduce d{head_dim}"
    if kernel == "copy":
        return f"copy {launch.args[0].dtype}".replace("torch.", "")
    return f"{kernel} {kv_format} d{head_dim}{' +win/cap/sinks' if features else ''}"


def _input_dtype(kernel: str, launch) -> str:
    """The dtype that picks the kernel's math: the query (attention), the output (reduce), the K/V (store)."""
    if kernel == "copy":
        return "-"
    tensor = launch.args[5] if kernel == "reduce" else launch.args[0]
    return str(tensor.dtype).split(".")[-1]


_LAUNCHES: list = []


def _compile(index: int):
    from paged_hf.kernels import aot  # noqa: PLC0415

    return aot.compile_launch(_LAUNCHES[index])


def table(headers, rows) -> list[str]:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return lines


if __name__ == "__main__":
    sys.exit(main())
