"""What the KV cache reads from a model's config, and what memory it can take: head size, KV heads (per
tensor-parallel rank), dtype, the bytes one block id costs in every layer, the memory available on a device, and
which models it cannot serve. Pure functions of the config (and of the device, for ``available_memory``).
"""

from __future__ import annotations

import os

import torch

from ..quant import check_kv_format, layer_block_bytes
from .recurrent import kv_layers

STATE_SPACE_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")


def head_dim_of(text_config) -> int:
    """The attention head size (``head_dim``, else ``hidden_size / num_attention_heads``)."""
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def kv_heads_of(text_config) -> int:
    """The model's KV heads (``num_key_value_heads``, else ``num_attention_heads``: no grouped-query attention)."""
    return getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads


def config_dtype(text_config) -> torch.dtype:
    """The config's dtype as a ``torch.dtype`` (float32 when it names none)."""
    dtype = getattr(text_config, "dtype", None) or torch.float32
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))


def local_kv_heads(text_config, tp_size: int = 1) -> int:
    """KV heads one tensor-parallel rank stores: the config's, split ``tp_size`` ways. ValueError (naming both
    numbers) when ``tp_size`` does not divide them."""
    heads = kv_heads_of(text_config)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tp_size!r}")
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the model's num_key_value_heads={heads}: each rank must "
            f"hold whole KV heads; choose a divisor of {heads}"
        )
    return heads // tp_size


def block_id_bytes(text_config, block_size: int, kv_cache_dtype: str, num_kv_heads: int | None = None,
                   dtype: torch.dtype | None = None) -> int:
    """Bytes one block id takes in every layer of a model (K and V, scales and zeros), at ``dtype`` (default: the
    config's) with ``num_kv_heads`` heads (default: the config's). ``quant.layer_block_bytes`` is one layer's."""
    head_dim = head_dim_of(text_config)
    layer = layer_block_bytes(check_kv_format(kv_cache_dtype, head_dim), block_size,
                              num_kv_heads or kv_heads_of(text_config), head_dim, dtype or config_dtype(text_config))
    return layer * len(kv_layers(text_config))


def available_memory(device: torch.device) -> int:
    """Bytes a new allocation can take on ``device``: free device memory on CUDA, available RAM on the host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - a platform without sysconf
        return 1 << 62


def check_supported(text_config, config=None) -> None:
    """NotImplementedError for models the paged cache cannot serve: encoder-decoder and state-space models,
    multi-head latent attention (DeepSeek V2/V3), Falcon's ALiBi, head sizes set per layer (Gemma 4) and layers that
    read another layer's K/V (Gemma 3n)."""
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"PagedCache supports decoder-only models; {type(config).__name__} is an encoder-decoder model"
        )
    model_type = getattr(text_config, "model_type", "")
    if model_type in STATE_SPACE_MODEL_TYPES or getattr(text_config, "layer_types", None) is None and any(
        hasattr(text_config, attr) for attr in ("ssm_state_size", "state_size", "mamba_expand")
    ):
        raise NotImplementedError(
            f"PagedCache holds attention K/V; {model_type!r} is a state-space model with no KV cache to page"
        )
    if getattr(text_config, "kv_lora_rank", None):
        raise NotImplementedError(
            f"PagedCache pages each layer's keys and values per KV head; {model_type!r} uses multi-head latent "
            f"attention (kv_lora_rank={text_config.kv_lora_rank}): its layers cache a compressed latent and a rotary "
            f"key, which the paged pools do not hold")
    if model_type == "falcon" and getattr(text_config, "alibi", False):
        raise NotImplementedError(
            "PagedCache cannot serve Falcon with alibi=True (Falcon-RW): its attention adds ALiBi biases in its own "
            "code, outside transformers' attention interface (the engine's paged attention cannot read them), and "
            "builds them from a 2-D attention mask, which generate replaces with a 4-D one for a compileable cache "
            "(transformers' StaticCache fails there too); it runs on the default DynamicCache")
    try:
        head_dim_of(text_config), kv_heads_of(text_config)
    except RuntimeError as error:  # transformers' AmbiguousGlobalPerLayerAttributeError (heterogeneous configs)
        if type(error).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        raise NotImplementedError(
            f"PagedCache sizes its pools from one head size and KV-head count per model; {model_type!r} sets them "
            f"per layer ({error})") from None
    if getattr(text_config, "num_kv_shared_layers", 0):
        raise NotImplementedError(
            f"PagedCache gives every layer its own K/V; {model_type!r}'s last {text_config.num_kv_shared_layers} "
            f"layers (num_kv_shared_layers) read the K/V of earlier layers")
