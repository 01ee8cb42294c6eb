"""A real ``paged-hf serve`` (``python -m paged_hf.cli serve``) in a subprocess on a free loopback port, over a copy of
stories260K whose tokenizer has a plain chat template (the model ships none). Used by the client-compatibility tests.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from models import STORIES, require_stories

CHAT_TEMPLATE = "{% if preamble is defined %}{{ preamble }}\n{% endif %}" \
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
                "{% if add_generation_prompt %}assistant:{% endif %}"
ROOT = Path(__file__).resolve().parents[1]


def stories_folder(parent: Path) -> Path:
    """``parent/stories260K``: the model's files, its tokenizer given ``CHAT_TEMPLATE``."""
    require_stories()
    folder = parent / "stories260K"
    folder.mkdir(exist_ok=True)
    for item in STORIES.iterdir():
        shutil.copy(item, folder / item.name)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Served:
    """``paged-hf serve FOLDER ARGS...`` until ``stop()``; ``url`` is its base address, ``log`` its stderr file."""

    def __init__(self, folder: Path, *args: str, log_dir: Path, timeout: float = 180) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"serve-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "paged_hf.cli", "serve", str(folder), "--port", str(self.port), *args]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"paged-hf serve exited {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"paged-hf serve did not start in {timeout} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.25)

    def logged(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def client_program(name: str, variable: str) -> str | None:
    """A third-party client's command: ``$variable``, else ``.clients/<venv>/bin/<name>`` (tests/clients/install.sh),
    else ``name`` on PATH; None where none is found."""
    given = os.environ.get(variable)
    if given:
        return given
    venv = {"lm_eval": "lm-eval"}.get(name, name)
    installed = ROOT / ".clients" / venv / "bin" / name
    if installed.is_file():
        return str(installed)
    return shutil.which(name)
