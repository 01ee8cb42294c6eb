"""Kernels of the paged path: each file holds a torch ``*_ref`` (the test oracle) and, where written, a Triton kernel
with a launcher of the same signature; every one takes the layer's pools as one ``pool_tensors.PoolTensors``."""

from .paged_decode_attention import paged_decode_attention_ref
from .paged_prefill_attention import paged_prefill_attention_ref

__all__ = ["paged_decode_attention_ref", "paged_prefill_attention_ref"]
