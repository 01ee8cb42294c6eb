"""The engine's forward through the recurrent layers of hybrid models (linear attention, Mamba, short convolutions:
``kv.recurrent``).

The engine lays a step's sequences back to back in one row; attention reads each sequence's own blocks, but a
recurrent layer runs a causal convolution and a scan along its input, which must not cross from one sequence into
the next. So each recurrent layer's module (its *mixer*: the child of the decoder layer that owns a ``Conv1d`` and
reads ``cache``) runs once per step on the continuing decodes as a batch ``[D, 1, hidden]``, and once per other
sequence on its own tokens ``[1, q, hidden]`` (a prompt chunk, or a sequence's first token), each time with a
``StateView`` of its sequences' state rows in place of the cache. A mixer whose several-token form ignores the state
it continues (Jamba's and Zamba's selective scan; ``continues_chunks`` probes each mixer once) runs a chunk that
continues a state a token at a time. Outside the engine (``generate``, any other cache) the mixer runs as it always
did.

Options the states rule out, refused by name before anything is built (``check_options``): prefix caching and
offloading (a cached block holds K/V, not the recurrent state after it), swap preemption, speculative decoding (a
rejected draft would have to roll the state back), tensor parallelism. The forward runs eagerly: a step's pieces
are Python slices, which a compiled graph would fix.
"""

from __future__ import annotations

import copy
import inspect
import logging
import types

import torch

from ..kv.recurrent import RecurrentStates, RecurrentStep, recurrent_layers

logger = logging.getLogger("paged_hf")

_MIXER_MARK = "_paged_hf_mixer_forward"


def find_mixers(model, layers: list[int]) -> dict[int, torch.nn.Module]:
    """``{layer index: mixer}`` for each recurrent layer: the module with that ``layer_idx`` that owns a ``Conv1d``
    and whose forward takes ``cache``. NotImplementedError naming the layer where there is not exactly one."""
    found: dict[int, list[torch.nn.Module]] = {idx: [] for idx in layers}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx in found and any(isinstance(child, torch.nn.Conv1d) for child in module.children()) \
                and "cache" in inspect.signature(getattr(module, _MIXER_MARK, module.forward)).parameters:
            found[idx].append(module)
    for idx, modules in found.items():
        if len(modules) != 1:
            raise NotImplementedError(
                f"PagedEngine runs a recurrent layer through its mixer (the module of the layer that owns its "
                f"convolution and reads the cache); layer {idx} of {type(model).__name__} has {len(modules)} such "
                f"modules ({[type(m).__name__ for m in modules]})")
    return {idx: modules[0] for idx, modules in found.items()}


def wrap_mixers(model) -> int:
    """Makes each recurrent layer's mixer split the engine's packed row by sequence (idempotent); returns how many
    layers are recurrent. Another cache than the engine's reaches the mixer's own forward unchanged."""
    text_config = model.config.get_text_config(decoder=True)
    layers = recurrent_layers(text_config)
    for idx, mixer in find_mixers(model, layers).items():
        if not hasattr(mixer, _MIXER_MARK):
            try:
                stepwise = not continues_chunks(mixer, text_config.hidden_size)
            except NotImplementedError as error:
                raise NotImplementedError(f"PagedEngine cannot serve {type(model).__name__}: layer {idx}: {error}") \
                    from None
            if stepwise:
                logger.info("PagedEngine: layer %d's %s starts a chunk of several tokens from zeros whatever its "
                            "state; a prompt chunk that continues one runs through it a token at a time", idx,
                            type(mixer).__name__)
            # attributes of the module, not a closure: a deep copy of the model (its modules, bound methods and
            # all) then runs its own mixers
            setattr(mixer, _MIXER_MARK, mixer.forward)
            mixer._paged_hf_mixer_signature = inspect.signature(mixer.forward)
            mixer._paged_hf_stepwise_layer = idx if stepwise else None
            mixer.forward = types.MethodType(_engine_forward, mixer)
    return len(layers)


def continues_chunks(mixer: torch.nn.Module, hidden_size: int, tokens: int = 4) -> bool:
    """Whether the mixer, over ``tokens`` tokens that continue a state, gives what it gives over them at the end of
    one longer run (within 1e-3 of its largest output; run on a float32 copy on the mixer's own device, so that a
    bfloat16 model's rounding is not taken for a lost state). transformers' selective scan of Jamba and Zamba takes
    no initial state: their several-token form restarts from zeros (their one-token decode reads the state)."""
    probe = copy.deepcopy(mixer).float()
    device = next(probe.parameters()).device  # the mixer's own (a model split across devices)
    hidden = torch.randn((1, 2 * tokens, hidden_size), generator=torch.Generator().manual_seed(0)).to(device)
    row = torch.zeros(1, dtype=torch.long, device=device)
    whole, split = RecurrentStates([]), RecurrentStates([])
    call = MixerCall.alone(getattr(probe, _MIXER_MARK, probe.forward))  # a copy of an engine's mixer: its own
    with torch.inference_mode():
        expected = call(hidden, whole.view(row, fresh=True))[:, tokens:]
        call(hidden[:, :tokens], split.view(row, fresh=True))
        split.commit()
        got = call(hidden[:, tokens:], split.view(row, fresh=False))
    return bool((got - expected).abs().max() <= 1e-3 * expected.abs().max())


def state_shapes(model) -> dict:
    """``{(kind, layer, state_idx): (shape, dtype)}`` of one sequence's states: each recurrent layer's mixer run
    once on one zero token (its own forward, fresh states), its writes kept by a scratch ``RecurrentStates``."""
    text_config = model.config.get_text_config(decoder=True)
    scratch = RecurrentStates(recurrent_layers(text_config))
    rows = torch.zeros(1, dtype=torch.long, device=model.device)
    hidden = torch.zeros((1, 1, text_config.hidden_size), dtype=model.dtype, device=model.device)
    with torch.inference_mode():
        for mixer in find_mixers(model, scratch.layers).values():
            MixerCall.alone(getattr(mixer, _MIXER_MARK, mixer.forward))(hidden, scratch.view(rows, fresh=True))
    return scratch.staged_shapes()


class MixerCall:
    """A call of a mixer's own forward as the decoder layer made it (its arguments bound to the forward's signature,
    ``cache`` by keyword or by position), again with other hidden states (its first parameter) and another cache,
    and ``attention_mask``, where the layer passed one, None (the engine's rows hold no padding)."""

    def __init__(self, forward, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
        self.forward = forward
        self.signature = signature
        bound = signature.bind(*args, **kwargs)
        self.arguments = dict(bound.arguments)
        self.hidden_name = next(iter(signature.parameters))
        if self.arguments.get("attention_mask") is not None:
            self.arguments["attention_mask"] = None

    @classmethod
    def alone(cls, forward) -> "MixerCall":
        """A call with no argument but the hidden states and the cache (the start probes)."""
        signature = inspect.signature(forward)
        return cls(forward, signature, (None,), {"cache": None})

    @property
    def cache(self):
        return self.arguments.get("cache")

    def __call__(self, hidden_states: torch.Tensor, view) -> torch.Tensor:
        """The mixer's output ``[B, q, hidden]`` over ``hidden_states`` ``[B, q, hidden]``, with ``view`` as its
        cache; the states it wrote are staged (``StateView.finish``)."""
        bound = inspect.BoundArguments(self.signature, {**self.arguments, self.hidden_name: hidden_states,
                                                        "cache": view})
        result = self.forward(*bound.args, **bound.kwargs)
        if not isinstance(result, torch.Tensor) or result.shape != hidden_states.shape:
            raise NotImplementedError(
                f"the engine runs a recurrent layer's mixer on each sequence of a step apart and needs its hidden "
                f"states back ({tuple(hidden_states.shape)}); {type(getattr(self.forward, '__self__', None)).__name__}"
                f" returned {type(result).__name__} "
                f"{tuple(result.shape) if isinstance(result, torch.Tensor) else ''}".rstrip())
        view.finish()
        return result


def _engine_forward(mixer: torch.nn.Module, *args, **kwargs):
    """A wrapped mixer's forward: in the engine's forward (its cache has a ``recurrent_step``) ``run_packed``, else
    the mixer's own forward, as the model runs it."""
    original = getattr(mixer, _MIXER_MARK)
    if "cache" in kwargs and getattr(kwargs["cache"], "recurrent_step", None) is None:
        return original(*args, **kwargs)
    call = MixerCall(original, mixer._paged_hf_mixer_signature, args, kwargs)
    step = getattr(call.cache, "recurrent_step", None)
    if step is None:
        return original(*args, **kwargs)
    states, plan = step
    return run_packed(call, call.arguments[call.hidden_name], states, plan, mixer._paged_hf_stepwise_layer)


def run_packed(call: MixerCall, hidden_states: torch.Tensor, states: RecurrentStates, plan: RecurrentStep,
               stepwise_layer: int | None = None) -> torch.Tensor:
    """The mixer over a packed row ``[1, T, hidden]``: the decodes as one batch, every other sequence alone.
    ``stepwise_layer``: the mixer's layer, whose several-token form ignores the state (``continues_chunks``): a
    chunk that continues a state runs a token at a time, each reading the state the one before left."""
    out = torch.empty_like(hidden_states)
    if plan.decode_rows.numel():
        view = states.view(plan.decode_rows, fresh=False)
        if plan.decodes_are_first:
            batch = hidden_states[0, : plan.decode_rows.numel()].unsqueeze(1)
        else:
            batch = hidden_states[0].index_select(0, plan.decode_tokens).unsqueeze(1)
        result = call(batch, view)  # [D, 1, hidden]
        if plan.decodes_are_first:
            out[0, : plan.decode_rows.numel()] = result[:, 0]
        else:
            out[0].index_copy_(0, plan.decode_tokens, result[:, 0])
    for i, (first, end, fresh) in enumerate(plan.pieces):
        rows = plan.piece_rows[i : i + 1]
        if stepwise_layer is None or fresh or end - first == 1:
            out[:, first:end] = call(hidden_states[:, first:end], states.view(rows, fresh))
            continue
        scratch = states.row_copy(rows, stepwise_layer)
        for token in range(first, end):
            out[:, token : token + 1] = call(hidden_states[:, token : token + 1],
                                             scratch.view(torch.zeros_like(rows), fresh=False))
            scratch.commit()
        states.stage_copy(scratch, rows)
    return out


def check_options(config, text_config, tensor_parallel: bool) -> None:
    """ValueError naming the option that a model with recurrent layers cannot honour (see the module docstring);
    NotImplementedError under tensor parallelism."""
    layers = recurrent_layers(text_config)
    if not layers:
        return
    what = f"{text_config.model_type!r} has recurrent layers ({len(layers)} of {text_config.num_hidden_layers})"
    if tensor_parallel:
        raise NotImplementedError(f"PagedEngine runs models with recurrent layers on one process: {what}")
    if config.preemption_mode == "swap":
        raise ValueError(f"preemption_mode='swap' is not supported: {what}, whose states are not swapped; use "
                         f"'recompute' or 'auto'")
    if config.speculative_config is not None:
        raise ValueError(f"speculative_config is not supported: {what}, whose states cannot roll back a rejected "
                         f"draft")
    if config.kv_offloading_size:
        raise ValueError(f"kv_offloading_size is not supported: {what}; it offloads prefix-cached blocks, and "
                         f"prefix caching is off for such models")
