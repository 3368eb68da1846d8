"""GEMM backends. Each is ``linear(x, weight, weight_scale, weight_global_scale, n, k, target) -> y``:
x bf16 ``[M, K]`` (logical K), the target's runtime tensors, output bf16 ``[M, N]`` (logical N). ``target`` is the
layout's ``Target.layout_key``: for the W4A4 layout (its id) ``weight_global_scale`` is ``[alpha,
input_global_scale_inv]`` and the backend quantizes x to NVFP4 (``reference.w4a4_scales``). ``triton`` also
takes the layer's online input transform (``input_transform=``) where ``fuses_input_transform`` says it applies it
itself; every other transform runs before the backend, as ``block_transform``.

Which backend runs where is read from the target registry's capability table
(``Target.backend`` on the target's own GPUs; ``reference`` on CPU). ``prepare_backend`` binds one layer's tensors
to its backend once, for the eager op's per-call path.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from ...errors import RepackError
from ...targets import Target
from ..transforms import WalshFactors, walsh_from_key

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, str], torch.Tensor]


def get_backend(name: str) -> Linear:
    """The backend's ``linear``; imported lazily so CPU-only installs never import GPU libraries."""
    if name == "reference":
        from .reference import linear
    elif name == "flashinfer":
        from .flashinfer import linear
    elif name == "triton":
        from .triton_sm90 import linear as triton_linear

        def linear(x, weight, weight_scale, weight_global_scale, n, k, target, input_transform=None,  # noqa: ARG001
                   input_walsh=""):  # fmt: skip
            walsh = walsh_from_key(input_walsh) if input_walsh else None
            return triton_linear(x, weight, weight_scale, weight_global_scale, n, k, input_transform, walsh)
    else:
        raise RepackError(f"unknown backend {name!r}; known: reference, flashinfer, triton")
    return linear


def fuses_input_transform(name: str, matrix: torch.Tensor | None) -> bool:
    """Whether backend ``name`` applies the online input transform ``matrix`` in its own kernels: ``triton`` for
    blocks of 16 to 128 (in its activation pre-pass; docs/benchmarks.md, "Online transforms")."""
    if name != "triton" or matrix is None:
        return False
    from .triton_sm90.common import fuses_transform

    return fuses_transform(matrix)


def prepare_backend(
    name: str, weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, n: int, k: int,
    target: str, input_transform: torch.Tensor | None = None, input_walsh: WalshFactors | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:  # fmt: skip
    """``x -> linear(x, <the layer's tensors>)`` for a contiguous bf16 ``x [M, K]``: triton checks the layer (and
    the ``input_transform`` it fuses, ``fuses_input_transform``, with its Walsh-Hadamard factors if it has them)
    once here and nothing per call (its per-call CPU time at M = 1 exceeds the kernel's GPU time otherwise); the
    other backends keep their per-call path."""
    if name == "triton":
        from .triton_sm90 import prepare

        return prepare(weight, weight_scale, weight_global_scale, n, k, input_transform, input_walsh)
    if input_transform is not None:
        raise RepackError(f"backend {name!r} does not fuse online transforms; apply block_transform first")
    return partial(get_backend(name), weight=weight, weight_scale=weight_scale,
                   weight_global_scale=weight_global_scale, n=n, k=k, target=target)  # fmt: skip


def device_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def runs_on(target: Target, device: torch.device) -> bool:
    """Whether ``device`` runs ``target``'s layout: the CPU (the reference backend reads every layout), or one of
    the target's GPUs."""
    capability = device_capability(device)
    return capability is None or capability in target.compute_capabilities


def choose_backend(target: Target, device: torch.device) -> str:
    """``reference`` on CPU; the target's own backend on its GPUs; an error on any other GPU."""
    capability = device_capability(device)
    if capability is None:
        return "reference"
    if not runs_on(target, device):
        have = f"sm{capability[0]}{capability[1]}"
        raise RepackError(
            f"this bundle is for {target.name} ({', '.join(f'sm{a}{b}' for a, b in target.compute_capabilities)}) "
            f"but the device is {have}; convert the source for {have}, or run on the CPU"
        )
    return target.backend
