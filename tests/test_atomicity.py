"""Atomicity under faults: ``kill -9`` a convert anywhere and OUT is absent or a complete, verified bundle.

Three angles:

* the real CLI (``python -m repack.cli convert``) killed while it writes;
* convert processes forked from a preloaded forkserver (so a kill costs no interpreter start-up) and
  SIGKILLed at seeded random delays spread over the measured duration of a convert, with and without
  ``--overwrite`` over an existing bundle;
* fault injection: the process kills itself right before or right after each file-system step of the
  final install (fsync, rename/exchange, deletion of the old bundle), on the Linux ``renameat2`` path and on
  the portable two-rename fallback (where the next convert's :func:`recover_interrupted` must bring the old
  bundle back).

"Complete" is checked two ways: OUT's files are byte-for-byte those of a reference bundle written by an
uninterrupted convert, and that reference passes ``verify_bundle`` (so OUT does too); any OUT state not
seen before is verified itself.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from repack.bundle.manifest import read_manifest
from repack.bundle.writer import recover_interrupted
from repack.convert import convert
from repack.sample.synthetic import random_nvfp4, write_checkpoint
from repack.verify import verify_bundle

from . import _killable

REPO = Path(__file__).resolve().parent.parent
BIG_SHAPES = [(2048, 4096)] * 6  # ~1 s of convert on a laptop core; long enough to land kills mid-write


def _forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "repack.cli", "repack.cli.commands", "repack.convert", "repack.sample",
                                "tests._killable"])
    return ctx


# --- helpers ----------------------------------------------------------------------------------------------------


def make_checkpoint(root: Path, shapes, seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    layers = {f"model.layers.{i}.mlp.proj": random_nvfp4(n, k, gen) for i, (n, k) in enumerate(shapes)}
    plain = {"model.embed_tokens.weight": torch.randn(64, 16, generator=gen).to(torch.bfloat16)}
    write_checkpoint(root, layers, plain, fmt="compressed-tensors", shards=2, config={"model_type": "llama"})
    (root / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    return root


def tree_digest(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every entry, symlinks and folders included (a partial bundle differs)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink() or not path.is_file():
            out[rel] = "link" if path.is_symlink() else "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class Oracle:
    """Complete bundles: reference digests, each verified once; any new complete-looking state is verified too."""

    def __init__(self) -> None:
        self.complete: dict[str, str] = {}  # frozen digest -> label

    def add_reference(self, folder: Path, label: str) -> None:
        report = verify_bundle(folder)
        assert report.passed, [e for c in report.failures for e in c.errors]
        self.complete[repr(tree_digest(folder))] = label

    def check(self, out: Path, allowed: set[str], context: str) -> str:
        """The label of the complete bundle at ``out``; fails if it is anything else."""
        assert out.is_dir() and not out.is_symlink(), f"{context}: OUT missing"
        key = repr(tree_digest(out))
        label = self.complete.get(key)
        if label is None:  # not byte-identical to a reference: it must still be a complete, verified bundle
            read_manifest(out)
            report = verify_bundle(out)
            errors = [e for c in report.failures for e in c.errors]
            assert report.passed, f"{context}: OUT is partial or wrong: {errors}"
            label = "verified"
            self.complete[key] = label
        assert label in allowed | {"verified"}, f"{context}: OUT is {label}, expected one of {allowed}"
        return label


def hidden_leftovers(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def clean_leftovers(out: Path) -> None:
    for path in hidden_leftovers(out):
        shutil.rmtree(path)


def assert_no_visible_garbage(parent: Path, expected: set[str]) -> None:
    visible = {p.name for p in parent.iterdir() if not p.name.startswith(".")}
    assert visible <= expected, visible - expected


def run_forked(ctx, argv, step=None, fallback=False):
    process = ctx.Process(target=_killable.child, args=([str(a) for a in argv], step, fallback))
    process.start()
    return process


def wait_for_staging(out: Path, process, timeout: float = 60.0) -> float:
    """Block until the convert has created its staging folder (it is writing); return that moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.startswith(f".{out.name}.partial-") for p in out.parent.iterdir()):
            return time.monotonic()
        if not process.is_alive():
            return time.monotonic()
        time.sleep(0.001)
    raise AssertionError("convert never started writing")


def kill(process) -> None:
    if process.is_alive():
        os.kill(process.pid, signal.SIGKILL)
    process.join(30)


# --- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A checkpoint that takes about a second to convert, its reference bundles, and the oracle."""
    base = tmp_path_factory.mktemp("atomicity")
    source = make_checkpoint(base / "model", BIG_SHAPES, seed=1)
    other = make_checkpoint(base / "other-model", BIG_SHAPES[:2], seed=2)
    oracle = Oracle()
    convert(source, "sm120", base / "ref-new")
    oracle.add_reference(base / "ref-new", "new")
    convert(other, "sm120", base / "ref-old")
    oracle.add_reference(base / "ref-old", "old")
    ctx = _forkserver()
    # Measure an uninterrupted convert the way the kills will see it: from the staging folder to the exit. The
    # fastest of two: the first forked convert can take twice as long as the later ones (warm caches), and kills
    # timed by it would all land after the convert ended.
    durations = []
    for attempt in range(2):
        out = base / f"timing-{attempt}" / "out"
        out.parent.mkdir()
        process = run_forked(ctx, ["convert", source, "-t", "sm120", "-o", out])
        began = wait_for_staging(out, process)
        process.join(60)
        durations.append(time.monotonic() - began)
        assert process.exitcode == 0 and tree_digest(out) == tree_digest(base / "ref-new")
    return {"base": base, "source": source, "oracle": oracle, "ctx": ctx, "duration": min(durations)}


def kill_delays(duration: float, seed: int, count: int) -> list[float]:
    rng = random.Random(seed)
    fixed = [0.0, duration * 0.5, duration * 0.9, duration * 0.99, duration * 1.2, duration * 3 + 0.5]  # last: done
    return fixed + [rng.uniform(0, duration * 1.05) for _ in range(count)]


# --- the tests --------------------------------------------------------------------------------------------------


def test_killed_cli_leaves_nothing_or_a_complete_bundle(big, tmp_path):
    """The real CLI in its own interpreter, SIGKILLed mid-write, then once more near its end."""
    for attempt, fraction in enumerate((0.3, 0.97)):
        out = tmp_path / f"out{attempt}"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        process = subprocess.Popen(
            [sys.executable, "-m", "repack.cli", "convert", str(big["source"]), "-t", "sm120", "-o", str(out)],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while process.poll() is None and not hidden_leftovers(out) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(big["duration"] * fraction)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
        if out.exists():
            big["oracle"].check(out, {"new"}, f"CLI kill at {fraction:.0%}")
        assert_no_visible_garbage(tmp_path, {f"out{i}" for i in range(2)})


def test_random_kills_of_a_new_convert(big, tmp_path):
    out = tmp_path / "out"
    outcomes = []
    for delay in kill_delays(big["duration"], seed=20241129, count=5):
        process = run_forked(big["ctx"], ["convert", big["source"], "-t", "sm120", "-o", out])
        wait_for_staging(out, process)
        time.sleep(delay)
        kill(process)
        if out.exists() or out.is_symlink():
            outcomes.append(big["oracle"].check(out, {"new"}, f"kill after {delay:.3f} s"))
            shutil.rmtree(out)
        else:
            written = sum(f.stat().st_size for d in hidden_leftovers(out) for f in d.rglob("*.safetensors"))
            outcomes.append("absent, mid-write" if written else "absent")
        assert_no_visible_garbage(tmp_path, set())
        clean_leftovers(out)
    assert "absent, mid-write" in outcomes, f"no kill landed mid-write ({outcomes}, convert {big['duration']:.2f} s)"
    assert "new" in outcomes, f"no convert finished ({outcomes}, convert {big['duration']:.2f} s)"


def test_random_kills_of_an_overwrite(big, tmp_path):
    """--overwrite over a complete old bundle: after any kill OUT is the old bundle or the new one."""
    out = tmp_path / "out"
    outcomes = []
    for delay in kill_delays(big["duration"], seed=7, count=5):
        shutil.copytree(big["base"] / "ref-old", out)
        process = run_forked(big["ctx"], ["convert", big["source"], "-t", "sm120", "-o", out, "--overwrite"])
        wait_for_staging(out, process)
        time.sleep(delay)
        kill(process)
        outcomes.append(big["oracle"].check(out, {"old", "new"}, f"kill after {delay:.3f} s"))
        shutil.rmtree(out)
        clean_leftovers(out)
        assert_no_visible_garbage(tmp_path, set())
    assert {"old", "new"} <= set(outcomes), f"kills did not span the convert ({outcomes}, {big['duration']:.2f} s)"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    source = make_checkpoint(base / "model", [(32, 64), (64, 128)], seed=3)
    other = make_checkpoint(base / "other-model", [(16, 32)], seed=4)
    oracle = Oracle()
    convert(source, "sm100", base / "ref-new")
    oracle.add_reference(base / "ref-new", "new")
    convert(other, "sm100", base / "ref-old")
    oracle.add_reference(base / "ref-old", "old")
    return {"base": base, "source": source, "oracle": oracle, "ctx": _forkserver()}


@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "two-renames"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_kill_at_every_install_step(tiny, tmp_path, fallback, overwrite):
    """SIGKILL right before and right after each fsync / rename / exchange / delete of the install."""
    out = tmp_path / "out"
    argv = ["convert", tiny["source"], "-t", "sm100", "-o", out] + ["--overwrite"] * overwrite
    seen = set()
    for step in range(100):
        if overwrite:
            shutil.copytree(tiny["base"] / "ref-old", out)
        process = run_forked(tiny["ctx"], argv, step=step, fallback=fallback)
        process.join(60)
        finished = process.exitcode == 0
        assert finished or process.exitcode == -signal.SIGKILL, process.exitcode
        context = f"kill at step {step} ({'fallback' if fallback else 'renameat2'})"
        if overwrite and not out.exists():
            # Only the fallback has this window; the next convert (or recover_interrupted) restores the old bundle.
            assert fallback, f"{context}: OUT missing although renameat2 exchanges atomically"
            assert recover_interrupted(out) == out, f"{context}: OUT missing and not recoverable"
            seen.add("recovered")
        if out.exists():
            seen.add(tiny["oracle"].check(out, {"old", "new"} if overwrite else {"new"}, context))
            shutil.rmtree(out)
        else:
            seen.add("absent")
        clean_leftovers(out)
        assert_no_visible_garbage(tmp_path, set())
        if finished:
            break
    else:
        raise AssertionError("the convert never finished: more kill points than expected")
    assert step >= 4, "fault injection did not reach the install"
    assert "new" in seen and ("old" in seen if overwrite else "absent" in seen)
    if fallback and overwrite:
        assert "recovered" in seen, "the two-rename window was never hit"


def test_next_convert_recovers_an_interrupted_fallback_replace(tiny, tmp_path, capsys):
    """The state a kill between the fallback's two renames leaves: the next convert restores, then refuses."""
    from repack.cli import main

    out = tmp_path / "out"
    shutil.copytree(tiny["base"] / "ref-old", tmp_path / ".out.old-deadbeef")
    shutil.copytree(tiny["base"] / "ref-new", tmp_path / ".out.partial-cafef00d")  # complete but never renamed
    assert main(["convert", str(tiny["source"]), "-t", "sm100", "-o", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert tiny["oracle"].check(out, {"old"}, "after recovery") == "old"
