#!/usr/bin/env bash
# Build the vLLM oracles' own virtualenvs, one per supported vLLM version: vLLM without its dependency tree (its torch
# pin has no CPU build here) over the CPU torch and the packages of requirements-<version>.txt that its CPU load path
# imports. Each is rebuilt only when its requirements file changes. Venvs of their own because vLLM pins FlashInfer
# 0.7.2.post1 (0.34: 0.7.3) while the project's test env takes the newest FlashInfer.
#
#     bash tests/vllm/make_env.sh [VERSION ...]     # default: every version (0.33 0.34)
#
# Shared where it can be: versions whose requirements list the same packages get one pip install of them (the first
# version's venv), the others a hard-linked copy of it with only vLLM replaced (seconds, no second 4 GB on disk);
# versions whose lists differ build in parallel. Each builds beside its venv and replaces it only when complete
# (tests/oracle_venv.sh): a failed build leaves the previous venv. Where: 0.33 in $NVFP4_REPACK_VLLM_VENV (default .venv-vllm), 0.34 in
# $NVFP4_REPACK_VLLM_VENV_0_34 (default .venv-vllm-0.34): NVFP4_REPACK_VLLM_VENV_<version, _ for .>, none for 0.33.
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
requirements_of() { echo "$here/requirements-$1.txt"; }
packages_of() { grep -v '^#' "$(requirements_of "$1")" | sort; }  # the list without its comments
source "$here/../oracle_venv.sh"
stamp_of() { venv_stamp "$(requirements_of "$1")"; }

build() {  # version: a venv of its own, every package installed
    build_venv "$(venv_of "$1")" "$(requirements_of "$1")" "vllm==$1.0"
}

derive() {  # version base: a hard-linked copy of base's venv with vLLM replaced (pip unlinks, never rewrites, files)
    local status=0
    derive_venv "$(venv_of "$2")" "$(venv_of "$1")" "$(stamp_of "$1")" "vllm==$1.0" || status=$?
    case $status in
        0) "$(venv_of "$1")/bin/python" -c "import importlib.metadata as m; assert m.version('vllm') == '$1.0'" \
               || { rm -f "$(venv_of "$1")/.requirements.sha256"; return 1; } ;;
        2) build "$1" ;;  # another file system: a venv of its own
        *) return 1 ;;
    esac
}

for version in "${versions[@]}"; do
    [ -f "$(requirements_of "$version")" ] || { echo "make_env.sh: no vLLM $version oracle (no requirements-$version.txt)" >&2; exit 2; }
done
first=${versions[0]}
pids=()
build "$first" & pids+=($!)
shared=()
for version in "${versions[@]:1}"; do
    if [ "$(packages_of "$version")" = "$(packages_of "$first")" ]; then
        shared+=("$version")
    else
        build "$version" & pids+=($!)
    fi
done
status=0
wait "${pids[0]}" || status=1
for version in "${shared[@]}"; do  # after the first venv exists
    [ $status -eq 0 ] && { derive "$version" "$first" || status=1; }
done
for pid in "${pids[@]:1}"; do wait "$pid" || status=1; done
exit $status
