"""The torch attention core of the paged path: its one-call SDPA path and its chunked online-softmax path both equal
a naive dense oracle (read each sequence's K/V position by position, plain softmax), for every kv format (int4: keys
per channel of a block; each query's own block exact: its older tokens from the tail row, the forward's from the
fresh K/V), GQA, windows and padding queries. The kernels' tests compare Triton against this core, so the core is
checked on its own here."""

from __future__ import annotations

import pytest
import torch

from paged_hf.kernels import attention_ref
from paged_hf.kernels.attention_ref import paged_attention_core
from paged_hf.kernels.kv_format import kv_format as get_format
from pools import dense_kv, kernel_args, random_block_tables, random_pools

FORMATS = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4")


def _case(kv_format, block_size=8, num_kv_heads=2, group=3, head_dim=16, lengths=(1, 9, 30), queries=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 2
    pools = random_pools(kv_format, num_blocks, block_size, num_kv_heads, head_dim, seed=seed, num_rows=len(lengths) + 1,
                         key_offset=2.0)
    if get_format(kv_format).tail:  # each sequence's tail row, not in sequence order, and the forward's new K/V
        pools["tail_rows"] = torch.randperm(len(lengths) + 1, generator=gen)[: len(lengths)]
        pools["num_fresh"] = torch.tensor([min(queries, n) for n in lengths])
        for which in ("keys", "values"):
            pools[f"fresh_{which}"] = torch.randn(len(lengths), queries, num_kv_heads, head_dim, generator=gen)
    tables = random_block_tables(lengths, block_size, num_blocks, gen)
    query = torch.randn(len(lengths), num_kv_heads * group, queries, head_dim, generator=gen)
    # the last `queries` positions of each sequence; positions before 0 are padding queries
    positions = torch.stack([torch.arange(n - queries, n) for n in lengths])
    positions = positions.clamp(min=-1)
    return query, positions, pools, tables, torch.tensor(lengths)


def own_block_view(pools, b, k, v, seq_len, pos):
    """A tail format: sequence ``b``'s K/V ``[L, H, D]`` as the query at ``pos`` reads them: positions of its own block
    exact, from the tail row before the forward's first position, from the fresh K/V after."""
    block_size = pools["key_cache"].shape[1]
    ctx = seq_len - int(pools["num_fresh"][b])
    k, v = k.clone(), v.clone()
    for j in range(pos // block_size * block_size, pos + 1):
        if j < ctx:
            row = int(pools["tail_rows"][b])
            k[j], v[j] = pools["key_tail"][row, j % block_size].float(), pools["value_tail"][row, j % block_size].float()
        else:
            k[j], v[j] = pools["fresh_keys"][b, j - ctx].float(), pools["fresh_values"][b, j - ctx].float()
    return k, v


def _dense_oracle(query, positions, pools, tables, seq_lens, scale, window):
    batch, num_heads, num_queries, _ = query.shape
    tail_rows = pools.get("tail_rows")
    out = torch.zeros_like(query)
    for b in range(batch):
        stored_k, stored_v = dense_kv(pools, tables[b], int(seq_lens[b]), None if tail_rows is None else int(tail_rows[b]))
        group = num_heads // stored_k.shape[1]
        for i in range(num_queries):
            pos = int(positions[b, i])
            if pos < 0:
                continue
            k, v = stored_k, stored_v
            if tail_rows is not None:
                k, v = own_block_view(pools, b, k, v, int(seq_lens[b]), pos)
            kb, vb = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, heads, D]
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,lhd->hl", query[b, :, i], kb[lo : pos + 1]) * scale
            out[b, :, i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), vb[lo : pos + 1])
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_format", FORMATS)
def test_both_paths_equal_dense_oracle(kv_format, window, monkeypatch):
    query, positions, pools, tables, seq_lens = _case(kv_format)
    scale = 0.25
    oracle = _dense_oracle(query, positions, pools, tables, seq_lens, scale, window)
    one_call = paged_attention_core(query, positions, block_tables=tables, seq_lens=seq_lens, scale=scale,
                                    sliding_window=window, **kernel_args(pools))
    monkeypatch.setattr(attention_ref, "SCORE_ELEMENTS_PER_CHUNK", 1)  # one block per chunk: the online path
    chunked = paged_attention_core(query, positions, block_tables=tables, seq_lens=seq_lens, scale=scale,
                                   sliding_window=window, **kernel_args(pools))
    torch.testing.assert_close(one_call, oracle, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, oracle, atol=1e-5, rtol=1e-5)
    assert (one_call[0, :, :2] == 0).all()  # the padding queries (positions < 0) of the 1-token sequence


def test_one_call_path_is_taken_only_without_softcap_and_sinks(monkeypatch):
    query, positions, pools, tables, seq_lens = _case("auto")
    calls = []
    real = attention_ref._single_chunk_attention
    monkeypatch.setattr(attention_ref, "_single_chunk_attention", lambda *a: calls.append(1) or real(*a))
    common = dict(block_tables=tables, seq_lens=seq_lens, scale=0.25, **kernel_args(pools))
    paged_attention_core(query, positions, **common)
    assert calls == [1]
    paged_attention_core(query, positions, softcap=5.0, **common)
    paged_attention_core(query, positions, sinks=torch.zeros(query.shape[1]), **common)
    assert calls == [1]


@pytest.mark.parametrize("kv_format", ["auto", "int4"])
def test_prefill_ref_batches_rows_like_one_call_per_sequence(kv_format, monkeypatch):
    """The varlen prefill reference pads sequences into batched calls; splitting every sequence into its own call
    (a chunk bound too small for two) must give the same rows, and each row must equal the dense oracle."""
    from paged_hf.kernels.paged_prefill_attention import paged_prefill_attention_ref

    _, _, pools, tables, seq_lens = _case(kv_format, lengths=(5, 17, 40, 9))
    query_lens = [5, 1, 12, 3]
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(sum(query_lens), 6, 16, generator=gen)
    cu = torch.tensor([0, 5, 6, 18, 21])
    if "tail_rows" in pools:  # the forward's new K/V, packed like the queries
        gen = torch.Generator().manual_seed(4)
        pools["num_fresh"] = torch.tensor(query_lens)
        packed = {which: torch.randn(sum(query_lens), 2, 16, generator=gen) for which in ("key", "value")}
        pools["fresh_keys"] = torch.stack([torch.cat([packed["key"][cu[s] : cu[s + 1]],
                                                      torch.zeros(12 - n, 2, 16)]) for s, n in enumerate(query_lens)])
        pools["fresh_values"] = torch.stack([torch.cat([packed["value"][cu[s] : cu[s + 1]],
                                                        torch.zeros(12 - n, 2, 16)]) for s, n in enumerate(query_lens)])
    operands = {k: v for k, v in pools.items() if k not in ("fresh_keys", "fresh_values", "num_fresh")}
    if "tail_rows" in pools:
        operands.update(fresh_key=packed["key"], fresh_value=packed["value"])
    batched = paged_prefill_attention_ref(query, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu,
                                          scale=0.3, **kernel_args(operands))
    monkeypatch.setattr(attention_ref, "SCORE_ELEMENTS_PER_CHUNK", 6 * 12 * 40)
    single = paged_prefill_attention_ref(query, block_tables=tables, seq_lens=seq_lens, cu_query_lens=cu,
                                         scale=0.3, **kernel_args(operands))
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    for s, n in enumerate(query_lens):
        rows = query[cu[s] : cu[s + 1]].transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
        positions = torch.arange(int(seq_lens[s]) - n, int(seq_lens[s])).unsqueeze(0)
        one = pools
        if "tail_rows" in pools:
            one = {**pools, **{name: pools[name][s : s + 1] for name in ("tail_rows", "num_fresh", "fresh_keys",
                                                                          "fresh_values")}}
        oracle = _dense_oracle(rows, positions, one, tables[s : s + 1], seq_lens[s : s + 1], 0.3, None)
        torch.testing.assert_close(batched[cu[s] : cu[s + 1]], oracle[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
