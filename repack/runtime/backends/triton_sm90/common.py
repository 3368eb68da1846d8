"""What the sm90 kernels share: the Triton imports (optional on CPU-only installs), device facts, a cached launcher,
a prepared launch (``DirectLaunch``), and the programmatic-dependent-launch (PDL) helpers of the kernels that
follow an activation pre-pass."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

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


def _c_launcher(compiled: object) -> Callable | None:
    """The compiled kernel's C launch function itself, or None where this Triton's launcher is not the one this was
    written against (Triton 3.6: ``CompiledKernel.run`` a ``CudaLauncher`` whose ``launch`` is the C function, or a
    closure over it named ``launcher`` that encodes tensor descriptors per call) or the kernel needs scratch
    memory, which its Python ``__call__`` allocates per launch."""
    run = compiled.run
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    launch = getattr(run, "launch", None)
    closure = getattr(launch, "__closure__", None)
    if closure:
        cells = dict(zip(launch.__code__.co_freevars, closure))
        launch = cells["launcher"].cell_contents if "launcher" in cells else None
    return launch if callable(launch) and type(launch).__name__ == "builtin_function_or_method" else None


def _expanded(compiled: object, args: Sequence[object]) -> list[object] | None:
    """``args`` as the C launcher takes them: each host tensor descriptor as its encoded TMA map, sizes and strides
    (Triton 3.6's ``make_tensordesc_arg``, which its launcher wrapper calls per launch), or None if that function
    is not there or differs."""
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except ImportError:
        return None
    metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
    out: list[object] = []
    for arg in args:
        if TensorDescriptor is not None and isinstance(arg, TensorDescriptor):
            try:
                out.extend(make_tensordesc_arg(arg, metas.pop(0) if metas else None))
            except TypeError:  # another Triton's signature
                return None
        else:
            out.append(arg)
    return out


class DirectLaunch:
    """One compiled kernel's launch with its grid and every argument fixed but the tensors at ``slots`` (the
    activations, the output): a call is one C call. TMA descriptors are encoded once here, fixed tensors pass as
    integer addresses (the launcher then skips its per-pointer driver query), and Triton's Python launcher (the
    descriptor encoding, the scratch allocation closures) is skipped where ``_c_launcher`` recognises it; elsewhere
    the call goes through ``compiled.run`` with the original arguments, as ``Launcher`` does. The caller keeps the
    fixed tensors alive and calls on the device the kernel was compiled for."""

    def __init__(self, compiled: object, grid: tuple[int, ...], args: Sequence[object], constexprs: Sequence[object],
                 slots: Sequence[int]) -> None:  # fmt: skip
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.compiled = compiled
        run = compiled.run
        launch = _c_launcher(compiled)
        marked = [_Slot(i) if i in slots else a for i, a in enumerate(args)]
        expanded = _expanded(compiled, marked) if launch is not None else None
        if expanded is None:  # Triton's own launcher, arguments as given
            self.launch, self.head, fixed = run, (compiled.function, compiled.packed_metadata, None, None, None), marked
        else:
            self.launch = launch
            self.head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                         compiled.packed_metadata, None, None, None)  # fmt: skip
            fixed = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in expanded]
        self.direct = expanded is not None
        self.fixed = [*fixed, *constexprs]
        self.positions = [i for i, a in enumerate(self.fixed) if isinstance(a, _Slot)]

    def __call__(self, stream: int, *tensors: torch.Tensor) -> None:
        args = self.fixed.copy()
        for i, t in zip(self.positions, tensors):
            args[i] = t
        self.launch(*self.grid, stream, *self.head, *args)


class _Slot:
    """A placeholder for a per-call argument of ``DirectLaunch``."""

    def __init__(self, index: int) -> None:
        self.index = index


if triton is not None:

    @gluon.jit
    def grid_dependency_wait():
        """Wait until the previous kernel in the stream has finished and its writes are visible (a no-op unless
        launched with PDL): no activation, output or workspace access may come before this."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

else:
    grid_dependency_wait = None
