#!/usr/bin/env bash
# Build the vLLM oracles' own virtualenvs, one per supported vLLM version, in parallel: vLLM without its dependency
# tree (its torch pin has no CPU build here) over the CPU torch and the packages of requirements-<version>.txt that
# its CPU load path imports. Each is rebuilt only when its requirements file changes. Venvs of their own because vLLM
# pins FlashInfer 0.7.2.post1 (0.34: 0.7.3) while the project's test env takes the newest FlashInfer.
#
#     bash tests/vllm/make_env.sh [VERSION ...]     # default: every version (0.33 0.34)
#
# Where: 0.33 in $NVFP4_REPACK_VLLM_VENV (default .venv-vllm), 0.34 in $NVFP4_REPACK_VLLM_VENV_0_34 (default
# .venv-vllm-0.34): the variable is NVFP4_REPACK_VLLM_VENV_<version with _ for .>, the oldest version's has no suffix.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.33 0.34)

venv_of() {  # the version's venv folder
    case $1 in
        0.33) echo "${NVFP4_REPACK_VLLM_VENV:-$root/.venv-vllm}" ;;
        *) local var="NVFP4_REPACK_VLLM_VENV_${1//./_}"; echo "${!var:-$root/.venv-vllm-$1}" ;;
    esac
}

source "$here/../oracle_venv.sh"

build() {  # version: (re)build its venv unless its stamp matches its requirements
    local requirements="$here/requirements-$1.txt"
    [ -f "$requirements" ] || { echo "make_env.sh: no vLLM $1 oracle (no $requirements)" >&2; return 2; }
    build_venv "$(venv_of "$1")" "$requirements" "vllm==$1.0"
}

pids=()
for version in "${versions[@]}"; do
    build "$version" & pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
