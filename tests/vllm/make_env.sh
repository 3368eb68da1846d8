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

build() {  # version: (re)build its venv unless its stamp matches its requirements
    local version=$1 venv requirements stamp want
    venv=$(venv_of "$version")
    requirements="$here/requirements-$version.txt"
    [ -f "$requirements" ] || { echo "make_env.sh: no vLLM $version oracle (no $requirements)" >&2; return 2; }
    stamp="$venv/.requirements.sha256"
    want=$(sha256sum < "$requirements" | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
    rm -rf "$venv"
    python -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0 -r "$requirements"
    "$venv/bin/pip" install -q --no-deps "vllm==$version.0"
    echo "$want" > "$stamp"
}

pids=()
for version in "${versions[@]}"; do
    build "$version" & pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
