"""paged_hf: a paged, quantizable KV cache for stock Hugging Face transformers models.

``import paged_hf`` registers the ``"paged"`` attention (and its mask) and takes back
``cache_implementation="paged"`` for ``generate``; ``paged_hf.unregister()`` undoes both. Idempotent.
"""

from .attention import paged_attention_forward, register_attention, unregister_attention
from .cache import PagedCache, PagedCacheFullError
from .config import CacheConfig, EngineConfig, SamplingParams
from .engine import CompletionOutput, PagedEngine, RequestOutput
from . import patches

__version__ = "0.1.0"


def register() -> None:
    """Registers ``attn_implementation="paged"`` and ``cache_implementation="paged"`` (idempotent)."""
    register_attention()
    patches.apply()


def unregister() -> None:
    """Undoes ``register``: transformers behaves as if paged_hf had never been imported."""
    unregister_attention()
    patches.undo()


register()

__all__ = [
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "PagedEngine",
    "RequestOutput",
    "SamplingParams",
    "PagedCache",
    "PagedCacheFullError",
    "paged_attention_forward",
    "register",
    "unregister",
]
