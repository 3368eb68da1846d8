"""The offline layouts are byte-identical to FlashInfer's own cute-dsl weight preparation.

FlashInfer's public ``prepare_bf16_fp4_weights`` picks its layout from ``b.device``'s compute capability
and refuses CPU tensors, but its per-architecture helpers are plain torch and run on CPU: they are the
oracle here. In CI these tests fail (not skip) when flashinfer-python / nvidia-cutlass-dsl are missing.
"""

from __future__ import annotations

import pytest
import torch

from repack.nvfp4 import NVFP4Weight, dequantize
from repack.runtime.formulas import decode
from repack.targets.layout import swizzle_128x4_offsets
from repack.sample.synthetic import random_nvfp4
from repack.targets import RuntimeLayer, resolve_target, sm120
from repack.targets.families import SM120_CUTE_DSL
from repack.targets.layout import round_up, vllm_geometry

from .conftest import require

require("flashinfer")
require("cutlass")
from flashinfer.gemm.gemm_bf16_fp4 import _unswizzle_sf_128x4  # noqa: E402
from flashinfer.gemm.gemm_bf16_fp4_cute_dsl import _prepare_cute_dsl_sm12x, _prepare_cute_dsl_sm100  # noqa: E402

# (N, K): odd multiples of 16, N = 16, square and rectangular model shapes, one large layer.
CONFORMANCE_SHAPES = [
    (16, 16),
    (16, 4096),
    (48, 80),
    (64, 64),
    (100, 208),
    (176, 1008),
    (1000, 336),
    (4096, 4096),
    (14336, 512),
]


def vllm_prepared(weight: NVFP4Weight) -> RuntimeLayer:
    """What vLLM hands to ``prepare_bf16_fp4_weights``: codes zero-padded to 64 (``pad_nvfp4_weight_for_cutlass``),
    scales scattered to the 128x4 offsets of FlashInfer's ``_unswizzle_sf_128x4`` docstring. Built here from
    those formulas, not with our sm100 target, so the sm120 check does not lean on it."""
    n, k = weight.n, weight.k
    geometry = vllm_geometry(n, k)
    codes = torch.nn.functional.pad(weight.codes, (0, (geometry.k_padded - k) // 2, 0, geometry.n_padded - n))
    rows, k_sf = round_up(n, 128), geometry.k_padded // 16
    swizzled = torch.zeros(rows * k_sf, dtype=torch.uint8)
    offsets = swizzle_128x4_offsets(torch.arange(n), torch.arange(k // 16), n, k)
    swizzled[offsets.reshape(-1)] = weight.block_scales.view(torch.uint8).reshape(-1)
    return RuntimeLayer(codes, swizzled.view(rows, k_sf).view(torch.float8_e4m3fn), weight.multiplier.clone(), 0)


def mma_view_scales(sf_view: torch.Tensor, n: int, k_sf: int) -> torch.Tensor:
    """The scale the sm100 kernel reads for ``(row, block)``: ``convert_sf_to_mma_layout``'s documented 6-D
    position ``(row % 32, (row % 128) // 32, row // 128, block % 4, block // 4, 0)``."""
    rows, blocks = torch.meshgrid(torch.arange(n), torch.arange(k_sf), indexing="ij")
    return sf_view.view(torch.uint8)[rows % 32, (rows % 128) // 32, rows // 128, blocks % 4, blocks // 4, 0]


@pytest.mark.parametrize("n,k", CONFORMANCE_SHAPES)
def test_sm100_matches_flashinfer(n, k):
    """What FlashInfer's sm100 kernel is given, read back through FlashInfer's own views, is the source."""
    weight = random_nvfp4(n, k)
    runtime = resolve_target("sm100").to_runtime(weight)
    # The stored buffer, read back by FlashInfer's own unswizzle, gives the source scales.
    linear = _unswizzle_sf_128x4(runtime.weight_scale, n, k // 16)
    assert torch.equal(linear, weight.block_scales.view(torch.uint8))
    b, sf_view, alpha = _prepare_cute_dsl_sm100(runtime.weight, runtime.weight_scale, runtime.weight_global_scale, 16)
    # The kernel's 6-D scale view, indexed as convert_sf_to_mma_layout documents, gives the source scales ...
    assert sf_view.shape == (32, 4, -(-n // 128), 4, -(-k // 64), 1)
    assert torch.equal(mma_view_scales(sf_view, n, k // 16), weight.block_scales.view(torch.uint8))
    padded = mma_view_scales(sf_view, round_up(n, 128), round_up(k, 64) // 16)
    assert not padded[n:].any() and not padded[:, k // 16 :].any()
    # ... the packed FP4 operand is the source's codes (element 2i in the low nibble), zero-padded to 64 ...
    geometry = vllm_geometry(n, k)
    assert b.dtype == torch.uint8 and tuple(b.shape) == (geometry.n_padded, geometry.k_padded // 2)
    assert torch.equal(b[:n, : k // 2], weight.codes)
    assert not b[n:].any() and not b[:, k // 2 :].any()
    # ... and alpha is the source's dequantization multiplier.
    assert torch.equal(alpha.view(torch.int32), weight.multiplier.view(torch.int32))


@pytest.mark.parametrize("n,k", CONFORMANCE_SHAPES)
def test_sm120_matches_flashinfer(n, k):
    weight = random_nvfp4(n, k)
    expected_b, expected_sf, alpha = _prepare_cute_dsl_sm12x(*vllm_prepared(weight).tensors().values(), 16)
    ours = sm120.CUTE_DSL.to_runtime(weight)  # --linear-backend flashinfer_cutedsl (Marlin is sm120's default)
    assert ours.weight.dtype == expected_b.dtype == torch.int32
    assert torch.equal(ours.weight, expected_b)
    assert ours.weight_scale.dtype == expected_sf.dtype
    assert torch.equal(ours.weight_scale, expected_sf)
    assert torch.equal(ours.weight_global_scale, alpha)


@pytest.mark.parametrize("n,k", CONFORMANCE_SHAPES[:7])
def test_formula_decoders_read_flashinfers_own_output(n, k):
    """The reference backend's index formulas, applied to FlashInfer's own sm12x output and to the sm100 tensors
    read through FlashInfer's MMA view, give the source weights: the decoders are pinned to FlashInfer."""
    weight = random_nvfp4(n, k)
    prepared = vllm_prepared(weight)
    assert torch.equal(_unswizzle_sf_128x4(prepared.weight_scale, n, k // 16), weight.block_scales.view(torch.uint8))
    b, sf, alpha = _prepare_cute_dsl_sm12x(*prepared.tensors().values(), 16)
    assert torch.equal(decode(RuntimeLayer(b, sf, alpha, 0), n, k, SM120_CUTE_DSL, torch.float64), dequantize(weight))
    assert torch.equal(decode(prepared, n, k, "sm100", torch.float64), dequantize(weight))
