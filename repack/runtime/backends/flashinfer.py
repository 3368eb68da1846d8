"""FlashInfer cute-dsl backend (sm100/103/107 and sm120/121): the bundle's tensors go straight to the kernel.

Per call, as vLLM's ``FlashInferCuteDslNvFp4W4A16LinearKernel`` does: zero-pad activations by the
layer's K padding, run ``mm_bf16_fp4(..., backend="cute-dsl")``, slice the output back to N. sm100
wants the scales as the 6-D zero-copy view of the canonical 128x4 buffer; sm120 bundles already hold
the repacked tensors, so FlashInfer's own (load-time) preparation is never run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...targets.families import SM100
from ...targets.layout import round_up, vllm_geometry
from ...targets.w4a4 import ALIGNMENT as W4A4_ALIGNMENT
from ...targets.w4a4 import LAYOUT_ID as W4A4_LAYOUT


def sm100_scale_view(weight_scale: torch.Tensor, n_padded: int, k_padded: int) -> torch.Tensor:
    """The 6-D view of the 2-D 128x4-swizzled buffer that FlashInfer's sm100 kernel (and vLLM's layer) holds:
    a zero-copy view, so the bundle stores the buffer and this rebuilds what ``_prepare_cute_dsl_sm100`` makes."""
    from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout

    return convert_sf_to_mma_layout(weight_scale, m=n_padded, k=k_padded, num_groups=1, sf_vec_size=16)


def linear(x, weight, weight_scale, weight_global_scale, n: int, k: int, target: str) -> torch.Tensor:
    if target == W4A4_LAYOUT:
        return linear_w4a4(x, weight, weight_scale, weight_global_scale, n, k)
    from flashinfer.gemm import mm_bf16_fp4

    shape = vllm_geometry(n, k)
    x_padded = F.pad(x, (0, shape.k_padded - k)) if shape.k_padded != k else x
    y = mm_bf16_fp4(
        x_padded.contiguous(),
        weight,
        sm100_scale_view(weight_scale, shape.n_padded, shape.k_padded) if target in ("sm100", SM100.layout_id) else weight_scale,
        weight_global_scale,
        backend="cute-dsl",
    )
    return y[:, :n]


def linear_w4a4(x, weight, weight_scale, scales, n: int, k: int) -> torch.Tensor:
    """FP4 x FP4, as vLLM's FlashInfer W4A4 kernels call it (``scales``: ``[alpha, input_global_scale_inv]``):
    ``fp4_quantize`` with swizzled scales on the K-padded activations, then ``mm_fp4`` with ``alpha``. The cute-dsl
    backend on sm10x, CUTLASS elsewhere (vLLM's auto). NOT RUN: written without a Blackwell GPU."""
    from flashinfer import fp4_quantize, mm_fp4

    padded = round_up(k, W4A4_ALIGNMENT)
    x_padded = F.pad(x, (0, padded - k)) if padded != k else x
    x_fp4, x_scale = fp4_quantize(x_padded.contiguous(), scales[1:2], is_sf_swizzled_layout=True)
    backend = "cute-dsl" if torch.cuda.get_device_capability(x.device)[0] == 10 else "cutlass"
    b_scale = weight_scale if backend == "cute-dsl" else weight_scale.view(torch.uint8)
    a_scale = x_scale if backend == "cute-dsl" else x_scale.view(torch.uint8)
    y = mm_fp4(x_fp4, weight.t(), a_scale, b_scale.t(), scales[0:1], torch.bfloat16, backend=backend)
    return y[:, :n]
