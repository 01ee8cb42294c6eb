"""Draft-model details: the draft's catch-up bounded by the step's tokens, its compiled forward, the refusal under
tensor parallelism, the layer-truncated (early-exit) draft, and a speculating step with nothing proposed scheduled
as a step without speculation. Greedy output stays token for token that of the engine without speculation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine.spec.early_exit import early_exit_draft
from models import STORIES, require_stories, sample_stories, stories_model, stories_tokenizer
from test_spec_draft import draft_config, drafter, run, same

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


@pytest.fixture(scope="module")
def prompts():
    return [s[:200] for s in sample_stories()[:4]] + ["Once upon a time"]


def test_catch_up_chunks_stay_within_the_step_budget(stories, prompts):
    """Prompts of ~60 tokens, 24 tokens a step: the draft's first forward of a step never computes more than 24
    tokens (its prompt catch-up is spread over steps), and proposals still flow."""
    model, tok = stories
    options = dict(enforce_eager=True, block_size=4, num_blocks=512, max_num_batched_tokens=24)
    base = PagedEngine(model, tok, **options)
    spec = PagedEngine(model, tok, speculative_config=draft_config(stories_model("sdpa")), **options)
    proposer = drafter(spec)
    sizes = []
    forward = proposer._forward

    def recorded(kvs, starts, counts, tokens):
        sizes.append(sum(counts))
        return forward(kvs, starts, counts, tokens)

    proposer._forward = recorded
    same(run(base, prompts, GREEDY), run(spec, prompts, GREEDY))
    assert max(len(tok(p)["input_ids"]) for p in prompts) > 24
    assert sizes and max(sizes) <= 24
    assert spec.get_stats()["spec_decode_num_accepted_tokens"] > 0


def test_the_draft_runs_compiled_when_the_engine_compiles(stories, prompts):
    model, tok = stories
    options = dict(block_size=4, num_blocks=512)
    base = PagedEngine(model, tok, enforce_eager=True, **options)
    spec = PagedEngine(model, tok, speculative_config=draft_config(stories_model("sdpa")), **options)
    assert drafter(spec).runner.compiled is not None
    same(run(base, prompts, GREEDY), run(spec, prompts, GREEDY))
    assert drafter(spec).runner.compiled is not None  # no fallback to eager on the way
    assert spec.get_stats()["spec_decode_num_accepted_tokens"] > 0
    eager = PagedEngine(model, tok, enforce_eager=True, speculative_config=draft_config(stories_model("sdpa")),
                        **options)
    assert drafter(eager).runner.compiled is None


def test_a_draft_model_under_tensor_parallelism_is_refused_before_any_process_starts():
    require_stories()
    with pytest.raises(ValueError, match=r"speculative_config\['method'\] 'draft_model' .*tensor_parallel_size=2"):
        PagedEngine.from_pretrained(str(STORIES), tensor_parallel_size=2,
                                    speculative_config={"method": "draft_model", "model": str(STORIES)})


def test_early_exit_draft_is_the_first_layers_then_the_norm_and_head(stories):
    """Its logits are the target's hidden state after layer ``n``, through the target's final norm and lm_head;
    its modules are the target's (no weight copied)."""
    model, tok = stories
    ids = tok(sample_stories()[0][:120], return_tensors="pt")["input_ids"]
    for num_layers in (1, 2, 4):
        draft = early_exit_draft(model, num_layers)
        assert draft.config.num_hidden_layers == num_layers and model.config.num_hidden_layers == 5
        assert draft.lm_head is model.lm_head and draft.model.layers[0] is model.model.layers[0]
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states[num_layers]
            expected = model.lm_head(model.model.norm(hidden))
            torch.testing.assert_close(draft(ids).logits, expected, atol=1e-5, rtol=0)
    assert sum(p.numel() for p in model.parameters()) == 260032  # the target is untouched


def test_early_exit_draft_speculates_exactly(stories, prompts):
    model, tok = stories
    target = stories_model("sdpa")  # its own object: the draft shares its modules
    options = dict(enforce_eager=True, block_size=4, num_blocks=512)
    base = PagedEngine(model, tok, **options)
    spec = PagedEngine(target, tok, speculative_config=draft_config(early_exit_draft(target, 3)), **options)
    same(run(base, prompts, GREEDY), run(spec, prompts, GREEDY))
    assert spec.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert drafter(spec).kv.text_config.num_hidden_layers == 3  # its pool holds K/V for its 3 layers only


@settings(max_examples=25, deadline=None)
@given(st.one_of(st.integers(-3, 8), st.booleans(), st.floats(0, 5), st.text(max_size=2)))
def test_early_exit_draft_refuses_a_bad_layer_count(stories, num_layers):
    model, _ = stories
    if isinstance(num_layers, int) and not isinstance(num_layers, bool) and 1 <= num_layers <= 4:
        assert early_exit_draft(model, num_layers).config.num_hidden_layers == num_layers
    else:
        with pytest.raises(ValueError, match=r"num_layers must be an int in \[1, 4\]"):
            early_exit_draft(model, num_layers)


def test_a_speculating_step_with_nothing_proposed_schedules_as_without(stories, prompts, monkeypatch):
    """N-gram lookup finding nothing: no step asks for a sequence's drafts (the one-pass decode path, as without
    speculation)."""
    import paged_hf.engine.spec.speculator as speculator_module

    model, tok = stories
    spec = PagedEngine(model, tok, enforce_eager=True, block_size=4, num_blocks=512,
                       speculative_config={"method": "ngram", "auto_disable": False})
    monkeypatch.setattr(speculator_module, "propose_ngram", lambda *args: [])
    asked = []
    monkeypatch.setattr(spec.scheduler.speculator, "propose", lambda seq, room, max_len: asked.append(seq) or ())
    base = PagedEngine(model, tok, enforce_eager=True, block_size=4, num_blocks=512)
    expected = base.generate(prompts, GREEDY, use_tqdm=False)
    same(expected, spec.generate(prompts, GREEDY, use_tqdm=False))
    spec.check_invariants()
    assert not asked and spec.get_stats()["spec_decode_num_drafts"] == 0


def test_a_bfloat16_draft_of_the_targets_weights_speculates_exactly(stories, prompts):
    """The target's own weights in bfloat16 drafting for it in float32: its pool is bfloat16, its drafts are
    mostly accepted, and the output is the float32 engine's."""
    model, tok = stories
    options = dict(enforce_eager=True, block_size=4, num_blocks=512)
    base = PagedEngine(model, tok, **options)
    spec = PagedEngine(model, tok, speculative_config=draft_config(stories_model("sdpa").to(torch.bfloat16)),
                       **options)
    same(run(base, prompts, GREEDY), run(spec, prompts, GREEDY))
    stats = spec.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_draft_tokens"] / 2
    storages = [storage for group in drafter(spec).kv.groups for storage in group.storages.values()]
    assert storages and all(storage.key_cache.dtype == torch.bfloat16 for storage in storages)


def test_batch_progress_is_the_longest_budgets_step():
    """Where nothing waits the switch counts a step by how much closer the batch's end came: the tokens of the
    sequence with the longest budget left, not those of sequences ahead of it."""
    from types import SimpleNamespace

    from paged_hf.engine.request import SequenceStatus
    from paged_hf.engine.spec.speculator import batch_progress

    def seq(max_tokens, num_output, finished=False):
        status = SequenceStatus.FINISHED if finished else SequenceStatus.RUNNING
        return SimpleNamespace(request=SimpleNamespace(params=SimpleNamespace(max_tokens=max_tokens)),
                               num_output_tokens=num_output, status=status)

    def step(seqs, emitted):  # emitted[i]: tokens seqs[i] gained (its output counts include them); 1: no drafts
        runs = [SimpleNamespace(seq=s, token_ids=[0] * e) for s, e in zip(seqs, emitted) if e > 1]
        return batch_progress([SimpleNamespace(seq=s) for s in seqs], runs)

    lagging, ahead = seq(100, 10), seq(100, 30)
    assert step([lagging, ahead], [1, 1]) == 1  # no drafts: one token closer
    assert step([lagging, ahead], [1, 5]) == 1  # the one ahead gained 5: the end came no closer
    assert step([lagging, ahead], [3, 5]) == 3
    assert step([seq(100, 12), seq(100, 11)], [3, 2]) == 2  # both 9 tokens in before: the slower one counts
    assert step([seq(100, 99, finished=True)], [4]) == 5  # it finished (EOS): its whole budget is gone


def test_the_switch_counts_a_closed_batch_by_its_end(stories, monkeypatch):
    """A closed batch where drafts run ahead only for sequences other than the last: with nothing waiting, the
    switch is handed each step's progress of the batch's end, not its tokens."""
    import paged_hf.engine.spec.speculator as speculator_module

    model, tok = stories
    spec = PagedEngine(model, tok, enforce_eager=True, block_size=4, num_blocks=512,
                       speculative_config={"method": "ngram", "auto_disable": True, "min_acceptance_rate": 0.0})
    handed = []
    record = spec.scheduler.speculator.switch.record
    monkeypatch.setattr(spec.scheduler.speculator.switch, "record",
                        lambda mode, seconds, tokens, seqs: handed.append(tokens) or record(mode, seconds, tokens,
                                                                                            seqs))
    counted = []
    progress = speculator_module.batch_progress
    monkeypatch.setattr(speculator_module, "batch_progress", lambda s, v: counted.append(len(s) * progress(s, v))
                        or progress(s, v))
    spec.generate([f"{s[:300]} {s[:60]}" for s in sample_stories()[:4]], GREEDY, use_tqdm=False)
    assert handed and handed == counted  # every measured step: sequences x progress, nothing waiting


def test_a_draft_shorter_than_the_context_drafts_where_it_can_and_a_failing_draft_stops_drafting(stories, prompts,
                                                                                                caplog):
    """A draft of 48 positions (GPT-2's learned position table) drafts for the sequences it covers and leaves the
    longer ones to decode alone (its table would raise past them); a draft whose forward raises is logged, speculation stops, and every
    request ends with the tokens of the engine without speculation. Both leave the draft pool empty."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model, tok = stories
    torch.manual_seed(1)
    short = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=48, n_embd=64, n_layer=2, n_head=4)).eval()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    options = dict(enforce_eager=True, block_size=4, num_blocks=512)
    expected = run(PagedEngine(model, tok, **options), prompts, params)
    engine = PagedEngine(model, tok, speculative_config=draft_config(short), **options)
    same(expected, run(engine, prompts, params))
    assert engine.get_stats()["spec_decode_num_draft_tokens"] > 0 and not engine.scheduler.speculator.disabled
    assert max(len(o.prompt_token_ids) for o in expected) + 30 > 48  # some sequences outgrow the draft
    failing = PagedEngine(model, tok, speculative_config=draft_config(stories_model("sdpa")), **options)
    calls = {"n": 0}
    forward = drafter(failing).runner.run

    def breaks_on_the_fifth(step_input):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("draft out of memory")
        return forward(step_input)

    drafter(failing).runner.run = breaks_on_the_fifth
    with caplog.at_level("ERROR", logger="paged_hf"):
        outs = failing.generate(prompts, params, use_tqdm=False)
    same(expected, outs)
    assert failing.scheduler.speculator.disabled and failing.scheduler.speculator.drafter is None
    assert "the draft model's forward failed" in caplog.text and "draft out of memory" in caplog.text
    failing.check_invariants()


def test_the_memory_budget_holds_the_draft_pool_too(stories):
    from paged_hf.config import GIB

    model, tok = stories
    budget = 0.01
    plain = PagedEngine(model, tok, enforce_eager=True, kv_cache_memory=budget)
    engine = PagedEngine(model, tok, enforce_eager=True, kv_cache_memory=budget,
                         speculative_config=draft_config(stories_model("sdpa")))
    draft_pool = drafter(engine).kv
    both = engine.kv.stats().kv_cache_bytes + draft_pool.stats().kv_cache_bytes
    assert both <= budget * GIB and draft_pool.num_total_blocks == engine.kv.num_total_blocks
    assert engine.kv.num_total_blocks <= plain.kv.num_total_blocks // 2 + 1  # the same model drafts: half each


def test_a_sliding_window_draft_frees_the_blocks_behind_its_window():
    """The draft's pool slides as the target's does: a long output keeps drafting from a small pool."""
    from models import tiny_model

    target = tiny_model("mistral", attn_implementation="sdpa", sliding_window=4, vocab_size=512)
    draft = tiny_model("mistral", attn_implementation="sdpa", sliding_window=4, vocab_size=512)
    tok = stories_tokenizer()
    engine = PagedEngine(target, tok, enforce_eager=True, block_size=2, num_blocks=24,
                         speculative_config=draft_config(draft, k=2))
    engine.add_request("Once upon a time", SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    for _ in range(200):
        engine.step()
        assert drafter(engine).kv.num_total_blocks - drafter(engine).kv.num_free_blocks <= 6
        if not engine.has_unfinished_requests():
            break
    # the draft is the target's copy: every step drafts 2 tokens and both are accepted, to the end (a draft pool
    # that filled would stop drafting after about 20 of them)
    assert engine.get_stats()["spec_decode_num_draft_tokens"] >= 70 and not engine.has_unfinished_requests()
    engine.check_invariants()
