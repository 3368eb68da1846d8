"""convert end to end: every output tensor decodes back to the source, and the bundle is complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
import torch
from safetensors import safe_open

from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.convert import convert, served_scheme
from repack.errors import OutputExists, RepackError
from repack.formats import read_source
from repack.sample import SAMPLE_DIR
from repack.targets import TARGETS

from .conftest import MOE_FIXTURES, PRODUCERS, REFUSED_FIXTURES


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def bundle_tensors(root):
    out = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                out[name] = handle.get_tensor(name)
    return out


def check_bundle_against_source(source_path, out, target):
    """Every layer inverts to the source bit for bit; passthrough is byte-identical; hashes match."""
    source = read_source(source_path)
    bundle = open_bundle(out)
    tensors = bundle_tensors(out)  # read with the real safetensors library, not ours
    manifest = bundle.manifest
    target = target.for_scheme(served_scheme(source))  # vLLM's auto: W4A4 checkpoints get the W4A4 layout
    assert manifest.target == target.name and manifest.layout_id == target.layout_id
    assert set(manifest.layers) == set(source.layers)
    # Every digest is BLAKE3, against the blake3 package on whole files and on the tensors as safetensors reads them:
    # the source files' (computed by convert from its one read of them), the bundle's files', each tensor's.
    assert (manifest.file_digest, manifest.tensor_digest) == ("blake3", "blake3")
    assert manifest.source.files == {name: blake3.blake3((source.checkpoint.root / name).read_bytes()).hexdigest()
                                     for name in source.checkpoint.shard_files}
    assert manifest.files == {p.name: blake3.blake3(p.read_bytes()).hexdigest()
                              for p in out.iterdir() if p.name != "manifest.json"}
    if manifest.source.repo_id is None:
        assert manifest.source.hub_sha256 == {}  # a local folder: no Hub metadata
    for name, record in manifest.all_tensors.items():
        raw = as_bytes(tensors[name]).numpy().tobytes()
        assert blake3.blake3(raw).hexdigest() == record.digest, name
    for prefix, layer in source.layers.items():
        record = manifest.layers[prefix]
        runtime = bundle.runtime_layer(prefix)
        back = target.from_runtime(runtime, record.n, record.k)
        original = target.as_read(source.load_layer(layer))
        for a, b in ((back.codes, original.codes), (back.block_scales, original.block_scales),
                     (back.multiplier, original.multiplier)):
            assert torch.equal(as_bytes(a), as_bytes(b)), prefix
        if target.scheme == "W4A4":
            expected = source.read_input_scale(prefix)
            assert back.input_scale is not None
            assert torch.equal(back.input_scale.scale, expected.scale), prefix
            assert torch.equal(back.input_scale.inverse, expected.inverse), prefix
        assert record.global_scale == float(original.multiplier)
        assert tensors[f"{prefix}.weight_global_scale"].dtype == torch.float32
    consumed = {source.input_scale_name(p) for p in source.layers} if target.scheme == "W4A4" else set()
    for name in set(source.passthrough) - consumed:
        assert torch.equal(as_bytes(tensors[name]), as_bytes(source.checkpoint.read(name))), name
    assert set(tensors) == set(manifest.all_tensors)
    return manifest


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_convert_synthetic(make_model, tmp_path, target, fmt, w4a4):
    model = make_model(fmt, w4a4=w4a4, shards=2)
    out = tmp_path / "bundle"
    summary = convert(model.path, target.name, out)
    assert summary.layers == len(model.layers)
    check_bundle_against_source(model.path, out, target)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == json.loads((model.path / "config.json").read_text())["quantization_config"]
    assert config["nvfp4_repack"]["target"] == target.name
    for side in ("tokenizer_config.json", "recipe.yaml"):
        assert (out / side).read_bytes() == (model.path / side).read_bytes()
    if fmt == "modelopt":
        assert (out / "hf_quant_config.json").exists()
    assert not list(tmp_path.glob(".bundle*")), "no staging folder left behind"


PRODUCER_FIXTURES = sorted(p.name for p in PRODUCERS.iterdir() if (p / "config.json").exists() and
                           "quantization_config" in (p / "config.json").read_text() and
                           p.name not in REFUSED_FIXTURES and p.name not in MOE_FIXTURES) if PRODUCERS.exists() else []


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("fixture", PRODUCER_FIXTURES)
def test_convert_real_producer_checkpoints(tmp_path, target, fixture):
    out = tmp_path / "bundle"
    # vLLM 0.34 (the default) refuses the Hadamard-rotated W4A4 fixtures on sm100 / sm120, 0.33 the weight-only ones
    # on sm120 (Marlin there; tests/test_engines.py)
    convert(PRODUCERS / fixture, target.name, out, vllm="0.33" if "_had" in fixture and "a16" not in fixture else None)
    manifest = check_bundle_against_source(PRODUCERS / fixture, out, target)
    assert manifest.layers


def test_real_producer_fixtures_exist():
    formats = {read_source(PRODUCERS / f).format for f in PRODUCER_FIXTURES}
    assert formats == {"modelopt", "compressed-tensors"}


def test_small_shards_are_indexed(make_model, tmp_path):
    model = make_model("modelopt", shapes=[(64, 256)] * 6)
    out = tmp_path / "bundle"
    convert(model.path, "sm100", out, max_shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    check_bundle_against_source(model.path, out, TARGETS[0])


def test_existing_output_is_never_touched(make_model, tmp_path):
    model = make_model()
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    for overwrite in (False, True):  # no "overwrite" hint: overwriting would be refused as well
        with pytest.raises(RepackError, match="not an nvfp4-repack bundle") as caught:
            convert(model.path, "sm100", out, overwrite=overwrite)
        assert not isinstance(caught.value, OutputExists)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"


def test_overwrite_replaces_a_bundle(make_model, tmp_path):
    out = tmp_path / "bundle"
    convert(make_model().path, "sm100", out)
    convert(make_model().path, "sm120", out, overwrite=True)
    assert open_bundle(out).manifest.target == "sm120"


def test_failure_midway_leaves_nothing(make_model, tmp_path):
    model = make_model(shapes=[(16, 32), (32, 64)])
    # Corrupt the second layer's scales with a NaN: found only when its data is read, after writing began.
    path = model.path / "model.safetensors"
    from repack.formats.checkpoint import open_checkpoint

    entry = open_checkpoint(model.path).tensors["model.layers.1.mlp.proj.weight_scale"]
    data = bytearray(path.read_bytes())
    data[entry.begin] = 0x7F
    path.write_bytes(bytes(data))
    out = tmp_path / "bundle"
    with pytest.raises(RepackError, match="model.layers.1.mlp.proj: block scales contain NaN"):
        convert(model.path, "sm120", out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_output_may_not_replace_the_source(make_model):
    model = make_model()
    with pytest.raises(RepackError, match="would replace the input"):
        convert(model.path, "sm100", model.path, overwrite=True)
    assert (model.path / "model.safetensors").exists()


def test_cli_sample_then_inspect(tmp_path, capsys):
    out = tmp_path / "sample-sm100"
    assert main(["convert", "--sample", "--target", "sm100", "-o", str(out), "--json"]) == 0
    [summary] = json.loads(capsys.readouterr().out)  # a list for one target as for several (issue 38)
    assert summary["layers"] == 14 and summary["target"] == "sm100"
    assert main(["inspect", str(out), "--json"]) == 0
    assert [m["target"] for m in json.loads(capsys.readouterr().out)] == ["sm100"]  # a list, as for several
    assert main(["targets", "--json"]) == 0
    assert {t["name"] for t in json.loads(capsys.readouterr().out)} >= {"sm100", "sm120"}


@pytest.mark.parametrize("flags,members", [(["--fuse"], [""]), (["--tp", "2"], ["rank-0", "rank-1"])])
def test_the_sample_shows_fuse_and_tp(tmp_path, capsys, flags, members):
    """The built-in sample converts fused and per TP rank without --rescale (one global scale per fused module,
    per-rank K a multiple of 16), and verify passes; the tokenizer `vllm serve OUT` reads is at OUT's top."""
    out = tmp_path / "out"
    assert main(["convert", "--sample", "-t", "sm100", *flags, "-o", str(out), "--json"]) == 0
    assert [s["rescaled"] for s in json.loads(capsys.readouterr().out)] == [{}]
    for member in members:
        manifest = open_bundle(out / member).manifest
        assert sorted(manifest.fusion) == ["mlp.gate_up_proj", "self_attn.qkv_proj"]
        assert manifest.tp_size == len(members) and "model.layers.1.mlp.gate_up_proj" in manifest.layers
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {p.name for p in out.iterdir()}
    assert main(["verify", str(out), "--json"]) == 0, capsys.readouterr().out[-3000:]


def test_inspect_sample(capsys):
    assert main(["inspect", "--sample", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    source = read_source(SAMPLE_DIR)
    assert (info["path"], info["quantized_layers"]) == (str(SAMPLE_DIR), len(source.layers))
    assert sum(row["count"] for row in info["layer_shapes"]) == len(source.layers)
    assert main(["inspect", "--sample", str(SAMPLE_DIR)]) == 2  # one or the other
    assert "either PATH or --sample" in capsys.readouterr().err


def test_aliases_of_one_family_write_one_plain_bundle(tmp_path, monkeypatch, capsys):
    """`-t sm100 -t sm103` is one family: one bundle at OUT (default <model>-sm100), not OUT/sm100; --fuse takes it."""
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "--sample", "-t", "sm100", "-t", "SM103", "--fuse"]) == 0
    out = tmp_path / "tiny-llama-nvfp4-sm100"
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    assert open_bundle(out).manifest.target == "sm100" and not (out / "sm100").exists()
    summary = convert(SAMPLE_DIR, ["sm103", "sm107"], tmp_path / "lib")
    assert not isinstance(summary, list) and summary.target == "sm100"
    assert isinstance(convert(SAMPLE_DIR, ["sm103", "sm120"], tmp_path / "two"), list)


@pytest.mark.parametrize("size,nbytes", [("4GiB", 4 * 2**30), ("1.5 MiB", 3 * 2**19), ("64kib", 2**16),
                                         ("2TiB", 2 * 2**40), ("64KB", 64_000), ("5GB", 5 * 10**9)])
def test_shard_sizes_take_decimal_and_binary_units(size, nbytes):
    from repack.bundle.plan import parse_size

    assert parse_size(size) == nbytes


@pytest.mark.parametrize("size", ["4Gi", "5", "GiB", "-1MiB", "0KiB"])
def test_shard_sizes_need_a_unit_and_a_positive_number(size, capsys, tmp_path):
    assert main(["convert", "--sample", "-t", "sm100", "--max-shard-size", size, "-o", str(tmp_path / "o")]) == 2
    assert "such as 5GB, 500MB or 4GiB" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_binary_shard_size_on_the_cli(tmp_path, capsys):
    """64KiB (65536 bytes) and 64KB (64000) plan differently on the sample: the unit is read, not ignored."""
    shards = {}
    for size in ("64KiB", "64KB", "1MiB"):
        assert main(["convert", "--sample", "-t", "sm100", "--max-shard-size", size, "-o", str(tmp_path / size)]) == 0
        shards[size] = len(list((tmp_path / size).glob("*.safetensors")))
    assert shards["1MiB"] == 1 and shards["64KiB"] >= 2


def test_bench_convert_with_a_missing_dir_is_a_one_line_usage_error(tmp_path):
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "scripts" / "bench_convert.py"), "--dir", str(tmp_path / "no")],
                         capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stderr) == (2, f"Error: --dir {tmp_path / 'no'}: no such folder\n")
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize(
    "argv,code,message",
    [
        (["convert", "/does/not/exist", "--target", "sm100"], 1, "no such file or directory"),
        (["convert", "--sample"], 2, "Missing option"),
        (["inspect", "/does/not/exist"], 1, "no such file"),
        # usage errors (exit 2, issue 38: these exited 1): flag values and combinations, refused before any read
        (["convert", "--sample", "--target", "sm70", "-o", "x"], 2, "'--target': unknown target 'sm70'; valid targets: sm100"),
        (["convert", "--sample", "-t", "sm999", "-o", "x"], 2, "unknown target 'sm999'"),
        *[(["convert", "--sample", "-t", "sm100", "--max-shard-size", size, "-o", "x"], 2,
           f"'--max-shard-size': shard size '{size}': expected a positive size") for size in ("5", "abc", "0GB", "-1GB")],
        (["convert", "--sample", "-t", "all", "--fuse", "-o", "x"], 2, "--fuse/--tp take one target family"),
        (["convert", "--sample", "-t", "all", "--tp", "2", "-o", "x"], 2, "--fuse/--tp take one target family"),
        # audit: this read "--fuse/--tp take one target" (neither given; --engine sglang fuses)
        (["convert", "--sample", "-t", "all", "--engine", "sglang", "-o", "x"], 2,
         "--engine sglang (its bundles are fused, as the engine holds them) takes one target family"),
        (["convert", "--sample", "-t", "sm100", "--tp", "2", "--resume", "-o", "x"], 2, "--resume is not supported with --tp"),
        # audit: the new options' combinations were bad input (exit 1), refused by the library after the CLI's checks
        (["convert", "--sample", "-t", "sm100", "--engine", "sglang", "--vllm", "0.33", "-o", "x"], 2,
         "--vllm 0.33 names a vLLM version; an --engine sglang bundle is for sglang"),
        (["convert", "--sample", "-t", "sm100", "--engine", "sglang", "--linear-backend", "marlin", "-o", "x"], 2,
         "--linear-backend names a vLLM kernel"),
        (["convert", "--sample", "-t", "sm120", "--weight-only", "--linear-backend", "marlin", "-o", "x"], 2,
         "--linear-backend marlin --weight-only: --weight-only picks the family's weight-only kernel itself"),
        (["convert", "--sample", "-t", "sm100", "--engine", "sglang", "--rescale", "-o", "x"], 2,
         "--engine sglang --rescale: SGLang keeps each partition's weight_scale_2 as loaded"),
        (["convert", "--sample", "-t", "sm100", "--bogus", "-o", "x"], 2, "No such option: --bogus"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch, argv, code, message):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == code
    err = capsys.readouterr().err
    assert message in err and err.startswith("Error: ") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command,text", [("convert", "<model>-<target>"), ("verify", "recorded in"),
                                          ("inspect", "bundle folder"), ("targets", "backends")])
def test_help_is_complete(capsys, command, text):
    assert main([command, "--help"]) == 0
    assert text in " ".join(capsys.readouterr().out.split())


def test_each_layer_is_converted_once_and_kept_in_one_shard(make_model, tmp_path, monkeypatch):
    """Even when a layer's weight alone exceeds --max-shard-size (the splitter gives such tensors own shards)."""
    from repack.formats import SourceModel

    model = make_model("modelopt", shapes=[(128, 512)] * 4)
    target = TARGETS[0]
    calls = []
    real = SourceModel.load_layer
    monkeypatch.setattr(SourceModel, "load_layer",
                        lambda self, layer, *read: calls.append(layer.prefix) or real(self, layer, *read))
    convert(model.path, target.name, tmp_path / "bundle", max_shard_size=10_000)
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 4
    monkeypatch.undo()
    manifest = open_bundle(tmp_path / "bundle").manifest
    for layer in manifest.layers.values():
        assert len({record.file for record in layer.tensors.values()}) == 1
    check_bundle_against_source(model.path, tmp_path / "bundle", target)


def test_layers_that_finish_transforming_out_of_order_are_written_in_order(make_model, tmp_path, monkeypatch):
    """Layers transform in parallel (a pool shared by the pass's outputs): the first layer is held back until a
    later one has finished, and every bundle is still byte for byte the one of an unhindered run."""
    import dataclasses
    import os
    import threading

    import repack.convert

    model = make_model("compressed-tensors", shapes=[(128, 512), (256, 256), (128, 768)], shards=2)
    convert(model.path, ["sm100", "sm90"], tmp_path / "plain")
    finished, later_done = [], threading.Event()

    def held_back(real):
        def to_runtime(weight):
            if weight.n == 128 and weight.k == 512:  # the first layer: wait (boundedly) for a later one
                later_done.wait(timeout=10)
            result = real(weight)
            finished.append((weight.n, weight.k))
            if (weight.n, weight.k) != (128, 512):
                later_done.set()
            return result
        return to_runtime

    resolve = repack.convert.resolve_target
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # a worker for each output's held-back layer, and more
    monkeypatch.setattr(repack.convert, "resolve_target",
                        lambda name: dataclasses.replace(resolve(name), to_runtime=held_back(resolve(name).to_runtime)))
    convert(model.path, ["sm100", "sm90"], tmp_path / "held")
    assert finished.index((128, 512)) > 0, f"the first layer finished first: {finished}"
    for target in ("sm100", "sm90"):
        names = sorted(f.name for f in (tmp_path / "plain" / target).iterdir())
        assert names == sorted(f.name for f in (tmp_path / "held" / target).iterdir())
        for name in names:
            if name != "manifest.json":  # it records the source path, the same here, and nothing else varies
                assert (tmp_path / "plain" / target / name).read_bytes() == \
                       (tmp_path / "held" / target / name).read_bytes(), name
        check_bundle_against_source(model.path, tmp_path / "held" / target, resolve(target))


def test_a_manifest_in_the_source_folder_is_not_copied(make_model, tmp_path):
    model = make_model()
    (model.path / "manifest.json").write_text('{"unrelated": true}')
    out = tmp_path / "bundle"
    convert(model.path, "sm100", out)
    assert "manifest.json" not in open_bundle(out).manifest.files
    from repack.verify import verify_bundle

    assert verify_bundle(out).passed


def test_runtime_refuses_a_tensor_of_the_wrong_shape(make_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from repack.runtime import load_bundle

    model = make_model(shapes=[(128, 256)])
    out = tmp_path / "bundle"
    convert(model.path, "sm100", out)
    name = "model.layers.0.mlp.proj.weight"
    tensors = load_file(out / "model.safetensors")
    tensors[name] = tensors[name][:64].clone()
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(RepackError, match="is not the sm100 layout"):
        load_bundle(out).layer("model.layers.0.mlp.proj")


def test_mapped_source_tensors_convert_as_read_ones(make_model, tmp_path, monkeypatch):
    """Every source tensor mapped from its file (MAP_MIN_BYTES = 0), at the unaligned offsets safetensors gives
    them, in chunks of a few KB for passthrough tensors: the bundles of all targets are byte for byte those of
    plain reads, and decode back to the source."""
    from repack.formats import safetensors_io

    model = make_model("modelopt", shards=2)
    offsets = {e.begin % 8 for e in read_source(model.path).checkpoint.tensors.values()}
    assert offsets != {0}, "the fixture should hold tensors at unaligned file offsets"
    monkeypatch.setattr(safetensors_io, "MAP_MIN_BYTES", 1 << 40)
    convert(model.path, "all", tmp_path / "read")
    monkeypatch.setattr(safetensors_io, "MAP_MIN_BYTES", 0)
    chunks = safetensors_io.map_chunks
    monkeypatch.setattr(safetensors_io, "map_chunks", lambda entry: chunks(entry, chunk=1000))
    from repack.formats import hashing

    monkeypatch.setattr(hashing, "map_chunks", safetensors_io.map_chunks)
    convert(model.path, "all", tmp_path / "mapped")
    for target in TARGETS:
        check_bundle_against_source(model.path, tmp_path / "mapped" / target.name, target)
        for file in sorted((tmp_path / "read" / target.name).iterdir()):
            if file.name != "manifest.json":  # it records the source path, the same here, and nothing else varies
                assert file.read_bytes() == (tmp_path / "mapped" / target.name / file.name).read_bytes(), file.name
