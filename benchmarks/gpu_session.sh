#!/usr/bin/env bash
# One GPU session's checks and measurements, in one command (the device machine is lent for
# minutes): the GPU tests, then benchmarks/kernels.py, lmkv_ttft.py and engine_throughput.py
# on CUDA. Runs with the machine's own python3 (torch, CuPy, transformers) and lmkv from
# this checkout; Python wheels it lacks travel in .whl/ (see docs/kernels.md, "GPU benchmark").
# Each step has its own time limit; full logs go to $OUT (or /tmp/gpu-out), tails to stdout.
#   benchmarks/gpu_session.sh [STEP...]   steps: tests kernels ttft warm warm_after throughput
#   eager profile (default: all but warm_after)
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lmkv-site .whl/*.whl || exit 1
fi
# lmkv's packages under the names they install as (pyproject's package-dir), without pip
PKG=/tmp/lmkv-pkgs
mkdir -p "$PKG"
for pair in lmkv:lmkv lmkv_engines:engine_integration lmkv_cuda:cuda lmkv_server:server; do
    ln -sfn "$ROOT/${pair#*:}" "$PKG/${pair%%:*}"
done
export PYTHONPATH="$PKG:/tmp/lmkv-site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 LMKV_CACHE_DIR=/tmp/lmkv-cache
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
$PY -c "import os, torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, 'cpus', os.cpu_count())"

step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc $rc, $((SECONDS - start)) s"
    grep -v "^\s*$" "$OUT/$name.log" | tail -n "${TAIL:-14}"
}

steps=${*:-tests kernels ttft warm throughput eager profile}
for s in $steps; do
    case $s in
    tests) step tests 140 $PY -m pytest -q -p no:cacheprovider -x tests/cuda/test_engine_cuda.py \
        tests/lmkv/connector/test_worker.py tests/vllm/test_paged.py -k "cuda" ;;
    kernels) step kernels 240 $PY benchmarks/kernels.py --iters 20 ;;
    ttft) step ttft 170 $PY benchmarks/lmkv_ttft.py --device cuda --dtype bfloat16 --model smollm2-shape \
        --repeats 9 ;;
    warm) TAIL=24 step warm 90 $PY benchmarks/profile_warm.py --device cuda --dtype bfloat16 \
        --model smollm2-shape ;;
    warm_after) TAIL=24 step warm_after 90 $PY benchmarks/profile_warm.py --device cuda \
        --dtype bfloat16 --model smollm2-shape --served-before 10 ;;
    throughput) step throughput 110 $PY benchmarks/engine_throughput.py --device cuda --dtype bfloat16 \
        --model smollm2-shape ;;
    eager) step eager 110 $PY benchmarks/engine_throughput.py --device cuda --dtype bfloat16 \
        --model smollm2-shape --enforce-eager ;;
    profile) TAIL=3 step profile 90 $PY benchmarks/profile_decode.py --device cuda --dtype bfloat16 \
        --model smollm2-shape ;;
    *) echo "unknown step $s" ;;
    esac
done
