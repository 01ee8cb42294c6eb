"""Speculative decoding by a draft model: the engine with ``{"method": "draft_model", ...}`` emits what it emits
without speculation.

Two drafts for stories260K: stories260K itself (its greedy drafts are the target's tokens: acceptance near 1, so
long accepted runs and the draft's catch-up after them are exercised) and a random tiny llama of its vocabulary
(drafts mostly rejected: the draft's K/V is rolled back at almost every step). Greedy output is token for token
(and logprob for logprob) that of the engine without speculation, with chunked prefill, ``n > 1`` and preemption
by recompute in the mix; the draft's pool holds no block once the engine is idle. Sampling keeping the target's
distribution reuses the chi-square test of ``test_spec_decode_distribution.py`` with a draft model.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine.spec.draft_model import DraftModelProposer, load_draft_model
from models import require_stories, sample_stories, stories_model, stories_tokenizer, tiny_model, token_logprobs
from test_spec_decode_distribution import (NUM_OUTPUT, PROMPT, TEMPERATURE, VOCAB, chi_square_bound, exact_law,
                                          pooled_chi_square)


def draft_config(model, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "min_acceptance_rate": 0.0,
            "auto_disable": False}


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


@pytest.fixture(scope="module")
def drafts(stories):
    """The drafts by name: stories260K for itself, and a random llama of its vocabulary."""
    return {"self": stories_model("sdpa"), "random": tiny_model("llama", vocab_size=512, seed=1)}


@pytest.fixture(scope="module")
def prompts():
    return [s[:200] for s in sample_stories()[:5]] + ["Once upon a time", "Tom had a red ball."]


def drafter(engine) -> DraftModelProposer:
    return engine.scheduler.speculator.drafter


def run(engine, prompts, params):
    outs = engine.generate(prompts, params, use_tqdm=False)
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_used"] == 0
    pool = drafter(engine).kv if engine.config.speculative_config is not None else None
    if pool is not None:  # no draft block leaked: every sequence's draft K/V was freed when it finished
        assert pool.num_free_blocks == pool.num_total_blocks and not pool.live_sequences()
        assert not drafter(engine).states
    return outs


def same(a, b):
    for x, y in zip(a, b):
        assert x.error is None and y.error is None
        assert len(x.outputs) == len(y.outputs)
        for cx, cy in zip(x.outputs, y.outputs):
            assert cy.token_ids == cx.token_ids
            assert (cy.text, cy.finish_reason) == (cx.text, cx.finish_reason)
            if cx.logprobs is not None:
                torch.testing.assert_close(token_logprobs(cy), token_logprobs(cx), atol=2e-5, rtol=0)


@pytest.mark.parametrize("options", [
    dict(block_size=4, num_blocks=512),
    dict(block_size=4, num_blocks=512, max_num_batched_tokens=24),  # chunked prefill beside verified runs
    dict(block_size=16, num_blocks=14, preemption_mode="recompute", enable_prefix_caching=False),
], ids=["roomy", "chunked", "recompute"])
@pytest.mark.parametrize("which", ["self", "random"])
def test_greedy_equals_no_speculation(stories, drafts, prompts, options, which):
    model, tok = stories
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1, n=2)
    expected = run(PagedEngine(model, tok, enforce_eager=True, **options), prompts, params)
    spec = PagedEngine(model, tok, enforce_eager=True, speculative_config=draft_config(drafts[which]), **options)
    same(expected, run(spec, prompts, params))
    stats = spec.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 100
    if which == "self":  # greedy drafts of the target itself: a wrong draft K/V would show as rejections
        assert stats["spec_decode_num_accepted_tokens"] > 0.95 * stats["spec_decode_num_draft_tokens"]
    if options["num_blocks"] < 100:
        assert stats["preemption_count"] > 0


def test_preemption_by_recompute_and_abort_free_the_draft_kv(stories, drafts, prompts):
    """A sequence preempted by recompute holds no draft K/V while it waits (it computes it again when it runs), and
    an aborted request frees its samples' draft K/V."""
    model, tok = stories
    spec = PagedEngine(model, tok, enforce_eager=True, block_size=16, num_blocks=14, preemption_mode="recompute",
                       enable_prefix_caching=False, speculative_config=draft_config(drafts["self"]))
    ids = [spec.add_request(p, SamplingParams(max_tokens=40, temperature=0.0, n=2)) for p in prompts]
    waited = 0
    for _ in range(12):
        spec.step()
        preempted = [s for s in spec.scheduler.waiting if s.request.metrics.num_preemptions]
        waited += len(preempted)
        assert not any(id(s) in drafter(spec).states for s in preempted)
    assert waited > 0 and drafter(spec).states
    for request_id in ids:
        spec.abort(request_id)
    assert not drafter(spec).states and not drafter(spec).kv.live_sequences()
    spec.check_invariants()


class FakeSequence:
    """What the proposer reads of a sequence: its tokens."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


def test_proposals_are_the_draft_models_greedy_continuation():
    """Whatever part of its drafts a sequence then takes (none, some, all, with another token after them, or more
    tokens of steps without drafts), the next proposal is the draft model's own greedy continuation of the sequence
    (a dense forward per token): the draft K/V is rolled back to the tokens the sequence repeats and caught up on
    the rest, and holds no more than its tokens and drafts."""
    paged = tiny_model("llama", vocab_size=64, seed=2)
    dense = tiny_model("llama", attn_implementation="sdpa", vocab_size=64, seed=2)
    proposer = DraftModelProposer(load_draft_model(paged, dense), num_blocks=64, block_size=4,
                                  max_num_batched_tokens=2048)
    rng = torch.Generator().manual_seed(0)
    seqs = [FakeSequence(torch.randint(0, 64, (n,), generator=rng).tolist()) for n in (1, 5, 9)]

    def greedy(tokens: list[int], n: int) -> tuple[int, ...]:
        out = list(tokens)
        with torch.no_grad():
            for _ in range(n):
                out.append(int(dense(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
        return tuple(out[len(tokens):])

    for step in range(8):
        wanted = [(seq, 1 + (step + i) % 3) for i, seq in enumerate(seqs)]
        proposals = proposer.propose(wanted)
        for seq, n in wanted:
            assert proposals[id(seq)] == greedy(seq.token_ids, n)
            assert proposer.states[id(seq)][1].kv.num_tokens == len(seq.token_ids) + n - 1  # rolled back, not grown
            taken = int(torch.randint(0, n + 1, (1,), generator=rng))
            others = 1 + 2 * (step % 3 == 2)  # sometimes steps without drafts follow
            seq.token_ids += list(proposals[id(seq)][:taken]) + torch.randint(0, 64, (others,), generator=rng).tolist()
        if step == 4:  # a sequence preempted by recompute: its draft K/V is computed again from its start
            proposer.release(seqs[0])
        proposer.check_invariants()
    for seq in seqs:
        proposer.release(seq)
    assert proposer.kv.num_free_blocks == proposer.kv.num_total_blocks and not proposer.kv.live_sequences()


def test_a_proposal_without_room_leaves_the_draft_kv_consistent():
    """A sequence that takes exactly its drafts, then asks for more drafts than the pool holds, proposes nothing;
    its next proposal (with room) is still the draft's greedy continuation."""
    paged = tiny_model("llama", vocab_size=64, seed=2)
    dense = tiny_model("llama", attn_implementation="sdpa", vocab_size=64, seed=2)
    proposer = DraftModelProposer(load_draft_model(paged, dense), num_blocks=3, block_size=4,
                                  max_num_batched_tokens=2048)
    seq = FakeSequence([3, 14, 15, 9, 26])
    seq.token_ids += list(proposer.propose([(seq, 3)])[id(seq)][:2])  # its K/V holds 5 tokens and these 2 drafts
    assert proposer.propose([(seq, 7)]) == {}  # 6 + 7 tokens: more than the 12 of the pool
    seq.token_ids.append(5)
    with torch.no_grad():
        expected = int(dense(input_ids=torch.tensor([seq.token_ids])).logits[0, -1].argmax())
    assert proposer.propose([(seq, 1)]) == {id(seq): (expected,)}
    assert proposer.states[id(seq)][1].kv.num_tokens == len(seq.token_ids)  # a slot for every token it computed
    proposer.check_invariants()


def test_a_full_draft_pool_proposes_nothing_and_fails_no_request(stories, drafts, prompts):
    """A draft pool of 3 blocks of 4 tokens holds only the short prompts' first tokens: the rest proposes nothing,
    and the output is the same."""
    model, tok = stories
    params = SamplingParams(max_tokens=24, temperature=0.0)
    expected = run(PagedEngine(model, tok, enforce_eager=True, block_size=4, num_blocks=256), prompts, params)
    spec = PagedEngine(model, tok, enforce_eager=True, block_size=4, num_blocks=256,
                       speculative_config=draft_config(drafts["self"]))
    spec.scheduler.speculator.drafter = DraftModelProposer(drafts["self"], num_blocks=3, block_size=4,
                                                                 max_num_batched_tokens=2048)
    same(expected, run(spec, prompts, params))
    assert 0 < spec.get_stats()["spec_decode_num_draft_tokens"] < 30


def test_draft_model_from_a_folder(stories, prompts):
    model, tok = stories
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = run(PagedEngine(model, tok, enforce_eager=True, num_blocks=128), prompts[:2], params)
    spec = PagedEngine(model, tok, enforce_eager=True, num_blocks=128,
                       speculative_config=draft_config(str(require_stories())))
    same(expected, run(spec, prompts[:2], params))
    assert spec.get_stats()["spec_decode_num_accepted_tokens"] > 10


def test_the_target_drafting_for_itself_in_one_object(stories, prompts):
    """The same loaded model as target and draft: two pools, one set of weights."""
    model, tok = stories
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = run(PagedEngine(model, tok, enforce_eager=True, num_blocks=128), prompts[:3], params)
    spec = PagedEngine(model, tok, enforce_eager=True, num_blocks=128, speculative_config=draft_config(model))
    same(expected, run(spec, prompts[:3], params))
    stats = spec.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 20


def test_serve_takes_a_draft_model_folder_as_json():
    import paged_hf_cli  # noqa: PLC0415
    from paged_hf import cli  # noqa: PLC0415

    folder = str(require_stories())
    text = f'{{"method": "draft_model", "model": "{folder}", "num_speculative_tokens": 2}}'
    args = paged_hf_cli.build_parser().parse_args(["serve", "--speculative-config", text])
    options = cli._engine_options(args)["speculative_config"]
    engine = PagedEngine(stories_model("sdpa"), None, enforce_eager=True, num_blocks=32, speculative_config=options)
    assert engine.scheduler.speculator.drafter is not None


def test_a_draft_of_another_vocabulary_is_refused(stories):
    model, tok = stories
    with pytest.raises(ValueError, match=r"speculative_config\['model'\] must have the target's vocabulary: its "
                                         r"vocab_size is 1000, the target's 512"):
        PagedEngine(model, tok, enforce_eager=True, num_blocks=16,
                    speculative_config=draft_config(tiny_model("llama", vocab_size=1000)))


def test_sampling_with_a_draft_model_keeps_the_target_distribution():
    """The chi-square test of the n-gram method, with a random draft of the same 4 tokens (accepted often, not
    always), at fewer samples."""
    target = tiny_model("llama", attn_implementation="sdpa", vocab_size=VOCAB, seed=3)
    draft = tiny_model("llama", attn_implementation="sdpa", vocab_size=VOCAB, seed=4, num_hidden_layers=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(5.0)
    torch.manual_seed(0)
    engine = PagedEngine(target, None, enforce_eager=True, block_size=2, num_blocks=4096, max_num_seqs=256,
                         max_num_batched_tokens=4096, speculative_config=draft_config(draft))
    params = SamplingParams(n=100, max_tokens=NUM_OUTPUT, temperature=TEMPERATURE, ignore_eos=True)
    samples = Counter()
    for _ in range(4):
        outs = run(engine, [PROMPT] * 10, params)
        samples.update(tuple(c.token_ids) for out in outs for c in out.outputs)
    stats = engine.get_stats()
    assert 300 < stats["spec_decode_num_accepted_tokens"] < 0.9 * stats["spec_decode_num_draft_tokens"]
    law = exact_law(target)
    statistic, cells = pooled_chi_square(law, samples)
    assert cells > 10
    assert statistic < chi_square_bound(cells - 1), (statistic, cells)
