"""The runner's persistent decode batch (``engine/decode_batch.py``) under every event that changes the running set.

Random interleavings of admissions (some with ``n > 1``, logprobs, seeded sampling, shared prefixes), aborts, steps,
a small pool (preemption by recompute or swap) and chunked prefill: after every step the batch that may run the next
step equals a rebuild from the sequences (``check_invariants`` runs ``DecodeBatch.check``), and every step's outputs
equal those of the same engine without any persistent batch (every step on the general paths)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unittest import mock

from models import tiny_model
from paged_hf import PagedEngine, SamplingParams
from paged_hf.engine.decode_batch import DecodeBatch
from paged_hf.engine.request import RequestOutputKind

KINDS = [RequestOutputKind.FINAL_ONLY, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE,
         RequestOutputKind.DELTA]

ENGINES = {
    "recompute, prefix caching": dict(preemption_mode="recompute", enable_prefix_caching=True),
    "swap": dict(preemption_mode="swap", enable_prefix_caching=False, swap_space=0.001),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", attn_implementation="paged")


_add = st.tuples(st.just("add"), st.integers(1, 14), st.integers(1, 16), st.sampled_from([1, 1, 2]),
                 st.sampled_from(["greedy", "greedy", "seeded", "logprobs", "min_tokens", "stops"]),
                 st.sampled_from(KINDS))
_events = st.lists(st.one_of(_add, st.tuples(st.just("abort"), st.integers(0, 50)), st.just(("step",)),
                             st.just(("step",)), st.just(("step",))), min_size=4, max_size=40)


def _params(kind: str, max_tokens: int, n: int, index: int) -> SamplingParams:
    if kind == "seeded":
        return SamplingParams(max_tokens=max_tokens, n=n, temperature=0.8, seed=index)
    if kind == "logprobs":
        return SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, logprobs=2)
    if kind == "min_tokens":
        return SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, min_tokens=max_tokens // 2,
                              stop_token_ids=[5, 6, 7])
    if kind == "stops":  # a third of the vocabulary ends it, once 3 tokens are out: mostly in a steady decode step
        return SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, min_tokens=min(3, max_tokens),
                              stop_token_ids=list(range(8, 512, 3)))
    return SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, stop_token_ids=[3])


def _run(model, options: dict, events, reuse: bool) -> tuple[list, int, int]:
    """Every step's outputs as ``(request id, [token ids per sample], finished)``, the steps the batch ran and the
    preemptions. ``reuse=False``: no step has a persistent batch (the runner and the scheduler's general paths)."""
    if not reuse:
        with mock.patch.object(DecodeBatch, "of", return_value=None):
            return _run(model, options, events, reuse=True)
    engine = PagedEngine(model, None, block_size=4, num_blocks=14, max_num_seqs=6, max_num_batched_tokens=24,
                         max_model_len=64, enforce_eager=True, **options)
    ran = []
    plan_batch = engine.runner._plan_batch
    engine.runner._plan_batch = lambda *args: (ran.append(1), plan_batch(*args))[1]
    added, log = [], []

    def step():
        for out in engine.step():
            log.append((out.request_id, [o.token_ids for o in out.outputs], out.finished))
        engine.check_invariants()

    for index, event in enumerate(events):
        if event[0] == "add":
            _, length, max_tokens, n, kind, output_kind = event
            prompt = [1] + [(7 * index + j) % 5 + 8 if j < 8 else (index + j) % 90 + 8 for j in range(length)]
            added.append(engine.add_request(prompt, _params(kind, max_tokens, n, index), output_kind=output_kind))
        elif event[0] == "abort" and added:
            engine.abort(added[event[1] % len(added)])
            engine.check_invariants()
        else:
            step()
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        step()
    assert not engine.has_unfinished_requests(), "the requests should finish within 400 steps"
    assert engine.get_stats()["kv_cache_used"] == 0
    return log, len(ran), engine.get_stats()["preemption_count"]


@pytest.mark.parametrize("options", ENGINES.values(), ids=ENGINES.keys())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=_events)
def test_batch_equals_a_rebuild_at_every_step(model, options, events):
    reused, _, preempted = _run(model, options, events, reuse=True)
    rebuilt, _, again = _run(model, options, events, reuse=False)
    assert reused == rebuilt and preempted == again


@pytest.mark.parametrize("options", ENGINES.values(), ids=ENGINES.keys())
def test_steady_decodes_run_from_the_batch(model, options):
    """Four greedy requests decoding together in a pool too small for all of them: most decode steps run from the
    batch, and the preemptions, finishes and the abort in between make the next step rebuild it."""
    events = [("add", 6, 12, 1, "greedy", RequestOutputKind.FINAL_ONLY)] * 3 + \
        [("add", 6, 12, 1, "min_tokens", RequestOutputKind.FINAL_ONLY)] + \
        [("add", 5, 12, 1, "stops", RequestOutputKind.FINAL_ONLY)] * 2 + [("step",)] * 14 + [("abort", 1)] + \
        [("step",)] * 3
    reused, ran, preempted = _run(model, options, events, reuse=True)
    rebuilt, _, again = _run(model, options, events, reuse=False)
    assert reused == rebuilt and preempted == again
    assert preempted > 0, "the pool should be too small for the four requests"
    assert ran >= 8, f"the steady decode steps should run from the persistent batch (ran {ran})"


def test_a_stale_batch_is_caught(model):
    """``check`` compares every row with its sequence: a batch left one token behind fails it."""
    engine = PagedEngine(model, None, block_size=4, num_blocks=40, max_num_seqs=4, enforce_eager=True)
    for i in range(3):
        engine.add_request([1, 9 + i, 20, 30], SamplingParams(max_tokens=8, temperature=0.0))
    for _ in range(3):
        engine.step()
    batch = engine.runner.batch
    assert isinstance(batch, DecodeBatch) and batch.epoch == engine.scheduler.epoch
    engine.check_invariants()
    batch.positions = batch.positions - 1
    with pytest.raises(AssertionError, match="stale"):
        engine.check_invariants()


def test_a_prompt_its_last_chunk_completes_as_a_decode_forks(model):
    """An ``n = 2`` prompt of 24 tokens beside a decode under a budget of 24: its last prompt token is a one-token
    chunk, scheduled with the running decodes, and its other sample forks from it then (the decodes' fast path must
    see it)."""
    events = [("add", 6, 8, 1, "greedy", RequestOutputKind.FINAL_ONLY), ("step",), ("step",),
              ("add", 23, 4, 2, "greedy", RequestOutputKind.FINAL_ONLY)]
    reused, _, _ = _run(model, ENGINES["swap"], events, reuse=True)
    rebuilt, _, _ = _run(model, ENGINES["swap"], events, reuse=False)
    assert reused == rebuilt
    finals = {request_id: samples for request_id, samples, finished in reused if finished}
    assert [len(tokens) for tokens in finals["1"]] == [4, 4], finals
