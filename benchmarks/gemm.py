"""GEMM speed of a model's linear shapes, the ways torch 2.13 on a CPU can run them: which one the engine should use.

For each weight shape (SmolLM2-135M's by default: q/o ``576x576``, k/v ``192x576``, gate/up ``1536x576``, down
``576x1536``, lm_head ``49152x576``; and the fused products of the compiled forward: qkv ``960x576``, gate_up
``3072x576``), each dtype and each token count ``M`` the variants run alternately, each ``--repeats`` times
(``--iters`` calls per timing), and the table shows the median microseconds per call:

- ``eager``: ``F.linear(x, w)`` (float32: MKL sgemm; bfloat16: oneDNN with the weight reordered at every call);
- ``compiled``: ``torch.compile`` of a one-linear module, ``M`` dynamic (inductor's default: ``aten.mm``);
- ``frozen``: the same with ``freezing=True`` (inductor packs the weight once into an ``mkldnn._linear_pointwise``
  for bfloat16; for float32 with ``M`` dynamic also oneDNN, with ``M`` static MKL's packed sgemm);
- ``packed``: ``torch.ops.mkldnn._linear_pointwise`` called directly on a weight reordered once by
  ``torch.ops.mkldnn._reorder_linear_weight`` (oneDNN, AMX where the CPU has it; bfloat16 on a CPU without bfloat16
  dot products: a float32 copy, the input widened and the product rounded back, as the engine does);
- ``mkl_packed`` (float32 only): ``torch.ops.mkl._mkl_linear`` over ``_mkl_reorder_linear_weight`` (packed sgemm);
- ``engine``: the engine's own linear, ``paged_hf_cpu::packed_linear`` over a weight ``pack_linears`` packed (with
  ``PAGED_HF_PACKED_LINEAR=all``): oneDNN's product as ``packed``, AMX tiles for bfloat16 products of at most 64
  rows where the CPU has AMX, and on a library built for AVX2 without AVX-512 the panel product of
  ``csrc/avx2_linear.cpp`` (float32, and bfloat16 widened) at every row count.

``--vllm-python PATH`` (the interpreter of a vLLM CPU build's virtual environment) adds ``vllm``: vLLM's own
``onednn_mm`` over ``create_onednn_mm(weight.t(), 32)`` (its CPU linear), timed the same way in a child process run
before the others (this script with ``--vllm-child``), as an anchor.

The largest difference from ``eager`` of each variant's output is printed too (bfloat16: 0 when the rounding is the
same). The machine may be shared: the load average is printed before each dtype.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/gemm.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import statistics
import time

import torch
import torch.nn.functional as F


SMOLLM2 = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536),
           "qkv": (960, 576), "gate_up": (3072, 576), "lm_head": (49152, 576)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VARIANTS = ("eager", "compiled", "frozen", "packed", "mkl_packed", "engine")


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


class OneLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight)


def compiled_call(weight: torch.Tensor, freezing: bool):
    """A one-linear module compiled with ``M`` dynamic (``freezing``: inductor's weight prepacking on)."""
    compiled = torch.compile(OneLinear(weight), dynamic=True, options={"freezing": freezing})
    return compiled


def variants(weight: torch.Tensor, dtype_name: str, names: list[str], hint: int) -> dict:
    """name -> a function of ``x`` computing ``x @ weight.T`` that way (weights packed once here)."""
    calls = {}
    for name in names:
        if name == "eager":
            calls[name] = lambda x: F.linear(x, weight)
        elif name in ("compiled", "frozen"):
            calls[name] = compiled_call(weight, freezing=name == "frozen")
        elif name == "packed" and weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            # no bfloat16 oneDNN here: the engine's float32 copy (paged_hf.packed_linear.widens)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.float(), hint)
            calls[name] = lambda x, packed=packed: torch.ops.mkldnn._linear_pointwise(
                x.float(), packed, None, "none", [], "").to(x.dtype)
        elif name == "packed":
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
            calls[name] = lambda x, packed=packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        elif name == "mkl_packed" and dtype_name == "float32" and torch.backends.mkl.is_available():
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, hint)
            calls[name] = lambda x, packed=packed: torch.ops.mkl._mkl_linear(x, packed, weight, None, hint)
        elif name == "engine":
            calls[name] = engine_linear(weight)
    return calls


def engine_linear(weight: torch.Tensor):
    """The engine's ``PackedLinear`` over ``weight`` (the C++ op where the kernels build), packed as the engine
    packs."""
    from paged_hf import packed_linear  # noqa: PLC0415 - not in vLLM's environment

    os.environ[packed_linear.ENV] = "all"
    with torch.inference_mode(False), torch.no_grad():  # a parameter with a version counter, as a model's
        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        module.weight.copy_(weight)
    packed_linear.pack_linears(module)
    return module


def time_call(call, x: torch.Tensor, iters: int) -> float:
    """Microseconds per call over ``iters`` calls."""
    begin = time.perf_counter()
    for _ in range(iters):
        call(x)
    return (time.perf_counter() - begin) / iters * 1e6


def vllm_child(args) -> None:
    """Run by vLLM's interpreter: prints ``{"dtype|label|M": microseconds}`` of vLLM's oneDNN linear as JSON."""
    from vllm import _custom_ops as vllm_ops  # noqa: PLC0415 - only in vLLM's environment

    times = {}
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            for label in args.shapes:
                shape = SMOLLM2[label]
                weight = torch.randn(shape).div_(shape[1] ** 0.5).to(DTYPES[dtype_name])
                try:
                    handler = vllm_ops.create_onednn_mm(weight.t(), 32)
                except RuntimeError:
                    continue
                for m in args.tokens:
                    x = torch.randn(m, shape[1], dtype=weight.dtype)
                    call = lambda x: vllm_ops.onednn_mm(handler, x, None)  # noqa: E731
                    call(x)
                    times[f"{dtype_name}|{label}|{m}"] = statistics.median(
                        time_call(call, x, iterations(shape, m, args.iters)) for _ in range(args.repeats))
    print(json.dumps(times))


def vllm_times(args) -> dict:
    """vLLM's timings from a child process under ``args.vllm_python`` ({} when it fails, saying why)."""
    argv = [args.vllm_python, os.path.abspath(__file__), "--vllm-child", "--threads", str(args.threads),
            "--repeats", str(args.repeats), "--iters", str(args.iters), "--shapes", *args.shapes,
            "--dtypes", *args.dtypes, "--tokens", *map(str, args.tokens)]
    print(f"vLLM's oneDNN linear in {args.vllm_python} ({load()})", flush=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        print(f"vLLM's run failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        return {}
    return json.loads(done.stdout.strip().splitlines()[-1])


def iterations(shape: tuple[int, int], m: int, iters: int) -> int:
    """``iters`` calls at ``M <= 32`` on a ``1536x576`` weight, fewer for more work (at least 2)."""
    return max(2, int(iters * 32 / max(m, 32) * 576 * 1536 / (shape[0] * shape[1])))


def bench_shape(label: str, shape: tuple[int, int], dtype_name: str, args, vllm: dict) -> list[list]:
    dtype = DTYPES[dtype_name]
    weight = torch.randn(shape, dtype=torch.float32).div_(shape[1] ** 0.5).to(dtype)
    calls = variants(weight, dtype_name, args.variants, hint=max(args.tokens))
    rows = []
    for m in args.tokens:
        x = torch.randn(m, shape[1], dtype=dtype)
        reference = F.linear(x, weight).float()
        error = {name: (call(x).float() - reference).abs().max().item() for name, call in calls.items()}  # warms
        iters = iterations(shape, m, args.iters)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():  # alternating: a load spike hits every variant alike
                times[name].append(time_call(call, x, iters))
        medians = {name: statistics.median(t) for name, t in times.items()}
        if f"{dtype_name}|{label}|{m}" in vllm:
            medians["vllm"] = vllm[f"{dtype_name}|{label}|{m}"]
        best = min(medians, key=medians.get)
        row = [label, f"{shape[0]}x{shape[1]}", dtype_name, m]
        for name in [*args.variants, "vllm"] if vllm else args.variants:
            row.append(f"{medians[name]:.1f} ({medians['eager'] / medians[name]:.2f}x)" if name in medians else "-")
        row += [best, " ".join(f"{name}:{error[name]:.1e}" for name in calls if name != "eager")]
        rows.append(row)
        print(" | ".join(str(cell) for cell in row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SMOLLM2), choices=list(SMOLLM2))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="calls per timing at M <= 32 on a 1536x576 weight "
                        "(scaled down for larger work)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", help="a vLLM CPU build's python: adds vLLM's own oneDNN linear")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.vllm_child:
        return vllm_child(args)
    from _common import machine, markdown_table  # noqa: PLC0415 - not in vLLM's environment
    if "eager" not in args.variants:
        args.variants.insert(0, "eager")
    vllm = vllm_times(args) if args.vllm_python else {}
    print(machine())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"oneDNN bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}, MKL {torch.backends.mkl.is_available()}")
    rows = []
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            print(f"{dtype_name} ({load()})", flush=True)
            for label in args.shapes:
                rows += bench_shape(label, SMOLLM2[label], dtype_name, args, vllm)
    print()
    names = [*args.variants, "vllm"] if vllm else args.variants
    print(markdown_table(["linear", "weight", "dtype", "M", *[f"{v} us" for v in names], "fastest",
                          "max |diff| vs eager"], rows))
    print(f"\n(median of {args.repeats} alternating timings; threads {args.threads}; {load()})")


if __name__ == "__main__":
    main()
