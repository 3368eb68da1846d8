#!/usr/bin/env bash
# The GPU machine's side of docs/serving.md: run from this repository's root there, after the kit's chunks
# (../shared/vllm-gpu) are copied into /tmp/stage. Logs and results go to $OUT (default /tmp/out).
#   bash scripts/vllm_gpu_run.sh prep    # wheels in .whl/ into /tmp/site; the benchmark's models written in the
#                                        # background (/tmp/bench, log /tmp/bench-prep.log), from a copy in /tmp/tree
#   bash scripts/vllm_gpu_run.sh tests   # install.sh (last chunk), then the vLLM GPU tests
#   bash scripts/vllm_gpu_run.sh bench   # scripts/bench_vllm_serve.py on /tmp/bench
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
step=${1:?usage: vllm_gpu_run.sh prep|tests|bench}

case $step in
  prep)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    rm -rf /tmp/tree && cp -r . /tmp/tree
    (cd /tmp/tree && PYTHONPATH=/tmp/tree:/tmp/site setsid nohup python3 scripts/bench_vllm_serve.py \
      --work /tmp/bench --prepare-only >/tmp/bench-prep.log 2>&1 &)
    echo "prep started" ;;
  tests)
    bash /tmp/stage/install.sh || exit 1
    source /tmp/stage/env.sh
    tail -3 /tmp/bench-prep.log
    timeout 430 python3 -m pytest -q -p no:cacheprovider -rs -s tests/test_gpu_vllm.py tests/test_gpu_runtime.py \
      2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|error|PASS|FAIL|mean \||greedy vs" ;;
  bench)
    source /tmp/stage/env.sh
    timeout 570 python3 scripts/bench_vllm_serve.py --work /tmp/bench --wait-ready 240 --budget 520 \
      --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    tar czf "$OUT/bench-logs.tgz" -C /tmp/bench logs ready.json /tmp/bench-prep.log 2>/dev/null ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
