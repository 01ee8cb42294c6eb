"""bfloat16 on CPU end to end: a ``dtype=torch.bfloat16`` model on the paged attention (the production CPU path,
bfloat16 pools attended in bfloat16) stays as close to the float32 model as bfloat16 sdpa over a ``DynamicCache``.

The bound, per model, over a chunked forward of real text (prefill chunks of 32 tokens, then single-token decode
steps): ``max |logits(paged, bf16) - logits(fp32)| <= BOUND * max |logits(sdpa, bf16) - logits(fp32)|``. Measured
(2026-12-01, 128+8 tokens): the two maxima are equal on stories260K and on SmolLM2-135M (ratio 1.00); ``BOUND``
leaves room for another summation order, not for a systematic error (a float32 upcast missing from the softmax, or
bfloat16 scores, fail it).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import paged_hf
from models import smollm2_dir, stories_model, stories_tokenizer, story_text_ids
from paged_hf.kernels import cpu_attention

BOUND = 1.25
PREFILL_TOKENS, CHUNK, DECODE_STEPS = 128, 32, 8


@torch.no_grad()
def chunked_logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """float32 logits ``[n, vocab]`` of ``ids`` fed in chunks of ``CHUNK`` up to ``PREFILL_TOKENS``, then one token a
    step."""
    bounds = [*range(0, PREFILL_TOKENS, CHUNK), *range(PREFILL_TOKENS, len(ids) + 1)]
    return torch.cat([model(input_ids=ids[None, a:b], cache=cache, use_cache=True).logits[0].float()
                      for a, b in zip(bounds[:-1], bounds[1:])])


def smollm2():
    directory, gguf = smollm2_dir(), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32).eval(), tokenizer


@pytest.mark.parametrize("name", ["stories260K", "smollm2"])
def test_bfloat16_paged_logits_stay_within_bfloat16_sdpa_distance(name, monkeypatch):
    model, tokenizer = (stories_model("sdpa"), stories_tokenizer()) if name == "stories260K" else smollm2()
    ids = story_text_ids(tokenizer, PREFILL_TOKENS + DECODE_STEPS)
    reference = chunked_logits(model, ids, DynamicCache(config=model.config))
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    sdpa = chunked_logits(bf16, ids, DynamicCache(config=bf16.config))

    calls = []
    for kind in ("decode", "prefill"):  # count the production path's calls and the dtype it attends in
        real = getattr(cpu_attention, f"paged_{kind}_attention_cpu")
        monkeypatch.setattr(cpu_attention, f"paged_{kind}_attention_cpu",
                            lambda q, *a, _real=real, _kind=kind, **kw: calls.append((_kind, q.dtype, kw.get(
                                "pools", a[0] if a else None).key_cache.dtype)) or _real(q, *a, **kw))
    monkeypatch.delenv("PAGED_HF_KERNELS", raising=False)
    bf16.set_attn_implementation("paged")
    paged = chunked_logits(bf16, ids, paged_hf.PagedCache(bf16.config, block_size=16))
    num_layers = model.config.num_hidden_layers
    assert calls.count(("prefill", torch.bfloat16, torch.bfloat16)) == num_layers * PREFILL_TOKENS // CHUNK
    assert calls.count(("decode", torch.bfloat16, torch.bfloat16)) == num_layers * DECODE_STEPS

    paged_error, sdpa_error = (paged - reference).abs().max(), (sdpa - reference).abs().max()
    assert sdpa_error > 0
    assert paged_error <= BOUND * sdpa_error, f"{name}: paged bf16 {paged_error:.4f} vs sdpa bf16 {sdpa_error:.4f}"
