"""The production CPU attention (``kernels.cpu_attention``) equals the float32 oracle (``paged_*_attention_ref``) over a
grid: every kv format x float32/bfloat16 x decode/prefill/mixed chunks x plain/sliding window/softcap/sinks, GQA,
int4's tail rows and fresh K/V, sequences split into groups; and dispatch picks it on CPU unless the oracle is
forced. float32 agrees to 1e-5; bfloat16 (computed in bfloat16 here, float32 in the oracle) to bfloat16 rounding."""

from __future__ import annotations

import pytest
import torch

from paged_hf.kernels import cpu_attention, dispatch
from paged_hf.kernels.cpu_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu
from paged_hf.kernels.kv_format import kv_format as get_format
from paged_hf.kernels.paged_decode_attention import paged_decode_attention_ref
from paged_hf.kernels.paged_prefill_attention import paged_prefill_attention_ref
from pools import kernel_args, random_block_tables, random_pools

FORMATS = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4")
DTYPES = (torch.float32, torch.bfloat16)
FEATURES = {"plain": {}, "window": {"sliding_window": 11}, "softcap": {"softcap": 4.0}, "sinks": {"sinks": True},
            "window+sinks": {"sliding_window": 6, "sinks": True}}
BLOCK_SIZE, NUM_KV_HEADS, GROUP, HEAD_DIM = 8, 2, 3, 16
# context lengths: one token, a full block, a block and one, several blocks; prefill chunk lengths per mode
DECODE_LENGTHS = (1, 8, 9, 30, 47)
PREFILL_CHUNKS = {"prefill": ((13, 13), (40, 17), (9, 8), (64, 24)),  # (seq_len, chunk): first chunks and later ones
                  "mixed": ((30, 1), (5, 0), (47, 12), (16, 1), (23, 8), (8, 8)),  # decode-like rows, an empty one
                  "equal": ((20, 8), (33, 8), (8, 8)),  # chunks of one length: the packed rows are the padded ones
                  # every chunk its sequence's first (the causal plan, no mask), and so short no window cuts them
                  "first": ((13, 13), (9, 9), (30, 30), (1, 1)), "first_short": ((5, 5), (6, 6), (3, 3))}


def assert_matches_oracle(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _pools(kv_format, dtype, lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lengths) + 3
    pools = random_pools(kv_format, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, seed=seed,
                         num_rows=len(lengths) + 2, key_offset=2.0)
    if get_format(kv_format).tail:  # tail rows not in sequence order
        pools["tail_rows"] = torch.randperm(len(lengths) + 2, generator=gen)[: len(lengths)]
    return pools, random_block_tables(lengths, BLOCK_SIZE, num_blocks, gen, spare_columns=2), gen


def _options(feature, dtype, gen):
    options = dict(FEATURES[feature], scale=0.3)
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(NUM_KV_HEADS * GROUP, generator=gen).to(dtype)
    return options


def _fresh(pools, rows, dtype, gen):
    if "tail_rows" not in pools:
        return {}
    return {f"fresh_{which}": torch.randn(rows, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            for which in ("key", "value")}


@pytest.fixture(params=["in_place", "torch"])
def decode_path(request, monkeypatch):
    """Decode through the C++ kernel that reads the pools in place (where it serves the call) or the torch path."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_attention, "decode_kernel", lambda: None)
    elif cpu_attention.decode_kernel() is None:
        pytest.skip("the C++ decode kernel cannot be built here")
    return request.param


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_decode_matches_oracle(kv_format, dtype, feature, decode_path):
    if decode_path == "in_place" and kv_format != "auto":
        pytest.skip("the in-place kernel serves the unquantized pools only (the torch path is the other case)")
    pools, tables, gen = _pools(kv_format, dtype, DECODE_LENGTHS, seed=1)
    query = torch.randn(len(DECODE_LENGTHS), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    operands = dict(block_tables=tables, seq_lens=torch.tensor(DECODE_LENGTHS), **kernel_args(pools), **_fresh(pools,
                    len(
        DECODE_LENGTHS), dtype, gen), **_options(feature, dtype, gen))
    assert_matches_oracle(paged_decode_attention_cpu(query, **operands), paged_decode_attention_ref(query, **operands),
                          dtype)


@pytest.mark.parametrize("mode", PREFILL_CHUNKS)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_prefill_matches_oracle(kv_format, dtype, feature, mode):
    lengths, chunks = zip(*PREFILL_CHUNKS[mode])
    pools, tables, gen = _pools(kv_format, dtype, lengths, seed=2)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()])
    query = torch.randn(int(cu[-1]), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    operands = dict(block_tables=tables, seq_lens=torch.tensor(lengths), cu_query_lens=cu, **kernel_args(pools),
                    **_fresh(pools, int(cu[-1]), dtype, gen), **_options(feature, dtype, gen))
    assert_matches_oracle(paged_prefill_attention_cpu(query, **operands),
                          paged_prefill_attention_ref(query, **operands), dtype)


def test_grouped_heads_are_repeated_where_torch_flash_lacks_them(monkeypatch):
    """torch 2.6 to 2.8's CPU flash attention return garbage for fewer KV heads than query heads: the torch path
    then repeats the KV heads. Here that path runs on this torch and still equals the oracle, and the probe that
    chooses it agrees with the C++ prefill's own."""
    lengths, chunks = zip(*PREFILL_CHUNKS["prefill"])
    pools, tables, gen = _pools("auto", torch.float32, lengths, seed=5)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()])
    query = torch.randn(int(cu[-1]), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    operands = dict(block_tables=tables, seq_lens=torch.tensor(lengths), cu_query_lens=cu, **kernel_args(pools),
                    scale=0.3)
    monkeypatch.setattr(cpu_attention, "prefill_kernel", lambda: None)
    monkeypatch.setattr(cpu_attention, "_flash_groups_heads", lambda: False)
    assert_matches_oracle(paged_prefill_attention_cpu(query, **operands),
                          paged_prefill_attention_ref(query, **operands), torch.float32)
    monkeypatch.undo()
    if cpu_attention.prefill_kernel() is not None:
        assert torch.ops.paged_hf_cpu.flash_groups_heads() == cpu_attention._flash_groups_heads()
    assert cpu_attention._flash_groups_heads() == (tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 9))


@pytest.mark.parametrize("kv_format", ["auto", "int4"])
def test_groups_of_sequences_equal_one_call(kv_format, monkeypatch):
    """A batch past the gather bound goes in groups of sequences: the same rows as one call, decode and prefill
    (the torch path: the in-place kernel gathers nothing)."""
    monkeypatch.setattr(cpu_attention, "decode_kernel", lambda: None)
    lengths, chunks = (30, 9, 47, 16, 1), (5, 9, 12, 1, 1)
    pools, tables, gen = _pools(kv_format, torch.float32, lengths, seed=3)
    query = torch.randn(len(lengths), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()])
    prefill_query = torch.randn(int(cu[-1]), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    decode_ops = dict(block_tables=tables, seq_lens=torch.tensor(lengths), scale=0.3, sliding_window=20,
                      **kernel_args(pools),
                      **_fresh(pools, len(lengths), torch.float32, gen))
    prefill_ops = dict(decode_ops, cu_query_lens=cu, **_fresh(pools, int(cu[-1]), torch.float32, gen))
    whole = (paged_decode_attention_cpu(query, **decode_ops), paged_prefill_attention_cpu(prefill_query, **prefill_ops))
    calls = []
    real = cpu_attention._decode
    monkeypatch.setattr(cpu_attention, "_decode", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(cpu_attention, "GATHER_ELEMENTS_PER_CHUNK", 1)  # one sequence per group
    grouped = (paged_decode_attention_cpu(query, **decode_ops),
               paged_prefill_attention_cpu(prefill_query, **prefill_ops))
    assert calls == [1] * len(lengths)
    for got, want in zip(grouped, whole):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grouped[0], paged_decode_attention_ref(query, **decode_ops), atol=1e-5, rtol=1e-5)


def test_bfloat16_pool_is_never_upcast(monkeypatch):
    """A bfloat16 pool is gathered and attended in bfloat16 on the torch path: no float32 tensor as large as the
    gathered K/V (the in-place kernel reads the pool as it is and gathers nothing)."""
    monkeypatch.setattr(cpu_attention, "decode_kernel", lambda: None)
    lengths = (64, 64)
    pools, tables, gen = _pools("auto", torch.bfloat16, lengths, seed=4)
    query = torch.randn(2, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(torch.bfloat16)
    seen = []
    real_flash = cpu_attention._flash
    monkeypatch.setattr(cpu_attention, "_flash", lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype))
                        or real_flash(q, k, v, **kw))
    paged_decode_attention_cpu(query, block_tables=tables, seq_lens=torch.tensor(lengths), scale=0.3,
                               **kernel_args(pools))
    assert seen == [(torch.bfloat16,) * 3]


def test_dispatch_picks_the_production_path_on_cpu_and_the_oracle_when_forced(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    kernels = dispatch.select("cpu")
    assert kernels.decode_attention is paged_decode_attention_cpu
    assert kernels.prefill_attention is paged_prefill_attention_cpu
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert dispatch.select("cpu").decode_attention is paged_decode_attention_cpu
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    kernels = dispatch.select("cpu")
    assert kernels.decode_attention is paged_decode_attention_ref
    assert kernels.prefill_attention is paged_prefill_attention_ref
    assert kernels.triton is False
