"""The engine core: step metadata, output kinds, incremental text, batched sampling, logprobs against a plain
forward, kernel choice made once, pools that cannot fit, and the shared statistics vocabulary."""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import pytest
import torch

import paged_hf
from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine import RequestOutputKind
from paged_hf.engine.detokenizer import Decoder, IncrementalDetokenizer, find_stop
from paged_hf.engine.sampler import _filter
from paged_hf.kv.manager import KVManager
from paged_hf.kv_stats import EngineStats, KVCacheStats, PagedCacheStats
from paged_hf.metadata import build_metadata
from models import output_text, stories_model, stories_tokenizer, story_openings, tiny_model


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


# ------------------------------------------------------------------------------------------------ metadata
def test_metadata_tensors_are_built_on_the_forward_device():
    """Every tensor of a mixed decode + prefill forward's metadata is made on the device asked for ("meta" here: a
    tensor made on the host and not moved would show up as cpu)."""
    kv = KVManager(tiny_model("gemma2").config, 4, "auto", num_blocks=64)  # two layer groups
    seqs = [kv.new_sequence() for _ in range(3)]
    for seq, held in zip(seqs, (5, 9, 0)):
        kv.append(seq, held)
    counts = [1, 1, 7]  # two decodes, then a prefill chunk
    for seq, count in zip(seqs, counts):
        kv.append(seq, count)
    metadata = build_metadata(kv, seqs, [5, 9, 0], counts, num_decodes=2, device="meta")
    tensors = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
    for group in metadata.groups:
        tensors.update({f"group.{f.name}": getattr(group, f.name) for f in dataclasses.fields(group)})
    tensors = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    assert {"seq_lens", "query_start_loc", "prefill_query_start_loc", "positions", "group.block_tables",
            "group.slot_mapping"} <= set(tensors)
    assert {name: t.device.type for name, t in tensors.items()} == {name: "meta" for name in tensors}
    host = build_metadata(kv, seqs, [5, 9, 0], counts, num_decodes=2, device="cpu")
    assert host.prefill_query_start_loc.tolist() == [0, 7] and host.seq_lens.tolist() == [6, 10, 7]
    assert host.positions.tolist() == [5, 9, *range(7)]


def test_mixed_step_through_the_triton_kernels_matches_the_references(stories, monkeypatch):
    """A chunked-prefill engine run (steps mixing decodes and prefill chunks) with the Triton kernels in the
    interpreter gives the tokens of the torch references: the decode / prefill split hands the kernels tensors
    they accept (on the query's device, the prefill part's own query offsets)."""
    pytest.importorskip("triton")
    model, tok = stories
    prompts = [story_openings()[0], "Lily", story_openings()[2]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    options = dict(block_size=4, max_num_batched_tokens=9, num_blocks=64, enable_prefix_caching=False)
    reference = [o.outputs[0].token_ids for o in PagedEngine(model, tok, **options).generate(prompts, params,
                                                                                            use_tqdm=False)]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PAGED_HF_KERNELS", "triton")
    from paged_hf.kernels.paged_decode_attention import triton_interpreting

    if not triton_interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET could take effect in this process")
    engine = PagedEngine(model, tok, **options)
    assert all(s.kernels.triton for g in engine.kv.groups for s in g.storages.values())
    mixed = []
    schedule = engine.scheduler.schedule

    def watch():
        out = schedule()
        mixed.append(0 < out.num_decodes < len(out.scheduled))
        return out

    engine.scheduler.schedule = watch
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    model.set_attn_implementation("sdpa")
    assert any(mixed), "the run must contain a step that mixes decodes and prefill chunks"
    assert got == reference


# ------------------------------------------------------------------------------------------- output kinds
def test_output_kinds_carry_the_same_text_and_tokens(stories):
    model, tok = stories
    engine = PagedEngine(model, tok, block_size=8)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    ids = {kind: engine.add_request(story_openings()[1], params, output_kind=kind) for kind in RequestOutputKind}
    seen = {kind: [] for kind in RequestOutputKind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[next(k for k, rid in ids.items() if rid == out.request_id)].append(out)
    final = seen[RequestOutputKind.CUMULATIVE][-1].outputs[0]
    assert len(seen[RequestOutputKind.CUMULATIVE]) == 20
    assert len(seen[RequestOutputKind.FINAL_ONLY]) == 1 and seen[RequestOutputKind.FINAL_ONLY][0].finished
    only = seen[RequestOutputKind.FINAL_ONLY][0].outputs[0]
    deltas = [o.outputs[0] for o in seen[RequestOutputKind.DELTA]]
    assert len(deltas) == 20 and "".join(d.text for d in deltas) == final.text == only.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids == only.token_ids
    # the three requests share each forward at different rows: logprobs agree to float rounding
    for entries in ([e for d in deltas for e in d.logprobs], only.logprobs):
        assert [list(e) for e in entries] == [list(e) for e in final.logprobs]
        assert max(abs(a[t].logprob - b[t].logprob) for a, b in zip(entries, final.logprobs) for t in a) < 1e-5
    prompt_ids = seen[RequestOutputKind.CUMULATIVE][-1].prompt_token_ids
    assert final.text == output_text(tok, prompt_ids, final.token_ids)
    assert final.text.startswith(" ")  # a SentencePiece output keeps its first token's space
    engine.check_invariants()


# ------------------------------------------------------------------------------------------ detokenizer
def test_incremental_text_equals_one_decode_of_the_output(stories):
    """Random token ids (byte-fallback pieces that split characters included) fed one or a few at a time: the
    emitted deltas concatenate to the text the output adds to the prompt's (``decode(prompt + output)`` less
    ``decode(prompt)``, skip_special_tokens=True) less the U+FFFD of a character the output ends inside, for prompts
    shorter and longer than the context window."""
    _, tok = stories
    decode = Decoder(tok)
    rng = random.Random(0)
    text_ids = tok(" ".join(story_openings()), add_special_tokens=False)["input_ids"]
    for trial in range(200):
        if trial % 2:
            output = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        else:
            start = rng.randrange(len(text_ids) - 30)
            output = text_ids[start : start + rng.randint(1, 30)]
        prompt = [1] + text_ids[: rng.randint(0, 12)]
        token_ids = list(prompt)
        detok = IncrementalDetokenizer(decode, len(prompt), token_ids)
        streamed = ""
        while len(token_ids) < len(prompt) + len(output):
            step = rng.randint(1, 3)
            token_ids.extend(output[len(token_ids) - len(prompt) : len(token_ids) - len(prompt) + step])
            streamed += detok.update(token_ids)
        streamed += detok.finish(token_ids)
        assert streamed == detok.text == output_text(tok, prompt, output).rstrip("\ufffd"), (prompt, output)


def test_stop_strings_are_found_across_steps_in_the_new_text_only():
    text = "abc" + "hello wor"
    assert find_stop(text, 4, ("world",)) is None
    text += "ld!"
    assert find_stop(text, 3, ("!", "world")) == ("world", 9)  # the stop that ends first wins
    assert find_stop(text, 3, ("ld!", "o world!", "d!")) == ("ld!", 12)  # on a tie, the first listed (vLLM)
    assert find_stop("xxstop" + "y" * 10, 3, ("stop",)) is None  # old text is not searched again
    # nor is a short stop lying wholly in the old text, whatever the longest stop's length (min_tokens held it)
    assert find_stop(" Paris" + ".\n", 2, ("Paris", "z" * 30)) is None


# ------------------------------------------------------------------------------------------------- sampler
def _filter_one(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The per-row definition, in vLLM's order: temperature, then min-p, top-k (ties at the k-th kept), top-p."""
    logits = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, params.top_k).values[-1], float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def test_batched_filtering_equals_the_per_row_definition():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 300, generator=generator) * 3
    logits[3, :5] = logits[3, 5]  # ties at the k-th value
    rng = random.Random(1)
    params = [SamplingParams(temperature=rng.choice([0.5, 1.0, 1.7]), top_k=rng.choice([-1, 1, 5, 40]),
                             top_p=rng.choice([1.0, 0.9, 0.3]), min_p=rng.choice([0.0, 0.05, 0.2])) for _ in range(12)]
    batched = _filter(logits, params)
    for row, p in enumerate(params):
        expected = _filter_one(logits[row], p)
        assert torch.equal(torch.isinf(batched[row]), torch.isinf(expected)), (row, p)
        assert torch.allclose(batched[row][~torch.isinf(expected)], expected[~torch.isinf(expected)])


def test_top_p_counts_only_what_min_p_left_as_vllm():
    """vLLM applies min-p before top-k/top-p: top-p's mass is that of the min-p survivors, renormalized. Here min-p
    keeps the two best (0.40, 0.24: 0.625 and 0.375 renormalized), and top_p=0.5 then keeps the best alone; top-p
    measured on the whole distribution (0.40 < 0.5) would have kept the second too, drawn 37.5% of the time."""
    logits = torch.tensor([[0.40, 0.24, 0.12, 0.12, 0.12]]).log()
    kept = torch.isfinite(_filter(logits, [SamplingParams(top_p=0.5, min_p=0.5)]))
    assert kept.tolist() == [[True, False, False, False, False]]


def test_batched_penalties_equal_the_per_row_definition():
    """Repetition (prompt + output), presence and frequency (output) penalties of several rows at once equal
    vLLM's per-row definition."""
    from paged_hf.engine.request import Request
    from paged_hf.engine.sampler import _apply_penalties

    generator = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(4, vocab, generator=generator) * 2
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.5, frequency_penalty=0.7),
              SamplingParams(), SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4)]
    seqs = []
    for p in params:
        request = Request("r", None, torch.randint(0, vocab, (6,), generator=generator).tolist(), p)
        seq = request.sequences[0]
        seq.token_ids += torch.randint(0, vocab, (9,), generator=generator).tolist()  # output with repeats
        seqs.append(seq)
    got = _apply_penalties(logits.clone(), [0, 1, 3], seqs, params)
    for row, (p, seq) in enumerate(zip(params, seqs)):
        want = logits[row].clone()
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(seq.token_ids)] = True
        want = torch.where(seen, torch.where(want > 0, want / p.repetition_penalty, want * p.repetition_penalty), want)
        counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=vocab).float()
        want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[row], want)


# ------------------------------------------------------------------------------------------------ logprobs
def plain_forward_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """``[len - 1, vocab]``: log_softmax of one plain sdpa forward over ``token_ids``; row i scores token i + 1."""
    attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1]
    model.set_attn_implementation(attention)
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 7, "block_size": 4},  # chunked prompts
    {"num_blocks": 14, "block_size": 4, "preemption_mode": "recompute"},
    {"num_blocks": 14, "block_size": 4, "preemption_mode": "swap", "swap_space": 0.001},
], ids=["plain", "chunked", "recompute", "swap"])
def test_logprobs_equal_a_plain_forward(stories, options):
    """Output and prompt logprobs (sampled token, its rank, the top k) equal ``log_softmax`` of one plain forward
    over prompt + output within 2e-5, also when the prompt was chunked or the request was preempted."""
    model, tok = stories
    engine = PagedEngine(model, tok, **options)
    prompts = story_openings()[:4]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = engine.generate(prompts, params, use_tqdm=False)
    if options.get("num_blocks"):
        assert engine.get_stats().preemption_count > 0
    for out in outs:
        completion = out.outputs[0]
        reference = plain_forward_logprobs(model, out.prompt_token_ids + completion.token_ids)
        prompt_len = len(out.prompt_token_ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == prompt_len
        positions = [(p, out.prompt_token_ids[p], out.prompt_logprobs[p], 2) for p in range(1, prompt_len)]
        positions += [(prompt_len + i, t, e, 3) for i, (t, e) in enumerate(zip(completion.token_ids,
                                                                                completion.logprobs))]
        for position, token, entry, k in positions:
            row = reference[position - 1]
            assert abs(entry[token].logprob - float(row[token])) < 2e-5
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = torch.topk(row, k)
            assert [t for t, e in entry.items() if e.rank <= k] == top.indices.tolist()
            assert torch.allclose(torch.tensor([entry[t].logprob for t in top.indices.tolist()]), top.values,
                                  atol=2e-5)
        assert abs(completion.cumulative_logprob - sum(e[t].logprob for t, e in zip(completion.token_ids,
                                                                                    completion.logprobs))) < 1e-4
    engine.check_invariants()
    assert engine.get_stats().kv_cache_used == 0


# ----------------------------------------------------------------------------------- once per pool / sizing
def test_kernels_are_chosen_once_per_pool(monkeypatch):
    monkeypatch.setenv("PAGED_HF_KERNELS", "torch")
    storage = paged_hf.quant.make_storage("int8", 4, 8, 2, 16, torch.float32, "cpu")
    monkeypatch.setenv("PAGED_HF_KERNELS", "no-such-side")  # read at every call, this would raise
    storage.write(torch.tensor([0, 9]), torch.randn(2, 2, 16), torch.randn(2, 2, 16))
    assert storage.kernels.triton is False


def test_a_pool_that_cannot_fit_raises_before_allocating(stories):
    model, tok = stories
    with pytest.raises(ValueError, match="num_blocks / memory_budget"):  # at construction, before any forward
        paged_hf.PagedCache(model.config, num_blocks=10**12)
    with pytest.raises(ValueError, match="num_blocks / memory_budget"):
        PagedEngine(model, tok, num_blocks=10**12)
    model.set_attn_implementation("sdpa")


def test_cache_and_engine_statistics_share_their_names(stories):
    shared = {f.name for f in dataclasses.fields(KVCacheStats)}
    assert shared <= {f.name for f in dataclasses.fields(PagedCacheStats)}
    assert shared <= {f.name for f in dataclasses.fields(EngineStats)}
    model, tok = stories
    cache_stats = paged_hf.PagedCache(model.config, num_blocks=8).stats()
    engine_stats = PagedEngine(model, tok, num_blocks=8, swap_space=0).get_stats()
    model.set_attn_implementation("sdpa")
    assert cache_stats.kv_cache_total == engine_stats.kv_cache_total == 8
    assert cache_stats["kv_cache_utilization"] == engine_stats.kv_cache_utilization == 0.0
    assert set(dict(engine_stats)) >= shared | {"kv_cache_utilization", "num_running", "preemption_count"}


@pytest.mark.parametrize("options, message", [
    ({"max_num_seq": 4}, r"PagedEngine has unknown option\(s\) \['max_num_seq'\] \('max_num_seq': did you mean "
                         r"'max_num_seqs'\?\); allowed options are \['block_size', "),
    ({"blocksize": 16, "zzz": 1}, r"unknown option\(s\) \['blocksize', 'zzz'\] \('blocksize': did you mean "
                                  r"'block_size'\?\)"),
])
def test_an_unknown_engine_option_is_named_with_the_closest_valid_one(stories, options, message):
    model, tok = stories
    with pytest.raises(ValueError, match=message):
        PagedEngine(model, tok, **options)
    model.set_attn_implementation("sdpa")


def test_engine_forward_keeps_the_paged_attention_when_another_user_switches_the_model(stories):
    """A model shared with other code (a generate call that switched it to sdpa): the engine's forward switches it
    back instead of attending densely over only the new K/V."""
    model, tok = stories
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = PagedEngine(model, tok)
    expected = engine.generate(["Lily and Tom"], params, use_tqdm=False)[0].outputs[0].token_ids
    model.set_attn_implementation("sdpa")
    again = engine.generate(["Lily and Tom"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == expected and model.config._attn_implementation == "paged"
    model.set_attn_implementation("sdpa")


def test_cpu_threads_bind_pins_the_engine_and_is_checked(stories):
    import os

    model, tok = stories
    with pytest.raises(ValueError, match=r"cpu_threads_bind must be 'auto', 'nobind' or a CPU list such as '0-3'"):
        PagedEngine(model, tok, cpu_threads_bind="first two")
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        torch.set_num_threads(1)
        PagedEngine(model, tok, cpu_threads_bind="auto")  # auto never changes a running program's threads
        assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == affinity
        first = min(affinity)
        engine = PagedEngine(model, tok, cpu_threads_bind=str(first))
        assert engine.cpu_threads == [first] and os.sched_getaffinity(0) == {first} and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="names CPUs .* this process may not run on"):
            PagedEngine(model, tok, cpu_threads_bind=f"{max(affinity) + 1}")
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
        model.set_attn_implementation("sdpa")


def _child_result(code: str):
    """Runs ``code`` in a fresh Python (tests/ importable, no OpenMP settings of this process: its OpenMP runtime
    starts anew) and returns the value of the last line it prints (a ``repr``)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_") and k != "PAGED_HF_START_AFFINITY"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 - our own output


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs this process may run on")
def test_auto_pins_one_thread_per_cpu_while_stepping_and_restores_the_callers_mask():
    """``cpu_threads_bind="auto"`` with 2 intra-op threads: during a step the stepping thread is on the first CPU
    and a worker on the second; after it the caller's mask is what it was (the program's later threads inherit it).
    Runs in a subprocess: pinning this test process's OpenMP team would outlive the test."""
    from paged_hf.kernels import cpu_ext

    if cpu_ext.pin_threads() is None:
        pytest.skip("the CPU kernels cannot be built here")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    code = """
import glob, os, torch
torch.set_num_threads(2)
from models import stories_model, stories_tokenizer
from paged_hf import PagedEngine, SamplingParams
engine = PagedEngine(stories_model(), stories_tokenizer(), enforce_eager=True)
before = os.sched_getaffinity(0)
seen = []
real = engine.runner.execute
def execute(output):
    seen.append(os.sched_getaffinity(0))
    return real(output)
engine.runner.execute = execute
engine.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
masks = [[x for x in open(f) if x.startswith("Cpus_allowed_list")][0].split()[-1]
         for f in glob.glob("/proc/self/task/*/status")]
print(repr((sorted(before), [sorted(m) for m in seen], sorted(os.sched_getaffinity(0)), masks)))
"""
    before, during, after, masks = _child_result(code)
    assert during and all(mask == [cpus[0]] for mask in during)
    assert after == before
    assert str(cpus[1]) in masks


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc/self/task")
def test_the_thread_that_starts_the_server_loop_gives_up_its_openmp_team():
    """libgomp lets an idle OpenMP thread spin before it sleeps only while the process's OpenMP threads fit its CPUs
    (``engine/threads.py``): the thread that built the engine and starts the server's loop ends its team, so the
    loop thread's is the only one, and the loop still serves. Runs in a subprocess with 2 intra-op threads (this
    process runs one, which never starts a team)."""
    code = """
import asyncio, os, time, torch
torch.set_num_threads(2)
from models import stories_model, stories_tokenizer
from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine import RequestOutputKind
from paged_hf.server.engine_loop import EngineLoop
engine = PagedEngine(stories_model(), stories_tokenizer(), enforce_eager=True)
x = torch.randn(1 << 22)
(x * 2).sum()  # a parallel region in this thread: its team has one worker from now on
tasks = lambda: set(os.listdir("/proc/self/task"))
before = tasks()
loop = EngineLoop(engine)
loop.start()
time.sleep(0.2)
ended = before - tasks()
async def one():
    [(_, outputs)] = await loop.submit(["Once upon a time"], [SamplingParams(max_tokens=4, temperature=0.0)],
                                       RequestOutputKind.FINAL_ONLY)
    while not (out := await outputs.get()).finished:
        pass
    return len(out.outputs[0].token_ids)
print(repr((len(ended), asyncio.run(one()))))
loop.stop()
"""
    ended, generated = _child_result(code)
    assert ended == 1, "the starting thread's OpenMP worker should have exited"
    assert generated == 4
