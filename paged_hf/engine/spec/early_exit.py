"""A layer-truncated draft model: the first ``num_layers`` decoder layers of a model, then its final norm and its
lm_head, all sharing the model's weights (self-speculative early-exit drafting, as in LayerSkip and Draft & Verify).

It is a model of the target's own tokenizer where no smaller one exists, and costs no weight memory: only its
``num_layers`` layers of K/V in the draft's pool. Layer ``i`` of the draft is layer ``i`` of the target (the same
module, so its ``layer_idx`` indexes the draft's pool as well), so the draft must only ever run in the engine's paged
attention, as the target does.
"""

from __future__ import annotations

import copy

import torch


def early_exit_draft(model, num_layers: int):
    """``model`` cut after its first ``num_layers`` decoder layers, as a new model object of its class whose modules
    are ``model``'s (nothing copied): pass it as ``speculative_config['model']`` of method "draft_model".

    ``model``: a causal LM whose decoder (``get_decoder()``) holds its layers in a ``layers`` ModuleList;
    ``num_layers``: in ``[1, L - 1]`` for ``L`` layers. ValueError naming the argument otherwise."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"early_exit_draft: the decoder of {type(model).__name__} keeps no 'layers' ModuleList, "
                         "so it cannot be cut after a layer")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < len(layers):
        raise ValueError(f"early_exit_draft: num_layers must be an int in [1, {len(layers) - 1}] (the model has "
                         f"{len(layers)} layers), got {num_layers!r}")
    config = copy.deepcopy(model.config)
    text_config = config.get_text_config(decoder=True)
    text_config.num_hidden_layers = num_layers
    if getattr(text_config, "layer_types", None) is not None:
        text_config.layer_types = list(text_config.layer_types[:num_layers])
    with torch.device("meta"):  # a skeleton of the right class and config; every module is then the target's
        draft = type(model)._from_config(config, attn_implementation=model.config._attn_implementation)
    path = _module_path(model, decoder)
    ours, theirs = draft, model
    for name in path:  # the modules on the way to the decoder are new; everything beside them is the target's
        _share_children(ours, theirs, skip=name)
        ours, theirs = getattr(ours, name), getattr(theirs, name)
    _share_children(ours, theirs, skip="layers")
    ours.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    meta = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"early_exit_draft: {type(model).__name__} holds tensors outside its modules' children "
                         f"that a cut model cannot share ({meta[:3]})")
    draft.generation_config = model.generation_config
    return draft.eval()


def _module_path(model, module) -> list[str]:
    """The attribute names from ``model`` down to its submodule ``module``."""
    for name, found in model.named_modules():
        if found is module:
            return name.split(".") if name else []
    raise ValueError(f"early_exit_draft: {type(model).__name__}.get_decoder() is not one of its modules")


def _share_children(ours: torch.nn.Module, theirs: torch.nn.Module, skip: str) -> None:
    """Every child module of ``ours`` but ``skip`` replaced by ``theirs``' of that name."""
    for name, _ in list(ours.named_children()):
        if name != skip:
            setattr(ours, name, getattr(theirs, name))
