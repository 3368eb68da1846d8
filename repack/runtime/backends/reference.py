"""Reference backend: decode the runtime layout by its index formula, GEMM in float32, any device.

Slow but independent of every kernel and of the targets' own inverses (``repack/runtime/formulas.py``):
it is what CPU users and ``verify`` run, so verify's numerics check that the bundle's bytes, read the
way the layout's documentation says a kernel reads them, mean the source's weights.
"""

from __future__ import annotations

import torch

from ...targets import RuntimeLayer
from ..formulas import decode_blocks


def linear(x, weight, weight_scale, weight_global_scale, n: int, k: int, target: str) -> torch.Tensor:
    """``x @ W.T`` in float32, ``W`` decoded a row block at a time: memory is one block, not the layer in float32
    (4 bytes a weight: gigabytes for the largest layers)."""
    layer = RuntimeLayer(weight, weight_scale, weight_global_scale, weights_padding_cols=0)
    x32 = x.to(torch.float32)
    out = torch.empty((*x.shape[:-1], n), dtype=torch.float32, device=x.device)
    for first, block in decode_blocks(layer, n, k, target):
        out[..., first : first + len(block)] = x32 @ block.t()
    return out.to(x.dtype)
