"""What an operator of ``paged-hf serve`` relies on, as with ``vllm serve``: API keys, the model's default sampling
parameters, the probes (/ping, /version, /load), and start-up errors reported in one line before any weight loads."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (pip install 'paged_hf[server]')")
httpx = pytest.importorskip("httpx", reason="the tests send raw requests")

import paged_hf  # noqa: E402
from paged_hf import PagedEngine  # noqa: E402
from paged_hf.server.app import build_app  # noqa: E402
from paged_hf.server.auth import api_keys  # noqa: E402
from models import require_stories, stories_tokenizer  # noqa: E402
from test_server import Server, chat_stories  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["sk-first", "sk-second"]


@pytest.fixture(scope="module")
def served():
    """A server with two API keys and the defaults a generation_config would give (greedy, 5 tokens)."""
    model, tok = chat_stories()
    engine = PagedEngine(model, tok, block_size=8, num_blocks=128, enforce_eager=True)
    server = Server(build_app(engine, "stories260K", api_keys=KEYS,
                              sampling_defaults={"temperature": 0.0, "max_tokens": 5}))
    yield server
    server.stop()


def call(server, method: str, path: str, key: str | None = None, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kwargs)


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "Once"}), ("GET", "/tokenizer_info", None),
])
def test_every_route_but_the_probes_needs_one_of_the_keys(served, method, path, body):
    for key in (None, "sk-wrong", "sk-first "[:-1] + "x"):
        refused = call(served, method, path, key, json=body)
        assert refused.status_code == 401, (path, key)
        assert refused.json()["error"]["code"] == "invalid_api_key"
    for key in KEYS:
        assert call(served, method, path, key, json=body).status_code == 200, (path, key)


def test_the_probes_answer_without_a_key(served):
    assert call(served, "GET", "/health").status_code == 200
    assert call(served, "GET", "/ping").status_code == 200 and call(served, "POST", "/ping").status_code == 200
    assert call(served, "GET", "/version").json() == {"version": paged_hf.__version__}
    assert call(served, "GET", "/load").json() == {"server_load": 0}
    assert call(served, "GET", "/metrics").status_code == 200


def test_a_request_leaving_fields_out_gets_the_models_defaults(served):
    """Greedy and 5 tokens from the defaults; a request's own values win."""
    body = {"prompt": "Once upon a time", "n": 2}
    texts = [c["text"] for c in call(served, "POST", "/v1/completions", KEYS[0], json=body).json()["choices"]]
    assert texts[0] == texts[1]  # greedy: the two samples agree
    usage = call(served, "POST", "/v1/completions", KEYS[0], json=body).json()["usage"]
    assert usage["completion_tokens"] == 2 * 5
    own = call(served, "POST", "/v1/completions", KEYS[0], json={**body, "max_tokens": 7, "temperature": 1.0,
                                                                    "seed": 1, "ignore_eos": True}).json()
    assert own["usage"]["completion_tokens"] == 2 * 7 and own["choices"][0]["text"] != own["choices"][1]["text"]


def test_metrics_carry_vllms_series_for_its_dashboards(served):
    def series() -> dict[str, float]:
        text = call(served, "GET", "/metrics").text
        return {name: float(value) for name, value in re.findall(r"^(vllm:[^ ]+) (\S+)$", text, re.M)}

    before = series()
    out = call(served, "POST", "/v1/completions", KEYS[0],
               json={"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}).json()
    after = series()
    label = '{model_name="stories260K"}'
    grew = {name: after.get(name + label, 0) - before.get(name + label, 0)
            for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                         "vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count")}
    assert grew == {"vllm:generation_tokens_total": 6, "vllm:prompt_tokens_total": out["usage"]["prompt_tokens"],
                    "vllm:e2e_request_latency_seconds_count": 1, "vllm:time_to_first_token_seconds_count": 1}
    assert after['vllm:request_success_total{finished_reason="length",model_name="stories260K"}'] >= 1
    assert after["vllm:num_requests_running" + label] == 0 and after["vllm:num_requests_waiting" + label] == 0
    assert 0 <= after["vllm:kv_cache_usage_perc" + label] <= 1
    assert {"vllm:prefix_cache_queries_total" + label, "vllm:num_preemptions_total" + label} <= set(after)


def test_the_api_key_comes_from_the_flag_else_vllms_variable(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(None) == [] and api_keys(["a", "b"]) == ["a", "b"]
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys(None) == ["from-env"] and api_keys(["flag"]) == ["flag"]
    with pytest.raises(ValueError, match="must not be empty"):
        api_keys([" "])


@pytest.mark.parametrize("flags, message", [
    (["--block-size", "3"], "block_size must be a power of two"),
    (["--kv-cache-memory", "-1"], "kv_cache_memory must be in"),
    (["--speculative-config", '{"method": "eagle"}'], "speculative_config\\['method'\\] must be one of"),
    (["--generation-config", "nowhere"], "generation_config must be 'auto', 'vllm' or a folder"),
    (["--port", "70000"], "must be a port number in \\[0, 65535\\], got 70000"),
    (["--max-model-len", "1k"], "must be a positive integer, got '1k'"),
    (["--allow-credentials"], "--allow-credentials need --allowed-origins"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "mistral"], "argument --tool-call-parser: invalid choice: 'mistral'"),
])
def test_bad_flags_end_serve_in_one_line_before_the_weights_load(flags, message):
    run = subprocess.run([sys.executable, "-m", "paged_hf_cli", "serve", str(require_stories()), *flags],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert re.search(message, run.stderr), run.stderr
    assert "Loading weights" not in run.stderr


def test_vllm_serve_flags_take_effect(tmp_path):
    """--served-model-name with two names, --chat-template FILE, --dtype auto, --tokenizer, --trust-remote-code,
    --seed, --root-path, --allowed-origins (CORS), --api-key and --uvicorn-log-level, on one started server."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stories = str(require_stories())
    server = subprocess.Popen(
        [sys.executable, "-m", "paged_hf_cli", "serve", stories, "--served-model-name", "first", "second",
         "--chat-template", str(template), "--dtype", "auto", "--tokenizer", stories, "--trust-remote-code",
         "--seed", "3", "--root-path", "/proxy", "--allowed-origins", '["https://app.example"]', "--api-key", "k",
         "--uvicorn-log-level", "warning", "--enforce-eager", "--num-blocks", "64", "--port", str(port)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(1)
        auth = {"Authorization": "Bearer k"}
        assert [m["id"] for m in httpx.get(url + "/v1/models", headers=auth).json()["data"]] == ["first", "second"]
        out = httpx.post(url + "/v1/completions", headers=auth, json={"model": "second", "prompt": "Once",
                                                                       "max_tokens": 2}).json()
        assert out["model"] == "second"
        tokens = httpx.post(url + "/tokenize", headers=auth, json={
            "messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False}).json()["tokens"]
        tok = stories_tokenizer()
        assert tokens == tok("<<user>>Hi", add_special_tokens=False)["input_ids"]
        preflight = httpx.options(url + "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers.get("access-control-allow-origin") == "https://app.example"
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        server.terminate()
        server.wait(timeout=60)

