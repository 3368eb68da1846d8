"""sm100 / sm103 / sm107 (Blackwell datacenter): vLLM's load-time layout for FlashInfer's cute-dsl kernel.

weight: codes zero-padded to 64-aligned ``[Np, Kp/2]`` uint8 (``pad_nvfp4_weight_for_cutlass``).
weight_scale: the canonical 128x4-swizzled float8_e4m3fn ``[round_up(N,128), round_up(K/16,4)]``
(``swizzle_blockscale``); FlashInfer's sm100 prepare only wraps this buffer in a 6-D view, so the
buffer itself is what a bundle persists. weight_global_scale: the float32 ``[1]`` multiplier.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..nvfp4 import BLOCK_SIZE, NVFP4Weight
from . import families, w4a4
from .base import RuntimeLayer, Target, TensorSpec
from .layout import pad_codes, swizzle_128x4, swizzled_scale_shape, unswizzle_128x4, vllm_geometry


def to_runtime(weight: NVFP4Weight) -> RuntimeLayer:
    geometry = vllm_geometry(weight.n, weight.k)
    return RuntimeLayer(
        weight=pad_codes(weight.codes, geometry),
        weight_scale=swizzle_128x4(weight.block_scales),
        weight_global_scale=weight.multiplier.reshape(1).to(torch.float32).clone(),
        weights_padding_cols=geometry.weights_padding_cols,
    )


def from_runtime(layer: RuntimeLayer, n: int, k: int) -> NVFP4Weight:
    return NVFP4Weight(
        codes=layer.weight[:n, : k // 2].contiguous(),
        block_scales=unswizzle_128x4(layer.weight_scale, n, k // BLOCK_SIZE),
        multiplier=layer.weight_global_scale.reshape(1).clone(),
    )


def runtime_specs(n: int, k: int) -> dict[str, TensorSpec]:
    geometry = vllm_geometry(n, k)
    return {
        "weight": TensorSpec(torch.uint8, (geometry.n_padded, geometry.k_padded // 2)),
        "weight_scale": TensorSpec(torch.float8_e4m3fn, swizzled_scale_shape(n, k)),
        "weight_global_scale": TensorSpec(torch.float32, (1,)),
    }


WEIGHT_ONLY = Target.of(
    families.SM100,
    to_runtime=to_runtime,
    from_runtime=from_runtime,
    runtime_specs=runtime_specs,
    geometry=vllm_geometry,
)
TARGET = replace(WEIGHT_ONLY, variants=(w4a4.variant(WEIGHT_ONLY),))
