"""--resume: after Ctrl-C or kill -9, the finished shards are kept, the rest is redone, and the bundle is
byte-identical to one from an uninterrupted convert."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest
import torch

import repack.convert
from repack.cli import main
from repack.convert import convert
from repack.errors import Interrupted
from repack.formats import SourceModel
from repack.sample.synthetic import random_nvfp4, write_checkpoint

from .test_atomicity import tree_digest

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(256, 512)] * 8


def make_checkpoint(root: Path, seed: int, shapes=SHAPES) -> Path:
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    layers = {f"model.layers.{i}.mlp.proj": random_nvfp4(n, k, gen) for i, (n, k) in enumerate(shapes)}
    plain = {"model.embed_tokens.weight": torch.randn(64, 16, generator=gen).to(torch.bfloat16)}
    write_checkpoint(root, layers, plain, fmt="modelopt", shards=2, config={"model_type": "llama"})
    return root


@pytest.fixture
def source(tmp_path):
    return make_checkpoint(tmp_path / "model", seed=int(torch.randint(0, 2**31, ())))


def interrupt_after(monkeypatch, layers: int) -> None:
    """Ctrl-C on the converting thread once ``layers`` layers have been handed to the writers."""
    real = repack.convert._Writing.take_layer
    seen = []

    def take(self, layer, weight):
        if len(seen) == layers:
            raise KeyboardInterrupt
        seen.append(layer.prefix)
        real(self, layer, weight)

    monkeypatch.setattr(repack.convert._Writing, "take_layer", take)


def staging(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.partial-*"))


@pytest.mark.parametrize("targets", ["sm120", ["sm100", "sm90"]], ids=["one", "two"])
def test_ctrl_c_then_resume_keeps_finished_shards_and_matches_a_clean_run(source, tmp_path, monkeypatch, targets):
    reference = tmp_path / "reference"
    convert(source, targets, reference, max_shard_size="200KB")
    out = tmp_path / "out"
    interrupt_after(monkeypatch, layers=5)
    with pytest.raises(Interrupted) as caught:
        convert(source, targets, out, max_shard_size="200KB")
    kept = [done for _, _, done, _ in caught.value.kept]
    assert all(done >= 1 for done in kept), caught.value.kept
    bundles = [out] if isinstance(targets, str) else [out / t for t in targets]
    assert not out.exists() and len(staging(out)) == 1, "no OUT yet (issue 38: not even an empty one), one staging folder"
    folders = [staging(out)[0] / b.relative_to(out) for b in bundles]  # several targets: <target> inside it
    monkeypatch.undo()
    finished = {}  # a kept shard's place in OUT -> its time in the staging folder
    for bundle, folder in zip(bundles, folders):  # the journal records each finished shard's BLAKE3
        journal = json.loads((folder / ".nvfp4-repack-resume.json").read_text())
        assert journal["shards"] and {name: shard["digest"] for name, shard in journal["shards"].items()} == \
            {name: blake3.blake3((folder / name).read_bytes()).hexdigest() for name in journal["shards"]}
        finished.update({bundle / name: (folder / name).stat().st_mtime_ns for name in journal["shards"]})
    reads = []
    real = SourceModel.load_layer
    monkeypatch.setattr(SourceModel, "load_layer",
                        lambda self, layer, *read: reads.append(layer.prefix) or real(self, layer, *read))
    result = convert(source, targets, out, max_shard_size="200KB", resume=True)
    summaries = result if isinstance(result, list) else [result]
    assert [s.kept_shards for s in summaries] == kept
    assert len(reads) < len(SHAPES), "layers of kept shards are not read again"
    for bundle in bundles:
        assert tree_digest(bundle) == tree_digest(reference / bundle.name if bundle != out else reference)
    assert staging(out) == [] and hidden(tmp_path) == []
    assert {path: path.stat().st_mtime_ns for path in finished} == finished  # kept, not written again
    assert tree_digest(out) == tree_digest(reference)  # the output record too


def test_resume_keeps_nothing_when_the_source_changed(tmp_path, monkeypatch):
    first = make_checkpoint(tmp_path / "model", seed=11)
    out = tmp_path / "out"
    interrupt_after(monkeypatch, layers=6)
    with pytest.raises(Interrupted):
        convert(first, "sm100", out, max_shard_size="200KB")
    monkeypatch.undo()
    changed = make_checkpoint(tmp_path / "model-changed", seed=12)
    for file in changed.iterdir():  # the same folder, new contents
        (first / file.name).write_bytes(file.read_bytes())
    summary = convert(first, "sm100", out, max_shard_size="200KB", resume=True)
    assert summary.kept_shards == 0
    convert(changed, "sm100", tmp_path / "reference", max_shard_size="200KB")
    digests = tree_digest(out)
    reference = tree_digest(tmp_path / "reference")
    assert {k: v for k, v in digests.items() if k != "manifest.json"} == \
        {k: v for k, v in reference.items() if k != "manifest.json"}


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*"))


def test_a_run_without_resume_removes_what_an_interrupted_one_left(source, tmp_path, monkeypatch, capsys):
    """Regression (issue 26): Ctrl-C, then the same command without --resume, left the interrupted run's staging
    folder (its finished shards) behind for good. The next convert removes it and says so in one line; the
    Ctrl-C line says that it will."""
    out = tmp_path / "out"
    argv = ["convert", str(source), "-t", "sm100", "-o", str(out), "--max-shard-size", "200KB"]
    with monkeypatch.context() as patch:
        interrupt_after(patch, layers=6)
        assert main(argv) == 130
    assert "without it, the next convert removes them" in capsys.readouterr().err
    left = staging(out)
    assert len(left) == 1
    size = sum(f.stat().st_size for f in left[0].iterdir()) / 1e6
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err == (f"{out}: removed 1 hidden folder(s) that interrupted converts left ({size:.1f} MB); a run with "
                   "--resume would have continued from them\n")
    assert hidden(tmp_path) == []


def test_a_resume_whose_plan_changed_discards_the_old_staging(source, tmp_path, monkeypatch):
    """Regression (issue 26): --resume with another plan (here: another shard size) started afresh and left the
    old staging folder behind."""
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        interrupt_after(patch, layers=6)
        with pytest.raises(Interrupted):
            convert(source, "sm100", out, max_shard_size="200KB")
    notices = []
    summary = convert(source, "sm100", out, max_shard_size="300KB", resume=True, notify=notices.append)
    assert summary.kept_shards == 0 and hidden(tmp_path) == []
    assert len(notices) == 1 and "--resume found no finished shard of this run's plan and source in them" in notices[0]


@pytest.mark.parametrize("layers", [1, 5], ids=["nothing finished", "shards finished"])
@pytest.mark.parametrize("again", [["sm100", "sm120", "sm90"], ["sm100", "sm90"]], ids=["same targets", "fewer targets"])
def test_interrupted_several_targets_leave_nothing_after_the_next_run(source, tmp_path, monkeypatch, again, layers):
    """Regression (issues 26, 38): ``-t all``, Ctrl-C (before any target finished a shard, or after), then
    ``--resume`` with the same or fewer targets: the interrupted run left no OUT (it left a visible, seemingly empty
    one) but one hidden staging folder, which the next run reuses or removes, saying so in words that fit a
    --resume run (it said "a run with --resume would have continued"); a staging folder a running convert holds
    is left alone."""
    from repack.bundle.manifest import OUTPUT_RECORD
    from repack.bundle.writer import _lock

    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        interrupt_after(patch, layers=layers)
        with pytest.raises(Interrupted):
            convert(source, ["sm100", "sm120", "sm90"], out, max_shard_size="200KB")
    assert not out.exists() and len(staging(out)) == 1
    assert sorted(p.name for p in staging(out)[0].iterdir()) == ["sm100", "sm120", "sm90"]
    busy = tmp_path / ".out.partial-0123abcd"  # as if another convert were writing it right now
    busy.mkdir()
    lock = _lock(busy)
    notices = []
    try:
        convert(source, again, out, max_shard_size="200KB", resume=True, notify=notices.append)
        assert hidden(tmp_path) == [busy.name]
    finally:
        os.close(lock)
    assert sorted(p.name for p in out.iterdir()) == sorted([*again, OUTPUT_RECORD])
    if layers == 1:  # no journal: nothing to resume
        assert len(notices) == 1 and notices[0].startswith(f"{out}: removed 1 hidden folder(s)"), notices
        assert notices[0].endswith("; --resume found no finished shard of this run's plan and source in them"), notices
    elif again != ["sm100", "sm120", "sm90"]:
        assert len(notices) == 1 and notices[0].startswith(f"{out}: removed what the interrupted convert left for "
                                                            "sm120 ("), notices
        assert notices[0].endswith("); this run does not write sm120"), notices
    else:
        assert notices == []
    notices.clear()
    convert(source, again, out, max_shard_size="200KB", overwrite=True, notify=notices.append)
    assert hidden(tmp_path) == []
    assert len(notices) == 1 and notices[0].startswith(f"{out}: removed 1 hidden folder(s)"), notices
    assert notices[0].endswith(f"; a run with --resume would have continued from them while {out} did not exist")


def test_several_targets_into_an_existing_output_are_staged_inside_it(source, tmp_path, monkeypatch):
    """An output that already holds bundles gets new ones beside them, each staged inside it; the next run removes
    the staging folder of a target it does not write, in words that say why."""
    out = tmp_path / "out"
    convert(source, ["sm100", "sm120"], out, max_shard_size="200KB")
    with monkeypatch.context() as patch:
        interrupt_after(patch, layers=5)
        with pytest.raises(Interrupted):
            convert(source, ["sm90", "sm100"], out, max_shard_size="200KB", overwrite=True)
    assert [len(staging(out / t)) for t in ("sm90", "sm100")] == [1, 1]
    notices = []
    convert(source, ["sm90", "sm120"], out, max_shard_size="200KB", resume=True, overwrite=True, notify=notices.append)
    assert sorted(p.name for p in out.iterdir()) == ["nvfp4-repack-output.json", "sm100", "sm120", "sm90"]
    assert hidden(tmp_path) == []
    assert len(notices) == 1 and notices[0].startswith(f"{out / 'sm100'}: removed 1 hidden folder(s)"), notices
    assert notices[0].endswith("; this run does not write that target"), notices


def test_a_damaged_kept_shard_is_written_again(source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    interrupt_after(monkeypatch, layers=6)
    with pytest.raises(Interrupted) as caught:
        convert(source, "sm100", out, max_shard_size="200KB")
    monkeypatch.undo()
    folder = caught.value.kept[0][1]
    shards = sorted(folder.glob("*.safetensors"))
    data = bytearray(shards[0].read_bytes())
    data[-1] ^= 0xFF
    shards[0].write_bytes(bytes(data))
    summary = convert(source, "sm100", out, max_shard_size="200KB", resume=True)
    assert summary.kept_shards == caught.value.kept[0][2] - 1
    convert(source, "sm100", tmp_path / "reference", max_shard_size="200KB")
    assert tree_digest(out) == tree_digest(tmp_path / "reference")


def default_sigint() -> None:
    """A child's SIGINT as in a terminal, however pytest was started: a shell starts background jobs (``cmd &``,
    nohup, CI runners) with SIGINT ignored, the child inherits that, and Python then installs no Ctrl-C handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli_process(argv, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "repack.cli", *map(str, argv)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)


def wait_for_a_finished_shard(out: Path, process, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if any((p / ".nvfp4-repack-resume.json").exists() for f in staging(out) for p in (f, *f.glob("sm*"))):
            return
        time.sleep(0.002)
    raise AssertionError("the convert finished no shard before the deadline")


@pytest.mark.parametrize("how,flags,targets", [
    (signal.SIGINT, [], ["sm120"]), (signal.SIGKILL, [], ["sm120"]), (signal.SIGKILL, ["--no-fsync"], ["sm120"]),
    (signal.SIGKILL, [], ["sm120", "sm90"]),  # several targets: no OUT either (issue 38), one staging folder
], ids=["ctrl-c", "kill-9", "kill-9-no-fsync", "kill-9-two-targets"])
def test_real_interrupt_then_resume_on_the_cli(tmp_path, how, flags, targets, capsys):
    """Also without fsync: a killed process's writes are in the page cache, so its finished shards are kept."""
    source = make_checkpoint(tmp_path / "model", seed=5, shapes=[(1024, 2048)] * 24)
    argv = ["convert", source, *(a for t in targets for a in ("-t", t)), "-o", tmp_path / "out", "--max-shard-size",
            "1MB", *flags]
    process = run_cli_process(argv, tmp_path)
    wait_for_a_finished_shard(tmp_path / "out", process)
    process.send_signal(how)
    _, err = process.communicate(timeout=60)
    if how == signal.SIGINT:
        assert process.returncode == 130
        assert err.count("\n") == 1 and err.startswith("Interrupted: ") and "--resume" in err, err
        assert "shards of" in err and "kept" in err
    else:
        assert process.returncode == -signal.SIGKILL
    assert not (tmp_path / "out").exists()
    capsys.readouterr()
    assert main([str(a) for a in argv + ["--resume"]]) == 0
    assert re.search(r"\d+ shards? kept from the interrupted run", " ".join(capsys.readouterr().out.split()))  # wrapped
    convert(source, targets if len(targets) > 1 else targets[0], tmp_path / "reference", max_shard_size="1MB")
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "reference")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_ctrl_c_during_a_tp_convert_keeps_nothing_and_says_so_once(tmp_path, monkeypatch, capsys):
    """--resume does not cover --tp, so an interrupted --tp convert leaves no staging folder behind, and its one
    line names OUT once (not once per rank) and offers no --resume."""
    from repack.sample.synthetic import write_llama

    root = write_llama(tmp_path / "m", "modelopt", hidden=96, heads=6, kv_heads=2, intermediate=96,
                       generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))))
    out = tmp_path / "out"
    interrupt_after(monkeypatch, layers=3)
    assert main(["convert", str(root), "-t", "sm100", "--tp", "2", "-o", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].count(str(out)) == 1 and "--resume to continue" not in err[0], err
    assert "nothing of" in err[0]
    assert not out.exists() and staging(out) == []
