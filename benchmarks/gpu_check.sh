#!/usr/bin/env bash
# Everything that needs the GPU, in one call of the device tool (an H200 with torch + Triton):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"])
# Writes at most 8 files under $OUT: the device, the GPU test log (+ junit XML), and the GPU
# benchmark results, which are then committed under benchmarks/results/.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# FastAPI, uvicorn, pydantic, pyzmq and msgspec are not installed there: they travel as wheels.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

# Only modules with GPU tests are collected: the rest may import CPU-only dev tools.
mapfile -t gpu_tests < <(grep -l "pytest.mark.gpu\|marks=\[pytest.mark.gpu\|mark.gpu" tests/*.py)
echo "GPU test modules: ${gpu_tests[*]}"
python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" --timeout 300 \
    --junitxml="$OUT/gpu_tests.xml" "${gpu_tests[@]}" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

step() { echo "== $*"; timeout 400 "$@" || echo "FAILED ($?): $*"; }
step python3 benchmarks/bench_commit.py --out "$OUT/bench_commit.json" 2>&1 | tee "$OUT/bench.log"
step python3 benchmarks/bench_step.py --device cuda --out "$OUT/bench_step_cuda.json" \
    2>&1 | tee -a "$OUT/bench.log"
exit "$tests_rc"
