#!/usr/bin/env bash
# The GPU checks of benchmarks/RESULTS.md in one bounded run, for a machine lent for minutes:
#   1. the CUDA path's tests (tests/test_cuda.py; 38 s on an H200);
#   2. one save benchmark against stock DeepSpeed at a micro-batch whose steps are not launch-bound
#      (ZeRO-3 fp32), the methods taking turns twice (--rounds 2): an H200's steps drifted by 40 %
#      with no save in flight, more than a background write moves them (benchmarks/RESULTS.md, "one
#      H200 at c551b69"; one round of 3 saves x 20 steps took 176 s there);
#   3. where the steps right after a save spend their time at that micro-batch (step_profile, ZeRO-3 fp32).
# Each step has its own time limit and the next one runs whatever the last one did, so one failure
# or hang does not cost the others; each step's exit status and seconds go to OUT/status.txt, and the
# script's exit status is that of the first step that failed.
#
# Usage: benchmarks/gpu_checks.sh OUT [WHEELS]
#   OUT     results folder (created): each step's JSON/markdown, status.txt, and log.txt with everything printed
#   WHEELS  optional folder of wheels, for a machine that cannot reach a package index: whatever of
#           async_ckpt's dependencies the machine lacks (not torch), built for its Python. They go to a
#           scratch site folder (--no-index --no-deps); async_ckpt itself runs from this checkout.
#           On the device machines of 2026-11 (Python 3.12, torch 2.11) that was deepspeed (an sdist:
#           `DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8`), hjson, pydantic,
#           pydantic_core, annotated-types, typing-inspection, isal, s3fs, aiobotocore, botocore, jmespath
#           and aioitertools (`pip download --no-deps --only-binary=:all: --python-version 3.12 ...`).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: benchmarks/gpu_checks.sh OUT [WHEELS]"; exit 2; }
out=$(realpath -m "$1")
wheels=${2:+$(realpath -m "$2")}
micro_batch=${MICRO_BATCH:-128}
cd "$(dirname "$0")/.."
mkdir -p "$out"

step() {  # step SECONDS NAME COMMAND...: one check under a time limit; its exit status goes to status.txt
    local limit=$1 name=$2 started rc
    shift 2
    echo "== $name (limit ${limit} s): $*"
    started=$SECONDS
    timeout --kill-after=5 "$limit" "$@"
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - started)) s"
    echo "$name $rc $((SECONDS - started))" >> "$out/status.txt"
    [ "$status" -ne 0 ] || status=$rc
}

checks() {
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if [ -n "$wheels" ]; then
        local site
        site=$(mktemp -d)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
            || { echo "could not install the wheels of $wheels"; return 1; }
        export PYTHONPATH="$PYTHONPATH:$site"
    fi
    python3 -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__,
                                              "gpu", torch.cuda.get_device_name(0))' || return 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    status=0
    # the limits add up to 510 s (+5 s each to kill): one call of a machine lent for 600 s at most
    step 90 cuda_tests python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    step 330 bench_zero3_fp32 python3 -m async_ckpt bench --device cuda --size large --micro-batch "$micro_batch" \
        --saves 3 --steps-between 10 --rounds 2 --writeback-cap-s 20 --methods stock,async_ckpt \
        --out "$out/bench_zero3_fp32"
    step 90 profile_zero3_fp32 python3 -m async_ckpt.bench.step_profile --device cuda --stage 3 --dtype fp32 \
        --size large --micro-batch "$micro_batch" --saves 2 --before 3 --after 6 --warmup 20 --steps-between 10 \
        --out "$out/profile_zero3_fp32"
    return "$status"
}

checks 2>&1 | tee -a "$out/log.txt"
exit "${PIPESTATUS[0]}"
