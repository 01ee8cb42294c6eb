"""The C++ CPU decode kernel (``kernels/cpu_ext``, ``csrc/paged_decode.cpp``) against the float32 oracle, over random
shapes (hypothesis): sequence and block counts, GQA groups, head dims that are and are not whole vectors, windows,
softcap, sinks, int32 and int64 tables and lengths, float32 and bfloat16, and a non-contiguous query; plus where the
production path uses it, the switch that turns it off, and an engine's greedy tokens with it equal to the torch
path's."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from paged_hf.kernels import cpu_attention, cpu_ext
from paged_hf.kernels.cpu_attention import paged_decode_attention_cpu
from paged_hf.kernels.paged_decode_attention import paged_decode_attention_ref
from paged_hf.kernels.pool_tensors import PoolTensors
from pools import random_block_tables, random_pools

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the torch path serves the CPU decode (tested elsewhere)")


@pytest.fixture(scope="module")
def kernel():
    op = cpu_ext.decode_kernel()
    assert op is not None, "a C++ compiler is here, so the kernel must build (see the paged_hf log)"
    return op


@st.composite
def decode_cases(draw):
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 8]))
    head_dim = draw(st.sampled_from([8, 16, 24, 32, 64, 80, 128, 256]))
    block_size = draw(st.sampled_from([1, 4, 16]))
    lengths = draw(st.lists(st.integers(1, 70), min_size=1, max_size=6))
    feature = dict(
        window=draw(st.one_of(st.none(), st.integers(1, 40))),
        softcap=draw(st.one_of(st.none(), st.floats(1.0, 30.0))),
        sinks=draw(st.booleans()),
    )
    return dict(num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size, lengths=lengths,
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])), seed=draw(st.integers(0, 2**16)),
                strided_query=draw(st.booleans()), **feature)


@settings(max_examples=60, deadline=None)
@given(case=decode_cases())
def test_kernel_matches_the_oracle(kernel, case):
    matches_the_oracle(kernel, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [256, 512])
def test_wide_head_dims_match_the_oracle(kernel, head_dim, group, dtype):
    """Gemma 2 and 3's head dim and Gemma 4's full layers', whose per-head kernels (vectors spilled to L1) the drawn
    cases never reach: every group size, one and two KV heads, a window and a softcap, lengths across several
    blocks."""
    for num_kv_heads, window, softcap in ((1, None, None), (2, 40, 30.0)):
        matches_the_oracle(kernel, dict(num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=16,
                                        lengths=[1, 17, 70, 300], window=window, softcap=softcap, sinks=False,
                                        dtype=dtype, index_dtype=torch.int32, seed=group, strided_query=False))


def matches_the_oracle(kernel, case) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, lengths, bs = case["dtype"], case["lengths"], case["block_size"]
    heads = case["num_kv_heads"] * case["group"]
    num_blocks = sum(-(-n // bs) for n in lengths) + 2
    pools = PoolTensors(**random_pools("auto", num_blocks, bs, case["num_kv_heads"], case["head_dim"], dtype=dtype,
                                       seed=case["seed"], key_offset=1.0))
    tables = random_block_tables(lengths, bs, num_blocks, gen, spare_columns=2).to(case["index_dtype"])
    seq_lens = torch.tensor(lengths, dtype=case["index_dtype"])
    query = torch.randn(len(lengths), heads, case["head_dim"] * (2 if case["strided_query"] else 1),
                        generator=gen).to(dtype)
    if case["strided_query"]:  # rows and heads strided, the last dimension contiguous (the kernel's contract)
        query = query[..., : case["head_dim"]]
    sinks = torch.randn(heads, generator=gen).to(dtype) if case["sinks"] else None
    got = kernel(query, pools.key_cache, pools.value_cache, tables, seq_lens, 0.4, case["window"] or 0,
                 case["softcap"] or 0.0, sinks)
    want = paged_decode_attention_ref(query, pools, tables.long(), seq_lens.long(), 0.4,
                                      sliding_window=case["window"], softcap=case["softcap"], sinks=sinks)
    # bfloat16: both outputs are float32 sums rounded once, so they differ by at most one ulp (2^-8 to 2^-7
    # relative), and by float32's own error where a sum cancels to near zero
    atol, rtol = (2e-5, 2e-5) if dtype == torch.float32 else (1e-4, 2**-7)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="reads the x86-64 library's code with objdump")
def test_the_block_prefetch_reaches_the_binary(kernel):
    """The decode requests each block's rows before it reads them (``prefetch_block``): the outputs are the same
    without, only slower (25% of the kernel's rate at 30 layers of bf16 K/V), so only the code can show it. GCC 12
    took a function whose only effect is ``__builtin_prefetch`` calls for pure and deleted every call; no
    ``prefetcht0`` was left in the library."""
    library = next(path for path in torch.ops.loaded_libraries if path.endswith("paged_hf_cpu.so"))
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library], capture_output=True, text=True,
                          check=True).stdout
    assert "prefetcht0" in code


# The first AMX products of a fresh process, before oneDNN ran any (oneDNN's loads its own tile configuration, which
# hid a kernel's own configuration going wrong: in the engine its linears always run first).
FRESH_PROCESS = """
import torch
from paged_hf.kernels import cpu_ext
assert cpu_ext.loaded()
torch.manual_seed(0)
torch.set_num_threads(2)
keys, values = (torch.randn(16, 16, 3, 64).bfloat16() for _ in range(2))
for seqs in (1, 8):
    query = torch.randn(seqs, 9, 64).bfloat16()
    tables = torch.arange(seqs * 2, dtype=torch.int32).view(seqs, 2)
    out = torch.ops.paged_hf_cpu.paged_decode(query, keys, values, tables, torch.full((seqs,), 30), 0.125, 0, 0.0,
                                              None)
    assert torch.isfinite(out.float()).all()
print("ok")
"""


def test_bfloat16_decode_runs_in_a_process_where_nothing_else_used_amx(kernel):
    """The bfloat16 decode's AMX scores configure the tiles themselves. GCC 12 does not see ``_tile_loadconfig``
    read its operand: inlined, the stores of the tiles' rows and widths before it were dropped, and the first
    decode of a process that had run no oneDNN product died of an illegal instruction (``amx.h`` loads the
    configuration by an asm statement)."""
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_kernel_refuses_what_it_cannot_read(kernel):
    pools = random_pools("auto", 4, 4, 2, 16)
    query = torch.randn(1, 4, 16)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3])
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(query.bfloat16(), pools["key_cache"], pools["value_cache"], tables, lens, 1.0, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernel(torch.randn(1, 3, 16), pools["key_cache"], pools["value_cache"], tables, lens, 1.0, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(query.double(), pools["key_cache"].double(), pools["value_cache"].double(), tables, lens, 1.0, 0,
               0.0, None)


def test_production_decode_uses_the_kernel_for_unquantized_pools_only(kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_attention, "decode_kernel", lambda: (lambda *a: calls.append(1) or kernel(*a)))
    gen = torch.Generator().manual_seed(0)
    for kv_format, used in (("auto", True), ("int8", False)):
        calls.clear()
        pools = PoolTensors(**random_pools(kv_format, 8, 4, 2, 16))
        tables = random_block_tables([5, 9], 4, 8, gen)
        paged_decode_attention_cpu(torch.randn(2, 4, 16), pools, tables, torch.tensor([5, 9]), 0.25)
        assert bool(calls) is used, kv_format


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(cpu_ext.ENV_VAR, "0")
    assert cpu_ext._load() is False


# bfloat16 rounding of 17-magnitude logits is ~0.06 a logit, and it compounds over the layers and the fed-back tokens
BF16_TIE = 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_engine_tokens_equal_the_torch_path(dtype, monkeypatch):
    """stories260K through the engine, eager, greedy: the kernel's tokens equal those of the torch decode path.
    float32: identical logits to float rounding, the same tokens. bfloat16: the two paths round their sums apart
    (on an AVX2 CPU, with no bfloat16 dot products, this prompt set forks at token 16), so a greedy path may fork,
    but only where the kernel's own top two tokens are within ``BF16_TIE`` nats of each other."""
    from models import stories_model, stories_tokenizer  # noqa: PLC0415
    from paged_hf import PagedEngine, SamplingParams  # noqa: PLC0415

    model, tokenizer = stories_model().to(dtype), stories_tokenizer()
    prompts = ["Once upon a time", "The little dog", "Lily had a red ball and"]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)

    def run():
        engine = PagedEngine(model, tokenizer, block_size=4, enforce_eager=True)
        return [out.outputs[0] for out in engine.generate(prompts, params)]

    with_kernel = run()
    monkeypatch.setattr(cpu_attention, "decode_kernel", lambda: None)
    torch_path = run()
    for kernel_out, torch_out in zip(with_kernel, torch_path):
        if dtype == torch.float32:
            assert kernel_out.token_ids == torch_out.token_ids
            continue
        fork = next((i for i, (a, b) in enumerate(zip(kernel_out.token_ids, torch_out.token_ids)) if a != b), None)
        if fork is not None:
            top = sorted((getattr(v, "logprob", v) for v in kernel_out.logprobs[fork].values()), reverse=True)
            assert top[0] - top[1] < BF16_TIE, (fork, top)
