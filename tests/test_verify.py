"""verify passes fresh bundles and catches every kind of damage, naming the layer or file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.convert import convert
from repack.verify import verify_bundle

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
    code, text = run_verify(out, capsys, "--source", str(model.path), "--json", str(report_path))
    assert code == 0, text
    assert "PASS" in text
    report = json.loads(report_path.read_text())
    assert report["passed"] and len(report["layers"]) == len(model.layers)
    assert all(0 < layer["max_rel_error"] < report["tolerance"] for layer in report["layers"])


def test_flipped_weight_byte_is_caught(bundle, capsys):
    out, _ = bundle
    flip_tensor_byte(out, f"{LAYER}.weight", offset=3)
    code, text = run_verify(out, capsys)
    assert code == 1 and LAYER in text and "sha256" in text


def test_changed_global_scale_is_caught_even_with_a_consistent_manifest(bundle, capsys):
    """Rewrite the tensor AND its manifest hashes: only the comparison with the source can catch it."""
    out, model = bundle
    manifest_path = out / "manifest.json"
    bundle_ = open_bundle(out)
    record = bundle_.manifest.all_tensors()[f"{LAYER}.weight_global_scale"]
    tensors = load_file(out / record.file)
    tensors[f"{LAYER}.weight_global_scale"] = tensors[f"{LAYER}.weight_global_scale"] * 2
    save_file(tensors, out / record.file, metadata={"format": "pt"})
    from repack.formats.safetensors_io import file_sha256, tensor_bytes
    import hashlib

    manifest = json.loads(manifest_path.read_text())
    manifest["layers"][LAYER]["tensors"]["weight_global_scale"]["sha256"] = hashlib.sha256(
        tensor_bytes(tensors[f"{LAYER}.weight_global_scale"])).hexdigest()
    manifest["files"][record.file] = file_sha256(out / record.file)
    manifest_path.write_text(json.dumps(manifest))
    report = verify_bundle(out, source=model.path)
    failed = [c for c in report.layers if c.status == "fail"]
    assert [c.name for c in failed] == [LAYER]
    assert any("global scale differ" in e for e in failed[0].errors)
    assert any("relative error" in e for e in failed[0].errors)


def test_deleted_tensor_is_caught(bundle, capsys):
    out, _ = bundle
    record = open_bundle(out).manifest.all_tensors()[f"{LAYER}.weight_scale"]
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
    other = {"sm100": "sm120", "sm120": "sm100"}[manifest["target"]]
    manifest["target"] = other
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(out)]) == 1
    assert "layout" in capsys.readouterr().err
    # Editing the layout id too still cannot make the tensors fit the other layout.
    manifest["layout_id"] = f"{other}-cute-dsl-v1"
    (out / "manifest.json").write_text(json.dumps(manifest))
    code, text = run_verify(out, capsys)
    assert code == 1 and "is not the" in text and "layout" in text


def test_verify_on_real_producer_bundle_without_source(tmp_path, capsys):
    out = tmp_path / "bundle"
    convert(PRODUCERS / "modelopt_nvfp4_sharded", "sm120", out)
    # Moving the bundle away from its recorded source still verifies integrity and numerics.
    code, text = run_verify(out, capsys)
    assert code == 0, text


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
