"""scripts/flashinfer_sources.py: how FLASHINFER_CHECKED's releases are compared (docs/testing.md, FlashInfer 0.7.3).
On two stand-in packages: a function held the same, one that differs, one that is missing, a CUDA kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "flashinfer_sources.py"


def package(root: Path, shuffle_body: str, kernel_body: str) -> Path:
    (root / "flashinfer" / "gemm").mkdir(parents=True)
    (root / "flashinfer" / "__init__.py").write_text("")
    (root / "flashinfer" / "gemm" / "prep.py").write_text(
        f"def _e4m3_to_s0e5m3(x):\n    return x >> 7\n\n\ndef shuffle_matrix_a(x):\n    return {shuffle_body}\n")
    (root / "flashinfer" / "quant.cu").write_text(
        "template <typename T>\n__global__ void block_scale_interleave_kernel(int n, T const* in) {\n"
        f"  if (n) {{ {kernel_body} }}\n}}\n")
    return root


def run(*roots: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, roots)], capture_output=True, text=True)


def test_same_code_in_both_releases_is_reported_identical(tmp_path):
    a = package(tmp_path / "a", "x[::-1]", "out[n] = in[n];")
    b = package(tmp_path / "b", "x[::-1]", "out[n] = in[n];")
    lines = run(a, b).stdout.splitlines()
    assert "_e4m3_to_s0e5m3: identical (gemm/prep.py)" in lines
    assert "shuffle_matrix_a: identical (gemm/prep.py)" in lines
    assert "block_scale_interleave_kernel: identical (quant.cu)" in lines
    assert "convert_sf_to_mma_layout: in none of them" in lines  # not in these stand-ins: exit 1


def test_a_changed_function_or_kernel_is_shown_with_its_difference(tmp_path):
    a = package(tmp_path / "a", "x[::-1]", "out[n] = in[n];")
    b = package(tmp_path / "b", "x[::2]", "out[n] = in[n + 1];")
    done = run(a, b)
    assert done.returncode == 1
    assert "shuffle_matrix_a: DIFFERS (gemm/prep.py)" in done.stdout and "+    return x[::2]" in done.stdout
    assert "block_scale_interleave_kernel: DIFFERS (quant.cu)" in done.stdout and "in[n + 1]" in done.stdout
    assert "_e4m3_to_s0e5m3: identical (gemm/prep.py)" in done.stdout
    assert run(a, tmp_path / "missing").returncode == 2
