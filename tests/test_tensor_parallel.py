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
import transformers

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


def test_latent_attention_under_tensor_parallelism_equals_one_process(tmp_path):
    """DeepSeek V3's multi-head latent attention: each rank keeps the whole latent row of a token (one head, not
    split) and folds its own shard of ``kv_b_proj`` (its half of the query heads) into its attention; greedy, beams
    and samples, paged and sdpa attention, and the engine (prefix hits, swap, an abort) give one process's
    tokens."""
    config = transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=256, pad_token_id=0,
        initializer_range=0.2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "deepseek_v3")
    one = launch("tp_generate.py", [str(tmp_path / "deepseek_v3")], nproc=1)
    two = launch("tp_generate.py", [str(tmp_path / "deepseek_v3")], nproc=2)
    assert set(one) == set(two) and len(one) == 6
    for key, single in one.items():
        assert two[key]["sequences"] == single["sequences"], key
        assert single["stored_kv_heads"] == two[key]["stored_kv_heads"] == [1], key
    # the engine: prefix hits and swap preemption (int4 is refused for MLA), an abort mid-decode
    one = launch("tp_engine.py", [str(tmp_path / "deepseek_v3"), "prefix_hits", "swap"], nproc=1)
    two = launch("tp_engine.py", [str(tmp_path / "deepseek_v3"), "prefix_hits", "swap"], nproc=2)
    for name in ("prefix_hits", "swap"):
        assert two[name]["tokens"] == one[name]["tokens"], name
        torch.testing.assert_close(torch.tensor(two[name]["logprobs"]), torch.tensor(one[name]["logprobs"]),
                                   atol=1e-4, rtol=0)
        assert two[name]["used_after"] == one[name]["used_after"] == 0
    assert one["swap"]["swapped"] > 0 and one["prefix_hits"]["hit_rate"] > 0.3
    assert two["abort"] == one["abort"]


def test_engine_under_torchrun_equals_one_process(model_folders):
    """``PagedEngine`` on two ranks (rank 0 leads, rank 1 follows its broadcast steps) gives one process's tokens
    and logprobs: with prefix hits, with preemption by recompute and by swap, with int4 blocks and their full-precision tails swapped, and with an abort mid-decode; no block
    is left in use."""
    one = launch("tp_engine.py", model_folders[:1], nproc=1)
    two = launch("tp_engine.py", model_folders[:1], nproc=2)
    assert set(one) == set(two) == {"prefix_hits", "recompute", "swap", "int4_swap", "abort"}
    for name in ("prefix_hits", "recompute", "swap", "int4_swap"):
        single, sharded = one[name], two[name]
        assert sharded["tokens"] == single["tokens"], name
        torch.testing.assert_close(torch.tensor(sharded["logprobs"]), torch.tensor(single["logprobs"]), atol=1e-4,
                                   rtol=0)
        assert (single["tp"], sharded["tp"]) == (1, 2)
        assert sharded["used_after"] == single["used_after"] == 0
        for key in ("preemptions", "swapped", "hit_rate"):
            assert sharded[key] == single[key], (name, key)
    assert one["prefix_hits"]["hit_rate"] > 0.3
    assert one["recompute"]["preemptions"] > 0 and one["recompute"]["swapped"] == 0
    assert one["swap"]["swapped"] > 0 and one["int4_swap"]["swapped"] > 0
    assert two["abort"] == one["abort"] and one["abort"]["tokens"][1] is None and one["abort"]["used_after"] == 0


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_from_pretrained_starts_its_ranks_and_reports_a_dead_one(model_folders, backend):
    """``PagedEngine.from_pretrained(path, tensor_parallel_size=2)`` starts its follower (a local process, or a Ray
    actor), gives one process's tokens (prefix hits on a second run too), leaves no process after ``shutdown()``;
    a follower killed mid-life fails the next requests at once with the rank's error, never a hang."""
    if backend == "ray":
        pytest.importorskip("ray", reason="the test extra installs Ray")
    result = launch("tp_launch.py", [model_folders[0], backend], nproc=1)
    assert result["two"] == result["one"] and result["again"] == result["one"]
    assert result["tp"] == 2 and result["hit_rate"] > 0.3
    assert result["left_after_shutdown"] == 0 and result["left_after_dead"] == 0
    assert all(error and error.startswith("TensorParallelError: tensor-parallel rank 1") for error in
               result["dead_errors"])
    assert result["dead_seconds"] < 10


def test_tensor_parallel_options_are_checked_before_any_process_starts(model_folders):
    from paged_hf import PagedEngine

    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_key_value_heads=4"):
        PagedEngine.from_pretrained(model_folders[0], tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        PagedEngine.from_pretrained(model_folders[0], tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        PagedEngine.from_pretrained(model_folders[0], tensor_parallel_size=2, distributed_executor_backend="slurm")
    for timeout in (0, -5, float("nan"), "60"):
        with pytest.raises(ValueError, match="distributed_timeout must be a positive number of seconds"):
            PagedEngine.from_pretrained(model_folders[0], tensor_parallel_size=2, distributed_timeout=timeout)
    with pytest.raises(ValueError, match="block_size"):
        PagedEngine.from_pretrained(model_folders[0], tensor_parallel_size=2, block_size=0)
    assert not torch.distributed.is_initialized()


def test_llm_with_tensor_parallel_size_equals_one_process(model_folders):
    """``LLM(path, tensor_parallel_size=2)`` (vLLM's keyword) shards the model over this process and one it starts;
    same tokens as ``LLM(path)``; ``shutdown()`` leaves no process and no process group."""
    import multiprocessing

    from paged_hf import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 17], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    one = LLM(model_folders[1], skip_tokenizer_init=True, block_size=4, num_blocks=32)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(model_folders[1], skip_tokenizer_init=True, tensor_parallel_size=2, block_size=4, num_blocks=32)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
        assert two.get_stats()["tensor_parallel_size"] == 2
    finally:
        two.shutdown()
    assert not multiprocessing.active_children() and not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="shut down"):
        two.generate(prompts, params, use_tqdm=False)


def _children(pid: int) -> set[int]:
    """The processes ``pid`` started (Linux /proc), recursively."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
                direct = {int(child) for child in handle.read().split()}
        except OSError:
            continue
        for child in direct:
            found |= {child} | _children(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc (Linux)")
def test_server_with_tensor_parallel_size_2_answers_the_openai_client():
    """``paged-hf serve stories260K --tensor-parallel-size 2`` starts its follower, answers the real ``openai``
    client with the single-process engine's tokens, reports the TP size in ``/metrics``, and leaves no process after
    SIGTERM."""
    import signal
    import time

    import httpx
    import openai

    from models import require_stories
    from paged_hf import PagedEngine, SamplingParams
    from served import free_port

    folder = str(require_stories())
    prompts = ["Once upon a time", "The little dog"]
    engine = PagedEngine.from_pretrained(folder, block_size=8, num_blocks=128)
    expected = [o.outputs[0].text for o in engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0),
                                                            use_tqdm=False)]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    server = subprocess.Popen([sys.executable, "-m", "paged_hf.cli", "serve", folder, "--tensor-parallel-size", "2",
                               "--port", str(port), "--block-size", "8", "--num-blocks", "128",
                               "--log-level", "warning"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        followers = _children(server.pid)
        assert followers, "the follower rank runs as a child process"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        got = [client.completions.create(model="stories260K", prompt=p, max_tokens=16, temperature=0).choices[0].text
               for p in prompts]
        assert got == expected
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        assert "paged_hf_tensor_parallel_size 2.0" in metrics
        assert "paged_hf_kv_cache_blocks_total 128.0" in metrics
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in followers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in followers), "a rank outlived the server"
