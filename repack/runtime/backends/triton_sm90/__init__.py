"""Triton/Gluon W4A16 linear for Hopper (sm90): bf16 activations x NVFP4 weights in the ``sm90`` layout -> bf16.

Both kernels read the same layout (``repack/targets/sm90.py``), whose 32-bit words are tensor-core A fragments,
and decode them with the same inline PTX (``ptx``); accumulation is float32 on the tensor cores. One module each:

* ``decode``: ``_gemv_kernel``, the decode-bound kernel for ``M <= 8`` (16 on narrow layers): ``mma.sync`` with
  the activations read straight from global memory, no shared memory.
* ``tensor_core``: ``_tc_kernel``, warp-specialised (a TMA loader warp, wgmma consumer warpgroups), the other
  sizes, with the k-slot activation pass it overlaps through programmatic dependent launch, and split-K. That
  pass also applies a layer's online input transform (``fuses_transform``), which before the decode kernel runs
  alone (``transformed_activations``), the decode kernel launched with PDL and loading its first weights
  while it runs; a Walsh-Hadamard transform the decode kernel applies itself (``gemv_linear``'s ``walsh``).
* ``dispatch``: which one runs (``linear``, ``prepare``) and with which work split, from the H200 measurements.
* ``dequant``: bf16 weights for the benchmarks' cuBLAS baseline and the tests.
* ``common``: the optional Triton imports, device facts, ``Launcher`` (a cached launch path, as Triton's
  generic one costs more CPU time per call at M = 1 than the kernel takes on the GPU) and ``DirectLaunch`` (one
  prepared launch through Triton's C launcher: ``decode.GemvLaunch`` and ``tensor_core.TcLaunch``, the eager
  per-layer calls of ``dispatch.Prepared``).

Every path captures into CUDA graphs and runs under ``torch.compile`` (no host synchronisation, nothing cached
between calls that depends on the data), and neither kernel materialises bf16 weights.
"""

from .common import fuses_transform
from .decode import GEMV_MAX_M, MAX_SMEM, GemvConfig, gemv_config_for, gemv_linear, walsh_smem_bytes
from .dequant import dequantize
from .dispatch import check_layer, linear, plan, prepare, uses_decode_kernel
from .tensor_core import (
    TcConfig,
    kslot_activations,
    kslot_order,
    tc_config_for,
    tc_descriptors,
    tc_launch_options,
    tc_linear,
    transformed_activations,
)

__all__ = [
    "GEMV_MAX_M",
    "GemvConfig",
    "MAX_SMEM",
    "TcConfig",
    "check_layer",
    "dequantize",
    "fuses_transform",
    "gemv_config_for",
    "gemv_linear",
    "kslot_activations",
    "kslot_order",
    "linear",
    "plan",
    "prepare",
    "tc_config_for",
    "tc_descriptors",
    "tc_launch_options",
    "tc_linear",
    "transformed_activations",
    "uses_decode_kernel",
    "walsh_smem_bytes",
]
