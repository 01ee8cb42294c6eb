#!/usr/bin/env bash
# One run on a lent GPU machine (the `device` tool): the compiled Triton tests, the CUDA end-to-end tests and the
# kernel benchmark, each bounded in time, their outputs under $OUT. The machine has its own python3, torch and
# triton, no network, and an older transformers: carry a wheel of ours and the real models.
#
# Prepare here, once per session (both folders are git-ignored; 'carry' them):
#   pip download --no-deps transformers==5.24.0 -d .whl
#   mkdir -p .gpu_shared/models && cp -r ../shared/models/stories260K .gpu_shared/models/
#   cp -r ../shared/data .gpu_shared/
# Then, through the device tool, with carry [".whl", ".gpu_shared"] and timeout_s 540:
#   bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PAGED_HF_SLOW=1
[ -d .gpu_shared ] && export PAGED_HF_SHARED=$PWD/.gpu_shared
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -3
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"

# 1. correctness: every kernel compiled, against its torch reference (the slow sweep too), then end to end
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_cuda.py 2>&1 \
  | tail -40 | tee "$OUT/tests.txt"

# 2. speed: bandwidth of paged decode vs the measured copy bandwidth, formats, SDPA, prefill
timeout 240 python3 benchmarks/kernels.py --quick 2>&1 | tail -80 | tee "$OUT/kernels_log.txt"
