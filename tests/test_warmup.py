"""Kernel variants: the start-up warm-up covers every batch, and the production variants compile for sm_90
without spills.

- Coverage (CPU, interpreter or not): the variant keys (``aot.variant_key``: triton's cache key as the CUDA backend
  computes it) of the launches that batches of 1..256 sequences make, decode, prefill, mixed, store and copy, are
  all among those ``warmup_kernels`` prepared. On CUDA, also checked in triton's own cache: no compile after the
  warm-up.
- Compile check (needs triton's ptxas, no GPU): a representative subset of the bf16/fp16 production variants
  compiled for sm_90 in a fresh process (the kernels compiled, not interpreted): zero spills, shared memory under
  the sm_90 limit. ``benchmarks/compile_report.py`` compiles the whole grid.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as in test_kernels: the kernels, if launched, interpret

pytest.importorskip("triton", reason="triton is not installed: the kernel variants are untested")

from paged_hf.kernels import aot  # noqa: E402
from paged_hf.kernels.copy_blocks import _copy_launches  # noqa: E402
from paged_hf.kernels.paged_decode_attention import _decode_launches  # noqa: E402
from paged_hf.kernels.paged_prefill_attention import _prefill_launches  # noqa: E402
from paged_hf.kernels.store_kv import _store_launches  # noqa: E402
from paged_hf.kernels.warmup import example_pools, warmup_kernels  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE, KV_HEADS, GROUP, HEAD_DIM = 16, 2, 4, 64

# (kv_format, model dtype, window, softcap, sinks)
LAYERS = [("int8", torch.bfloat16, None, None, False), ("auto", torch.float16, 128, 30.0, True)]


def _layer(kv_format, dtype, window, softcap, use_sinks):
    pools = example_pools(kv_format, 600, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, DEVICE)
    heads = KV_HEADS * GROUP
    options = dict(sliding_window=window, softcap=softcap,
                   sinks=torch.zeros(heads, device=DEVICE) if use_sinks else None,
                   store_dtype=dtype if kv_format == "auto" else torch.float32)
    return pools, heads, options


def _serving_launches(pools, heads, dtype, options, rng):
    """Launches of the steps a server makes, batches of 1..256 sequences (widths, lengths, chunks at random)."""
    attention = (options["sliding_window"], options["softcap"], options["sinks"])
    launches = []
    # longest sequence of each batch: table widths 1, 2, 16, 32 (one partition), 33, 48, 512, 513 blocks
    # (2, 2, 16, 17 partitions), also one past the longest
    longest = (1, 17, 256, 512, 513, 768, 8192, 8193)
    batches = (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 64, 65, 100, 128, 255, 256)
    for i, (batch, extra) in enumerate(zip(batches * 2, [0] * len(batches) + [1] * len(batches))):
        top = longest[i % len(longest)]
        lengths = [top] + [rng.randint(1, top) for _ in range(batch - 1)]
        width = -(-top // BLOCK_SIZE) + extra
        tables = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor(lengths, device=DEVICE)
        query = torch.zeros(batch, heads, HEAD_DIM, dtype=dtype, device=DEVICE)
        launches += _decode_launches(query, pools, tables, seq_lens, 0.1, *attention, torch.empty_like(query))
        chunks = [rng.randint(1, min(n, 40)) for n in lengths]  # within a step's token budget
        cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], device=DEVICE)
        prefill_query = torch.empty(sum(chunks), heads, HEAD_DIM, dtype=dtype, device=DEVICE)
        launches += _prefill_launches(prefill_query, pools, tables, seq_lens, cu, 0.1, *attention,
                                      torch.empty_like(prefill_query))
        if batch > 1:  # a mixed step: the first d sequences decode, the rest prefill, on slices of the same tensors
            d = rng.randint(1, batch - 1)
            mixed = torch.empty(d + sum(chunks[d:]), heads, HEAD_DIM, dtype=dtype, device=DEVICE)
            out = torch.empty_like(mixed)
            launches += _decode_launches(mixed[:d], pools, tables[:d], seq_lens[:d], 0.1, *attention, out[:d])
            launches += _prefill_launches(mixed[d:], pools, tables[d:], seq_lens[d:], cu[d:] - cu[d], 0.1,
                                          *attention, out[d:])
        for tokens in (batch, sum(chunks)):
            states = torch.empty(tokens, KV_HEADS, HEAD_DIM, dtype=options["store_dtype"], device=DEVICE)
            slots = torch.arange(tokens, device=DEVICE)
            launches += _store_launches(states, states, slots, pools)
        pairs = torch.arange(rng.randint(1, 8), device=DEVICE)
        launches += _copy_launches(pairs, pairs + 100, pools.block_tensors())
    return launches


# On CUDA the real cache is checked instead, and the keys computed here (triton 3.9's internals) could differ from
# an older triton's there.
@pytest.mark.skipif(CUDA, reason="on CUDA, test_warmup_leaves_nothing_to_compile_on_cuda checks triton's cache")
@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: f"{layer[0]}-{str(layer[1]).split('.')[-1]}")
def test_warmup_covers_every_batch(layer):
    kv_format, dtype = layer[:2]
    pools, heads, options = _layer(*layer)
    warmed = warmup_kernels(pools, heads, dtype, **options)
    warm_keys = {aot.variant_key(launch) for launch in warmed}
    kernels = {key[0] for key in warm_keys}
    assert kernels == {"_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_store_kernel", "_copy_kernel"}
    assert len(warm_keys) >= 5
    serving = _serving_launches(pools, heads, dtype, options, random.Random(0))
    new = {aot.variant_key(launch) for launch in serving} - warm_keys
    assert not new, f"{len(new)} variants compile while serving, e.g. {sorted(new)[0]}"


@pytest.mark.skipif(not CUDA, reason="checks triton's compiled-kernel cache on a CUDA device")
def test_warmup_leaves_nothing_to_compile_on_cuda():
    """On the GPU: after the warm-up, serving launches of any batch size compile nothing (triton's cache)."""
    pools, heads, options = _layer(*LAYERS[0])
    dtype = LAYERS[0][1]
    launches = warmup_kernels(pools, heads, dtype, **options)
    kernels = {launch.kernel for launch in launches}
    if not all(hasattr(kernel, "device_caches") for kernel in kernels):
        pytest.skip("this triton keeps no JITFunction.device_caches to count compiled variants in")
    compiled = _compiled_count(kernels)
    for launch in _serving_launches(pools, heads, dtype, options, random.Random(1)):
        launch()
    torch.cuda.synchronize()
    assert _compiled_count(kernels) == compiled


def _compiled_count(kernels) -> int:
    return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())


# ------------------------------------------------------------------------------------------------ sm_90 compile

# (kernel, kv_format, dtype, head_dim, window + softcap + sinks): variants that spilled, with float32 queries or
# before the tiles and maxnreg were set, or sit closest to 255 registers now (benchmarks/RESULTS.md, "sm_90
# compile report"). The whole grid: benchmarks/compile_report.py.
COMPILE_SUBSET = [
    ("prefill", "int8", "float16", 128, True),
    ("prefill", "int4", "bfloat16", 256, True),
    ("decode-parts", "fp8_e5m2", "bfloat16", 128, False),
    ("decode-parts", "int8", "float16", 128, True),
    ("fill", "int4", "bfloat16", 128, False),  # int4's block fill: two passes whose tiles differ in shape
]

# paged_hf/kernels loaded as a package of its own (as in test_kernels): importing paged_hf imports transformers
_COMPILE_SCRIPT = """
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location('kernels_alone', 'paged_hf/kernels/__init__.py',
                                              submodule_search_locations=['paged_hf/kernels'])
package = importlib.util.module_from_spec(spec); sys.modules['kernels_alone'] = package
spec.loader.exec_module(package)
from kernels_alone import aot
from kernels_alone.warmup import example_pools, layer_launches
results = []
for kernel, kv_format, dtype, head_dim, features in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    options = dict(sliding_window=4096, softcap=30.0, sinks=torch.zeros(32)) if features else {}
    launches = layer_launches(example_pools(kv_format, 40, 16, 8, head_dim, dtype), 32, dtype,
                              store_dtype=dtype if kv_format == "int4" else torch.float32, **options)
    launch = {"decode": launches[0], "decode-parts": launches[1], "prefill": launches[3], "fill": launches[4]}[kernel]
    assert kernel != "fill" or launch.kernel.fn.__name__ == "_fill_kernel", launch.kernel.fn.__name__
    result = aot.compile_launch(launch)
    results.append(dict(kernel=kernel, kv_format=kv_format, head_dim=head_dim, features=features,
                        spills=result.spills, shared=result.shared, registers=result.registers,
                        seconds=round(result.seconds, 1)))
print(json.dumps(results))
"""


@pytest.mark.skipif(CUDA, reason="on a GPU machine every variant the tests launch compiles for real")
def test_production_variants_compile_for_sm90_without_spills():
    missing = aot.ptxas_available()
    if missing:
        pytest.skip(missing)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(COMPILE_SUBSET)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(rows) == len(COMPILE_SUBSET)
    for row in rows:
        assert row["spills"] == 0 and row["shared"] <= aot.SM90_MAX_SHARED, row
