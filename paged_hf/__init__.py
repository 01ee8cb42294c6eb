"""paged_hf: a paged, quantizable KV cache for stock Hugging Face transformers models.

``import paged_hf`` registers the ``"paged"`` attention (and its mask) and takes back
``cache_implementation="paged"`` for ``generate``; ``paged_hf.unregister()`` undoes both. Idempotent.
With ``PAGED_HF_DEFAULT_CACHE=paged`` in the environment (``paged-hf run`` sets it), the import also makes the paged
cache the default of every ``generate`` call that chooses no cache (``enable_default_paged``).
"""

from .attention import paged_attention_forward, register_attention, unregister_attention
from .cache import PagedCache, PagedCacheFullError
from .config import CacheConfig, EngineConfig, SamplingParams
from .engine import CompletionOutput, PagedEngine, RequestOutput
from .llm import LLM, RequestsFailed
from .structured import StructuredOutputsParams
from . import patches
from .patches import default_paged as _default_paged

__version__ = "0.1.0"


def register() -> None:
    """Registers ``attn_implementation="paged"`` and ``cache_implementation="paged"`` (idempotent), and turns on
    the default that ``PAGED_HF_DEFAULT_CACHE=paged`` / ``PAGED_HF_CACHE_CONFIG`` ask for, unless one is on."""
    register_attention()
    patches.apply()
    if not _default_paged.is_enabled():
        cache_config = _default_paged.config_from_environment()
        if cache_config is not None:
            _default_paged.enable(cache_config)


def unregister() -> None:
    """Undoes ``register`` (and ``enable_default_paged``): transformers behaves as if paged_hf had never been
    imported."""
    unregister_attention()
    patches.undo()


def enable_default_paged(cache_config: dict | None = None) -> None:
    """Makes ``cache_implementation="paged"`` with ``cache_config`` the default of every ``generate`` call that does
    not choose its own cache (a cache object, a ``cache_implementation`` in its arguments, its
    ``generation_config`` or the model's, or ``use_cache=False``). ``cache_config`` is also used by paged caches
    asked for without one. Bad keys or values raise ``ValueError`` naming them, before anything changes.
    A model the paged cache cannot hold (encoder-decoder, state-space) keeps transformers' cache, with a warning.
    Undone by ``disable_default_paged()`` or ``unregister()``."""
    _default_paged.enable(cache_config)
    register()


def disable_default_paged() -> None:
    """Turns ``enable_default_paged`` off: ``generate`` calls that choose no cache get transformers' default."""
    _default_paged.disable()


register()

__all__ = [
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "LLM",
    "PagedEngine",
    "RequestOutput",
    "RequestsFailed",
    "SamplingParams",
    "StructuredOutputsParams",
    "disable_default_paged",
    "enable_default_paged",
    "PagedCache",
    "PagedCacheFullError",
    "paged_attention_forward",
    "register",
    "unregister",
]
