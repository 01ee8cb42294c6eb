"""Patches of transformers, one module per range of versions; ``apply`` picks the one for the installed version."""

from __future__ import annotations

import transformers
from packaging.version import Version

from . import generate_v5

_PATCHES = [generate_v5]


def _select():
    installed = Version(transformers.__version__)
    for module in _PATCHES:
        low, high = (Version(v) for v in module.TRANSFORMERS_VERSIONS)
        if low <= installed < high:
            return module
    supported = ", ".join(f">={m.TRANSFORMERS_VERSIONS[0]},<{m.TRANSFORMERS_VERSIONS[1]}" for m in _PATCHES)
    raise ImportError(f"paged_hf supports transformers {supported}; found {transformers.__version__}")


def apply() -> None:
    _select().apply()


def undo() -> None:
    for module in _PATCHES:
        module.undo()
