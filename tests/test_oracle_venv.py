"""tests/oracle_venv.sh, which the oracles' make_env.sh build their venvs with: a venv is built beside its folder and
renamed over it only when complete, so a failed or interrupted build leaves the previous venv; a derived venv is a
hard-linked copy whose rewritten paths never reach its base. Run with a stand-in ``python`` (its ``-m venv`` and
``-m pip install`` write what the real ones write: scripts whose shebang names the venv, ``activate``,
``pyvenv.cfg``), so no package is downloaded."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "oracle_venv.sh"

# `python -m venv DIR`: a venv whose bin/python records `-m pip install` (and fails where FAIL_PIP is set)
FAKE_PYTHON = r"""#!/usr/bin/env bash
set -eu
[ "$1 $2" = "-m venv" ] || exit 3
dir=$(realpath -m "$3")  # as the real one: the folder's canonical path, whatever path it was given
mkdir -p "$dir/bin"
printf 'home = /usr/bin\ncommand = python -m venv %s\n' "$dir" > "$dir/pyvenv.cfg"
printf "VIRTUAL_ENV='%s'\nexport VIRTUAL_ENV\n" "$dir" > "$dir/bin/activate"
cat > "$dir/bin/python" <<'PY'
#!/usr/bin/env bash
set -eu
here=$(cd "$(dirname "$0")" && pwd)
[ "$1 $2 $3" = "-m pip install" ] || exit 3
[ -z "${FAIL_PIP:-}" ] || exit 1
shift 3
{ cat "$here/../installed.txt" 2>/dev/null || true; echo "$*"; } > "$here/../installed.new"  # pip unlinks, never
mv "$here/../installed.new" "$here/../installed.txt"                                        # rewrites, files
printf '#!%s/python\nimport tool\n' "$here" > "$here/tool.new" && mv "$here/tool.new" "$here/tool"
PY
chmod +x "$dir/bin/python"
printf '#!%s/bin/python\nimport pip\n' "$dir" > "$dir/bin/pip"
"""


@pytest.fixture
def shell(tmp_path):
    """Runs bash lines with oracle_venv.sh sourced and the stand-in python first on PATH."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)

    def run(line: str, fail_pip: bool = False) -> subprocess.CompletedProcess:
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **({"FAIL_PIP": "1"} if fail_pip else {})}
        return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{SCRIPT}"; {line}'], env=env,
                              capture_output=True, text=True)  # fmt: skip

    return run


def requirements(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "requirements.txt"
    path.write_text(text)
    return path


def shebangs(venv: Path) -> set[str]:
    """The interpreter lines of the venv's scripts (its own bin/python is the interpreter)."""
    lines = {f.read_text().splitlines()[0] for f in (venv / "bin").iterdir() if f.name != "python"}
    return {line for line in lines if line.startswith("#!")}


@pytest.mark.parametrize("given", [".venv-x", "sub/../.venv-x"], ids=["plain", "dotdot"])
def test_build_renames_a_complete_venv_whose_paths_name_it(shell, tmp_path, given):
    """tests/sglang/make_env.sh names its venv tests/sglang/../../.venv-sglang: built all the same, its canonical path
    written in its files."""
    venv, req = tmp_path / ".venv-x", requirements(tmp_path, "six==1\n")
    (tmp_path / "sub").mkdir()
    done = shell(f'build_venv "{tmp_path / given}" "{req}" pkg==1')
    assert done.returncode == 0, done.stderr
    assert (venv / ".requirements.sha256").read_text().strip() == hashlib.sha256(req.read_bytes()).hexdigest()
    assert (venv / "installed.txt").read_text().splitlines() == [f"-q torch==2.13.0 -r {req}", "-q --no-deps pkg==1"]
    assert shebangs(venv) == {f"#!{venv}/bin/python"}
    assert f"VIRTUAL_ENV='{venv}'" in (venv / "bin" / "activate").read_text()
    assert f"-m venv {venv}\n" in (venv / "pyvenv.cfg").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv-x", "fakebin", "requirements.txt", "sub"]


def test_a_failed_rebuild_leaves_the_previous_venv(shell, tmp_path):
    venv, req = tmp_path / ".venv-x", requirements(tmp_path, "six==1\n")
    assert shell(f'build_venv "{venv}" "{req}" pkg==1').returncode == 0
    before = {p.relative_to(venv): p.read_bytes() for p in venv.rglob("*") if p.is_file()}
    req.write_text("six==2\n")
    failed = shell(f'build_venv "{venv}" "{req}" pkg==2', fail_pip=True)
    assert failed.returncode != 0 and "previous venv" in failed.stderr
    assert {p.relative_to(venv): p.read_bytes() for p in venv.rglob("*") if p.is_file()} == before
    assert not list(tmp_path.glob(".venv-x.*"))  # no staging folder left
    rebuilt = shell(f'build_venv "{venv}" "{req}" pkg==2')  # stale stamp: the next run builds
    assert rebuilt.returncode == 0 and "pkg==2" in (venv / "installed.txt").read_text()


def test_fresh_venv_is_kept_and_interrupted_stagings_are_removed(shell, tmp_path):
    venv, req = tmp_path / ".venv-x", requirements(tmp_path, "six==1\n")
    assert shell(f'build_venv "{venv}" "{req}" pkg==1').returncode == 0
    installed = (venv / "installed.txt").read_text()
    assert shell(f'PATH=/usr/bin:/bin build_venv "{venv}" "{req}" pkg==1').returncode == 0  # no python needed
    assert (venv / "installed.txt").read_text() == installed
    (tmp_path / ".venv-x.building-12345" / "bin").mkdir(parents=True)  # what a killed run leaves
    req.write_text("six==2\n")
    assert shell(f'build_venv "{venv}" "{req}" pkg==2').returncode == 0
    assert not list(tmp_path.glob(".venv-x.*"))


def test_derive_rewrites_its_own_copies_of_the_base_files(shell, tmp_path):
    """The derived venv's name starts with the base's (.venv-x-2 beside .venv-x, as .venv-vllm-0.34 beside
    .venv-vllm): its paths are rewritten, the base's hard-linked files are not."""
    base, derived, req = tmp_path / ".venv-x", tmp_path / ".venv-x-2", requirements(tmp_path, "six==1\n")
    assert shell(f'build_venv "{base}" "{req}" pkg==1').returncode == 0
    base_files = {p.relative_to(base): p.read_bytes() for p in base.rglob("*") if p.is_file()}
    done = shell(f'derive_venv "{base}" "{derived}" stamp-2 pkg==2')
    assert done.returncode == 0, done.stderr
    assert {p.relative_to(base): p.read_bytes() for p in base.rglob("*") if p.is_file()} == base_files
    assert shebangs(derived) == {f"#!{derived}/bin/python"}
    assert f"VIRTUAL_ENV='{derived}'" in (derived / "bin" / "activate").read_text()
    assert (derived / ".requirements.sha256").read_text().strip() == "stamp-2"
    assert (derived / "installed.txt").read_text().splitlines()[-1] == "-q --no-deps --force-reinstall pkg==2"
    failed = shell(f'derive_venv "{base}" "{derived}" stamp-3 pkg==3', fail_pip=True)
    assert failed.returncode == 1 and (derived / ".requirements.sha256").read_text().strip() == "stamp-2"
    assert not list(tmp_path.glob(".venv-x-2.*"))
