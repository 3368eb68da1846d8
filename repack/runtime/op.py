"""``nvfp4_linear``: the one GEMM entry point, registered as ``torch.ops.nvfp4_repack.linear``.

A ``torch.library.custom_op`` with a fake implementation, so models using it trace under
``torch.compile(fullgraph=True)`` and capture into CUDA graphs; the backend is chosen when the layer is
built (from the target's capability table), never inside the traced region.
"""

from __future__ import annotations

import torch

from .backends import get_backend


@torch.library.custom_op("nvfp4_repack::linear", mutates_args=())
def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    n: int,
    k: int,
    target: str,
    backend: str,
) -> torch.Tensor:
    return get_backend(backend)(x, weight, weight_scale, weight_global_scale, n, k, target)


@_linear.register_fake
def _(x, weight, weight_scale, weight_global_scale, n, k, target, backend):
    return x.new_empty((x.shape[0], n))


def nvfp4_linear(x: torch.Tensor, layer: "PackedLinear", bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: F821
    """``F.linear(x, dequant(W), bias)`` for bf16 ``x`` of any leading shape ``[..., K]``."""
    if x.shape[-1] != layer.k:
        raise ValueError(f"nvfp4_linear: x has K={x.shape[-1]}, layer expects K={layer.k}")
    x2d = x.reshape(-1, layer.k).to(torch.bfloat16).contiguous()
    y = _linear(
        x2d, layer.weight, layer.weight_scale, layer.weight_global_scale, layer.n, layer.k, layer.target, layer.backend
    )
    y = y.reshape(*x.shape[:-1], layer.n)
    return y + bias if bias is not None else y
