"""Reference backend: decode the runtime layout by its index formula, GEMM in float32, any device.

Slow but independent of every kernel and of the targets' own inverses (``repack/runtime/formulas.py``):
it is what CPU users and ``verify`` run, so verify's numerics check that the bundle's bytes, read the
way the layout's documentation says a kernel reads them, mean the source's weights.

W4A4 layouts (``target`` is the layout id): what an FP4 x FP4 GEMM computes. The activations are quantized to
NVFP4 with the layer's ``input_global_scale_inv`` (:func:`repack.nvfp4.quantize_activations`, vLLM's and
FlashInfer's semantics), both operands are taken as ``e2m1 * block_scale`` (exact in float32), and the product is
scaled by ``alpha``, as the kernels' epilogue does.
"""

from __future__ import annotations

import torch

from ...nvfp4 import BLOCK_SIZE, e2m1_to_float, quantize_activations, unpack_codes
from ...targets import RuntimeLayer
from ...targets.w4a4 import LAYOUT_ID as W4A4_LAYOUT
from ..formulas import decode_blocks


def linear(x, weight, weight_scale, weight_global_scale, n: int, k: int, target: str) -> torch.Tensor:
    """``x @ W.T`` in float32, ``W`` decoded a row block at a time: memory is one block, not the layer in float32
    (4 bytes a weight: gigabytes for the largest layers). W4A4: ``weight_global_scale`` is ``[alpha,
    input_global_scale_inv]`` (:func:`w4a4_scales`)."""
    w4a4 = target == W4A4_LAYOUT
    multiplier = torch.ones(1, dtype=torch.float32, device=x.device) if w4a4 else weight_global_scale
    layer = RuntimeLayer(weight, weight_scale, multiplier, weights_padding_cols=0)
    x32 = quantized_activations(x, weight_global_scale[1]) if w4a4 else x.to(torch.float32)
    out = torch.empty((*x.shape[:-1], n), dtype=torch.float32, device=x.device)
    for first, block in decode_blocks(layer, n, k, target):
        out[..., first : first + len(block)] = x32 @ block.t()
    return (out * weight_global_scale[0] if w4a4 else out).to(x.dtype)


def w4a4_scales(alpha: torch.Tensor, input_global_scale_inv: torch.Tensor) -> torch.Tensor:
    """A W4A4 layer's two GEMM scalars as the one float32 ``[2]`` tensor the backends' ``weight_global_scale``."""
    return torch.stack([alpha.reshape(()), input_global_scale_inv.reshape(())]).to(torch.float32)


def quantized_activations(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[M, K]``: ``e2m1(code) * block_scale`` of ``x`` quantized with ``global_scale`` (exact; the
    ``1 / global_scale`` is in ``alpha``). The kernels quantize bf16 activations: a float32 ``x`` (bf16 values, as
    tests pass to keep a float32 output) is taken as bf16."""
    m = x.shape[0]
    codes, scales = quantize_activations(x if x.dtype == torch.float16 else x.to(torch.bfloat16), global_scale)
    values = e2m1_to_float(unpack_codes(codes)).view(m, k_blocks := codes.shape[1] * 2 // BLOCK_SIZE, BLOCK_SIZE)
    return (values * scales.to(torch.float32).view(m, k_blocks, 1)).view(m, -1)
