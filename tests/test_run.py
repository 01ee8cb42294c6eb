"""``paged-hf run``: an unmodified program runs on the paged cache; the environment switch; what passes through.

The programs run in child processes, as users run them. Each child imports this checkout's paged_hf: the tests put
it on PYTHONPATH (an editable install may point elsewhere), and ``paged-hf run`` must keep that entry.
"""

from __future__ import annotations

import json
import os
import runpy
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paged_hf import run
from models import require_stories

ROOT = Path(__file__).resolve().parents[1]

# An ordinary transformers script: no paged_hf anywhere. It reports the cache generate built, the tokens, which
# paged_hf (if any) the process imported, and whether a sitecustomize it did not know about ran.
UNMODIFIED_SCRIPT = textwrap.dedent('''
    import json
    import os
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.unk_token
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = tokenizer(["Once upon a time", "The little dog saw a big red ball"], return_tensors="pt", padding=True)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    config = getattr(out.cache, "cache_config", None)
    print("RESULT " + json.dumps({
        "cache": type(out.cache).__name__,
        "block_size": getattr(config, "block_size", None),
        "kv_cache_dtype": getattr(config, "kv_cache_dtype", None),
        "tokens": out.sequences.tolist(),
        "paged_hf": getattr(sys.modules.get("paged_hf"), "__file__", None),
        "chained": os.environ.get("CHAINED_SITECUSTOMIZE_RAN"),
    }))
''')

# A program that never imports transformers: reports its arguments and environment, then exits with status 3.
PROBE_SCRIPT = textwrap.dedent('''
    import json
    import os
    import sys

    print("RESULT " + json.dumps({
        "argv": sys.argv[1:],
        "executable": sys.executable,
        "switch": os.environ.get("PAGED_HF_DEFAULT_CACHE"),
        "cache_config": os.environ.get("PAGED_HF_CACHE_CONFIG"),
        "imported": sorted(m for m in ("transformers", "torch", "paged_hf") if m in sys.modules),
    }), flush=True)
    if os.environ.get("PROBE_KILL_SELF"):
        os.kill(os.getpid(), __import__("signal").SIGTERM)
    sys.exit(3)
''')


def child_env(with_root: bool = True, **extra) -> dict:
    env = dict(os.environ)
    others = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] * with_root + others)
    env.pop("PAGED_HF_DEFAULT_CACHE", None)
    env.pop("PAGED_HF_CACHE_CONFIG", None)
    env.update(extra)
    return env


def result_of(completed: subprocess.CompletedProcess) -> dict:
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, completed.stdout + completed.stderr
    return json.loads(lines[0].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def unmodified_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("program") / "generate_stories.py"
    path.write_text(UNMODIFIED_SCRIPT)
    return path


@pytest.fixture(scope="module")
def default_run(unmodified_script) -> dict:
    """The script's report run in this process, where paged_hf is imported but its default is off."""
    model_dir = str(require_stories())
    saved = sys.argv
    sys.argv = [str(unmodified_script), model_dir]
    try:
        from io import StringIO  # noqa: PLC0415
        from contextlib import redirect_stdout  # noqa: PLC0415

        buffer = StringIO()
        with redirect_stdout(buffer):
            runpy.run_path(str(unmodified_script), run_name="__main__")
    finally:
        sys.argv = saved
    return result_of(subprocess.CompletedProcess([], 0, buffer.getvalue(), ""))


def test_unmodified_script_runs_on_the_paged_cache_with_the_default_tokens(unmodified_script, default_run):
    assert default_run["cache"] == "DynamicCache"
    # The runner finds this checkout through its working directory only, so the child's paged_hf can only be this
    # checkout's if the runner hands it over (any other install would win a plain `import paged_hf`).
    completed = subprocess.run(
        [sys.executable, "-m", "paged_hf.cli", "run", "--cache-config", '{"block_size": 8}', "--",
         sys.executable, str(unmodified_script), str(require_stories())],
        capture_output=True, text=True, env=child_env(with_root=False), cwd=ROOT, timeout=600,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = result_of(completed)
    assert report["cache"] == "PagedCache"
    assert report["block_size"] == 8, "--cache-config must reach the cache"
    assert report["tokens"] == default_run["tokens"]
    assert report["paged_hf"] == str(ROOT / "paged_hf" / "__init__.py"), "the runner's own paged_hf must load"


def test_environment_switch_for_programs_started_by_others(unmodified_script, tmp_path):
    """eval "$(paged-hf run --print-env ...)" in a shell, then the program starts as anything would start it; a
    sitecustomize that was already on PYTHONPATH still runs."""
    chained = tmp_path / "site"
    chained.mkdir()
    (chained / "sitecustomize.py").write_text("import os\nos.environ['CHAINED_SITECUSTOMIZE_RAN'] = 'yes'\n")
    shell = (f'eval "$({shlex.quote(sys.executable)} -m paged_hf.run --print-env --kv-cache-dtype int8)" && '
             f'exec {shlex.quote(sys.executable)} {shlex.quote(str(unmodified_script))} '
             f'{shlex.quote(str(require_stories()))}')
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(chained), env["PYTHONPATH"]])
    completed = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env, cwd=tmp_path,
                               timeout=600)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = result_of(completed)
    assert report["cache"] == "PagedCache"
    assert report["kv_cache_dtype"] == "int8"
    assert report["chained"] == "yes", "the sitecustomize that paged-hf run shadows must still run"


def test_a_python_where_paged_hf_cannot_load_runs_on_as_without_the_switch(tmp_path):
    """The variables reach every process the program starts, Pythons of other environments too: one whose
    transformers paged_hf does not support warns on stderr and runs as it would without ``paged-hf run``."""
    other = tmp_path / "other_env"  # the program's folder, first on its sys.path: its transformers is too old
    (other / "transformers").mkdir(parents=True)
    (other / "transformers" / "__init__.py").write_text('__version__ = "4.0.0"\n')
    program = other / "program.py"
    program.write_text("import transformers\nprint('RESULT', '\"' + transformers.__version__ + '\"')\n")
    completed = subprocess.run([sys.executable, "-m", "paged_hf.run", "--", sys.executable, str(program)],
                               capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert result_of(completed) == "4.0.0"
    assert "paged-hf run: paged_hf cannot load in" in completed.stderr and "transformers" in completed.stderr


def test_command_arguments_environment_and_exit_status_pass_through(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE_SCRIPT)
    completed = subprocess.run(
        [sys.executable, "-m", "paged_hf.cli", "run", "--kv-cache-dtype", "int8", "--",
         sys.executable, str(probe), "--kv-cache-dtype", "x", "-m", "y", "--"],
        capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=300,
    )
    assert completed.returncode == 3, completed.stdout + completed.stderr
    report = result_of(completed)
    assert report["argv"] == ["--kv-cache-dtype", "x", "-m", "y", "--"]
    assert report["switch"] == "paged"
    assert json.loads(report["cache_config"]) == {"kv_cache_dtype": "int8"}
    assert report["imported"] == [], "a program that never imports transformers must not pay for paged_hf"


def test_module_form_runs_this_python_and_passes_signals(tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE_SCRIPT)
    completed = subprocess.run(
        [sys.executable, "-m", "paged_hf.run", "-m", "probe_module", "a", "--b"],
        capture_output=True, text=True, env=child_env(PROBE_KILL_SELF="1"), cwd=tmp_path, timeout=300,
    )
    assert completed.returncode == -signal.SIGTERM, completed.stdout + completed.stderr
    report = result_of(completed)
    assert report["argv"] == ["a", "--b"]
    assert os.path.realpath(report["executable"]) == os.path.realpath(sys.executable)
    assert report["switch"] == "paged" and json.loads(report["cache_config"]) == {}


# --------------------------------------------------------------------------------------- in this process
@pytest.fixture
def no_exec(monkeypatch):
    def refuse(*args):
        raise AssertionError(f"paged-hf run must not start the program here: {args}")

    monkeypatch.setattr(os, "execvpe", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cache-config", '{"blocksize": 16}', "--", "python", "x.py"], r"unknown key\(s\) \['blocksize'\]"),
        (["--cache-config", '{"block_size": 12}', "--", "python", "x.py"], "block_size must be a power of two"),
        (["--cache-config", "{block_size: 16}", "--", "python", "x.py"], "--cache-config is not valid JSON"),
        (["--cache-config", "[16]", "--", "python", "x.py"], "--cache-config must be a JSON object"),
        (["--cache-config", '{"kv_cache_dtype": "fp8"}', "--kv-cache-dtype", "int8", "--", "python", "x.py"],
         "--kv-cache-dtype int8 contradicts --cache-config's kv_cache_dtype 'fp8'"),
        (["--kv-cache-dtype", "int3", "--", "python", "x.py"], "invalid choice: 'int3'"),
        (["--kv-cache-dtype", "int8"], "give the program to run"),
        (["--print-env", "--", "python", "x.py"], "--print-env prints the environment and runs nothing"),
    ],
    ids=["unknown-key", "bad-value", "bad-json", "not-object", "contradiction", "bad-dtype", "no-command",
         "print-env-with-command"],
)
def test_bad_options_exit_2_naming_the_problem_before_running_anything(argv, message, no_exec, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run.main(argv)
    assert exit_info.value.code == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_a_missing_command_exits_127(capsys):
    assert run.main(["--", "/nonexistent/paged-hf-test-command"]) == 127
    assert "command not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--", "python", "s.py", "--x"], ([], None, ["python", "s.py", "--x"])),
        (["--kv-cache-dtype", "int8", "python", "s.py", "--kv-cache-dtype", "q"],
         (["--kv-cache-dtype", "int8"], None, ["python", "s.py", "--kv-cache-dtype", "q"])),
        (["--cache-config={}", "-m", "mod", "--flag", "-m", "x"], (["--cache-config={}"], "mod", ["--flag", "-m", "x"])),
        (["-mmod", "a"], ([], "mod", ["a"])),
        (["--print-env"], (["--print-env"], None, [])),
    ],
    ids=["dashdash", "first-positional", "module", "module-glued", "options-only"],
)
def test_split_command_leaves_the_program_arguments_untouched(argv, expected):
    assert run.split_command(argv) == expected


def test_environment_prepends_the_site_folder_once_and_keeps_the_rest():
    base = {"PYTHONPATH": os.pathsep.join(["/a", run.SITE_DIR, "/b"]), "OTHER": "1"}
    env = run.environment({"block_size": 8}, base)
    assert env["PYTHONPATH"].split(os.pathsep) == [run.SITE_DIR, "/a", "/b"]
    assert env["PAGED_HF_DEFAULT_CACHE"] == "paged"
    assert json.loads(env["PAGED_HF_CACHE_CONFIG"]) == {"block_size": 8}
    assert env["OTHER"] == "1" and base["PYTHONPATH"].startswith("/a"), "the caller's mapping is left alone"
    assert run.environment({}, {})["PYTHONPATH"] == run.SITE_DIR
