"""``paged_hf.LLM``: a vLLM script runs by changing its import and produces what ``PagedEngine.generate`` does."""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from paged_hf import LLM, PagedEngine, RequestsFailed, SamplingParams
from models import require_stories, smollm2_dir, stories_model, stories_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vllm_offline.py"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(str(require_stories()), dtype="float32", num_blocks=128)


def completions(outputs) -> list[tuple]:
    return [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outputs]


def test_vllm_script_produces_what_paged_engine_generate_produces(monkeypatch, capsys):
    """examples/vllm_offline.py is a vLLM script with its import changed: greedy, seeded sampling and chat."""
    calls = []
    generate = LLM.generate

    def recording(self, prompts, sampling_params=None, **kwargs):
        outputs = generate(self, prompts, sampling_params, **kwargs)
        calls.append((prompts, sampling_params, outputs))
        return outputs

    monkeypatch.setattr(LLM, "generate", recording)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--model", str(require_stories()), "--max-tokens", "24"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    printed = capsys.readouterr().out
    assert printed.count("[greedy]") == 3 and printed.count("[sampled]") == 3 and printed.count("[chat]") == 1

    engine = PagedEngine(stories_model(), stories_tokenizer(), max_num_seqs=16, enable_prefix_caching=True)
    assert [params.temperature for _, params, _ in calls] == [0.0, 0.8, 0.0]  # greedy, sampled, the chat's
    for prompts, params, outputs in calls:
        expected = engine.generate(prompts, params, use_tqdm=False)
        assert completions(outputs) == completions(expected)
    greedy, sampled = (completions(calls[i][2]) for i in (0, 1))
    assert greedy != sampled, "the sampled run must have sampled"


def test_prompt_forms(llm):
    tok = llm.get_tokenizer()
    text = "Once upon a time"
    ids = tok(text)["input_ids"]
    (reference,) = llm.generate(text, GREEDY, use_tqdm=False)
    assert reference.prompt == text and reference.prompt_token_ids == ids
    forms = [[text], {"prompt": text}, [{"prompt": text}], {"prompt_token_ids": ids}, ids, [ids],
             [{"prompt_token_ids": ids, "prompt": text, "cache_salt": "user-1"}]]
    for form in forms:
        (out,) = llm.generate(form, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids, form
    mixed = llm.generate([text, {"prompt_token_ids": ids}, "Lily"], use_tqdm=False,
                         sampling_params=[GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=3)])
    assert [len(o.outputs[0].token_ids) for o in mixed] == [12, 12, 3]
    assert mixed[1].prompt is None, "a TokensPrompt has no text, as in vLLM"
    assert llm.generate([], GREEDY) == []


def test_max_tokens_none_generates_up_to_the_context_length(llm):
    """vLLM's ``max_tokens=None``: as many tokens as the context leaves (a length finish at max_model_len)."""
    params = SamplingParams(temperature=0.0, max_tokens=None, min_tokens=3, ignore_eos=True)
    (out,) = llm.generate("Once upon a time", params, use_tqdm=False)
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == llm.llm_engine.max_model_len == 512
    assert out.outputs[0].finish_reason == "length" and params.max_tokens is None  # the caller's params unchanged


def test_max_tokens_past_the_context_stops_at_it(llm):
    """vLLM 0.32's rule (offline and served): the context ends a request whatever its ``max_tokens``; the output
    stops at ``max_model_len`` with a length finish, a ``min_tokens`` past it met as far as the context allows."""
    ids = list(range(5, 505))  # 500 of the 512 tokens
    for options in ({"max_tokens": 10**6}, {"max_tokens": 40, "min_tokens": 30}):
        params = SamplingParams(temperature=0.0, ignore_eos=True, **options)
        (out,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length", options
        assert params.max_tokens == options["max_tokens"]  # the caller's params unchanged


def test_chat_takes_one_conversation_or_a_list(llm):
    first = [{"role": "user", "content": "Once upon a time"}]
    second = [{"role": "user", "content": "Lily and Tom"}, {"role": "assistant", "content": " went to the"}]
    (one,) = llm.chat(first, GREEDY, chat_template=TEMPLATE, use_tqdm=False)
    both = llm.chat([first, second], GREEDY, chat_template=TEMPLATE, use_tqdm=False)
    assert completions(both)[0] == completions([one])[0]
    assert both[1].prompt == "Lily and Tom went to the"
    ids = llm.get_tokenizer()("Once upon a time", add_special_tokens=False)["input_ids"]
    (plain,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == ids, "the template's text, with no special tokens added on top (as vLLM)"
    assert one.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 3}, r"tensor_parallel_size=3 does not divide the model's num_key_value_heads"),
        ({"distributed_executor_backend": "slurm"}, r"distributed_executor_backend must be one of"),
        ({"quantization": "awq"}, r"quantization must be one of \[None\]"),
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill must be one of"),
        ({"logprobs_mode": "processed_logprobs"}, r"logprobs_mode must be one of \['raw_logprobs'\] here \(logprobs "
                                                  r"are the model's raw log_softmax"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an int >= 1"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype must be one of"),
        ({"swap_spaces": 4}, r"unknown keyword\(s\) \['swap_spaces'\] \('swap_spaces': did you mean 'swap_space'\?\)"),
        ({"dtype": "float64"}, "dtype must be 'auto', one of"),
        ({"device": "tpu"}, "device must be one of"),
        ({"tokenizer_mode": "slow"}, "tokenizer_mode must be 'auto'"),
        ({"seed": 1.5}, "seed must be an int or None"),
        ({"generation_config": "nowhere"}, "generation_config must be 'auto', 'vllm' or a folder"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_constructor_refuses_what_it_cannot_honour_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(require_stories()), **kwargs)


def test_accepted_vllm_keywords_that_tune_absent_machinery():
    llm = LLM(str(require_stories()), enforce_eager=False, disable_log_stats=True, tensor_parallel_size=1,
              num_gpu_blocks_override=40, kv_cache_memory_bytes=None, seed=None,
              logprobs_mode="raw_logprobs")  # vLLM's default mode, the one the sampler's logprobs have
    assert llm.get_stats()["kv_cache_total"] == 40, "num_gpu_blocks_override is vLLM's num_blocks"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda llm: llm.generate({"prompt": "x", "multi_modal_data": {}}), r"multi_modal_data must be \{'image'"),
        (lambda llm: llm.generate({"text": "x"}), r"unsupported key\(s\) \['text'\]"),
        (lambda llm: llm.generate(3.5), "a prompt must be a string"),
        (lambda llm: llm.generate(["a", "b"], [GREEDY]), "sampling_params has 1 entries for 2 prompts"),
        (lambda llm: llm.generate("a", lora_request=object()), "lora_request is not supported"),
        (lambda llm: llm.generate(["a"], GREEDY, priority=[1]), "priority needs scheduling_policy='priority'"),
        (lambda llm: llm.generate(["a", "x " * 600], GREEDY), "max_model_len=512 leaves no room"),
    ],
    ids=["multimodal", "unknown-key", "not-a-prompt", "params-count", "lora", "priority", "too-long"],
)
def test_bad_requests_raise_before_any_work(llm, call, message):
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert not llm.llm_engine.has_unfinished_requests(), "a rejected batch must leave nothing queued"
    assert llm.get_stats()["kv_cache_used"] == 0


def test_a_request_failing_while_running_raises_with_every_output(llm):
    """A request that fails at run time fails alone (the engine's rule); ``LLM.generate`` then raises, and the
    exception carries every request's output: the others' completions are not lost with it."""
    poisoned = SamplingParams(max_tokens=12, temperature=1.0, logits_processors=[lambda _ids, logits: logits * math.nan])
    with pytest.raises(RequestsFailed, match="1 of 3 requests failed") as raised:
        llm.generate(["Once upon a time", "The dog", "Once upon a time"], [GREEDY, poisoned, GREEDY], use_tqdm=False)
    outputs = raised.value.outputs
    assert isinstance(raised.value, RuntimeError) and len(outputs) == 3
    assert outputs[1].error is not None and outputs[1].outputs[0].finish_reason == "error"
    alone = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[0].error is None and outputs[0].outputs[0].token_ids == alone == outputs[2].outputs[0].token_ids
    assert llm.get_stats()["kv_cache_used"] == 0


def test_get_stats_adds_the_memory_of_the_model_and_the_kv_pool(llm):
    llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    engine_keys = set(llm.llm_engine.get_stats())
    assert engine_keys <= set(stats) and stats["generated_tokens"] > 0
    config = llm.model.config
    params = sum(p.numel() for p in llm.model.parameters()) * 4  # fp32
    buffers = sum(b.numel() * b.element_size() for b in llm.model.buffers())
    assert stats["model_memory_gib"] * 2**30 == params + buffers
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes = 128 * config.num_hidden_layers * 2 * 16 * config.num_key_value_heads * head_dim * 4
    assert stats["kv_cache_memory_gib"] * 2**30 == kv_bytes, "128 blocks of 16 tokens, K and V, every layer, fp32"
    assert stats["device"] == "cpu" and "gpu_memory_used" not in stats
    assert stats["cpu_memory_used"] * 2**30 > params + kv_bytes


def test_a_loaded_model_and_tokenizer_the_seed_and_the_models_sampling_defaults():
    model, tok = stories_model(), stories_tokenizer()
    model.generation_config.temperature = 0.7
    model.generation_config.top_k = 0  # transformers' "off" is vLLM's -1
    model.generation_config.max_new_tokens = 6
    first = LLM(model, tokenizer=tok, seed=7)
    assert first.get_tokenizer() is tok and first.model is model
    defaults = first.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, -1, 6)
    runs = [first.generate(["Once upon a time", "Lily"], use_tqdm=False)]
    runs.append(LLM(model, tokenizer=tok, seed=7).generate(["Once upon a time", "Lily"], use_tqdm=False))
    runs.append(LLM(model, tokenizer=tok, seed=8).generate(["Once upon a time", "Lily"], use_tqdm=False))
    assert all(len(o.outputs[0].token_ids) == 6 for o in runs[0]), "max_new_tokens of the model's defaults"
    assert completions(runs[0]) == completions(runs[1]), "the same seed samples the same tokens"
    assert completions(runs[0]) != completions(runs[2])
    assert LLM(model, tokenizer=tok, generation_config="vllm").get_default_sampling_params() == SamplingParams()


def test_presence_and_frequency_penalties_of_the_generation_config_are_defaults(tmp_path):
    """vLLM's --generation-config reads presence_penalty and frequency_penalty too (GenerationConfig keeps them as
    extra fields), from the model's config ("auto") and from a folder's generation_config.json."""
    model, tok = stories_model(), stories_tokenizer()
    saved = model.generation_config
    model.generation_config = GenerationConfig(presence_penalty=1.5, frequency_penalty=0.5)
    try:
        defaults = LLM(model, tokenizer=tok).get_default_sampling_params()
    finally:
        model.generation_config = saved
    assert (defaults.presence_penalty, defaults.frequency_penalty) == (1.5, 0.5)
    GenerationConfig(presence_penalty=-0.5, do_sample=True, temperature=0.3).save_pretrained(tmp_path)
    defaults = LLM(model, tokenizer=tok, generation_config=str(tmp_path)).get_default_sampling_params()
    assert (defaults.presence_penalty, defaults.frequency_penalty, defaults.temperature) == (-0.5, 0.0, 0.3)


def test_gguf_paths(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds several \.gguf files \['a.gguf', 'b.gguf'\]; pass gguf_file="):
        LLM(str(tmp_path))
    from paged_hf.model_source import model_source  # noqa: PLC0415

    assert model_source(str(tmp_path / "a.gguf"), None) == (str(tmp_path), {"gguf_file": "a.gguf"})
    assert model_source(str(tmp_path), "b.gguf") == (str(tmp_path), {"gguf_file": "b.gguf"})


def test_a_gguf_file_loads_and_chats():
    folder = smollm2_dir()
    pytest.importorskip("gguf", reason="reading a .gguf model needs the gguf package (pip install 'paged_hf[demo]')")
    llm = LLM(str(Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"), max_num_seqs=4)
    (answer,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert "Paris" in answer.outputs[0].text
    assert llm.model.dtype == torch.float32 and llm.model.config._attn_implementation == "paged"
