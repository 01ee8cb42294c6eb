"""Pool tensors of one attention layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V.

A slot is ``block_id * block_size + offset``. Storage knows nothing of sequences: the block tables say which
slots a sequence owns. Quantized formats subclass ``KVStorage`` and keep the same methods.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels import dispatch
from .kernels.pool_tensors import PoolTensors
from .pool_memory import pool_zeros


class FreshKV(NamedTuple):
    """A forward's new K and V as a tail format holds them in full precision: ``[n, num_kv_heads, head_dim]`` each,
    rotated as the storage stores them, in the tail pools' dtype, packed by sequence like the forward's new tokens.
    The store returns them; the attention reads each query's own block from them (and the tail row), and the tail
    writes take them after the attention (``QuantizedKVStorage.write_tails``)."""

    key: torch.Tensor
    value: torch.Tensor


class KVStorage:
    """K and V pools of one layer in the compute dtype (``kv_cache_dtype="auto"``).

    Invariant: ``key_cache.shape == value_cache.shape == [num_blocks, block_size, num_kv_heads, head_dim]``.
    Pools start zeroed, so a slot never holds NaN (a masked slot read by a dense kernel contributes exactly 0).
    ``shared_values``: the value pools *are* the key pools (a multi-head latent attention layer's one row a token
    serves as both, ``kv.model_config.latent_dims``): writes store the same row as both, and ``tensors`` lists the
    keys' alone, so copies, swaps and growth move each byte once.
    """

    # Orthonormal ``[head_dim, head_dim]`` the stored keys / values are rotated by (see ``rotation``), or None:
    # the attention rotates its query by ``key_rotation`` and un-rotates its output by ``value_rotation``.
    key_rotation: torch.Tensor | None = None
    value_rotation: torch.Tensor | None = None
    # Whether the newest, partial block of each sequence lives in a tail row (``QuantizedKVStorage``, int4).
    has_tail = False

    def __init__(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
        shared_values: bool = False,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.shared_values = shared_values
        self.key_cache = pool_zeros(shape, dtype, device)
        self.value_cache = self.key_cache if shared_values else pool_zeros(shape, dtype, device)
        self.kernels = dispatch.select(self.key_cache.device)

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    @property
    def head_shape(self) -> tuple[int, int]:
        """``(kv_heads, head_dim)`` of the keys and values this storage holds."""
        return self.key_cache.shape[2], self.key_cache.shape[3]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.key_cache.dtype

    @property
    def device(self) -> torch.device:
        return self.key_cache.device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this layer, K and V together."""
        return self.nbytes // (self.num_blocks * self.block_size)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every pool tensor, indexed by block along dim 0 (what a block copy must move)."""
        if self.shared_values:
            return {"key_cache": self.key_cache}
        return {"key_cache": self.key_cache, "value_cache": self.value_cache}

    def pool_tensors(self) -> PoolTensors:
        """The pools as every kernel launcher, oracle and the CPU attention take them."""
        return PoolTensors(self.key_cache, self.value_cache)

    @property
    def store_dtype(self) -> torch.dtype:
        """The dtype of the K/V ``write`` hands the store kernel (what a kernel warm-up compiles for)."""
        return self.dtype

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan=None) -> FreshKV | None:
        """Stores ``key``/``value`` ``[n, num_kv_heads, head_dim]`` into ``slots`` ``[n]`` (int64), quantizing for
        quantized formats (the ``store_kv`` kernel on CUDA, its torch reference elsewhere). ``plan``: the
        ``StorePlan`` of a format with a tail (ignored here). Returns the ``FreshKV`` a tail format's attention and
        ``write_tails`` need; None here."""
        self.kernels.store(key, value, slots, self.pool_tensors())
        return None

    def read_slots(self, slots: torch.Tensor, tail_slots: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """K and V of ``slots`` (any shape ``S``) as ``[*S, num_kv_heads, head_dim]``. ``tail_slots`` (formats with
        a tail): where a slot's token lives in the tail pools instead (``row * block_size + offset``), -1 where
        not."""
        flat_k = self.key_cache.view(-1, *self.key_cache.shape[2:])
        flat_v = self.value_cache.view(-1, *self.value_cache.shape[2:])
        return flat_k[slots], flat_v[slots]

    def tail_tensors(self) -> dict[str, torch.Tensor]:
        """The tail pools, indexed by sequence row along dim 0 (none without a tail)."""
        return {}

    @property
    def tail_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tail_tensors().values())

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies whole blocks ``src[i] -> dst[i]`` of every pool tensor (copy-on-write); the destinations are
        distinct and none is a source."""
        self.kernels.copy(src, dst, list(self.tensors().values()))

    def grow(self, num_new_blocks: int) -> None:
        """Appends ``num_new_blocks`` zeroed blocks (ids ``num_blocks ..``), keeping the existing content.

        One pool tensor at a time: the old and the grown copy of a single tensor are alive together, never two
        whole pools; on CUDA the old one's memory goes back to the device before the next tensor grows.
        """
        for name in list(self.tensors()):
            pool = getattr(self, name)
            grown = pool_zeros((pool.shape[0] + num_new_blocks, *pool.shape[1:]), pool.dtype, pool.device)
            raw = grown.view(torch.uint8) if _is_float8(pool) else grown
            raw[: pool.shape[0]] = pool.view(torch.uint8) if _is_float8(pool) else pool
            setattr(self, name, grown)
            del pool, raw, grown
            if self.key_cache.device.type == "cuda":
                torch.cuda.empty_cache()
        if self.shared_values:  # the value pools are the grown key pools again
            for part in ("cache", "scale", "zero"):
                if hasattr(self, "key_" + part):
                    setattr(self, "value_" + part, getattr(self, "key_" + part))


def _is_float8(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point and t.element_size() == 1


def copy_blocks_between(src: KVStorage, dst: KVStorage, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                        tails: bool = False) -> None:
    """Copies blocks ``src_ids`` of ``src`` into ``dst_ids`` of ``dst`` (same format; devices may differ: swap);
    ``tails``: rows of the tail pools instead."""
    targets = dst.tail_tensors() if tails else dst.tensors()
    for name, source in (src.tail_tensors() if tails else src.tensors()).items():
        target = targets[name]
        if _is_float8(source):  # float8: copy its bytes
            source, target = source.view(torch.uint8), target.view(torch.uint8)
        target[dst_ids.to(target.device)] = source[src_ids.to(source.device)].to(target.device)
