"""Triton kernels of the paged path against their torch references.

Without CUDA the kernels run in triton's CPU interpreter (``TRITON_INTERPRET=1``, set below before any kernel is
launched; the kernel modules decorate their functions at the first launch, so this also holds when another test
module imported ``paged_hf`` first). With CUDA they run compiled on the GPU. The interpreter is slow, so the
default cases are a covering subset of the grid (every value of every axis appears: block sizes 8/16/32, head_dim
64/128/256, GQA 1/4/8, every kv format, lengths 1/15/16/17/hundreds, ragged batches, empty and full blocks, sliding
window, softcap, sinks, several partitions); ``PAGED_HF_SLOW=1`` adds a larger sweep.

Tolerances: float32 queries 1e-5 (atol and rtol) against the reference on the same (quantized) pools; float16 /
bfloat16 queries, whose K/V tiles and probabilities enter the dots in that dtype, 2e-3 / 1.6e-2. Stores are
compared byte for byte. int4 (per-channel keys, a full-precision tail, blocks quantized when they fill) has its own
kernel tests in ``test_kernels_int4.py``; here it runs through the shared attention grid.
"""

from __future__ import annotations

import ast
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_kernels import require_triton_kernels

CUDA = require_triton_kernels()  # before the kernel imports below

from paged_hf.kernels import dispatch  # noqa: E402
from paged_hf.kernels.copy_blocks import copy_blocks, copy_blocks_ref  # noqa: E402
from pools import kernel_args, random_block_tables, random_pools  # noqa: E402
from paged_hf.kernels.paged_decode_attention import (  # noqa: E402
    _decode_launches,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from paged_hf.kernels.paged_prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from paged_hf.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402
from paged_hf.quant import make_storage  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
slow = pytest.mark.skipif(os.environ.get("PAGED_HF_SLOW") != "1", reason="slow: set PAGED_HF_SLOW=1")


# ------------------------------------------------------------------------------------------------ helpers


def make_pools(kv_format, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, seed=0, num_rows=4):
    """Pools filled with random K/V (quantized by the reference for quantized formats; int4 with ``num_rows`` random
    tail rows): the fields of ``storage.pool_tensors()`` as a dict (``kernel_args`` passes them)."""
    return random_pools(kv_format, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed, num_rows, DEVICE,
                        key_offset=1.0)


def make_tables(lengths, block_size, num_blocks, spare_columns=1, seed=0):
    """Block tables with distinct random blocks per sequence, ``spare_columns`` unused (but valid) entries past the
    longest sequence (so some blocks of the table are empty), padded rows filled with valid random ids."""
    tables = random_block_tables(lengths, block_size, num_blocks, torch.Generator().manual_seed(seed + 1),
                                 spare_columns)
    return tables.to(torch.int32).to(DEVICE)


def assert_close(out, ref, dtype):
    tol = TOLERANCE[dtype] * (3 if CUDA and dtype == torch.float32 else 1)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def attention_case(block_size, head_dim, group, kv_format, lengths, num_kv_heads=1, dtype=torch.float32, seed=0,
                   query_lens=None):
    """Pools, tables, queries (decode: one per sequence; prefill: ``query_lens``) and sinks of one case."""
    total_blocks = sum(-(-n // block_size) for n in lengths) + 3
    pools = make_pools(kv_format, total_blocks, block_size, num_kv_heads, head_dim,
                       dtype if kv_format in ("auto", "int4") else torch.float32, seed, num_rows=len(lengths) + 2)
    tables = make_tables(lengths, block_size, total_blocks, seed=seed)
    gen = torch.Generator().manual_seed(seed + 2)
    if "key_tail" in pools:  # each sequence's tail row (int4), not in sequence order
        pools["tail_rows"] = torch.randperm(len(lengths) + 2, generator=gen)[: len(lengths)].to(DEVICE)
    num_heads = group * num_kv_heads
    num_queries = len(lengths) if query_lens is None else sum(query_lens)
    query = torch.randn(num_queries, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    sinks = torch.randn(num_heads, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
    if "key_tail" in pools:  # int4 reads each query's own block exact: the forward's new K/V, packed like the queries
        for which in ("key", "value"):
            pools[f"fresh_{which}"] = torch.randn(num_queries, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return pools, tables, query, sinks, seq_lens


# ------------------------------------------------------------------------------------------------ decode

# (block_size, head_dim, group, kv_format, lengths, num_kv_heads, window, softcap, sinks, partition, dtype)
DECODE_CASES = [
    (16, 64, 1, "auto", [1, 15, 16, 17], 1, None, None, False, None, torch.float32),
    (8, 128, 4, "int8", [300, 17, 1], 1, None, 20.0, False, 64, torch.float32),
    (32, 64, 8, "fp8_e4m3", [16, 333], 1, None, None, True, 128, torch.float32),
    (16, 128, 1, "fp8_e5m2", [15, 257], 2, 100, None, False, 64, torch.float32),
    (8, 64, 4, "int4", [1, 16, 400], 1, 37, 30.0, True, 64, torch.float32),
    (32, 128, 8, "int8", [17, 64], 1, None, None, True, None, torch.float32),
    (16, 64, 4, "auto", [200, 3], 1, None, 10.0, False, 64, torch.float16),
    (32, 64, 1, "int4", [32, 31, 1], 2, 8, None, False, None, torch.float32),
    (8, 128, 8, "fp8_e4m3", [40, 129], 1, 64, None, True, 64, torch.bfloat16),
    (16, 128, 4, "fp8_e5m2", [480], 1, None, 50.0, True, None, torch.float32),
    (32, 64, 4, "auto", [700, 1], 1, 200, None, True, 128, torch.bfloat16),
    (16, 256, 4, "int8", [70, 600], 1, None, None, False, 256, torch.bfloat16),  # head_dim > 128: 8 warps
]


def _decode_id(case):
    bs, d, g, fmt, lengths, hkv, window, cap, sinks, part, dtype = case
    return (f"bs{bs}-d{d}-g{g}-{fmt}-len{'_'.join(map(str, lengths))}-kv{hkv}-w{window}-cap{cap}-sinks{int(sinks)}"
            f"-part{part}-{str(dtype).split('.')[-1]}")


def _run_decode(case, seed=0):
    bs, d, g, fmt, lengths, hkv, window, cap, use_sinks, part, dtype = case
    pools, tables, query, sinks, seq_lens = attention_case(bs, d, g, fmt, lengths, hkv, dtype, seed)
    options = dict(scale=d ** -0.5, sliding_window=window, softcap=cap, sinks=sinks if use_sinks else None)
    out = paged_decode_attention(query, block_tables=tables, seq_lens=seq_lens, partition_size=part,
                                 **kernel_args(pools),
                                 **options)
    ref = paged_decode_attention_ref(query, block_tables=tables, seq_lens=seq_lens, **kernel_args(pools), **options)
    assert out.shape == ref.shape and out.dtype == query.dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("case", DECODE_CASES, ids=_decode_id)
def test_decode_matches_ref(case):
    _run_decode(case)


def test_decode_default_partitions_and_strided_query():
    """The default 512-token partitions (several of them at 1100 tokens) and a non-contiguous query."""
    pools, tables, query, sinks, seq_lens = attention_case(16, 64, 4, "int8", [1100, 513, 5], 1)
    wide = torch.randn(query.shape[0], query.shape[1], 2 * query.shape[2], device=DEVICE)[..., ::2]
    wide.copy_(query)
    out = paged_decode_attention(wide, block_tables=tables, seq_lens=seq_lens, scale=0.125, sinks=sinks,
                                 **kernel_args(pools))
    ref = paged_decode_attention_ref(query, block_tables=tables, seq_lens=seq_lens, scale=0.125, sinks=sinks,
                                     **kernel_args(pools))
    assert_close(out, ref, torch.float32)


def test_decode_empty_partitions_write_no_partials():
    """The partition count follows the widest block table; programs whose partition starts at or past their
    sequence's length exit before writing: their partials keep whatever the buffers held (here a sentinel), the
    others are written, and the reduce (which reads only partitions below each length) gives the reference."""
    lengths, partition = [5, 300, 64, 65], 64
    pools, tables, query, sinks, seq_lens = attention_case(16, 64, 4, "int8", lengths, 1)
    out = torch.empty_like(query)
    decode, reduce = _decode_launches(query, kernel_args(pools)["pools"], tables, seq_lens, 0.125, None, None, sinks,
                                      out, partition)
    args = dict(zip(decode.kernel.arg_names, decode.args))
    partials = [args["PartM"], args["PartL"], args["PartAcc"]]
    num_parts = partials[0].shape[2]
    assert num_parts == 5 and decode.grid[2] == num_parts
    for t in partials:
        t.fill_(1234.5)
    decode()
    for s, n in enumerate(lengths):
        for part in range(num_parts):
            empty = part * partition >= n
            for t in partials:
                untouched = bool((t[s, :, part] == 1234.5).all())
                assert untouched == empty, (s, n, part, t.shape)
    reduce()
    ref = paged_decode_attention_ref(query, block_tables=tables, seq_lens=seq_lens, scale=0.125, sinks=sinks,
                                     **kernel_args(pools))
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("kv_format", ["int8", "int4"])
def test_tiny_value_scales_keep_float16_precision(kv_format):
    """The value scales multiply the probabilities before the float16 dot (``load_kv_codes``): with V of magnitude
    ~1e-5 that product would sit among float16 subnormals, so each tile is normalized by its largest scale first.
    Compared at float16's relative tolerance after undoing the magnitude."""
    pools, tables, query, _, seq_lens = attention_case(16, 64, 4, kv_format, [40, 300], 1, torch.float16)
    if kv_format == "int4":  # value_scale holds 4-bit scale codes; the scales are value_zero (vmax) times 2^(-k/3)
        pools["value_zero"] = pools["value_zero"] * 1e-4
    else:
        pools["value_scale"] = pools["value_scale"] * 1e-4
    prefill_pools = dict(pools)
    if pools.get("value_tail") is not None:  # int4's full-precision tail and new values: as tiny
        pools["value_tail"] = pools["value_tail"] * 1e-4
        pools["fresh_value"] = pools["fresh_value"] * 1e-4
        prefill_pools = {**pools, "fresh_key": pools["fresh_key"][:1].expand(40, -1, -1).contiguous(),
                         "fresh_value": pools["fresh_value"][:1].expand(40, -1, -1).contiguous()}
    cu = torch.tensor([0, 20, 40], device=DEVICE)
    prefill_query = query[:1].expand(40, -1, -1).contiguous()
    for out, ref in (
        (paged_decode_attention(query, block_tables=tables, seq_lens=seq_lens, scale=0.125, partition_size=64,
                                **kernel_args(pools)),
         paged_decode_attention_ref(query, block_tables=tables, seq_lens=seq_lens, scale=0.125, **kernel_args(pools))),
        (paged_prefill_attention(prefill_query, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu,
                                 scale=0.125, **kernel_args(prefill_pools)),
         paged_prefill_attention_ref(prefill_query, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu,
                                     scale=0.125, **kernel_args(prefill_pools))),
    ):
        assert_close(out.float() * 1e4, ref.float() * 1e4, torch.float16)


def test_decode_rejects_bad_operands():
    pools, tables, query, _, seq_lens = attention_case(16, 64, 4, "int8", [5, 9], 2)
    common = dict(block_tables=tables, seq_lens=seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="needs value_scale"):
        paged_decode_attention(query, **common, **kernel_args({**pools, "value_scale": None}))
    with pytest.raises(ValueError, match="kv_format"):
        paged_decode_attention(query, **common, **kernel_args({**pools, "kv_format": "int3"}))
    with pytest.raises(ValueError, match="int8"):
        paged_decode_attention(query, **common, **kernel_args({**pools, "kv_format": "fp8_e4m3"}))
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(query[:, :3], **common, **kernel_args(pools))
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(query, **{**common, "block_tables": tables.float()}, **kernel_args(pools))


@slow
@pytest.mark.parametrize(
    "bs,d,g,fmt", list(itertools.product((8, 16, 32), (64, 128), (1, 4, 8), FORMATS)),
    ids=lambda v: str(v),
)
def test_decode_sweep(bs, d, g, fmt):
    for lengths, window, cap, sinks, part in (([1, 17, 300], None, None, False, 64), ([16, 129], 50, 25.0, True, None)):
        _run_decode((bs, d, g, fmt, lengths, 1, window, cap, sinks, part, torch.float32), seed=bs + d + g)


# ------------------------------------------------------------------------------------------------ prefill

# (block_size, head_dim, group, kv_format, seq_lens, query_lens, num_kv_heads, window, softcap, sinks, dtype)
PREFILL_CASES = [
    (16, 64, 1, "auto", [16, 40, 17], [16, 0, 17], 1, None, None, False, torch.float32),
    (8, 128, 4, "int8", [15, 300, 1], [15, 60, 1], 1, None, 20.0, True, torch.float32),
    (32, 64, 8, "fp8_e4m3", [100, 33], [37, 1], 1, 20, None, False, torch.float32),
    (16, 128, 8, "fp8_e5m2", [129, 8], [40, 8], 1, None, None, True, torch.float32),
    (8, 64, 4, "int4", [70, 16, 5], [70, 15, 2], 2, 30, 30.0, True, torch.float32),
    (32, 128, 1, "int4", [200], [130], 1, None, None, False, torch.float32),
    (16, 64, 4, "auto", [90, 20], [45, 20], 1, 16, None, True, torch.float16),
    (8, 64, 8, "int8", [64, 0, 31], [33, 0, 31], 1, None, None, False, torch.bfloat16),
    (16, 256, 4, "fp8_e4m3", [90, 20], [50, 20], 1, None, None, True, torch.float16),  # head_dim 256: 16-key tiles
    (8, 256, 4, "int4", [33, 5], [20, 5], 1, 16, None, False, torch.bfloat16),  # int4 at 256: 32-row programs
]


def _prefill_id(case):
    bs, d, g, fmt, lengths, qlens, hkv, window, cap, sinks, dtype = case
    return (f"bs{bs}-d{d}-g{g}-{fmt}-seq{'_'.join(map(str, lengths))}-q{'_'.join(map(str, qlens))}-kv{hkv}"
            f"-w{window}-cap{cap}-sinks{int(sinks)}-{str(dtype).split('.')[-1]}")


def _run_prefill(case, seed=0):
    bs, d, g, fmt, lengths, qlens, hkv, window, cap, use_sinks, dtype = case
    pools, tables, query, sinks, seq_lens = attention_case(bs, d, g, fmt, lengths, hkv, dtype, seed, qlens)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int64, device=DEVICE)
    options = dict(scale=d ** -0.5, sliding_window=window, softcap=cap, sinks=sinks if use_sinks else None)
    out = paged_prefill_attention(query, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu, **kernel_args(pools),
                                  **options)
    ref = paged_prefill_attention_ref(query, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu,
                                      **kernel_args(pools),
                                      **options)
    assert out.shape == ref.shape and out.dtype == query.dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_prefill_id)
def test_prefill_matches_ref(case):
    _run_prefill(case)


@slow
@pytest.mark.parametrize(
    "bs,d,g,fmt", list(itertools.product((8, 16, 32), (64, 128), (1, 4, 8), FORMATS)),
    ids=lambda v: str(v),
)
def test_prefill_sweep(bs, d, g, fmt):
    for lengths, qlens, window, cap, sinks in (([17, 150], [17, 70], None, None, False),
                                               ([40, 9], [1, 9], 12, 9.0, True)):
        _run_prefill((bs, d, g, fmt, lengths, qlens, 1, window, cap, sinks, torch.float32), seed=bs + d + g)


# ------------------------------------------------------------------------------------------------ store


def _pool_bytes(storage) -> dict[str, torch.Tensor]:
    return {name: t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2
                                                                                   else torch.int32)
            for name, t in storage.tensors().items()}


def _store_both(kv_format, key, value, slots, num_blocks, block_size, dtype=torch.float32):
    """Stores through the kernel and the reference into two fresh storages; returns both."""
    num_kv_heads, head_dim = key.shape[1:]
    kernel = make_storage(kv_format, num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    ref = make_storage(kv_format, num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    store_kv(key, value, slots, pools=kernel.pool_tensors())
    store_kv_ref(key, value, slots, pools=ref.pool_tensors())
    return kernel, ref


def _assert_same_bytes(kernel, ref):
    got, want = _pool_bytes(kernel), _pool_bytes(ref)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs in {int((got[name] != want[name]).sum())} places"


# (kv_format, block_size, head_dim, num_kv_heads, input dtype)
STORE_CASES = [
    ("auto", 16, 64, 2, torch.float32), ("auto", 8, 128, 1, torch.bfloat16),
    ("int8", 8, 64, 3, torch.float32), ("int8", 32, 128, 1, torch.float16),
    ("fp8_e4m3", 16, 128, 2, torch.float32), ("fp8_e4m3", 32, 64, 1, torch.bfloat16),
    ("fp8_e5m2", 32, 64, 3, torch.float32), ("fp8_e5m2", 8, 128, 2, torch.float16),
]  # int4 stores whole blocks through a tail: tests/test_kernels_int4.py


@pytest.mark.parametrize("kv_format,block_size,head_dim,num_kv_heads,dtype", STORE_CASES,
                         ids=lambda v: str(v).split(".")[-1])
def test_store_matches_ref_bytes(kv_format, block_size, head_dim, num_kv_heads, dtype):
    """Random vectors over ten decades of magnitude (subnormal scales included), zero and constant vectors, into
    scattered slots (a full block and partial ones); the input dtype is the model's, also for 'auto' pools."""
    gen = torch.Generator().manual_seed(block_size + head_dim)
    n = 2 * block_size + 1
    magnitudes = torch.logspace(-7, 3, n).view(n, 1, 1)
    key = (torch.randn(n, num_kv_heads, head_dim, generator=gen) * magnitudes).to(dtype)
    value = (torch.randn(n, num_kv_heads, head_dim, generator=gen) * magnitudes.flip(0)).to(dtype)
    key[0] = 0.0
    value[1] = 0.75
    value[2] = -3.0
    key[3, 0, 1] = 5.0  # one outlier
    slots = torch.cat([torch.arange(block_size, 2 * block_size), torch.randperm(4 * block_size, generator=gen)[:n]])
    slots = slots.unique()[:n]
    slots = slots[torch.randperm(n, generator=gen)]
    kernel, ref = _store_both(kv_format, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), 6, block_size,
                              dtype if kv_format == "auto" else torch.float32)
    _assert_same_bytes(kernel, ref)


def _tie_vectors(values: torch.Tensor, anchor: float, head_dim: int = 64) -> torch.Tensor:
    """Rows of ``head_dim`` holding ``anchor`` (so the scale is exactly 1) and then ``values``."""
    per_row = head_dim - 1
    pad = (-values.numel()) % per_row
    values = torch.cat([values, torch.zeros(pad)]).view(-1, per_row)
    rows = torch.cat([torch.full((values.shape[0], 1), anchor), values], dim=1)
    return rows.view(-1, 1, head_dim)


def _float8_grid(dtype) -> torch.Tensor:
    """Every finite float8 value, the midpoints between neighbours (rounding ties) and one float32 ulp either side."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    nudged = torch.cat([torch.nextafter(mids, torch.full_like(mids, float("inf"))),
                        torch.nextafter(mids, torch.full_like(mids, float("-inf")))])
    return torch.cat([finite, mids, nudged, -mids, torch.tensor([-0.0, 1e-30, -1e-30])])


@pytest.mark.parametrize("kv_format", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_store_rounding_ties(kv_format):
    """Values at and around every rounding tie, with a scale of exactly 1: codes as torch rounds them
    (round half to even for int8, round to nearest even float8 incl. subnormals)."""
    if kv_format == "int8":
        grid = torch.arange(-127, 127) + 0.5
        values = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
        rows = _tie_vectors(values, 127.0)
    else:
        dtype = torch.float8_e4m3fn if kv_format == "fp8_e4m3" else torch.float8_e5m2
        rows = _tie_vectors(_float8_grid(dtype), torch.finfo(dtype).max)
    rows = rows.to(DEVICE)
    kernel, ref = _store_both(kv_format, rows, -rows, torch.arange(rows.shape[0], device=DEVICE),
                              -(-rows.shape[0] // 16), 16)
    _assert_same_bytes(kernel, ref)


# ------------------------------------------------------------------------------------------------ copy


@pytest.mark.parametrize("kv_format", FORMATS)
def test_copy_blocks_matches_ref(kv_format):
    storage = make_storage(kv_format, 7, 16, 2, 64, torch.bfloat16, DEVICE)
    for t in storage.tensors().values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=DEVICE))
    expected = [t.clone() for t in storage.tensors().values()]
    src = torch.tensor([1, 2, 6], device=DEVICE)
    dst = torch.tensor([0, 5, 3], dtype=torch.int32, device=DEVICE)
    copy_blocks(src, dst, list(storage.tensors().values()))
    copy_blocks_ref(src, dst, expected)
    for got, want in zip(storage.tensors().values(), expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_copy_blocks_strided_and_odd_sizes():
    """Blocks that are views of a larger buffer (block stride != block size) and whose byte count only fits
    narrow words; an empty id list is a no-op."""
    buffer = torch.randint(-100, 100, (8, 3, 5), dtype=torch.int16, device=DEVICE)
    pool = buffer[::2]  # 4 blocks, stride 2 blocks
    narrow = torch.randint(0, 255, (4, 3, 3), dtype=torch.uint8, device=DEVICE)
    expected = [pool.clone(), narrow.clone()]
    interleaved = buffer[1::2].clone()
    src, dst = torch.tensor([3, 0], device=DEVICE), torch.tensor([1, 2], device=DEVICE)
    copy_blocks(src, dst, [pool, narrow])
    copy_blocks_ref(src, dst, expected)
    assert torch.equal(pool, expected[0]) and torch.equal(narrow, expected[1])
    assert torch.equal(buffer[1::2], interleaved), "the blocks between the pool's blocks must stay untouched"
    before = buffer.clone()
    copy_blocks(src[:0], dst[:0], [pool])
    assert torch.equal(buffer, before), "an empty id list copies nothing"


# ------------------------------------------------------------------------------------------------ dispatch


def test_use_triton_env(monkeypatch):
    monkeypatch.setenv("PAGED_HF_KERNELS", "torch")
    assert dispatch.use_triton(DEVICE) is False
    monkeypatch.setenv("PAGED_HF_KERNELS", "triton")
    assert dispatch.use_triton(DEVICE) is True  # CUDA, or CPU under the interpreter
    monkeypatch.setenv("PAGED_HF_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PAGED_HF_KERNELS"):
        dispatch.use_triton(DEVICE)
    monkeypatch.delenv("PAGED_HF_KERNELS")
    assert dispatch.use_triton("cpu") is False
    assert dispatch.use_triton(DEVICE) is CUDA
    monkeypatch.setenv("PAGED_HF_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not CUDA:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            dispatch.use_triton("cpu")


def test_dispatch_routes_to_both_sides(monkeypatch):
    pools, tables, query, sinks, seq_lens = attention_case(16, 64, 4, "fp8_e4m3", [20, 3], 1)
    cu = torch.tensor([0, 20, 23], device=DEVICE)
    prefill_query = torch.randn(23, 4, 64, device=DEVICE)
    results = {}
    for side in ("torch", "triton"):
        monkeypatch.setenv("PAGED_HF_KERNELS", side)
        kernels = dispatch.select(DEVICE)
        assert kernels.triton == (side == "triton")
        decode = kernels.decode_attention(query, block_tables=tables, seq_lens=seq_lens, scale=0.125,
                                          **kernel_args(pools))
        prefill = kernels.prefill_attention(prefill_query, block_tables=tables, seq_lens=seq_lens,
                                            cu_query_lens=cu, scale=0.125, **kernel_args(pools))
        storage = make_storage("int8", 2, 16, 1, 64, torch.float32, DEVICE)  # picks its kernels when made
        assert storage.kernels.triton == (side == "triton")
        storage.write(torch.tensor([3, 17], device=DEVICE), query[:, :1], query[:, 1:2])
        storage.copy_blocks(torch.tensor([0], device=DEVICE), torch.tensor([1], device=DEVICE))
        results[side] = (decode, prefill, [t.clone() for t in storage.tensors().values()])
    assert_close(results["triton"][0], results["torch"][0], torch.float32)
    assert_close(results["triton"][1], results["torch"][1], torch.float32)
    for got, want in zip(results["triton"][2], results["torch"][2]):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------ imports


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=300)


# Loads paged_hf/kernels as a package of its own, without paged_hf/__init__ (transformers: slow to import).
_LOAD_KERNELS_ALONE = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('kernels_alone', 'paged_hf/kernels/__init__.py',\n"
    "                                              submodule_search_locations=['paged_hf/kernels'])\n"
    "package = importlib.util.module_from_spec(spec); sys.modules['kernels_alone'] = package\n"
    "spec.loader.exec_module(package)\n"
)
KERNEL_MODULES = ("paged_decode_attention", "paged_prefill_attention", "store_kv", "copy_blocks", "dispatch", "aot",
                  "warmup", "pool_tensors")


def test_kernel_modules_import_no_triton_at_module_level():
    """No kernel module imports triton at import time (only inside functions), so ``import paged_hf`` needs no
    triton and creates no Triton function before ``TRITON_INTERPRET`` may be set."""
    for name in KERNEL_MODULES:
        tree = ast.parse((ROOT / "paged_hf" / "kernels" / f"{name}.py").read_text())
        imported = list(_module_level_imports(tree))
        assert imported and not [m for m in imported if m.split(".")[0] == "triton"], (name, imported)


def _module_level_imports(tree):
    """Modules imported by statements that run at import time (not inside functions or classes)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or ""
        else:
            stack.extend(ast.iter_child_nodes(node))


@pytest.mark.skipif(CUDA, reason="checks the CPU interpreter")
def test_kernel_modules_without_triton_then_interpreter_after_triton_import():
    """In a fresh process: (1) with triton unimportable the kernel modules import, the dispatch picks the
    references and they run; (2) then triton is imported (compiled mode: its own ``tl.max``, ``tl.sum``... are
    created for the GPU, as when ``import paged_hf`` imports triton through transformers before a test sets
    TRITON_INTERPRET) and TRITON_INTERPRET is set before the first launch: the kernels run in the interpreter."""
    code = _LOAD_KERNELS_ALONE.replace("import importlib.util, sys", "import importlib.util, os, sys") + (
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "from kernels_alone import dispatch, store_kv, copy_blocks, paged_prefill_attention\n"
        "from kernels_alone import paged_decode_attention as decode\n"
        "assert not dispatch.triton_available() and not dispatch.use_triton('cpu')\n"
        "from kernels_alone.pool_tensors import PoolTensors\n"
        "k, v = torch.zeros(4, 8, 1, 64), torch.zeros(4, 8, 1, 64)\n"
        "kernels = dispatch.select('cpu')\n"
        "kernels.store(torch.randn(32, 1, 64), torch.randn(32, 1, 64), torch.arange(32), PoolTensors(k, v))\n"
        "kernels.copy(torch.tensor([0]), torch.tensor([1]), [k.clone(), v.clone()])\n"
        "q, t, n = torch.randn(2, 2, 64), torch.tensor([[0, 1], [2, 3]]), torch.tensor([9, 16])\n"
        "ref = kernels.decode_attention(q, PoolTensors(k, v), t, n, 0.125)\n"
        "assert 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "assert decode._kernels.cache_info().currsize == 0  # nothing decorated\n"
        "del sys.modules['triton']\n"
        "import triton\n"
        "assert 'TRITON_INTERPRET' not in os.environ\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "k2, v2 = torch.zeros_like(k), torch.zeros_like(v)\n"
        "store_kv.store_kv(torch.randn(32, 1, 64), torch.randn(32, 1, 64), torch.arange(32), PoolTensors(k2, v2))\n"
        "out = decode.paged_decode_attention(q, PoolTensors(k, v), t, n, 0.125, partition_size=64)\n"
        "torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)\n"
        "print('ok')\n"
    )
    result = _python(code, {"PAGED_HF_KERNELS": None, "TRITON_INTERPRET": None})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@slow
def test_import_paged_hf_without_triton():
    """With triton unimportable, ``import paged_hf`` works and the dispatch falls back to the references."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import paged_hf, torch\n"
        "from paged_hf.kernels import dispatch\n"
        "assert not dispatch.triton_available() and not dispatch.use_triton('cpu')\n"
        "print('ok')\n"
    )
    result = _python(code, {"PAGED_HF_KERNELS": None})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@slow
@pytest.mark.skipif(CUDA, reason="checks the CPU interpreter")
def test_interpreter_enabled_after_paged_hf_import():
    """TRITON_INTERPRET set after ``import paged_hf`` (which imports triton) but before the first launch."""
    code = (
        "import os, sys, torch\n"
        "import paged_hf\n"
        "from paged_hf.kernels import paged_decode_attention as decode\n"
        "assert 'triton' in sys.modules and 'TRITON_INTERPRET' not in os.environ\n"
        "assert decode._kernels.cache_info().currsize == 0\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "k, v = torch.randn(4, 8, 1, 64), torch.randn(4, 8, 1, 64)\n"
        "q, t, n = torch.randn(2, 2, 64), torch.tensor([[0, 1], [2, 3]]), torch.tensor([9, 16])\n"
        "from paged_hf.kernels.pool_tensors import PoolTensors\n"
        "out = decode.paged_decode_attention(q, PoolTensors(k, v), t, n, 0.125)\n"
        "ref = decode.paged_decode_attention_ref(q, PoolTensors(k, v), t, n, 0.125)\n"
        "torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)\n"
        "print('ok')\n"
    )
    result = _python(code, {"TRITON_INTERPRET": None})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
