"""The offline layouts are byte-identical to FlashInfer's own cute-dsl weight preparation.

FlashInfer's public ``prepare_bf16_fp4_weights`` picks its layout from ``b.device``'s compute capability
and refuses CPU tensors, but its per-architecture helpers are plain torch and run on CPU: they are the
oracle here. In CI these tests fail (not skip) when flashinfer-python / nvidia-cutlass-dsl are missing.
"""

from __future__ import annotations

import pytest
import torch

from repack.sample.synthetic import random_nvfp4
from repack.targets import resolve_target

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


def vllm_prepared(n: int, k: int):
    """The (padded weight, 128x4 scales, alpha) vLLM hands to prepare_bf16_fp4_weights, via our sm100 target."""
    weight = random_nvfp4(n, k)
    return weight, resolve_target("sm100").to_runtime(weight)


@pytest.mark.parametrize("n,k", CONFORMANCE_SHAPES)
def test_sm100_matches_flashinfer(n, k):
    weight, runtime = vllm_prepared(n, k)
    # The 128x4 swizzle, read back by FlashInfer's own unswizzle, gives the source scales.
    linear = _unswizzle_sf_128x4(runtime.weight_scale, n, k // 16)
    assert torch.equal(linear, weight.block_scales.view(torch.uint8))
    # FlashInfer's sm100 prepare keeps the weight and views the canonical buffer, of the exact size it needs.
    b, sf_view, alpha = _prepare_cute_dsl_sm100(runtime.weight, runtime.weight_scale, runtime.weight_global_scale, 16)
    assert torch.equal(b, runtime.weight)
    assert sf_view.data_ptr() == runtime.weight_scale.data_ptr()
    assert sf_view.untyped_storage().nbytes() == runtime.weight_scale.numel() == (-(-n // 128)) * (-(-k // 64)) * 512
    assert torch.equal(alpha, runtime.weight_global_scale)


@pytest.mark.parametrize("n,k", CONFORMANCE_SHAPES)
def test_sm120_matches_flashinfer(n, k):
    _, sm100 = vllm_prepared(n, k)
    expected_b, expected_sf, alpha = _prepare_cute_dsl_sm12x(sm100.weight, sm100.weight_scale, sm100.weight_global_scale, 16)
    ours = resolve_target("sm120").to_runtime(resolve_target("sm100").from_runtime(sm100, n, k))
    assert ours.weight.dtype == expected_b.dtype == torch.int32
    assert torch.equal(ours.weight, expected_b)
    assert ours.weight_scale.dtype == expected_sf.dtype
    assert torch.equal(ours.weight_scale, expected_sf)
    assert torch.equal(ours.weight_global_scale, alpha)
