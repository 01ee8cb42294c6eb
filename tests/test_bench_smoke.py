"""Every ``paged-hf bench NAME`` runs, at its smallest size, through the command users type.

The list of benchmarks is ``paged_hf_cli.benchmark_names()`` (the scripts of ``benchmarks/``): a new script without
an entry in ``SMOKE`` fails here until it gets one. These runs check that each script still works against today's
code (it imports, reads the cache and engine it measures, prints its table), not its figures: a few tokens on
stories260K, a few seconds each after the imports. Benchmarks that need a CUDA device skip without one, saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import paged_hf_cli
from models import require_stories

# name -> the smallest arguments, and what its output must show
SMOKE = {
    "compile_report": (["--dtypes", "bfloat16", "--head-dims", "64", "--formats", "auto", "--kernels", "store"],
                       "store"),
    "cuda_graphs": (["--quick"], "decode tok/s"),  # on CPU: the padded static path against no graphs
    "cpu_attention": (["--threads", "1", "--repeats", "1", "--formats", "auto"], "prefill"),
    "cpu_prefill": (["--quick", "--threads", "1", "--repeats", "1"], "speed-up"),
    # against this checkout's own source (a file: no git needed)
    "prefill_ab": (["--against", str(Path(paged_hf_cli.BENCHMARKS_DIR).parent / "paged_hf/kernels/csrc" /
                                     "paged_prefill.cpp"), "--quick", "--threads", "1", "--repeats", "1"],
                   "largest difference"),
    "decode": (["--models", "stories260K", "--batches", "1", "--new-tokens", "3", "--repeats", "1", "--min-len", "4",
                "--max-len", "8", "--threads", "1"], "DynamicCache"),
    "decode_linears": (["--rows", "1,33", "--layers", "1", "--repeats", "1", "--threads", "1"], "outputs differing"),
    "engine_thread": (["--model", "stories260K", "--requests", "3", "--rounds", "1", "--threads", "1"],
                      "| released | 1"),
    "engine_compile": (["--models", "stories260K", "--dtypes", "float32", "--requests", "2", "--max-out", "8",
                        "--rounds", "1", "--threads", "1"], "same tokens"),
    "families": (["--families", "llama", "--tokens", "3"], "| llama  | yes      | True              | True"),
    "gemm": (["--shapes", "k/v", "--tokens", "1", "4", "--repeats", "1", "--iters", "2", "--threads", "1"],
             "fastest"),
    "fault_load": (["--clients", "8"], "idle"),
    "images": (["--requests", "3", "--max-out", "3", "--budgets", "64", "--layers", "1", "--hidden", "64"],
               "vision-tower runs"),
    "gpu_kernels": (["--quick"], "Paged attention kernels"),
    "latent_attention": (["--layers", "1", "--requests", "2", "--hidden", "256", "--vocab", "512", "--prompt-len",
                          "8-40", "--engines", "eager", "--dtype", "float32"], "greedy tokens equal"),
    "kv_decode": (["--model", "stories260K", "--formats", "int8,auto", "--batch", "1", "--prompt-len", "8",
                   "--new-tokens", "3", "--repeats", "1"], "decode ms/step"),
    "kv_quality": (["--models", "stories", "--rows", "dynamic,int8", "--tokens", "32", "--prompts", "2", "--batch", "2",
                    "--new-tokens", "3"], "int8"),
    "memory": (["--batch", "2", "--min-len", "4", "--max-len", "8", "--new-tokens", "3"], "live / peak allocated"),
    "overhead": (["--num-seqs", "1", "--steps", "2", "--warmup", "1"], "scheduler"),
    "prefix": (["--model", "stories", "--requests", "2", "--system-tokens", "32", "--question-tokens", "8",
                "--max-tokens", "2", "--repeats", "1", "--admission", "chunked", "--bursts", "off"], "prefix"),
    "serve": (["--model", "stories", "--requests", "2", "--rates", "inf", "--prompt-len", "8-16",
               "--output-len", "2-4"], "TTFT"),
    "serve_vs_vllm": (["--model", "stories260K", "--vllm-python", "/nonexistent/bin/python", "--requests", "3",
                       "--concurrency", "2", "--prompt-len", "8-16", "--output-len", "2-4", "--threads", "1",
                       "--pairs", "1"], "vLLM SKIPPED: no Python at /nonexistent"),  # paged_hf's row still runs
    "structured": (["--model", "stories260K", "--batch", "2", "--steps", "2", "--rounds", "1", "--latency-rounds", "1",
                    "--threads", "1"],
                   "JSON-schema constrained"),
    "throughput": (["--model", "stories", "--requests", "4", "--max-prompt", "32", "--max-out", "8",
                    "--min-out", "2"], "PagedEngine"),
    "vs_vllm": (["--model", "stories260K", "--workloads", "shared", "--dtypes", "float32", "--pairs", "1",
                 "--num-requests", "2", "--max-prompt", "16", "--max-output", "2", "--threads", "1",
                 "--engines", "paged_hf"], "paged_hf"),  # tests/test_vs_vllm_smoke.py runs its HF rows too
    "spec_decode": (["--requests", "2", "--batches", "1,2", "--max-tokens", "8", "--repeats", "1", "--story-chars",
                     "200"], "same tokens"),
    "tp": (["--tensor-parallel-size", "1", "--requests", "2", "--prompt-len", "8", "16", "--output-len", "2", "4"],
           "TP"),
}
NEEDS_CUDA = {"gpu_kernels"}
# Run in a child process: compiling for another target leaves triton's driver state changed for later tests.
ISOLATED = {"compile_report", "gpu_kernels", "vs_vllm", "engine_compile"}


def _run(name: str, args: list[str], capsys) -> tuple[int, str, str]:
    """Runs ``paged-hf bench NAME ARGS`` in this process (the imports are paid once for all the benchmarks), or in a
    child process for the ``ISOLATED`` ones."""
    import torch

    if name in ISOLATED:
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        done = subprocess.run([sys.executable, "-m", "paged_hf_cli", "bench", name, *args], capture_output=True,
                              text=True, env=env, cwd=root, timeout=600)
        return done.returncode, done.stdout, done.stderr

    threads, argv, path = torch.get_num_threads(), list(sys.argv), list(sys.path)
    try:
        status = paged_hf_cli.main(["bench", name, *args])
    except SystemExit as done:  # the scripts end with sys.exit(main())
        status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        torch.set_num_threads(threads)
        sys.argv[:], sys.path[:] = argv, path
    out, err = capsys.readouterr()
    return status, out, err


def test_every_benchmark_has_a_smoke_run():
    assert sorted(SMOKE) == paged_hf_cli.benchmark_names()


def test_no_benchmark_shadows_an_installed_module():
    """A script runs with ``benchmarks/`` first on ``sys.path``: a ``NAME.py`` there hides the package NAME from
    everything the script imports (``benchmarks/kernels.py`` once hid HF's ``kernels`` from transformers)."""
    import importlib.machinery

    benchmarks = str(Path(paged_hf_cli.BENCHMARKS_DIR).resolve())
    elsewhere = [p for p in sys.path if p and str(Path(p).resolve()) != benchmarks]
    shadowing = [name for name in paged_hf_cli.benchmark_names()
                 if importlib.machinery.PathFinder.find_spec(name, elsewhere) is not None]
    assert not shadowing, f"benchmarks/ scripts named like installed modules: {shadowing}"


@pytest.mark.parametrize("name", paged_hf_cli.benchmark_names())
def test_benchmark_runs_at_its_smallest_size(name, capsys):
    import torch

    require_stories()
    args, expected = SMOKE[name]
    status, out, err = _run(name, args, capsys)
    output = out + err
    if name in NEEDS_CUDA and not torch.cuda.is_available():
        assert status == 2 and "no CUDA device" in err, output
        pytest.skip(f"benchmarks/{name}.py measures on a CUDA GPU; none here (it said so and exited 2)")
    if name == "compile_report" and "Nothing compiled" in err:
        pytest.skip(f"compile_report needs triton's NVIDIA backend and ptxas: {err.strip()}")
    assert status == 0, output
    assert "skipped" not in out.replace("vLLM rows skipped: not in --engines", ""), output
    assert expected in out, output
