"""generate() on a PagedCache gives exactly DynamicCache + dense attention's tokens, for every family and mode.

Reference: DynamicCache with the family's dense attention (sdpa; eager for Gemma2). Candidates: the paged
cache with attn_implementation="paged" (reads blocks) and with the dense attention (gathered path).
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import paged_hf
from models import FAMILIES, dense_attention, stories_tokenizer, tiny_model

BLOCK_SIZE = 4  # small, so prompts and generations cross many block boundaries
MODES = ["greedy", "sample", "beams", "return_sequences", "eos_early", "stop_strings", "streamer", "assisted",
         "right_padded", "mask_hole"]
LOGIT_MODES = ("greedy", "right_padded", "mask_hole")  # compared by logits too
_references: dict = {}


def right_padded_batch(lengths=(3, 9, 14, 6), seed=0):
    """The prompts of ``left_padded_batch`` with their pads on the right (generate warns, DynamicCache runs it)."""
    batch = left_padded_batch(lengths, seed)
    width = batch["input_ids"].shape[1]
    for row, length in enumerate(lengths):
        for key in ("input_ids", "attention_mask"):
            batch[key][row] = torch.cat([batch[key][row, width - length :], batch[key][row, : width - length]])
    return batch


def left_padded_batch(lengths=(3, 9, 14, 6), seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros((len(lengths), width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, 512, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class TokenCollector(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.extend(value.flatten().tolist())

    def end(self):
        pass


def mode_kwargs(mode: str, family: str) -> tuple[dict, dict]:
    """(inputs, generate kwargs) for a mode; the EOS and stop-string modes derive theirs from a greedy run."""
    batch = left_padded_batch()
    kwargs = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=None, do_sample=False)
    if mode in LOGIT_MODES:
        kwargs.update(return_dict_in_generate=True, output_logits=True)
        if mode == "right_padded":
            # fewer trailing pads than a sliding window (6): a pad column whose window holds no real token has no
            # defined output (an eager DynamicCache averages the pads' own values there; the paged cache stores none)
            batch = right_padded_batch(lengths=(12, 9, 14, 11))
        elif mode == "mask_hole":  # a masked column inside a prompt, and a row that is all real
            batch["attention_mask"][2, 6] = 0
            batch["attention_mask"][1, :] = 1
    elif mode == "sample":
        kwargs.update(do_sample=True, top_k=40, temperature=0.9)
    elif mode == "beams":
        kwargs.update(num_beams=3, return_dict_in_generate=True, output_scores=True)
    elif mode == "return_sequences":
        kwargs.update(do_sample=True, num_return_sequences=2)
    elif mode == "eos_early":
        greedy = reference(family, "greedy").sequences
        kwargs.update(eos_token_id=int(greedy[1, batch["input_ids"].shape[1] + 2]))  # row 1 ends at step 3
    elif mode == "stop_strings":
        tok = stories_tokenizer()
        batch = {k: v[2:3] for k, v in batch.items()}
        greedy = reference(family, "greedy").sequences[2, batch["input_ids"].shape[1]:]
        text = tok.decode(greedy[4:6])
        if not text.strip():
            pytest.skip("greedy continuation decodes to whitespace; no stop string to pick")
        kwargs.update(stop_strings=[text.strip()], tokenizer=tok)
    elif mode in ("streamer", "assisted"):
        batch = {k: v[1:2, -9:] for k, v in batch.items()}  # streamers and assisted decoding take one row
        if mode == "assisted":
            kwargs.update(assistant_model=tiny_model(family, seed=1))
    return batch, kwargs


def run(model, mode: str, family: str, paged: bool):
    batch, kwargs = mode_kwargs(mode, family)
    if paged:
        kwargs.update(cache_implementation="paged", cache_config={"block_size": BLOCK_SIZE})
    streamer = TokenCollector() if mode == "streamer" else None
    torch.manual_seed(1234)
    out = model.generate(**batch, **kwargs, streamer=streamer)
    return (out, streamer.tokens) if streamer else out


def reference(family: str, mode: str):
    if (family, mode) not in _references:
        _references[family, mode] = run(tiny_model(family), mode, family, paged=False)
    return _references[family, mode]


def sequences(out):
    return out.sequences if hasattr(out, "sequences") else out


@pytest.mark.parametrize("attention", ["paged", "dense"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_matches_dynamic_cache(family, mode, attention):
    model = tiny_model(family, None if attention == "dense" else "paged")
    expected = reference(family, mode)
    got = run(model, mode, family, paged=True)
    if mode == "streamer":
        (got, got_streamed), (expected, expected_streamed) = got, expected
        assert got_streamed == expected_streamed
    assert torch.equal(sequences(got), sequences(expected))
    if mode in LOGIT_MODES:
        for step_got, step_expected in zip(got.logits, expected.logits):
            torch.testing.assert_close(step_got, step_expected, atol=1e-5, rtol=1e-5)
        cache = got.cache
        assert isinstance(cache, paged_hf.PagedCache)
        cache.check_invariants()
        assert cache.stats().kv_cache_used > 0
        cache.reset()
        assert cache.stats().kv_cache_used == 0
    if mode == "beams":
        torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-5, rtol=1e-5)
