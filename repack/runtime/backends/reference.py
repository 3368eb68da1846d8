"""Reference backend: decode the runtime layout by its index formula, GEMM in float32, any device.

Slow but independent of every kernel and of the targets' own inverses (``repack/runtime/formulas.py``):
it is what CPU users and ``verify`` run, so verify's numerics check that the bundle's bytes, read the
way the layout's documentation says a kernel reads them, mean the source's weights.
"""

from __future__ import annotations

import torch

from ...targets import RuntimeLayer
from ..formulas import decode


def linear(x, weight, weight_scale, weight_global_scale, n: int, k: int, target: str) -> torch.Tensor:
    layer = RuntimeLayer(weight, weight_scale, weight_global_scale, weights_padding_cols=0)
    return (x.to(torch.float32) @ decode(layer, n, k, target).t()).to(x.dtype)
