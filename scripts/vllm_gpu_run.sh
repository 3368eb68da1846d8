#!/usr/bin/env bash
# The GPU machine's side of docs/serving.md: run from this repository's root there, after the kit's chunks
# (../shared/vllm-gpu) are copied into /tmp/stage. What comes back goes to $OUT (default /tmp/out).
#   bash scripts/vllm_gpu_run.sh prep      # wheels in .whl/ into /tmp/site; this checkout copied to /tmp/tree, which
#                                          # the later steps run from
#   bash scripts/vllm_gpu_run.sh go [S]    # install.sh (last chunk), then in the background: the benchmark's models
#                                          # (/tmp/bench, log /tmp/bench-prep.log), the GPU tests, and the benchmark
#                                          # (its engines build meanwhile, measure once the tests end); then poll for S
#                                          # seconds (default 540)
#   bash scripts/vllm_gpu_run.sh poll [S]  # wait up to S seconds more (default 570) for both; logs into $OUT
# GPU_TESTS overrides the test files (pytest arguments); BENCH_JOBS, BENCH_PARALLEL and BENCH_BUDGET the benchmark's
# jobs, wave size and time (seconds).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
JOBS=${BENCH_JOBS:-"8b-32:default,eager:bundle,source,bf16 70b-4:default:bundle,source,bf16+8b-8-had128:default,eager:bundle,source"}
TESTS=${GPU_TESTS:-"tests/test_gpu_vllm.py tests/test_gpu_runtime.py"}
step=${1:?usage: vllm_gpu_run.sh prep|go|poll [seconds]}

collect() {  # what comes back: at most 8 files
  cp /tmp/tests.log /tmp/bench.log /tmp/bench.json /tmp/bench-prep.log "$OUT"/ 2>/dev/null
  tar czf "$OUT/bench-logs.tgz" -C /tmp/bench logs 2>/dev/null
  grep -hE "passed|failed|^FAILED|^ERROR|^E  |mean \||greedy vs|split at" /tmp/tests.log 2>/dev/null | tail -40
  grep -vE "^\| .*\| - \| - \| - \|" /tmp/bench.log 2>/dev/null | tail -60
}

finished() { [ -e /tmp/tests.done ] && [ -e /tmp/bench.done ]; }

case $step in
  prep)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; df -h /tmp | tail -1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    rm -rf /tmp/tree && cp -r . /tmp/tree && echo "wheels installed, tree in /tmp/tree" ;;
  go)
    bash /tmp/stage/install.sh || exit 1
    source /tmp/stage/env.sh
    rm -f /tmp/tests.done /tmp/bench.done
    # all from /tmp/tree (prep's copy of this checkout), which outlives this call; the models only now: the CLI's
    # typer needs pydantic, which comes with the kit
    export PYTHONPATH=/tmp/tree:/tmp/site
    cd /tmp/tree
    setsid nohup python3 scripts/bench_vllm_serve.py --work /tmp/bench --jobs "$JOBS" --prepare-only \
      >/tmp/bench-prep.log 2>&1 &
    setsid nohup bash -c "timeout 1500 python3 -m pytest -q -p no:cacheprovider -rs -s $TESTS >/tmp/tests.log 2>&1; \
      touch /tmp/tests.done" >/dev/null 2>&1 &
    setsid nohup bash -c "python3 scripts/bench_vllm_serve.py --work /tmp/bench --jobs '$JOBS' --wait-ready 600 \
      --parallel ${BENCH_PARALLEL:-10} --gate /tmp/tests.done --gate-wait 900 --profile-eager \
      --budget ${BENCH_BUDGET:-1500} --json /tmp/bench.json >/tmp/bench.log 2>&1; touch /tmp/bench.done" \
      >/dev/null 2>&1 &
    end=$((SECONDS + ${2:-540}))
    until finished || [ $SECONDS -ge $end ]; do sleep 5; done
    collect ;;
  poll)
    end=$((SECONDS + ${2:-570}))
    until finished || [ $SECONDS -ge $end ]; do sleep 5; done
    collect; nvidia-smi --query-gpu=memory.used --format=csv,noheader
    finished && echo "ALL DONE" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
