"""convert and verify as a CI step: several targets in one pass, Hub repo ids from an offline cache, verify as a
gate, and the CLI's conventions. Checkpoints are fresh random ones (their seeds are printed by make_model's
callers here, or fixed)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from repack.bundle.manifest import OUTPUT_RECORD
from repack.cli import main
from repack.convert import convert
from repack.errors import RepackError
from repack.formats import SourceModel
from repack.targets import TARGETS
from repack.targets.families import FAMILIES

from .test_convert import check_bundle_against_source

REPO = Path(__file__).resolve().parent.parent


def fresh_seed() -> int:
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed {seed}")
    return seed


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# --- several targets in one pass ------------------------------------------------------------------------------------


def test_all_targets_in_one_pass_read_each_layer_once(make_model, tmp_path, monkeypatch):
    model = make_model("modelopt", shards=2, seed=fresh_seed())
    reads = []
    real = SourceModel.load_layer
    monkeypatch.setattr(SourceModel, "load_layer",
                        lambda self, layer, *read: reads.append(layer.prefix) or real(self, layer, *read))
    summaries = convert(model.path, "all", tmp_path / "out")
    assert sorted(reads) == sorted(model.layers), "each source layer is read exactly once for all targets"
    assert [s.target for s in summaries] == [t.name for t in TARGETS]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([OUTPUT_RECORD, *(t.name for t in TARGETS)])
    for target in TARGETS:
        check_bundle_against_source(model.path, tmp_path / "out" / target.name, target)
        # Byte-identical to a bundle converted for that target alone.
        convert(model.path, target.name, tmp_path / f"alone-{target.name}")
        assert tree_bytes(tmp_path / "out" / target.name) == tree_bytes(tmp_path / f"alone-{target.name}")


def test_repeated_target_flags_on_the_cli(make_model, tmp_path, capsys):
    model = make_model(seed=fresh_seed())
    capsys.readouterr()  # the printed seed stays in the test log, not in the CLI's output
    out = tmp_path / "out"
    assert main(["convert", str(model.path), "-t", "sm100", "--target", "sm121", "-t", "sm100", "-o", str(out),
                 "--json", "--max-shard-size", "2KB"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["target"] for r in rows] == ["sm100", "sm120"]  # an alias names its family; duplicates once
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_RECORD, "sm100", "sm120"]
    for target in TARGETS[:2]:
        check_bundle_against_source(model.path, out / target.name, target)


def test_no_fsync_writes_the_same_bundles_without_waiting_for_the_disk(make_model, tmp_path, monkeypatch, capsys):
    """--no-fsync skips every fsync and early writeback of the bundles (the resume journal keeps its own), and
    changes no byte; by default every file and folder of each bundle is fsynced before it is published."""
    import repack.bundle.writer as writer

    model = make_model(seed=fresh_seed())
    capsys.readouterr()
    synced: list[Path] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync",
                        lambda fd: synced.append(Path(os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    writebacks: list[int] = []
    monkeypatch.setattr(writer, "WRITEBACK_BYTES", 1)  # every write would ask for writeback
    monkeypatch.setattr(writer, "START_WRITEBACK", lambda fd, offset, nbytes: writebacks.append(nbytes))
    runs = {}
    for name, flags in (("durable", []), ("fast", ["--no-fsync"])):
        synced.clear(), writebacks.clear()
        out = tmp_path / name
        assert main(["convert", str(model.path), "-t", "sm100", "-t", "sm90", "-o", str(out),
                     "--max-shard-size", "2KB", *flags]) == 0
        bundles = [out / t for t in ("sm100", "sm90")]
        files = {f.resolve() for b in bundles for f in b.iterdir()}
        published = {f for f in synced if not f.name.startswith(".nvfp4-repack-resume.json")}
        runs[name] = (files, published, list(writebacks), [tree_bytes(b) for b in bundles])
    files, published, writebacks_made, durable_bytes = runs["durable"]
    assert len(files) > 6 and writebacks_made
    staged = {f.name.split(".partial-")[0] for f in published if ".partial-" in f.name}  # the output, staged whole
    assert {f.name for f in published} >= {f.name for f in files} | {"sm100", "sm90", tmp_path.name}
    assert staged == {".durable"}
    files, published, writebacks_made, fast_bytes = runs["fast"]
    assert not published and not writebacks_made
    assert fast_bytes == durable_bytes


def test_one_target_failing_midway_leaves_no_bundle_at_all(make_model, tmp_path):
    model = make_model(shapes=[(16, 32), (32, 64)], seed=fresh_seed())
    from repack.formats.checkpoint import open_checkpoint

    entry = open_checkpoint(model.path).tensors["model.layers.1.mlp.proj.weight_scale"]
    data = bytearray((model.path / "model.safetensors").read_bytes())
    data[entry.begin] = 0x7F  # NaN, found only once writing has begun
    (model.path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(RepackError, match="block scales contain NaN"):
        convert(model.path, ["sm100", "sm120"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == [model.path]  # no empty OUT either (issue 26)


def test_several_targets_refuse_to_write_into_a_bundle(make_model, tmp_path):
    model = make_model(seed=fresh_seed())
    convert(model.path, "sm100", tmp_path / "b")
    with pytest.raises(RepackError, match="is a bundle"):
        convert(model.path, ["sm100", "sm120"], tmp_path / "b")


def count_source_hashes(monkeypatch, source: Path) -> list[Path]:
    """Record every digest verify computes of a file of ``source``."""
    import repack.verify as verify_module

    hashed: list[Path] = []
    real = verify_module.file_hexdigest
    monkeypatch.setattr(verify_module, "file_hexdigest",
                        lambda path, algorithm: (hashed.append(path) if path.parent == source else None)
                        or real(path, algorithm))
    return hashed


def test_verify_and_inspect_take_a_several_target_output(make_model, tmp_path, monkeypatch, capsys):
    """``verify OUT`` after ``convert -t all -o OUT``: every target's bundle, the source hashed once for them all;
    a damaged byte in one target's shard fails verify under that target's name."""
    model = make_model(shards=2, seed=fresh_seed())
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["convert", str(model.path), "-t", "all", "-o", str(out), "--max-shard-size", "2KB"]) == 0
    capsys.readouterr()
    hashed = count_source_hashes(monkeypatch, model.path)
    assert main(["verify", str(out), "--json", "--numerics", "all", "--seed", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["source"] == str(model.path)
    assert sorted(hashed) == sorted(model.path / f for f in json.loads(
        (out / "sm100" / "manifest.json").read_text())["source"]["files"]), "each source file hashed once"
    assert report["target"] == ", ".join(t.name for t in TARGETS)
    assert report["numerics_layers"] == len(TARGETS) * len(model.layers)
    for target in TARGETS:  # every target's layers, passthrough tensors and files, under its name
        assert {c["name"] for c in report["layers"]} >= {f"{target.name}/{prefix}" for prefix in model.layers}
        assert {c["name"] for c in report["passthrough"]} >= {f"{target.name}/{name}" for name in model.plain}
        files = {c["name"] for c in report["files"]}
        assert {f"{target.name}/{f.name}" for f in (out / target.name).iterdir() if f.name != "manifest.json"} <= files
    assert main(["inspect", str(out), "--json"]) == 0
    assert [m["target"] for m in json.loads(capsys.readouterr().out)] == [t.name for t in TARGETS]
    assert main(["inspect", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert [text.count(f"target {t.name} ({t.layout_id}; ") for t in TARGETS] == [1] * len(TARGETS)
    shard = sorted((out / "sm120").glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x10
    shard.write_bytes(bytes(data))
    assert main(["verify", str(out), "--json"]) == 1
    failed = {c["name"] for c in json.loads(capsys.readouterr().out)["files"] if c["status"] == "fail"}
    assert failed == {f"sm120/{shard.name}"}


def test_a_several_target_output_is_refused_against_another_source(make_model, tmp_path, capsys):
    seed = fresh_seed()
    model = make_model(seed=seed)
    other = make_model(seed=seed + 1)
    capsys.readouterr()
    convert(model.path, ["sm100", "sm90"], tmp_path / "out")
    assert main(["verify", str(tmp_path / "out"), "--source", str(other.path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not the source the bundle was built from" in err, err


def test_a_target_folder_holding_another_targets_bundle_fails(make_model, tmp_path, capsys):
    """OUT/sm100 and OUT/sm90 swapped: each bundle is whole and exact, but a deployment that takes OUT/sm100 to a
    B200 would get the sm90 layout."""
    model = make_model(seed=fresh_seed())
    capsys.readouterr()
    out = tmp_path / "out"
    convert(model.path, ["sm100", "sm90"], out)
    (out / "sm100").rename(out / "swap")
    (out / "sm90").rename(out / "sm100")
    (out / "swap").rename(out / "sm90")
    assert main(["verify", str(out), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    failed = {c["name"]: c["errors"] for c in report["files"] + report["layers"] if c["status"] == "fail"}
    assert failed == {"sm100": ["sm100: holds the bundle of sm90 (by its manifest); move it to sm90 or re-convert"],
                      "sm90": ["sm90: holds the bundle of sm100 (by its manifest); move it to sm100 or re-convert"]}


def test_a_target_folder_that_lost_its_manifest_fails_verify(make_model, tmp_path, capsys):
    model = make_model(seed=fresh_seed())
    capsys.readouterr()
    out = tmp_path / "out"
    convert(model.path, ["sm100", "sm120"], out)
    (out / "sm120" / "manifest.json").unlink()
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sm120: no manifest.json" in err, err


def test_a_missing_target_fails_verify_by_the_outputs_record(make_model, tmp_path, capsys):
    """Regression (issue 26): ``verify OUT`` passed after ``rm -rf OUT/sm120``. convert records the targets it
    wrote; a missing one is one integrity failure naming it; all of them missing, a one-line error. An output
    without the record (older versions) is verified as it is, as before."""
    model = make_model(seed=fresh_seed())
    capsys.readouterr()
    out = tmp_path / "out"
    convert(model.path, ["sm100", "sm120"], out)
    convert(model.path, ["sm90", "sm100"], out, overwrite=True)  # the record keeps sm120, still there
    assert json.loads((out / OUTPUT_RECORD).read_text())["members"] == ["sm100", "sm120", "sm90"]
    shutil.rmtree(out / "sm120")
    assert main(["verify", str(out), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [e for c in report["files"] + report["layers"] + report["passthrough"] for e in c["errors"]] == \
        [f"sm120: missing; the convert that wrote {out} recorded it in {OUTPUT_RECORD}"]
    shutil.rmtree(out / "sm100")
    shutil.rmtree(out / "sm90")
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none of the bundles its convert recorded (sm100, sm120, sm90) is there" in err
    convert(model.path, ["sm100", "sm120"], out)
    shutil.rmtree(out / "sm120")
    (out / OUTPUT_RECORD).unlink()
    assert main(["verify", str(out)]) == 0


def test_a_missing_shard_is_reported_once(make_model, tmp_path, capsys):
    """Regression (issue 26): one missing shard file gave an integrity failure for each tensor in it as well;
    now the file is the one problem (the layers in it are skipped, not failed)."""
    model = make_model(shards=2, seed=fresh_seed())
    capsys.readouterr()
    out = tmp_path / "out"
    convert(model.path, "sm100", out, max_shard_size="2KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    assert main(["verify", str(out), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["failures_by_kind"] == {"integrity": 1}
    assert [c["errors"] for c in report["files"] if c["status"] == "fail"] == [[f"{shards[1].name}: file not found in {out}"]]
    assert any(c["status"] == "skipped" for c in report["layers"] + report["passthrough"])


def test_a_model_folder_holding_a_target_folder_is_still_a_model(make_model, tmp_path, capsys):
    model = make_model(seed=fresh_seed())
    convert(model.path, "sm100", tmp_path / "sm100")  # convert writes nothing inside its source (issue 38): moved there
    shutil.move(tmp_path / "sm100", model.path / "sm100")
    capsys.readouterr()
    assert main(["inspect", str(model.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantized_layers"] == len(model.layers)


def test_verify_on_a_gpu_names_the_bundles_of_other_gpus(make_model, tmp_path, monkeypatch, capsys):
    """``verify OUT --device cuda`` on an H200 after ``convert -t all``: one line naming the other families' folders,
    before any work (the GPU's capability is faked: the CPU suite has no GPU)."""
    import repack.runtime.backends as backends

    model = make_model(seed=fresh_seed())
    capsys.readouterr()
    out = tmp_path / "out"
    convert(model.path, "all", out)
    monkeypatch.setattr(backends, "device_capability", lambda device: (9, 0) if device.type == "cuda" else None)
    assert main(["verify", str(out), "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    others = ", ".join(str(out / f.name) for f in FAMILIES if f.name != "sm90")  # sm100, sm120 and Marlin's
    assert f"{others}: not for this sm90 GPU" in " ".join(err.split()), err


# --- Hub repo ids, from a cache in the hub's layout, offline --------------------------------------------------------


def make_hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str = "0123456789abcdef" * 2 + "01234567") -> Path:
    """``cache/models--org--name``: the model's files as blobs named by their ETag, as huggingface_hub names them
    (LFS files, the safetensors: their sha256; files in git: their git blob sha1), the snapshot as symlinks,
    refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for file in sorted(model_dir.iterdir()):
        data = file.read_bytes()
        etag = (hashlib.sha256(data) if file.suffix == ".safetensors" else
                hashlib.sha1(b"blob %d\0" % len(data) + data)).hexdigest()
        blob = repo / "blobs" / etag
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # "org/name" must not exist as a local folder
    return cache


def test_convert_a_hub_repo_id_from_the_cache(make_model, tmp_path, offline_hub):
    model = make_model("modelopt", shards=2, seed=fresh_seed())
    snapshot = make_hub_cache(offline_hub, "acme/tiny-fp4", model.path)
    summary = convert("acme/tiny-fp4", "sm120", tmp_path / "out")
    assert summary.layers == len(model.layers)
    manifest = check_bundle_against_source(snapshot, tmp_path / "out", TARGETS[1])
    assert (manifest.source.repo_id, manifest.source.revision) == ("acme/tiny-fp4", snapshot.name)
    # The Hub's sha256 of each shard, as its metadata gave it: every shard (LFS) file's, nothing of the git files
    assert manifest.source.hub_sha256 == {name: hashlib.sha256((model.path / name).read_bytes()).hexdigest()
                                          for name in manifest.source.files} and len(manifest.source.files) == 2
    convert(model.path, "sm120", tmp_path / "local")  # same bytes as from the folder the cache was made of
    hub_files, local_files = tree_bytes(tmp_path / "out"), tree_bytes(tmp_path / "local")
    assert hub_files.keys() == local_files.keys()
    assert all(hub_files[name] == local_files[name] for name in hub_files if name != "manifest.json")
    report = __import__("repack.verify", fromlist=["verify_bundle"]).verify_bundle(
        tmp_path / "out", source="acme/tiny-fp4")
    assert report.passed and report.source is not None


def test_hub_sha256_comes_only_from_the_hubs_metadata(make_model, tmp_path, offline_hub):
    """A shard cached as a copy rather than a link to its blob (no symlinks on the file system) has no Hub sha256
    on record: the tool records what the Hub said, and never a hash of its own under the Hub's name."""
    model = make_model("modelopt", shards=2, seed=fresh_seed())
    snapshot = make_hub_cache(offline_hub, "acme/copies", model.path)
    copied, linked = sorted(p.name for p in snapshot.glob("*.safetensors"))
    (snapshot / copied).unlink()
    shutil.copyfile(model.path / copied, snapshot / copied)
    convert("acme/copies", "sm100", tmp_path / "out")
    manifest = __import__("repack.bundle.manifest", fromlist=["x"]).read_manifest(tmp_path / "out")
    assert manifest.source.hub_sha256 == {linked: hashlib.sha256((model.path / linked).read_bytes()).hexdigest()}
    assert set(manifest.source.files) == {copied, linked}


def test_hub_symlinks_may_not_leave_the_repo_cache_folder(make_model, tmp_path, offline_hub):
    model = make_model(seed=fresh_seed())
    snapshot = make_hub_cache(offline_hub, "acme/evil", model.path)
    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    (snapshot / "tokenizer_config.json").unlink()
    (snapshot / "tokenizer_config.json").symlink_to(outside)
    with pytest.raises(RepackError, match="points outside the model folder"):
        convert("acme/evil", "sm100", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_hub_errors_are_one_line(tmp_path, offline_hub, capsys):
    assert main(["convert", "acme/not-cached", "-t", "sm100", "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not in the local Hugging Face cache" in err


def test_a_local_folder_wins_over_a_hub_id(make_model, tmp_path, offline_hub):
    model = make_model(seed=fresh_seed())
    (tmp_path / "acme").mkdir()
    shutil.copytree(model.path, tmp_path / "acme" / "tiny")  # also present in no cache at all
    summary = convert("acme/tiny", "sm100", tmp_path / "out")
    assert summary.layers == len(model.layers)
    assert __import__("repack.bundle.manifest", fromlist=["x"]).read_manifest(tmp_path / "out").source.repo_id is None


def test_inspect_a_hub_repo_id_from_the_cache(make_model, tmp_path, offline_hub, capsys):
    """inspect resolves a repo id (and --revision) as convert and verify do, and names the commit it read."""
    model = make_model("compressed-tensors", shapes=[(64, 128), (48, 96)], seed=fresh_seed())
    snapshot = make_hub_cache(offline_hub, "acme/tiny-ct", model.path)
    capsys.readouterr()
    for argv in (["acme/tiny-ct"], ["acme/tiny-ct", "--revision", snapshot.name]):
        assert main(["inspect", *argv, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["path"] == f"acme/tiny-ct@{snapshot.name}" and info["format"] == "compressed-tensors"
        assert info["layer_shapes"] == [{"n": 48, "k": 96, "count": 1}, {"n": 64, "k": 128, "count": 1}]
    assert main(["inspect", "acme/tiny-ct", "--revision", "v9"]) == 1
    assert "acme/tiny-ct@v9" in capsys.readouterr().err


def test_cli_hub_id_with_revision_in_a_fresh_process(make_model, tmp_path):
    """The real CLI with HF_HUB_CACHE / HF_HUB_OFFLINE from the environment, as a CI job runs it."""
    model = make_model("compressed-tensors", seed=fresh_seed())
    snapshot = make_hub_cache(tmp_path / "cache", "acme/tiny-ct", model.path)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "repack.cli", "convert", "acme/tiny-ct", "--revision", snapshot.name,
                          "-t", "sm100", "-o", "out", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source"]["repo_id"] == "acme/tiny-ct" and manifest["source"]["revision"] == snapshot.name
    run = subprocess.run([sys.executable, "-m", "repack.cli", "convert", "acme/tiny-ct", "--revision", "v9",
                          "-t", "sm100", "-o", "out2"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "acme/tiny-ct@v9" in run.stderr


# --- verify as a gate -----------------------------------------------------------------------------------------------


def test_verify_refuses_a_source_the_bundle_was_not_built_from(make_model, tmp_path, capsys):
    seed = fresh_seed()
    model = make_model(shapes=[(64, 128), (32, 64)], seed=seed)
    other = make_model(shapes=[(64, 128), (32, 64)], seed=seed + 1)  # same names and shapes, other values
    wrong_shapes = make_model(shapes=[(48, 128), (32, 80)], seed=seed + 2)
    capsys.readouterr()
    convert(model.path, "sm100", tmp_path / "b")
    for source in (other.path, wrong_shapes.path):
        assert main(["verify", str(tmp_path / "b"), "--source", str(source)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not the source the bundle was built from" in err, err


def test_verify_summarises_failures_per_check_kind(make_model, tmp_path, capsys):
    model = make_model(shapes=[(64, 128)] * 12, seed=fresh_seed())
    capsys.readouterr()  # the printed seed stays in the test log, not in the CLI's output
    out = tmp_path / "b"
    convert(model.path, "sm100", out)
    shard = out / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")  # the file hash and the last tensor fail
    manifest = json.loads((out / "manifest.json").read_text())
    for layer in manifest["layers"].values():  # every layer's digest wrong: 12 integrity failures
        layer["tensors"]["weight"]["digest"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(out), "--report", str(tmp_path / "r.json")]) == 1
    text = capsys.readouterr().out
    assert "FAIL integrity" in text and "... and" in text and text.count("digest differs") <= 5
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["failures_by_kind"]["integrity"] >= 13 and not report["passed"]


def test_verify_json_goes_to_stdout(make_model, tmp_path, capsys):
    model = make_model(seed=fresh_seed())
    capsys.readouterr()  # the printed seed stays in the test log, not in the CLI's output
    convert(model.path, "sm120", tmp_path / "b")
    assert main(["verify", str(tmp_path / "b"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["source"] == str(model.path)


# --- CLI conventions ------------------------------------------------------------------------------------------------


def test_version_and_short_help(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "nvfp4-repack 0.1.0"
    for argv in (["-h"], ["convert", "-h"], ["verify", "-h"], ["inspect", "-h"], ["targets", "-h"]):
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert "Usage" in text and "<bool>" not in text, argv


@pytest.mark.parametrize("size", ["5", "500", "1.5"])
def test_a_shard_size_without_unit_is_refused(make_model, tmp_path, capsys, size):
    model = make_model(seed=fresh_seed())
    capsys.readouterr()  # the printed seed stays in the test log, not in the CLI's output
    assert main(["convert", str(model.path), "-t", "sm100", "-o", str(tmp_path / "o"), "--max-shard-size", size]) == 2  # bad usage
    err = capsys.readouterr().err
    assert "--max-shard-size" in err and "unit" in err and not (tmp_path / "o").exists()


def test_overwrite_hint_only_where_overwrite_would_work(make_model, tmp_path, capsys):
    model = make_model(seed=fresh_seed())
    capsys.readouterr()  # the printed seed stays in the test log, not in the CLI's output
    bundle, plain = tmp_path / "bundle", tmp_path / "plain"
    convert(model.path, "sm100", bundle)
    plain.mkdir()
    (plain / "notes.txt").write_text("x")
    assert main(["convert", str(model.path), "-t", "sm100", "-o", str(bundle)]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main(["convert", str(model.path), "-t", "sm100", "-o", str(plain)]) == 1
    assert "--overwrite" not in capsys.readouterr().err


def test_library_errors_do_not_name_cli_flags(make_model, tmp_path):
    model = make_model(seed=fresh_seed())
    convert(model.path, "sm100", tmp_path / "b")
    for call in (lambda: convert(model.path, "sm100", tmp_path / "b"),
                 lambda: convert(model.path, "sm100", tmp_path / "c", max_shard_size="5"),
                 lambda: convert(model.path, "sm100", model.path, overwrite=True)):
        with pytest.raises(RepackError) as caught:
            call()
        assert "--" not in str(caught.value), caught.value


def test_numerics_sample_covers_every_layer_shape(make_model, tmp_path, capsys):
    model = make_model(shapes=[(64, 128)] * 5 + [(48, 80)] * 3 + [(16, 1008)], seed=fresh_seed())
    capsys.readouterr()
    convert(model.path, "sm120", tmp_path / "b")
    assert main(["verify", str(tmp_path / "b"), "--json"]) == 0  # auto: a sample on the CPU
    report = json.loads(capsys.readouterr().out)
    sampled = {c["name"] for c in report["layers"] if c["max_rel_error"] is not None}
    shapes = {(l.shape[0], l.shape[1] * 2) for l in (model.layers[name].codes for name in sampled)}
    assert shapes == {(64, 128), (48, 80), (16, 1008)}
    assert report["numerics_layers"] == len(sampled) and len(sampled) in (3, 4)
    assert main(["verify", str(tmp_path / "b"), "--json", "--numerics", "all"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["numerics_layers"] == 9 and all(c["max_rel_error"] < 1e-2 for c in report["layers"])


def test_online_transforms_in_a_several_target_pass(tmp_path):
    """Transform matrices are units of the pass too: every bundle holds them and verifies against the source."""
    from repack.verify import verify_bundle

    from .conftest import PRODUCERS

    source = PRODUCERS / "ct_quip_vu_had32_nvfp4"
    convert(source, ["sm100", "sm120"], tmp_path / "out", vllm="0.33")  # 0.34 serves its rotations through Humming
    for target in ("sm100", "sm120"):
        report = verify_bundle(tmp_path / "out" / target, source=source, seed=0)
        assert report.passed and report.transforms, [e for c in report.failures for e in c.errors]
