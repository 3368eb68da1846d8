"""The SGLang plugin's packaging: its entry point is the register function, and nothing but the plugin imports SGLang
(its state and refusals: tests/test_sglang_conformance.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_entry_point_is_the_register_function_and_the_core_never_imports_sglang():
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    module, _, name = entry["nvfp4_repack"].partition(":")
    code = (f"import sys, repack.cli, repack.convert, repack.verify, repack.runtime, repack.targets.sglang, {module}; "
            f"assert callable({module}.{name}); assert 'sglang' not in sys.modules, 'imported sglang'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
