"""lm-evaluation-harness through the server equals lm-eval on the model itself.

``--model local-completions`` against a real ``paged-hf serve`` (loglikelihood through ``echo`` + ``logprobs``, and
generate_until) and ``--model hf`` on the same model folder run the local tasks of ``lm_eval_tasks/`` (a JSONL and a
task YAML each, no hub): every sample's loglikelihoods agree within 1e-4, and the greedy answers, the accuracy and
the exact-match score are the same. (``local-chat-completions`` cannot score loglikelihoods: lm-eval refuses it.)

lm-eval is pinned (0.4.13, with its ``api`` extra) and lives in a venv of its own (tests/clients/install.sh): found
through ``PAGED_HF_LM_EVAL``, ``.clients/lm-eval/bin/lm_eval`` or PATH; the test skips, saying so, without it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
from served import Served, client_program, stories_folder  # noqa: E402

LM_EVAL = client_program("lm_eval", "PAGED_HF_LM_EVAL")
pytestmark = pytest.mark.skipif(LM_EVAL is None, reason="lm-eval is not installed: run tests/clients/install.sh "
                                                        "(or set PAGED_HF_LM_EVAL to its lm_eval command)")
TASKS = Path(__file__).parent / "lm_eval_tasks"
TOLERANCE = 1e-4


def lm_eval(model: str, model_args: str, output: Path) -> dict:
    """Runs lm_eval on both local tasks; {task: (its results, [each sample's record])}."""
    command = [LM_EVAL, "--model", model, "--model_args", model_args, "--tasks", "stories_mc,stories_gen",
               "--include_path", str(TASKS), "--batch_size", "1", "--log_samples", "--output_path", str(output)]
    run = subprocess.run(command, cwd=TASKS, capture_output=True, text=True, check=False, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next(output.rglob("results_*.json")).read_text())["results"]
    out = {}
    for task in ("stories_mc", "stories_gen"):
        samples = [json.loads(line) for line in next(output.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
        out[task] = (results[task], sorted(samples, key=lambda s: s["doc_id"]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = stories_folder(tmp_path_factory.mktemp("model"))
    server = Served(folder, "--num-blocks", "256", log_dir=tmp_path_factory.mktemp("logs"))
    try:
        served = lm_eval("local-completions", f"model=stories260K,base_url={server.url}/v1/completions,"
                                              f"tokenizer={folder},num_concurrent=1,max_retries=1",
                         tmp_path_factory.mktemp("served"))
    finally:
        server.stop()
    direct = lm_eval("hf", f"pretrained={folder},dtype=float32", tmp_path_factory.mktemp("hf"))
    return served, direct


def test_loglikelihoods_and_accuracy_equal_the_hf_backend(runs):
    served, direct = runs
    (served_results, served_samples), (direct_results, direct_samples) = served["stories_mc"], direct["stories_mc"]
    assert len(served_samples) == len(direct_samples) == 10
    worst = 0.0
    for got, want in zip(served_samples, direct_samples):
        got_ll = [float(ll) for ll, _ in got["filtered_resps"]]
        want_ll = [float(ll) for ll, _ in want["filtered_resps"]]
        assert got_ll == pytest.approx(want_ll, abs=TOLERANCE), got["doc_id"]
        assert [g for _, g in got["filtered_resps"]] == [g for _, g in want["filtered_resps"]]  # is_greedy too
        worst = max(worst, *(abs(a - b) for a, b in zip(got_ll, want_ll)))
    assert served_results["acc,none"] == direct_results["acc,none"]
    print(f"stories_mc: acc {served_results['acc,none']} both; worst loglikelihood difference {worst:.2e}")


def test_generate_until_answers_equal_the_hf_backend(runs):
    served, direct = runs
    (served_results, served_samples), (direct_results, direct_samples) = served["stories_gen"], direct["stories_gen"]
    # lm-eval's hf backend decodes the continuation alone, which drops a SentencePiece first token's space; the
    # server answers what the output adds to the prompt's text, as vLLM does (" girl named Lily" vs "girl named Lily")
    served_answers = [[[text.lstrip(" ") for text in resp] for resp in s["resps"]] for s in served_samples]
    assert served_answers == [s["resps"] for s in direct_samples]
    assert any(resp[0].startswith(" ") for s in served_samples for resp in s["resps"])
    key = "exact_match,first_word"
    assert served_results[key] == direct_results[key]
    print(f"stories_gen: exact_match {served_results[key]} both")
