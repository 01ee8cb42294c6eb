"""benchmarks/vs_vllm.py end to end at a tiny size on stories260K, vLLM skipped: the paged_hf and HF rows run in their
own processes, the table prints, and greedy tokens agree (so the benchmark cannot rot between its long runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from models import require_stories

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_vllm.py"


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
