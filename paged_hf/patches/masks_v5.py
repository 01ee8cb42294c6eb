"""Hands the forward's 2D attention mask to a ``PagedCache`` when transformers builds its masks (5.20 <= version < 6).

Every mask builder of ``transformers.masking_utils`` (causal, sliding window, chunked) starts with
``_preprocess_mask_arguments(config, inputs_embeds, attention_mask, cache, position_ids, layer_idx, ...)``, before any
layer of the forward runs; in ``generate`` with a compileable cache it even runs before the forward, eagerly. The
wrapper gives a ``PagedCache`` the batch, query length, 2D mask and positions there, so the cache plans the forward
once from the true mask (right padding, holes, direct calls), and then lets transformers go on. With the
``"paged"`` attention no mask is built at all: the paged attention derives causality from its metadata.
"""

from __future__ import annotations

import functools

from transformers import masking_utils

TRANSFORMERS_VERSIONS = ("5.20", "6")

_originals: dict[str, object] = {}


def _preprocess_mask_arguments(config, inputs_embeds, attention_mask, cache, position_ids, layer_idx, *args, **kwargs):
    from ..cache import PagedCache  # noqa: PLC0415 - patches sit below the cache in the import order

    if isinstance(cache, PagedCache) and kwargs.get("encoder_hidden_states") is None:
        mask_2d = attention_mask if attention_mask is None or attention_mask.dim() == 2 else None
        cache.observe_forward(inputs_embeds.shape[0], inputs_embeds.shape[1], mask_2d, position_ids,
                              inputs_embeds.device, attention=_attention_of(config))
        if config._attn_implementation == "paged":
            return True, None, None, None, None, None, None  # early exit: no mask
    return _originals["_preprocess_mask_arguments"](
        config, inputs_embeds, attention_mask, cache, position_ids, layer_idx, *args, **kwargs
    )


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
