#!/usr/bin/env bash
# Build the SGLang oracle's own virtualenv (SGLang 0.5.23 without its dependency tree over the CPU torch, and the
# packages of requirements.txt its CPU load path imports), once: rebuilt only when requirements.txt changes.
# Where: $NVFP4_REPACK_SGLANG_VENV (default .venv-sglang).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../oracle_venv.sh"
build_venv "${NVFP4_REPACK_SGLANG_VENV:-$here/../../.venv-sglang}" "$here/requirements.txt" sglang==0.5.23
