"""Sampling with speculation keeps the target's distribution: a chi-square test on a tiny vocabulary.

A random llama with 4 tokens (its output layer scaled so the distributions are far from uniform) continues a prompt
that repeats itself, so n-gram drafts are proposed at every position and accepted often, not always. The joint law
of the first four output tokens drawn by the engine with speculation (thousands of samples) is compared with the
exact law of the model, computed by enumerating every prefix in one plain forward.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from paged_hf import PagedEngine, SamplingParams
from models import tiny_model

VOCAB = 4
NUM_OUTPUT = 4
PROMPT = [1, 3, 0, 2, 1, 3, 0, 2, 1, 3]  # every token occurs: every suffix has a draft
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", attn_implementation="sdpa", vocab_size=VOCAB, seed=3)
    with torch.no_grad():
        m.lm_head.weight.mul_(5.0)
    return m


def exact_law(model) -> dict[tuple[int, ...], float]:
    """P(output tokens = t) for every ``t`` in VOCAB^NUM_OUTPUT: softmax(logits / T) chained along each prefix."""
    paths = list(itertools.product(range(VOCAB), repeat=NUM_OUTPUT))
    ids = torch.tensor([PROMPT + list(p) for p in paths])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
    logprobs = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    start = len(PROMPT) - 1
    law = {}
    for row, path in enumerate(paths):
        law[path] = math.exp(sum(logprobs[row, start + j, token].item() for j, token in enumerate(path)))
    return law


def chi_square_bound(df: int, z: float = 3.719) -> float:
    """The chi-square quantile of ``df`` degrees of freedom at the normal quantile ``z`` (3.719: p = 1e-4), by
    Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def pooled_chi_square(law: dict[tuple[int, ...], float], samples: Counter) -> tuple[float, int]:
    """Pearson's statistic of ``samples`` against ``law`` and its number of cells; the paths expected fewer than 5
    times are pooled into one cell."""
    total = sum(samples.values())
    statistic, pooled_expected, pooled_observed, cells = 0.0, 0.0, 0, 0
    for path, p in law.items():
        expected = p * total
        if expected < 5:
            pooled_expected += expected
            pooled_observed += samples.get(path, 0)
            continue
        statistic += (samples.get(path, 0) - expected) ** 2 / expected
        cells += 1
    if pooled_expected > 0:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        cells += 1
    return statistic, cells


def test_sampling_with_speculation_keeps_the_target_distribution(model):
    torch.manual_seed(0)
    engine = PagedEngine(model, None, enforce_eager=True, block_size=2, num_blocks=4096, max_num_seqs=256,
                         max_num_batched_tokens=4096,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                             "prompt_lookup_min": 1, "min_acceptance_rate": 0.0,
                                             "auto_disable": False})
    params = SamplingParams(n=100, max_tokens=NUM_OUTPUT, temperature=TEMPERATURE, ignore_eos=True)
    samples = Counter()
    for _ in range(6):  # 1000 sequences at a time leave the token budget room for their drafts
        outs = engine.generate([PROMPT] * 10, params, use_tqdm=False)
        engine.check_invariants()
        samples.update(tuple(c.token_ids) for out in outs for c in out.outputs)
    total = sum(samples.values())
    stats = engine.get_stats()
    assert 1000 < stats["spec_decode_num_accepted_tokens"] < 0.9 * stats["spec_decode_num_draft_tokens"], \
        "the drafts must be both accepted and rejected, many times"
    assert stats["spec_decode_num_drafts"] > total  # more than one verified run per sample

    law = exact_law(model)
    assert abs(sum(law.values()) - 1) < 1e-9
    statistic, cells = pooled_chi_square(law, samples)
    assert cells > 20
    assert statistic < chi_square_bound(cells - 1), (statistic, cells)
