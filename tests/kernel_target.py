"""What the CPU kernel library may use here: the CPU's feature flags, and the compiler's feature macros for the
library's target (``-march=native``, or ``$PAGED_HF_CPU_ARCH``: ``cpu_ext``), which the kernels' ``#if`` branches
read. A branch runs where both have the feature (the target never has more than the CPU it runs on)."""

from __future__ import annotations

import functools

from paged_hf.kernels import cpu_ext


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the library's build hash reads them (/proc/cpuinfo; empty where it has none)."""
    line = cpu_ext._cpu_flags().decode()
    return frozenset(line.split(":", 1)[1].split()) if line.startswith("flags") else frozenset()


@functools.cache
def target_defines() -> frozenset[str]:
    """The macros the compiler defines for the library's target, e.g. ``__AVX512F__``, ``__AMX_BF16__``."""
    return cpu_ext.target_macros()
