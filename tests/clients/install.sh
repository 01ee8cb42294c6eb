#!/usr/bin/env bash
# Installs the third-party clients that test_lm_eval.py and test_guidellm.py drive, each in a venv of its own
# (their pins need not agree with the project's), sharing the machine's torch and transformers
# (--system-site-packages): .clients/lm-eval/bin/lm_eval and .clients/guidellm/bin/guidellm under the repository.
# Those tests look there (or at PAGED_HF_LM_EVAL / PAGED_HF_GUIDELLM) and skip, saying so, when a client is absent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$root/.clients"
python -m venv --system-site-packages "$root/.clients/lm-eval"
"$root/.clients/lm-eval/bin/python" -m pip install -q 'lm-eval[api]==0.4.13'
python -m venv --system-site-packages "$root/.clients/guidellm"
"$root/.clients/guidellm/bin/python" -m pip install -q 'guidellm==0.8.1'
echo "installed: $root/.clients/lm-eval/bin/lm_eval, $root/.clients/guidellm/bin/guidellm"
