"""Dense W4A4 on Blackwell: what vLLM 0.33's FP4 x FP4 kernels hold after ``process_weights_after_loading``.

One layout for all of them: FlashInfer cute-dsl (``FlashInferCuteDslNvFp4LinearKernel``, vLLM's ``auto`` on sm100 /
sm103), FlashInfer CUTLASS (``FlashInferCutlassNvFp4LinearKernel``, ``auto`` on sm120 / sm121), FlashInfer cuDNN
and vLLM's own CUTLASS kernel each run ``swizzle_blockscale`` and ``pad_nvfp4_weight_for_cutlass`` with its default
alignment of 32, and nothing else (``kernels/linear/nvfp4/{flashinfer,cutlass}.py``):

weight: codes zero-padded to ``[round_up(N, 32), round_up(K, 32)/2]`` uint8. The kernels keep no
``weights_padding_cols``: they derive the K padding from ``weight.shape[1] - K/2`` (``nvfp4_weight_padding_bytes``).
weight_scale: the 128x4-swizzled float8_e4m3fn ``[round_up(N, 128), round_up(K/16, 4)]`` (as sm100's).
weight_global_scale, input_global_scale, input_global_scale_inv, alpha: float32 ``[]``, as the schemes leave them
(``KNvfp4Static`` / ``KNvfp4Dynamic`` + ``maybe_fuse_global_scales``, ``CompressedTensorsW4A4Fp4``):
``alpha = input_global_scale * weight_global_scale``, the GEMM's output scale; the kernels quantize activations
with ``input_global_scale_inv``.

QuTLASS (vLLM's ``QutlassNvFP4LinearMethod``, ``compressed_tensors/transform/schemes/linear_qutlass_nvfp4.py``):
on a GPU where ``has_device_capability(100)`` holds (sm100 and sm120 alike, the families with this layout), a W4A4
layer whose every online input transform has a block (``head_dim``) of 16, 32, 64 or 128 runs QuTLASS's fused
Hadamard + activation quantization, then FlashInfer's FP4 GEMM on this same layout. Its quantizer takes a fixed
global scale of 6 (block scales = the blocks' absmax), so the GEMM scale becomes ``fused_alpha =
weight_global_scale / 6``; both are computed at load (:func:`qutlass_scales`), nothing more is stored.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from ..errors import RepackError
from ..nvfp4 import BLOCK_SIZE, InputScale, NVFP4Weight
from .base import W4A4_SCALARS, RuntimeLayer, Target, TensorSpec
from .families import W4A4_LAYOUT_ID
from .layout import pad_codes, swizzle_128x4, swizzled_scale_shape, unswizzle_128x4, vllm_geometry

LAYOUT_ID = W4A4_LAYOUT_ID
ALIGNMENT = 32  # pad_nvfp4_weight_for_cutlass's default, which every W4A4 kernel calls it with
SCHEME = "W4A4"
geometry = partial(vllm_geometry, alignment=ALIGNMENT)


def scalar(value: torch.Tensor) -> torch.Tensor:
    """A float32 ``[]`` copy: what ``.max()`` over a layer's partitions leaves in vLLM."""
    return value.reshape(()).to(torch.float32).clone()


QUTLASS_BLOCKS = (16, 32, 64, 128)  # is_qutlass_fp4_scheme: the NVFP4 block sizes QuTLASS v0.2.0 fuses
QUTLASS_GLOBAL_SCALE = 6.0  # NVFP4_MAX: fusedQuantizeNv's global scale


def runs_qutlass(input_blocks: list[int | None]) -> bool:
    """Whether vLLM 0.33 serves a W4A4 layer with online input transforms of these blocks (``None``: a whole-K one,
    no ``head_dim``) through QuTLASS on sm100 / sm120 (``is_qutlass_fp4_scheme``); else its transform method
    rotates the activations before the layer's W4A4 kernel."""
    return bool(input_blocks) and all(block in QUTLASS_BLOCKS for block in input_blocks)


HUMMING_BLOCKS = (16, 32, 64, 128)  # vLLM 0.34's HADAMARD_BLOCK_SIZES (linear_humming_nvfp4.py)


def runs_humming(inputs: list[tuple[str, int | None]], outputs: int) -> bool:
    """Whether vLLM 0.34 serves a W4A4 layer through Humming's Hadamard kernel on sm100 / sm120
    (``is_humming_hadamard_fp4_scheme``): input transforms ``(type, block)`` (``None``: whole-K, no head_dim) all
    deterministic ``hadamard`` of one block it fuses, and no output transform (``outputs``: their number); every other
    rotated W4A4 layer gets its generic transform method around the W4A4 kernel, as 0.33 does outside QuTLASS."""
    return (bool(inputs) and not outputs and len({block for _, block in inputs}) == 1
            and all(kind == "hadamard" and block in HUMMING_BLOCKS for kind, block in inputs))


def qutlass_scales(weight_global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fused_alpha, fused_global_scale)`` as QutlassNvFP4LinearMethod computes them after loading: the float32
    ``[]`` ``weight_global_scale / 6`` and the float32 ``[1]`` ``[6]``."""
    return (weight_global_scale.to(torch.float32) / QUTLASS_GLOBAL_SCALE,
            torch.tensor([QUTLASS_GLOBAL_SCALE], dtype=torch.float32, device=weight_global_scale.device))


def to_runtime(weight: NVFP4Weight) -> RuntimeLayer:
    if weight.input_scale is None:
        raise RepackError(f"the {LAYOUT_ID} layout needs the layer's input global scale (a W4A4 checkpoint)")
    layout = geometry(weight.n, weight.k)
    multiplier = scalar(weight.multiplier)
    scale = scalar(weight.input_scale.scale)
    return RuntimeLayer(
        weight=pad_codes(weight.codes, layout),
        weight_scale=swizzle_128x4(weight.block_scales),
        weight_global_scale=multiplier,
        weights_padding_cols=layout.weights_padding_cols,
        input_global_scale=scale,
        input_global_scale_inv=scalar(weight.input_scale.inverse),
        alpha=scale * multiplier,  # float32 x float32, as maybe_fuse_global_scales computes it
    )


def from_runtime(layer: RuntimeLayer, n: int, k: int) -> NVFP4Weight:
    """Exact inverse of :func:`to_runtime` (``alpha`` is derived, so not read)."""
    if layer.input_global_scale is None or layer.input_global_scale_inv is None:
        raise RepackError(f"a {LAYOUT_ID} layer needs {' and '.join(W4A4_SCALARS[:2])}")
    return NVFP4Weight(
        codes=layer.weight[:n, : k // 2].contiguous(),
        block_scales=unswizzle_128x4(layer.weight_scale, n, k // BLOCK_SIZE),
        multiplier=layer.weight_global_scale.reshape(1).clone(),
        input_scale=InputScale(scalar(layer.input_global_scale), scalar(layer.input_global_scale_inv)),
    )


def runtime_specs(n: int, k: int) -> dict[str, TensorSpec]:
    layout = geometry(n, k)
    scalars = {name: TensorSpec(torch.float32, ()) for name in ("weight_global_scale", *W4A4_SCALARS)}
    return {
        "weight": TensorSpec(torch.uint8, (layout.n_padded, layout.k_padded // 2)),
        "weight_scale": TensorSpec(torch.float8_e4m3fn, swizzled_scale_shape(n, k)),
        **scalars,
    }


def variant(family: Target) -> Target:
    """``family``'s W4A4 layout: this module's transform under the family's names, GPUs, backend and kernels."""
    return replace(family, layout_id=LAYOUT_ID, scheme=SCHEME, to_runtime=to_runtime, from_runtime=from_runtime,
                   runtime_specs=runtime_specs, geometry=geometry, stack_rows=None, kernels=family.w4a4_kernels,
                   variants=())
