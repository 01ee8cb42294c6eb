"""The C++ CPU prefill (``kernels/cpu_ext``, ``csrc/paged_prefill.cpp``) against the float32 oracle, over random
steps (hypothesis): chunks that start a sequence and chunks after stored keys, empty chunks, one-token chunks,
GQA groups, block sizes, head dims, sinks, sliding windows, softcaps, int32 and int64 tables, float32 and bfloat16
(its own flash where the CPU has the products, across several key tiles); plus where the production path takes it
(and where it keeps the torch path), and an engine's greedy tokens with it equal to the torch path's."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from paged_hf.kernels import cpu_attention, cpu_ext
from paged_hf.kernels.cpu_attention import paged_prefill_attention_cpu
from paged_hf.kernels.paged_prefill_attention import paged_prefill_attention_ref
from paged_hf.kernels.pool_tensors import PoolTensors
from kernel_target import cpu_flags, target_defines
from pools import random_block_tables, random_pools

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the torch path serves the CPU prefill (tested elsewhere)")


@pytest.fixture(scope="module")
def kernel():
    op = cpu_ext.prefill_kernel()
    assert op is not None, "a C++ compiler is here, so the kernel must build (see the paged_hf log)"
    return op


@st.composite
def prefill_cases(draw):
    num_chunks = draw(st.integers(1, 5))
    # (stored keys before the chunk, the chunk's queries): first chunks, later chunks, empty and one-token chunks
    # (300, 520: past the own flash's first 256-key tiles; 100, 200: chunks of several work items, which take
    # 96 or 192 / group query positions)
    chunks = [(draw(st.sampled_from([0, 0, 1, 5, 16, 37, 300, 520])),
               draw(st.one_of(st.integers(0, 40), st.sampled_from([100, 200]))))
              for _ in range(num_chunks)]
    if all(n == 0 for _, n in chunks):
        chunks[0] = (chunks[0][0], 1)
    return dict(chunks=chunks, num_kv_heads=draw(st.integers(1, 3)), group=draw(st.sampled_from([1, 2, 3])),
                head_dim=draw(st.sampled_from([8, 16, 48, 64])), block_size=draw(st.sampled_from([1, 4, 16])),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), sinks=draw(st.booleans()),
                # windows of one key, inside a chunk, across chunks and key tiles, and wider than every sequence
                window=draw(st.sampled_from([None, None, 1, 3, 30, 257, 600])),
                softcap=draw(st.sampled_from([None, None, 0.5, 5.0])),
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])), seed=draw(st.integers(0, 2**16)))


def _step(case):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, bs = case["dtype"], case["block_size"]
    lengths = [max(ctx + n, 1) for ctx, n in case["chunks"]]
    num_blocks = sum(-(-n // bs) for n in lengths) + 2
    pools = PoolTensors(**random_pools("auto", num_blocks, bs, case["num_kv_heads"], case["head_dim"], dtype=dtype,
                                       seed=case["seed"], key_offset=1.0))
    tables = random_block_tables(lengths, bs, num_blocks, gen, spare_columns=1).to(case["index_dtype"])
    counts = [n if ctx + n > 0 else 0 for ctx, n in case["chunks"]]
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=case["index_dtype"])
    heads = case["num_kv_heads"] * case["group"]
    query = torch.randn(int(cu[-1]), heads, case["head_dim"], generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen).to(dtype) if case["sinks"] else None
    return query, pools, tables, torch.tensor(lengths, dtype=case["index_dtype"]), cu, sinks


@settings(max_examples=60, deadline=None)
@given(case=prefill_cases())
def test_kernel_matches_the_oracle(kernel, case):
    query, pools, tables, seq_lens, cu, sinks = _step(case)
    window, softcap = case["window"], case["softcap"]
    want = paged_prefill_attention_ref(query, pools, tables.long(), seq_lens.long(), cu.long(), 0.3,
                                       sliding_window=window, softcap=softcap, sinks=sinks)
    # bfloat16: the output's rounding, and the two partial outputs' (chunks after stored keys) before their merge
    tol = 2e-5 if case["dtype"] == torch.float32 else 2e-2
    for op in (kernel, torch.ops.paged_hf_cpu.paged_prefill_flash):  # the op, and its torch-flash path alone
        got = op(query, pools.key_cache, pools.value_cache, tables, seq_lens, cu, 0.3, sinks, window or 0,
                 softcap or 0.0)
        assert got.dtype == query.dtype and got.shape == query.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 30, 255, 256, 257, 700])
def test_windows_across_key_tiles(kernel, dtype, window):
    """Sliding windows whose first keys fall on either side of the own flash's 256-key tiles: a first chunk of
    600 keys, a chunk of 60 after 500 stored keys (its rows' windows start in one tile and end in the next) and
    one of 3 after 1,000; both paths of the op against the oracle."""
    gen = torch.Generator().manual_seed(window)
    lengths, counts = [600, 560, 1003], [600, 60, 3]
    pools = PoolTensors(**random_pools("auto", 160, 16, 2, 64, dtype=dtype, seed=window, key_offset=1.0))
    tables, seq_lens = random_block_tables(lengths, 16, 160, gen), torch.tensor(lengths)
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    query = torch.randn(sum(counts), 4, 64, generator=gen).to(dtype)
    want = paged_prefill_attention_ref(query, pools, tables, seq_lens, cu, 0.125, sliding_window=window).float()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for op in (kernel, torch.ops.paged_hf_cpu.paged_prefill_flash):
        got = op(query, pools.key_cache, pools.value_cache, tables, seq_lens, cu, 0.125, None, window).float()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("growth", [0.002, 0.05])
def test_later_key_tiles_that_outscore_the_first(kernel, dtype, growth):
    """Keys whose scores grow along the sequence, so a row's maximum rises from one 256-key tile to the next: by
    less than the kernel's lazy threshold (its probabilities then exceed 1, nothing is rescaled) or by far more (the
    row's sum and output are rescaled). Both equal the oracle, for a first chunk and for a chunk after stored keys."""
    gen = torch.Generator().manual_seed(3)
    lengths, counts = [700, 600], [700, 80]
    pools = PoolTensors(**random_pools("auto", 96, 16, 2, 64, dtype=dtype, seed=3, key_offset=0.0))
    tables = random_block_tables(lengths, 16, 96, gen)
    query = (torch.rand(sum(counts), 4, 64, generator=gen) + 0.5).to(dtype)
    for s, length in enumerate(lengths):
        for t in range(length):  # key t of sequence s: positive, times 1 + growth * t
            row = pools.key_cache[int(tables[s, t // 16]), t % 16]
            row.copy_((row.float().abs() + 0.5) * (1 + growth * t))
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    seq_lens = torch.tensor(lengths)
    want = paged_prefill_attention_ref(query, pools, tables, seq_lens, cu, 0.02)
    got = kernel(query, pools.key_cache, pools.value_cache, tables, seq_lens, cu, 0.02, None)
    # float32: the oracle's own rounding moves by 2.7e-5 between torch 2.8 and 2.13 at growth 0.05
    tol = 3e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_own_flash_serves_where_the_cpu_has_its_products(kernel):
    """The kernel's own flash attention serves head dims a multiple of 16 where it has products: float32 where the
    library targets AVX-512 (oneDNN's brgemm) or AVX2 with FMA (the AVX2 linear's panels), bfloat16 there too
    (widened to float32 products) and wherever oneDNN has AMX; the rest keeps torch's flash kernel (both checked
    against the oracle above)."""
    pools = random_pools("auto", 4, 4, 2, 64, dtype=torch.bfloat16)
    query = torch.randn(3, 4, 64).bfloat16()
    uses = torch.ops.paged_hf_cpu.prefill_uses_own_flash
    defines = target_defines()
    float32_products = "__AVX512F__" in defines or ("__AVX2__" in defines and "__FMA__" in defines)
    assert not uses(query[..., :8], pools["key_cache"][..., :8].contiguous())
    assert uses(query, pools["key_cache"]) == ("amx_bf16" in cpu_flags() or float32_products)
    assert uses(query.float(), pools["key_cache"].float()) == float32_products


def test_kernel_refuses_what_it_cannot_read(kernel):
    pools = random_pools("auto", 4, 4, 2, 16)
    tables, lens, cu = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3]), torch.tensor([0, 3])
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(torch.randn(3, 4, 16).bfloat16(), pools["key_cache"], pools["value_cache"], tables, lens, cu, 1.0, None)
    with pytest.raises(RuntimeError, match="only 2 keys"):
        kernel(torch.randn(3, 4, 16), pools["key_cache"], pools["value_cache"], tables, torch.tensor([2]), cu, 1.0,
               None)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        kernel(torch.randn(3, 4, 16), pools["key_cache"], pools["value_cache"], tables, torch.tensor([9]), cu, 1.0,
               None)


@pytest.mark.parametrize(("kv_format", "window", "softcap", "used"), [
    ("auto", None, None, True), ("auto", 64, None, True), ("auto", 8, None, True), ("auto", None, 20.0, True),
    ("int8", None, None, False)])
def test_production_prefill_takes_it_where_it_applies(kernel, monkeypatch, kv_format, window, softcap, used):
    """Unquantized pools (with a window shorter than a sequence, with a softcap): the kernel; else the torch
    path."""
    calls = []
    monkeypatch.setattr(cpu_attention, "prefill_kernel", lambda: (lambda *a: calls.append(1) or kernel(*a)))
    gen = torch.Generator().manual_seed(0)
    pools = PoolTensors(**random_pools(kv_format, 8, 4, 2, 16))
    tables = random_block_tables([5, 9], 4, 8, gen)
    paged_prefill_attention_cpu(torch.randn(6, 4, 16), pools, tables, torch.tensor([5, 9]), torch.tensor([0, 2, 6]),
                                0.25, sliding_window=window, softcap=softcap)
    assert bool(calls) is used


def test_bfloat16_error_is_the_torch_paths(kernel, monkeypatch):
    """bfloat16 against the float32 oracle: a chunk after stored keys merges two bfloat16 partial outputs, so its
    rounding is not the torch path's; its error stays that of the torch path (largest: one ulp; mean: within
    1.5x). Greedy tokens of a bfloat16 model may then fork where two logits tie to bfloat16 rounding."""
    gen = torch.Generator().manual_seed(0)
    lengths, counts = [300, 77, 150], [100, 77, 64]
    pools = PoolTensors(**random_pools("auto", 64, 16, 3, 64, dtype=torch.bfloat16, seed=1, key_offset=1.0))
    tables, seq_lens = random_block_tables(lengths, 16, 64, gen), torch.tensor(lengths)
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    query = torch.randn(sum(counts), 9, 64, generator=gen).bfloat16()
    want = paged_prefill_attention_ref(query, pools, tables, seq_lens, cu, 0.125).float()
    got = kernel(query, pools.key_cache, pools.value_cache, tables, seq_lens, cu, 0.125, None).float()
    monkeypatch.setattr(cpu_attention, "prefill_kernel", lambda: None)
    torch_path = paged_prefill_attention_cpu(query, pools, tables, seq_lens, cu, 0.125).float()
    assert (got - want).abs().max() <= max((torch_path - want).abs().max(), 2**-7)
    assert (got - want).abs().mean() <= 1.5 * (torch_path - want).abs().mean()


def test_engine_tokens_equal_the_torch_path(monkeypatch):
    """stories260K through the engine in float32, eager, greedy, chunks of 7 (so most chunks follow stored keys):
    the kernel's tokens equal those of the torch prefill path."""
    from models import stories_model, stories_tokenizer  # noqa: PLC0415
    from paged_hf import PagedEngine, SamplingParams  # noqa: PLC0415

    model, tokenizer = stories_model(), stories_tokenizer()
    prompts = ["Once upon a time there was a little girl named Lily who", "The little dog ran to the park and saw",
               "Lily had a red ball and"]
    params = SamplingParams(max_tokens=16, temperature=0.0)

    def run():
        engine = PagedEngine(model, tokenizer, block_size=4, enforce_eager=True, max_num_batched_tokens=7)
        return [out.outputs[0].token_ids for out in engine.generate(prompts, params)]

    with_kernel = run()
    monkeypatch.setattr(cpu_attention, "prefill_kernel", lambda: None)
    assert run() == with_kernel
