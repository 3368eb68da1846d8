"""Target layouts: exact round trips, and each layout against an independent per-element formula."""

from __future__ import annotations

import pytest
import torch

from repack.errors import RepackError
from repack.nvfp4 import NVFP4Weight, dequantize
from repack.sample.synthetic import random_nvfp4
from repack.targets import TARGETS, resolve_target, sm120
from repack.targets.layout import round_up, swizzle_128x4, unswizzle_128x4, vllm_geometry
from repack.targets.sm120 import pack_tiles, unpack_tiles

from .conftest import LAYER_SHAPES


# each family's weight-only layout, and sm120's cute-dsl one (--linear-backend flashinfer_cutedsl)
WEIGHT_ONLY = [*TARGETS, sm120.CUTE_DSL]


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("target", WEIGHT_ONLY, ids=lambda t: f"{t.name}-{t.layout_id}")
@pytest.mark.parametrize("n,k", LAYER_SHAPES)
def test_round_trip_is_bit_exact(target, n, k):
    weight = random_nvfp4(n, k, allow_zero_scales=True)
    runtime = target.to_runtime(weight)
    back = target.from_runtime(runtime, n, k)
    assert_same_bits(back.codes, weight.codes)
    assert_same_bits(back.block_scales, target.as_read(weight).block_scales)
    assert_same_bits(back.multiplier, weight.multiplier)
    specs = target.runtime_specs(n, k)
    for part, tensor in runtime.tensors().items():
        assert (tensor.dtype, tuple(tensor.shape)) == (specs[part].dtype, specs[part].shape), part
    geometry = target.geometry(n, k)
    assert runtime.weights_padding_cols == geometry.weights_padding_cols
    assert geometry.n_padded >= n and geometry.k_padded >= k
    if target.backend == "flashinfer":  # vLLM's contract: pad N and K to 64, K padding in bytes
        assert geometry.padded_shape == [round_up(n, 64), round_up(k, 64)]
        assert runtime.weights_padding_cols == (round_up(k, 64) - k) // 2


@pytest.mark.parametrize("target", WEIGHT_ONLY, ids=lambda t: f"{t.name}-{t.layout_id}")
def test_runtime_layout_dequantizes_to_the_same_matrix(target):
    weight = random_nvfp4(80, 208)
    back = target.from_runtime(target.to_runtime(weight), 80, 208)
    assert torch.equal(dequantize(back), dequantize(target.as_read(weight)))


@pytest.mark.parametrize("n,k_sf", [(1, 1), (16, 5), (130, 7), (256, 64), (333, 13)])
def test_swizzle_matches_the_documented_offset_formula(n, k_sf):
    scales = torch.randint(0, 127, (n, k_sf), dtype=torch.uint8)
    swizzled = swizzle_128x4(scales).reshape(-1)
    kp = round_up(k_sf, 4)
    rows, cols = torch.meshgrid(torch.arange(n), torch.arange(k_sf), indexing="ij")
    offsets = ((rows // 128) * (kp // 4) + cols // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4 + cols % 4
    assert swizzled.numel() == round_up(n, 128) * kp
    assert torch.equal(swizzled[offsets], scales)
    mask = torch.ones_like(swizzled, dtype=torch.bool)
    mask[offsets.reshape(-1)] = False
    assert not swizzled[mask].any(), "padding bytes must be zero"
    assert torch.equal(unswizzle_128x4(swizzle_128x4(scales), n, k_sf), scales)


def test_sm120_tiles_match_the_documented_index_formula():
    """docs/NVFP4_REFERENCE.md §4, element by element, for a 2 x 3 grid of tiles."""
    codes = torch.randint(0, 256, (128, 16), dtype=torch.uint8)  # Np=128, Kp/2=16
    packed = pack_tiles(codes).view(torch.uint8).reshape(2, 2, 128, 4)  # [KT, NT, p, j]
    b_kn = codes.t()
    for p in (0, 1, 2, 63, 64, 65, 127):
        lane = (p // 2) % 32
        base_n = (p // 64) * 8 + lane // 4
        offs = (0, 0, 16, 16) if p % 2 == 0 else (32, 32, 48, 48)
        for j in range(4):
            row = lane % 4 + (0, 4, 0, 4)[j]
            for kt in range(2):
                for nt in range(2):
                    assert packed[kt, nt, p, j] == b_kn[kt * 8 + row, nt * 64 + base_n + offs[j]]


def test_padding_is_zero_and_shape_matches_vllm():
    weight = random_nvfp4(100, 80)
    runtime = resolve_target("sm100").to_runtime(weight)
    shape = vllm_geometry(100, 80)
    assert runtime.weight.shape == (128, 64) and shape.weights_padding_cols == 24
    assert not runtime.weight[100:].any() and not runtime.weight[:, 40:].any()


def test_unknown_target_lists_valid_ones():
    with pytest.raises(RepackError, match="unknown target 'sm70'; valid targets: sm100"):
        resolve_target("sm70")


def test_aliases_resolve():
    assert resolve_target("SM103").name == "sm100"
    assert resolve_target("sm121").name == "sm120"
    assert resolve_target("sm89").name == resolve_target("A100").name == resolve_target("l40s").name == "sm80"
    assert resolve_target("T4").name == "sm75"


@pytest.mark.parametrize("bad,message", [("nan", "block scales contain NaN"),
                                         ("negative", "block scales contain negative values"),
                                         ("zero_global", "must be finite and positive, got 0.0"),
                                         ("inf_global", "must be finite and positive, got inf")])
def test_canonical_validation_rejects_bad_values(bad, message):
    w = random_nvfp4(16, 32)
    scales, mult = w.block_scales.view(torch.uint8).clone(), w.multiplier.clone()
    if bad == "nan":
        scales[0, 0] = 0x7F
    elif bad == "negative":
        scales[0, 1] |= 0x80
    elif bad == "zero_global":
        mult[0] = 0.0
    else:
        mult[0] = float("inf")
    with pytest.raises(RepackError, match=f"layer: .*{message}"):
        NVFP4Weight(w.codes, scales.view(torch.float8_e4m3fn), mult).validate("layer")


@pytest.mark.parametrize("n,k_half", [(64, 8), (128, 40), (192, 504), (1024, 2048)])
def test_sm120_tile_packing_is_the_documented_permutation(n, k_half):
    """pack_tiles (a gather, for speed) against the module docstring's single 8-D view permutation, also for
    a view that starts at an odd byte offset."""
    seed = int(torch.randint(0, 2**31, ()))
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randint(0, 256, (n * k_half + 1,), dtype=torch.uint8, generator=gen)
    for codes in (storage[:-1].view(n, k_half), storage[1:].view(n, k_half)):
        # codes.view(NT, s, h, w, c, KT, q, r) -> (KT, NT, w, c, r, s, h, q)
        reference = codes.reshape(n // 64, 2, 2, 2, 8, k_half // 8, 2, 4).permute(5, 0, 3, 4, 7, 1, 2, 6)
        packed = pack_tiles(codes)
        assert torch.equal(packed, reference.reshape(k_half // 8, n * 8).view(torch.int32)), f"seed {seed}"
        assert torch.equal(unpack_tiles(packed), codes), f"seed {seed}"
