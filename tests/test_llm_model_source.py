"""``LLM(model=...)`` with a model that is not there: the error says what is missing, not the hub's repo-id rules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged_hf import LLM

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model", ["/nope/absent-model", "./absent-model", "a/b/c", "/nope/model.gguf"])
def test_a_path_that_does_not_exist_is_named(model):
    with pytest.raises(ValueError, match="does not exist") as error:
        LLM(model=model)
    assert repr(model) in str(error.value) and "Repo id" not in str(error.value)


def test_a_hub_name_that_cannot_be_fetched_says_the_hub_could_not_provide_it():
    """Offline (as this machine is), a name shaped like a hub id goes to the hub and fails: the error says so."""
    check = (
        "from paged_hf import LLM\n"
        "try:\n"
        "    LLM(model='paged-hf-tests/absent-model')\n"
        "except OSError as error:\n"
        "    print(error)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # no retries against a network that is not there
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "'paged-hf-tests/absent-model' is not a local folder or file" in result.stdout
    assert "hub could not provide it" in result.stdout
