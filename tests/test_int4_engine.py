"""int4 KV in the engine: forks and swap carry each sequence's full-precision tail row.

1. ``n > 1`` forks a sequence whose last block is partly full: the child's tail row starts as a copy of the
   parent's. Greedy samples therefore all equal the ``n = 1`` output.
2. Swap preemption moves a sequence's tail row to a CPU tail slot and back: the outputs equal a run on a pool
   large enough for no preemption.
(Prefix hits per format, int4 included: ``test_quant_end_to_end.py``.)
Outputs of different batch compositions are compared with a tolerance: a batch's shape changes the float K/V in the
last bits, and an int4 code that flips moves a value by a whole step (measured differences up to ~1e-4).
"""

from __future__ import annotations

import pytest
import torch

from paged_hf import PagedEngine, SamplingParams
from models import stories_model, stories_tokenizer, story_openings, token_logprobs

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


@pytest.mark.parametrize("options", [
    {"num_blocks": 64},
    {"num_blocks": 11, "preemption_mode": "swap", "swap_space": 0.001},
], ids=["roomy", "swap"])
def test_forks_and_swap_carry_the_tail(stories, options):
    model, tok = stories
    prompts = [story_openings()[i] for i in (2, 3, 4)]
    assert all(len(tok(p)["input_ids"]) % BLOCK_SIZE for p in prompts), "the prompts must end mid-block"
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=0)
    reference = PagedEngine(model, tok, block_size=BLOCK_SIZE, num_blocks=64, kv_cache_dtype="int4",
                            enable_prefix_caching=False)
    expected = [reference.generate([p], greedy, use_tqdm=False)[0].outputs[0] for p in prompts]
    engine = PagedEngine(model, tok, block_size=BLOCK_SIZE, kv_cache_dtype="int4", enable_prefix_caching=False,
                         **options)
    forked = SamplingParams(n=2, max_tokens=14, temperature=0, ignore_eos=True, logprobs=0)
    outputs = engine.generate(prompts, forked, use_tqdm=False)
    for out, want in zip(outputs, expected):
        for sample in out.outputs:
            assert sample.token_ids == want.token_ids, f"sample {sample.index} of {out.prompt!r}"
            torch.testing.assert_close(token_logprobs(sample), token_logprobs(want), atol=5e-4, rtol=0)
    stats = engine.get_stats()
    if options.get("preemption_mode") == "swap":
        assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    engine.check_invariants()
    assert stats["kv_cache_used"] == 0
