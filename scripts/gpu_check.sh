#!/usr/bin/env bash
# The GPU checks of the kernels issue in one run, for a machine with one CUDA GPU and a Python
# that already has torch, triton, transformers, peft and safetensors (nothing is downloaded):
#
#   1. the environment: GPU, driver, Python, torch, triton, commit          -> $OUT/env.txt
#   2. the kernel tests natively on the GPU (every test of tests/kernels, the engine with
#      --kernels triton against peft, the CUDA warm-up tests: every variant compiled at start
#      and no new binary while serving; the pool sized after a profiling pass; bf16 and
#      larger shapes)                                                        -> $OUT/tests.log
#   3. benchmarks/kernel_bench.py: SGMV, paged attention, the engine (under 5 min) -> $OUT/bench/
#   4. benchmarks/tp_bench.py: TP = 1 and TP = 2 side by side (NCCL), only with two GPUs
#      (skipped with a line saying so on one GPU)                          -> $OUT/tp/
#
# Usage: OUT=DIR scripts/gpu_check.sh   (under 10 minutes; each step has its own time limit,
# TESTS_TIMEOUT and BENCH_TIMEOUT seconds, 280 and 310 unless set; with two GPUs step 4 adds up
# to TP_TIMEOUT, 240).
# The package is installed (editable) without its dependencies; a missing one shows up as an
# import error in tests.log.
set -uo pipefail
OUT=${OUT:?set OUT to the directory for the results}
PY=${PYTHON:-python3}
mkdir -p "$OUT/bench"
cd "$(dirname "$0")/.."

# Editable, as in development: the tests import the checkout's loraplex/ first, and the
# editable finder maps loraplex.server, loraplex.adapter_store, ... onto server/, adapter_store/, ...
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    > "$OUT/install.log" 2>&1 || { echo "install failed: see install.log"; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET

{
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0]);
print("torch", torch.__version__, "cuda", torch.version.cuda); print("triton", triton.__version__)'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 16 cores there: torch's CPU threads for the peft oracles
# (warm-up compiles each kernel variant once per process: about 65 at max_rank 64)
OMP_NUM_THREADS=8 timeout "${TESTS_TIMEOUT:-280}" "$PY" -m pytest -q -ra -p no:cacheprovider \
    tests/kernels tests/engine/test_triton_engine.py tests/engine/test_warmup.py \
    tests/engine/test_profile.py \
    2>&1 | tee "$OUT/tests.log" | tail -25
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tests.log"

timeout "${BENCH_TIMEOUT:-310}" "$PY" benchmarks/kernel_bench.py --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" \
    | tail -60
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"

# Tensor parallelism: TP = 1 and TP = 2 side by side (NCCL), on a machine with two GPUs.
NUM_GPUS=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$NUM_GPUS" -ge 2 ]; then
    timeout "${TP_TIMEOUT:-240}" "$PY" benchmarks/tp_bench.py --device cuda --dtype bfloat16 \
        --sizes 1,2 --num-requests 64 --max-tokens 64 --out "$OUT/tp" 2>&1 \
        | tee "$OUT/tp.log" | tail -8
    echo "tp exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tp.log"
else
    echo "tensor parallelism: skipped, TP = 2 needs two GPUs and $NUM_GPUS is present" \
        | tee "$OUT/tp.log"
fi
