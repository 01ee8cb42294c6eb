"""``pool_zeros``: the pools' values are ``torch.zeros``'; on a Linux CPU whose transparent huge pages are not off,
a large pool's memory is advised onto them (its mapping carries the ``hg`` flag)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from paged_hf.pool_memory import pool_zeros
from paged_hf.storage import KVStorage

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process holding ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(part, 16) for part in head.split("-"))
            inside = begin <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pool_zeros_equals_torch_zeros(dtype):
    for shape in [(3, 4, 2, 8), (600, 16, 4, 64)]:
        pool = pool_zeros(shape, dtype, "cpu")
        assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
        assert torch.equal(pool, torch.zeros(shape, dtype=dtype))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages here")
def test_a_large_pool_is_advised_onto_huge_pages():
    storage = KVStorage(2048, 16, 4, 64, torch.float32, "cpu")  # 32 MiB a pool
    for pool in (storage.key_cache, storage.value_cache):
        middle = pool.data_ptr() + pool.nbytes // 2
        assert "hg" in vm_flags(middle)
