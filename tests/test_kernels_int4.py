"""The int4 paths of the Triton kernels against their torch references (triton's CPU interpreter without CUDA, set
up as in ``test_kernels.py``).

- Store: the block fill (keys per channel over a block on its grid, values per token with a scale code on the
  block's maximum, from the tail row and the new K/V) and the tail writes, byte for byte, for sequences written in
  random chunks; block sizes 2..128, head_dim 16..256, 1..3 KV heads, the compute dtype float32 / bfloat16 /
  float16 (new values rounded to it first), rounding ties and ties between value scale codes.
- Attention: decode and prefill read quantized blocks (keys dequantized from their channel ranges, values scaled by
  their scale codes) before each query's own block, and its own block exact from the tail row and the new K/V, in
  one pass, for tiles inside one block (``block_size >= BLOCK_N``) and tiles spanning blocks, with windows, softcap,
  sinks, partitions, prefill chunks across blocks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from triton_kernels import require_triton_kernels

CUDA = require_triton_kernels()  # before the kernel imports below

from paged_hf.kernels.fill_blocks import StorePlan  # noqa: E402
from paged_hf.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from paged_hf.kernels.paged_prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from paged_hf.kernels.store_kv import store_kv, store_kv_ref, store_tails, store_tails_ref  # noqa: E402
from paged_hf.quant import make_storage  # noqa: E402
from pools import kernel_args, random_block_tables, random_pools  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def plan_for(start: int, count: int, row: int, blocks: torch.Tensor, block_size: int) -> tuple:
    """(slots, StorePlan) of a forward adding ``count`` tokens to a sequence that held ``start`` (its ``blocks``)."""
    end = start + count
    positions = torch.arange(start, end)
    tail_slots = torch.where(positions >= end // block_size * block_size, row * block_size + positions % block_size,
                             -1)
    filled = torch.arange(start // block_size, end // block_size)
    plan = StorePlan(*(t.to(DEVICE) for t in (tail_slots, blocks[filled], torch.full_like(filled, row),
                                             filled * block_size - start, (start - filled * block_size).clamp_min(0))))
    slots = (blocks[positions // block_size] * block_size + positions % block_size).to(DEVICE)
    return slots, plan


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else
                                                                    torch.int32)


def assert_same_pools(kernel, ref):
    for name in [*kernel.tensors(), *kernel.tail_tensors()]:
        got, want = getattr(kernel, name), getattr(ref, name)
        if name == "key_zero":  # +0.0 and -0.0 are the same grid base (see below)
            assert torch.equal(got, want), name
        else:
            assert torch.equal(_bytes(got), _bytes(want)), f"{name} differs in {int((got != want).sum())} places"


# (block_size, head_dim, num_kv_heads, compute dtype)
STORE_CASES = [(4, 16, 2, torch.float32), (16, 64, 2, torch.float32), (8, 128, 1, torch.bfloat16),
               (64, 64, 3, torch.float16), (128, 256, 1, torch.bfloat16), (32, 128, 2, torch.float16),
               (2, 32, 1, torch.float32), (16, 128, 3, torch.bfloat16)]


@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,dtype", STORE_CASES, ids=str)
def test_fill_and_tail_writes_match_ref_bytes(block_size, head_dim, num_kv_heads, dtype):
    """Three sequences written in random chunks (ending mid-block, filling a block from its tail row and new tokens,
    spanning whole blocks) with magnitudes over six decades, a channel bias and an outlier."""
    gen = torch.Generator().manual_seed(block_size * head_dim)
    lengths = [3 * block_size + 5, block_size, 2 * block_size - 1]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 1
    kernel, ref = (make_storage("int4", num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE)
                   for _ in range(2))
    for storage in (kernel, ref):
        storage.ensure_tail_rows(4)
    order = torch.randperm(num_blocks, generator=gen)
    used = 0
    for s, length in enumerate(lengths):
        blocks = order[used : used + -(-length // block_size)]
        used += len(blocks)
        start = 0
        while start < length:
            count = min(length - start, int(torch.randint(1, block_size + 7, (1,), generator=gen)))
            magnitude = 10.0 ** (torch.rand(count, 1, 1, generator=gen) * 6 - 3)
            key = (torch.randn(count, num_kv_heads, head_dim, generator=gen) + 2) * magnitude
            value = torch.randn(count, num_kv_heads, head_dim, generator=gen) * magnitude
            key[0, 0, 1] = 7.0
            slots, plan = plan_for(start, count, s + 1, blocks, block_size)
            key, value = key.to(dtype).to(DEVICE), value.to(dtype).to(DEVICE)  # as QuantizedKVStorage.write
            store_kv(key, value, slots, pools=kernel.pool_tensors(), plan=plan)
            store_kv_ref(key, value, slots, pools=ref.pool_tensors(), plan=plan)
            store_tails(key, value, kernel.pool_tensors(), plan)
            store_tails_ref(key, value, ref.pool_tensors(), plan)
            start += count
    assert_same_pools(kernel, ref)


def test_fill_rounding_ties():
    """Keys and values at and around every rounding tie, and exact ties between value scale codes: codes as torch
    rounds them (round half to even), the smallest of equally good scale codes.

    Keys: the grid is ``base = 0``, ``step = 1`` (a min of 0 and a max of 255), and most channels hold a 0 and a 15
    (``lo = 0``, ``s = 1``), so ``q = round(x)`` at ``x = i + 0.5`` and its float32 neighbours; one channel's range
    ends exactly on grid points (3 and 200: ``floor`` / ``ceil`` of integers). Values: ``vmax = 1`` (a 7), tokens of
    ties at the power-of-two scales ``s_k`` (``k = 0, 3, .., 15``), a token of ones (``k = 0, 3, 6`` all exact: 0
    wins), one of quarters (``k = 6, 9, 12`` exact: 6 wins) and a zero token (every code ties: 0). A zero minimum
    that is -0.0 in one place and +0.0 in another may give either grid base: compared by value."""
    ties = torch.arange(0, 15) + 0.5
    values = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])  # 45 values
    block_size, head_dim = 64, 48
    key = torch.zeros(block_size, 1, head_dim)
    key[1] = 15.0
    key[1, 0, -1] = 255.0
    key[2:47, 0, :] = values[:, None].expand(45, head_dim)
    key[:, 0, -2] = 100.0
    key[0, 0, -2], key[1, 0, -2] = 3.0, 200.0
    value = torch.zeros(block_size, 1, head_dim)
    value[0, 0, 0] = 7.0
    halves = (torch.arange(head_dim) % 14 - 7) + 0.5  # -6.5 .. 6.5
    for i, k in enumerate(range(0, 16, 3)):
        step = 2.0 ** -(k // 3)
        value[1 + 3 * i, 0] = halves * step
        value[2 + 3 * i, 0] = torch.nextafter(halves * step, halves * step + 1)
        value[3 + 3 * i, 0] = torch.nextafter(halves * step, halves * step - 1)
    value[20, 0], value[21, 0] = 1.0, 0.25  # token 22: zeros
    kernel, ref = (make_storage("int4", 2, block_size, 1, head_dim, torch.float32, DEVICE) for _ in range(2))
    for storage in (kernel, ref):
        storage.ensure_tail_rows(1)
    slots, plan = plan_for(0, block_size, 0, torch.tensor([1, 0]), block_size)
    store_kv(key.to(DEVICE), value.to(DEVICE), slots, pools=kernel.pool_tensors(), plan=plan)
    store_kv_ref(key.to(DEVICE), value.to(DEVICE), slots, pools=ref.pool_tensors(), plan=plan)
    assert_same_pools(kernel, ref)
    assert ref.key_zero[1, 0].tolist() == [0.0, 1.0]  # base, step
    assert ref.key_scale[1, 0, :, 0].tolist() == [0, 15] and ref.key_scale[1, 0, :, -2].tolist() == [3, 200]
    assert ref.value_zero[1, 0].item() == 1.0
    value_codes = torch.stack((ref.value_scale[1, 0] & 15, ref.value_scale[1, 0] >> 4), -1).flatten()
    assert value_codes[20:23].tolist() == [0, 6, 0]
    assert len(set(value_codes[1:19].tolist())) >= 5  # the tie tokens take several scales


# ------------------------------------------------------------------------------------------------ attention

# (block_size, head_dim, group, lengths, num_kv_heads, window, softcap, sinks, partition, dtype): block sizes below
# 16 (tiles span blocks: keys dequantized) and from 16 on (a tile inside one block), so both key paths run.
DECODE_CASES = [
    (16, 64, 4, [1, 15, 16, 17, 200], 1, None, None, False, 64, torch.float32),
    (64, 64, 2, [63, 64, 65, 300], 2, None, 20.0, True, 128, torch.float32),
    (128, 128, 8, [130, 5], 1, 100, None, False, None, torch.bfloat16),
    (8, 128, 4, [40, 129], 1, None, None, True, 64, torch.float16),
    (64, 256, 4, [90, 64], 1, 50, None, False, 64, torch.bfloat16),
    (4, 16, 2, [7, 9], 2, None, None, False, None, torch.float32),
]
PREFILL_CASES = [
    (16, 64, 4, [17, 40, 1], [17, 9, 1], 1, None, None, False, torch.float32),
    (64, 64, 2, [130, 64], [70, 64], 2, 30, 25.0, True, torch.float32),
    (128, 128, 4, [200, 9], [100, 9], 1, None, None, True, torch.float16),
    (8, 256, 4, [33, 5], [20, 5], 1, 16, None, False, torch.float16),
    (32, 128, 1, [70, 31], [40, 0], 1, None, None, False, torch.bfloat16),
]


def attention_case(block_size, head_dim, group, lengths, num_kv_heads, dtype, seed=0, query_lens=None):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 2
    pools = random_pools("int4", num_blocks, block_size, num_kv_heads, head_dim, dtype, seed, len(lengths) + 2,
                         DEVICE, key_offset=2.0)
    pools["tail_rows"] = torch.randperm(len(lengths) + 2, generator=gen)[: len(lengths)].to(DEVICE)
    tables = random_block_tables(lengths, block_size, num_blocks, gen)
    num_queries = len(lengths) if query_lens is None else sum(query_lens)
    query = torch.randn(num_queries, num_kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    for which, offset in (("key", 2.0), ("value", 0.0)):  # the queries' own new K/V, packed like them
        pools[f"fresh_{which}"] = (torch.randn(num_queries, num_kv_heads, head_dim, generator=gen)
                                   + offset).to(dtype).to(DEVICE)
    sinks = torch.randn(num_kv_heads * group, generator=gen).to(DEVICE)
    return pools, tables.to(torch.int32).to(DEVICE), query, sinks, torch.tensor(lengths, device=DEVICE)


def assert_close(out, ref, dtype):
    tol = TOLERANCE[dtype] * (3 if CUDA and dtype == torch.float32 else 1)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_reads_blocks_and_tail_like_ref(case):
    bs, d, g, lengths, hkv, window, cap, use_sinks, part, dtype = case
    pools, tables, query, sinks, seq_lens = attention_case(bs, d, g, lengths, hkv, dtype)
    options = dict(scale=d ** -0.5, sliding_window=window, softcap=cap, sinks=sinks if use_sinks else None)
    out = paged_decode_attention(query, block_tables=tables, seq_lens=seq_lens, partition_size=part,
                                 **kernel_args(pools),
                                 **options)
    ref = paged_decode_attention_ref(query, block_tables=tables, seq_lens=seq_lens, **kernel_args(pools), **options)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_prefill_reads_blocks_and_tail_like_ref(case):
    bs, d, g, lengths, qlens, hkv, window, cap, use_sinks, dtype = case
    pools, tables, query, sinks, seq_lens = attention_case(bs, d, g, lengths, hkv, dtype, query_lens=qlens)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], device=DEVICE)
    options = dict(scale=d ** -0.5, sliding_window=window, softcap=cap, sinks=sinks if use_sinks else None)
    out = paged_prefill_attention(query, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu,
                                  **kernel_args(pools), **options)
    ref = paged_prefill_attention_ref(query, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu,
                                      **kernel_args(pools),
                                      **options)
    assert_close(out, ref, dtype)


def write_chunks(storage, chunks, blocks, row, gen, kernels=True):
    """Writes a sequence chunk by chunk into ``storage`` (fill, then tail writes); the last chunk's tail writes are
    left out: returns that chunk's ``(key, value, plan)`` so a test attends in between, as a forward does."""
    start = 0
    for i, count in enumerate(chunks):
        key = (torch.randn(count, 2, storage.head_dim, generator=gen) + 1).to(DEVICE)
        value = torch.randn(count, 2, storage.head_dim, generator=gen).to(DEVICE)
        slots, plan = plan_for(start, count, row, blocks, storage.block_size)
        (store_kv if kernels else store_kv_ref)(key, value, slots, pools=storage.pool_tensors(), plan=plan)
        if i + 1 < len(chunks):
            (store_tails if kernels else store_tails_ref)(key, value, storage.pool_tensors(), plan)
        start += count
    return key, value, plan


@pytest.mark.parametrize("last", [1, 10, 23], ids=["decode", "chunk", "chunk across blocks"])
def test_store_then_attend_roundtrip(last):
    """Pools written by the Triton store (fills and tail writes), read by the Triton decode or prefill between the
    last forward's store and its tail writes: as the references read them; then the tail writes match too."""
    block_size, head_dim = 16, 64
    blocks = torch.tensor([5, 1, 7, 0, 3, 2])
    pools = {}
    for kernels in (True, False):
        storage = make_storage("int4", 8, block_size, 2, head_dim, torch.float32, DEVICE)
        storage.ensure_tail_rows(2)
        key, value, plan = write_chunks(storage, (9, 20, 1, 1, 7, last), blocks, 1, torch.Generator().manual_seed(5),
                                        kernels)
        pools[kernels] = (storage, key, value, plan)
    storage, key, value, plan = pools[True]
    ops = {**storage.pool_tensors()._asdict(), "tail_rows": torch.tensor([1], device=DEVICE), "fresh_key": key,
           "fresh_value": value}
    tables = blocks[None].to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor([38 + last], device=DEVICE)
    gen = torch.Generator().manual_seed(6)
    queries = torch.randn(last, 8, head_dim, generator=gen).to(DEVICE)
    if last == 1:
        out = paged_decode_attention(queries, block_tables=tables, seq_lens=seq_lens, scale=0.125, **kernel_args(ops))
        ref = paged_decode_attention_ref(queries, block_tables=tables, seq_lens=seq_lens, scale=0.125,
                                         **kernel_args(ops))
    else:
        cu = torch.tensor([0, last], device=DEVICE)
        out = paged_prefill_attention(queries, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu,
                                      scale=0.125, **kernel_args(ops))
        ref = paged_prefill_attention_ref(queries, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu,
                                          scale=0.125, **kernel_args(ops))
    assert_close(out, ref, torch.float32)
    for kernels, (storage, key, value, plan) in pools.items():
        (store_tails if kernels else store_tails_ref)(key, value, storage.pool_tensors(), plan)
    assert_same_pools(pools[True][0], pools[False][0])


def test_int4_launches_reject_missing_tail_operands():
    pools, tables, query, _, seq_lens = attention_case(16, 64, 4, [5, 9], 1, torch.float32)
    common = dict(block_tables=tables, seq_lens=seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="tail_rows"):
        paged_decode_attention(query, **common, **kernel_args({**pools, "tail_rows": None}))
    with pytest.raises(ValueError, match="fresh_value"):
        paged_decode_attention(query, **common, **kernel_args({**pools, "fresh_value": None}))
    with pytest.raises(ValueError, match="fresh_key"):
        paged_prefill_attention(query, **common, cu_query_lens=torch.tensor([0, 1, 2], device=DEVICE),
                                **kernel_args({**pools, "fresh_key": pools["fresh_key"][:1]}))
    with pytest.raises(ValueError, match="key_tail"):
        paged_decode_attention(query, **common, **kernel_args({**pools, "key_tail": None}))
    with pytest.raises(ValueError, match="StorePlan"):
        store_kv(query[:, :1], query[:, :1], torch.tensor([0, 1], device=DEVICE), kernel_args(pools)["pools"])
