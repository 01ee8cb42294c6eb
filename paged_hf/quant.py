"""Quantized KV storage: the pools of one layer hold quantized codes plus a float16 scale (and, for int4, a zero
point) per token per KV head; see ``paged_hf.kernels.kv_quant`` for the formats and their error bounds. Every
vector is rotated by ``rotation.kv_rotation(head_dim)`` before it is quantized (outliers spread over all
channels); the attention rotates its query and un-rotates its output instead of un-rotating each key.

``kv_cache_dtype`` names: ``"auto"`` (the model dtype, plain ``KVStorage``), ``"int8"``, ``"fp8"`` (alias of
``"fp8_e4m3"``), ``"fp8_e5m2"``, ``"int4"``. Tokens are quantized when written and dequantized when read, so a
``QuantizedKVStorage`` is a drop-in ``KVStorage``: reads return the compute dtype.
"""

from __future__ import annotations

import torch

from .kernels.kv_quant import (
    QUANTIZED_KV_FORMATS,
    dequantize_kv_ref,
    kv_data_dim,
    kv_data_dtype,
    kv_has_zero,
)
from .kernels import dispatch
from .rotation import kv_rotation, rotate, unrotate
from .storage import KVStorage

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int4")
_ALIASES = {"fp8": "fp8_e4m3"}
_SCALE_DTYPE = torch.float16


def canonical_kv_format(name: str) -> str:
    """The canonical format of a ``kv_cache_dtype`` name (``"fp8"`` -> ``"fp8_e4m3"``)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got kv_cache_dtype={name!r}")
    return _ALIASES.get(name, name)


def check_kv_format(kv_format: str, head_dim: int) -> str:
    """Validates ``kv_format`` for a model with ``head_dim``; returns the canonical format.

    Raises ValueError for an unknown name, int4 with an odd ``head_dim`` (two codes per byte) and fp8 on a torch
    without float8 dtypes.
    """
    fmt = canonical_kv_format(kv_format)
    if fmt == "int4" and head_dim % 2:
        raise ValueError(f"kv_cache_dtype='int4' packs two values per byte: head_dim must be even, got {head_dim=}")
    if fmt.startswith("fp8"):
        try:
            kv_data_dtype(fmt)
        except ValueError:
            raise ValueError(
                f"kv_cache_dtype={kv_format!r} needs torch float8 dtypes, which torch {torch.__version__} lacks"
            ) from None
    return fmt


class QuantizedKVStorage(KVStorage):
    """K and V pools of one layer in a quantized ``kv_format``, with ``KVStorage``'s methods.

    Shapes: ``key_cache``/``value_cache`` ``[num_blocks, block_size, num_kv_heads, Dp]`` codes (``Dp = head_dim``,
    or ``head_dim // 2`` uint8 for int4); ``key_scale``/``value_scale`` ``[num_blocks, block_size, num_kv_heads]``
    float16; ``key_zero``/``value_zero`` the same for int4, else None. ``dtype`` is the compute dtype that reads
    return. The codes hold ``x @ rotation`` (``[head_dim, head_dim]`` float32, orthonormal); reads un-rotate.
    Invariant: a slot's bytes depend only on the K/V last written to it. Pools start zeroed, and zero bytes read
    as exact 0.
    """

    _POOL_NAMES = ("key_cache", "value_cache", "key_scale", "value_scale", "key_zero", "value_zero")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        kv_format: str,
    ) -> None:
        fmt = check_kv_format(kv_format, head_dim)
        if fmt not in QUANTIZED_KV_FORMATS:
            raise ValueError(f"QuantizedKVStorage needs a quantized kv_cache_dtype, got kv_cache_dtype={kv_format!r}")
        # Not calling KVStorage.__init__: it would allocate full-precision pools.
        self.kv_format = fmt
        self.head_dim = head_dim
        self._dtype = dtype
        data_shape = (num_blocks, block_size, num_kv_heads, kv_data_dim(fmt, head_dim))
        data_dtype = kv_data_dtype(fmt)
        self.key_cache = torch.zeros(data_shape, dtype=data_dtype, device=device)
        self.value_cache = torch.zeros(data_shape, dtype=data_dtype, device=device)
        self.key_scale = torch.zeros(data_shape[:3], dtype=_SCALE_DTYPE, device=device)
        self.value_scale = torch.zeros(data_shape[:3], dtype=_SCALE_DTYPE, device=device)
        has_zero = kv_has_zero(fmt)
        self.key_zero = torch.zeros(data_shape[:3], dtype=_SCALE_DTYPE, device=device) if has_zero else None
        self.value_zero = torch.zeros(data_shape[:3], dtype=_SCALE_DTYPE, device=device) if has_zero else None
        self.rotation = kv_rotation(head_dim, device)
        self.kernels = dispatch.select(self.key_cache.device)

    def _pools(self) -> list[str]:
        """Names of the pool tensors this format holds (data, scales, zeros)."""
        return [name for name in self._POOL_NAMES if getattr(self, name) is not None]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: what reads return and writes accept (not the dtype of the stored codes)."""
        return self._dtype

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self._pools())

    @staticmethod
    def bytes_per_block(  # type: ignore[override]
        block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_format: str
    ) -> int:
        """Bytes of one block, K and V with their scales (and zeros); independent of the compute ``dtype``."""
        fmt = check_kv_format(kv_format, head_dim)
        code_bytes = kv_data_dim(fmt, head_dim) * torch.empty((), dtype=kv_data_dtype(fmt)).element_size()
        side_bytes = (2 if kv_has_zero(fmt) else 1) * torch.empty((), dtype=_SCALE_DTYPE).element_size()
        return 2 * block_size * num_kv_heads * (code_bytes + side_bytes)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._pools()}

    def attention_operands(self) -> dict:
        """Codes, scales, zeros and format: the kernels dequantize each block as they read it."""
        return {
            "key_cache": self.key_cache, "value_cache": self.value_cache,
            "key_scale": self.key_scale, "value_scale": self.value_scale,
            "key_zero": self.key_zero, "value_zero": self.value_zero, "kv_format": self.kv_format,
        }

    def _side(self, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Codes, scale and zero (or None) pools of ``which`` ("key" or "value")."""
        return getattr(self, f"{which}_cache"), getattr(self, f"{which}_scale"), getattr(self, f"{which}_zero")

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Rotates and quantizes ``key``/``value`` ``[n, num_kv_heads, head_dim]`` into ``slots`` ``[n]`` (int64)."""
        self.kernels.store(rotate(key, self.rotation), rotate(value, self.rotation), slots, **self.attention_operands())

    def _dequantize(self, which: str, index) -> torch.Tensor:
        data, scale, zero = (None if pool is None else pool[index] for pool in self._side(which))
        rotated = dequantize_kv_ref(data, scale, zero, self.kv_format, torch.float32)
        return unrotate(rotated, self.rotation).to(self._dtype)

    def read_blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of ``block_ids`` (any shape ``S``): ``[*S, block_size, num_kv_heads, head_dim]``."""
        return self._dequantize("key", block_ids), self._dequantize("value", block_ids)

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of ``slots`` (any shape ``S``): ``[*S, num_kv_heads, head_dim]``."""
        block_ids, offsets = slots // self.block_size, slots % self.block_size
        index = (block_ids, offsets)
        return self._dequantize("key", index), self._dequantize("value", index)


def make_storage(
    kv_format: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
) -> KVStorage:
    """The storage of one layer: plain ``KVStorage`` for ``"auto"``, else ``QuantizedKVStorage``."""
    fmt = check_kv_format(kv_format, head_dim)
    if fmt == "auto":
        return KVStorage(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    return QuantizedKVStorage(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, fmt)


def bytes_per_block(kv_format: str, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block of one layer (K and V, scales and zeros included) in ``kv_format``."""
    fmt = check_kv_format(kv_format, head_dim)
    if fmt == "auto":
        return KVStorage.bytes_per_block(block_size, num_kv_heads, head_dim, dtype)
    return QuantizedKVStorage.bytes_per_block(block_size, num_kv_heads, head_dim, dtype, fmt)
