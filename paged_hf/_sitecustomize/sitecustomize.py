"""Imported by Python at start-up in every process that ``paged-hf run`` starts: its folder leads ``PYTHONPATH``.

It imports nothing heavy. It arranges that when the program imports ``transformers``, ``paged_hf`` (the copy
this file belongs to) is imported right after; ``import paged_hf`` reads ``PAGED_HF_DEFAULT_CACHE=paged`` and
``PAGED_HF_CACHE_CONFIG`` and makes the paged cache the default of ``generate``. A program that never imports
transformers pays nothing. Then it runs the ``sitecustomize`` module that this one shadows, if there is one, and
takes its own folder off ``sys.path``. A process where paged_hf cannot load (a Python of another environment,
which the variables reach too) is told so on stderr and runs as it would without ``paged-hf run``.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(_HERE))  # the folder holding paged_hf/


def _import_paged_hf() -> None:
    if "paged_hf" in sys.modules:  # imported, or importing (it imports transformers): it reads the switch itself
        return
    spec = importlib.machinery.PathFinder.find_spec("paged_hf", [_PACKAGE_PARENT])
    if spec is None:
        raise ImportError(f"paged-hf run: no paged_hf package in {_PACKAGE_PARENT}", name="paged_hf")
    module = importlib.util.module_from_spec(spec)
    sys.modules["paged_hf"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("paged_hf", None)
        raise


def _import_paged_hf_or_warn() -> None:
    """Imports paged_hf; where it cannot load in this process (another environment: another transformers, no torch),
    says so on stderr and lets the program run on transformers' own cache, as it would without ``paged-hf run``."""
    try:
        _import_paged_hf()
    except Exception as error:  # noqa: BLE001 - whatever stops paged_hf must not stop the program
        sys.stderr.write(f"paged-hf run: paged_hf cannot load in {sys.executable} ({type(error).__name__}: "
                         f"{error}); this program runs on transformers' default cache\n")


class _ThenImportPagedHF:
    """Wraps the loader of ``transformers``: runs it, then imports paged_hf. Anything else goes to the original."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _remove_watcher()
        _import_paged_hf_or_warn()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _TransformersWatcher:
    """A meta path finder that only notices the first ``import transformers``."""

    _searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers" or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)  # the other finders' answer
        finally:
            self._searching = False
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenImportPagedHF(spec.loader)
        return spec


_WATCHER = _TransformersWatcher()


def _remove_watcher() -> None:
    if _WATCHER in sys.meta_path:
        sys.meta_path.remove(_WATCHER)


def _run_shadowed_sitecustomize() -> None:
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _install() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    if "transformers" in sys.modules:  # a .pth file got there first
        _import_paged_hf_or_warn()
    else:
        sys.meta_path.insert(0, _WATCHER)
    _run_shadowed_sitecustomize()


if __name__ == "sitecustomize":  # not when a tool walking paged_hf's files imports paged_hf._sitecustomize.*
    _install()
