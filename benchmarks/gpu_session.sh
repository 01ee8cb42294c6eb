#!/usr/bin/env bash
# One run on a lent GPU machine (the `device` tool): the CUDA end-to-end tests first, then the compiled kernel
# grid, then the kernel benchmark; each step bounded, its results under $OUT even when it times out.
#
# Budget (a session has 15 min of device time in all, machine start-up included; planned so a rerun fits):
#   step 0  machine facts, carried wheels installed             ~20 s
#   step 1  tests/test_cuda.py (CUDA vs CPU end to end)        wall 120 s, 90 s per test, xdist -n $JOBS
#   step 2  tests/test_kernels.py + tests/test_warmup.py       wall  90 s, 60 s per test, xdist -n $JOBS
#           (the default grid compiled, not PAGED_HF_SLOW's sweep: ~35 float32-heavy variants, 1-5 s each)
#   step 3  benchmarks/gpu_kernels.py --quick                  wall 120 s (mostly compiles: ~25 variants)
#   step 4  $BENCH_EXTRA (a slot for throughput / decode)       wall $BENCH_EXTRA_WALL s (default 60), if set
#   step 5  CUDA graphs: tests/test_static_decode_triton.py,    wall $WALL_GRAPHS s (default 150) for both parts:
#           tests/test_cuda.py -k cuda_graphs (when step 1     the tests, then benchmarks/cuda_graphs.py
#           did not run them)
#           + benchmarks/cuda_graphs.py --layers 12             (decode tok/s, graphs on vs cudagraph_mode="NONE",
#             --batches 1,8,64 --new-tokens 32 --repeats 1       a SmolLM2-shaped random Llama of 12 layers in bf16:
#                                                                one compile; each row printed as it is measured)
#   whole run: at most 20 + 120 + 90 + 120 + 150 = 500 s without step 4 (each step gets SIGINT at its wall, so
#   pytest writes its summary and JUnit XML, and SIGKILL 10 s later: 550 s at the very worst). With ~2 min of
#   machine start-up and the transfers, ~11 of the 15 minutes: a rerun of one or two steps (STEPS=...) still fits,
#   not of all of them. STEPS='5' alone (graph tests + benchmark): ~150 s.
#
# Prepare here, once per session, in the root of the checkout the session runs from (both folders are
# git-ignored; they travel only through `carry`; together ~15 MiB of the 64 MiB a call may carry):
#   W='python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64'
#   $W -d .whl transformers==5.24.0                                   # the machine has transformers 5.17
#   $W -d .whl/plugins pytest-timeout==2.4.0 pytest-xdist==3.8.0 execnet==2.1.2   # installed only if missing
#   $W -d .whl/deps regex==2025.11.3          # installed only if transformers 5.24 fails to import without it
#   mkdir -p .gpu_shared/models && cp -r ../shared/models/stories260K .gpu_shared/models/ && cp -r ../shared/data .gpu_shared/
# Then one call of the device tool:
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl", ".gpu_shared"], timeout_s=590)
# (590 s: the 550 s worst case plus margin, under the 600 s a call may take; the tool's limit counts the command
# only, not the start-up).
# and, to rerun only some steps on the still-warm machine (it stays warm 30 s after a call): command=
# "STEPS='1' bash benchmarks/gpu_session.sh". Variables: STEPS (default "1 2 3 4 5"), JOBS (xdist workers, 8),
# WALL_CUDA / WALL_KERNELS / WALL_BENCH / WALL_GRAPHS (120 / 90 / 120 / 150 s), BENCH_EXTRA (e.g.
# "benchmarks/throughput.py --batches 1,8,32") with BENCH_EXTRA_WALL (60 s).
# What comes back (the tool returns at most 8 files): session.txt (everything printed, with the per-step status
# and times), cuda.xml, kernels.xml (JUnit), kernels.md (the benchmark's report), graphs.xml and cuda_graphs.md
# (step 5), plus what BENCH_EXTRA writes.
#
# Dry run on a CPU machine (CUDA steps skipped; proves the paths, the plugins and the carried files):
#   OUT=/tmp/dry bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-1 2 3 4 5}
JOBS=${JOBS:-8}
BENCH_EXTRA=${BENCH_EXTRA:-}
BENCH_EXTRA_WALL=${BENCH_EXTRA_WALL:-60}
WALL_CUDA=${WALL_CUDA:-120} WALL_KERNELS=${WALL_KERNELS:-90} WALL_BENCH=${WALL_BENCH:-120}
WALL_GRAPHS=${WALL_GRAPHS:-150}
SITE=/tmp/paged_hf_site
mkdir -p "$OUT" "$SITE"
LOG="$OUT/session.txt"
: >"$LOG"
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset PAGED_HF_SLOW TRITON_INTERPRET
[ -d .gpu_shared ] && export PAGED_HF_SHARED=$PWD/.gpu_shared
SUMMARY=()

say() { echo "$*" | tee -a "$LOG"; }
note() { echo "$*" | tee -a "$LOG" >&2; }  # for functions whose stdout is captured

# run_step NAME WALL_S CMD...: CMD under `timeout` (SIGINT at WALL_S, SIGKILL 10 s later), output into $LOG.
run_step() {
  local name=$1 wall=$2 start=$SECONDS status
  shift 2
  say "=== step $name: $* (wall ${wall}s) ==="
  timeout -s INT -k 10 "$wall" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    5) status="no tests ran (all skipped?)" ;;
    124) status="TIMED OUT at ${wall}s (SIGINT)" ;;
    137) status="KILLED after ${wall}s + 10s" ;;
    *) status="rc=$rc" ;;
  esac
  SUMMARY+=("step $name: $status, $((SECONDS - start)) s")
  say "=== step $name: $status, $((SECONDS - start)) s ==="
}

pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@" 2>&1 | tail -3; }
has() { python3 -c "import $1" >/dev/null 2>&1; }

# ------------------------------------------------------------------------------------------ step 0: facts
say "=== step 0: machine and packages ==="
ls .whl/transformers-*.whl >/dev/null 2>&1 && pip_target .whl/transformers-*.whl
if ! has transformers && ls .whl/deps/*.whl >/dev/null 2>&1; then
  python3 -c "import transformers" 2>&1 | tail -2 | tee -a "$LOG"
  say "transformers does not import: installing the carried .whl/deps"
  pip_target .whl/deps/*.whl
fi
has pytest_timeout || { ls .whl/plugins/pytest_timeout*.whl >/dev/null 2>&1 && pip_target .whl/plugins/pytest_timeout*.whl; }
has xdist || { ls .whl/plugins/pytest_xdist*.whl >/dev/null 2>&1 && pip_target .whl/plugins/pytest_xdist*.whl .whl/plugins/execnet*.whl; }
{
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  echo "cpus $(nproc), $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB RAM"}'), python $(python3 -V 2>&1)"
  python3 -c "
import importlib, torch, triton, transformers
cuda = torch.cuda.is_available()
print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__,
      '|', torch.cuda.get_device_name() if cuda else 'no CUDA device')
for name in ('pytest', 'pytest_timeout', 'xdist'):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, '__version__', 'present'))
    except ImportError:
        print(name, 'ABSENT')
"
  echo "PAGED_HF_SHARED=${PAGED_HF_SHARED:-unset} ($(ls "${PAGED_HF_SHARED:-/nonexistent}/models" 2>/dev/null | tr '\n' ' '))"
} 2>&1 | tee -a "$LOG"
CUDA=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
[ "$CUDA" = 1 ] || JOBS=$(( $(nproc) < JOBS ? $(nproc) : JOBS ))  # a dry run on a small CPU machine

# pytest options: JUnit XML under $OUT, a per-test timeout and workers when the plugins are there
pytest_opts() {  # NAME PER_TEST_S
  local opts=(-q -rfEs -p no:cacheprovider -p no:benchmark --junitxml="$OUT/$1.xml")
  # a plugin that does not import is also kept from loading (a broken install would stop pytest)
  if has pytest_timeout; then
    opts+=(--timeout="$2")
  else
    opts+=(-p no:timeout) && note "(no pytest-timeout: no per-test timeout)"
  fi
  if has xdist; then
    opts+=(-n "$JOBS")
  else
    opts+=(-p no:xdist -p no:xdist.looponfail) && note "(no pytest-xdist: one process)"
  fi
  echo "${opts[@]}"
}

for step in $STEPS; do
  case $step in
    1)  # shellcheck disable=SC2046
      run_step "1 test_cuda" "$WALL_CUDA" python3 -m pytest tests/test_cuda.py $(pytest_opts cuda 90) ;;
    2)
      if [ "$CUDA" = 1 ]; then  # shellcheck disable=SC2046
        run_step "2 kernels" "$WALL_KERNELS" python3 -m pytest tests/test_kernels.py tests/test_warmup.py $(pytest_opts kernels 60)
      else  # the compiled grid needs CUDA; on CPU prove that the step's tests collect
        run_step "2 kernels (no CUDA: collect only)" "$WALL_KERNELS" python3 -m pytest --collect-only -q -p no:cacheprovider \
          tests/test_kernels.py tests/test_warmup.py
      fi ;;
    3)
      run_step "3 kernel benchmark" "$WALL_BENCH" env OUT="$OUT" python3 benchmarks/gpu_kernels.py --quick ;;
    4)
      if [ -n "$BENCH_EXTRA" ]; then  # shellcheck disable=SC2086
        run_step "4 $BENCH_EXTRA" "$BENCH_EXTRA_WALL" env OUT="$OUT" python3 $BENCH_EXTRA
      else
        SUMMARY+=("step 4: no BENCH_EXTRA set, skipped")
      fi ;;
    5)  # the graph tests (unless step 1 ran them), then decode on and off in what is left of the wall
      graphs_start=$SECONDS
      graph_tests=(tests/test_static_decode_triton.py)  # the padded path on the compiled kernels, without graphs
      # step 1 runs tests/test_cuda.py whole; without it, its graph tests run here (the -k keeps the file above)
      [[ " $STEPS " != *" 1 "* ]] && graph_tests+=(tests/test_cuda.py -k "cuda_graphs or padded_path")
      # shellcheck disable=SC2046
      run_step "5a cuda graph tests" "$((WALL_GRAPHS * 2 / 5))" \
        python3 -m pytest "${graph_tests[@]}" $(pytest_opts graphs 60)
      if [ "$CUDA" = 1 ]; then
        run_step "5b cuda graphs benchmark" "$((WALL_GRAPHS - SECONDS + graphs_start))" env OUT="$OUT" \
          python3 benchmarks/cuda_graphs.py --layers 12 --batches 1,8,64 --new-tokens 32 --repeats 1
      else  # a CPU dry run: the padded static path instead of graphs, at the smallest size
        run_step "5b cuda graphs benchmark (no CUDA: --quick)" "$((WALL_GRAPHS - SECONDS + graphs_start))" \
          env OUT="$OUT" python3 benchmarks/cuda_graphs.py --quick
      fi ;;
  esac
done

say "=== summary (${SECONDS} s in all; planned at most 500 s, 550 s with every SIGKILL grace) ==="
for line in "${SUMMARY[@]}"; do say "$line"; done
ls -la "$OUT" | tee -a "$LOG"
