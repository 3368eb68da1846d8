"""The vLLM loader plugin's checks (tests/vllm/plugin_checks.py), run in the vLLM env from the project's suite.

They need vLLM itself in-process (the plugin is vLLM code), so they run as one pytest session in each of
tests/vllm/make_env.sh's envs (vLLM 0.33 and 0.34, FlashInfer 0.7.2.post1); in CI a missing env fails.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .conftest import assert_plugin_entry_point
from .test_vllm_conformance import HERE, _vllm_python

ROOT = Path(__file__).resolve().parents[1]


def test_vllm_plugin_checks_pass_in_the_vllm_env(vllm_version):
    """Once per supported vLLM version, in its own oracle env: the plugin loads into exactly that version's state."""
    python = _vllm_python(vllm_version)
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "plugin_checks.py")],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_entry_point_is_the_register_function_and_the_core_never_imports_vllm():
    assert_plugin_entry_point("vllm.general_plugins", "vllm")
