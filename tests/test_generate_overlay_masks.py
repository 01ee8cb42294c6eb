"""``generate`` with the ``"paged"`` attention on a model whose prefill mask adds a non-causal part to the causal one
(transformers' ``or_mask_function`` / ``block_sequence_ids``): a PaliGemma's prefix (image and prompt tokens attend
to each other both ways) runs the exact dense attention over the ``PagedCache``, so tokens and logprobs equal sdpa on
``DynamicCache``; a plain prefill and every decode step still read the blocks. (Gemma 3's images:
``test_engine_images.py``.)"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from paged_hf import attention
from paged_hf.cache import PagedCache
from vision_models import random_pixels, tiny_gemma3

IMAGE = 515


def tiny_paligemma():
    """A 2-layer PaliGemma (Gemma text) with a 2-layer SigLIP tower on 16x16 images: 16 image tokens (id 515)."""
    text = dict(model_type="gemma", vocab_size=520, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4, projection_dim=64)
    config = transformers.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE,
                                          projection_dim=64)
    torch.manual_seed(0)
    return transformers.PaliGemmaForConditionalGeneration(config).eval()


def run(model, attention_name: str, cache: str, **inputs):
    """Greedy tokens and ``[B, steps, vocab]`` logprobs of 5 new tokens."""
    model.set_attn_implementation(attention_name)
    options = dict(cache_implementation="paged") if cache == "paged" else dict(cache=DynamicCache(config=model.config))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True, **options)
    return out.sequences.tolist(), torch.log_softmax(torch.stack(out.logits, 1).float(), -1)


@pytest.fixture
def dense_forwards(monkeypatch):
    """The forwards ``PagedCache.answer_densely`` switched to the dense attention (one entry each)."""
    calls = []
    original = PagedCache.answer_densely

    def recording(self):
        first = original(self)
        if first:
            calls.append(self._metadata.query_len)
        return first

    monkeypatch.setattr(PagedCache, "answer_densely", recording)
    monkeypatch.setattr(attention, "_DENSE_WARNED", set())
    return calls


def test_a_paligemma_prefix_through_generate_with_the_paged_attention_matches_sdpa(dense_forwards):
    model = tiny_paligemma()
    prompt = [IMAGE] * 16 + [1, 5, 6, 7]
    ids = torch.tensor([prompt, [0, 0] + prompt[:-2]])
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([[0], [2]])).long()
    prefix = torch.tensor([[0] * 18 + [1, 1], [0] * 20])  # row 0: its last two tokens are the suffix
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=random_pixels(2, 3), token_type_ids=prefix)
    tokens, logprobs = run(model, "sdpa", "dynamic", **inputs)
    paged_tokens, paged_logprobs = run(model, "paged", "paged", **inputs)
    assert paged_tokens == tokens
    torch.testing.assert_close(paged_logprobs, logprobs, atol=1e-5, rtol=0)
    assert dense_forwards == [ids.shape[1]]  # the prefill only; its decode steps read the blocks


def test_text_only_gemma3_prefills_and_image_decodes_read_the_blocks(dense_forwards):
    model = tiny_gemma3()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 1, 5, 6, 7, 8, 9, 10]])
    mask = (ids != 0).long()
    inputs = dict(input_ids=ids, attention_mask=mask)
    tokens, logprobs = run(model, "sdpa", "dynamic", **inputs)
    paged_tokens, paged_logprobs = run(model, "paged", "paged", **inputs)
    assert paged_tokens == tokens
    torch.testing.assert_close(paged_logprobs, logprobs, atol=1e-5, rtol=0)
    assert dense_forwards == []
    image = torch.tensor([[1, 5, 513, IMAGE, IMAGE, IMAGE, IMAGE, 514, 6, 7]])
    run(model, "paged", "paged", input_ids=image, attention_mask=torch.ones_like(image),
        pixel_values=random_pixels(1, 4), token_type_ids=(image == IMAGE).long())
    assert dense_forwards == [image.shape[1]]
