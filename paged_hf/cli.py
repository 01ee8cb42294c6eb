"""What the ``paged-hf`` subcommands do: serve, generate and demo (``paged_hf_cli`` parses their arguments).

Each ``_run_<name>`` takes the parsed arguments and returns the exit status. ``main`` and ``build_parser`` are
``paged_hf_cli``'s, re-exported so that ``python -m paged_hf.cli`` works like the console script.
"""

from __future__ import annotations

import logging
import sys

from paged_hf_cli import LOG_LEVELS, build_parser, main  # noqa: F401 - re-exported

from .demo import DemoSetupError, demo_model_source
from .sampling_defaults import check_generation_config, generation_defaults
from .vision_loading import model_class, serve_media


def _run_demo(args) -> int:
    from .demo import run_demo  # noqa: PLC0415 - loads a model: only when asked

    return run_demo(
        model_dir=args.model_dir,
        max_new_tokens=args.max_new_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
    )


ENGINE_OPTIONS = ("block_size", "num_blocks", "kv_cache_dtype", "kv_cache_memory", "gpu_memory_utilization",
                  "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "swap_space",
                  "kv_offloading_size", "preemption_mode", "scheduling_policy", "max_logprobs", "max_n",
                  "max_stop_strings", "enforce_eager", "cudagraph_mode", "cudagraph_capture_sizes", "cpu_threads_bind",
                  "limit_mm_per_prompt",
                  "max_num_encoder_input_tokens", "speculative_config")


def _engine_options(args) -> dict:
    """The engine options given on the command line; the others keep EngineConfig's defaults."""
    return {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name) is not None}


def _model_folder(args) -> tuple[str, dict]:
    """MODEL (or --model) as a folder and its from_pretrained keywords; DemoSetupError names what is wrong."""
    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        raise DemoSetupError(f"MODEL {args.model!r} and --model {args.model_option!r} differ: give one")
    model, flag = (args.model, "MODEL") if args.model is not None else (args.model_option, "--model")
    directory, extra = demo_model_source(model, flag=flag)
    if args.gguf_file:
        extra = {"gguf_file": args.gguf_file}
    if getattr(args, "trust_remote_code", False):
        extra = {**extra, "trust_remote_code": True}
    return directory, extra


def _model_folder_or_report(args, command: str) -> tuple[str, dict] | None:
    """``_model_folder``, or None once what is wrong is printed under ``paged-hf <command>`` (which then exits with
    status 2): the opening ``serve`` and ``generate`` share."""
    try:
        return _model_folder(args)
    except DemoSetupError as error:
        print(f"paged-hf {command}: {error}", file=sys.stderr)
        return None


def _load_engine(args, source: tuple[str, dict]):
    import torch  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from .engine import PagedEngine  # noqa: PLC0415

    directory, extra = source
    tokenizer_source = getattr(args, "tokenizer", None) or directory
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, **(extra if tokenizer_source == directory else
                                                                    _trust(extra)))
    name = extra.get("gguf_file") or directory.rstrip("/").split("/")[-1]
    dtype = "auto" if args.dtype == "auto" else getattr(torch, DTYPE_ALIASES.get(args.dtype, args.dtype))
    if args.tensor_parallel_size > 1:
        return PagedEngine.from_pretrained(directory, tokenizer, tensor_parallel_size=args.tensor_parallel_size,
                                           distributed_executor_backend=args.distributed_executor_backend,
                                           model_kwargs={"dtype": dtype, **extra}, **_engine_options(args)), name
    model = model_class(directory, extra).from_pretrained(directory, dtype=dtype, attn_implementation="paged", **extra)
    return PagedEngine(model, tokenizer, **_engine_options(args)), name


DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's names


def _trust(extra: dict) -> dict:
    return {"trust_remote_code": True} if extra.get("trust_remote_code") else {}


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
    from .server.auth import api_keys  # noqa: PLC0415

    source = _model_folder_or_report(args, "serve")
    if source is None:
        return 2
    configure_logging(args.log_level)
    try:
        keys = api_keys(args.api_key)
        _check_cors(args)
        _tool_call_parser(args)
        check_generation_config(args.generation_config)
        _check_engine_options(args)  # before the weights load
        template = _chat_template(args.chat_template)
        engine, name = _load_engine(args, source)
        if template is not None:
            engine.tokenizer.chat_template = template
        if args.seed is not None:
            import torch  # noqa: PLC0415

            torch.manual_seed(args.seed)
        defaults = generation_defaults(engine.model, args.generation_config)
        processor, media = serve_media(args, *source)
        app = build_app(engine, args.served_model_name or [name], args.max_queue_len, args.max_request_bytes,
                        allow_unknown_fields=args.allow_unknown_fields, processor=processor, media=media,
                        api_keys=keys, sampling_defaults=defaults, tool_call_parser=_tool_call_parser(args))
    except USER_ERRORS as error:
        return _report("serve", error)
    if args.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware  # noqa: PLC0415

        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_methods=args.allowed_methods or ["*"], allow_headers=args.allowed_headers or ["*"],
                           allow_credentials=bool(args.allow_credentials))
    if defaults:
        logging.getLogger("paged_hf").info("default sampling parameters from the model's generation_config: %s "
                                           "(--generation-config vllm ignores them)", defaults)
    if keys:
        logging.getLogger("paged_hf").info("requests must carry one of %d API key(s)", len(keys))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                root_path=args.root_path)
    return 0


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself (vLLM's rule: a path if one exists)."""
    import os  # noqa: PLC0415

    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as handle:
        return handle.read()


# What a command's options or model can be wrong with: reported in one line, status 2 (a traceback at debug level)
USER_ERRORS = (ValueError, OSError, NotImplementedError)


def _report(command: str, error: BaseException) -> int:
    logging.getLogger("paged_hf").debug("paged-hf %s failed", command, exc_info=error)
    print(f"paged-hf {command}: {type(error).__name__}: {error}", file=sys.stderr)
    return 2


def _check_cors(args) -> None:
    """ValueError for a CORS option given without ``--allowed-origins``, which alone turns CORS on."""
    given = [flag for flag, value in (("--allowed-methods", args.allowed_methods),
                                      ("--allowed-headers", args.allowed_headers),
                                      ("--allow-credentials", args.allow_credentials)) if value is not None]
    if given and not args.allowed_origins:
        raise ValueError(f"{', '.join(given)} need --allowed-origins (CORS is off without it)")


def _tool_call_parser(args) -> str | None:
    """The parser ``tool_choice: "auto"`` uses: ``--tool-call-parser`` under ``--enable-auto-tool-choice``, which
    needs one (vLLM's rule); None when auto tool choice is off."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def _check_engine_options(args) -> None:
    """The engine options' own checks (EngineConfig's), before any weight is read."""
    from .config import EngineConfig  # noqa: PLC0415

    EngineConfig(**_engine_options(args))


def _run_generate(args) -> int:
    import json  # noqa: PLC0415

    from .config import SamplingParams  # noqa: PLC0415

    source = _model_folder_or_report(args, "generate")
    if source is None:
        return 2
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as handle:
            prompts += [line.rstrip("\n") for line in handle if line.strip()]
    if not prompts:
        print("paged-hf generate: give --prompt or --prompts-file", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        _check_engine_options(args)
        engine, _ = _load_engine(args, source)
    except USER_ERRORS as error:
        return _report("generate", error)
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


if __name__ == "__main__":
    sys.exit(main())
