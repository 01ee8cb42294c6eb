"""guidellm's streaming benchmark, unchanged, against a real ``paged-hf serve``: it sends
``stream_options: {"include_usage": true, "continuous_usage_stats": true}`` (vLLM's field) and counts tokens from the
usage in every chunk. A short synchronous run on loopback with guidellm's synthetic data, over both endpoints.

guidellm is pinned (0.8.1) and lives in a venv of its own (tests/clients/install.sh): found through
``PAGED_HF_GUIDELLM``, ``.clients/guidellm/bin/guidellm`` or PATH; the test skips, saying so, without it.
"""

from __future__ import annotations

import json
import subprocess

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
from served import Served, client_program, stories_folder  # noqa: E402

GUIDELLM = client_program("guidellm", "PAGED_HF_GUIDELLM")
pytestmark = pytest.mark.skipif(GUIDELLM is None, reason="guidellm is not installed: run tests/clients/install.sh "
                                                         "(or set PAGED_HF_GUIDELLM to its command)")
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 24, 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = stories_folder(tmp_path_factory.mktemp("model"))
    server = Served(folder, "--num-blocks", "256", log_dir=tmp_path_factory.mktemp("logs"))
    yield server, folder
    server.stop()


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_streaming_benchmark_completes_every_request(served, endpoint, tmp_path):
    server, folder = served
    report = tmp_path / "report.json"
    command = [GUIDELLM, "run",
               "--backend", f"kind=openai_http,target={server.url},model=stories260K,request_format={endpoint}",
               "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={REQUESTS}",
               "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
               "--tokenizer", f"kind=huggingface_auto,model={folder}",
               "--output", f"kind=json,path={report}", "--disable-console"]
    run = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    assert metrics["output_token_count"]["successful"]["mean"] == OUTPUT_TOKENS  # from the chunks' usage
    assert metrics["request_streaming_iterations_count"]["successful"]["mean"] > OUTPUT_TOKENS / 2  # it streamed
    assert f'"POST {endpoint} HTTP/1.1" 200' in server.logged()
