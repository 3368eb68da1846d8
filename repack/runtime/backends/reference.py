"""Reference backend: decode the runtime layout with the target's inverse, GEMM in float32, any device.

Slow but independent of every kernel: it is what CPU users and ``verify`` run, and it checks that the
bundle's bytes (not just their hashes) still mean the source's weights.
"""

from __future__ import annotations

import torch

from ...nvfp4 import dequantize
from ...targets import RuntimeLayer, resolve_target


def linear(x, weight, weight_scale, weight_global_scale, n: int, k: int, target: str) -> torch.Tensor:
    layer = RuntimeLayer(weight, weight_scale, weight_global_scale, weights_padding_cols=0)
    w = dequantize(resolve_target(target).from_runtime(layer, n, k), torch.float32)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)
