"""``pytest -p enforce_eager_plugin``: every ``PagedEngine`` a test builds runs eagerly unless the test sets
``enforce_eager`` itself, so the engine's suites check the eager forward too (they run compiled by default):

    PYTHONPATH=.:tests python -m pytest -p enforce_eager_plugin tests/test_engine*.py
"""

from __future__ import annotations

import pytest

from paged_hf.config import EngineConfig


@pytest.fixture(autouse=True)
def _enforce_eager(monkeypatch):
    build = EngineConfig.from_options.__func__

    def from_options(cls, what, options):
        return build(cls, what, {"enforce_eager": True, **options})

    monkeypatch.setattr(EngineConfig, "from_options", classmethod(from_options))
