"""Module-level set-up of the Triton kernel test files: triton's CPU interpreter where there is no CUDA device.

``require_triton_kernels()`` must run before the first kernel launch (``TRITON_INTERPRET`` is read when the kernels
are decorated), so a test module calls it above its kernel imports. It skips the module when triton is absent, or
when there is no CUDA device and the interpreter was disabled from outside.
"""

from __future__ import annotations

import os

import pytest
import torch


def require_triton_kernels() -> bool:
    """Sets up (or skips) the calling test module; returns whether a CUDA device runs the kernels."""
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel launch
    pytest.importorskip("triton", reason="triton is not installed (pip install triton): the Triton kernels are "
                                         "untested")
    if not cuda and os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "on", "yes"):
        pytest.skip("no CUDA device and TRITON_INTERPRET is disabled: the Triton kernels cannot run",
                    allow_module_level=True)
    return cuda
