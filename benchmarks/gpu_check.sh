#!/usr/bin/env bash
# Everything that needs a GPU, on any CUDA machine where the project is installed (for instance
# `make SYSTEM_TORCH=1 .venv/.installed-dev` over a CUDA build of torch, then PYTHON=.venv/bin/python):
# the GPU tests, then the GPU benchmarks.
#   benchmarks/gpu_check.sh [SECTION...]   (default: all of them, in this order)
#   sections: tests targets shards profile table split round_trip host_calls decode worker sweep
#             commit attention mla host_tier (see below)
#   PYTHON  the interpreter to use (default python3)
#   OUT     where results go (default ./out): device.txt, the GPU test log and junit XML, and the
#           benchmark JSON, to be committed under benchmarks/results/<date>-<gpu>/
# Exit status: the GPU tests' (a failed benchmark is reported, not fatal).
set -uo pipefail
SECTIONS=" ${*:-tests targets shards profile table split round_trip host_calls decode worker sweep commit attention mla host_tier} "
want() { [[ $SECTIONS == *" $1 "* ]]; }
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: $PYTHON sees no CUDA device (is a CUDA build of torch installed?)" >&2
    exit 1
fi
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

# Only modules with GPU tests are collected: the others may import test-only tools that a
# runtime install lacks.
tests_rc=0
if want tests; then
    mapfile -t gpu_tests < <(grep -rl --include='*.py' "mark.gpu" tests)
    echo "GPU test modules: ${gpu_tests[*]}"
    # xunit1: the XML keeps what tests record with record_property (the bf16 agreement figures).
    "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -o junit_family=xunit1 \
        --timeout 300 --junitxml="$OUT/gpu_tests.xml" "${gpu_tests[@]}" 2>&1 | tee "$OUT/gpu_tests.log"
    tests_rc=${PIPESTATUS[0]}
fi

step() { echo "== $(date -u +%T) $*"; timeout 500 "$@" || echo "FAILED ($?): $*"; }
# Most telling first: a run cut short still records it.
# targets: the service's call on a pool shaped like a real model (32 layers x 8 KV heads x 128)
# against 2 layers, same steps: the commit reads every layer in place, so the two should be
# close. One remote transport a run: a service sized for two workers of 32 layers beside the in-process
# one would not fit in one GPU's memory.
want targets && for layers in 2 32; do
    for transport in ipc stream; do
        step "$PYTHON" benchmarks/bench_step.py --device cuda --quick --steps 80 \
            --layers "$layers" --kv-heads 8 --head-dim 128 \
            --only manager service_inproc "$transport" \
            --out "$OUT/bench_step_cuda_${layers}_layers_${transport}.json" 2>&1 \
            | tee -a "$OUT/bench.log"
    done
    # The overlap worker's in-process step on its own: a third pool of this shape beside the
    # two above would not fit in one GPU's memory (the remote service refuses to start).
    step "$PYTHON" benchmarks/bench_step.py --device cuda --quick --steps 80 \
        --layers "$layers" --kv-heads 8 --head-dim 128 \
        --only manager service_inproc_overlap \
        --out "$OUT/bench_step_cuda_${layers}_layers_overlap.json" 2>&1 | tee -a "$OUT/bench.log"
done
# profile: where the in-process step's time goes, phase by phase, on both shapes.
# shards: the step of a service of two tensor-parallel shards against one pool, same batch and
# model (the second device should add <= 20%: a table sync, a fence and a commit, nothing per
# layer); both shards on cuda:0, and on cuda:0,cuda:1 where there are two GPUs.
want shards && for devices in cuda:0,cuda:0 $("$PYTHON" -c 'import torch; print("cuda:0,cuda:1" if torch.cuda.device_count() > 1 else "")'); do
    step "$PYTHON" benchmarks/bench_step.py --device cuda --quick --steps 80 \
        --layers 32 --kv-heads 8 --head-dim 128 --devices "$devices" \
        --only service_inproc service_inproc_shards \
        --out "$OUT/bench_step_cuda_32_layers_shards_${devices//[:,]/_}.json" 2>&1 \
        | tee -a "$OUT/bench.log"
done

want profile && for layers in 2 32; do
    step "$PYTHON" benchmarks/profile_step.py --device cuda --layers "$layers" --kv-heads 8 \
        --head-dim 128 --steps 200 --out "$OUT/profile_step_${layers}_layers.json" 2>&1 \
        | tee -a "$OUT/bench.log"
done
# table: the block table's per-step sync, one graph replay against the eager copies.
want table && step "$PYTHON" benchmarks/bench_table_upload.py --out "$OUT/bench_table_upload.json" 2>&1 | tee -a "$OUT/bench.log"
# split: a remote call's time on both sides of the transport (medians), the service polling
# around when the next call is due (the default) or sleeping between calls, back to back and
# with the caller sleeping through a 10 ms forward, and over ZeroMQ.
want split && for run in "stream:" "stream_sleeping:--ipc-spin-s 0" "stream_gap10:--gap-ms 10" \
        "stream_gap10_sleeping:--ipc-spin-s 0 --gap-ms 10" "ipc:--transport ipc"; do
    # shellcheck disable=SC2086  # the flags are words
    step "$PYTHON" benchmarks/bench_call_split.py --device cuda ${run#*:} \
        --out "$OUT/bench_call_split_${run%%:*}.json" 2>&1 | tee -a "$OUT/bench.log"
done
# round_trip: what the host adds to a local round trip with no service behind it (ZeroMQ and a
# stream socket).
want round_trip && step "$PYTHON" benchmarks/bench_round_trip.py --out "$OUT/bench_round_trip.json" 2>&1 | tee -a "$OUT/bench.log"
# host_calls: what one host call into torch and CUDA costs here (a stream look-up, an event, an
# upload, a launch, a graph replay): the units of the host path below, which hosts differ in.
want host_calls && step "$PYTHON" benchmarks/bench_host_calls.py --out "$OUT/bench_host_calls.json" 2>&1 | tee -a "$OUT/bench.log"
# decode: the worker's decode step alone (1B and 8B shapes, batch 64, 1.5k context, graphs)
# against the same forward without attention, SDPA over a contiguous cache, the bytes it must
# read and model.generate; where the launches' host time goes (profiled in the warm-up runs).
# One shape a run: a run cut short still records the other.
want decode && for shape in 1b 8b; do
    step "$PYTHON" benchmarks/bench_decode.py --shapes "$shape" --host-profile \
        --out "$OUT/bench_decode_${shape}.json" 2>&1 | tee -a "$OUT/bench.log"
done
# worker: a real model's decode loop with its KV in the pool (a ~1B shape, bf16, random weights).
want worker && step "$PYTHON" benchmarks/bench_worker.py --out "$OUT/bench_worker.json" 2>&1 | tee -a "$OUT/bench.log"
# sweep: the step path, the manager with a CUDA block table and the service on a CUDA pool of
# the embedded shape, at 64, 256 and 1024 requests.
want sweep && step "$PYTHON" benchmarks/bench_step.py --device cuda --steps 100 \
    --out "$OUT/bench_step_cuda.json" 2>&1 | tee -a "$OUT/bench.log"
# commit: the NWOR commit kernel against the copy ceiling.
want commit && step "$PYTHON" benchmarks/bench_commit.py --out "$OUT/bench_commit.json" 2>&1 | tee -a "$OUT/bench.log"
# attention: the paged attention kernel's decode layer against a device copy and cuDNN's SDPA.
want attention && step "$PYTHON" benchmarks/bench_attention.py --out "$OUT/bench_attention.json" 2>&1 | tee -a "$OUT/bench.log"
# mla: the MLA decode kernel over a latent pool (DeepSeek-V3's 128 heads x 512 + 64, bf16) at
# 1k, 4k and 16k tokens of context against a plain read of the same bytes and a bf16 product of
# the same FLOPs (compute-bound: the product is its ceiling), every candidate cut timed.
want mla && step "$PYTHON" benchmarks/bench_mla.py --out "$OUT/bench_mla.json" 2>&1 | tee -a "$OUT/bench.log"
# host_tier: the host tier's copies (scattered blocks gathered, one DMA per run of slots) against a
# plain pinned copy of the same bytes and against one copy per piece, on the 8B shape, and a
# 100k-token prefix onboarded (16 GiB of pool on the GPU, 16 GiB of pinned host memory).
want host_tier && step "$PYTHON" benchmarks/bench_host_tier.py --out "$OUT/bench_host_tier.json" 2>&1 | tee -a "$OUT/bench.log"
# ... and time to first token of a 32k-token prompt on the ~1B shape: from the tier, from the
# pool, recomputed; and the steps of 32 decoding requests around its onboard.
want host_tier && step "$PYTHON" benchmarks/bench_tier_ttft.py --out "$OUT/bench_tier_ttft.json" 2>&1 | tee -a "$OUT/bench.log"
exit "$tests_rc"
