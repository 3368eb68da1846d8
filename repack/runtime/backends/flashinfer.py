"""FlashInfer cute-dsl backend (sm100/103/107 and sm120/121): the bundle's tensors go straight to the kernel.

Per call, as vLLM's ``FlashInferCuteDslNvFp4W4A16LinearKernel`` does: zero-pad activations by the
layer's K padding, run ``mm_bf16_fp4(..., backend="cute-dsl")``, slice the output back to N. sm100
wants the scales as the 6-D zero-copy view of the canonical 128x4 buffer; sm120 bundles already hold
the repacked tensors, so FlashInfer's own (load-time) preparation is never run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...targets.layout import vllm_geometry


def sm100_scale_view(weight_scale: torch.Tensor, n_padded: int, k_padded: int) -> torch.Tensor:
    """The 6-D view of the 2-D 128x4-swizzled buffer that FlashInfer's sm100 kernel (and vLLM's layer) holds:
    a zero-copy view, so the bundle stores the buffer and this rebuilds what ``_prepare_cute_dsl_sm100`` makes."""
    from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout

    return convert_sf_to_mma_layout(weight_scale, m=n_padded, k=k_padded, num_groups=1, sf_vec_size=16)


def linear(x, weight, weight_scale, weight_global_scale, n: int, k: int, target: str) -> torch.Tensor:
    from flashinfer.gemm import mm_bf16_fp4

    shape = vllm_geometry(n, k)
    x_padded = F.pad(x, (0, shape.k_padded - k)) if shape.k_padded != k else x
    y = mm_bf16_fp4(
        x_padded.contiguous(),
        weight,
        sm100_scale_view(weight_scale, shape.n_padded, shape.k_padded) if target == "sm100" else weight_scale,
        weight_global_scale,
        backend="cute-dsl",
    )
    return y[:, :n]
