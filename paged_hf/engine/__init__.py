"""The batching engine: continuous batching, chunked prefill, prefix caching and preemption on stock models."""

from .engine import PagedEngine
from .request import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "PagedEngine", "RequestOutput"]
