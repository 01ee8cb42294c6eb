"""Hands the forward's 2D attention mask to a ``PagedCache`` when transformers builds its masks (5.20 <= version < 6).

Every mask builder of ``transformers.masking_utils`` (causal, sliding window, chunked) starts with
``_preprocess_mask_arguments(config, inputs_embeds, attention_mask, cache, position_ids, layer_idx, ...)``, before any
layer of the forward runs; in ``generate`` with a compileable cache it even runs before the forward, eagerly. The
wrapper gives a ``PagedCache`` the batch, query length, 2D mask and positions there, so the cache plans the forward
once from the true mask (right padding, holes, direct calls), and then lets transformers go on. With the
``"paged"`` attention a decode step builds no mask at all (the paged attention derives causality from its metadata);
a prefill goes on to the ``"paged"`` mask builder (``attention.paged_mask``), which learns here which cache the mask is
for (``take_mask_cache``) and so sees a mask that adds a non-causal part (Gemma 3's image tokens, a prefix-LM's
prefix): transformers' ``or_mask_function`` / ``block_sequence_ids``, which only reach the builder.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar

import torch
from transformers import masking_utils

TRANSFORMERS_VERSIONS = ("5.20", "6")

_originals: dict[str, object] = {}
# The handshake of one mask builder call: the PagedCache whose "paged" prefill the builder that called the hook is
# sizing, read once by the "paged" mask function that the same builder calls next (None: no such cache).
_mask_cache: ContextVar[object | None] = ContextVar("paged_hf_mask_cache", default=None)


def _preprocess_mask_arguments(config, inputs_embeds, attention_mask, cache, position_ids, layer_idx, *args, **kwargs):
    from ..cache import PagedCache  # noqa: PLC0415 - patches sit below the cache in the import order

    building = None
    if isinstance(cache, PagedCache) and kwargs.get("encoder_hidden_states") is None:
        # Without a 2D mask (none, or the caller's own 3D/4D one) every column is a real token, as DynamicCache
        # stores and attends them all: positions that restart (packed sequences) say nothing of padding here.
        custom = attention_mask is not None and attention_mask.dim() != 2
        mask_2d = None if attention_mask is None or custom else attention_mask
        cache.observe_forward(inputs_embeds.shape[0], inputs_embeds.shape[1], mask_2d,
                              None if mask_2d is None else position_ids, inputs_embeds.device,
                              attention=_attention_of(config))
        if custom:  # transformers hands the caller's mask to the attention as it is: the exact dense attention
            cache.answer_densely()
        elif config._attn_implementation == "paged":
            # a decode step (an overlay cannot reach a later key), or a compiled forward: no mask
            if inputs_embeds.shape[1] == 1 or torch.compiler.is_compiling():
                return True, None, None, None, None, None, None
            building = cache
    if not torch.compiler.is_compiling():  # a compiled forward (the engine's) keeps no handshake
        _mask_cache.set(building)
    return _originals["_preprocess_mask_arguments"](
        config, inputs_embeds, attention_mask, cache, position_ids, layer_idx, *args, **kwargs
    )


def take_mask_cache():
    """The ``PagedCache`` whose paged prefill the mask builder running now sizes, or None (always in a compiled
    forward); reading it clears it."""
    if torch.compiler.is_compiling():
        return None
    cache = _mask_cache.get()
    _mask_cache.set(None)
    return cache


def _attention_of(config) -> str | None:
    """The attention implementation the model runs with (a name), as its mask builders' config says."""
    attention = getattr(config, "_attn_implementation", None)
    return attention if isinstance(attention, str) else None


def apply() -> None:
    if _originals:
        return
    original = masking_utils._preprocess_mask_arguments
    _originals["_preprocess_mask_arguments"] = original
    masking_utils._preprocess_mask_arguments = functools.wraps(original)(_preprocess_mask_arguments)


def undo() -> None:
    for name, original in _originals.items():
        setattr(masking_utils, name, original)
    _originals.clear()
    _mask_cache.set(None)
