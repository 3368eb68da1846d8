"""The CLI starts without torch, and Ctrl-C at any moment of its start is one line and exit code 130.

Guards issue 26: ``--version`` took 3-4 s and ``--help`` 7 s because torch was imported before any command ran,
and a Ctrl-C during those imports printed a 12-line traceback. Each check runs the real entry point in a fresh
interpreter, so nothing this test process imported can hide an import.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repack import __version__
from repack.errors import RepackError
from repack.targets import TARGETS, resolve_family
from repack.targets.moe import moe_layout

ROOT = Path(__file__).resolve().parents[1]


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _imported_modules(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime -m repack.cli ARGV``; the modules the interpreter imported, by name."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "repack.cli", *argv], capture_output=True,
                         text=True, env=_child_env(), cwd=ROOT, timeout=120)
    modules = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    return run, modules


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["targets"], ["targets", "--json"], ["convert", "--help"],
                                  ["verify", "--help"], ["inspect", "--help"]], ids=" ".join)
def test_help_version_and_targets_never_import_torch(argv):
    run, modules = _imported_modules(argv)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "repack.cli.app" in modules  # the importtime listing really covers the CLI's imports
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "numpy", "safetensors", "flashinfer", "triton"))
    assert not heavy, f"{' '.join(argv)} imported {heavy[:5]}"


def _moe_layouts(family: str) -> dict[str, str]:
    """Per checkpoint scheme, the MoE layout module convert picks on ``family`` (none where it refuses MoE)."""
    out = {}
    for scheme in ("W4A4", "W4A16"):
        with contextlib.suppress(RepackError):
            out[scheme] = moe_layout(family, scheme).LAYOUT_ID
    return out


SGLANG_BLACKWELL = "W4A4, W4A16; MoE: FlashInfer (W4A4), FP4 Marlin (compressed-tensors weight-only)"


def test_targets_lists_the_capability_table_without_the_layouts():
    """``targets`` reads the table's torch-free rows: they are the very facts the layouts' Targets carry."""
    run = subprocess.run([sys.executable, "-m", "repack.cli", "targets", "--json"], capture_output=True, text=True,
                         env=_child_env(), cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    # per scheme, the layout vLLM's auto holds (sm120: Marlin's for W4A16; its cute-dsl one is --linear-backend's);
    # the family's backend: its FP4 layouts' (Marlin's runs on the reference backend)
    auto = [{scheme: t.for_scheme(scheme) for scheme in ("W4A16", "W4A4") if t.for_scheme(scheme).scheme == scheme}
            for t in TARGETS]
    expected = [{"name": t.name, "aliases": list(t.aliases),
                 "compute_capabilities": [f"{major}.{minor}" for major, minor in t.compute_capabilities],
                 "backend": resolve_family(t.name).backend, "layout_id": t.layout_id,
                 "layouts": {scheme: {"layout_id": layout.layout_id, "kernels": list(layout.kernels),
                                      "engines": {"vllm": ["0.33", "0.34"]}} for scheme, layout in layouts.items()},
                 "moe_layouts": _moe_layouts(t.name),
                 "sglang": None if t.name == "sm75" else {  # convert --engine sglang (audit: --json did not say)
                     "version": "0.5.23", "serves": SGLANG_BLACKWELL if t.name in ("sm100", "sm120")
                     else "weight-only: Marlin; MoE: FP4 Marlin"},
                 "description": t.description}
                for t, layouts in zip(TARGETS, auto)]
    assert json.loads(run.stdout) == expected


# A real SIGINT, sent to the child by itself when it is about to import MODULE (so always at the same point).
# SIGINT's default handler is restored first: a child started from a background job inherits "ignore SIGINT".
_INTERRUPT_DURING_IMPORT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)

class InterruptAt:
    def find_spec(self, name, path=None, target=None):
        if name == module:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAt())
module, sys.argv = sys.argv[1], ["nvfp4-repack", *sys.argv[2:]]
from repack.cli import run
run()
"""


@pytest.mark.parametrize("module, argv", [
    ("typer", ["--help"]),                                  # while the CLI imports its commands
    ("rich.table", ["targets"]),
    ("typer.rich_utils", ["--help"]),  # inside Typer's own parsing: it turned the Ctrl-C into a silent 130 (issue 38)
    ("torch", ["convert", "--sample", "-t", "sm100", "-o", "{out}"]),  # while a command imports what it needs
], ids=["typer", "rich", "typer-parsing", "torch-in-convert"])
def test_ctrl_c_during_startup_is_one_line_and_exit_130(tmp_path, module, argv):
    out = tmp_path / "out"
    argv = [a.format(out=out) for a in argv]
    run = subprocess.run([sys.executable, "-c", _INTERRUPT_DURING_IMPORT, module, *argv], capture_output=True,
                         text=True, env=_child_env(), cwd=tmp_path, timeout=120)
    assert (run.returncode, run.stderr) == (130, "Interrupted.\n"), run.stderr[-2000:]
    assert run.stdout == ""
    assert sorted(tmp_path.iterdir()) == []  # nothing written


# A real SIGINT at the tool's own moments outside main(): between the console script's import of repack.cli and its
# call of run() (pip's script runs `from repack.cli import run` first), and in run()'s exit after main() returned.
_INTERRUPT_AROUND_MAIN = """
import gc, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv = ["nvfp4-repack", "--version"]
from repack.cli import run
if WHERE == "before":
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
gc.freeze = lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5))
run()
"""


@pytest.mark.parametrize("where", ["before", "after"])
def test_ctrl_c_around_main_is_one_line_and_exit_130(tmp_path, where):
    """Regression (issue 38): a Ctrl-C once the tool's code runs but outside main()'s handler printed Python's
    traceback. The SIGINT handler the entry point installs first answers there (what comes before it, the
    interpreter's own start, is CPython's: docs/usage.md)."""
    code = _INTERRUPT_AROUND_MAIN.replace("WHERE", repr(where))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_child_env(), cwd=tmp_path,
                         timeout=120)
    assert (run.returncode, run.stderr) == (130, "Interrupted.\n"), run.stderr[-2000:]
    assert run.stdout == ("" if where == "before" else f"nvfp4-repack {__version__}\n")
