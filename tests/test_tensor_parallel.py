"""Tensor parallelism on CPU (gloo, two ranks): the paged cache under ``torchrun`` gives one process's tokens.

Each rank holds half of the KV heads (transformers' TP plan splits the attention heads); its pool is sized from its
own heads. Tiny models with 4 KV heads are saved to a temporary folder (TP loads with ``from_pretrained``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import tiny_model

HERE = Path(__file__).parent
ROOT = HERE.parent


def launch(script: str, args: list[str], nproc: int, timeout: int = 600) -> dict:
    """Runs ``script`` under torchrun with ``nproc`` ranks (plain python for 1); returns rank 0's RESULT json."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(HERE / "distributed" / script), *args]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   str(HERE / "distributed" / script), *args]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"{command} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp_models")
    paths = []
    for family in ("llama", "mistral"):  # full attention, and a sliding window
        model = tiny_model(family, num_key_value_heads=4, num_attention_heads=4, num_hidden_layers=2)
        path = folder / family
        model.save_pretrained(path)
        paths.append(str(path))
    return paths


def test_generate_under_tensor_parallelism_equals_one_process(model_folders):
    """Greedy, beam search and seeded sampling, paged and sdpa attention, Llama and Mistral: the tokens (and the
    first steps' scores) of two ranks equal one process's; each rank stores 2 of the 4 KV heads, and the same
    memory_budget holds twice the blocks."""
    one = launch("tp_generate.py", model_folders, nproc=1)
    two = launch("tp_generate.py", model_folders, nproc=2)
    assert set(one) == set(two) and len(one) == 12
    for key, single in one.items():
        sharded = two[key]
        assert sharded["sequences"] == single["sequences"], key
        torch.testing.assert_close(torch.tensor(sharded["scores"]), torch.tensor(single["scores"]), atol=1e-4,
                                   rtol=1e-4)
        assert single["stored_kv_heads"] == [4] and sharded["stored_kv_heads"] == [2], key
        assert sharded["num_blocks"] == 2 * single["num_blocks"], key
