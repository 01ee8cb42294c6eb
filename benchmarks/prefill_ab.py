"""The C++ CPU prefill of this checkout beside the same kernel from another git revision (or another source file), in
one process, calls alternating: the way to measure a change to ``csrc/paged_prefill.cpp`` on a noisy machine.

Runs of one build in separate processes on the 2-core KVM guest differed by up to 1.6x (before the packed tiles moved
to 2 MiB pages, a process's luck of physical pages decided it); two builds in one process see the same machine. Each
variant is ``paged_prefill.cpp`` with the headers beside it and the sources it calls (``CALLED``) at that revision,
compiled with the library's own flags into a library of its own whose ops live under another namespace. Steps and
heads are ``cpu_prefill.py``'s.
Columns: the median of ``--repeats`` alternating calls of each (ms) with its speed relative to this checkout's
(> 1: faster), and the largest difference between their outputs.

    PYTHONPATH=. python benchmarks/prefill_ab.py --against HEAD~1                  # bfloat16, 2 threads
    PYTHONPATH=. python benchmarks/prefill_ab.py --against old=HEAD~3 --against /tmp/mine.cpp --dtype float32
    PYTHONPATH=. python benchmarks/prefill_ab.py --against HEAD --quick --repeats 1     # seconds: does it still run
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from _common import machine, markdown_table  # noqa: E402
from cpu_prefill import add_run_arguments, cases, kernels_ready, median_ms, step  # noqa: E402

from paged_hf.kernels import cpu_ext  # noqa: E402

CSRC = Path("paged_hf/kernels/csrc")
CALLED = ("avx2_linear.cpp",)  # sources with functions paged_prefill.cpp calls (and no ops of their own), where present


def sources_at(spec: str, folder: Path) -> list[Path]:
    """``paged_prefill.cpp``, the ``CALLED`` sources and the headers of revision ``spec`` (or the file ``spec``, with
    this checkout's headers and called sources) written into ``folder``; the .cpp paths, paged_prefill.cpp's first."""
    if Path(spec).is_file():
        for other in (*(ROOT / CSRC).glob("*.h"), *(ROOT / CSRC / name for name in CALLED)):
            (folder / other.name).write_bytes(other.read_bytes())
        (folder / "paged_prefill.cpp").write_bytes(Path(spec).read_bytes())
    else:
        names = subprocess.run(["git", "ls-tree", "--name-only", spec, f"{CSRC}/"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.split()
        for name in names:
            if name.endswith((".h", "paged_prefill.cpp", *CALLED)):
                blob = subprocess.run(["git", "show", f"{spec}:{name}"], cwd=ROOT, check=True,
                                      capture_output=True).stdout
                (folder / Path(name).name).write_bytes(blob)
    return [folder / "paged_prefill.cpp", *(folder / name for name in CALLED if (folder / name).is_file())]


def build_variant(spec: str, namespace: str, folder: Path):
    """The prefill op of ``spec`` compiled as the library's own is, its ops registered under ``namespace``."""
    sources = sources_at(spec, folder)
    text = sources[0].read_text()
    if "TORCH_LIBRARY_FRAGMENT(paged_hf_cpu," not in text:
        raise SystemExit(f"{spec}: its paged_prefill.cpp registers no paged_hf_cpu ops to rename")
    sources[0].write_text(text.replace("TORCH_LIBRARY_FRAGMENT(paged_hf_cpu,", f"TORCH_LIBRARY_FRAGMENT({namespace},"))
    library = folder / f"{namespace}.so"
    cpu_ext.compile_library(cpu_ext._compiler(), sources, library, folder)
    torch.ops.load_library(str(library))
    return getattr(torch.ops, namespace).paged_prefill


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", action="append", required=True,
                        help="[NAME=]REV or [NAME=]FILE.cpp: a variant to run beside this checkout's (repeatable)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    heads, steps = cases(args.quick)
    if not kernels_ready(args):
        return 1
    variants = {"this checkout": torch.ops.paged_hf_cpu.paged_prefill}
    with tempfile.TemporaryDirectory() as scratch:
        for number, against in enumerate(args.against):
            name, _, spec = against.rpartition("=")
            folder = Path(scratch) / str(number)
            folder.mkdir()
            variants[name or spec] = build_variant(spec, f"paged_hf_variant_{number}", folder)
        dtype = getattr(torch, args.dtype)
        print(f"# CPU prefill, this checkout beside {', '.join(list(variants)[1:])}: {args.dtype}, {args.threads} "
              f"threads, median of {args.repeats} alternating calls")
        print(machine())
        rows = []
        for head_name, (num_kv_heads, group, head_dim) in heads.items():
            for step_name, chunks in steps.items():
                query, pools, tables, seq_lens, cu = step(chunks, num_kv_heads, group, head_dim, dtype)
                operands = (query, pools.key_cache, pools.value_cache, tables, seq_lens, cu, head_dim**-0.5, None)
                outs = {name: op(*operands).float() for name, op in variants.items()}
                first = outs["this checkout"]
                ms = median_ms({name: functools.partial(op, *operands) for name, op in variants.items()},
                               args.repeats)
                base = ms["this checkout"]
                rows.append([head_name, step_name, *(f"{ms[name]:.2f} ({base / ms[name]:.2f}x)" for name in variants),
                             f"{max((out - first).abs().max().item() for out in outs.values()):.1e}"])
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end\n")
        print(markdown_table(["heads", "step", *(f"{name} ms" for name in variants), "largest difference"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
