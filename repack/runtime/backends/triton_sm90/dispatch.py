"""Which kernel and work split runs a call: ``linear`` (checked per call) and ``prepare`` (checked once, per layer).

Measured on an H200 (docs/benchmarks.md, "sm90 kernels against cuBLAS and Humming" and its history):

* ``M <= 8``, and ``M <= 16`` on layers of fewer than half as many 64-row tiles as SMs (``uses_decode_kernel``):
  the decode kernel with ``gemv_config_for`` (8 warps per program unless that needs more waves of programs than 4).
* Otherwise the tensor-core kernel with ``tc_config_for`` (activation tile 16 / 32 / 64 / 128 / 256 rows by M), at
  every large M too: dequantize + cuBLAS was slower than it on 38 of 42 layer and M points up to M = 8192, never
  faster by more than 3%, and needs a bf16 copy of W (round 7; rounds 3 and 5 alike), so there is no crossover.
"""

from __future__ import annotations

import os
from functools import lru_cache, partial
from typing import Callable

import torch

from ....targets import sm90 as layout
from ...transforms import WalshFactors
from .common import FUSED_TRANSFORM_BLOCKS, fuses_transform, narrow, require_triton, sm_count
from .decode import GEMV_MAX_M, GemvConfig, GemvLaunch, gemv_config_for, gemv_linear, walsh_smem_bytes
from .tensor_core import PREPARED_MAX_M, TcConfig, TcLaunch, tc_config_for, tc_linear, transformed_activations

PREPARED_TC = os.environ.get("NVFP4_REPACK_PREPARED_TC", "1") != "0"  # read once: ``Prepared``'s default


def uses_decode_kernel(m: int, n: int, sm_count: int) -> bool:
    """``M <= 8``, and ``M <= 16`` on layers with fewer 64-row tiles than half the SMs: the decode kernel, else the
    tensor-core kernel. At M = 9 .. 16 the decode kernel runs two n-tiles of mma.sync and reads the activations
    from L2 in every warp, where 16-row wgmma tiles read them once per program from shared memory (H200, M = 16,
    us: 57344 x 8192 99 against 84, 8192 x 28672 57 against 47, 14336 x 4096 20 against 18, 8192 x 8192 and
    10240 x 8192 even); with 64 tiles (N = 4096) too few programs share out K (4096 x 14336 18 against 19,
    4096 x 4096 8 against 10)."""
    if m <= 8:
        return True
    return m <= GEMV_MAX_M and narrow(n, sm_count)


@lru_cache(maxsize=4096)
def plan(m: int, n: int, k: int, sm_count: int) -> GemvConfig | TcConfig:
    """The kernel (by its config's type) and work split for one call shape; cached, as it runs on every call."""
    if uses_decode_kernel(m, n, sm_count):
        return gemv_config_for(m, n, k, sm_count)
    return tc_config_for(m, n, k, sm_count)


def check_layer(weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, n: int, k: int) -> None:
    """The layer's tensors against the sm90 layout's specs: metadata only, no device synchronisation."""
    require_triton(weight)
    specs = layout.runtime_specs(n, k)
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("weight_global_scale", weight_global_scale)):
        spec = specs[name]
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {spec.dtype} {list(spec.shape)}, got {t.dtype} {list(t.shape)}")
        if t.device != weight.device:
            raise ValueError(f"{name} is on {t.device}, weight on {weight.device}")


def check_transform(transform: torch.Tensor | None, weight: torch.Tensor, k: int) -> None:
    """An online input transform the pre-pass can apply: square, a fused block size dividing K, on the device."""
    if transform is None:
        return
    if not transform.is_floating_point() or not fuses_transform(transform) or k % transform.shape[0]:
        raise ValueError(f"transform must be a float [b, b] with b in {FUSED_TRANSFORM_BLOCKS} dividing K={k}, got "
                         f"{transform.dtype} {list(transform.shape)}")  # fmt: skip
    if transform.device != weight.device:
        raise ValueError(f"transform is on {transform.device}, weight on {weight.device}")
    if not transform.is_contiguous():
        raise ValueError("transform must be contiguous (the pre-pass reads it row-major)")


def check_input(x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"x must be contiguous bf16 [M, {k}], got {x.dtype} {list(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")


WALSH_SMEM_BYTES = 64 * 1024  # the largest in-kernel Walsh transform the dispatch takes (to K = 32768 at M = 1)


def walsh_in_kernel(walsh: WalshFactors | None, config: GemvConfig | TcConfig, m: int, n: int, k: int,
                    sm_count: int) -> bool:  # fmt: skip
    """Whether a Walsh-Hadamard input transform runs inside the decode kernel (``gemv_linear``'s ``walsh``: each
    program transforms x into shared memory first) rather than in the pre-pass before it. Measured on the H200
    (docs/benchmarks.md, "Online transforms"): at M = 1 the transform costs 0-12% of the GEMM in the kernel against
    6-25% for the pre-pass, except blocks of 128 on layers of more than two waves of programs (14336 x 4096: 14.9%
    against 11.5%, each of the 896 programs transforming the whole x); at M = 8 it costs 36-277% in the kernel
    (every program transforms 8 rows) against 11-28%: M = 1 only."""
    if walsh is None or not isinstance(config, GemvConfig) or m != 1:
        return False
    if walsh.block == 128 and layout.padded_shape(n, k)[0] // layout.STRIPE > 2 * sm_count:
        return False
    return walsh_smem_bytes(m, k, config) <= WALSH_SMEM_BYTES


def run(x, weight, weight_scale, weight_global_scale, n: int, k: int, transform=None,
        walsh: WalshFactors | None = None) -> torch.Tensor:  # fmt: skip
    """``linear`` without its checks: the dispatch alone. Activations that are not 16-byte aligned (a view into
    another tensor) are copied first: both kernels read them as 16-byte vectors, the decode kernel through an int32
    view, which a 2-byte offset cannot have. An online input ``transform`` runs in the activation pre-pass: the
    tensor-core kernel's k-slot pass, or before the decode kernel, which overlaps it through PDL; or, where it is
    of Walsh-Hadamard type (``walsh``, its factors) and ``walsh_in_kernel`` says so, inside the decode kernel."""
    if x.data_ptr() % 16:
        x = x.clone()
    config = plan(x.shape[0], n, k, sm_count(x.device.index or 0))
    if isinstance(config, TcConfig):
        return tc_linear(x, weight, weight_scale, weight_global_scale, n, k, config, transform=transform)
    if transform is None:
        return gemv_linear(x, weight, weight_scale, weight_global_scale, n, k, config)
    if walsh_in_kernel(walsh, config, x.shape[0], n, k, sm_count(x.device.index or 0)):
        return gemv_linear(x, weight, weight_scale, weight_global_scale, n, k, config, walsh=walsh)
    x = transformed_activations(x, transform)
    return gemv_linear(x, weight, weight_scale, weight_global_scale, n, k, config, pdl=True)


def linear(  # the layer's sm90 tensors, as ``layout.runtime_specs`` names them
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
    n: int, k: int, transform: torch.Tensor | None = None, walsh: WalshFactors | None = None,
) -> torch.Tensor:
    """``(x @ blockdiag(transform)) @ W^T`` for bf16 ``x [M, K]`` and the sm90 runtime tensors of ``W [N, K]``
    (``transform``: an online input transform, ``fuses_transform``, or None; ``walsh``: its
    ``transforms.walsh_factors``, read once by the caller, or None); returns bf16 ``[M, N]``."""
    check_layer(weight, weight_scale, weight_global_scale, n, k)
    check_input(x, weight, k)
    check_transform(transform, weight, k)
    check_walsh(walsh, transform)
    return run(x, weight, weight_scale, weight_global_scale, n, k, transform, walsh)


def check_walsh(walsh: WalshFactors | None, transform: torch.Tensor | None) -> None:
    """Factors only with their matrix, and of its block (metadata only: the caller read them from it)."""
    if walsh is not None and (transform is None or transform.shape[0] != walsh.block):
        raise ValueError(f"walsh factors of block {walsh.block} need their [{walsh.block}, {walsh.block}] transform")


class Prepared:
    """``x -> linear(x, ...)`` for one layer, its tensors checked once at construction: the eager op's per-call path.

    It trusts its caller (``nvfp4_linear``) for a contiguous bf16 ``x [M, K]`` and checks only its device (a kernel
    handed a pointer of another device faults). Per M it keeps a prepared launch, so that a call is an allocation
    and one or two launches: Triton's generic launch and this module's dispatch cost 50-100 us of CPU time per call
    on the H200's host, more than the kernels take on the GPU at decode sizes (docs/benchmarks.md, "sm90 runtime
    op: CPU cost per call"). At the decode kernel's sizes that is ``decode.GemvLaunch`` (with an online input
    ``transform``: the pre-pass and that launch with PDL, or that launch alone where the kernel applies it itself,
    ``walsh``, ``walsh_in_kernel``); at the tensor-core kernel's, up to ``PREPARED_MAX_M``, ``TcLaunch`` (its
    activation pass, which applies the transform, and the kernel). ``prepared_tc=False`` keeps the tensor-core
    calls on ``run`` (the environment variable ``NVFP4_REPACK_PREPARED_TC=0`` sets it for every layer).
    """

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, n: int, k: int,
        transform: torch.Tensor | None = None, walsh: WalshFactors | None = None, prepared_tc: bool | None = None,
    ) -> None:  # fmt: skip
        check_layer(weight, weight_scale, weight_global_scale, n, k)
        check_transform(transform, weight, k)
        check_walsh(walsh, transform)
        self.transform, self.walsh = transform, walsh
        self.tensors = (weight, weight_scale, weight_global_scale)
        self.n, self.k = n, k
        self.device, self.index = weight.device, weight.get_device()
        self.prepared_tc = PREPARED_TC if prepared_tc is None else prepared_tc
        self.launches: dict[int, Callable[[torch.Tensor], torch.Tensor] | None] = {}  # M -> launch, None: ``run``

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        launch = self.launches.get(m, False)
        if launch is False:
            launch = self.launches[m] = self._launch_for(m)
        if x.get_device() != self.index:
            raise ValueError(f"weight is on {self.device}, x on {x.device}")
        if launch is not None and x.data_ptr() % 16 == 0 and torch.cuda.current_device() == self.index:
            return launch(x)
        return run(x, *self.tensors, self.n, self.k, self.transform, self.walsh)

    def _launch_for(self, m: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        config = plan(m, self.n, self.k, sm_count(self.index))
        if m == 0:
            return None
        with torch.cuda.device(self.index):
            if isinstance(config, TcConfig):
                if not self.prepared_tc or m > PREPARED_MAX_M:
                    return None
                return TcLaunch(*self.tensors, self.n, self.k, config, m, self.transform)
            in_kernel = self.transform is not None and walsh_in_kernel(self.walsh, config, m, self.n, self.k,
                                                                       sm_count(self.index))  # fmt: skip
            prepass = self.transform is not None and not in_kernel
            launch = GemvLaunch(*self.tensors, self.n, self.k, config, m, pdl=prepass,
                                walsh=self.walsh if in_kernel else None)  # fmt: skip
        return partial(_after_prepass, launch, self.transform) if prepass else launch


def _after_prepass(launch: GemvLaunch, transform: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return launch(transformed_activations(x, transform))


def prepare(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, n: int, k: int,
    transform: torch.Tensor | None = None, walsh: WalshFactors | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:  # fmt: skip
    """``Prepared`` for one layer (the backend registry's entry point)."""
    return Prepared(weight, weight_scale, weight_global_scale, n, k, transform, walsh)
