"""The prefix cache's host tier, its hit search and the cache-aware waiting queue.

- A hit served from the host tier (the pool evicted the prefix's blocks, ``kv_offloading_size`` kept them) gives the
  tokens and logprobs of a pool hit, bit for bit also in a quantized format, on a full-attention and a hybrid model;
  the host tier stays within its size.
- ``find_longest_hit`` equals a brute-force search over random cached patterns and windows.
- A burst of requests sharing a prefix computes the prefix once (prompt tokens counted), chunked or not.
- Under tensor parallelism the follower replays the host-tier copies into its own host storages.
- ``scheduling_policy="lpm"`` admits the longest cached prefix first within a priority level, and falls back to
  arrival order past ``LPM_MAX_WAITING``.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine import lpm
from paged_hf.kv.layer_groups import FullAttention, LayerGroup, SlidingWindow
from paged_hf.kv.prefix_hit import find_longest_hit
from paged_hf.kv.sizing import block_id_bytes
from models import tiny_model, token_logprobs

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
BLOCK = 4


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = tokens(24, 0)
FIRST, SECOND = SHARED + tokens(5, 1), SHARED + tokens(7, 2)
FILLERS = [tokens(30, 10 + i) for i in range(3)]  # distinct prompts that push the prefix out of a small pool


def host_run(model, kv_cache_dtype: str, tiered: bool):
    """FIRST, then (tiered: a pool of 16 blocks, the fillers evict the prefix to the host tier) SECOND."""
    options = dict(num_blocks=16, kv_offloading_size=0.001) if tiered else dict(num_blocks=128)
    engine = PagedEngine(model, None, block_size=BLOCK, kv_cache_dtype=kv_cache_dtype, swap_space=0, **options)
    engine.generate([FIRST], GREEDY, use_tqdm=False)
    if tiered:
        for filler in FILLERS:
            engine.generate([filler], GREEDY, use_tqdm=False)
    out = engine.generate([SECOND], GREEDY, use_tqdm=False)[0]
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
    return out, engine.get_stats()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_host_tier_hit_equals_pool_hit(family, kv_cache_dtype):
    model = tiny_model(family)
    pool_hit, pool_stats = host_run(model, kv_cache_dtype, tiered=False)
    host_hit, host_stats = host_run(model, kv_cache_dtype, tiered=True)
    assert pool_hit.num_cached_tokens == host_hit.num_cached_tokens == len(SHARED)
    assert pool_stats["prefix_cache_host_hits"] == 0
    assert host_stats["prefix_cache_host_hits"] > 0, "the fillers must have evicted the prefix to the host tier"
    assert host_hit.outputs[0].token_ids == pool_hit.outputs[0].token_ids
    assert token_logprobs(host_hit.outputs[0]) == token_logprobs(pool_hit.outputs[0])  # the same bytes


def test_host_tier_is_bounded_and_lru():
    model = tiny_model("llama")
    probe = PagedEngine(model, None, block_size=BLOCK, num_blocks=16, swap_space=0)
    block_bytes = block_id_bytes(probe.kv)
    engine = PagedEngine(model, None, block_size=BLOCK, num_blocks=16, swap_space=0,
                         kv_offloading_size=6 * block_bytes / 2**30)
    for prompt in [FIRST] + FILLERS * 2:
        engine.generate([prompt], GREEDY, use_tqdm=False)
        stats = engine.get_stats()
        assert stats["host_cache_blocks_total"] == 6
        assert stats["host_cache_blocks_used"] <= 6 and stats["host_cache_bytes"] <= 6 * block_bytes
        engine.check_invariants()
    # the oldest evicted blocks (FIRST's) left the 6-block host tier long ago: a miss
    assert engine.generate([SECOND], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert engine.get_stats()["host_cache_blocks_used"] == 6


def test_kv_offloading_size_is_checked():
    with pytest.raises(ValueError, match="kv_offloading_size"):
        PagedEngine(tiny_model("llama"), None, num_blocks=16, kv_offloading_size=-1)


# ------------------------------------------------------------------------------------------------ hit search
def brute_force(groups, cached, max_blocks):
    for k in range(max_blocks, 0, -1):
        if all(all(cached[g][i] for i in range(max(0, group.policy.first_needed(k * BLOCK)) // BLOCK, k))
               for g, group in enumerate(groups)):
            return k
    return 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([None, 1, 3, 6, 9, 17]), min_size=1, max_size=3), st.data())
def test_find_longest_hit_equals_brute_force(windows, data):
    groups = [LayerGroup(g, FullAttention() if w is None else SlidingWindow(w), BLOCK) for g, w in enumerate(windows)]
    max_blocks = data.draw(st.integers(0, 12))
    cached = [data.draw(st.lists(st.booleans(), min_size=12, max_size=12)) for _ in groups]
    hit = find_longest_hit(groups, lambda g, i: object() if cached[g][i] else None, max_blocks)
    assert hit.num_tokens == brute_force(groups, cached, max_blocks) * BLOCK
    for g, part in enumerate(hit.groups):
        assert part.num_skipped + len(part.blocks) == hit.num_tokens // BLOCK


# -------------------------------------------------------------------------------------- burst and admission
def computed_tokens(engine) -> list[int]:
    """Counts the tokens every step schedules (prompt chunks and decodes)."""
    count = [0]
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        count[0] += out.num_tokens
        return out

    engine.scheduler.schedule = counting
    return count


@pytest.mark.parametrize("budget", [16, 512])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_burst_computes_the_shared_prefix_once(family, budget):
    shared, tails = tokens(32, 3), [tokens(6, 20 + i) for i in range(8)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        engine = PagedEngine(tiny_model(family), None, block_size=BLOCK, num_blocks=256,
                             max_num_batched_tokens=budget, enable_prefix_caching=caching)
        count = computed_tokens(engine)
        outs[caching] = engine.generate([shared + t for t in tails], params, use_tqdm=False)
        decodes = len(tails) * (params.max_tokens - 1)
        expected = len(shared) + 6 * len(tails) if caching else (len(shared) + 6) * len(tails)
        assert count[0] == expected + decodes
        engine.check_invariants()
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]
    assert [o.num_cached_tokens for o in outs[True]] == [0] + [len(shared)] * 7


def admission_order(policy: str, priorities=(0, 0, 0, 0)) -> list[str]:
    """With one sequence at a time, the order in which four requests are first scheduled after a warm-up cached
    SHARED: "a" shares nothing, "b" and "d" share SHARED, "c" shares its first half."""
    engine = PagedEngine(tiny_model("llama"), None, block_size=BLOCK, num_blocks=128, max_num_seqs=1,
                         scheduling_policy=policy)
    engine.generate([FIRST], GREEDY, use_tqdm=False)
    prompts = {"a": tokens(30, 5), "b": SECOND, "c": SHARED[:12] + tokens(9, 6), "d": SHARED + tokens(4, 7)}
    for (name, prompt), priority in zip(prompts.items(), priorities):
        engine.add_request(prompt, GREEDY, request_id=name, priority=priority)
    started = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            started.setdefault(out.request_id, out.metrics.first_scheduled_time)
    engine.check_invariants()
    return sorted(started, key=started.get)


def test_lpm_admits_the_longest_cached_prefix_first(monkeypatch):
    assert admission_order("fcfs") == ["a", "b", "c", "d"]
    assert admission_order("lpm") == ["b", "d", "c", "a"]
    assert admission_order("lpm", priorities=(0, 1, 0, 1)) == ["c", "a", "b", "d"]  # within a priority level
    monkeypatch.setattr(lpm, "LPM_MAX_WAITING", 1)
    assert admission_order("lpm") == ["a", "b", "c", "d"]  # a long queue keeps arrival order


def test_prefix_benchmark_suite_runs_at_its_smallest_size(monkeypatch, capsys):
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    prefix = importlib.import_module("prefix")
    threads = torch.get_num_threads()
    try:
        assert prefix.main(["--suite", "--requests", "3", "--system-tokens", "32", "--question-tokens", "8",
                            "--max-tokens", "2", "--hidden", "64", "--window", "8", "--tenants", "4",
                            "--tenant-tokens", "32", "--rounds", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "quarter pool + host tier" in out and "3/3" in out and "8/8" in out, out


def test_metrics_count_hits_per_tier():
    from paged_hf.server.metrics import ServerMetrics  # noqa: PLC0415 - the server extra

    engine = PagedEngine(tiny_model("llama"), None, block_size=BLOCK, num_blocks=16, swap_space=0,
                         kv_offloading_size=0.001)
    for prompt in [FIRST] + FILLERS + [SECOND]:
        engine.generate([prompt], GREEDY, use_tqdm=False)
    stats = engine.get_stats()
    text = ServerMetrics().render(stats).decode()
    assert f'paged_hf_prefix_cache_hits{{tier="host"}} {float(stats["prefix_cache_host_hits"])}' in text
    assert stats["prefix_cache_host_hits"] == len(SHARED)
    device = stats["prefix_cache_hits"] - stats["prefix_cache_host_hits"]
    assert f'paged_hf_prefix_cache_hits{{tier="device"}} {float(device)}' in text
    assert f"paged_hf_host_cache_blocks_used {float(stats['host_cache_blocks_used'])}" in text


def test_host_tier_under_tensor_parallelism_equals_one_process(tmp_path):
    """The follower rank replays the leader's OFFLOAD / LOAD copies into host storages of its own."""
    import multiprocessing  # noqa: PLC0415

    from paged_hf import LLM  # noqa: PLC0415

    folder = tmp_path / "gemma2"
    tiny_model("gemma2", num_key_value_heads=4, num_attention_heads=4, num_hidden_layers=2).save_pretrained(folder)
    options = dict(skip_tokenizer_init=True, block_size=BLOCK, num_blocks=16, swap_space=0, kv_offloading_size=0.001)

    def run(llm):
        outs = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in [FIRST] + FILLERS + [SECOND]]
        return [o.outputs[0].token_ids for o in outs], outs[-1].num_cached_tokens, llm.get_stats()

    one_tokens, one_cached, _ = run(LLM(str(folder), **options))
    env_before = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    two = LLM(str(folder), tensor_parallel_size=2, **options)
    try:
        tokens, cached, stats = run(two)
    finally:
        two.shutdown()
    assert not multiprocessing.active_children()
    # the group's variables are given back: a torchrun started next must not inherit the old group's port
    assert {name: os.environ.get(name) for name in env_before} == env_before
    assert one_cached == cached == len(SHARED) and stats["prefix_cache_host_hits"] == len(SHARED)
    assert tokens == one_tokens
