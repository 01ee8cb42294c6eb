"""Quantized KV storage: the pools of one layer in a quantized ``kv_cache_dtype``, laid out as its ``KVFormat``
says (``kernels/kv_format.py``): codes, side data (float16 scales per token; for int4, per block: key range codes on
a float16 grid, value scale codes on a float16 maximum), and, for int4, a full-precision tail.

Values (and, but for int4, keys) are rotated by ``rotation.kv_rotation(head_dim)`` before they are quantized
(outliers spread over all channels); the attention rotates its query by the key rotation and un-rotates its output
by the value rotation instead of un-rotating each stored vector.

int4 keeps each sequence's newest, not yet full block in a *tail row* of two small pools in the compute dtype
(``[rows, block_size, num_kv_heads, head_dim]``, one row per sequence row of the ``KVManager``), and quantizes the
block when it fills (keys per channel over the block, values per token with a scale code per token on the
block's maximum: ``kernels/fill_blocks.py``; int4 therefore needs an even ``block_size``). A block's
codes then depend only on its tokens, and only full blocks hold codes, so prefix hits (which share full blocks
only) stay exact. The tail rows grow with the manager's sequence rows (``ensure_tail_rows``).

``kv_cache_dtype`` names: ``"auto"`` (the model dtype, plain ``KVStorage``), ``"int8"``, ``"fp8"`` (alias of
``"fp8_e4m3"``), ``"fp8_e5m2"``, ``"int4"``. Tokens are quantized when written and dequantized when read, so a
``QuantizedKVStorage`` is a drop-in ``KVStorage``: reads return the compute dtype.
"""

from __future__ import annotations

import torch

from .kernels import dispatch
from .kernels.kv_format import KV_FORMATS, KVFormat, kv_format
from .kernels.kv_quant import (
    dequantize_block_values_ref, dequantize_channels_ref, dequantize_kv_ref, unpack_int4, value_scales_ref,
)
from .kernels.pool_tensors import PoolTensors
from .pool_memory import pool_zeros
from .rotation import kv_rotation, rotate, unrotate
from .storage import FreshKV, KVStorage

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int4")
_ALIASES = {"fp8": "fp8_e4m3"}
assert {_ALIASES.get(name, name) for name in KV_CACHE_DTYPES} == set(KV_FORMATS)


def canonical_kv_format(name: str) -> str:
    """The canonical format of a ``kv_cache_dtype`` name (``"fp8"`` -> ``"fp8_e4m3"``)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got kv_cache_dtype={name!r}")
    return _ALIASES.get(name, name)


def check_kv_format(kv_format_name: str, head_dim: int) -> str:
    """Validates ``kv_format_name`` for a model with ``head_dim``; returns the canonical format.

    Raises ValueError for an unknown name, int4 with an odd ``head_dim`` (two codes per byte) and fp8 on a torch
    without float8 dtypes.
    """
    fmt = kv_format(canonical_kv_format(kv_format_name))
    if fmt.quantized:
        try:
            fmt.code_dtype()
            fmt.code_dim(head_dim)
        except ValueError as error:
            raise ValueError(str(error).replace("kv_format=", "kv_cache_dtype=")) from None
    return fmt.name


class QuantizedKVStorage(KVStorage):
    """K and V pools of one layer in a quantized ``kv_format``, with ``KVStorage``'s methods.

    Shapes: ``key_cache``/``value_cache`` ``[num_blocks, block_size, num_kv_heads, Dp]`` codes (``Dp = head_dim``,
    or ``head_dim // 2`` uint8 for int4); side data as ``KVFormat.side_shapes`` (shapes and dtypes); for int4
    ``key_tail``/``value_tail`` ``[rows, block_size, num_kv_heads, head_dim]`` in the compute dtype. ``dtype`` is the
    compute dtype that reads return. Codes hold ``x @ rotation`` where the format rotates (``[head_dim, head_dim]``
    float32, orthonormal); reads un-rotate. Invariant: a slot's (int4: a block's) bytes depend only on the K/V last written
    to it. Pools start zeroed, and zero bytes read as exact 0.
    """

    _POOL_NAMES = ("key_cache", "value_cache", "key_scale", "value_scale", "key_zero", "value_zero")

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device, kv_format: str, shared_values: bool = False) -> None:
        fmt = KV_FORMATS[check_kv_format(kv_format, head_dim)]
        if not fmt.quantized:
            raise ValueError(f"QuantizedKVStorage needs a quantized kv_cache_dtype, got kv_cache_dtype={kv_format!r}")
        if shared_values:
            fmt.check_shared_values()
        self.shared_values = shared_values
        # Not calling KVStorage.__init__: it would allocate full-precision pools.
        self.format: KVFormat = fmt
        self.kv_format = fmt.name
        self.head_dim = head_dim
        self._dtype = dtype
        data_shape = (num_blocks, block_size, num_kv_heads, fmt.code_dim(head_dim))
        side = fmt.side_shapes(num_blocks, block_size, num_kv_heads, head_dim)  # ValueError: int4, odd block_size
        side["key_cache"] = side["value_cache"] = (data_shape, fmt.code_dtype())
        for name in self._POOL_NAMES:
            shape, pool_dtype = side.get(name, (None, None))
            if shared_values and name.startswith("value_"):
                setattr(self, name, getattr(self, "key_" + name.removeprefix("value_")))
            else:
                setattr(self, name, None if shape is None else pool_zeros(shape, pool_dtype, device))
        self.has_tail = fmt.tail
        tail_shape = (0, block_size, num_kv_heads, head_dim)
        self.key_tail = torch.zeros(tail_shape, dtype=dtype, device=device) if fmt.tail else None
        self.value_tail = torch.zeros(tail_shape, dtype=dtype, device=device) if fmt.tail else None
        rotation = kv_rotation(head_dim, device)
        self.key_rotation = rotation if fmt.rotate_keys else None
        self.value_rotation = rotation if fmt.rotate_values else None
        self.kernels = dispatch.select(self.key_cache.device)

    @property
    def head_shape(self) -> tuple[int, int]:
        return self.key_cache.shape[2], self.head_dim

    def _pools(self) -> list[str]:
        """Names of the block-indexed pool tensors this format holds (codes, scales, zeros; the keys' alone where the
        values share them)."""
        return [name for name in self._POOL_NAMES if getattr(self, name) is not None
                and not (self.shared_values and name.startswith("value_"))]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: what reads return and writes accept (not the dtype of the stored codes)."""
        return self._dtype

    @property
    def store_dtype(self) -> torch.dtype:
        """What ``write`` hands the store: the tails' dtype for a tail format (``FreshKV``), else float32 (the
        rotated vectors)."""
        return self._dtype if self.has_tail else torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes of the block pools (codes, scales, zeros); the tail pools are ``tail_nbytes``."""
        return sum(getattr(self, name).nbytes for name in self._pools())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._pools()}

    def tail_tensors(self) -> dict[str, torch.Tensor]:
        return {"key_tail": self.key_tail, "value_tail": self.value_tail} if self.has_tail else {}

    @property
    def num_tail_rows(self) -> int:
        return self.key_tail.shape[0] if self.has_tail else 0

    def ensure_tail_rows(self, num_rows: int) -> None:
        """Grows the tail pools (doubling, zero-filled) to hold at least ``num_rows`` sequence rows."""
        if not self.has_tail or num_rows <= self.num_tail_rows:
            return
        rows = max(num_rows, 2 * self.num_tail_rows, 4)
        for name, tail in self.tail_tensors().items():
            grown = torch.zeros((rows, *tail.shape[1:]), dtype=tail.dtype, device=tail.device)
            grown[: tail.shape[0]] = tail
            setattr(self, name, grown)

    def pool_tensors(self) -> PoolTensors:
        """Codes, scales, zeros, format and tails: the kernels dequantize each block as they read it."""
        return PoolTensors(*(getattr(self, name) for name in self._POOL_NAMES), self.kv_format, self.key_tail,
                           self.value_tail)

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan=None) -> FreshKV | None:
        """Rotates (as the format says) and quantizes ``key``/``value`` ``[n, num_kv_heads, head_dim]`` into ``slots``
        ``[n]`` (int64). A tail format quantizes the blocks that fill as its ``StorePlan`` ``plan`` says
        (``metadata`` builds it) and returns the forward's ``FreshKV``: the attention reads the queries' own blocks
        from it, and ``write_tails`` must follow the attention."""
        if self.has_tail and plan is None:
            raise ValueError(f"kv_cache_dtype={self.kv_format!r} keeps a full-precision tail: write needs the "
                             f"forward's StorePlan")
        key = rotate(key, self.key_rotation).float()
        value = rotate(value, self.value_rotation).float()
        if not self.has_tail:
            self.kernels.store(key, value, slots, self.pool_tensors())
            return None
        fresh = FreshKV(key.to(self.key_tail.dtype), value.to(self.value_tail.dtype))
        self.kernels.store(fresh.key, fresh.value, slots, self.pool_tensors(), plan)
        return fresh

    def write_tails(self, fresh: FreshKV, plan) -> None:
        """Writes the forward's new tokens whose block is not full into their tail rows (after the attention,
        which reads the tail rows as they were before the forward). ``fresh``: what ``write`` returned."""
        self.kernels.store_tails(fresh.key, fresh.value, self.pool_tensors(), plan)

    def _dequantize(self, which: str, index, unrotated: bool = True) -> torch.Tensor:
        """Dequantized K or V (float32; un-rotated unless ``unrotated=False``) of ``index`` (block ids ``[*S]`` or
        ``(block ids, offsets)``)."""
        data = getattr(self, f"{which}_cache")
        scale, zero = getattr(self, f"{which}_scale"), getattr(self, f"{which}_zero")
        raw = data.view(torch.uint8) if data.dtype.is_floating_point and data.element_size() == 1 else data
        codes = raw[index].view(data.dtype)
        side = self.format.key_side if which == "key" else self.format.value_side
        slots = isinstance(index, tuple)  # (block ids, offsets): one token of each block
        blocks = index[0] if slots else index
        if side == "channel":  # int4 keys: the block's channel ranges
            if slots:
                values = dequantize_channels_ref(codes.unsqueeze(-3), scale[blocks], zero[blocks]).squeeze(-3)
            else:
                values = dequantize_channels_ref(codes, scale[blocks], zero[blocks])
        elif side == "token_code":  # int4 values: each token's scale code on its block's maximum
            if slots:
                offsets = index[1]
                byte = scale[blocks, :, offsets // 2]  # [*S, H]
                k = (byte >> (4 * (offsets % 2)).unsqueeze(-1).to(byte.dtype)) & 15
                values = (unpack_int4(codes).float() - 8) * value_scales_ref(k, zero[blocks]).unsqueeze(-1)
            else:
                values = dequantize_block_values_ref(codes, scale[blocks], zero[blocks])
        else:
            values = dequantize_kv_ref(codes, scale[index], None if zero is None else zero[index], self.kv_format)
        return unrotate(values, getattr(self, f"{which}_rotation")) if unrotated else values

    def read_slots(self, slots: torch.Tensor, tail_slots: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """Dequantized K and V of ``slots`` (any shape ``S``): ``[*S, num_kv_heads, head_dim]``; where
        ``tail_slots >= 0`` the token is read from the tail pools (un-rotated)."""
        index = (slots // self.block_size, slots % self.block_size)
        out = []
        for which in ("key", "value"):
            values = self._dequantize(which, index)
            if self.has_tail and tail_slots is not None:
                tail = getattr(self, f"{which}_tail")
                rows = tail.view(-1, *tail.shape[2:])[tail_slots.clamp_min(0)].float()
                values = torch.where((tail_slots >= 0)[..., None, None],
                                     unrotate(rows, getattr(self, f"{which}_rotation")), values)
            out.append(values.to(self._dtype))
        return out[0], out[1]

    def copy_tails(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """Copies tail rows ``src_rows[i] -> dst_rows[i]`` (forks); destinations distinct, none a source."""
        if self.has_tail:
            self.kernels.copy(src_rows, dst_rows, list(self.tail_tensors().values()))

    def block_to_tail(self, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Dequantizes blocks ``block_ids`` into tail rows ``rows`` (still rotated as stored): the rollback of a
        sequence into a block that was full (``KVManager.truncate``)."""
        if not self.has_tail:
            return
        for which in ("key", "value"):
            values = self._dequantize(which, block_ids, unrotated=False)
            tail = getattr(self, f"{which}_tail")
            tail.index_copy_(0, rows.to(tail.device), values.to(tail.dtype))


def make_storage(
    kv_format: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
    shared_values: bool = False,
) -> KVStorage:
    """The storage of one layer: plain ``KVStorage`` for ``"auto"``, else ``QuantizedKVStorage``; ``shared_values``:
    its value pools are its key pools (``KVStorage``)."""
    fmt = check_kv_format(kv_format, head_dim)
    if fmt == "auto":
        return KVStorage(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, shared_values)
    return QuantizedKVStorage(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, fmt, shared_values)


def layer_block_bytes(kv_format: str, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      shared_values: bool = False) -> int:
    """Bytes of one block of one layer (K and V, scales and zeros included; the keys' alone for ``shared_values``)
    in ``kv_format``; every layer's is ``kv.model_config.block_id_bytes``."""
    return KV_FORMATS[check_kv_format(kv_format, head_dim)].bytes_per_block(block_size, num_kv_heads, head_dim, dtype,
                                                                              shared_values)


def tail_bytes_per_row(kv_format: str, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one sequence row of one layer's tail pools (0 for formats without a tail)."""
    fmt = KV_FORMATS[check_kv_format(kv_format, head_dim)]
    return fmt.tail_bytes_per_row(block_size, num_kv_heads, head_dim, dtype)
