"""Structured outputs on a real model: SmolLM2-135M-Instruct answers chat prompts under a JSON schema (free strings
included, which a trained model closes), greedy and sampled; every finished output parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from paged_hf import PagedEngine, SamplingParams, StructuredOutputsParams
from models import smollm2_dir

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'paged_hf[structured]')")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                           "population_millions": {"type": "number"},
                                           "landmarks": {"type": "array", "items": {"type": "string"},
                                                         "maxItems": 3}},
          "required": ["city", "country", "landmarks"]}
QUESTIONS = ["Describe Paris as JSON.", "Describe Tokyo as JSON.", "Describe a city you like as JSON."]


def test_smollm2_outputs_validate():
    directory, gguf = smollm2_dir(), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32,
                                                 attn_implementation="paged").eval()
    engine = PagedEngine(model, tok, block_size=16, num_blocks=256, enforce_eager=True)
    spec = StructuredOutputsParams(json=SCHEMA)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = [SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=spec)] + \
             [SamplingParams(max_tokens=96, temperature=0.7, seed=i, structured_outputs=spec) for i in range(2)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    finished = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 2, [(o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
    for text in finished:
        jsonschema.validate(json.loads(text), SCHEMA)
    engine.check_invariants()
