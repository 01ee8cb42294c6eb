"""Picks the Triton kernels, the production CPU attention or the torch references for the paged path.

``use_triton(device)``: True on CUDA when triton imports; the environment variable ``PAGED_HF_KERNELS`` forces
a side: ``torch`` (the torch side: on CPU the production attention ``cpu_attention``, elsewhere the references),
``reference`` (the torch references everywhere, attention included: the float32 test oracle ``attention_ref``, for
checking or timing against it) or ``triton`` (always the kernels: on CPU only under ``TRITON_INTERPRET=1``,
triton's interpreter, else a ValueError says why). Unset: Triton on CUDA, else the torch side. ``select(device)``
makes that choice once and returns the ``KernelSet`` a pool's storage keeps: the hot path never reads the
environment.

triton is imported only when a kernel is chosen (and once to see whether it imports), so ``import paged_hf``
works without it. The interpreter is fixed by ``TRITON_INTERPRET`` when the kernels are first launched.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV_VAR = "PAGED_HF_KERNELS"
_CHOICES = ("torch", "reference", "triton")


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works here."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # ImportError, or a broken install raising anything else
        return False
    return True


def _interpreting() -> bool:
    from ._common import triton_interpreting

    return triton_interpreting()


def use_triton(device) -> bool:
    """Whether the paged path on ``device`` runs the Triton kernels (see the module docstring)."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced and forced not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {_CHOICES} (or unset)")
    if forced in ("torch", "reference"):
        return False
    device = torch.device(device)
    if forced == "triton":
        if not triton_available():
            raise ValueError(f"{ENV_VAR}=triton but triton does not import (pip install triton)")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"{ENV_VAR}=triton on {device.type}: triton kernels run on CUDA, or on CPU only under "
                "TRITON_INTERPRET=1 (set before the first kernel launch)"
            )
        return True
    return device.type == "cuda" and triton_available()


@dataclass(frozen=True)
class KernelSet:
    """The paged-path functions one device runs: the Triton kernels or their torch references (same signatures).

    Chosen once per pool (``select``), so no kernel call reads the environment or imports anything.
    """

    decode_attention: Callable
    prefill_attention: Callable
    store: Callable
    store_tails: Callable
    copy: Callable
    triton: bool


def select(device) -> KernelSet:
    """The kernels for ``device`` as ``use_triton`` decides (reads ``PAGED_HF_KERNELS`` now, once); the torch side
    attends with ``cpu_attention`` on CPU unless ``reference`` is forced."""
    from . import copy_blocks, paged_decode_attention, paged_prefill_attention, store_kv  # noqa: PLC0415

    if use_triton(device):
        return KernelSet(paged_decode_attention.paged_decode_attention, paged_prefill_attention.paged_prefill_attention,
                         store_kv.store_kv, store_kv.store_tails, copy_blocks.copy_blocks, triton=True)
    decode = paged_decode_attention.paged_decode_attention_ref
    prefill = paged_prefill_attention.paged_prefill_attention_ref
    if torch.device(device).type == "cpu" and os.environ.get(ENV_VAR, "").strip().lower() != "reference":
        from . import cpu_attention  # noqa: PLC0415

        decode, prefill = cpu_attention.paged_decode_attention_cpu, cpu_attention.paged_prefill_attention_cpu
    return KernelSet(decode, prefill, store_kv.store_kv_ref, store_kv.store_tails_ref, copy_blocks.copy_blocks_ref,
                     triton=False)
