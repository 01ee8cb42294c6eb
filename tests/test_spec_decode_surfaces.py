"""Speculative decoding through its other doors: ``LLM(speculative_config=...)``, ``paged-hf serve
--speculative-config JSON`` and the server's ``/metrics`` counters (vLLM's ``vllm:spec_decode_*`` names)."""

from __future__ import annotations

import pytest

import paged_hf_cli
from paged_hf import LLM, PagedEngine, SamplingParams
from paged_hf import cli
from paged_hf.server.metrics import ServerMetrics
from models import require_stories, tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "min_acceptance_rate": 0.0, "auto_disable": False}


def test_llm_speculates_and_matches_greedy():
    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = ["Once upon a time, there was a cat. Once upon a time", "Tom and Lily"]
    plain = LLM(str(require_stories()), dtype="float32", num_blocks=128, enforce_eager=True)
    fast = LLM(str(require_stories()), dtype="float32", num_blocks=128, enforce_eager=True,
               speculative_config=NGRAM)
    a, b = plain.generate(prompts, params, use_tqdm=False), fast.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert fast.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0


def test_llm_refuses_a_bad_speculative_config_before_loading():
    with pytest.raises(ValueError, match=r"speculative_config\['method'\] must be one of \['ngram', 'draft_model'\]"):
        LLM("/nonexistent/model", speculative_config={"method": "medusa"})


def test_serve_parses_speculative_config_json():
    parser = paged_hf_cli.build_parser()
    args = parser.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert cli._engine_options(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert "speculative_config" not in cli._engine_options(parser.parse_args(["serve"]))
    for bad in ("[1, 2]", "{method: ngram}"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--speculative-config", bad])


def test_metrics_count_drafts_under_vllm_names():
    engine = PagedEngine(tiny_model("llama", attn_implementation="sdpa"), None, enforce_eager=True, block_size=4,
                         num_blocks=200, speculative_config=NGRAM)
    metrics = ServerMetrics("m")
    for _ in range(2):  # rendered twice: the counters grow by what the engine added, not by its totals again
        engine.generate([[1, 10, 20, 10, 20]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
        text = metrics.render(engine.get_stats()).decode()
    stats = engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("vllm:"))
    label = '{model_name="m"}'  # as vLLM labels them, for dashboards that filter by model
    assert float(lines["vllm:spec_decode_num_drafts_total" + label]) == stats["spec_decode_num_drafts"]
    assert float(lines["vllm:spec_decode_num_draft_tokens_total" + label]) == stats["spec_decode_num_draft_tokens"]
    assert float(lines["vllm:spec_decode_num_accepted_tokens_total" + label]) == \
        stats["spec_decode_num_accepted_tokens"]
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    for j, count in enumerate(per_pos):
        assert float(lines[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{j}"}}']) \
            == count
    rates = stats["spec_decode_acceptance_rate_per_pos"]
    assert rates == tuple(n / stats["spec_decode_num_drafts"] for n in per_pos) and rates[0] >= rates[-1]
