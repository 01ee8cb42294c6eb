"""``LLM``: vLLM's offline API (``vllm.LLM``) on a transformers model, served by ``PagedEngine``.

A script written for vLLM runs by changing its import::

    from paged_hf import LLM, SamplingParams          # was: from vllm import LLM, SamplingParams

    llm = LLM(model="path/to/model")                  # a model folder, a .gguf file, or a hub name
    outputs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.8, max_tokens=64))
    print(outputs[0].outputs[0].text)

The model and tokenizer load through transformers (``AutoModelForCausalLM``, ``AutoTokenizer``); requests run on
``PagedEngine``, whose ``RequestOutput`` / ``CompletionOutput`` have vLLM's shape. ``SamplingParams`` reach the
engine unchanged. vLLM keywords that only tune vLLM's own machinery (CUDA graphs, custom all-reduce, stats logging)
are accepted and have nothing to do here; any other keyword this class cannot honour raises ``ValueError``
naming it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields

import torch

from .config import GIB, EngineConfig, SamplingParams, check_known
from .engine import PagedEngine, RequestOutput
from .media import MediaPolicy
from .model_source import explained_hub_miss, load_tokenizer, model_source
from .multimodal_prompts import processed_images, render_chat
from .sampling_defaults import default_sampling_params
from .vision_loading import load_processor, model_class

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig))
# vLLM keyword -> the value(s) this class can honour (None: any value; it tunes machinery that does not exist here).
VLLM_KEYWORDS: dict[str, tuple | None] = {
    "pipeline_parallel_size": (1,), "quantization": (None,), "cpu_offload_gb": (0,),
    "enable_chunked_prefill": (True, None),
    "max_seq_len_to_capture": None, "disable_custom_all_reduce": None,
    "disable_log_stats": None, "logprobs_mode": ("raw_logprobs",),
}
WHY_NOT = {
    "pipeline_parallel_size": "pipeline parallelism is not supported",
    "quantization": "load a quantized checkpoint through transformers (its quantization_config is read as usual) "
                    "or quantize the KV blocks with kv_cache_dtype",
    "cpu_offload_gb": "weight offloading is not supported",
    "enable_chunked_prefill": "the engine always chunks prefills within max_num_batched_tokens",
    "logprobs_mode": "logprobs are the model's raw log_softmax, before penalties, temperature and filtering",
}
# The compilation_config entries LLM honours (as the engine options of the same names); the engine compiles its
# forward its own way, so any other entry is refused by name.
COMPILATION_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes")
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt", "multi_modal_data")


class RequestsFailed(RuntimeError):
    """Raised by ``LLM.generate`` / ``chat`` when requests failed while running (each fails alone: the others ran to
    their end). ``outputs``: one ``RequestOutput`` per prompt, in order, the failed ones with ``error`` set."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs
        failed = [o for o in outputs if o.error is not None]
        super().__init__(f"{len(failed)} of {len(outputs)} requests failed; request {failed[0].request_id}: "
                         f"{failed[0].error} (the exception's outputs hold every request's output)")


class LLM:
    """vLLM's ``LLM`` on a transformers model.

    Args:
        model: a model folder, a ``.gguf`` file (or a folder with ``gguf_file=``), a hub name, or a loaded
            ``PreTrainedModel`` (kept where it is unless ``dtype`` / ``device`` say otherwise).
        tokenizer: a path or hub name, or a tokenizer object; None loads the model's.
        dtype: "auto" (the checkpoint's dtype), "float32"/"float", "bfloat16", "float16"/"half", or a torch dtype.
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        seed: seeds torch's global RNG once the model is loaded (what requests without their own
            ``SamplingParams.seed`` draw from), as vLLM does in-process; None leaves it alone.
        generation_config: "auto" takes default sampling parameters from the model's generation_config (as vLLM),
            "vllm" ignores them, or a folder holding a generation_config.json.
        skip_tokenizer_init: no tokenizer: prompts must be token ids and outputs carry no text.
        processor: the model's processor (e.g. ``AutoProcessor.from_pretrained(...)``), which images need: it expands
            the image placeholders and makes the pixel values (``multi_modal_data``, image content parts); None
            loads a vision-language model folder's own.
        media: a ``paged_hf.media.MediaPolicy``: which image URLs of chat content parts may be read (by default data:
            URLs only) and the most pixels of one image.
        trust_remote_code, revision, tokenizer_revision, gguf_file: passed to ``from_pretrained``.
        tensor_parallel_size, distributed_executor_backend: as vLLM: N > 1 shards the model (a path: each rank
            loads its shard) over N ranks with transformers' tensor-parallel plan, on CUDA when available (NCCL)
            else on the CPU (gloo); this process leads and starts the others as local processes ("mp", the
            default) or Ray actors ("ray"). See ``PagedEngine.from_pretrained``; ``shutdown()`` stops them.
        **options: ``PagedEngine`` options (``EngineConfig``: ``max_num_seqs``, ``kv_cache_dtype``,
            ``enable_prefix_caching``, ``gpu_memory_utilization``, ``max_model_len``, ``block_size``,
            ``swap_space``, ...), vLLM's ``num_gpu_blocks_override`` (= ``num_blocks``) and
            ``kv_cache_memory_bytes``, vLLM's ``compilation_config`` (its ``COMPILATION_KEYS`` only:
            ``{"cudagraph_mode": "NONE"}`` turns CUDA graphs off), and the vLLM keywords of ``VLLM_KEYWORDS``.
    """

    def __init__(self, model, tokenizer=None, *, tokenizer_mode: str = "auto", skip_tokenizer_init: bool = False,
                 trust_remote_code: bool = False, dtype="auto", device: str = "auto", seed: int | None = 0,
                 revision: str | None = None, tokenizer_revision: str | None = None, gguf_file: str | None = None,
                 generation_config: str = "auto", tensor_parallel_size: int = 1,
                 distributed_executor_backend: str | None = None, processor=None, media=None, **options) -> None:
        engine_options = _engine_options(options)
        if tokenizer_mode != "auto":
            raise ValueError(f"tokenizer_mode must be 'auto' (transformers' AutoTokenizer), got {tokenizer_mode!r}")
        torch_dtype = _torch_dtype(dtype)
        target = _device(device)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        tokenizer = None if skip_tokenizer_init else load_tokenizer(
            tokenizer, model, trust_remote_code=trust_remote_code, revision=tokenizer_revision or revision,
            gguf_file=gguf_file)
        if distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be one of [None, 'mp', 'ray'], got "
                             f"{distributed_executor_backend!r}")
        if tensor_parallel_size == 1:
            self.model = _load_model(model, torch_dtype, target, trust_remote_code, revision, gguf_file)
            self.llm_engine = PagedEngine(self.model, tokenizer, **engine_options)
        else:
            self.llm_engine = _tensor_parallel_engine(model, tokenizer, tensor_parallel_size,
                                                      distributed_executor_backend or "mp", device, torch_dtype,
                                                      trust_remote_code, revision, gguf_file, engine_options)
            self.model = self.llm_engine.runner.model
        self.tokenizer = tokenizer
        if processor is None and tensor_parallel_size == 1 and isinstance(model, (str, os.PathLike)):
            processor = load_processor(*model_source(model, gguf_file))  # None for a text model
        self.processor = processor
        self.media = media if media is not None else MediaPolicy()
        self._default_params = default_sampling_params(self.model, generation_config)
        if seed is not None:
            torch.manual_seed(seed)

    # ---------------------------------------------------------------------------------------- front ends
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, lora_request=None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Completes ``prompts``: a string, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}`` (vLLM's
        TextPrompt / TokensPrompt, optionally with ``cache_salt``), a list of token ids, or a list of any of these.
        ``{"prompt": text, "multi_modal_data": {"image": an image or a list of them}}`` (PIL, uint8 pixel arrays):
        the text holds the model's image placeholder once per image (the processor expands it).
        Returns one ``RequestOutput`` per prompt, in order. A prompt that cannot run raises ``ValueError`` before
        any work starts; a request that fails while running raises ``RequestsFailed`` (a ``RuntimeError``) at the
        end, whose ``outputs`` hold every request's output, the failed ones with ``error`` set."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: LLM serves one set of weights (merge the adapter)")
        prompts = _prompt_list(prompts)
        images = processed_images(prompts, self.processor, self.media)  # multi_modal_data prompts become token ids
        params = self._params_list(sampling_params, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        if any(priorities) and self.llm_engine.config.scheduling_policy != "priority":
            raise ValueError("priority needs scheduling_policy='priority' (the LLM was built with "
                             f"{self.llm_engine.config.scheduling_policy!r}, which ignores it)")
        return self._run(prompts, params, priorities, use_tqdm, images)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, lora_request=None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: Mapping | None = None) -> list[RequestOutput]:
        """Answers one conversation (a list of ``{"role", "content"}`` messages) or a list of them, rendered with
        the tokenizer's chat template (or ``chat_template``). Content may be OpenAI's parts: text, ``image_url``
        (data: URLs, or what ``media`` allows) and vLLM's ``image_pil``."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init=True")
        if lora_request is not None:
            raise ValueError("lora_request is not supported: LLM serves one set of weights (merge the adapter)")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        template = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message, tools=tools, **dict(chat_template_kwargs or {}))
        rendered = [render_chat(self.tokenizer, self.processor, list(c), self.media, template) for c in conversations]
        if all(tensors is None for _, tensors in rendered):
            return self.generate([prompt for prompt, _ in rendered], sampling_params, use_tqdm=use_tqdm)
        return self._run([(prompt, None) for prompt, _ in rendered], self._params_list(sampling_params, len(rendered)),
                         [0] * len(rendered), use_tqdm, [tensors for _, tensors in rendered])

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks this LLM started (a no-op on one process)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's generation_config defaults (unless ``generation_config="vllm"``)."""
        return self._default_params

    def get_stats(self) -> dict:
        """``PagedEngine.get_stats()`` plus the memory of the model and the KV pool on their device: ``device``,
        ``model_memory_gib`` (parameters and buffers), ``kv_cache_memory_gib`` (the pool's tensors), and on CUDA
        ``gpu_memory_used`` (GiB torch holds on the device, what nvidia-smi shows for the process less the CUDA
        context), on CPU ``cpu_memory_used`` (the process's resident memory, GiB)."""
        engine_stats = self.llm_engine.get_stats()
        stats = engine_stats.as_dict()
        device = self.model.device
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        stats["device"] = str(device)
        stats["model_memory_gib"] = sum(t.numel() * t.element_size() for t in tensors) / GIB
        stats["kv_cache_memory_gib"] = engine_stats.kv_cache_bytes / GIB
        if device.type == "cuda":
            stats["gpu_memory_used"] = torch.cuda.memory_reserved(device) / GIB
        else:
            stats.update(_host_memory())
        return stats

    # ------------------------------------------------------------------------------------------ running
    def _params_list(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self._default_params] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be paged_hf.SamplingParams (or a list of them), got {p!r}")
        return params

    def _run(self, prompts, params, priorities, use_tqdm, images) -> list[RequestOutput]:
        # PagedEngine.generate checks every prompt before any work (a bad one raises, nothing stays queued)
        outputs = self.llm_engine.generate([prompt for prompt, _ in prompts], list(params), use_tqdm,
                                           priority=list(priorities), cache_salt=[salt for _, salt in prompts],
                                           images=images if any(i is not None for i in images) else None)
        if any(o.error is not None for o in outputs):
            raise RequestsFailed(outputs)
        return outputs


# ------------------------------------------------------------------------------------------- arguments
def _engine_options(options: dict) -> dict:
    engine = {name: options.pop(name) for name in ENGINE_OPTIONS if name in options}
    if "num_gpu_blocks_override" in options:
        engine.setdefault("num_blocks", options.pop("num_gpu_blocks_override"))
    if "kv_cache_memory_bytes" in options:
        value = options.pop("kv_cache_memory_bytes")
        if value is not None:
            engine.setdefault("kv_cache_memory", value / GIB)
    compilation = _compilation_options(options.pop("compilation_config", None))
    twice = sorted(set(compilation) & set(engine))
    if twice:
        raise ValueError(f"{twice} given both as options and in compilation_config: give each once")
    engine.update(compilation)
    for name, allowed in VLLM_KEYWORDS.items():
        if name in options:
            value = options.pop(name)
            if allowed is not None and value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)} here ({WHY_NOT[name]}), got {value!r}")
    check_known("LLM", "keyword", options,
                [*ENGINE_OPTIONS, "num_gpu_blocks_override", "kv_cache_memory_bytes", "compilation_config",
                 *VLLM_KEYWORDS])
    EngineConfig(**engine)  # bad values raise here, naming the field, before the model loads
    return engine


def _compilation_options(config) -> dict:
    """vLLM's ``compilation_config`` (None or a dict) as engine options: ``COMPILATION_KEYS`` only (e.g.
    ``{"cudagraph_mode": "NONE"}`` turns CUDA graphs off); another entry raises ``ValueError`` naming it."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise ValueError(f"compilation_config must be None or a dict with keys from {list(COMPILATION_KEYS)}, got "
                         f"{config!r}")
    unknown = sorted(set(config) - set(COMPILATION_KEYS))
    if unknown:
        raise ValueError(f"compilation_config keys {unknown} are not supported: the engine compiles its forward its "
                         f"own way (enforce_eager=True runs it eagerly); it honours {list(COMPILATION_KEYS)}")
    return dict(config)


def _torch_dtype(dtype):
    if dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto', one of {list(DTYPES)} or a torch.dtype, got {dtype!r}")
    return DTYPES[dtype]


def _device(device) -> torch.device | None:
    """The device to place the model on; None for "auto" with a loaded model (left where it is)."""
    text = str(device)
    if text == "auto":
        return None
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device must be one of {list(DEVICES)}, got {device!r}")
    return torch.device(text)


def _load_model(model, dtype, device, trust_remote_code, revision, gguf_file):
    from transformers import PreTrainedModel  # noqa: PLC0415

    if isinstance(model, PreTrainedModel):
        if dtype != "auto":
            model = model.to(dtype)
        return model if device is None else model.to(device)
    name, extra = model_source(model, gguf_file)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if revision is not None:
        extra["revision"] = revision
    if device.type != "cpu":
        extra["device_map"] = str(device)
    with explained_hub_miss(name):  # a vision-language folder: its image-text class where it has no causal one
        model = model_class(name, extra).from_pretrained(name, dtype=dtype, attn_implementation="paged",
                                                         trust_remote_code=trust_remote_code, **extra)
    return model.eval()


def _tensor_parallel_engine(model, tokenizer, size, backend, device, dtype, trust_remote_code, revision, gguf_file,
                            engine_options) -> PagedEngine:
    from transformers import PreTrainedModel  # noqa: PLC0415

    if isinstance(model, PreTrainedModel):
        raise ValueError(f"tensor_parallel_size={size} needs the model's path, not a loaded model: every rank loads "
                         f"its own shard")
    if str(device) != "auto":
        raise ValueError(f"device must be 'auto' with tensor_parallel_size={size} (the ranks use CUDA when "
                         f"available, else the CPU), got {device!r}")
    name, extra = model_source(model, gguf_file)
    if revision is not None:
        extra["revision"] = revision
    return PagedEngine.from_pretrained(name, tokenizer, tensor_parallel_size=size,
                                       distributed_executor_backend=backend,
                                       model_kwargs=dict(dtype=dtype, trust_remote_code=trust_remote_code, **extra),
                                       **engine_options)


def _prompt_list(prompts) -> list[tuple[object, str | None]]:
    """(engine prompt, cache_salt) per prompt; one prompt (a string, a dict, a list of ids) becomes a list of one."""
    single = not isinstance(prompts, Sequence) or isinstance(prompts, str) or (
        prompts and all(isinstance(t, int) for t in prompts))
    return [_engine_prompt(p) for p in ([prompts] if single else list(prompts))]


def _engine_prompt(prompt) -> tuple[object, str | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"prompt has unsupported key(s) {unknown}; allowed keys are {list(PROMPT_KEYS)}")
        if "multi_modal_data" in prompt:  # LLM.generate runs the processor
            return dict(prompt), prompt.get("cache_salt")
        if "prompt_token_ids" in prompt:
            return {"prompt": prompt.get("prompt"), "prompt_token_ids": list(prompt["prompt_token_ids"])}, \
                prompt.get("cache_salt")
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], prompt.get("cache_salt")
        raise ValueError(f"a prompt dict needs 'prompt' (a string) or 'prompt_token_ids', got {prompt!r}")
    if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt), None
    raise ValueError(f"a prompt must be a string, a dict with 'prompt' or 'prompt_token_ids', or a list of token ids, "
                     f"got {prompt!r}")


def _host_memory() -> dict:
    """Resident memory of this process (Linux), else its peak (``cpu_memory_peak``), in GiB."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            resident_pages = int(handle.read().split()[1])
        return {"cpu_memory_used": resident_pages * os.sysconf("SC_PAGE_SIZE") / GIB}
    except (OSError, ValueError, IndexError):
        import resource  # noqa: PLC0415
        import sys  # noqa: PLC0415

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return {"cpu_memory_peak": peak * (1 if sys.platform == "darwin" else 1024) / GIB}
