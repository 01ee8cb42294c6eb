"""End to end on a CUDA GPU: the Triton path (store, decode, prefill, copy) against the CPU torch reference path.

Skipped without CUDA (CI has none). A GPU session runs it with ``python -m pytest -q tests/test_cuda.py``.

- float32: ``generate(cache_implementation="paged")`` with ``attn_implementation="paged"`` on CUDA gives the same
  greedy tokens as on CPU, for every tiny family and every kv format (the same math; reductions run in another
  order, so logits agree within 1e-4, not bit for bit).
- bfloat16: teacher-forced over the CPU float32 greedy tokens, the CUDA bf16 paged logits pick the same argmax as
  the CPU float32 ones (same kv format) at >= 90% of the steps, and their largest distance to them is at most
  ``BF16_ERROR_FACTOR`` x that of CUDA bf16 sdpa + DynamicCache (stock transformers): the paged path adds no
  error beyond bf16 itself. With int8 the kernels take bf16 queries too (the rotated query returns to bf16).
- The engine on CUDA (mixed decode + chunked prefill steps, prefix hits, copy-on-write for n > 1) gives the CPU
  engine's greedy tokens (its decode-only steps replayed from CUDA graphs, the default); so does a hybrid model's
  (recurrent states on the GPU), and a multi-head latent attention model's (folded decodes, expanded long chunks).
- The host tier's copies on a side stream, host blocks pinned: an offload, the device blocks' immediate reuse and a
  load give back the original bytes in every format, with a stream kept busy before each copy (a missing wait
  copies stale bytes); a host-tier hit on CUDA gives the tokens and logprobs of a device-pool hit.
- CUDA graphs (``engine/cuda_graphs.py``): every bucket captured at start without a failure (a host sync inside the
  captured region fails it), replayed for the decode-only steps, with the tokens of ``cudagraph_mode="NONE"`` in
  every format (int4: captured again when its tail pools move); ``enforce_eager=True`` turns graphs off with
  compile. ``benchmarks/gpu_session.sh`` step 5 runs these alone (``-k cuda_graphs``) and times decode on and off.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache

import paged_hf
from paged_hf import PagedEngine, SamplingParams
from models import FAMILIES, stories_model, stories_tokenizer, story_openings, tiny_model
from test_engine_families import prompts as family_prompts

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the compiled Triton path is tested on GPU sessions only", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

CUDA = torch.device("cuda")
BF16_ERROR_FACTOR = 1.5  # the paged bf16 path may be at most this much further from fp32 than bf16 sdpa
FORMATS = ("auto", "int8", "fp8", "int4")


def _prompts(batch=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 33][:batch]
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths):  # left padding
        ids[row, width - n :] = torch.randint(3, 500, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


def _greedy(model, ids, mask, kv_format, new_tokens=24):
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                         max_new_tokens=new_tokens, cache_implementation="paged",
                         cache_config={"kv_cache_dtype": kv_format}, pad_token_id=0, eos_token_id=None,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences.cpu(), torch.stack(out.logits, 1).float().cpu()


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_float32_cuda_equals_cpu_reference(family, kv_format):
    cpu = tiny_model(family, "paged")
    gpu = tiny_model(family, "paged").to(CUDA)
    ids, mask = _prompts()
    ref_tokens, ref_logits = _greedy(cpu, ids, mask, kv_format)
    tokens, logits = _greedy(gpu, ids, mask, kv_format)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def _teacher_forced_logits(model, sequence, prompt_len, attn, kv_format="auto"):
    """Logits for every position after the prompt, fed as prefill + one token per step through a cache."""
    model.set_attn_implementation(attn)
    if attn == "paged":
        cache = paged_hf.PagedCache(model.config, kv_cache_dtype=kv_format)
    else:
        cache = DynamicCache(config=model.config)
    seq = sequence.to(model.device)[None]
    out = [model(input_ids=seq[:, :prompt_len], cache=cache, use_cache=True).logits[0, -1]]
    for t in range(prompt_len, seq.shape[1] - 1):
        out.append(model(input_ids=seq[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(out).float().cpu()


@pytest.mark.parametrize("kv_format", ["auto", "int8"])
def test_stories_bfloat16_paged_within_bf16_tolerance(kv_format):
    tok = stories_tokenizer()
    cpu = stories_model("paged")
    prompt = tok(story_openings()[0], return_tensors="pt")["input_ids"]
    ref = cpu.generate(input_ids=prompt, max_new_tokens=48, do_sample=False, cache_implementation="paged")[0]
    ref_logits = _teacher_forced_logits(cpu, ref, prompt.shape[1], "paged", kv_format)
    gpu = stories_model("paged").to(CUDA, torch.bfloat16)
    error = {}
    for attn in ("paged", "sdpa"):
        logits = _teacher_forced_logits(gpu, ref, prompt.shape[1], attn, kv_format)
        error[attn] = (logits - ref_logits).abs().max().item()
        agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
        assert agree >= 0.9, f"{attn}: argmax agrees at {agree:.0%} of the steps"
    # bf16 itself costs about 0.3 on logits of magnitude ~15 (measured on CPU bf16: paged 0.30, sdpa 0.35)
    assert error["paged"] <= max(BF16_ERROR_FACTOR * error["sdpa"], 0.1), error


def test_engine_on_cuda_equals_cpu_engine():
    tok = stories_tokenizer()
    prompts = [story_openings()[i % 5] + " " * (i // 5) for i in range(12)]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True) for i in range(12)]
    options = dict(block_size=16, max_num_batched_tokens=64, num_blocks=256)
    ref = PagedEngine(stories_model("paged"), tok, **options).generate(prompts, params, use_tqdm=False)
    got = PagedEngine(stories_model("paged").to(CUDA), tok, **options).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    forks = SamplingParams(max_tokens=12, temperature=0, n=3, ignore_eos=True)  # copy-on-write of the shared tail
    engine = PagedEngine(stories_model("paged").to(CUDA), tok, **options)
    out = engine.generate([prompts[0]], forks, use_tqdm=False)[0]
    assert all(c.token_ids[:8] == ref[0].outputs[0].token_ids for c in out.outputs)
    assert engine.get_stats().kv_cache_used == 0


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid", "jamba"])
def test_hybrid_engine_on_cuda_equals_cpu_engine(family):
    """A hybrid model's recurrent states on the GPU (state rows, staged writes, the start probes on the mixers'
    device; Jamba's continuing chunks a token at a time): the CPU engine's greedy tokens, chunked and with n=2."""
    import copy  # noqa: PLC0415

    from test_hybrid_models import prompts as hybrid_prompts  # noqa: PLC0415
    from test_hybrid_models import tiny_hybrid  # noqa: PLC0415

    model = tiny_hybrid(family)
    options = dict(block_size=4, max_num_batched_tokens=7, num_blocks=128)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=2)
    ref = PagedEngine(copy.deepcopy(model), None, **options).generate(hybrid_prompts(), params, use_tqdm=False)
    engine = PagedEngine(copy.deepcopy(model).to(CUDA), None, **options)
    got = engine.generate(hybrid_prompts(), params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
    assert engine.get_stats().kv_cache_used == 0


@pytest.mark.parametrize("kv_format", ["auto", "int8"])
def test_latent_attention_engine_on_cuda_equals_cpu_engine(kv_format):
    """Multi-head latent attention on the GPU: the folded decodes (Triton, head dim 40 + the rows shared as values)
    replayed from CUDA graphs, long chunks expanded through sdpa, prefix hits; the CPU engine's greedy tokens, and
    the same with CUDA graphs off."""
    import copy  # noqa: PLC0415

    from test_latent_attention import _long_prompts, tiny_latent  # noqa: PLC0415

    model = tiny_latent()
    options = dict(block_size=4, max_num_batched_tokens=48, num_blocks=256, max_num_seqs=4, kv_cache_dtype=kv_format)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in _long_prompts()]
    ref = PagedEngine(copy.deepcopy(model), None, **options).generate(prompts, params, use_tqdm=False)
    for mode in ("FULL_DECODE_ONLY", "NONE"):
        engine = PagedEngine(copy.deepcopy(model).to(CUDA), None, cudagraph_mode=mode, **options)
        got = engine.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref], mode
        assert engine.get_stats().kv_cache_used == 0


# ------------------------------------------------------------------------------------------ host tier, side stream
def _stall(host, kind):
    """Keeps the stream a copy must wait for busy: the compute stream before an offload (its gather), the side
    stream before a load (its host-to-device transfer)."""
    from paged_hf.kv.copies import CopyKind  # noqa: PLC0415

    stream = host.side_stream(CUDA).stream if kind is CopyKind.LOAD else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_host_tier_offload_then_immediate_reuse_is_exact_on_the_side_stream(kv_format):
    from paged_hf.kv.host_tier import HostTier  # noqa: PLC0415
    from test_host_copies import offload_reuse_load  # noqa: PLC0415

    host = offload_reuse_load(kv_format, CUDA, HostTier.side_factory, stall=_stall)
    assert host.side_stream(CUDA) is not None
    assert all(t.is_pinned() for t in host.space.storage(0, 0).tensors().values())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_host_tier_hit_on_cuda_equals_pool_hit(kv_cache_dtype):
    from test_prefix_tiers import host_run  # noqa: PLC0415

    from models import token_logprobs  # noqa: PLC0415

    model = tiny_model("llama").to(CUDA)
    pool_hit, _ = host_run(model, kv_cache_dtype, tiered=False)
    host_hit, stats = host_run(model, kv_cache_dtype, tiered=True)
    assert stats["prefix_cache_host_hits"] > 0
    assert host_hit.outputs[0].token_ids == pool_hit.outputs[0].token_ids
    assert token_logprobs(host_hit.outputs[0]) == token_logprobs(pool_hit.outputs[0])


# ------------------------------------------------------------------------------------------ CUDA graphs
GRAPH_OPTIONS = dict(block_size=16, max_num_batched_tokens=64, num_blocks=256, max_num_seqs=16)


def _graph_requests():
    prompts = [story_openings()[i % 5] + " " * (i // 5) for i in range(12)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True, logprobs=0) for i in range(12)]
    return prompts, params  # the batch shrinks one request at a time: every bucket, padded, is used


def _replays(monkeypatch) -> list:
    calls = []
    replay = torch.cuda.CUDAGraph.replay

    def counting(graph):
        calls.append(graph)
        return replay(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting)
    return calls


def _tokens_and_logprobs(engine, prompts, params):
    outs = engine.generate(prompts, params, use_tqdm=False)
    engine.check_invariants()
    assert engine.get_stats().kv_cache_used == 0
    return ([o.outputs[0].token_ids for o in outs],
            [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


@pytest.mark.parametrize("kv_format", ["auto", "int8", "int4"])
def test_cuda_graphs_replay_decode_steps_with_the_tokens_of_the_engine_without_them(kv_format, monkeypatch, caplog):
    """Captured at start (the log line names the buckets), with no capture failure (a host sync inside the region
    would fail it), replayed for every decode-only step, the tokens of ``cudagraph_mode="NONE"``."""
    tok = stories_tokenizer()
    prompts, params = _graph_requests()
    options = dict(GRAPH_OPTIONS, kv_cache_dtype=kv_format)
    off = PagedEngine(stories_model("paged").to(CUDA), tok, cudagraph_mode="NONE", **options)
    assert off.runner.graphs is None and off.runner.compiled is not None
    ref_tokens, ref_logprobs = _tokens_and_logprobs(off, prompts, params)
    with caplog.at_level(logging.INFO, logger="paged_hf"):
        on = PagedEngine(stories_model("paged").to(CUDA), tok, **options)
        assert "captured CUDA graphs of decode steps at batch sizes [1, 2, 4, 8, 16]" in caplog.text
        assert "failed" not in caplog.text
        assert sorted(on.runner.graphs.graphs) == [1, 2, 4, 8, 16]
        replays = _replays(monkeypatch)
        tokens, logprobs = _tokens_and_logprobs(on, prompts, params)
    assert tokens == ref_tokens
    for got, ref in zip(logprobs, ref_logprobs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=1e-4, rtol=0)
    assert len(replays) >= 20  # decode-only steps of 12..1 sequences


def test_cuda_graphs_are_captured_again_when_int4_tail_pools_move(monkeypatch, caplog):
    """A graph holds the addresses of the tail pools it read: when they grow (more sequence rows than the largest
    bucket), the next decode step captures again, and the tokens stay those of the engine without graphs."""
    tok = stories_tokenizer()
    prompts, params = _graph_requests()
    options = dict(GRAPH_OPTIONS, kv_cache_dtype="int4")
    off = PagedEngine(stories_model("paged").to(CUDA), tok, cudagraph_mode="NONE", **options)
    ref = _tokens_and_logprobs(off, prompts, params)[0]
    on = PagedEngine(stories_model("paged").to(CUDA), tok, **options)
    assert _tokens_and_logprobs(on, prompts, params)[0] == ref
    for group in on.kv.groups:  # what more rows than the largest bucket do
        for storage in group.storages.values():
            storage.ensure_tail_rows(4 * GRAPH_OPTIONS["max_num_seqs"])
    with caplog.at_level(logging.INFO, logger="paged_hf"):
        replays = _replays(monkeypatch)
        assert _tokens_and_logprobs(on, prompts, params)[0] == ref
    assert "capturing the decode graphs again" in caplog.text and replays


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_cuda_graphs_on_tiny_families_equal_no_graphs(family):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = dict(block_size=4, num_blocks=128, max_num_batched_tokens=9, max_num_seqs=8)
    off = PagedEngine(tiny_model(family).to(CUDA), None, cudagraph_mode="NONE", **options)
    on = PagedEngine(tiny_model(family).to(CUDA), None, **options)
    assert sorted(on.runner.graphs.graphs) == [1, 2, 4, 8]
    ref = [o.outputs[0].token_ids for o in off.generate(family_prompts(), params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in on.generate(family_prompts(), params, use_tqdm=False)] == ref
    on.check_invariants()


def test_enforce_eager_turns_cuda_graphs_off_with_compile():
    engine = PagedEngine(tiny_model("llama").to(CUDA), None, enforce_eager=True, num_blocks=16)
    assert engine.runner.graphs is None and engine.runner.compiled is None
    engine = PagedEngine(tiny_model("llama").to(CUDA), None, cudagraph_mode="NONE", num_blocks=16)
    assert engine.runner.graphs is None and engine.runner.compiled is not None
