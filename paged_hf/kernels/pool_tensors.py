"""``PoolTensors``: the pool operands of one layer, as one typed argument of every kernel launcher, ``*_ref`` oracle
and the CPU attention.

The storage returns it (``KVStorage.pool_tensors()``); a launcher checks and unpacks it once (``_common.check_pools``)
into the flat pointers and strides its ``@triton.jit`` kernel takes. Per-forward operands (tail rows, the forward's
new K/V) stay separate arguments: they change every step, the pools do not.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kv_format import KVFormat, kv_format as _kv_format


class PoolTensors(NamedTuple):
    """One layer's pools in ``kv_format``, laid out as its ``KVFormat`` says.

    key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, Dp]``: the compute dtype for "auto", else codes
        (``Dp = head_dim``, or ``head_dim // 2`` uint8 for int4).
    key_scale, value_scale, key_zero, value_zero: the format's side data (``KVFormat.side_shapes``), None where it
        has none.
    kv_format: the canonical format name.
    key_tail, value_tail: a tail format's (int4) ``[rows, block_size, num_kv_heads, head_dim]`` rows in the compute
        dtype, else None.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    key_zero: torch.Tensor | None = None
    value_zero: torch.Tensor | None = None
    kv_format: str = "auto"
    key_tail: torch.Tensor | None = None
    value_tail: torch.Tensor | None = None

    @property
    def format(self) -> KVFormat:
        return _kv_format(self.kv_format)

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2]

    def block_tensors(self) -> list[torch.Tensor]:
        """The block-indexed pools this format holds (codes, scales, zeros): what a block copy moves."""
        return [t for t in self[:6] if t is not None]

    def tail_tensors(self) -> list[torch.Tensor]:
        """The tail pools (row-indexed), empty without a tail."""
        return [t for t in (self.key_tail, self.value_tail) if t is not None]
