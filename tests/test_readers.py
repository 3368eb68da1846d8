"""Readers normalize both producers' checkpoints to the same canonical layers."""

from __future__ import annotations

import json

import pytest
import torch

from repack.errors import RepackError
from repack.formats import read_source


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize("shards", [1, 3])
def test_reader_yields_the_written_layers(make_model, fmt, w4a4, shards):
    model = make_model(fmt, w4a4=w4a4, shards=shards)
    source = read_source(model.path)
    assert source.format == fmt
    expected_algo = {("modelopt", False): "W4A16_NVFP4", ("modelopt", True): "NVFP4",
                     ("compressed-tensors", False): "NVFP4A16", ("compressed-tensors", True): "NVFP4"}
    assert source.quant_algo == expected_algo[(fmt, w4a4)]
    assert set(source.layers) == set(model.layers)
    for prefix, written in model.layers.items():
        layer = source.layers[prefix]
        assert (layer.n, layer.k) == (written.n, written.k)
        canonical = source.load_layer(layer)
        assert_same_bits(canonical.codes, written.codes)
        assert_same_bits(canonical.block_scales, written.block_scales)
        # compressed-tensors stores 1/multiplier; the reader inverts it in float32, as vLLM does.
        expected = written.multiplier if fmt == "modelopt" else 1 / torch.reciprocal(written.multiplier)
        assert canonical.multiplier.dtype == torch.float32
        assert torch.equal(canonical.multiplier, expected.reshape(1))
    # Excluded modules (lm_head, embeddings, norms) and activation scales pass through untouched.
    assert set(model.plain) <= set(source.passthrough)
    activation = {"modelopt": "input_scale", "compressed-tensors": "input_global_scale"}[fmt]
    assert any(name.endswith(activation) for name in source.passthrough) == w4a4


def test_unquantized_checkpoint_is_refused(make_model):
    model = make_model("compressed-tensors")
    config = json.loads((model.path / "config.json").read_text())
    del config["quantization_config"]
    (model.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RepackError, match="not an NVFP4 checkpoint"):
        read_source(model.path)


@pytest.mark.parametrize("marker", [{}, False, None, {"target": "sm100"}])
def test_any_bundle_marker_is_refused_as_a_source(make_model, marker):
    model = make_model("compressed-tensors")
    config = json.loads((model.path / "config.json").read_text())
    config["nvfp4_repack"] = marker
    (model.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RepackError, match="is an nvfp4-repack bundle"):
        read_source(model.path)


def test_config_quant_method_wins_over_a_stray_hf_quant_config(make_model):
    model = make_model("compressed-tensors")
    (model.path / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    assert read_source(model.path).format == "compressed-tensors"
