"""What the sm90 kernels share: the Triton imports (optional on CPU-only installs), device facts, a cached launcher,
and the programmatic-dependent-launch (PDL) helpers of the kernels that follow an activation pre-pass."""

from __future__ import annotations

from functools import lru_cache

import torch

from ....targets import sm90 as layout

try:
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # CPU-only installs: importing must work, calling must say why it cannot
    triton = tl = gluon = gl = knobs = None
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

REGISTERS_PER_SM = 65536
FUSED_TRANSFORM_BLOCKS = (16, 32, 64, 128)  # online-transform blocks the activation pre-pass applies (one ``tl.dot``
# operand, whole within or made of 64-column k-slot chunks); others run as ``block_transform`` before the kernels
MAX_WARPS_PER_SM = 64
_MAX_KEYS = 4096  # launch keys one Launcher keeps


def require_triton(t: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the sm90 W4A16 backend needs Triton (pip install triton); it is not importable here")
    if not t.is_cuda:
        raise RuntimeError(f"the sm90 W4A16 backend runs on CUDA tensors, got a tensor on {t.device}")


def fuses_transform(matrix: torch.Tensor) -> bool:
    """Whether the sm90 kernels apply ``x @ blockdiag(matrix)`` in their activation pre-pass (pure shape logic, so
    it can be asked on any machine)."""
    return matrix.dim() == 2 and matrix.shape[0] == matrix.shape[1] and matrix.shape[0] in FUSED_TRANSFORM_BLOCKS


@lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def narrow(n: int, sm_count: int) -> bool:
    """Fewer 64-row tiles than half the SMs (N <= 4224 on 132): too few programs unless they split K or M finely."""
    return 2 * (layout.padded_shape(n, 64)[0] // 64) < sm_count


def _arg_key(arg: object) -> object:
    """What Triton's specialisation can depend on: a tensor's dtype and 16-byte alignment; a tensor descriptor's
    dtype, block, shared layout and padding (Triton's own key, ``tensordesc<dtype[block],layout>``), and whether
    each of its sizes and strides is a multiple of 16 (more than Triton keys on: a superset only costs a lookup);
    any other value itself."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if TensorDescriptor is not None and isinstance(arg, TensorDescriptor):
        return (arg.base.dtype, tuple(arg.block_shape), arg.layout, arg.padding,
                tuple(d % 16 == 0 for d in (*arg.shape, *arg.strides)))  # fmt: skip
    return arg


def launch_hooked() -> bool:
    """Whether a launch hook (a profiler's) is set. Triton 3.6 keeps them in a ``HookChain``, which is never None:
    testing for None sent every launch down Triton's generic path."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """``kernel[grid](*args, **kwargs)`` without Triton's generic launch path on repeated calls.

    Triton binds, specialises and hashes every argument on each launch, which at M = 1 costs more CPU time than
    the kernel takes on the GPU (docs/benchmarks.md, "sm90 runtime op: CPU cost per call"). This keys its own cache
    on a superset of what that specialisation reads (integer values exactly, tensor dtypes and alignment, the
    constexprs and options, the device), takes the first launch of each key through Triton (which compiles or finds
    the kernel), and afterwards calls the compiled kernel's launcher directly, as Triton itself does last.
    Pointer, integer and host tensor-descriptor arguments (the compiled launcher encodes a descriptor's TMA map on
    every call, as Triton's path does); launch hooks (profilers) take Triton's path.
    """

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, tuple] = {}
        self.stream = None  # the driver's raw current-stream getter, looked up on the first launch

    def compiled_for(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, object]) -> tuple[object, tuple]:
        """The compiled kernel for these arguments and its constexpr values in signature order (the launch takes
        every parameter). Compiles, or finds in Triton's cache, without launching."""
        key = (torch.cuda.current_device(), tuple(map(_arg_key, args)), tuple(kwargs.items()))
        hit = self.compiled.get(key)
        if hit is None:
            if len(self.compiled) >= _MAX_KEYS:  # exact integers key it: varying M (prefill) must not grow it forever
                self.compiled.clear()
            compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
            hit = self.compiled[key] = (compiled, tuple(kwargs[name] for name in self.kernel.arg_names[len(args) :]))
            self.stream = triton.runtime.driver.active.get_current_stream
        return hit

    def __call__(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, object]) -> None:
        if launch_hooked():  # a profiler's hook: Triton's own path calls it
            self.kernel[grid](*args, **kwargs)
            return
        compiled, constexprs = self.compiled_for(grid, args, kwargs)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, self.stream(torch.cuda.current_device()), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *constexprs)  # fmt: skip


if triton is not None:

    @gluon.jit
    def grid_dependency_wait():
        """Wait until the previous kernel in the stream has finished and its writes are visible (a no-op unless
        launched with PDL): no activation, output or workspace access may come before this."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

else:
    grid_dependency_wait = None
