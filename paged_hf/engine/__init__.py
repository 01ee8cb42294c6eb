"""The batching engine: continuous batching, chunked prefill, prefix caching and preemption on stock models."""

from .engine import PagedEngine
from .request import CompletionOutput, Logprob, RequestOutput, RequestOutputKind

__all__ = ["CompletionOutput", "Logprob", "PagedEngine", "RequestOutput", "RequestOutputKind"]
