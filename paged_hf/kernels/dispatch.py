"""Picks the Triton kernels or their torch references for the paged path.

``use_triton(device)``: True on CUDA when triton imports; the environment variable ``PAGED_HF_KERNELS`` forces
either side: ``torch`` (always the references) or ``triton`` (always the kernels: on CPU only under
``TRITON_INTERPRET=1``, triton's interpreter, else a ValueError says why). ``decode_attention``,
``prefill_attention``, ``store`` and ``copy`` take the arguments of the references and run one or the other.

triton is imported only when a kernel is chosen (and once to see whether it imports), so ``import paged_hf``
works without it. The interpreter is fixed by ``TRITON_INTERPRET`` when the kernels are first launched.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

ENV_VAR = "PAGED_HF_KERNELS"
_CHOICES = ("torch", "triton")


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
    from .paged_decode_attention import triton_interpreting

    return triton_interpreting()


def use_triton(device) -> bool:
    """Whether the paged path on ``device`` runs the Triton kernels (see the module docstring)."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced and forced not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {_CHOICES} (or unset)")
    if forced == "torch":
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


def decode_attention(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``paged_decode_attention`` (Triton) or ``paged_decode_attention_ref`` on ``query.device``."""
    from . import paged_decode_attention as module

    fn = module.paged_decode_attention if use_triton(query.device) else module.paged_decode_attention_ref
    return fn(query, *args, **kwargs)


def prefill_attention(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``paged_prefill_attention`` (Triton) or ``paged_prefill_attention_ref`` on ``query.device``."""
    from . import paged_prefill_attention as module

    fn = module.paged_prefill_attention if use_triton(query.device) else module.paged_prefill_attention_ref
    return fn(query, *args, **kwargs)


def store(key: torch.Tensor, *args, **kwargs) -> None:
    """``store_kv`` (Triton) or ``store_kv_ref``: writes K/V (quantized per ``kv_format``) into their slots."""
    from . import store_kv as module

    fn = module.store_kv if use_triton(key.device) else module.store_kv_ref
    fn(key, *args, **kwargs)


def copy(src_ids: torch.Tensor, dst_ids: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """``copy_blocks`` (Triton) or ``copy_blocks_ref`` on the device of the pools."""
    from . import copy_blocks as module

    if not tensors:
        return
    fn = module.copy_blocks if use_triton(tensors[0].device) else module.copy_blocks_ref
    fn(src_ids, dst_ids, tensors)
