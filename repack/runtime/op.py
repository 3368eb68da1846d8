"""``nvfp4_linear``: the one GEMM entry point, registered as ``torch.ops.nvfp4_repack.linear``.

A ``torch.library.custom_op`` with a fake implementation, so models using it trace under
``torch.compile(fullgraph=True)`` and capture into CUDA graphs; the backend is chosen when the layer is
built (from the target's capability table), never inside the traced region. Eager calls skip the op's Python
dispatch and call the layer's prepared backend directly (``PackedLinear.prepared``): at M = 1 the wrapper alone
cost more CPU time than the kernel takes on the GPU (docs/benchmarks.md, "sm90 runtime op: CPU cost per call").
A layer's online input transform goes into the backend where it fuses it (``fuses_input_transform``: the sm90
kernels' activation pre-pass, or the decode kernel itself for Walsh-Hadamard matrices, whose factors travel as
the string ``input_walsh``, a constant of the traced graph), else it runs first as ``block_transform``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .backends import get_backend
from .transforms import block_transform, rows_transform


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
    input_transform: torch.Tensor | None = None,
    input_walsh: str = "",
) -> torch.Tensor:
    linear = get_backend(backend)
    if input_transform is None:
        return linear(x, weight, weight_scale, weight_global_scale, n, k, target)
    return linear(x, weight, weight_scale, weight_global_scale, n, k, target, input_transform=input_transform,
                  input_walsh=input_walsh)  # fmt: skip


@_linear.register_fake
def _(x, weight, weight_scale, weight_global_scale, n, k, target, backend, input_transform=None, input_walsh=""):
    return x.new_empty((x.shape[0], n))


def _rows(x: torch.Tensor, k: int, transform: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]``, rotated by the online input ``transform`` if any, as a contiguous bf16 ``[M, K]``, copied
    only where it must be."""
    if x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear: x has K={x.shape[-1]}, layer expects K={k}")
    x2d = x if x.dim() == 2 else x.reshape(-1, k)
    if transform is not None:
        x2d = block_transform(x2d, transform)
    if x2d.dtype != torch.bfloat16:
        x2d = x2d.to(torch.bfloat16)
    return x2d.contiguous()


def eager(x2d: torch.Tensor) -> bool:
    """Whether a call may skip the op: a plain tensor (no subclass, no fake tensor) outside any compiler trace."""
    return type(x2d) is torch.Tensor and not torch.compiler.is_compiling()


def nvfp4_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    n: int,
    k: int,
    target: str,
    backend: str,
    bias: torch.Tensor | None = None,
    prepared: Callable[[torch.Tensor], torch.Tensor] | None = None,
    input_transform: torch.Tensor | None = None,
    fuse_input: bool = False,
    input_walsh: str = "",
) -> torch.Tensor:
    """``F.linear(x @ T_in, dequant(W), bias)`` from a layer's runtime tensors: for modules that hold the tensors
    themselves (vLLM's layers, whose engine compiles and captures the model). Eager calls go to ``prepared``
    (``prepare_backend`` on the same tensors and fused transform) when given, traced ones through the op.
    ``T_in``, the online input transform if any, goes into the backend's kernels when ``fuse_input``
    (``fuses_input_transform``; ``input_walsh``: its Walsh-Hadamard factors' key, "" if none), else it runs first
    as ``block_transform``."""
    x2d = _rows(x, k, None if fuse_input else input_transform)
    if prepared is not None and eager(x2d):
        y = prepared(x2d)
    else:
        y = _linear(x2d, weight, weight_scale, weight_global_scale, n, k, target, backend,
                    input_transform if fuse_input else None, input_walsh)  # fmt: skip
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], n)
    return y + bias if bias is not None else y


def nvfp4_linear(x: torch.Tensor, layer: "PackedLinear", bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: F821
    """``F.linear(x @ T_in, dequant(W), bias) @ T_out`` for ``x`` of any leading shape ``[..., K]`` and dtype.

    The GEMM runs in bf16 (every backend's kernel dtype); the result comes back in ``x``'s dtype. ``T_in`` /
    ``T_out`` are the layer's online transforms (``block_transform``), when it has them; ``T_in`` goes into the
    backend's kernels where it fuses it (``layer.fused_input_transform``), applied to the bf16 ``x``.
    """
    k = layer.k
    fused = layer.fused_input_transform
    x2d = _rows(x, k, None if fused is not None else layer.input_transform)
    if eager(x2d):
        y = layer.prepared()(x2d)
    else:
        y = _linear(x2d, layer.weight, layer.weight_scale, layer.gemm_scale, layer.n, k, layer.target,
                    layer.backend, fused, layer.input_walsh_key)  # fmt: skip
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], layer.n)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    y = y + bias if bias is not None else y
    if layer.output_transform is not None:
        return block_transform(y, layer.output_transform)
    return rows_transform(y, layer.output_parts) if layer.output_rows else y
