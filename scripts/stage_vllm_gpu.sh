#!/usr/bin/env bash
# Stage the vllm-gpu kit (../shared/vllm-gpu: vLLM trimmed for the GPU machine's torch 2.11, in chunks) for a vLLM
# release other than the kit's own 0.33.0: the kit's files in a scratch copy with that release's wheel pinned (its
# sha256 from the registry's file), and the shared libraries the release no longer ships (0.34: qutlass) left off the
# trim list; then the kit's own stage.sh. docs/serving.md, "On a GPU: how", has the device calls.
#
#     bash scripts/stage_vllm_gpu.sh 0.34.0 .vllmgpu034 [--with-server] [--chunk-mib N]
#
# env: VLLMGPU_KIT (default ../shared/vllm-gpu beside the repository, else /work/shared/vllm-gpu), PYTHON.
set -euo pipefail
die() { echo "stage_vllm_gpu.sh: error: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: stage_vllm_gpu.sh VERSION OUTDIR [stage.sh options]"
version=$1 out=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
kit=${VLLMGPU_KIT:-$root/../shared/vllm-gpu}
[ -f "$kit/stage.sh" ] || kit=/work/shared/vllm-gpu
[ -f "$kit/stage.sh" ] || die "no vllm-gpu kit at $kit (set VLLMGPU_KIT)"
PY=${PYTHON:-python3}
mkdir -p "$out/.cache"
cache=$(cd "$out/.cache" && pwd)

# the release's wheel for CPython 3.12 on manylinux x86_64 (the GPU machine), and its hash
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --implementation cp \
    --python-version 3.12 --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$cache" "vllm==$version" || die "pip download vllm==$version failed"
wheel=$(ls "$cache"/vllm-"$version"-*.whl | head -1)
hash=$(sha256sum "$wheel" | cut -d' ' -f1)

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r "$kit/." "$scratch/"
sed -i "s/^VLLM_VERSION=.*/VLLM_VERSION=$version/" "$scratch/stage.sh"
sed -i "s/^vllm==[^ ]* --hash=sha256:[0-9a-f]*/vllm==$version --hash=sha256:$hash/" "$scratch/requirements-offline.txt"
grep -q "^vllm==$version --hash=sha256:$hash" "$scratch/requirements-offline.txt" || die "could not pin vllm==$version"
# stage_wheels.py drops a fixed list of files and refuses a wheel without one of them: leave off what this one lacks
for so in $("$PY" - "$wheel" "$scratch/stage_wheels.py" <<'EOF'
import re, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
listed = re.findall(r'^\s+"(vllm/[^"]+)": ".*",$', open(sys.argv[2]).read(), re.M)
print(" ".join(n for n in listed if not n.endswith("/") and n not in names))
EOF
); do
    sed -i "\#^    \"$so\": #d" "$scratch/stage_wheels.py"
    echo "stage_vllm_gpu.sh: vllm $version has no $so: not dropped" >&2
done
sed -i "s/vllm 0\.33\.0 wheel/vllm $version wheel/" "$scratch/stage_wheels.py"
VLLMGPU_CACHE=$cache bash "$scratch/stage.sh" "$out" "$@"
