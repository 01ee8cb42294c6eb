"""PagedEngine: fidelity against model.generate, prefix caching, preemption, failures, and a randomized soak."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import paged_hf
from paged_hf import PagedEngine, SamplingParams
from paged_hf.config import ParameterError
from paged_hf.engine import worker as worker_module
from paged_hf.kv.model_config import block_id_bytes
from models import output_text, stories_model, stories_tokenizer, story_openings, tiny_model

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


@pytest.fixture(scope="module")
def prompts(stories):
    _, tok = stories
    openings = story_openings()
    return openings + [openings[0] + " He liked to", "Lily", openings[2] + " The sun was hot and"]


@pytest.fixture(scope="module")
def references(stories, prompts):
    """Greedy continuation of each prompt alone, by generate + DynamicCache + sdpa."""
    model, tok = stories
    model.set_attn_implementation("sdpa")
    refs = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
                             cache=DynamicCache(config=model.config))
        refs.append(out[0, ids["input_ids"].shape[1]:].tolist())
    return refs


def engine_for(stories, **options) -> PagedEngine:
    model, tok = stories
    return PagedEngine(model, tok, **options)


def assert_all_freed(engine: PagedEngine) -> None:
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
    assert not engine.requests


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7, "block_size": 4},  # chunked prefill across chunk boundaries
        {"max_num_seqs": 2},
        {"num_blocks": 14, "block_size": 4, "preemption_mode": "recompute"},
        {"num_blocks": 14, "block_size": 4, "preemption_mode": "swap"},
        {"num_blocks": 14, "block_size": 4, "preemption_mode": "auto", "max_num_batched_tokens": 9},
        {"kv_cache_dtype": "auto", "enable_prefix_caching": False, "block_size": 8},
    ],
    ids=["default", "chunked", "max_seqs", "recompute", "swap", "auto_chunked", "no_prefix_cache"],
)
def test_engine_greedy_equals_generate(stories, prompts, references, options):
    engine = engine_for(stories, **options)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    stats = engine.get_stats()
    if options.get("num_blocks"):
        assert stats["preemption_count"] > 0, "the tiny pool must force preemption"
        if options.get("preemption_mode") == "swap":
            assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    assert_all_freed(engine)


def test_stats_count_the_steps_and_the_tokens_they_forwarded(stories, prompts):
    """Without prefix hits or preemption every prompt token is forwarded once, and every generated token but each
    request's last once more (the next step's input); a step with nothing to run is not counted."""
    engine = engine_for(stories, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    calls, prompt_tokens, generated = 0, {}, {}
    while engine.has_unfinished_requests():
        calls += 1
        for out in engine.step():
            prompt_tokens[out.request_id] = len(out.prompt_token_ids)
            generated[out.request_id] = len(out.outputs[0].token_ids)
    engine.step()  # nothing left: no forward
    stats = engine.get_stats()
    assert stats["preemption_count"] == 0 and sorted(generated) == sorted(ids)
    assert stats["num_steps"] == calls
    assert stats["num_step_tokens"] == sum(prompt_tokens.values()) + sum(generated.values()) - len(ids)
    assert stats["num_step_tokens"] <= 16 * calls


def test_staggered_arrivals_and_prefix_hits(stories, prompts, references):
    engine = engine_for(stories, block_size=4, max_num_batched_tokens=16)
    first = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:  # later arrivals, two of which share a computed prefix
            later = [engine.add_request(p, GREEDY) for p in prompts[3:]]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert [done[r] for r in first + later] == references
    assert engine.get_stats()["prefix_cache_hit_rate"] > 0
    # the same prompts again: their prompt blocks are all cached now (up to the last token)
    again = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == references
    assert all(o.metrics.num_prefix_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 4)
    assert_all_freed(engine)


def test_burst_admitted_in_one_step_shares_the_prefix_it_computes(stories, prompts, references):
    """Requests admitted in the same step hit the blocks an earlier one of them fills in that very forward."""
    system = story_openings()[0] + " " + story_openings()[1]
    burst = [system + " " + p for p in prompts[:4]]
    expected = engine_for(stories, block_size=4, enable_prefix_caching=False).generate(burst, GREEDY, use_tqdm=False)
    engine = engine_for(stories, block_size=4, max_num_batched_tokens=4096)
    ids = [engine.add_request(p, GREEDY) for p in burst]
    engine.step()  # the whole burst is admitted and prefilled in this one step
    shared = min(engine.requests[i].metrics.num_prefix_cached_tokens for i in ids[1:])
    assert shared >= len(engine.requests[ids[0]].prompt_token_ids) // 2, "later requests must hit the first's blocks"
    assert engine.requests[ids[0]].metrics.num_prefix_cached_tokens == 0
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
    assert [outs[i] for i in ids] == [o.outputs[0].token_ids for o in expected]
    assert_all_freed(engine)


def test_failed_forward_unregisters_the_blocks_it_was_to_fill(stories, monkeypatch):
    engine = engine_for(stories, block_size=4)
    prompt = story_openings()[0] * 2
    real = engine.runner.run

    def exploding(step):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", exploding)  # every forward, the retries in parts too
    out = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and "device lost" in out.error
    assert engine.get_stats()["kv_cache_cached_blocks"] == 0, "blocks never filled must not stay in the cache"
    monkeypatch.setattr(engine.runner, "run", real)
    again = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.metrics.num_prefix_cached_tokens == 0
    reference = engine_for(stories, block_size=4, enable_prefix_caching=False).generate([prompt], GREEDY,
                                                                                        use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids
    assert_all_freed(engine)


def test_prefix_hit_is_faster_in_tokens_computed(stories):
    engine = engine_for(stories, block_size=4)
    system = story_openings()[0] * 3
    engine.generate([system + " Q1"], GREEDY, use_tqdm=False)
    out = engine.generate([system + " Q2"], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_prefix_cached_tokens >= len(out.prompt_token_ids) - 8
    salted = engine.add_request(system + " Q2", GREEDY, cache_salt="tenant-b")
    engine.step()
    assert engine.requests[salted].metrics.num_prefix_cached_tokens == 0, "a cache_salt isolates tenants"
    engine.abort(salted)
    assert_all_freed(engine)


def test_seeded_sampling_is_independent_of_batch(stories, prompts):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = engine_for(stories).generate([prompts[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = engine_for(stories, max_num_batched_tokens=11).generate(prompts, params, use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone


def test_parallel_samples_share_prompt_blocks(stories, prompts):
    engine = engine_for(stories, block_size=4)
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    request_id = engine.add_request(prompts[0], params)
    engine.step()  # prefill of sample 0; samples 1 and 2 fork its blocks
    seqs = engine.requests[request_id].sequences
    shared = {id(b) for b in seqs[0].kv.tables[0].blocks[:-1]}
    assert all({id(b) for b in s.kv.tables[0].blocks[:-1]} == shared for s in seqs[1:])
    assert all(b.ref_cnt == 3 for b in seqs[0].kv.tables[0].blocks[:-1])
    engine.check_invariants()
    while engine.has_unfinished_requests():
        outs = engine.step()
    (out,) = outs
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_all_freed(engine)


def test_stop_strings_stop_ids_and_streaming(stories, prompts, references):
    model, tok = stories
    engine = engine_for(stories)
    text = output_text(tok, tok(prompts[0])["input_ids"], references[0])
    stop = text.split()[3]
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert stop not in out.outputs[0].text and text.startswith(out.outputs[0].text)
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[references[0][5]]),
                          use_tqdm=False)[0]
    assert out.outputs[0].token_ids == references[0][:6] and out.outputs[0].stop_reason == references[0][5]
    deltas = list(engine.stream(prompts[0], GREEDY))
    assert len(deltas) > 3 and "".join(deltas) == text
    assert_all_freed(engine)


def test_streams_generate_and_a_step_loop_share_one_engine_without_losing_outputs(stories, prompts, references):
    """Each reader gets its own requests' outputs whoever stepped: two streams read in turn, a ``generate`` run
    while a stream is open, and a request the caller added and reads with ``step()`` meanwhile, all with the
    texts of their solo runs; automatic ids skip ids the caller chose."""
    model, tok = stories
    engine = engine_for(stories)
    texts = [output_text(tok, tok(p)["input_ids"], r) for p, r in zip(prompts, references)]
    mine = engine.add_request(prompts[2], GREEDY, request_id="1")  # read by this test's step() loop
    first, second = engine.stream(prompts[0], GREEDY), engine.stream(prompts[1], GREEDY)
    got = [next(first), next(second)]
    got[1] += "".join(second)  # runs the steps first's request also advances in
    got[0] += "".join(first)
    assert got == texts[:2]
    (out,) = engine.generate([prompts[3]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == references[3] and out.request_id != mine
    seen = []
    while engine.has_unfinished_requests():  # vLLM's loop: its request ended in the others' steps, parked for it
        seen += engine.step()
    assert [o.request_id for o in seen if o.finished] == [mine] and seen[-1].outputs[0].token_ids == references[2]
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert_all_freed(engine)


def test_bad_requests_fail_alone(stories, prompts, references):
    engine = engine_for(stories, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.add_request(" ".join(["word"] * 80), GREEDY)

    def broken(token_ids, logits):
        raise RuntimeError("processor exploded")

    params = [GREEDY, SamplingParams(max_tokens=5, temperature=0, logits_processors=[broken]), GREEDY,
              GREEDY]
    with pytest.raises(ValueError, match="max_model_len=64"):  # checked before any work: nothing stays queued
        engine.generate([prompts[0], prompts[1], " ".join(["word"] * 80), prompts[2]], params, use_tqdm=False)
    assert not engine.requests and not engine.has_unfinished_requests()
    outs = engine.generate([prompts[0], prompts[1], prompts[2]], params[:3], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == references[0] and outs[2].outputs[0].token_ids == references[2]
    assert outs[1].outputs[0].finish_reason == "error" and "processor exploded" in outs[1].error
    small = engine_for(stories, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="pool has 4"):
        small.add_request(prompts[0], GREEDY)
    assert_all_freed(engine)


def test_engine_config_rejects_bad_values(stories):
    with pytest.raises(ValueError, match=r"preemption_mode must be one of \('recompute', 'swap', 'auto'\)"):
        engine_for(stories, preemption_mode="evict")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        engine_for(stories, kv_cache_dtype="int2")
    with pytest.raises(ValueError, match=r"top_p must be in \(0.0, 1.0\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"temperature must be in \[0.0, 2.0\], got 2.5"):  # OpenAI's, vLLM's range
        SamplingParams(temperature=2.5)
    assert SamplingParams(temperature=2.0).temperature == 2.0
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['max_batch_size'\]"):
        engine_for(stories, max_batch_size=3)
    with pytest.raises(ValueError, match=r"kv_cache_memory must be in \(0.0, inf\]"):
        engine_for(stories, kv_cache_memory=0)


def test_prefix_counters_count_each_requests_first_lookup_as_vllm(stories):
    """``prefix_cache_queries`` / ``_hits`` count a request's prompt once, at its first admission, once for its
    samples: not again when it comes back after preemption by recompute (its own blocks are no hit), nor for a
    request that does not look up (prompt logprobs, or prefix caching off). The hits are the tokens taken."""
    model, tok = stories
    prompts = ["Once upon a time there was a little girl", "The dog ran to the park to play with a ball",
               "Tom and Sue went to the big park", "A big red ball was on the floor of the room"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = PagedEngine(model, tok, block_size=4, num_blocks=16, preemption_mode="recompute")
    outs = engine.generate(prompts, params, use_tqdm=False)
    stats = engine.get_stats()
    assert stats["preemption_count"] > 0
    assert stats["prefix_cache_queries"] == sum(len(o.prompt_token_ids) for o in outs)
    assert stats["prefix_cache_hits"] == sum(o.num_cached_tokens for o in outs)
    before = engine.get_stats()["prefix_cache_queries"]
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    samples = engine.generate(prompts[1:2], SamplingParams(max_tokens=2, n=3, temperature=1.0, seed=1),
                              use_tqdm=False)[0]
    assert engine.get_stats()["prefix_cache_queries"] == before + len(samples.prompt_token_ids)
    off = PagedEngine(model, tok, block_size=4, num_blocks=64, enable_prefix_caching=False)
    off.generate(prompts, params, use_tqdm=False)
    assert off.get_stats()["prefix_cache_queries"] == 0


def test_a_pool_smaller_than_the_context_says_so_and_names_what_cannot_fit(caplog):
    """A pool that holds one sequence of fewer tokens than ``max_model_len`` is a choice here (vLLM refuses to start):
    the engine warns at start and says how long a sequence can get (``max_sequence_len``: what the server's default
    ``max_tokens`` fills up to); a request past it is refused naming ``max_tokens`` (or ``prompt``, too long alone)."""
    model = tiny_model("llama", "paged")
    with caplog.at_level("WARNING", logger="paged_hf"):
        engine = PagedEngine(model, None, block_size=4, num_blocks=6, max_model_len=40, enforce_eager=True)
    assert engine.max_sequence_len == 6 * 4 + 1  # every token stored but the last, sampled one
    assert "holds one sequence of at most 25 tokens, fewer than max_model_len 40" in caplog.text
    engine.add_request([5] * 10, SamplingParams(max_tokens=15))  # 25: fits
    engine.add_request([5] * 10, SamplingParams(max_tokens=None))  # as many as fit: the pool's 15, not the context's
    assert engine.requests[str(1)].params.max_tokens == 15
    for ids, max_tokens, field in (([5] * 10, 16, "max_tokens"), ([5] * 25, 1, "prompt"), ([5] * 30, 1, "prompt")):
        with pytest.raises(ParameterError, match="could never finish") as error:
            engine.add_request(ids, SamplingParams(max_tokens=max_tokens))
        assert error.value.param == field
    roomy = PagedEngine(model, None, block_size=4, num_blocks=10, max_model_len=40, enforce_eager=True)
    assert roomy.max_sequence_len == 40


def test_a_dropped_engine_frees_its_pool(stories):
    """The engine freezes what exists before it (model, tokenizer, libraries) out of the cyclic collector's sight,
    never its own objects: a dropped engine's pool is freed by the collector (it leaked a pool per engine)."""
    import gc
    import weakref

    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    engine.generate(["Once upon a time"], GREEDY, use_tqdm=False)
    storage = next(iter(engine.kv.groups[0].storages.values()))
    pool = weakref.ref(storage)
    del engine, storage
    gc.collect()
    assert pool() is None, "the dropped engine's KV pool is still alive"


def test_a_paged_cache_alive_when_an_engine_starts_is_freed_once_dropped(stories):
    """What exists when an engine starts is frozen out of the cyclic collector's sight; a ``generate`` cache kept
    then (``return_dict_in_generate``) must still free its pool once dropped: its layers hold it weakly, so it is
    freed by reference counting, with no cycle for the frozen collector to miss."""
    import gc
    import weakref

    model, tok = stories
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="paged",
                         return_dict_in_generate=True)
    storage = next(iter(out.past_key_values.kv.groups[0].storages.values()))
    pool = weakref.ref(storage)
    del storage
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    del out
    gc.collect()
    assert pool() is None, "a paged cache dropped after an engine started still holds its pool"
    del engine


def test_auto_sized_pool_follows_the_memory_budget(stories, monkeypatch):
    model, tok = stories
    per_block = block_id_bytes(model.config.get_text_config(decoder=True), 16, "auto", dtype=model.dtype)
    engine = PagedEngine(model, tok, kv_cache_memory=100 * per_block / 2**30, swap_space=0)
    assert engine.get_stats()["kv_cache_total"] == 100
    # CPU without a budget: DEFAULT_CPU_KV_CACHE_GIB, not a fraction of all the RAM
    monkeypatch.setattr(worker_module, "DEFAULT_CPU_KV_CACHE_GIB", 60 * per_block / 2**30)
    assert PagedEngine(model, tok, swap_space=0).get_stats()["kv_cache_total"] == 60


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_randomized_soak_keeps_invariants(data):
    model = tiny_model("llama", "paged")
    engine = PagedEngine(model, None, block_size=4, num_blocks=data.draw(st.integers(8, 24)),
                         max_num_batched_tokens=data.draw(st.integers(4, 32)), max_num_seqs=4,
                         preemption_mode=data.draw(st.sampled_from(["recompute", "swap", "auto"])),
                         swap_space=data.draw(st.sampled_from([0.0, 0.001])), max_model_len=40)
    pending = data.draw(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 6),
                                           st.booleans(), st.integers(0, 2)), min_size=1, max_size=8))
    shared = [list(range(3, 3 + 4 * k)) for k in (0, 2, 4)]  # prefixes of 0, 2 and 4 blocks: hits, same-step too
    added, prompts, finished = {}, {}, {}
    step = 0
    while pending or engine.has_unfinished_requests():
        for item in [p for p in pending if p[2] <= step]:
            pending.remove(item)
            length, max_tokens, _, abort, prefix = item
            ids = (shared[prefix] + torch.randint(3, 500, (length,)).tolist())[:28]  # + 12 <= max_model_len
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            if -(-(len(ids) + max_tokens - 1) // 4) > engine.get_stats()["kv_cache_total"]:
                with pytest.raises(ValueError, match="could never finish"):  # rejected up front, not livelocked
                    engine.add_request(ids, params)
                continue
            rid = engine.add_request(ids, params)
            added[rid], prompts[rid] = abort, (ids, max_tokens)
        for out in engine.step():
            assert out.error is None
            if out.finished and out.outputs[0].finish_reason == "length":
                finished[out.request_id] = out.outputs[0].token_ids
        for rid, abort in added.items():
            if abort and rid in engine.requests and step % 3 == 2:
                engine.abort(rid)
        engine.check_invariants()
        step += 1
        assert step < 2000, "the engine stopped making progress"
    # every completed request has the tokens it gets alone, without sharing or preemption
    alone = PagedEngine(model, None, block_size=4, num_blocks=64, enable_prefix_caching=False)
    for rid, tokens in finished.items():
        ids, max_tokens = prompts[rid]
        ref = alone.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0]
        assert tokens == ref.outputs[0].token_ids, f"request {rid} differs from its run alone"
    assert_all_freed(engine)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads the RSS from /proc")
def test_swap_space_is_allocated_as_it_is_used(stories, prompts, references):
    """Issue #12, item 11: the first preemption allocated all of ``swap_space`` (RSS 0.5 -> 4.5 GB for a 64-block
    pool). With the default 4 GiB of swap and a 14-block pool, swapping a few sequences must cost megabytes."""
    engine = engine_for(stories, num_blocks=14, block_size=4, preemption_mode="swap")
    assert engine.config.swap_space == 4.0
    before = resident_bytes()
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    grown = resident_bytes() - before
    assert engine.get_stats()["num_swapped_out"] > 0, "the tiny pool must swap"
    assert [o.outputs[0].token_ids for o in outs] == references
    assert grown < 256 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB for a few swapped blocks"  # measured: ~8 MiB
    assert_all_freed(engine)


def test_a_prompt_admitted_while_a_request_decodes_finds_its_generated_blocks(stories):
    """Decode steps register nothing (a steady step's host work); the first lookup after them registers the
    running sequences' computed blocks first: a prompt that continues a running request's text hits every block its
    decodes filled so far, and gives the tokens of a run without the cache. A step without a lookup registers no
    block."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = engine.add_request("Once upon a time there was a", params)
    outputs = {}
    for _ in range(12):
        for out in engine.step():
            outputs[out.request_id] = out
    registered = []
    cache = engine.kv.prefix_cache
    original = cache.cache_full_blocks
    cache.cache_full_blocks = lambda *args, **kwargs: registered.append(args[2]) or original(*args, **kwargs)
    engine.step()  # a steady decode step: nothing to register
    assert registered == [] and engine.scheduler.unregistered_decodes
    running = engine.scheduler.running[0]
    prompt = list(running.token_ids)
    computed = running.num_computed_tokens
    assert computed // 4 > len(running.request.prompt_token_ids) // 4 + 1  # decodes filled blocks
    second = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    assert done[second].num_cached_tokens == computed // 4 * 4
    assert done[first].outputs[0].token_ids[: len(prompt) - len(done[first].prompt_token_ids)] == \
        prompt[len(done[first].prompt_token_ids):]
    cold = PagedEngine(model, tok, block_size=4, num_blocks=64, enable_prefix_caching=False)
    assert done[second].outputs[0].token_ids == cold.generate([prompt], SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_a_sequence_preempted_by_recompute_finds_the_blocks_it_generated(stories):
    """A sequence preempted by recompute registers the blocks its decodes filled before it frees them: computed
    again, it finds them in the cache (its prompt and generated blocks) and goes on with the same tokens."""
    model, tok = stories
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = "Once upon a time there was a"
    reference = PagedEngine(model, tok, block_size=4, num_blocks=64, enable_prefix_caching=False).generate(
        [prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64, preemption_mode="recompute")
    request = engine.add_request(prompt, params)
    for _ in range(14):
        engine.step()
    seq = engine.scheduler.running[0]
    computed = seq.num_computed_tokens
    engine.scheduler._preempt(seq)
    assert seq.kv.num_tokens == 0 and engine.scheduler.waiting[0] is seq
    hits = []
    find = engine.kv.find_prefix_hit
    engine.kv.find_prefix_hit = lambda *args: hits.append(find(*args).num_tokens) or find(*args)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert seq.request.metrics.num_preemptions == 1
    assert hits[0] == computed // 4 * 4 > len(seq.request.prompt_token_ids)
    assert done[request].outputs[0].token_ids == reference


def test_blocks_that_decodes_fill_are_cached_for_later_prompts(stories):
    """With prefix caching, the blocks decode steps fill are registered, at the latest when their sequence ends (vLLM
    caches generated blocks too): a later prompt that continues the first request's text finds its generated blocks,
    the last block the forward computed included, and its greedy tokens are those of a run without the cache."""
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    first = engine.generate(["Once upon a time there was a"], params, use_tqdm=False)[0]
    prompt = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    computed = len(prompt) - 1  # the last token was sampled, never a forward's input
    second = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0]
    assert second.num_cached_tokens == computed // 4 * 4 > len(first.prompt_token_ids)
    cold = PagedEngine(model, tok, block_size=4, num_blocks=64, enable_prefix_caching=False)
    assert second.outputs[0].token_ids == cold.generate([prompt], SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
