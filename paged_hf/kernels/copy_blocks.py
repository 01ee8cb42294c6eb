"""Whole-block copies inside the pools of one layer (copy-on-write, defragmentation): ``dst_ids[i] <- src_ids[i]``
for every pool tensor (codes, scales, zeros).

``copy_blocks_ref`` is the torch reference (gather, then scatter: what ``KVStorage.copy_blocks`` does);
``copy_blocks`` the Triton kernel: per tensor, a block is a run of bytes (``tensor[0]`` must be contiguous, the
block stride may be anything), copied as the widest words (8/4/2/1 bytes) that divide the run, the block stride
and the base address, by programs ``(pair, chunk of CHUNK words)``.

Ids: 1-d int tensors of the same length; the destinations must be distinct and none of them a source (the
kernel copies in place, in no particular order). Decorated on first launch (see ``paged_decode_attention``).
"""

from __future__ import annotations

import functools

import torch

from . import _tiles
from ._common import Kernels, Launch

CHUNK = 1024  # words per program


def copy_blocks_ref(src_ids: torch.Tensor, dst_ids: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Torch reference: ``t[dst_ids] = t[src_ids]`` for each ``t`` (float8 through uint8 views)."""
    src, dst = src_ids.long(), dst_ids.long()
    for t in tensors:
        raw = t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t
        raw[dst.to(raw.device)] = raw[src.to(raw.device)]


def copy_blocks(src_ids: torch.Tensor, dst_ids: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Triton block copy; the arguments and effect of ``copy_blocks_ref``."""
    for launch in _copy_launches(src_ids, dst_ids, tensors):
        launch()


def _copy_launches(src_ids, dst_ids, tensors) -> list[Launch]:
    k = _kernels()
    for name, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-d int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if src_ids.shape != dst_ids.shape:
        raise ValueError(f"src_ids {tuple(src_ids.shape)} and dst_ids {tuple(dst_ids.shape)} differ")
    launches = []
    num_pairs = src_ids.shape[0]
    for i, t in enumerate(tensors):
        if t.dim() < 1 or t.shape[0] == 0:
            raise ValueError(f"tensors[{i}] must have blocks along dim 0, got {tuple(t.shape)}")
        if not t[0].is_contiguous():
            raise ValueError(f"tensors[{i}]: a block must be contiguous, got strides {t.stride()}")
        if num_pairs == 0:
            continue
        words = _words(t)
        src, dst = (ids.to(device=t.device, dtype=torch.int64).contiguous() for ids in (src_ids, dst_ids))
        per_block = words.shape[1]
        grid = (num_pairs, -(-per_block // CHUNK))
        args = (words, src, dst, per_block, words.stride(0))
        launches.append(Launch(k.copy, grid, args, dict(CHUNK=CHUNK), dict(num_warps=4, enable_fp_fusion=True)))
    return launches


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[num_blocks, words per block]`` of the widest integer words that tile its blocks."""
    flat = t.as_strided((t.shape[0], t[0].numel()), (t.stride(0), 1))
    raw = flat.view(torch.uint8)  # [num_blocks, block bytes]
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=dtype).element_size()
        if raw.shape[1] % size == 0 and raw.stride(0) % size == 0 and raw.data_ptr() % size == 0:
            return raw.view(dtype)
    return raw


# ----------------------------------------------------------------------------------------------- kernels

tl = None  # triton.language, bound by _kernels()


@functools.cache
def _kernels():
    """Decorates the copy kernel on first launch."""
    global tl, _copy_kernel
    import triton

    tl = _tiles.bind().tl
    _copy_kernel = triton.jit(_copy_kernel)
    return Kernels(copy=_copy_kernel)


def _copy_kernel(Words, SrcIds, DstIds, per_block, stride_block, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    w = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    ok = w < per_block
    src = tl.load(SrcIds + pair)
    dst = tl.load(DstIds + pair)
    x = tl.load(Words + (src * stride_block + w), mask=ok)
    tl.store(Words + (dst * stride_block + w), x, mask=ok)
