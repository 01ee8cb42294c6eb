"""benchmarks/vs_vllm.py end to end at a tiny size on stories260K, vLLM skipped: the paged_hf and HF rows run in their
own processes, the table prints, and greedy tokens agree (so the benchmark cannot rot between its long runs); and its
model-shape presets still build the shapes they name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from models import require_stories

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_vllm.py"
sys.path.insert(0, str(SCRIPT.parent))
import vs_vllm  # noqa: E402

# what each preset is for: (model class, parameters in millions with a 49,152-token vocabulary)
SHAPE_MODELS = {"qwen3-0.6b-shape": ("Qwen3ForCausalLM", 490.8), "gemma3-270m-shape": ("Gemma3ForCausalLM", 131.8),
                "gemma2-small-shape": ("Gemma2ForCausalLM", 131.8), "llama3.2-1b-shape": ("LlamaForCausalLM", 1073.8)}


def test_vs_vllm_runs_paged_hf_and_hf_rows_without_vllm(tmp_path):
    require_stories()
    out = tmp_path / "records.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "stories260K", "--workloads", "shared", "--dtypes", "float32",
         "--pairs", "1", "--num-requests", "3", "--max-prompt", "24", "--max-output", "4", "--threads", "1",
         "--vllm-python", str(tmp_path / "no-venv" / "python"), "--log-dir", str(tmp_path / "logs"),
         "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vLLM SKIPPED" in proc.stdout
    records = json.loads(out.read_text())["records"]
    assert [r["engine"] for r in records] == ["paged_hf", "hf_static", "hf_cb"]
    for record in records:
        (run,) = record["runs"]
        assert run["name"] == "shared" and run["generated"] == run["requested"] == 12, record
        assert run["short_requests"] == 0 and run["seconds"] > 0
    heads = [r["runs"][0]["head"] for r in records]
    assert heads[0] == heads[1] == heads[2]  # greedy tokens of paged_hf = HF static = HF continuous batching
    assert "| shared   | float32 | paged_hf" in proc.stdout
    assert "same greedy tokens as HF generate, static batches: paged_hf 3/3" in proc.stdout


@pytest.mark.parametrize("name", sorted(vs_vllm.SHAPES))
def test_each_shape_preset_builds_the_model_it_names(name):
    """On the meta device (no weights): the class and size each preset was measured with, every field kept."""
    config = vs_vllm.shape_config(name, vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    cls, millions = SHAPE_MODELS[name]
    assert type(model).__name__ == cls
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == millions


def test_a_shape_field_transformers_drops_is_refused(monkeypatch):
    model_type, fields = vs_vllm.SHAPES["qwen3-0.6b-shape"]
    # transformers 5 moves rope_theta into rope_parameters: a preset written the old way is refused
    monkeypatch.setitem(vs_vllm.SHAPES, "qwen3-0.6b-shape", (model_type, {**fields, "rope_theta": 5.0}))
    with pytest.raises(ValueError, match="does not keep"):
        vs_vllm.shape_config("qwen3-0.6b-shape", vocab_size=49152)
