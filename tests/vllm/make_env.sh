#!/usr/bin/env bash
# Build the vLLM oracle's own virtualenv (vLLM 0.33.0 without its dependency tree, the CPU torch), once:
# it is rebuilt only when requirements.txt changes. A venv of its own because vLLM pins FlashInfer
# 0.7.2.post1 while the project's test env takes the newest FlashInfer.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${NVFP4_REPACK_VLLM_VENV:-$here/../../.venv-vllm}
stamp="$venv/.requirements.sha256"
want=$(cat "$here/requirements.txt" "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
rm -rf "$venv"
python -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0 -r "$here/requirements.txt"
"$venv/bin/pip" install -q --no-deps vllm==0.33.0
echo "$want" > "$stamp"
