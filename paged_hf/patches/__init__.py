"""Patches of transformers, one module per range of versions: ``apply`` applies every module made for the installed
version (each names its range in ``TRANSFORMERS_VERSIONS``); ``undo`` reverts them all."""

from __future__ import annotations

import transformers
from packaging.version import Version

from . import generate_v5, masks_v5

_PATCHES = [generate_v5, masks_v5]


def _selected() -> list:
    installed = Version(transformers.__version__)
    chosen = [m for m in _PATCHES
              if Version(m.TRANSFORMERS_VERSIONS[0]) <= installed < Version(m.TRANSFORMERS_VERSIONS[1])]
    if generate_v5 not in chosen:
        supported = f">={generate_v5.TRANSFORMERS_VERSIONS[0]},<{generate_v5.TRANSFORMERS_VERSIONS[1]}"
        raise ImportError(f"paged_hf supports transformers {supported}; found {transformers.__version__}")
    return chosen


def apply() -> None:
    for module in _selected():
        module.apply()


def undo() -> None:
    for module in _PATCHES:
        module.undo()
