"""The pool ``cache_implementation="paged"`` sizes for a ``generate`` call is allocated at once for the call's need and
still grows where a later forward needs more: the returned cache continues a conversation (transformers' multi-turn
recipe), prompt lookup's drafts are checked past ``max_length``, and an assistant model's own cache (under the
default switch) is handed back to every draft call. Each gives ``DynamicCache``'s tokens."""

from __future__ import annotations

import pytest
import torch

import paged_hf
from models import stories_model, stories_tokenizer

GREEDY = dict(do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def stories():
    return stories_model("sdpa"), stories_tokenizer()


@pytest.mark.parametrize("attention", ["sdpa", "paged"])
def test_a_conversation_continues_on_the_returned_cache(stories, attention):
    model, tok = stories
    model.set_attn_implementation(attention)
    try:
        first = tok(["Once upon a time", "Lily and Tom went"], return_tensors="pt", padding=True)
        follow = tok([" Then the dog said", " The sun"], return_tensors="pt", padding=True, padding_side="right",
                     add_special_tokens=False)
        turns = {}
        for paged in (False, True):
            extra = {"cache_implementation": "paged"} if paged else {}
            out = model.generate(**first, max_new_tokens=10, return_dict_in_generate=True, **GREEDY, **extra)
            ids = torch.cat([out.sequences, follow["input_ids"]], 1)
            mask = torch.cat([first["attention_mask"], torch.ones(2, 10, dtype=torch.long), follow["attention_mask"]],
                             1)
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            assert isinstance(cache, paged_hf.PagedCache) == paged
            turns[paged] = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=12,
                                          **GREEDY)
            cache.check_invariants() if paged else None
        assert torch.equal(turns[True], turns[False])
    finally:
        model.set_attn_implementation("sdpa")


def test_prompt_lookup_drafts_checked_past_max_length(stories):
    """Prompt lookup proposes up to ``prompt_lookup_num_tokens`` drafts near the end of the call too, and the model
    checks them all in one forward: up to that many tokens past prompt + ``max_new_tokens``."""
    model, tok = stories
    prompt = tok("Once upon a time there was a little girl named Lily. She liked to", return_tensors="pt")
    for max_new_tokens in range(40, 47):
        options = dict(**prompt, prompt_lookup_num_tokens=10, max_new_tokens=max_new_tokens, **GREEDY)
        assert torch.equal(model.generate(**options, cache_implementation="paged"), model.generate(**options))


def test_an_assistant_under_the_default_switch_keeps_its_growing_cache(stories):
    model, tok = stories
    torch.manual_seed(5)
    assistant = stories_model("sdpa")
    with torch.no_grad():
        for parameter in assistant.parameters():  # a draft model that disagrees now and then
            parameter.add_(0.02 * torch.randn_like(parameter))
    prompt = tok("Once upon a time there was a little girl named Lily. She liked to", return_tensors="pt")
    reference = model.generate(**prompt, assistant_model=assistant, max_new_tokens=40, **GREEDY)
    paged_hf.enable_default_paged()
    try:
        out = model.generate(**prompt, assistant_model=assistant, max_new_tokens=40, return_dict_in_generate=True,
                             **GREEDY)
    finally:
        paged_hf.disable_default_paged()
        paged_hf.register()
    assert isinstance(out.cache if getattr(out, "cache", None) is not None else out.past_key_values,
                      paged_hf.PagedCache)
    assert torch.equal(out.sequences, reference)
