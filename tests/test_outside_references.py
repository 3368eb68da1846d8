"""Decoding checked against truth from outside the project, not against its own readers and inverses.

1. ``tests/data/producers/base_bf16`` is the unquantized model every producer fixture was quantized from.
   llm-compressor and ModelOpt both round to the nearest E2M1 value, so a correct dequantization is
   within half an E2M1 step (times the element's block scale) of the base weight, element by element
   (measured: every element of every fixture within 1 + 3e-7 of that bound, float32 arithmetic in the
   producers; a wrong nibble order or a wrong global scale breaks it on most elements). The relative L2
   error per layer is 0.094 .. 0.097 for a correct dequantization (1.43 with the nibbles swapped, 1.02
   with the global scale doubled).
2. The producers' own dequantizers: compressed-tensors' ``NVFP4PackedCompressor.decompress`` and ModelOpt's
   ``NVFP4QTensor.dequantize``, on the producers' files.
3. A transformers model patched with each target's bundle against the base model's logits.

In CI the peer libraries must be installed (``.[test]``); these tests fail, not skip, without them.
"""

from __future__ import annotations

import json
import warnings
from functools import cache

import pytest
import torch
from safetensors import safe_open

from repack.bundle.reader import open_bundle
from repack.convert import convert
from repack.formats import read_source
from repack.nvfp4 import BLOCK_SIZE, NVFP4Weight, dequantize
from repack.runtime import patch_model
from repack.runtime.formulas import decode
from repack.targets import TARGETS
from repack.targets.families import W4A4_LAYOUT_ID

from .conftest import MOE_FIXTURES, PRODUCERS, require

BASE = PRODUCERS / "base_bf16"


def has_transforms(folder) -> bool:
    """Fixtures with online transforms store the quantized TRANSFORMED weights: not comparable to the base ones."""
    config = json.loads((folder / "config.json").read_text())
    return bool(config.get("quantization_config", {}).get("transform_config"))


FIXTURES = sorted(p.name for p in PRODUCERS.iterdir()
                  if p.is_dir() and p.name != BASE.name and not has_transforms(p) and p.name not in MOE_FIXTURES)
ROUNDING_SLACK = 1e-5  # producers compute w / scale in float32: 3e-7 measured
LAYER_REL_ERROR = 0.12  # correct: <= 0.097 on every layer; a wrong nibble order 1.43, a wrong global scale 1.02
# Whole model, bf16 activations: quantization error alone gives 0.22 against the base model's logits; wrong
# layouts measured 0.72 (block scales of other rows) .. 1.33 (nibbles swapped), a global scale x2 0.89.
LOGITS_VS_BASE = 0.4
LOGITS_VS_PEER = 3e-2  # the same weights in both models: only bf16 activations and outputs differ


@cache
def base_weight(name: str) -> torch.Tensor:
    with safe_open(BASE / "model.safetensors", "pt") as f:
        return f.get_tensor(name).to(torch.float64)


def half_step(scaled: torch.Tensor) -> torch.Tensor:
    """Largest round-to-nearest error of E2M1 (0, .5, 1, 1.5, 2, 3, 4, 6) at magnitude ``scaled``, in its units;
    beyond 6 the producers clamp."""
    return torch.where(scaled <= 2, 0.25, torch.where(scaled <= 4, 0.5, torch.where(scaled <= 6, 1.0, scaled - 6)))


def assert_near_base(dequantized: torch.Tensor, weight: NVFP4Weight, prefix: str) -> None:
    """Every element within half an E2M1 step of the base weight, and the layer's relative error typical."""
    base = base_weight(f"{prefix}.weight")
    scale = (weight.block_scales.to(torch.float64) * weight.multiplier.double()).repeat_interleave(BLOCK_SIZE, 1)
    error = (dequantized - base).abs()
    bound = scale * half_step(base.abs() / scale) * (1 + ROUNDING_SLACK)
    outside = int((error > bound).sum())
    assert outside == 0, f"{prefix}: {outside}/{error.numel()} elements off by more than half an E2M1 step"
    relative = float((dequantized - base).norm() / base.norm())
    assert relative <= LAYER_REL_ERROR, f"{prefix}: relative error {relative:.3f} against the base weights"


@cache
def source(fixture: str):
    return read_source(PRODUCERS / fixture)


def peer_dequantize(fixture: str, prefix: str) -> torch.Tensor:
    """The producer library's own dequantization of one layer, from the fixture's raw tensors, as float64."""
    checkpoint = source(fixture).checkpoint
    if fixture.startswith("ct_"):
        require("compressed_tensors")
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
        from compressed_tensors.quantization import QuantizationConfig

        config = json.loads((PRODUCERS / fixture / "config.json").read_text())["quantization_config"]
        (scheme,) = QuantizationConfig.model_validate(config).config_groups.values()
        parts = {n: checkpoint.read(f"{prefix}.{n}") for n in ("weight_packed", "weight_scale", "weight_global_scale")}
        return NVFP4PackedCompressor.decompress(parts, scheme)["weight"].to(torch.float64)
    with warnings.catch_warnings():  # it warns that it was not tested with this transformers version
        warnings.simplefilter("ignore")
        require("modelopt")
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    codes = checkpoint.read(f"{prefix}.weight")
    qtensor = NVFP4QTensor(torch.Size([codes.shape[0], 2 * codes.shape[1]]), torch.float32, codes)
    return qtensor.dequantize(
        torch.float32, scale=checkpoint.read(f"{prefix}.weight_scale"),
        double_scale=checkpoint.read(f"{prefix}.weight_scale_2"), block_sizes={-1: BLOCK_SIZE},
    ).to(torch.float64)


def assert_matches_peer(ours: torch.Tensor, fixture: str, prefix: str) -> None:
    """compressed-tensors dequantizes in bf16 (scale / global scale, the product and the result each round:
    <= 3 * 2**-9 relative); ModelOpt in float32 (<= 2 * 2**-24)."""
    peer = peer_dequantize(fixture, prefix)
    rtol = 3 * 2.0**-9 if fixture.startswith("ct_") else 2.0**-22
    assert torch.equal(peer == 0, ours == 0), f"{prefix}: zeros differ from the producer's dequantization"
    worst = float(((peer - ours).abs() / ours.abs().clamp(min=1e-30)).max())
    assert worst <= rtol, f"{prefix}: relative difference {worst:.3g} from the producer's dequantization"


@pytest.mark.parametrize("fixture", FIXTURES)
def test_source_dequantizes_to_the_base_model(fixture):
    layers = source(fixture).layers
    assert len(layers) == 14
    for prefix, layer in layers.items():
        weight = source(fixture).load_layer(layer)
        assert_near_base(dequantize(weight), weight, prefix)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_source_dequantizes_like_the_producer_library(fixture):
    for prefix, layer in source(fixture).layers.items():
        assert_matches_peer(dequantize(source(fixture).load_layer(layer)), fixture, prefix)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("fixture", FIXTURES)
def test_bundle_decodes_to_the_base_model_and_the_producers_weights(fixture, target, tmp_path):
    """Each bundle's runtime tensors, read by the layout's index formula, against base weights and producer."""
    convert(PRODUCERS / fixture, target.name, tmp_path / "bundle")
    bundle = open_bundle(tmp_path / "bundle")
    for prefix, record in bundle.manifest.layers.items():
        decoded = decode(bundle.runtime_layer(prefix), record.n, record.k, bundle.target.layout_key, torch.float64)
        assert_near_base(decoded, source(fixture).load_layer(source(fixture).layers[prefix]), prefix)
        assert_matches_peer(decoded, fixture, prefix)


@pytest.mark.parametrize("target", [t for t in TARGETS if t.for_scheme("W4A4").scheme == "W4A4"], ids=lambda t: t.name)
@pytest.mark.parametrize("fixture", ["modelopt_nvfp4", "ct_nvfp4"])
def test_w4a4_patched_model_logits_against_the_base_model(fixture, target, tmp_path):
    """A W4A4 bundle (the producers' calibrated input scales) in the base model: logits near the base model's
    (weight and activation quantization error), and off the weight-only producer model's by the activations' where
    the kernel quantizes them (FP4 x FP4); Marlin serves a W4A4 checkpoint weight-only, within bf16 of that model."""
    convert(PRODUCERS / fixture, target.name, tmp_path / "bundle")
    unused, got, base, peer = patched_logits(fixture, tmp_path / "bundle")
    assert unused == []
    assert float((got - base).norm() / base.norm()) < LOGITS_VS_BASE
    off_peer = float((got - peer).norm() / peer.norm())
    quantizes = target.for_scheme("W4A4").layout_key == W4A4_LAYOUT_ID
    assert off_peer > LOGITS_VS_PEER if quantizes else off_peer < LOGITS_VS_PEER, (off_peer, quantizes)


def patched_logits(fixture: str, bundle) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bundle's tensors the patch left unused, and float64 logits of fresh random tokens from the bf16 base
    model patched with the bundle, from the float32 base model and from the producer-dequantized one."""
    patched = llama(torch.bfloat16)
    unused = patch_model(patched, bundle)
    tokens = torch.randint(0, patched.config.vocab_size, (4, 32))
    with torch.no_grad():
        got = patched(tokens).logits.double()
        base = llama(torch.float32)(tokens).logits.double()
        peer = llama(torch.float32, fixture)(tokens).logits.double()
    return unused, got, base, peer


def llama(dtype: torch.dtype, fixture: str | None = None):
    """The base model, or with ``fixture`` each quantized linear replaced by the producer's dequantized weight."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=dtype).eval()
    if fixture is not None:
        state = model.state_dict()
        with torch.no_grad():
            for prefix in source(fixture).layers:
                state[f"{prefix}.weight"].copy_(peer_dequantize(fixture, prefix))
    return model


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("fixture", ["ct_nvfp4a16", "modelopt_nvfp4"])
def test_patched_model_logits_against_the_base_model(fixture, target, tmp_path):
    """The base model with its linears swapped for a bundle's: logits near the base model's (quantization error
    only) and equal to the producer-dequantized model's up to bf16 activations (--weight-only: W4A4 below)."""
    convert(PRODUCERS / fixture, target.name, tmp_path / "bundle", weight_only=True)
    unused, got, base, peer = patched_logits(fixture, tmp_path / "bundle")
    assert all(name.endswith(("input_scale", "input_global_scale")) for name in unused)
    assert float((got - base).norm() / base.norm()) < LOGITS_VS_BASE
    assert float((got - peer).norm() / peer.norm()) < LOGITS_VS_PEER
