"""Structured outputs for ``model.generate()``: ``JSONSchemaLogitsProcessor`` / ``StructuredLogitsProcessor``.

Greedy decoding of a left-padded batch with the processor equals the engine's constrained greedy decoding token for
token, on ``DynamicCache`` + sdpa and on the paged cache; sampled rows (``num_return_sequences``) and beam search
(whose rows are reordered every step: the processor replays them) give valid outputs.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from paged_hf import PagedEngine, SamplingParams, StructuredOutputsParams
from models import stories_tokenizer, tiny_model

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'paged_hf[structured]')")
from paged_hf.structured import GrammarError, JSONSchemaLogitsProcessor, StructuredLogitsProcessor  # noqa: E402

PROMPTS = ["Once upon a time", "The cat", "Tom and Sue went to the big park"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 2}},
          "required": ["name", "age"]}
MAX_NEW = 60


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", attn_implementation="sdpa"), stories_tokenizer()


def generated(tok, batch, out) -> list[list[int]]:
    """Each row's new tokens, up to and including its end token (generate pads the rows that ended)."""
    rows = []
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        rows.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return rows


@pytest.mark.parametrize("cache", ["dynamic", "paged"])
def test_greedy_generate_equals_the_engine_token_for_token(tiny, cache):
    model, tok = tiny
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    engine = PagedEngine(model, tok, block_size=8, num_blocks=128, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in engine.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured_outputs=spec), use_tqdm=False)]
    model.set_attn_implementation("sdpa" if cache == "dynamic" else "paged")
    try:
        batch = tok(PROMPTS, return_tensors="pt", padding=True)
        extra = {"cache_implementation": "paged"} if cache == "paged" else {}
        out = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                             logits_processor=[StructuredLogitsProcessor(spec, tok)], **extra)
    finally:
        model.set_attn_implementation("sdpa")
    assert generated(tok, batch, out) == want
    assert any(tokens[-1] == tok.eos_token_id for tokens in want)
    for tokens in want:
        if tokens[-1] == tok.eos_token_id:
            jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), PERSON)


def test_sampled_rows_and_beams_give_valid_json(tiny):
    model, tok = tiny
    batch = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    sampled = model.generate(**batch, max_new_tokens=120, do_sample=True, num_return_sequences=3,
                             pad_token_id=tok.pad_token_id,
                             logits_processor=[JSONSchemaLogitsProcessor(PERSON, tok, disable_any_whitespace=True)])
    beams = model.generate(**batch, max_new_tokens=120, num_beams=3, do_sample=False, pad_token_id=tok.pad_token_id,
                           logits_processor=[JSONSchemaLogitsProcessor(PERSON, tok, disable_any_whitespace=True)])
    ended = 0
    for tokens in generated(tok, batch, sampled) + generated(tok, batch, beams):
        if tokens[-1] == tok.eos_token_id:
            ended += 1
            jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), PERSON)
    assert ended >= 6


def test_regex_processor_and_a_bad_schema(tiny):
    model, tok = tiny
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id,
                         logits_processor=[StructuredLogitsProcessor(StructuredOutputsParams(regex=r"\d{2}-[a-z]{2}"),
                                                                     tok)])
    for tokens in generated(tok, batch, out):
        assert re.fullmatch(r"\d{2}-[a-z]{2}", tok.decode(tokens, skip_special_tokens=True))
    with pytest.raises(GrammarError, match='Unsupported type "foo"'):
        JSONSchemaLogitsProcessor({"type": "foo"}, tok)


def test_a_row_whose_history_changes_is_replayed(tiny):
    """Beam search hands the processor reordered rows: row 0 now holds the history row 1 had. Its mask must follow
    the history it holds (after "c" only "d" may come), not the matcher it had."""
    _, tok = tiny
    a, b, c, d = (tok.convert_tokens_to_ids(f"<0x{ord(ch):02X}>") for ch in "abcd")
    processor = StructuredLogitsProcessor(StructuredOutputsParams(regex="(ab|cd)e"), tok)
    prompt = [[1, 5], [1, 5]]
    scores = torch.zeros(2, 512)
    processor(torch.tensor(prompt), scores)
    processor(torch.tensor([prompt[0] + [a], prompt[1] + [c]]), scores)
    masked = processor(torch.tensor([prompt[1] + [c], prompt[0] + [a]]), scores)  # the rows swapped
    assert masked[0, d] == 0 and masked[0, b] == float("-inf")
    assert masked[1, b] == 0 and masked[1, d] == float("-inf")


def test_min_new_tokens_yields_to_a_complete_value_and_a_reused_processor_starts_afresh(tiny):
    """``min_new_tokens`` holds back the end token that alone may follow a complete value: the grammar wins (the
    output ends there, valid), never a row freed of its mask. The same processor passed to a second ``generate``
    with other prompts constrains that call from its own start."""
    model, tok = tiny
    processor = StructuredLogitsProcessor(StructuredOutputsParams(choice=["yes", "no"]), tok)
    for prompts in (PROMPTS, PROMPTS[1:], ["A completely different and much longer prompt than before"]):
        batch = tok(prompts, return_tensors="pt", padding=True)
        out = model.generate(**batch, max_new_tokens=12, min_new_tokens=8, do_sample=False,
                             pad_token_id=tok.pad_token_id, logits_processor=[processor])
        for tokens in generated(tok, batch, out):
            assert tok.decode(tokens, skip_special_tokens=True) in ("yes", "no"), tok.decode(tokens)
            assert tokens[-1] == tok.eos_token_id
