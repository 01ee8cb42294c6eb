"""Kernels of the paged path: each file holds a torch ``*_ref`` (the CPU path and the test oracle) and, where
written, a Triton kernel with a launcher of the same signature."""

from .paged_decode_attention import paged_decode_attention_ref
from .paged_prefill_attention import paged_prefill_attention_ref

__all__ = ["paged_decode_attention_ref", "paged_prefill_attention_ref"]
