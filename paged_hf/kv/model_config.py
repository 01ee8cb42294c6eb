"""What the KV cache reads from a model's config, and what memory it can take: each layer's KV heads (per
tensor-parallel rank) and head size, which layers read another layer's K/V, dtype, the bytes one block id costs in
every layer, the memory available on a device, and which models it cannot serve. Pure functions of the config (and
of the device, for ``available_memory``).
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


def _split_heads(heads: int, tp_size: int) -> int:
    """``heads`` split ``tp_size`` ways; ValueError (naming both numbers) when ``tp_size`` does not divide them."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tp_size!r}")
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the model's num_key_value_heads={heads}: each rank must "
            f"hold whole KV heads; choose a divisor of {heads}"
        )
    return heads // tp_size


def latent_dims(text_config) -> dict[int, int]:
    """``{layer: latent size}`` of the layers that cache multi-head latent attention's compressed K/V (DeepSeek V2
    and V3, MiniCPM3, Kimi Linear's attention layers: every attention layer of a config with ``kv_lora_rank``). Such
    a layer stores one row a token, ``[latent (kv_lora_rank) | rotary key (qk_rope_head_dim)]``, which serves as
    its key and, its first ``kv_lora_rank`` columns, as its value (``KVStorage(shared_values=True)``); the model
    hands ``cache.update`` the two parts as its "keys" and "values" and expands them into heads after it."""
    rank = getattr(text_config, "kv_lora_rank", None)
    return dict.fromkeys(kv_layers(text_config), rank) if rank else {}


def layer_head_shapes(text_config, tp_size: int = 1) -> dict[int, tuple[int, int]]:
    """``{layer: (KV heads one tensor-parallel rank stores, head size)}`` of every layer that stores K/V: the
    config's, or the layer's own where the model sets them per layer (Gemma 4's full-attention layers, wider and
    with fewer KV heads than its sliding ones); a latent layer's one row (``latent_dims``: one head, the latent and
    the rotary key, the same on every rank). ValueError when ``tp_size`` does not divide a layer's KV heads."""
    latent = latent_dims(text_config)
    if latent:
        _split_heads(text_config.num_attention_heads, tp_size)  # each rank its query heads, the whole latent
        return dict.fromkeys(latent, (1, text_config.kv_lora_rank + text_config.qk_rope_head_dim))
    per_layer = text_config.per_layer_config if getattr(text_config, "is_heterogeneous", False) else None
    shapes = {}
    for idx in kv_layers(text_config):
        layer = text_config if per_layer is None else per_layer[idx]
        shapes[idx] = (_split_heads(kv_heads_of(layer), tp_size), head_dim_of(layer))
    return shapes


def kv_sources(text_config) -> dict[int, int]:
    """``{layer: the layer whose K/V it reads}`` for the layers that store none of their own (Gemma 3n's and Gemma
    4's last ``num_kv_shared_layers``: each reads the last earlier layer of its own type that stores, as the
    model's ``shared_kv_states`` hands them over). NotImplementedError for a reading layer with no such layer (an
    assistant model, all of whose layers read its target model's K/V)."""
    modes = getattr(text_config, "kv_sharing_modes", None)
    if not modes or not getattr(text_config, "num_kv_shared_layers", 0):
        return {}
    layer_types = text_config.layer_types
    stores = {layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    sources = {}
    for idx, mode in enumerate(modes):
        if mode != "reuse":
            continue
        if layer_types[idx] not in stores:
            raise NotImplementedError(
                f"layer {idx} of {text_config.model_type!r} reads the K/V of a {layer_types[idx]!r} layer that no "
                f"layer of this model stores (an assistant model reading its target model's cache): the paged cache "
                f"holds a model's own K/V only")
        sources[idx] = stores[layer_types[idx]]
    return sources


def block_id_bytes(text_config, block_size: int, kv_cache_dtype: str, tp_size: int = 1,
                   dtype: torch.dtype | None = None) -> int:
    """Bytes one block id takes in every layer of a model (K and V, scales and zeros), at ``dtype`` (default: the
    config's), each layer with its heads split ``tp_size`` ways. ``quant.layer_block_bytes`` is one layer's."""
    dtype = dtype or config_dtype(text_config)
    latent = latent_dims(text_config)
    return sum(layer_block_bytes(check_kv_format(kv_cache_dtype, head_dim), block_size, heads, head_dim, dtype,
                                 shared_values=idx in latent)
               for idx, (heads, head_dim) in layer_head_shapes(text_config, tp_size).items())


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
    DeepSeek's sparse attention (V3.2's indexer over the latent K/V), Falcon's ALiBi, and layers reading K/V no layer of the model
    stores (``kv_sources``)."""
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
    if getattr(text_config, "kv_lora_rank", None) and getattr(text_config, "index_topk", None):
        raise NotImplementedError(
            f"PagedCache cannot serve {model_type!r}: its sparse attention (index_topk={text_config.index_topk}) "
            f"caches an indexer's keys beside the latent K/V and attends over the tokens the indexer picks, which "
            f"the paged attention does not do; it runs on the default DynamicCache")
    if model_type == "falcon" and getattr(text_config, "alibi", False):
        raise NotImplementedError(
            "PagedCache cannot serve Falcon with alibi=True (Falcon-RW): its attention adds ALiBi biases in its own "
            "code, outside transformers' attention interface (the engine's paged attention cannot read them), and "
            "builds them from a 2-D attention mask, which generate replaces with a 4-D one for a compileable cache "
            "(transformers' StaticCache fails there too); it runs on the default DynamicCache")
    layer_head_shapes(text_config), kv_sources(text_config)
