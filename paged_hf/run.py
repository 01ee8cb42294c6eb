"""``paged-hf run``: runs an unmodified program with the paged KV cache as the default of ``generate``.

    paged-hf run [--kv-cache-dtype F] [--cache-config JSON] -- python script.py args...
    paged-hf run [options] -m module args...          (the current Python runs the module)
    python -m paged_hf.run [options] -- command...
    eval "$(paged-hf run --print-env [options])"       (the same switch for programs that others start)

The options are checked first (a bad key or value exits 2 naming it); then the command replaces this process
(``exec``), so its exit status and signals are the program's own. Its environment differs in three variables:

- ``PYTHONPATH`` starts with ``paged_hf/_sitecustomize``, whose ``sitecustomize`` module imports paged_hf as soon
  as the program imports transformers (and then runs any ``sitecustomize`` it shadows);
- ``PAGED_HF_DEFAULT_CACHE=paged``: ``import paged_hf`` then makes ``cache_implementation="paged"`` the default of
  every ``generate`` call that does not choose its own cache (``paged_hf.enable_default_paged``);
- ``PAGED_HF_CACHE_CONFIG``: that cache's ``cache_config``, as JSON.

Child processes inherit the three, so a program's own Python subprocesses run paged too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

from .config import KV_CACHE_DTYPES
from .patches import default_paged

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sitecustomize")
OPTIONS_WITH_VALUE = ("--kv-cache-dtype", "--cache-config")
USAGE = ("%(prog)s [--kv-cache-dtype F] [--cache-config JSON] [--print-env] (-- COMMAND [ARGS...] | "
         "-m MODULE [ARGS...])")


def build_parser(prog: str = "paged-hf run") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, usage=USAGE,
        description="Run an unmodified program with paged_hf registered and cache_implementation='paged' as the "
                    "default of every generate() call that does not choose its own cache.",
        epilog="Everything after '--' (or after '-m MODULE', or from the first argument that is not an option of "
               "this command) is the program and its arguments, passed through untouched.",
    )
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="storage format of the KV blocks (cache_config's kv_cache_dtype)")
    parser.add_argument("--cache-config", metavar="JSON", default=None,
                        help='the cache_config of the paged caches, e.g. \'{"block_size": 16, "num_blocks": 4096}\'; '
                             f"keys: {default_paged.allowed_keys()}")
    parser.add_argument("--print-env", action="store_true",
                        help="print the environment as shell 'export' lines instead of running a program "
                             '(eval "$(paged-hf run --print-env)" turns the default on for what that shell starts)')
    return parser


def split_command(argv: Sequence[str]) -> tuple[list[str], str | None, list[str]]:
    """(this command's options, the ``-m`` module or None, the program's arguments)."""
    argv, index = list(argv), 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            return argv[:index], None, argv[index + 1:]
        if token == "-m":
            if index + 1 == len(argv):
                return argv, None, []  # argparse reports the missing module
            return argv[:index], argv[index + 1], argv[index + 2:]
        if token.startswith("-m") and not token.startswith("--"):
            return argv[:index], token[2:], argv[index + 1:]
        if not token.startswith("-"):
            return argv[:index], None, argv[index:]
        index += 2 if token in OPTIONS_WITH_VALUE else 1
    return argv, None, []


def cache_config_from_options(cache_config_json: str | None, kv_cache_dtype: str | None) -> dict:
    """The ``cache_config`` the options ask for; ``ValueError`` naming the option and key when one is wrong."""
    options: dict = {}
    if cache_config_json is not None:
        try:
            options = json.loads(cache_config_json)
        except json.JSONDecodeError as error:
            raise ValueError(f"--cache-config is not valid JSON ({error}): {cache_config_json!r}") from None
        if not isinstance(options, dict):
            raise ValueError(f"--cache-config must be a JSON object with keys from {default_paged.allowed_keys()}, "
                             f"got {cache_config_json!r}")
    if kv_cache_dtype is not None:
        if options.get("kv_cache_dtype", kv_cache_dtype) != kv_cache_dtype:
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} contradicts --cache-config's kv_cache_dtype "
                             f"{options['kv_cache_dtype']!r}; give one of the two")
        options["kv_cache_dtype"] = kv_cache_dtype
    try:
        return default_paged.checked_cache_config(options)
    except ValueError as error:
        raise ValueError(f"--cache-config: {error}") from None


def environment(cache_config: Mapping, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``base`` with the switch on: ``SITE_DIR`` first on ``PYTHONPATH`` (once; the other entries kept in order),
    ``PAGED_HF_DEFAULT_CACHE=paged`` and ``PAGED_HF_CACHE_CONFIG``."""
    env = dict(base)
    existing = env.get("PYTHONPATH")
    paths = [p for p in (existing.split(os.pathsep) if existing else []) if not p or os.path.abspath(p) != SITE_DIR]
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *paths])
    env[default_paged.SWITCH_ENV] = "paged"
    env[default_paged.CONFIG_ENV] = json.dumps(dict(cache_config), sort_keys=True)
    return env


def main(argv: Sequence[str] | None = None, prog: str = "paged-hf run") -> int:
    """Checks the options, then replaces this process with the program; returns only on an error (or
    ``--print-env``)."""
    own, module, command = split_command(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(own)
    try:
        cache_config = cache_config_from_options(args.cache_config, args.kv_cache_dtype)
    except ValueError as error:
        parser.error(str(error))
    env = environment(cache_config)
    if args.print_env:
        if module is not None or command:
            parser.error("--print-env prints the environment and runs nothing; drop the command")
        for name in ("PYTHONPATH", default_paged.SWITCH_ENV, default_paged.CONFIG_ENV):
            print(f"export {name}={shlex.quote(env[name])}")
        return 0
    if module is not None:
        command = [sys.executable, "-m", module, *command]
    if not command:
        parser.error("give the program to run: -- COMMAND [ARGS...] or -m MODULE [ARGS...]")
    return _exec(command, env)


def _exec(command: list[str], env: dict[str, str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if os.name == "nt":  # no exec that keeps the process on Windows: wait for the child and pass its status
            return subprocess.call(command, env=env)
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"paged-hf run: {command[0]}: command not found", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"paged-hf run: {command[0]}: permission denied", file=sys.stderr)
        return 126
    return 0  # not reached: exec does not return


if __name__ == "__main__":
    sys.exit(main(prog="python -m paged_hf.run"))
