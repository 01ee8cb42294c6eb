"""Zeroed pool tensors, on a CPU backed by 2 MiB pages where Linux offers them.

A decode step reads every running sequence's blocks, which lie anywhere in pools of gigabytes: with 4 KiB pages
nearly every block is a TLB miss and a page walk, and the attention waits on address translation rather than on
memory (twice as slow, measured on a random 2 GiB pool). ``pool_zeros`` asks the kernel for transparent huge pages
over the pool (``madvise(MADV_HUGEPAGE)``, honoured where ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``) before its pages are first touched, then zeroes it. Elsewhere (CUDA, small tensors,
other systems, THP off) it is ``torch.zeros``; the advice changes where the bytes live, never what they are.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger("paged_hf")

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc: list = []  # [libc] once looked up; [None] where madvise is unavailable


def pool_zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; a CPU pool of at least 2 MiB advised onto huge pages."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    pool = torch.empty(shape, dtype=dtype, device=device)
    if pool.nbytes >= 2 * HUGE_PAGE:
        _advise_huge_pages(pool)
    return pool.zero_()


def _advise_huge_pages(pool: torch.Tensor) -> None:
    """``madvise(MADV_HUGEPAGE)`` over the whole 2 MiB pages inside ``pool``'s bytes (none touched yet)."""
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            _libc.append(libc)
        except (OSError, AttributeError):
            _libc.append(None)
    libc = _libc[0]
    if libc is None:
        return
    begin = -(-pool.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (pool.data_ptr() + pool.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > begin and libc.madvise(begin, end - begin, _MADV_HUGEPAGE) != 0:
        logger.debug("paged_hf: madvise(MADV_HUGEPAGE) on a KV pool failed (errno %d); it stays on 4 KiB pages",
                     ctypes.get_errno())
