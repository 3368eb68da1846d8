"""Hostile and broken inputs: a one-line error naming the file or tensor, exit code 1, nothing written.

Each corpus case is a small function that damages a fresh checkpoint (or builds the broken input from
scratch) and returns the path to hand to the CLI, with a substring the error must contain. Every case
runs ``convert`` (into a fresh OUT, and over an existing OUT with and without ``--overwrite``) and, where
the damage is visible from headers alone, ``inspect``.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from repack.cli import main
from repack.convert import convert
from repack.formats.checkpoint import open_checkpoint
from repack.sample import SAMPLE_DIR

LAYER = "model.layers.1.mlp.proj"
SHAPES = [(16, 32), (32, 64)]


# --- helpers that damage checkpoints ------------------------------------------------------------------------------


def small(make_model, fmt: str = "compressed-tensors", **kwargs) -> Path:
    return make_model(fmt, shapes=SHAPES, **kwargs).path


def read_raw(file: Path) -> tuple[dict, bytes]:
    blob = file.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def write_raw(file: Path, header: object, data: bytes = b"", length: int | None = None) -> None:
    body = json.dumps(header).encode() if not isinstance(header, bytes) else header
    file.write_bytes((len(body) if length is None else length).to_bytes(8, "little") + body + data)


def edit_header(file: Path, edit) -> None:
    header, data = read_raw(file)
    edit(header)
    write_raw(file, header, data)


def edit_tensors(root: Path, edit, file: str = "model.safetensors") -> None:
    tensors = load_file(root / file)
    edit(tensors)
    save_file(tensors, root / file, metadata={"format": "pt"})


def overwrite_bytes(root: Path, name: str, payload: bytes, offset: int = 0) -> None:
    entry = open_checkpoint(root).tensors[name]
    assert offset + len(payload) <= entry.nbytes
    data = bytearray(entry.file.read_bytes())
    data[entry.begin + offset : entry.begin + offset + len(payload)] = payload
    entry.file.write_bytes(bytes(data))


def edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


# --- the corpus -----------------------------------------------------------------------------------------------------

CASES = []


def case(match: str | tuple[str, ...], *, inspect: bool = True):
    """Register a corpus case: ``match``, substring(s) the error must contain; ``inspect``: the damage is
    visible to ``inspect`` (headers and config only)."""

    def register(fn):
        CASES.append(pytest.param((fn, match, inspect), id=fn.__name__))
        return fn

    return register


@case("does-not-exist: no such file or directory")
def missing_path(make_model, tmp_path):
    return tmp_path / "does-not-exist"


@case("not a directory")
def path_is_a_file(make_model, tmp_path):
    return small(make_model) / "model.safetensors"


@case("no config.json")
def empty_folder(make_model, tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


@case("no .safetensors weights found")
def config_without_weights(make_model, tmp_path):
    root = small(make_model)
    (root / "model.safetensors").unlink()
    return root


@case("config.json: invalid JSON")
def invalid_config_json(make_model, tmp_path):
    root = small(make_model)
    (root / "config.json").write_text('{"model_type": "llama", ')
    return root


@case("config.json: invalid JSON")
def config_json_not_utf8(make_model, tmp_path):
    root = small(make_model)
    (root / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    return root


@case("config.json: expected a JSON object")
def config_json_not_an_object(make_model, tmp_path):
    root = small(make_model)
    (root / "config.json").write_text("[1, 2, 3]")
    return root


@case("config.json: invalid JSON")
def config_json_deeply_nested(make_model, tmp_path):
    root = small(make_model)
    (root / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    return root


@case("not an NVFP4 checkpoint (quantization method: none)")
def unquantized_checkpoint(make_model, tmp_path):
    root = tmp_path / "bf16"
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "llama"}')
    save_file({"model.layers.0.mlp.proj.weight": torch.randn(16, 32).to(torch.bfloat16)}, root / "model.safetensors")
    return root


@case("not an NVFP4 checkpoint (quantization method: fp8)")
def other_quantization_method(make_model, tmp_path):
    root = small(make_model)
    edit_json(root / "config.json", lambda c: c.update(quantization_config={"quant_method": "fp8"}))
    return root


@case("pytorch_model.bin")
def pickle_weights_only(make_model, tmp_path):
    root = small(make_model)
    (root / "model.safetensors").unlink()
    # A pickle that would run code if it were ever unpickled.
    (root / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'touch /tmp/pwned-by-nvfp4-repack'\ntR.")
    return root


@case("model.safetensors: not a valid safetensors file")
def shorter_than_the_length_field(make_model, tmp_path):
    root = small(make_model)
    (root / "model.safetensors").write_bytes(b"\x10\x00\x00")
    return root


@case("model.safetensors: header length")
def truncated_inside_the_header(make_model, tmp_path):
    root = small(make_model)
    (root / "model.safetensors").write_bytes((root / "model.safetensors").read_bytes()[:40])
    return root


@case(("model.safetensors: tensor ", "spans bytes", "past the end of the file"))
def truncated_data(make_model, tmp_path):
    root = small(make_model)
    file = root / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-3])
    return root


@case("model.safetensors: not a valid safetensors file (header length 1099511627776 bytes exceeds")
def header_length_claims_a_terabyte(make_model, tmp_path):
    root = small(make_model)
    file = root / "model.safetensors"
    file.write_bytes((2**40).to_bytes(8, "little") + file.read_bytes()[8:])
    return root


@case("model.safetensors: not a valid safetensors file (header length 18446744073709551615")
def header_length_all_ones(make_model, tmp_path):
    root = small(make_model)
    file = root / "model.safetensors"
    file.write_bytes(b"\xff" * 8 + file.read_bytes()[8:])
    return root


@case("model.safetensors: not a valid safetensors file (header is not JSON")
def header_not_json(make_model, tmp_path):
    root = small(make_model)
    write_raw(root / "model.safetensors", b"\x00garbage" * 8, b"\x00" * 64)
    return root


@case("model.safetensors: not a valid safetensors file (header is not UTF-8)")
def header_not_utf8(make_model, tmp_path):
    root = small(make_model)
    write_raw(root / "model.safetensors", b'{"\xff": 1}   ')
    return root


@case("model.safetensors: not a valid safetensors file (header is a JSON list)")
def header_is_a_list(make_model, tmp_path):
    root = small(make_model)
    write_raw(root / "model.safetensors", [1, 2])
    return root


@case("model.safetensors: the header lists 'model.layers.0.mlp.proj.weight_packed' more than once")
def duplicate_name_inside_one_header(make_model, tmp_path):
    root = small(make_model)
    file = root / "model.safetensors"
    header, data = read_raw(file)
    name = "model.layers.0.mlp.proj.weight_packed"
    body = json.dumps(header)
    dup = json.dumps({name: header[name]})[1:-1]
    write_raw(file, ("{" + dup + ", " + body[1:]).encode(), data)
    return root


@case("model.safetensors: tensor 'model.layers.1.mlp.proj.weight_packed' spans bytes")
def offsets_past_the_end(make_model, tmp_path):
    root = small(make_model)

    def edit(header):
        begin, end = header[f"{LAYER}.weight_packed"]["data_offsets"]
        header[f"{LAYER}.weight_packed"]["data_offsets"] = [begin + 10**6, end + 10**6]

    edit_header(root / "model.safetensors", edit)
    return root


@case("model.safetensors: tensor 'model.layers.1.mlp.proj.weight_packed' spans bytes")
def offsets_reversed(make_model, tmp_path):
    root = small(make_model)

    def edit(header):
        begin, end = header[f"{LAYER}.weight_packed"]["data_offsets"]
        header[f"{LAYER}.weight_packed"]["data_offsets"] = [end, begin]

    edit_header(root / "model.safetensors", edit)
    return root


@case(("model.safetensors: tensors", "'model.layers.0.mlp.proj.weight_packed'",
       "'model.layers.0.mlp.proj.weight_scale'", "overlap"))
def overlapping_offsets(make_model, tmp_path):
    root = small(make_model)

    def edit(header):
        a, b = (header[f"model.layers.0.mlp.proj.{part}"] for part in ("weight_packed", "weight_scale"))
        size = b["data_offsets"][1] - b["data_offsets"][0]
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + size]

    edit_header(root / "model.safetensors", edit)
    return root


@case("model.safetensors: tensor 'model.layers.1.mlp.proj.weight_packed' spans bytes")
def size_does_not_match_shape(make_model, tmp_path):
    root = small(make_model)
    edit_header(root / "model.safetensors", lambda h: h[f"{LAYER}.weight_packed"].update(shape=[32, 16]))
    return root


@case("model.safetensors: tensor 'model.layers.1.mlp.proj.weight_packed': U8 [1099511627776, 1099511627776] is larger")
def shape_claims_a_yottabyte(make_model, tmp_path):
    root = small(make_model)
    edit_header(root / "model.safetensors", lambda h: h[f"{LAYER}.weight_packed"].update(shape=[2**40, 2**40]))
    return root


@case("model.safetensors: tensor 'model.layers.1.mlp.proj.weight_packed' has an invalid shape")
def negative_shape(make_model, tmp_path):
    root = small(make_model)
    edit_header(root / "model.safetensors", lambda h: h[f"{LAYER}.weight_packed"].update(shape=[-32, -16]))
    return root


@case("model.safetensors: tensor 'model.layers.1.mlp.proj.weight_packed' has an invalid shape")
def string_in_shape(make_model, tmp_path):
    root = small(make_model)
    # huggingface_hub's parser computes a parameter count with reduce(mul): "x" * 2**40 is a 1 TB string.
    edit_header(root / "model.safetensors", lambda h: h[f"{LAYER}.weight_packed"].update(shape=["x", 2**40]))
    return root


@case("model.safetensors: tensor 'model.layers.1.mlp.proj.weight_packed' has unsupported dtype 'F4'")
def unknown_dtype(make_model, tmp_path):
    root = small(make_model)
    edit_header(root / "model.safetensors", lambda h: h[f"{LAYER}.weight_packed"].update(dtype="F4"))
    return root


@case("model.safetensors: tensor 'model.layers.1.mlp.proj.weight_packed' must be an object")
def tensor_entry_not_an_object(make_model, tmp_path):
    root = small(make_model)
    edit_header(root / "model.safetensors", lambda h: h.update({f"{LAYER}.weight_packed": [1, 2, 3]}))
    return root


@case("model.safetensors: __metadata__ must map names to strings")
def metadata_not_strings(make_model, tmp_path):
    root = small(make_model)
    edit_header(root / "model.safetensors", lambda h: h.update(__metadata__={"format": ["pt"]}))
    return root


@case("the weight files hold no tensors")
def no_tensors(make_model, tmp_path):
    root = small(make_model)
    write_raw(root / "model.safetensors", {"__metadata__": {"format": "pt"}})
    return root


@case("model.layers.1.mlp.proj: quantized layer is missing tensor 'model.layers.1.mlp.proj.weight_scale'")
def missing_block_scale(make_model, tmp_path):
    root = small(make_model)
    edit_tensors(root, lambda t: t.pop(f"{LAYER}.weight_scale"))
    return root


@case("model.layers.1.mlp.proj.weight_global_scale: global scale without a packed NVFP4 weight")
def missing_packed_weight(make_model, tmp_path):
    root = small(make_model)
    edit_tensors(root, lambda t: t.pop(f"{LAYER}.weight_packed"))
    return root


@case("model.layers.1.mlp.proj.weight: packed NVFP4 weight must be U8 (two E2M1 codes a byte), got F32 [32, 64], "
      "though the layer has NVFP4 scales (model.layers.1.mlp.proj.weight_scale_2)")
def weight_stored_as_f32(make_model, tmp_path):
    """Regression (issue 38): reported as "global scale without a packed NVFP4 weight", naming the weight that is there."""
    root = small(make_model, "modelopt")
    edit_tensors(root, lambda t: t.update({f"{LAYER}.weight": torch.zeros(32, 64)}))
    return root


@case("model.layers.1.mlp.proj.weight_scale: block scales must be F8_E4M3, got F16")
def wrong_scale_dtype(make_model, tmp_path):
    root = small(make_model)
    edit_tensors(root, lambda t: t.update({f"{LAYER}.weight_scale": t[f"{LAYER}.weight_scale"].to(torch.float16)}))
    return root


@case("model.layers.1.mlp.proj.weight_scale: block scales must be F8_E4M3, got U8")
def scale_stored_as_bytes(make_model, tmp_path):
    root = small(make_model, "modelopt")
    edit_tensors(root, lambda t: t.update({f"{LAYER}.weight_scale": t[f"{LAYER}.weight_scale"].view(torch.uint8)}))
    return root


@case("model.layers.1.mlp.proj.weight_scale: shape [32, 8] does not match weight model.layers.1.mlp.proj.weight_packed")
def scale_shape_mismatch(make_model, tmp_path):
    root = small(make_model)
    edit_tensors(root, lambda t: t.update({f"{LAYER}.weight_scale": t[f"{LAYER}.weight_scale"].repeat(1, 2)}))
    return root


@case("model.layers.1.mlp.proj.weight_scale: shape [4] does not match weight")
def scale_flattened(make_model, tmp_path):
    root = small(make_model)
    edit_tensors(root, lambda t: t.update({f"{LAYER}.weight_scale": t[f"{LAYER}.weight_scale"][:1].reshape(-1)}))
    return root


@case("model.layers.1.mlp.proj.weight_packed: K=24 must be a positive multiple of 16")
def k_not_a_multiple_of_16(make_model, tmp_path):
    root = small(make_model)

    def edit(t):
        t[f"{LAYER}.weight_packed"] = t[f"{LAYER}.weight_packed"][:, :12].contiguous()
        t[f"{LAYER}.weight_scale"] = t[f"{LAYER}.weight_scale"][:, :1].contiguous()

    edit_tensors(root, edit)
    return root


@case("model.layers.1.mlp.proj.weight_packed: packed weight must be 2-D U8, got I32 [32, 8]")
def packed_weight_wrong_dtype(make_model, tmp_path):
    root = small(make_model)
    edit_tensors(root, lambda t: t.update({f"{LAYER}.weight_packed": t[f"{LAYER}.weight_packed"].view(torch.int32)}))
    return root


@case("model.layers.1.mlp.proj.weight_global_scale: global scale must be one F32, got F32 [2]")
def global_scale_two_values(make_model, tmp_path):
    root = small(make_model)
    name = f"{LAYER}.weight_global_scale"
    edit_tensors(root, lambda t: t.update({name: t[name].repeat(2)}))
    return root


@case("model.layers.1.mlp.proj.weight_global_scale: global scale must be one F32, got F16")
def global_scale_half(make_model, tmp_path):
    root = small(make_model)
    edit_tensors(root, lambda t: t.update(
        {f"{LAYER}.weight_global_scale": t[f"{LAYER}.weight_global_scale"].to(torch.float16)}))
    return root


def _global_scale_case(label: str, value: float, fmt: str):
    def build(make_model, tmp_path):
        root = small(make_model, fmt)
        name = f"{LAYER}.weight_global_scale" if fmt == "compressed-tensors" else f"{LAYER}.weight_scale_2"
        overwrite_bytes(root, name, struct.pack("<f", value))
        return root

    build.__name__ = f"global_scale_{label}_{fmt}".replace("-", "_")
    return build


GLOBAL_SCALES = {"nan": math.nan, "inf": math.inf, "neg_inf": -math.inf, "zero": 0.0, "neg_zero": -0.0, "neg": -2.0}
for _label, _value in GLOBAL_SCALES.items():
    for _fmt in ("compressed-tensors", "modelopt"):
        case("model.layers.1.mlp.proj: global scale must be finite and positive", inspect=False)(
            _global_scale_case(_label, _value, _fmt))


@case("model.layers.1.mlp.proj: block scales contain NaN", inspect=False)
def nan_in_block_scales(make_model, tmp_path):
    root = small(make_model)
    overwrite_bytes(root, f"{LAYER}.weight_scale", b"\xff", offset=37)
    return root


@case("model.layers.1.mlp.proj: block scales contain negative values", inspect=False)
def negative_block_scale(make_model, tmp_path):
    root = small(make_model, "modelopt")
    overwrite_bytes(root, f"{LAYER}.weight_scale", b"\xb8", offset=5)
    return root


@case("appears in both model-00001-of-00002.safetensors and model-00002-of-00002.safetensors")
def duplicate_tensor_across_shards(make_model, tmp_path):
    root = small(make_model, shards=2)
    first = load_file(root / "model-00001-of-00002.safetensors")
    name = next(iter(first))
    edit_tensors(root, lambda t: t.update({name: first[name]}), file="model-00002-of-00002.safetensors")
    return root


@case("appears in both extra.safetensors and model.safetensors")
def duplicate_tensor_across_unindexed_files(make_model, tmp_path):
    root = small(make_model)
    save_file({f"{LAYER}.weight_scale": load_file(root / "model.safetensors")[f"{LAYER}.weight_scale"]},
              root / "extra.safetensors")
    return root


@case("model.safetensors.index.json: names shard 'model-00003-of-00003.safetensors', which is missing")
def index_names_a_missing_shard(make_model, tmp_path):
    root = small(make_model, shards=2)
    edit_json(root / "model.safetensors.index.json",
              lambda i: i["weight_map"].update({"lm_head.weight": "model-00003-of-00003.safetensors"}))
    return root


@case("model.safetensors.index.json: names tensor 'model.layers.7.mlp.proj.weight_packed'")
def index_names_a_missing_tensor(make_model, tmp_path):
    root = small(make_model, shards=2)
    edit_json(root / "model.safetensors.index.json",
              lambda i: i["weight_map"].update(
                  {"model.layers.7.mlp.proj.weight_packed": "model-00001-of-00002.safetensors"}))
    return root


@case("model.safetensors.index.json: shard name '../model.safetensors' is not a plain file name")
def index_shard_escapes(make_model, tmp_path):
    root = small(make_model, shards=2)
    edit_json(root / "model.safetensors.index.json",
              lambda i: i["weight_map"].update({"lm_head.weight": "../model.safetensors"}))
    return root


@case("model.safetensors.index.json: missing or empty 'weight_map'")
def index_without_weight_map(make_model, tmp_path):
    root = small(make_model, shards=2)
    (root / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": []}')
    return root


@case("model.safetensors.index.json: invalid JSON")
def index_invalid_json(make_model, tmp_path):
    root = small(make_model, shards=2)
    (root / "model.safetensors.index.json").write_text("{")
    return root


@case("model.safetensors: points outside the model folder")
def symlinked_shard_escapes(make_model, tmp_path):
    root = small(make_model)
    outside = tmp_path / "outside.safetensors"
    (root / "model.safetensors").rename(outside)
    (root / "model.safetensors").symlink_to(outside)
    return root


@case("config.json: points outside the model folder")
def symlinked_config_escapes(make_model, tmp_path):
    root = small(make_model)
    outside = tmp_path / "outside-config.json"
    (root / "config.json").rename(outside)
    (root / "config.json").symlink_to(outside)
    return root


@case("tokenizer.json: points outside the model folder", inspect=False)
def symlinked_side_file_escapes(make_model, tmp_path):
    root = small(make_model)
    (tmp_path / "secret.txt").write_text("do not copy me into a bundle")
    (root / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    return root


@case("model.safetensors: not a regular file")
def shard_is_a_folder(make_model, tmp_path):
    root = small(make_model)
    (root / "model.safetensors").unlink()
    (root / "model.safetensors").mkdir()
    return root


@case("transform_config must be an object with only 'config_groups'")
def transform_config(make_model, tmp_path):
    root = small(make_model)
    edit_json(root / "config.json", lambda c: c["quantization_config"].update(transform_config={"u": {}}))
    return root


@case("config.json: weight scheme")
def weights_scheme_of_the_wrong_type(make_model, tmp_path):
    root = small(make_model)
    edit_json(root / "config.json",
              lambda c: c["quantization_config"]["config_groups"]["group_0"].update(weights=["num_bits", 4]))
    return root


@case("config.json: compressed-tensors format")
def format_of_the_wrong_type(make_model, tmp_path):
    root = small(make_model)
    edit_json(root / "config.json",
              lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format=["nvfp4-pack-quantized"]))
    return root


@case("config.json: compressed-tensors quantization_config has no config_groups")
def config_groups_missing(make_model, tmp_path):
    root = small(make_model)
    edit_json(root / "config.json", lambda c: c["quantization_config"].pop("config_groups"))
    return root


@case("hf_quant_config.json: missing 'quantization' object")
def hf_quant_config_without_quantization(make_model, tmp_path):
    root = small(make_model, "modelopt")
    (root / "hf_quant_config.json").write_text('{"quantization": "NVFP4"}')
    return root


@case("ModelOpt quant_algo 'FP8' is not supported")
def modelopt_fp8(make_model, tmp_path):
    root = small(make_model, "modelopt")
    edit_json(root / "hf_quant_config.json", lambda c: c["quantization"].update(quant_algo="FP8"))
    return root


@case("would collide with the converted layer 'model.layers.1.mlp.proj'", inspect=False)
def passthrough_collides_with_output(make_model, tmp_path):
    root = small(make_model)
    edit_tensors(root, lambda t: t.update({f"{LAYER}.weight": torch.zeros(4)}))
    return root


@case("is an nvfp4-repack bundle", inspect=False)  # inspect describes the bundle
def a_bundle_as_input(make_model, tmp_path):
    bundle = tmp_path / "already-a-bundle"
    convert(small(make_model), "sm100", bundle)
    return bundle


@case("is an nvfp4-repack bundle")
def a_bundle_without_its_manifest_as_input(make_model, tmp_path):
    bundle = tmp_path / "already-a-bundle"
    convert(small(make_model), "sm120", bundle)
    (bundle / "manifest.json").unlink()
    return bundle


@case(r"model.layers.1.mlp.proj\nError: forged line [/bold]\x1b[31m: quantized layer is missing tensor")
def hostile_tensor_name(make_model, tmp_path):
    """Newlines, terminal escapes and rich markup in a name: still exactly one printable line."""
    root = small(make_model)
    evil = "model.layers.1.mlp.proj\nError: forged line [/bold]\x1b[31m"

    def edit(t):
        for part in ("weight_packed", "weight_global_scale"):
            t[f"{evil}.{part}"] = t.pop(f"{LAYER}.{part}")

    edit_tensors(root, edit)
    return root


# --- running a case -------------------------------------------------------------------------------------------------


def staging_leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def assert_one_line_error(err: str, match: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    line = lines[0]
    assert line.startswith("Error: ") and len(line) > len("Error: "), line
    assert "Traceback" not in line and "internal error" not in line, line
    assert line.isprintable(), repr(line)
    for part in (match,) if isinstance(match, str) else match:
        assert part in line, f"{part!r} not in {line!r}"


def _build_case(param, make_model, tmp_path):
    build, match, inspectable = param
    work = tmp_path / "work"
    work.mkdir()
    return build(make_model, work), match, inspectable, work


@pytest.fixture(params=CASES)
def broken(request, make_model, tmp_path):
    return _build_case(request.param, make_model, tmp_path)


@pytest.fixture(params=[c for c in CASES if c.values[0][2]])  # damage inspect can see: headers, config, index
def broken_inspectable(request, make_model, tmp_path):
    return _build_case(request.param, make_model, tmp_path)


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_convert_refuses(broken, tmp_path, capsys):
    path, match, _, _ = broken
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    code, stdout, err = run_cli(["convert", path, "--target", "sm100", "-o", out], capsys)
    assert code == 1, err
    assert_one_line_error(err, match)
    assert not out.exists() and not out.is_symlink()
    assert staging_leftovers(tmp_path, "out") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not Path("/tmp/pwned-by-nvfp4-repack").exists()


@pytest.mark.parametrize("overwrite", [False, True], ids=["keep", "overwrite"])
def test_existing_output_survives(broken, tmp_path, capsys, overwrite):
    path, match, _, _ = broken
    out = tmp_path / "out"  # an existing bundle (which --overwrite may replace) holding one more file
    convert(SAMPLE_DIR, "sm100", out)
    (out / "keep.txt").write_text("precious")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = run_cli(["convert", path, "--target", "sm120", "-o", out] + ["--overwrite"] * overwrite, capsys)
    assert code == 1
    if overwrite:
        assert_one_line_error(err, match)
    else:  # either complaint is right: the input is bad and OUT exists
        assert_one_line_error(err, match if "already exists" not in err else "already exists")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert staging_leftovers(tmp_path, "out") == []


def test_inspect_refuses(broken_inspectable, capsys):
    path, match, _, work = broken_inspectable
    before = sorted(p.name for p in work.rglob("*"))
    code, _, err = run_cli(["inspect", path], capsys)
    assert code == 1
    assert_one_line_error(err, match)
    assert sorted(p.name for p in work.rglob("*")) == before


def test_corpus_covers_the_issue():
    ids = {p.id for p in CASES}
    wanted = {
        "missing_path", "empty_folder", "config_without_weights", "invalid_config_json", "unquantized_checkpoint",
        "truncated_data", "header_length_claims_a_terabyte", "offsets_past_the_end", "overlapping_offsets",
        "missing_block_scale", "wrong_scale_dtype", "scale_shape_mismatch", "k_not_a_multiple_of_16",
        "nan_in_block_scales", "duplicate_tensor_across_shards", "index_names_a_missing_shard",
        "symlinked_shard_escapes", "pickle_weights_only",
    }
    assert wanted <= ids
    for label in GLOBAL_SCALES:
        assert f"global_scale_{label}_compressed_tensors" in ids and f"global_scale_{label}_modelopt" in ids


# --- CLI arguments from the user are inputs too ---------------------------------------------------------------------


@pytest.mark.parametrize("size,match", [("lots", "--max-shard-size"), ("-5GB", "--max-shard-size"),
                                        ("0", "--max-shard-size")])
def test_bad_max_shard_size(make_model, tmp_path, capsys, size, match):
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", small(make_model), "-t", "sm100", "-o", out, "--max-shard-size", size], capsys)
    assert code == 2  # bad usage
    assert_one_line_error(err, match)
    assert not out.exists() and staging_leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("targets", [["sm100"], ["all"]])
def test_output_parents_are_created_and_removed_again_on_failure(make_model, tmp_path, capsys, monkeypatch, targets):
    """Regression (issue 26): ``-o a/b/c`` with missing parents was refused; they are created as ``mkdir -p``
    does, and a convert that fails while writing removes what it created, a several-target OUT included (it was
    left empty). A parent that is a file is a one-line error."""
    import repack.convert
    from repack.errors import RepackError

    model = small(make_model)
    flags = [a for t in targets for a in ("-t", t)]
    out = tmp_path / "no" / "such" / "out"
    with monkeypatch.context() as patch:
        patch.setattr(repack.convert._Writing, "take_layer", lambda *_: (_ for _ in ()).throw(RepackError("boom")))
        code, _, err = run_cli(["convert", model, *flags, "-o", out], capsys)
        assert code == 1 and err == "Error: boom\n" and not (tmp_path / "no").exists()
        code, _, err = run_cli(["convert", model, *flags, "-o", tmp_path / "here"], capsys)  # its parent exists
        assert code == 1 and err == "Error: boom\n" and not (tmp_path / "here").exists()
    code, _, err = run_cli(["convert", model, *flags, "-o", out], capsys)
    assert code == 0, err
    assert (out / ("manifest.json" if targets == ["sm100"] else "sm90/manifest.json")).is_file()
    (tmp_path / "file").write_text("")
    code, _, err = run_cli(["convert", model, *flags, "-o", tmp_path / "file" / "out"], capsys)
    assert code == 1
    assert_one_line_error(err, "cannot create the output folder")


def test_output_is_a_file(make_model, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a folder")
    code, _, err = run_cli(["convert", small(make_model), "-t", "sm100", "-o", out, "--overwrite"], capsys)
    assert code == 1
    assert_one_line_error(err, "exists and is not a folder")
    assert out.read_text() == "not a folder"


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_disk_full_while_writing(make_model, tmp_path, capsys, monkeypatch, overwrite):
    """An OSError mid-write (disk full) is a one-line error; nothing is left, an existing OUT is untouched."""
    import errno

    import repack.convert

    real = repack.convert.ShardWriter
    calls = []

    def full(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    out = tmp_path / "out"
    if overwrite:  # an existing bundle, which --overwrite may replace, holding one more file
        convert(SAMPLE_DIR, "sm100", out)
        (out / "keep.txt").write_text("precious")
    before = {p.name: p.read_bytes() for p in out.iterdir()} if overwrite else None
    monkeypatch.setattr(repack.convert, "ShardWriter", full)
    argv = ["convert", small(make_model, shards=2), "-t", "sm100", "-o", out, "--max-shard-size", "2KB"]
    code, _, err = run_cli(argv + ["--overwrite"] * overwrite, capsys)
    assert code == 1
    assert_one_line_error(err, "conversion failed, nothing written: No space left on device")
    assert staging_leftovers(tmp_path, "out") == []
    if overwrite:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    else:
        assert not out.exists()


def test_verify_report_into_a_missing_folder(make_model, tmp_path, capsys):
    out = tmp_path / "bundle"
    convert(small(make_model), "sm100", out)
    code, _, err = run_cli(["verify", out, "--report", tmp_path / "no" / "report.json"], capsys)
    assert code == 1
    assert_one_line_error(err, "report.json: No such file or directory")


# --- tampered bundles: inspect and verify ---------------------------------------------------------------------------


def _manifest_edit(edit):
    def apply(out: Path) -> None:
        path = out / "manifest.json"
        if callable(edit):
            data = json.loads(path.read_text())
            edit(data)
            path.write_text(json.dumps(data))
        else:
            path.write_bytes(edit)

    return apply


TAMPERED = [
    pytest.param(_manifest_edit(b"{"), "manifest.json: invalid JSON", id="not-json"),
    pytest.param(_manifest_edit(b"[" * 100_000), "manifest.json: invalid JSON", id="deeply-nested"),
    pytest.param(_manifest_edit(b"\xff\xfe"), "manifest.json: invalid JSON", id="not-utf8"),
    pytest.param(_manifest_edit(lambda m: m.update(kind="something-else")), "manifest.json: not an nvfp4-repack",
                 id="wrong-kind"),
    pytest.param(_manifest_edit(lambda m: m.update(bundle_format_version=99)), "bundle format version 99",
                 id="future-version"),
    pytest.param(_manifest_edit(lambda m: m.pop("layers")), "manifest.json: missing 'layers'", id="no-layers"),
    pytest.param(_manifest_edit(lambda m: m["layers"].update({LAYER: [1, 2]})),
                 f"manifest.json: missing 'padded_shape' in {LAYER}", id="layer-not-an-object"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER].update(n="16")), f"'n' in {LAYER} has the wrong type",
                 id="n-string"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER].update(global_scale=10**400)),
                 f"global_scale of {LAYER} must be a finite number", id="global-scale-huge-int"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER]["tensors"]["weight"].update(shape=[-1])),
                 f"shape of {LAYER}.weight must be non-negative integers", id="negative-shape"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER]["tensors"]["weight"].update(file="../../etc/passwd")),
                 f"file of {LAYER}.weight must be a plain file name", id="file-escapes"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER]["tensors"]["weight"].update(dtype="F4")),
                 f"dtype of {LAYER}.weight", id="unknown-dtype"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER]["tensors"]["weight"].update(digest="abc")),
                 f"digest of {LAYER}.weight must be 64 lowercase hex digits", id="bad-digest"),
    pytest.param(_manifest_edit(lambda m: m.update(tensor_digest="md5")), "tensor_digest 'md5' is not one of",
                 id="unknown-digest"),
    pytest.param(_manifest_edit(lambda m: m.update(file_digest="xxh3_128")), "file_digest 'xxh3_128' is not one of",
                 id="non-cryptographic-file-digest"),
    pytest.param(_manifest_edit(lambda m: m.pop("file_digest")), "missing 'file_digest'", id="no-file-digest"),
    pytest.param(_manifest_edit(lambda m: m["source"].update(hub_sha256={"../x": "0" * 64})),
                 "source.hub_sha256: '../x' is not a plain file name", id="hub-sha256-escapes"),
    pytest.param(_manifest_edit(lambda m: m["source"]["files"].update({"model.safetensors": "abc"})),
                 "blake3 of source.files['model.safetensors'] must be 64 lowercase hex digits", id="bad-source-digest"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER]["tensors"].update(
                     bias=m["layers"][LAYER]["tensors"]["weight"])),
                 f"manifest.json: {LAYER}: tensors ['bias', 'weight', 'weight_global_scale', 'weight_scale'] "
                 "are not the sm100 layout's", id="extra-part"),
    pytest.param(_manifest_edit(lambda m: m["files"].update({"../escape.json": "0" * 64})),
                 "manifest.json: files: '../escape.json' is not a plain file name", id="files-escape"),
    pytest.param(_manifest_edit(lambda m: m["passthrough"].update(
                     {f"{LAYER}.weight": m["passthrough"]["lm_head.weight"]})),
                 f"manifest.json: tensor '{LAYER}.weight' is listed twice", id="name-listed-twice"),
    pytest.param(_manifest_edit(lambda m: m.update(target="sm70")), "unknown target 'sm70'", id="unknown-target"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER].update(k=24)),
                 f"manifest.json: {LAYER}: N=32, K=24 is not an NVFP4 layer shape", id="k-not-a-multiple-of-16"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER].update(weights_padding_cols=10**9)),
                 f"manifest.json: {LAYER}: padded_shape [64, 64] / weights_padding_cols 1000000000 do not follow",
                 id="padding-cols"),
    pytest.param(_manifest_edit(lambda m: m["layers"][LAYER].update(padded_shape=[2**40, 64])),
                 f"manifest.json: {LAYER}: padded_shape [1099511627776, 64]", id="padded-shape"),
    pytest.param(_manifest_edit(b'{"kind": "nvfp4-repack-bundle", "bundle_format_version": 1' + b"0" * 5000 + b"}"),
                 "manifest.json: invalid JSON", id="huge-int-literal"),
    pytest.param(lambda out: (out / "config.json").unlink(), "config.json: file not found", id="no-config"),
]


@pytest.mark.parametrize("tamper,match", TAMPERED)
def test_tampered_bundle(make_model, tmp_path, capsys, tamper, match):
    out = tmp_path / "bundle"
    convert(small(make_model), "sm100", out)
    tamper(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for command in (["inspect", out], ["verify", out]):
        code, _, err = run_cli(command, capsys)
        assert code == 1, command
        assert_one_line_error(err, match)
    # Converting a tampered bundle (as a source) is refused too.
    code, _, err = run_cli(["convert", out, "-t", "sm120", "-o", tmp_path / "again"], capsys)
    assert code == 1 and err.startswith("Error: ") and "internal error" not in err
    assert not (tmp_path / "again").exists()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_markup_and_control_characters_in_names_are_only_data(tmp_path, capsys):
    """Layer names that look like rich markup or terminal escapes convert, inspect and verify normally."""
    from repack.sample.synthetic import random_nvfp4, write_checkpoint

    names = ["model.layers.0.[/bold].proj", "model.layers.1.[red]x[/red]\x1b[2J.proj"]
    root = write_checkpoint(tmp_path / "model [red] x", {n: random_nvfp4(16, 32) for n in names},
                            {"norm.[bold]w": torch.ones(4)}, fmt="compressed-tensors")
    out = tmp_path / "bundle [bold]"
    assert run_cli(["convert", root, "-t", "sm100", "-o", out], capsys)[0] == 0
    for argv in (["inspect", root], ["inspect", out], ["inspect", out, "--json"], ["verify", out]):
        code, text, err = run_cli(argv, capsys)
        assert code == 0 and err == "", (argv, err)
        assert "\x1b" not in text, f"a terminal escape from a tensor name reached the terminal: {argv}"
    code, text, _ = run_cli(["inspect", out], capsys)
    assert "[/bold]" in text and "bundle [bold]" in text.replace("\n", "")


def test_escaping_tensor_file_in_a_consistent_manifest_fails_verify(make_model, tmp_path, capsys):
    """A symlinked shard pointing outside the bundle: verify fails naming it and never reads the target."""
    out = tmp_path / "bundle"
    convert(small(make_model), "sm100", out)
    shard = out / "model.safetensors"
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    code, text, _ = run_cli(["verify", out], capsys)
    assert code == 1 and "model.safetensors: points outside the model folder" in text


# --- no code ever runs from a checkpoint ----------------------------------------------------------------------------


def test_pickle_only_folder_is_refused_without_unpickling(make_model, tmp_path, monkeypatch):
    import pickle

    root = small(make_model)
    (root / "model.safetensors").unlink()
    (root / "pytorch_model.bin").write_bytes(pickle.dumps({"w": 1}))

    def boom(*args, **kwargs):
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(torch, "load", boom)
    from repack.errors import RepackError

    with pytest.raises(RepackError, match=r"only pickle weights \(pytorch_model.bin\); they are never unpickled"):
        convert(root, "sm100", tmp_path / "out")


def test_pickle_files_beside_safetensors_are_neither_read_nor_copied(make_model, tmp_path):
    root = small(make_model)
    (root / "training_args.bin").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    (root / "optimizer.pt").write_bytes(b"\x80\x04junk")
    out = tmp_path / "out"
    convert(root, "sm100", out)
    assert not (out / "training_args.bin").exists() and not (out / "optimizer.pt").exists()


SOURCE_ALLOWED = {
    # (file, token): the explanatory mentions that say we never do it.
    ("formats/checkpoint.py", "pickle"),
    ("formats/checkpoint.py", "trust_remote_code"),
}


BUILTIN_CALL = re.compile(r"(?<![\w.])(eval|exec)\(")  # the builtins, not a method such as torch's Module.eval()


def test_package_never_unpickles_or_trusts_remote_code():
    package = Path(__file__).resolve().parent.parent / "repack"
    offenders = []
    for file in sorted(package.rglob("*.py")):
        rel = file.relative_to(package).as_posix()
        for number, line in enumerate(file.read_text().splitlines(), 1):
            for token in ("torch.load", "pickle", "trust_remote_code", "marshal", "eval(", "exec(", "import dill",
                          "weights_only=False", "safe_open(", "from_pretrained("):
                if token not in line or (token in ("eval(", "exec(") and not BUILTIN_CALL.search(line)):
                    continue
                allowed = (rel, token) in SOURCE_ALLOWED and ("never" in line or "PICKLE_SUFFIXES" in line
                                                               or "pickles" in line or "pickle weights" in line)
                if not allowed:
                    offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []


def test_reading_a_checkpoint_imports_no_remote_code(make_model, tmp_path):
    """A checkpoint shipping modeling code and auto_map: nothing of it is imported or executed."""
    root = small(make_model)
    marker = tmp_path / "executed"
    (root / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    edit_json(root / "config.json", lambda c: c.update(auto_map={"AutoModel": "modeling_evil.EvilModel"}))
    out = tmp_path / "out"
    convert(root, "sm100", out)
    assert not marker.exists()
    assert "modeling_evil" not in sys.modules
    # The side file is data to the bundle: copied, never run.
    assert (out / "modeling_evil.py").exists()
    assert re.search("auto_map", (out / "config.json").read_text())


def test_format_2_manifest_without_fusion_fields_reads_as_unfused(tmp_path):
    from repack.bundle.manifest import parse_manifest
    from repack.errors import RepackError

    convert(SAMPLE_DIR, "sm100", tmp_path / "out")
    data = json.loads((tmp_path / "out" / "manifest.json").read_text())
    data["bundle_format_version"] = 2
    for key in ("tp_size", "tp_rank", "fusion", "tensor_digest"):
        del data[key]
    for record in [*data["layers"].values()]:
        del record["partitions"]
        for tensor in record["tensors"].values():
            tensor["sha256"] = "0" * 64
            del tensor["digest"]
    for tensor in data["passthrough"].values():
        tensor["sha256"] = "0" * 64
        del tensor["digest"]
    manifest = parse_manifest(data)
    assert (manifest.tp_size, manifest.tp_rank, manifest.fusion, manifest.tensor_digest) == (1, 0, {}, "sha256")
    prefix, layer = next(iter(manifest.layers.items()))
    assert [(p.source, p.rows, p.source_cols) for p in layer.partitions] == [(prefix, [0, layer.n], [0, layer.k])]
    data["bundle_format_version"] = 3
    with pytest.raises(RepackError, match="missing"):
        parse_manifest(data)
