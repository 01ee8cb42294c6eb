"""What every rank of an engine builds, and a tensor-parallel follower's whole life.

Each rank (the leader, which runs the ``PagedEngine``, and each follower) prepares its model for the paged attention,
sizes and allocates the same KV pool (the smallest pool of the group wins, agreed by a collective) and builds a
``ModelRunner``. A follower is nothing more: it runs every forward the leader broadcasts (``follow``) and never
sees a request, a tokenizer or a scheduler.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ..config import DEFAULT_CPU_KV_CACHE_GIB, GIB, EngineConfig
from ..distributed import tensor_parallel_group
from ..distributed.group import init_group
from ..kv.manager import KVManager
from ..kv.model_config import available_memory, block_id_bytes, check_supported
from ..kv.sizing import allocate_all
from ..packed_linear import pack_linears
from ..kv.recurrent import recurrent_layers, state_bytes
from .recurrent_mixers import check_options, state_shapes, wrap_mixers
from .runner import ModelRunner

logger = logging.getLogger("paged_hf")


def prepare_model(model):
    """``model`` switched to the ``"paged"`` attention, in eval mode, its bfloat16 and float32 CPU linears packed
    for oneDNN (``packed_linear``);
    NotImplementedError for encoder-decoders, for what the paged cache cannot hold (``check_supported``) and for a
    model whose attention is its own code (MPT, Bloom: transformers cannot switch it)."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotImplementedError(f"PagedEngine serves decoder-only models; {type(model).__name__} is not")
    text_config = model.config.get_text_config(decoder=True)
    check_supported(text_config, model.config)  # a state-space model says so before its attention is switched
    if model.config._attn_implementation != "paged":
        model.set_attn_implementation("paged")
        if model.config._attn_implementation != "paged":
            raise NotImplementedError(
                f"PagedEngine cannot serve {type(model).__name__}: its attention is its own code, outside "
                f"transformers' attention interface, so it cannot read the paged blocks (attn_implementation stays "
                f"{model.config._attn_implementation!r})")
    if wrap_mixers(model):
        logger.info("PagedEngine: %s has recurrent layers; their states take a row per running sequence",
                    type(model).__name__)
    pack_linears(model, available_memory(model.device))
    return model.eval()


def max_model_len_of(config: EngineConfig, model) -> int:
    """``config.max_model_len``, else the model's ``max_position_embeddings`` (4096 without one). A length past
    the model's positions is honoured with a warning: positions it was not trained on (vLLM refuses it unless
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set; a model whose RoPE scaling reaches further is one reason to ask)."""
    text_config = model.config.get_text_config(decoder=True)
    trained = getattr(text_config, "max_position_embeddings", None)
    if config.max_model_len and trained and config.max_model_len > trained:
        logger.warning("max_model_len=%d is past the model's max_position_embeddings=%d: tokens beyond position %d "
                       "run at positions the model was not trained on, and their output may be poor",
                       config.max_model_len, trained, trained)
    return config.max_model_len or trained or 4096


def build_kv(model, config: EngineConfig, group=None) -> KVManager:
    """This rank's KV manager: pool sized (``num_blocks``, else from memory), agreed with the group, allocated on
    the model's device, its Triton kernels compiled (a collective under tensor parallelism: every rank calls it)."""
    text_config = model.config.get_text_config(decoder=True)
    tp_size = group.size if group is not None else 1
    check_options(config, text_config, group is not None)
    recurrent = bool(recurrent_layers(text_config))
    shapes, state_rows = {}, 0
    if recurrent:
        if config.enable_prefix_caching:
            logger.warning("PagedEngine: prefix caching is off for %r: a cached block holds K/V but not the "
                           "recurrent layers' states after it (enable_prefix_caching=False says so)",
                           text_config.model_type)
        shapes, state_rows = state_shapes(model), config.max_num_seqs + 1  # the running ones, and the queue's head
        logger.info("PagedEngine: the recurrent layers' states take %.2f MiB a sequence, %.2f GiB for %d rows "
                    "(max_num_seqs + 1)%s", state_bytes(shapes) / 2**20, state_bytes(shapes) * state_rows / GIB,
                    state_rows, "" if config.num_blocks else ", out of the KV memory budget")
    num_blocks = config.num_blocks or _blocks_from_memory(model, config, text_config, tp_size,
                                                          state_bytes(shapes) * state_rows)
    if group is not None:  # every rank must hold the same blocks: the smallest pool wins
        num_blocks = group.min(num_blocks)
    kv = KVManager(text_config, config.block_size, config.kv_cache_dtype, num_blocks,
                   enable_prefix_caching=config.enable_prefix_caching and not recurrent,
                   swap_space_bytes=0 if recurrent else int(config.swap_space * GIB),
                   tp_size=tp_size,
                   kv_offloading_bytes=int(config.kv_offloading_size * GIB), recurrent_states=recurrent)
    allocate_all(kv, model.dtype, model.device)
    if kv.recurrent is not None:
        kv.recurrent.allocate(shapes, state_rows, model.device)
    _warm_up_kernels(kv, text_config, model.dtype)
    return kv


def _blocks_from_memory(model, config: EngineConfig, text_config, tp_size: int, state_bytes: int = 0) -> int:
    """Blocks that fit the KV memory budget (``kv_cache_memory``, else the device default: see ``EngineConfig``),
    capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use. With a draft model, the budget
    holds its pool too (as many blocks, in the model's dtype): a block id counts both. ``state_bytes``: what the
    recurrent layers' states take out of the budget first (ValueError, naming the options, where nothing is left)."""
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory * GIB
    elif model.device.type == "cuda":
        budget = available_memory(model.device) * config.gpu_memory_utilization
    else:
        budget = min(DEFAULT_CPU_KV_CACHE_GIB * GIB, available_memory(model.device) / 2)
    if state_bytes:
        if state_bytes >= budget:
            raise ValueError(
                f"the recurrent layers' states of max_num_seqs={config.max_num_seqs} sequences take "
                f"{state_bytes / GIB:.2f} GiB, the whole KV memory budget ({budget / GIB:.2f} GiB): lower max_num_seqs "
                f"or raise kv_cache_memory")
        budget -= state_bytes
    per_block = block_id_bytes(text_config, config.block_size, config.kv_cache_dtype, tp_size, dtype=model.dtype) + \
        _draft_block_bytes(config, model.dtype)
    cap = config.max_num_seqs * math.ceil(max_model_len_of(config, model) / config.block_size)
    return max(1, min(int(budget) // per_block, cap))


def _draft_block_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes a block id takes in the pool of ``speculative_config``'s draft model (0 without one)."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return 0
    if isinstance(spec.model, torch.nn.Module):
        draft_config, dtype = spec.model.config, spec.model.dtype
    else:
        from transformers import AutoConfig  # noqa: PLC0415 - only a draft folder needs it

        draft_config = AutoConfig.from_pretrained(spec.model)
    return block_id_bytes(draft_config.get_text_config(decoder=True), config.block_size, "auto", dtype=dtype)


def _warm_up_kernels(kv: KVManager, text_config, dtype: torch.dtype) -> None:
    """On the Triton path, compiles every kernel variant the layers will launch now, so no request waits for a
    compile (one variant per kind of layer: nothing compiled depends on the batch). A model with attention sinks
    compiles its sink variants at its first step."""
    kinds: dict[tuple, object] = {}
    for group in kv.groups:
        for storage in group.storages.values():
            if storage.kernels.triton:
                kinds.setdefault((group.window, getattr(storage, "kv_format", "auto"), storage.head_shape), storage)
    if not kinds:
        return
    from ..kernels.warmup import warmup_kernels  # noqa: PLC0415 - imports triton

    started = time.perf_counter()
    softcap = getattr(text_config, "attn_logit_softcapping", None)
    for (window, _, _), storage in kinds.items():
        warmup_kernels(storage.pool_tensors(), num_heads=text_config.num_attention_heads, dtype=dtype,
                       sliding_window=window, softcap=softcap, store_dtype=storage.store_dtype,
                       copy_tensors=list(storage.tensors().values()))
    logger.info("compiled the kernels of %d layer kinds in %.1f s", len(kinds), time.perf_counter() - started)


# ------------------------------------------------------------------------------------------ followers
def follow(runner: ModelRunner, until_done: bool = False):
    """A follower's loop: runs every step the leader broadcasts until it says stop (or, ``until_done``, until its
    ``generate`` returns: then returns the same outputs). A step that raises here raises on the leader too (same
    inputs), which isolates the culprit and broadcasts the retries: the follower just goes on."""
    group = runner.group
    while True:
        message = group.broadcast()
        kind = message[0]
        if kind == "step":
            try:
                runner.run(message[1])
            except Exception as error:  # noqa: BLE001 - the leader reports it, with the same error
                logger.warning("rank %d: a step raised %s: %s", group.rank, type(error).__name__, error)
        elif kind == "done" and until_done:
            return message[1]
        elif kind == "stop":
            return None


def follower_runner(model, engine_options: dict, group) -> ModelRunner:
    """A follower's runner over its shard ``model``: the pool the leader's engine builds, and nothing else. It runs
    eagerly, as the leader does under tensor parallelism (a warm-up forward runs collectives, and a compile that
    failed on one rank only would leave the ranks with different forwards)."""
    config = EngineConfig.from_options("PagedEngine", engine_options)
    model = prepare_model(model)
    return ModelRunner(model, build_kv(model, config, group), group, compile=False)


def run_follower(rank: int, group, spec, engine_options: dict) -> None:
    """A follower rank's whole life (the target ``launch_workers`` starts): join, load its shard, follow, leave."""
    init_group(rank, group.size, group.address, group.port, group.backend, group.timeout_s)
    try:
        model = spec.load(group.size)
        follow(follower_runner(model, engine_options, tensor_parallel_group(model)))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
