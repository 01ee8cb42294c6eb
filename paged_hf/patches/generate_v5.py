"""Takes ``cache_implementation="paged"`` back from transformers' continuous batching (5.20 <= version < 6).

transformers' ``generate`` reroutes the *keyword* ``cache_implementation="paged"`` to ``generate_batch`` (which
drops the attention mask and most of generate's features), and silently builds a ``DynamicCache`` when the word
comes through a ``GenerationConfig``. Here the keyword is taken out before that reroute and remembered in a
context variable; the cache is then built where transformers builds its caches,
``_prepare_cache_for_generation``, with the batch and length it knows, and generate runs its normal loop.

While ``default_paged`` is on, a call that does not choose its own cache is treated as if it had said
``cache_implementation="paged"``, except that a model the paged cache cannot hold (``NotImplementedError``:
encoder-decoder, state-space, ...) keeps transformers' default cache, with a warning.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from contextvars import ContextVar

from transformers.generation.utils import GenerationMixin
from transformers.utils import deprecation

from ..metadata import table_width
from . import default_paged

TRANSFORMERS_VERSIONS = ("5.20", "6")

# Set by ``generate`` for one call: the ``cache_config`` given with ``cache_implementation="paged"``, and
# ``by_default`` when the call named no cache and ``default_paged`` chose the paged one.
_paged_request: ContextVar[dict | None] = ContextVar("paged_hf_request", default=None)
_originals: dict[str, object] = {}  # what the replacements call
_restores: list = []  # undo's steps, in the order apply took them
# The code of every function ``deprecate_kwarg`` returns (one nested function: every decoration shares its code)
_KWARG_DEPRECATION_CODE = deprecation.deprecate_kwarg("unused", "6.0.0")(lambda unused=None: None).__code__


def _generate(self, *args, **kwargs):
    if kwargs.get("cache_implementation") == "paged":
        kwargs.pop("cache_implementation")
        request = {"cache_config": kwargs.pop("cache_config", None), "by_default": False}
    elif default_paged.applies(self, args, kwargs):
        request = {"cache_config": default_paged.cache_config(), "by_default": True}
    else:
        return _originals["generate"](self, *args, **kwargs)
    token = _paged_request.set(request)
    try:
        return _originals["generate"](self, *args, **kwargs)
    finally:
        _paged_request.reset(token)


def _prepare_cache_for_generation(
    self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
):
    request = _paged_request.get()
    if request is None and generation_config.cache_implementation != "paged":
        _compile_on_any_device(generation_config, model_kwargs.get("cache"))
        return _originals["_prepare_cache_for_generation"](
            self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
        )
    _paged_request.set(None)  # consumed: an assistant model's own generate keeps its default cache
    if model_kwargs.get("cache") is not None:
        raise ValueError(
            "Passing both cache_implementation='paged' and a cache object is unsupported; pass one of the two"
        )
    if generation_config.use_cache is False:
        return None
    if request is not None and request["by_default"]:
        return _prepare_default_paged_cache(
            self, request, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
            *args, **kwargs,
        )
    options = _options_of((request or {}).get("cache_config") or generation_config.cache_config
                          or default_paged.cache_config())
    _build_paged_cache(self, options, generation_config, model_kwargs, batch_size, max_cache_length)
    _compile_on_any_device(generation_config, model_kwargs.get("cache"))
    return None


def _compile_on_any_device(generation_config, cache) -> None:
    """An explicit ``compile_config`` with a compileable ``PagedCache`` compiles on every device, the CPU included:
    transformers skips compiling off CUDA/XPU unless the private ``_compile_all_devices`` is set, which would
    ignore the call's parameter silently. (``generation_config`` is generate's own copy; the user's
    ``CompileConfig`` is copied, not changed.)"""
    from ..cache import PagedCache  # noqa: PLC0415

    compile_config = generation_config.compile_config
    if compile_config is None or compile_config._compile_all_devices or not isinstance(cache, PagedCache) \
            or not cache.is_compileable:
        return
    compile_config = copy.copy(compile_config)
    compile_config._compile_all_devices = True
    generation_config.compile_config = compile_config


def _prepare_default_paged_cache(
    self, request, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
):
    """The paged cache for a call that named none, or transformers' own for a model the paged cache cannot hold."""
    supports_cache = getattr(self, "_supports_default_dynamic_cache", lambda: True)()
    if supports_cache:
        try:
            _build_paged_cache(self, _options_of(request["cache_config"]), generation_config, model_kwargs,
                               batch_size, max_cache_length)
            return None
        except NotImplementedError as error:
            warnings.warn(f"paged_hf: generate() of {type(self).__name__} keeps transformers' default cache: {error}",
                          RuntimeWarning, stacklevel=2)
    return _originals["_prepare_cache_for_generation"](
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
    )


def _build_paged_cache(self, options, generation_config, model_kwargs, batch_size, max_cache_length) -> None:
    from ..cache import PagedCache  # noqa: PLC0415 - patches sit below the cache in the import order

    config = _checked_config(options)
    attention_mask = model_kwargs.get("attention_mask")
    presize = None
    if config.num_blocks is None and config.memory_budget is None:
        # the call's need, allocated at once; the pool stays growable: the cache outlives the call (a conversation
        # continued with it), and assisted decoding's drafts may run past max_length before they are checked
        presize = _blocks_for_generate(generation_config, attention_mask, batch_size, max_cache_length,
                                       config.block_size, bucketed=generation_config.compile_config is not None)
    elif config.num_blocks is not None:
        prompt_blocks = _prompt_blocks(generation_config, attention_mask, config.block_size)
        if config.num_blocks < prompt_blocks:
            raise ValueError(
                f"cache_config num_blocks={config.num_blocks} is too small for the batch: its prompts alone need "
                f"{prompt_blocks} blocks of {config.block_size} tokens; the whole call needs about "
                f"{_blocks_for_generate(generation_config, attention_mask, batch_size, max_cache_length, config.block_size)}"
                f" (or leave num_blocks unset and it is sized for you)"
            )
    cache = PagedCache(self.config, max_length=max_cache_length, tp_size=getattr(self, "tp_size", None) or 1,
                       **options)
    if presize is not None:
        cache.kv.presize(presize)
    model_kwargs["cache"] = cache
    if generation_config.is_assistant:
        model_kwargs["cache"].activate_past_recording()


def _options_of(cache_config) -> dict:
    from ..config import CacheConfig  # noqa: PLC0415

    return CacheConfig.options_of(cache_config)


def _checked_config(options: dict):
    from ..config import CacheConfig  # noqa: PLC0415

    return CacheConfig.from_dict(options)  # unknown keys and bad values raise here, before any allocation


def _blocks_for_generate(generation_config, attention_mask, batch_size, max_cache_length, block_size,
                         bucketed: bool = False) -> int:
    """Blocks for the whole call: each row's real prompt tokens plus its new tokens, rounded up to blocks, for
    every beam / returned sequence, plus one block per row for copy-on-write tails under beam search.
    ``bucketed`` (a compiled call): every row gets its block-table width (a power of two of blocks), so calls
    whose lengths share a width bucket share the pool's shape and a compiled step does not recompile."""
    expansion = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    if bucketed:
        per_row = [table_width(math.ceil(max_cache_length / block_size)) * block_size] * batch_size
    elif attention_mask is None:
        per_row = [max_cache_length] * batch_size
    else:
        new_tokens = max(max_cache_length - attention_mask.shape[-1], 0)
        per_row = [int(n) + new_tokens for n in attention_mask.sum(-1).tolist()]
    blocks = sum(math.ceil(n / block_size) for n in per_row) * expansion
    if (generation_config.num_beams or 1) > 1:
        blocks += batch_size * expansion
    return max(blocks, 1)


def _prompt_blocks(generation_config, attention_mask, block_size) -> int:
    """Blocks the prompts alone take (0 when generate dropped an all-ones mask: the cache checks then)."""
    if attention_mask is None:
        return 0
    expansion = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    return sum(math.ceil(int(n) / block_size) for n in attention_mask.sum(-1).tolist()) * expansion


def _deprecation_cell(function):
    """The closure cell holding the function that transformers' innermost keyword-deprecation wrapper of
    ``function`` calls (``generate`` is ``deprecate_kwarg(...)(deprecate_kwarg(...)(no_grad(generate)))``), or None
    where ``function`` is not such a wrapper."""
    cell = None
    while getattr(function, "__code__", None) is _KWARG_DEPRECATION_CODE:
        cell = function.__closure__[function.__code__.co_freevars.index("func")]
        function = cell.cell_contents
    return cell


def apply() -> None:
    """Puts ``_generate`` under transformers' keyword-deprecation wrappers of ``generate`` where it can (their
    ``FutureWarning``s name the caller's frame, ``stacklevel=2``: above them, ours would be named), else over
    ``generate``; and replaces ``_prepare_cache_for_generation``."""
    if _originals:
        return
    cell = _deprecation_cell(GenerationMixin.generate)
    if cell is not None:
        inner = cell.cell_contents
        _originals["generate"] = inner
        _restores.append(lambda: setattr(cell, "cell_contents", inner))
        cell.cell_contents = functools.wraps(inner)(_generate)
    else:
        outer = GenerationMixin.generate
        _originals["generate"] = outer
        _restores.append(lambda: setattr(GenerationMixin, "generate", outer))
        GenerationMixin.generate = functools.wraps(outer)(_generate)
    prepare = GenerationMixin._prepare_cache_for_generation
    _originals["_prepare_cache_for_generation"] = prepare
    _restores.append(lambda: setattr(GenerationMixin, "_prepare_cache_for_generation", prepare))
    GenerationMixin._prepare_cache_for_generation = functools.wraps(prepare)(_prepare_cache_for_generation)


def undo() -> None:
    default_paged.disable()
    while _restores:
        _restores.pop()()
    _originals.clear()
