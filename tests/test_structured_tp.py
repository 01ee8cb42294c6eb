"""Structured outputs under tensor parallelism (two CPU ranks, gloo): the leader fills the grammar masks and samples,
the follower only runs the forward; the outputs equal one process's and validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from models import require_stories, tiny_model
from test_tensor_parallel import launch

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'paged_hf[structured]')")


def test_structured_outputs_under_tensor_parallelism_equal_one_process(tmp_path):
    folder = tmp_path / "llama"
    tiny_model("llama", num_key_value_heads=4, num_attention_heads=4, num_hidden_layers=2).save_pretrained(folder)
    args = [str(folder), str(require_stories())]
    one, two = launch("tp_structured.py", args, nproc=1), launch("tp_structured.py", args, nproc=2)
    assert (one["tp"], two["tp"]) == (1, 2) and two["used_after"] == 0
    assert two["outputs"] == one["outputs"]
    from distributed.tp_structured import SCHEMA  # noqa: PLC0415

    finished = [text for request in one["outputs"][:2] for text, _, reason in request if reason == "stop"]
    assert finished
    for text in finished:
        jsonschema.validate(json.loads(text), SCHEMA)
