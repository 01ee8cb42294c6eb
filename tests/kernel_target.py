"""What the CPU kernel library may use here: the CPU's feature flags, and the compiler's feature macros for the
library's target (``-march=native``, or ``$PAGED_HF_CPU_ARCH``: ``cpu_ext``), which the kernels' ``#if`` branches
read. A branch runs where both have the feature (the target never has more than the CPU it runs on)."""

from __future__ import annotations

import functools
from pathlib import Path

from paged_hf.kernels import cpu_ext


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` line of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def target_defines() -> frozenset[str]:
    """The macros the compiler defines for the library's target, e.g. ``__AVX512F__``, ``__AMX_BF16__``."""
    return cpu_ext.target_macros()
