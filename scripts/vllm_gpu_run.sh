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
# GPU_TESTS overrides the tests (pytest arguments; groups separated by ';' run as that many pytest processes at once,
# each logging to tests-N.log: the engines' compiles are CPU-bound, the GPU is mostly idle; `go` starts them through
# this script's own `tests` step); BENCH_JOBS, BENCH_PARALLEL and BENCH_BUDGET the benchmark's jobs, wave size and time
# (seconds); NO_BENCH=1 runs the tests only. STAGE, SITE and TREE (default /tmp/stage, /tmp/site, /tmp/tree) and RUN
# (its logs and markers, default /tmp) keep two kits apart on one machine (vLLM 0.34: /tmp/stage034, /tmp/site034,
# /tmp/tree034, /tmp/run034). Keep a device call in flight while the jobs run: the machine goes back after 30 s idle.
set -uo pipefail
OUT=${OUT:-/tmp/out}
STAGE=${STAGE:-/tmp/stage} SITE=${SITE:-/tmp/site} TREE=${TREE:-/tmp/tree} RUN=${RUN:-/tmp}
export STAGE SITE
mkdir -p "$OUT" "$RUN"
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
JOBS=${BENCH_JOBS:-"8b-32:default,eager:bundle,source,bf16 70b-4:default:bundle,source,bf16+8b-8-had128:default,eager:bundle,source"}
TESTS=${GPU_TESTS:-"tests/test_gpu_vllm.py tests/test_gpu_runtime.py"}
step=${1:?usage: vllm_gpu_run.sh prep|go|poll [seconds]}

collect() {  # what comes back: at most 8 files
  cat "$RUN"/tests-*.log >"$RUN"/tests.log 2>/dev/null
  cp "$RUN"/tests.log "$RUN"/bench.log "$RUN"/bench.json "$RUN"/bench-prep.log "$OUT"/ 2>/dev/null
  tar czf "$OUT/bench-logs.tgz" -C "$RUN"/bench logs 2>/dev/null
  grep -hE "passed|failed|^FAILED|^ERROR|^E  |mean \||greedy vs|split at|^\[vLLM " "$RUN"/tests.log 2>/dev/null | tail -40
  grep -vE "^\| .*\| - \| - \| - \|" "$RUN"/bench.log 2>/dev/null | tail -60
}

guard_cute_dsl_warmup() {  # vLLM 0.34's kernel warmup imports MiniMax-M3's CuTe DSL kernels (`cutlass`) in every
  # CUDA engine; the kit ships no CuTe DSL: that warmup is skipped where `cutlass` is absent (0.33 has no such import)
  python3 - "$SITE/vllm/model_executor/warmup/kernel_warmup.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
old = "    if current_platform.is_cuda():\n        # The MSA kernels"
new = ("    import importlib.util\n    if current_platform.is_cuda() and importlib.util.find_spec(\"cutlass\") is not None:"
       "  # KIT PATCH: no CuTe DSL\n        # The MSA kernels")
if old in text:
    open(path, "w").write(text.replace(old, new))
    print("kernel_warmup.py: MiniMax-M3 warmup skipped without the CuTe DSL")
PY
}

finished() { [ -e "$RUN"/tests.done ] && [ -e "$RUN"/bench.done ]; }

run_tests() {  # each ';'-separated group of $TESTS in its own pytest process, all at once; tests.done once all end
  local i=0 group
  rm -f "$RUN"/tests-*.log
  IFS=';' read -ra groups <<<"$TESTS"
  for group in "${groups[@]}"; do
    [ -n "${group// /}" ] || continue
    (eval "timeout 1500 python3 -m pytest -q -p no:cacheprovider -rs -s $group" >"$RUN/tests-$i.log" 2>&1) &
    i=$((i + 1))
  done
  wait
  touch "$RUN"/tests.done
}

case $step in
  prep)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; df -h /tmp | tail -1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || exit 1
    rm -rf "$TREE" && cp -r . "$TREE" && echo "wheels installed, tree in $TREE" ;;
  go)
    bash "$STAGE"/install.sh || exit 1
    source "$STAGE"/env.sh
    guard_cute_dsl_warmup
    rm -f "$RUN"/tests.done "$RUN"/bench.done
    # all from $TREE (prep's copy of this checkout), which outlives this call; the models only now: the CLI's
    # typer needs pydantic, which comes with the kit
    export PYTHONPATH=$TREE:$SITE
    cd "$TREE"
    GPU_TESTS=$TESTS setsid nohup bash "$TREE"/scripts/vllm_gpu_run.sh tests >/dev/null 2>&1 &
    if [ -n "${NO_BENCH:-}" ]; then
      touch "$RUN"/bench.done
    else
      setsid nohup python3 scripts/bench_vllm_serve.py --work "$RUN"/bench --jobs "$JOBS" --prepare-only \
        >"$RUN"/bench-prep.log 2>&1 &
      setsid nohup bash -c "python3 scripts/bench_vllm_serve.py --work $RUN/bench --jobs '$JOBS' --wait-ready 600 \
        --parallel ${BENCH_PARALLEL:-10} --gate $RUN/tests.done --gate-wait 900 --profile-eager \
        --budget ${BENCH_BUDGET:-1500} --json $RUN/bench.json >$RUN/bench.log 2>&1; touch $RUN/bench.done" \
        >/dev/null 2>&1 &
    fi
    end=$((SECONDS + ${2:-540}))
    until finished || [ $SECONDS -ge $end ]; do sleep 5; done
    collect ;;
  tests) run_tests ;;
  poll)
    end=$((SECONDS + ${2:-570}))
    until finished || [ $SECONDS -ge $end ]; do sleep 5; done
    collect; nvidia-smi --query-gpu=memory.used --format=csv,noheader
    finished && echo "ALL DONE" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
