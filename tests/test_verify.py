"""verify passes fresh bundles and catches every kind of damage, naming the layer or file."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from repack.formats.hashing import file_hexdigest, new_digest
from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.convert import convert
from repack import targets
from repack.formats.safetensors_io import DTYPE_NAMES, tensor_bytes
from repack.sample.synthetic import write_llama
from repack.targets import TARGETS, Target
from repack.verify import verify_bundle, verify_output

from .conftest import PRODUCERS

LAYER = "model.layers.1.mlp.proj"


@pytest.fixture(params=[("modelopt", "sm100"), ("compressed-tensors", "sm120"),
                        ("compressed-tensors", "sm100"), ("modelopt", "sm120")], ids=lambda p: f"{p[0]}-{p[1]}")
def bundle(request, make_model, tmp_path):
    fmt, target = request.param
    model = make_model(fmt, w4a4=fmt == "modelopt")
    out = tmp_path / "bundle"
    convert(model.path, target, out)
    return out, model


def run_verify(out, capsys, *extra):
    code = main(["verify", str(out), *extra])
    return code, capsys.readouterr().out


def flip_tensor_byte(out, name, offset=0, xor=0x01):
    bundle = open_bundle(out)
    entry = bundle.entry(name)
    data = bytearray(entry.file.read_bytes())
    data[entry.begin + offset] ^= xor
    entry.file.write_bytes(bytes(data))


def test_fresh_bundle_passes(bundle, capsys, tmp_path):
    out, model = bundle
    report_path = tmp_path / "report.json"
    code, text = run_verify(out, capsys, "--source", str(model.path), "--report", str(report_path))
    assert code == 0, text
    assert "PASS" in text
    report = json.loads(report_path.read_text())
    assert report["passed"] and len(report["layers"]) == len(model.layers)
    assert all(0 < layer["max_rel_error"] < report["tolerance"] for layer in report["layers"])


def test_flipped_weight_byte_is_caught(bundle, capsys):
    out, _ = bundle
    flip_tensor_byte(out, f"{LAYER}.weight", offset=3)
    code, text = run_verify(out, capsys)
    assert code == 1 and LAYER in text and "blake3 digest differs" in text


def rewrite_consistently(out, name, value):
    """Replace (or, with None, delete) tensor ``name`` in its shard AND in the manifest, hashes recomputed:
    a tamperer who knows the format. Only the comparison with the source can catch what this does."""
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    record = open_bundle(out).manifest.all_tensors[name]
    tensors = load_file(out / record.file)
    prefix, _, part = name.rpartition(".")
    held = next((manifest[kind][prefix]["tensors"] for kind in ("layers", "moe") if prefix in manifest[kind]), None)
    records, key = (held, part) if held is not None else (manifest["passthrough"], name)
    if value is None:
        del tensors[name], records[key]
    else:
        tensors[name] = value
        digest = new_digest(manifest["tensor_digest"])
        digest.update(tensor_bytes(value))
        records[key].update(digest=digest.hexdigest(), dtype=DTYPE_NAMES[value.dtype], shape=list(value.shape))
    save_file(tensors, out / record.file, metadata={"format": "pt"})
    manifest["files"][record.file] = file_hexdigest(out / record.file, manifest["file_digest"])
    manifest_path.write_text(json.dumps(manifest))


def test_changed_global_scale_is_caught_even_with_a_consistent_manifest(bundle, capsys):
    out, model = bundle
    w4a4 = open_bundle(out).manifest.scheme == "W4A4"  # its kernels read alpha: doubled too, consistently
    for part in ["weight_global_scale", *(["alpha"] if w4a4 else [])]:
        name = f"{LAYER}.{part}"
        rewrite_consistently(out, name, load_file(next(out.glob("*.safetensors")))[name] * 2)
    report = verify_bundle(out, source=model.path)
    failed = [c for c in report.layers if c.status == "fail"]
    assert [c.name for c in failed] == [LAYER]
    # Marlin (sm120's weight-only layout) keeps the source multiplier and reads its scale factor from the global scale
    marlin = open_bundle(out).manifest.layout_id == "marlin-v1"
    differs = f"{'block scales' if marlin else 'global scale'} differ"
    assert any(differs in e for e in failed[0].errors), failed[0].errors
    assert any("relative error" in e for e in failed[0].errors)


def test_deleted_tensor_is_caught(bundle, capsys):
    out, _ = bundle
    record = open_bundle(out).manifest.all_tensors[f"{LAYER}.weight_scale"]
    tensors = load_file(out / record.file)
    del tensors[f"{LAYER}.weight_scale"]
    save_file(tensors, out / record.file, metadata={"format": "pt"})
    code, text = run_verify(out, capsys)
    assert code == 1 and f"{LAYER}.weight_scale" in text and "missing" in text


def test_truncated_shard_is_caught(bundle, capsys):
    out, _ = bundle
    shard = sorted(out.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    code, text = run_verify(out, capsys)
    assert code == 1 and shard.name in text


def test_edited_target_is_caught(bundle, capsys):
    out, _ = bundle
    manifest = json.loads((out / "manifest.json").read_text())
    padded_otherwise = manifest["scheme"] == "W4A4" or manifest["layout_id"] == "marlin-v1"  # than cute-dsl's
    other = {"sm100": "sm120", "sm120": "sm100"}[manifest["target"]]
    if manifest["scheme"] == "W4A4":  # one W4A4 layout for both families: only another layout id can be caught
        other = manifest["target"]
    else:
        manifest["target"] = other
        (out / "manifest.json").write_text(json.dumps(manifest))
        assert main(["verify", str(out)]) == 1
        assert "layout" in capsys.readouterr().err
    # Editing the layout id too still cannot make the tensors fit the other layout.
    manifest["layout_id"] = f"{other}-cute-dsl-v1"
    (out / "manifest.json").write_text(json.dumps(manifest))
    code = main(["verify", str(out)])
    captured = capsys.readouterr()
    if padded_otherwise:  # W4A4 or Marlin -> cute-dsl changes the padding: refused on opening, in one line
        assert code == 1 and captured.err.startswith("Error: manifest.json") and "do not follow" in captured.err
    else:
        assert code == 1 and "is not the" in captured.out and "layout" in captured.out


def test_dropped_passthrough_tensor_is_caught(bundle):
    out, model = bundle
    rewrite_consistently(out, "lm_head.weight", None)
    report = verify_bundle(out, source=model.path)  # hashes and manifest are consistent; the source tells
    assert [c.name for c in report.failures] == ["lm_head.weight"]
    assert "missing from the bundle" in report.failures[0].errors[0]


def test_passthrough_dtype_change_is_caught(bundle):
    out, model = bundle
    same_bytes = load_file(next(out.glob("*.safetensors")))["lm_head.weight"].view(torch.bfloat16)  # was fp16
    rewrite_consistently(out, "lm_head.weight", same_bytes)
    report = verify_bundle(out, source=model.path)
    assert [c.name for c in report.failures] == ["lm_head.weight"]


def test_verify_on_real_producer_bundle_without_source(tmp_path, capsys):
    out = tmp_path / "bundle"
    convert(PRODUCERS / "modelopt_nvfp4_sharded", "sm120", out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["source"]["path"] = str(tmp_path / "moved-away")  # the usual case on another machine
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(out)]) == 1  # a gate: no source is a failure unless asked for
    assert "--no-source" in capsys.readouterr().err
    code, text = run_verify(out, capsys, "--no-source")
    assert code == 0, text
    assert "exactness was NOT checked" in " ".join(text.split())
    assert verify_bundle(out).source is None


def test_no_source_does_not_read_the_recorded_source(bundle, capsys):
    """--no-source means no source: the folder the manifest records is not opened even where it still exists."""
    out, model = bundle
    assert verify_bundle(out).source is not None  # the recorded folder is there
    code, text = run_verify(out, capsys, "--no-source", "--json")
    assert code == 0 and json.loads(text)["source"] is None, text
    assert verify_bundle(out, no_source=True).source is None


def test_failure_reports_the_seed(bundle, capsys, tmp_path):
    out, _ = bundle
    flip_tensor_byte(out, f"{LAYER}.weight")
    code, text = run_verify(out, capsys, "--seed", "1234", "--report", str(tmp_path / "r.json"))
    assert code == 1 and "seed 1234" in text
    assert json.loads((tmp_path / "r.json").read_text())["seed"] == 1234


def test_a_seed_reproduces_every_layers_numerics(make_model, tmp_path):
    """Layers are checked in parallel, each on activations from its own seeded generator: two runs with one seed
    give every layer the same error to the last bit, and another seed gives other activations."""
    model = make_model("modelopt", shapes=[(128, 512), (256, 256), (128, 768), (64, 512)])
    convert(model.path, "sm100", tmp_path / "b")
    errors = [{c.name: c.max_rel_error for c in verify_bundle(tmp_path / "b", seed=seed, numerics="all").layers}
              for seed in (7, 7, 8)]
    assert all(e is not None and 0 < e <= 1e-2 for e in errors[0].values()), errors[0]
    assert errors[0] == errors[1]
    assert errors[0] != errors[2]


def wrong_together(target: Target) -> Target:
    """``target`` with the global scale doubled by ``to_runtime`` and halved by ``from_runtime``: a layout bug
    that its inverse mirrors, so the bundle round-trips bit for bit."""

    def to_runtime(weight):
        layer = target.to_runtime(weight)
        kept = None if layer.weight_multiplier is None else layer.weight_multiplier * 2  # Marlin: sf stays
        return dataclasses.replace(layer, weight_global_scale=layer.weight_global_scale * 2, weight_multiplier=kept)

    def from_runtime(layer, n, k):
        weight = target.from_runtime(layer, n, k)
        return dataclasses.replace(weight, multiplier=weight.multiplier / 2)

    return dataclasses.replace(target, to_runtime=to_runtime, from_runtime=from_runtime)


@pytest.mark.parametrize("name", [t.name for t in TARGETS])
def test_numerics_catches_a_transform_wrong_together_with_its_inverse(make_model, tmp_path, monkeypatch, name):
    """Exactness decodes with the target's inverse and passes; numerics reads the bytes by the layout's index
    formula (the reference backend) and fails: the two checks are independent."""
    monkeypatch.setattr(targets, "TARGETS", tuple(wrong_together(t) if t.name == name else t for t in TARGETS))
    model = make_model("compressed-tensors")
    convert(model.path, name, tmp_path / "bundle")
    report = verify_bundle(tmp_path / "bundle", source=model.path)
    assert report.backend == "reference"
    assert [c.name for c in report.failures] == list(model.layers)
    for check in report.failures:
        assert check.errors and all("relative error" in e for e in check.errors), check.errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verify_on_cuda_uses_the_target_backend(tmp_path, capsys):
    from repack.runtime.backends import device_capability
    from repack.targets import target_for_capability

    target = target_for_capability(*device_capability(torch.device("cuda")))
    if target is None:
        pytest.skip("no target for this GPU")
    out = tmp_path / "bundle"
    convert(PRODUCERS / "ct_nvfp4a16", target.name, out)
    report = verify_bundle(out, source=PRODUCERS / "ct_nvfp4a16", device="cuda")
    assert report.backend == target.backend and report.passed, report.failures


def rewrite_as_old_format(out, source_dir, version: int) -> None:
    """Turn a fresh bundle into the one the code before format 4 wrote: files and the source's files hashed with
    sha256, tensors with xxh3-128 (format 3) or sha256 under a ``sha256`` key (format 2), no ``file_digest``, no
    Hub provenance, the config's marker at that version. Digests from hashlib and xxhash, not from the tool."""
    import xxhash

    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    assert (manifest["bundle_format_version"], manifest["file_digest"], manifest["tensor_digest"]) == (6, "blake3", "blake3")
    config = json.loads((out / "config.json").read_text())
    config["nvfp4_repack"]["bundle_format_version"] = version
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    bundle = open_bundle(out)
    records = {f"{prefix}.{part}": record for prefix, layer in manifest["layers"].items()
               for part, record in layer["tensors"].items()}
    records.update(manifest["passthrough"])
    records.update({name: record["tensor"] for name, record in manifest["transforms"].items()})
    for name, record in records.items():
        entry = bundle.entry(name)
        data = entry.file.read_bytes()[entry.begin:entry.end]
        del record["digest"]
        if version == 3:
            record["digest"] = xxhash.xxh3_128(data).hexdigest()
        else:
            record["sha256"] = hashlib.sha256(data).hexdigest()
    sha256 = lambda file: hashlib.sha256(file.read_bytes()).hexdigest()  # noqa: E731
    manifest["files"] = {name: sha256(out / name) for name in manifest["files"]}
    manifest["source"]["files"] = {name: sha256(source_dir / name) for name in manifest["source"]["files"]}
    del manifest["file_digest"], manifest["source"]["hub_sha256"], manifest["engines"]
    manifest["bundle_format_version"] = version
    if version == 3:
        manifest["tensor_digest"] = "xxh3_128"
    else:
        del manifest["tensor_digest"]
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("version", [2, 3])
def test_bundles_of_older_formats_still_verify(make_model, tmp_path, capsys, version):
    """Format 2 and 3 bundles (sha256 files and source identity; sha256 or xxh3-128 tensors) pass verify against
    their source by those algorithms, and still fail on one flipped byte, naming the file and the tensor."""
    model = make_model("compressed-tensors", shards=2)
    out = tmp_path / "old"
    convert(model.path, "sm120", out)
    rewrite_as_old_format(out, model.path, version)
    bundle = open_bundle(out)
    assert (bundle.manifest.bundle_format_version, bundle.manifest.file_digest) == (version, "sha256")
    code, text = run_verify(out, capsys, "--source", str(model.path), "--numerics", "all")
    assert code == 0, text
    flip_tensor_byte(out, f"{LAYER}.weight", offset=5)
    report = verify_bundle(out, source=model.path, seed=0)
    assert [c.name for c in report.layers if c.status == "fail"] == [LAYER]
    failed_files = [c for c in report.files if c.status == "fail"]
    assert [c.errors for c in failed_files] == [[f"{bundle.manifest.all_tensors[f'{LAYER}.weight'].file}: sha256 "
                                                  "digest differs from the manifest (file modified or truncated)"]]


def test_a_several_target_output_of_mixed_formats_verifies_each_by_its_own(make_model, tmp_path):
    """An output whose sm120 bundle is of format 3 (sha256) beside a format 4 sm100 (BLAKE3): the source is hashed
    once per algorithm, each bundle checked by its own, and damage in the old one still fails it."""
    model = make_model("modelopt", shards=2)
    out = tmp_path / "out"
    convert(model.path, ["sm100", "sm120"], out)
    rewrite_as_old_format(out / "sm120", model.path, 3)
    report = verify_output(out, source=model.path, seed=0)
    assert report.passed, report.summary()
    flip_tensor_byte(out / "sm120", f"{LAYER}.weight_scale", offset=0)
    failed = verify_output(out, source=model.path, seed=0).failures
    assert {c.name for c in failed} >= {f"sm120/{LAYER}"} and all(c.name.startswith("sm120/") for c in failed)


# SGLang's dense layouts (issue 37: verify's numerics on each): (format, W4A4 checkpoint, target, --weight-only) ->
# its layout and the name of the layer's codes
SGLANG_DENSE = {("modelopt", True, "sm100", False): ("sglang-modelopt-w4a4-v1", "weight"),
                ("compressed-tensors", True, "sm120", False): ("sglang-ct-w4a4-v1", "weight_packed"),
                ("compressed-tensors", False, "sm100", False): ("sglang-ct-w4a16-cutedsl-v1", "weight"),
                ("modelopt", False, "sm90", False): ("sglang-modelopt-marlin-v1", "weight"),
                ("compressed-tensors", False, "sm120", False): ("sglang-ct-marlin-v1", "weight"),
                ("modelopt", True, "sm100", True): ("sglang-modelopt-w4a4-marlin-v1", "weight"),
                ("compressed-tensors", True, "sm90", False): ("sglang-ct-w4a4-marlin-v1", "weight")}


@pytest.mark.parametrize("job", SGLANG_DENSE, ids=lambda j: f"{j[0]}-{'w4a4' if j[1] else 'w4a16'}-{j[2]}"
                         + ("-weight-only" if j[3] else ""))
def test_sglang_dense_layouts_get_numerics_that_catch_a_corrupted_layer(job, tmp_path, random_seed):
    """Every SGLang dense layout (the W4A4 swizzle with its padding, FlashInfer's bf16 x fp4 state, FP4 Marlin) runs
    verify's numerics on every layer under --numerics all (its names mapped to the runtime's layout), and a layer whose
    codes are flipped (digests rewritten) fails them by name."""
    fmt, w4a4, target, weight_only = job
    layout, codes = SGLANG_DENSE[job]
    source = write_llama(tmp_path / "src", fmt, hidden=64, heads=2, kv_heads=1, intermediate=96, layers=1, w4a4=w4a4,
                         generator=torch.Generator().manual_seed(random_seed))
    out, layer = tmp_path / "bundle", "model.layers.0.mlp.down_proj"
    convert(source, target, out, engine="sglang", weight_only=weight_only)
    assert open_bundle(out).manifest.layout_id == layout
    report = verify_output(out, numerics="all")
    assert report.passed and report.numerics_layers == len(report.layers) == 4, report.summary()
    held = open_bundle(out).read(f"{layer}.{codes}").clone()
    held.view(torch.uint8).reshape(-1)[:] ^= 0x5A
    rewrite_consistently(out, f"{layer}.{codes}", held)
    numerics = verify_output(out, numerics="all").summary().get("numerics", [])
    assert any(m.startswith(f"{layer}: relative error ") for m in numerics), numerics
