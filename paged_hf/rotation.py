"""The fixed orthonormal rotation applied to K and V before they are quantized (QuaRot-style incoherence).

A few channels of post-RoPE keys carry most of a vector's magnitude; with one scale per vector they squeeze the
other channels into a handful of levels. Rotating every ``[head_dim]`` vector by ``R = diag(signs) @ H`` (``H`` a
normalized Hadamard matrix, the signs a fixed pseudo-random draw) spreads each outlier over all channels, so the
same per-token scale quantizes much finer. Nothing is un-rotated per key: attention scores are invariant,
``(q R) . (k R) = q . k``, so the attention rotates the query once and un-rotates its output once
(``sum_i p_i (v_i R) = (sum_i p_i v_i) R``). Reads of dequantized K/V (the gathered path) multiply by ``R.T``.

``R`` depends only on ``head_dim``, so the same tokens still give the same bytes (prefix hits stay exact).
A ``head_dim`` that is not a power of two uses a block-diagonal ``H`` built from the largest power-of-two block
that divides it.
"""

from __future__ import annotations

import functools

import torch

_SIGN_SEED = 0x5EED


@functools.lru_cache(maxsize=None)
def _rotation_cpu(head_dim: int) -> torch.Tensor:
    block = head_dim & -head_dim  # the largest power of two dividing head_dim
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < block:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    hadamard = torch.block_diag(*[hadamard / block**0.5] * (head_dim // block))
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(_SIGN_SEED)) * 2 - 1
    return signs.float().unsqueeze(1) * hadamard


def kv_rotation(head_dim: int, device=None) -> torch.Tensor:
    """``R``: ``[head_dim, head_dim]`` float32, orthonormal (``R @ R.T == I``); a vector ``x`` is stored as ``x @ R``."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim=}")
    return _rotation_cpu(head_dim).to(device)


def rotate(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``x @ rotation`` over the last dimension, in float32 (``x`` unchanged when ``rotation`` is None)."""
    return x if rotation is None else x.float() @ rotation


def unrotate(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``x @ rotation.T`` (the inverse of ``rotate``), in float32; ``x`` unchanged when ``rotation`` is None."""
    return x if rotation is None else x.float() @ rotation.T
