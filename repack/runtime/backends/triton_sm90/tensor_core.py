"""The tensor-core kernel (the sizes the decode kernel does not take): ``_tc_kernel``, Gluon, warp-specialised.

A program computes a ``[64 warpgroups, BM]`` tile of ``y^T = W x^T`` over a K range. A loader warp streams words,
scales and activation tiles by TMA into a ring of shared-memory slots (mbarriers with byte counts); the consumer
warpgroups decode each word straight into their wgmma A registers (``ptx.decode_asm``) and issue an asynchronous
``wgmma`` with the activation tile as the shared-memory B operand, decoding the next chunk while it runs. The
activations are permuted into the layout's k-slot order first (``kslot_activations``, one pass), so that a TMA box
lines up with the decoded fragments; the kernel is launched with programmatic dependent launch (PDL) so that its
launch and set-up overlap that pass, and waits for it before anything else. Split-K (only while the tiles do not
fill one wave) is atomic-free and deterministic: each split writes a float32 partial tile, bumps a per-tile counter
(release/acquire at GPU scope after a CTA barrier), and the last split to arrive sums the partials in split order
and writes bf16.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import torch

from ....targets import sm90 as layout
from .common import (
    REGISTERS_PER_SM,
    DirectLaunch,
    Launcher,
    TensorDescriptor,
    fence_async_shared,
    gl,
    grid_dependency_wait,
    gluon,
    launch_hooked,
    mbarrier,
    narrow,
    require_triton,
    sm_count,
    tl,
    tma,
    triton,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .ptx import decode_asm, scale_asm

@dataclass(frozen=True)
class TcConfig:
    """Work split of one ``_tc_kernel`` launch (weights decoded in registers as the wgmma A operand)."""

    bm: int  # activation rows per program: the wgmma N, a multiple of 16 up to 256
    warpgroups: int  # consumer warpgroups, 64 weight rows each
    stages: int  # pipeline depth (TMA ring slots of ``_TC_CHUNKS`` chunks), at least 2
    per_sm: int = 1  # programs resident per SM: the register cap divides the file (too low a cap fails in ptxas)


# 64-column chunks per pipeline step of ``_tc_kernel``, each decoded into its own A registers with one wgmma
# left in flight. One chunk rewrote the registers under the previous chunk's wgmma (wrong results on the H200 at
# BM >= 128); with four, or two wgmmas in flight, ptxas serialises the wgmmas (offline SASS: a full wait after
# every one) or the registers are again rewritten in flight.
_TC_CHUNKS = 2


def tc_config_for(m: int, n: int, k: int, sm_count: int) -> TcConfig:
    """Work split for ``_tc_kernel``, from the H200 sweeps (docs/benchmarks.md, rounds 3 to 5).

    Up to 16 rows (where the decode kernel is not used): 16-row tiles, four programs per SM. Up to 64 rows: one
    consumer warpgroup, several programs per SM hiding each other's step latency (four up to 32 rows: 57344 x 8192
    at M = 32 in 93 against 120 us with two; at 64 rows three were slower on 5 of 7 layers); on layers of fewer
    64-row tiles than half the SMs to M = 128 (4096 x 4096 at M = 128: 14.8 against 17.3 us with 128-row tiles in
    two splits, round 5). Up to 128: 128-row tiles, again one warpgroup and two programs per SM (0-7% faster than
    one program of two warpgroups on all 7 layers: 57344 x 8192 at M = 128 203 against 212 us). Up to 256: 256-row
    tiles (each weight decoded once) where they are more than half as many as the SMs, or where their K splits keep
    >= 64 steps each (8192 x 28672 at M = 256: 169-172 against 178-179 us, round 5), else the same 128-row tiles,
    whose programs fill more SMs (M = 256, us: 14336 x 4096 45 against 52, 10240 x 8192 82 against 99;
    8192 x 8192, 64 tiles, 63 against 53). Beyond, 256-row tiles unless 128-row ones (two warpgroups) fill the
    waves of programs at least 10% better (10240 x 8192 at M = 1024: 640 tiles of 128 rows, 4.8 waves, against
    320 of 256, 2.4).
    """
    if m <= 16:
        return TcConfig(bm=16, warpgroups=1, stages=4, per_sm=4)
    if m <= 32:
        return TcConfig(bm=32, warpgroups=1, stages=4, per_sm=4)
    if m <= 64 or (m <= 128 and narrow(n, sm_count)):
        return TcConfig(bm=64, warpgroups=1, stages=4, per_sm=2)
    one_warpgroup = TcConfig(bm=128, warpgroups=1, stages=3, per_sm=2)
    if m <= 128:
        return one_warpgroup
    np_, kp = layout.padded_shape(n, k)
    n_tiles = np_ // 128  # along N, for the two-warpgroup configs below
    wide = TcConfig(bm=256, warpgroups=2, stages=3)
    steps = kp // 64 // _TC_CHUNKS
    if m <= 256:
        long_k = steps // _tc_split(n_tiles, steps, wide, sm_count) >= 64
        return wide if 2 * n_tiles > sm_count or long_k else one_warpgroup
    tall = TcConfig(bm=128, warpgroups=2, stages=4)

    def fill(config: TcConfig) -> float:
        tiles = n_tiles * -(-m // config.bm)
        return _wave_fill(tiles * _tc_split(tiles, steps, config, sm_count), sm_count)

    return tall if fill(tall) > 1.1 * fill(wide) else wide


def tc_linear(  # the layer's sm90 tensors, as ``layout.runtime_specs`` names them
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
    n: int, k: int,
    config: TcConfig,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = True,
    transform: torch.Tensor | None = None,
) -> torch.Tensor:
    """The warp-specialised tensor-core kernel (any M; ``linear`` takes it wherever ``uses_decode_kernel`` is false)
    with an explicit work split (``linear`` picks one with ``tc_config_for``; benchmarks and tests sweep them);
    ``split_k`` defaults to ``_tc_split``, ``out`` (contiguous bf16 ``[M, N]``) to a new tensor. ``pdl``: launch with
    programmatic dependent launch, starting while ``kslot_activations`` (always its predecessor) runs; False: plain
    stream order (the tests compare both). ``transform``: the online input transform, applied in that pass
    (``fuses_transform``; the caller checks it)."""
    require_triton(x)
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    if config.stages < 2:
        raise ValueError(f"the tensor-core kernel needs at least 2 pipeline stages: {config}")
    grid, steps, total_steps = _tc_plan(m, weight, config, x.device.index or 0, split_k)
    split_k, kp = grid[2], weight.shape[1] // 2
    counters = torch.empty((grid[0] * grid[1] if split_k > 1 else 0,), dtype=torch.int32, device=x.device)
    xk = kslot_activations(x, kp, counters, transform)
    if split_k > 1:
        partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    else:
        partials, counters = out, out  # unused by the SPLIT=False specialisation
    _launch_tc(*_tc_launch_args(xk, weight, weight_scale, weight_global_scale, out, partials, counters, n, config,
                                grid, steps, total_steps, pdl))  # fmt: skip
    return out


def _tc_plan(m: int, weight: torch.Tensor, config: TcConfig, device_index: int,
             split_k: int | None = None) -> tuple[tuple[int, int, int], int, int]:  # fmt: skip
    """One call's grid (n-tiles, m-tiles, K splits; ``split_k`` defaults to ``_tc_split``, no split left empty),
    steps per split and steps in all."""
    stripes, kp = weight.shape[0], weight.shape[1] // 2
    n_tiles, m_tiles = stripes // (4 * config.warpgroups), triton.cdiv(m, config.bm)  # a 16-row stripe per warp
    total_steps = kp // 64 // _TC_CHUNKS
    if split_k is None:
        split_k = _tc_split(n_tiles * m_tiles, total_steps, config, sm_count(device_index))
    steps = triton.cdiv(total_steps, split_k)
    return (n_tiles, m_tiles, triton.cdiv(total_steps, steps)), steps, total_steps


def _tc_launch_args(xk, weight, weight_scale, weight_global_scale, out, partials, counters, n: int, config: TcConfig,
                    grid: tuple[int, int, int], steps: int, total_steps: int, pdl: bool):  # fmt: skip
    """``_tc_kernel``'s grid, arguments and constexprs/options (the output at argument 4)."""
    x_desc, w_desc, s_desc = tc_descriptors(xk, weight, weight_scale, config)
    args = (x_desc, w_desc, s_desc, weight_global_scale, out, partials, counters, xk.shape[0], n, steps, total_steps,
            grid[2])  # fmt: skip
    return grid, args, {"SPLIT": grid[2] > 1, **tc_launch_options(config, pdl)}


PREPARED_MAX_M = 1024  # the largest M whose eager calls take ``TcLaunch`` (its workspace: M x KP bf16 and more)
_workspaces: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # (device, stream) -> (bytes, generation)
_generations = itertools.count(1)


def _workspace(device: torch.device, stream: int, nbytes: int) -> tuple[torch.Tensor, int]:
    """The workspace of ``TcLaunch`` calls on one device and stream, grown (doubling) to ``nbytes``; a new one
    gets a new generation, so that launches built on the old one rebuild (and let it go)."""
    held = _workspaces.get((device.index, stream))
    if held is None or held[0].numel() < nbytes:
        size = max(nbytes, 2 * held[0].numel() if held is not None else 0)
        held = _workspaces[(device.index, stream)] = (torch.empty(size, dtype=torch.uint8, device=device),
                                                      next(_generations))  # fmt: skip
    return held


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


class TcLaunch:
    """One layer's tensor-core call at one M (``M <= PREPARED_MAX_M``; ``dispatch.Prepared``'s eager calls) reduced
    to an allocation and two ``DirectLaunch`` calls: the activation pass and the kernel, their TMA descriptors
    encoded once. Through ``tc_linear`` a call costs 90-100 us of CPU time on the H200's host (allocations, two
    launch keys, three descriptors built and encoded: docs/benchmarks.md, "sm90 runtime op: CPU cost per call").

    The pass's output, the split-K counters and the partials live in one workspace per device and stream
    (``_workspace``), shared by every layer: work on a stream runs in order, and the pass, launched without PDL,
    starts only after the kernel before it (the last user of the workspace) has finished. Under CUDA-graph capture
    (a graph must own its buffers) or with a launch hook set (a profiler's), a call takes ``tc_linear``. The caller
    guarantees a contiguous bf16 ``x [M, K]``, 16-byte aligned, on the current device (``dispatch.Prepared``)."""

    def __init__(self, weight, weight_scale, weight_global_scale, n: int, k: int, config: TcConfig, m: int,
                 transform: torch.Tensor | None = None) -> None:  # fmt: skip
        require_triton(weight)
        self.tensors, self.transform = (weight, weight_scale, weight_global_scale), transform
        self.n, self.k, self.m, self.config = n, k, m, config
        self.device, self.index = weight.device, weight.get_device()
        self.grid, self.steps, self.total_steps = _tc_plan(m, weight, config, self.index)
        split = self.grid[2]
        kp = weight.shape[1] // 2
        self.sizes = (_aligned(m * kp * 2), _aligned(4 * self.grid[0] * self.grid[1] if split > 1 else 0),
                      _aligned(4 * split * m * n if split > 1 else 0))  # fmt: skip
        self.stream = triton.runtime.driver.active.get_current_stream
        self.built_for: tuple[int, int] | None = None  # (stream, workspace generation)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing() or launch_hooked():
            return tc_linear(x, *self.tensors, self.n, self.k, self.config, transform=self.transform)
        stream = self.stream(self.index)
        held = _workspaces.get((self.index, stream))
        if held is None or (stream, held[1]) != self.built_for:
            self._build(stream)
        out = torch.empty((self.m, self.n), dtype=torch.bfloat16, device=self.device)
        self.prepass(stream, x)
        self.kernel(stream, out)
        return out

    def _build(self, stream: int) -> None:
        """Both launches on this stream's workspace (compiled, or found in Triton's cache, by ``Launcher``)."""
        buffer, generation = _workspace(self.device, stream, sum(self.sizes))
        m, (weight, weight_scale, weight_global_scale) = self.m, self.tensors
        kp, (xk_bytes, counter_bytes, _) = weight.shape[1] // 2, self.sizes
        xk = buffer[: m * kp * 2].view(torch.bfloat16).view(m, kp)
        counters = buffer[xk_bytes : xk_bytes + counter_bytes].view(torch.int32)
        partials = buffer[xk_bytes + counter_bytes :].view(torch.float32)[: self.grid[2] * m * self.n]
        x = torch.empty((m, self.k), dtype=torch.bfloat16, device=self.device)  # a stand-in: its shape and alignment
        launcher, grid, args, kwargs = _prepass(x, xk, counters, self.transform)
        compiled, constexprs = launcher.compiled_for(grid, args, kwargs)
        self.prepass = DirectLaunch(compiled, grid, args, constexprs, slots=(0,))
        if self.grid[2] == 1:
            partials = counters = xk  # unused by the SPLIT=False specialisation (bf16, as ``tc_linear`` passes)
        launch = _tc_launch_args(xk, weight, weight_scale, weight_global_scale, xk, partials, counters, self.n,
                                 self.config, self.grid, self.steps, self.total_steps, pdl=True)  # fmt: skip
        compiled, constexprs = _launch_tc.compiled_for(*launch)
        self.kernel = DirectLaunch(compiled, launch[0], launch[1], constexprs, slots=(4,))
        self.buffer, self.built_for = buffer, (stream, generation)  # the launches hold its address


def tc_descriptors(
    xk: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, config: TcConfig
) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    """TMA views: activation tiles ``[bm, 64]`` (k-slot order; the wgmma B operand, 128-byte swizzle), and per
    program and chunk the words ``[stripes, 128]`` and scale pairs ``[stripes, 32]`` (int16)."""
    rows = 4 * config.warpgroups

    def descriptor(t: torch.Tensor, block: list[int], swizzle: int) -> TensorDescriptor:
        layout = _shared_layout(swizzle, 8 * t.element_size())
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    return (
        descriptor(xk, [config.bm, 64], 128),
        descriptor(weight, [rows, 128], 0),
        descriptor(weight_scale.view(torch.int16), [rows, 32], 0),
    )


@lru_cache(maxsize=None)
def _shared_layout(swizzle: int, bits: int) -> object:
    """A TMA box's shared-memory layout: built once (its checks cost about 4 us per descriptor per call)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bits, rank=2)


def tc_launch_options(config: TcConfig, pdl: bool = True) -> dict[str, int]:
    """``_tc_kernel``'s constexprs and launch options for ``config``: consumer warps, and a register cap that lets
    ``per_sm`` programs (consumers plus the 4-warp loader group) share the register file."""
    warps = 4 * config.warpgroups
    maxnreg = REGISTERS_PER_SM // (config.per_sm * 32 * (warps + 4)) // 8 * 8
    return {"BM": config.bm, "NW": warps, "CPS": _TC_CHUNKS, "STAGES": config.stages, "num_warps": warps,
            "maxnreg": maxnreg, "launch_pdl": pdl}  # fmt: skip


def _tc_split(tiles: int, steps: int, config: TcConfig, sm_count: int) -> int:
    """K splits for ``tiles`` programs: up to 4, of >= 8 steps each, never into a second wave of programs. Splits
    that fill idle SMs (up to one program per SM) pay; splits that stack more programs on an SM pay only where each
    keeps at least 24 steps (16 with activation tiles of <= 32 rows), since every split writes and reads back a
    float32 partial tile of 64 x ``bm`` (H200 split sweep, docs/benchmarks.md round 5, us for 1 / 2 / 4 splits:
    4096 x 14336 at M = 64, 112 steps, 40.2 / 27.5 / 24.2; 4096 x 4096 at M = 256, 128 tiles of 32 steps, 20.4 /
    23.7 / 32.8; 8192 x 8192 at M = 32, 64 steps, 24.8 / 21.3 / 20.0). A second wave costs more than the idle SMs
    it fills (10240 x 8192, 80 tiles on 132 SMs: at M = 128 three splits took 54.9 us against 49.0 unsplit)."""
    stacked = min(config.per_sm * sm_count // tiles, steps // (16 if config.bm <= 32 else 24))
    return max(1, min(4, steps // 8, max(sm_count // tiles, stacked)))


def _wave_fill(programs: int, slots: int) -> float:
    """Busy fraction of the program slots over all waves (1.0 when the last wave is full)."""
    return programs / (-(-programs // slots) * slots)


def kslot_activations(
    x: torch.Tensor, kp: int, counters: torch.Tensor, transform: torch.Tensor | None = None
) -> torch.Tensor:
    """``kslot_order`` in one Triton pass (the TMA then loads activation tiles that match the decoded A fragments),
    which also zeroes the split-K ``counters`` (one launch fewer than a separate memset: 1.8 us on the H200) and
    applies the layer's online input ``transform`` (``fuses_transform``) first, so that it costs no launch either."""
    out = torch.empty((x.shape[0], kp), dtype=x.dtype, device=x.device)
    launcher, *launch = _prepass(x, out, counters, transform)
    launcher(*launch)
    return out


def _prepass(x: torch.Tensor, out: torch.Tensor, counters: torch.Tensor, transform: torch.Tensor | None):
    """The tensor-core kernel's activation pass into ``out [M, KP]``: its ``Launcher``, grid, arguments (x first)
    and constexprs/options; the k-slot pass, or the transform pass in k-slot order."""
    if transform is not None:
        return (_launch_transform, *_transform_args(x, out, counters, transform, kslot=True))
    m, k = x.shape
    kp = out.shape[1]
    return _launch_kslot, (triton.cdiv(m, 32), kp // 256), (x, out, counters, m, k, kp, counters.numel()), {
        "BR": 32, "num_warps": 4}


def transformed_activations(x: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
    """``x @ blockdiag(transform)`` (bf16 operands, float32 accumulation, bf16 out) by the same pass without the
    k-slot permutation: the decode kernel's predecessor, which it overlaps through PDL."""
    out = torch.empty_like(x)
    _launch_transform(*_transform_args(x, out, out, transform, kslot=False))  # no counters (COUNTERS = 0)
    return out


def _transform_args(x, out, counters, transform, kslot: bool):
    """``_transform_kernel``'s grid, arguments and constexprs/options over ``out [M, KP]`` as rows of one
    ``TE``-wide block each, 4096 elements a program (at least 64 rows: ``tl.dot`` then runs as wgmma; 8 warps for
    128-wide blocks, which spill with 4). With the k-slot order ``TE`` is a whole number of 64-column chunks, the
    permutation folded into the matrix's columns."""
    m, k = x.shape
    block = transform.shape[0]
    width = max(block, 64) if kslot else block
    rows, per_program = m * out.shape[1] // width, max(64, 4096 // width)
    args = (x, out, counters, transform, rows, out.shape[1] // width, k, counters.numel() if kslot else 0)
    return (triton.cdiv(rows, per_program),), args, {"TB": block, "TE": width, "RB": per_program, "KSLOT": kslot,
                                                      "num_warps": 8 if width > 64 else 4}  # fmt: skip


def kslot_order(x: torch.Tensor, kp: int) -> torch.Tensor:
    """``x [M, K]`` zero-padded to ``kp`` columns and permuted into the layout's k-slot order (``sm90.kslot_column``).

    The plain-torch definition of what ``kslot_activations`` computes in one Triton pass (the tests compare them):
    the tensor-core kernel's TMA then reads activation tiles that line up with its decoded A fragments.
    """
    m, k = x.shape
    if k < kp:
        x = torch.nn.functional.pad(x, (0, kp - k))
    out = torch.empty((m, kp), dtype=x.dtype, device=x.device)
    # k-slot 64c + 16j + 8q + 2t + p <- column 64c + 16t + 4j + 2q + p
    out.view(m, kp // 64, 4, 2, 4, 2).copy_(x.view(m, kp // 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5))
    return out


if triton is not None:
    _SCALE_ASM = tl.constexpr(scale_asm())
    _DECODE_ASM = tl.constexpr(decode_asm())

    @triton.jit
    def _zero_counters(count_ptr, COUNTERS):
        """Program (0, 0) zeroes the split-K counters of the tensor-core kernel that follows."""
        if tl.program_id(0) == 0 and tl.program_id(1) == 0:
            for start in range(0, COUNTERS, 1024):
                offs = start + tl.arange(0, 1024)
                tl.store(count_ptr + offs, tl.zeros([1024], tl.int32), mask=offs < COUNTERS)

    @triton.jit
    def _kslot_kernel(x_ptr, out_ptr, count_ptr, M, K, KP, COUNTERS, BR: tl.constexpr):
        """``kslot_activations``: rows ``BR`` x 256 columns per program; program (0, 0) also zeroes the counters."""
        tl.extra.cuda.gdc_launch_dependents()  # the tensor-core kernel (PDL) may launch and set up meanwhile
        _zero_counters(count_ptr, COUNTERS)
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rows = (pid_r * BR + tl.arange(0, BR)).to(tl.int64)[:, None]
        cols = pid_c * 256 + tl.arange(0, 256)[None, :]
        x = tl.load(x_ptr + rows * K + cols, mask=(rows < M) & (cols < K), other=0.0)
        # column 64c + 16t + 4j + 2q + p -> k-slot 64c + 16j + 8q + 2t + p
        x = tl.reshape(tl.permute(tl.reshape(x, (BR, 4, 4, 4, 2, 2)), (0, 1, 3, 4, 2, 5)), (BR, 256))
        tl.store(out_ptr + rows * KP + cols, x, mask=rows < M)

    @triton.jit
    def _transform_kernel(x_ptr, out_ptr, count_ptr, t_ptr, ROWS, BLOCKS, K, COUNTERS, TB: tl.constexpr,
                          TE: tl.constexpr, RB: tl.constexpr, KSLOT: tl.constexpr):  # fmt: skip
        """``out = x @ blockdiag(T)`` (``T``: ``TB`` square), then (``KSLOT``) in k-slot order: ``out`` read as
        ``ROWS`` rows of one ``TE``-wide block (``BLOCKS`` to a row of ``out``, which is ``x`` zero-padded), ``RB``
        of them per program, each times one ``TE`` square matrix: ``blockdiag(T)`` over ``TE`` columns with its
        columns permuted into k-slot order, so that loads and stores stay contiguous. Program 0 also zeroes the
        counters."""
        tl.extra.cuda.gdc_launch_dependents()  # the kernel after it (PDL) may launch and set up meanwhile
        _zero_counters(count_ptr, COUNTERS)
        r = (tl.program_id(0) * RB + tl.arange(0, RB))[:, None]
        i = tl.arange(0, TE)
        col = (r % BLOCKS) * TE + i[None, :]
        x = tl.load(x_ptr + (r // BLOCKS).to(tl.int64) * K + col, mask=(r < ROWS) & (col < K), other=0.0)
        j = tl.arange(0, TB)
        t = tl.load(t_ptr + j[:, None] * TB + j[None, :]).to(tl.bfloat16)
        if TE > TB:  # blockdiag(T, T, ..) over TE columns: kron(I, T)
            n = tl.arange(0, TE // TB)
            eye = (n[:, None] == n[None, :]).to(tl.bfloat16)
            t = tl.reshape(eye[:, None, :, None] * t[None, :, None, :], (TE, TE))
        if KSLOT:  # its columns in k-slot order: column 64c + 16t + 4j + 2q + p -> k-slot 64c + 16j + 8q + 2t + p
            t = tl.reshape(tl.permute(tl.reshape(t, (TE, TE // 64, 4, 4, 2, 2)), (0, 1, 3, 4, 2, 5)), (TE, TE))
        tl.store(out_ptr + r.to(tl.int64) * TE + i[None, :], tl.dot(x, t).to(x.dtype), mask=r < ROWS)

    @gluon.jit
    def _tc_loader(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, off_m, s0, c0, steps,
                   CPS: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Fill ring slot ``i % STAGES`` with step ``i``'s ``CPS`` chunks once the consumers released it."""
        nbytes: gl.constexpr = CPS * (x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes)
        for i in range(steps):
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            fence_async_shared()
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            for cc in gl.static_range(CPS):
                c = c0 + i * CPS + cc
                tma.async_copy_global_to_shared(x_desc, [off_m, c * 64], bar, x_smem.index(slot * CPS + cc))
                tma.async_copy_global_to_shared(w_desc, [s0, c * 128], bar, w_smem.index(slot * CPS + cc))
                tma.async_copy_global_to_shared(s_desc, [s0, c * 32], bar, s_smem.index(slot * CPS + cc))

    @gluon.jit
    def _tc_fragments(words, scales, a_layout: gl.constexpr):
        """Words ``[S, 32, 4]`` (stripe = warp, lane, tile j) and uint16 scale pairs ``[S, 32]`` -> the wgmma A
        operand ``[16 S, 64]`` bf16 in k-slot order (``e2m1 * scale * 2**-7``). The joins and reshapes only
        relabel registers: each thread's word already is its A fragment."""
        S: gl.constexpr = words.shape[0]
        s0, s1 = gl.inline_asm_elementwise(
            _SCALE_ASM, "=r,=r,h", [scales], dtype=(gl.int32, gl.int32), is_pure=True, pack=1
        )
        s0, _ = gl.broadcast(gl.expand_dims(s0, 2), words)
        s1, _ = gl.broadcast(gl.expand_dims(s1, 2), words)
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            _DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, s0, s1],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
        w = gl.join(gl.join(gl.join(e0, e1), gl.join(e2, e3)), gl.join(gl.join(e4, e5), gl.join(e6, e7)))
        w = gl.reshape(w, [S, 8, 4, 4, 2, 2, 2])  # s, g, t, j, p, h, q (element e = p + 2h + 4q)
        w = gl.permute(w, [0, 5, 1, 3, 6, 2, 4])  # s, h, g | j, q, t, p: k-slot 16j + 8q + 2t + p
        return gl.convert_layout(gl.reshape(w, [16 * S, 64]), a_layout, assert_trivial=True)

    @gluon.jit
    def _tc_consumer(x_smem, w_smem, s_smem, ready, empty, steps, BM: gl.constexpr, NW: gl.constexpr,
                     CPS: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """Per chunk: decode the words into A registers and issue an async wgmma on the activation tile; the wait
        after it retires the previous chunk's wgmma, whose ring slot is then free.

        A wgmma reads its A registers asynchronously until a wait retires it. The two chunks of a step decode into
        their own registers, each rewritten only in the next step, after the wait that retired it (``_TC_CHUNKS``).
        """
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        LW: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [NW, 1, 1], [2, 1, 0])  # warp w: stripe w
        acc = gl.zeros([16 * NW, BM], gl.float32, acc_layout)
        a_prev = gl.zeros([16 * NW, 64], gl.bfloat16, a_layout)
        for i in range(steps):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            for cc in gl.static_range(CPS):
                buf = slot * CPS + cc
                words = w_smem.index(buf).reshape([NW, 32, 4]).load(LW)
                scales = s_smem.index(buf).load(gl.SliceLayout(2, LW))
                a = _tc_fragments(words, scales, a_layout)
                acc = warpgroup_mma(a, x_smem.index(buf).permute((1, 0)), acc, is_async=True)
                acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
                a_prev = a
                if cc == 0:
                    if i > 0:
                        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1)
        acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
        return (acc,)  # the default partition returns a tuple

    @gluon.jit
    def _tc_kernel(
        x_desc, w_desc, s_desc, g_ptr, y_ptr, part_ptr, count_ptr, M, N, STEPS, TOTAL_STEPS, SPLIT_K,
        BM: gl.constexpr, NW: gl.constexpr, CPS: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    ):  # fmt: skip
        """``tc_linear``: program (n, m, k) computes ``y[m-tile, n-tile]^T`` over steps ``k STEPS ..`` of
        ``CPS`` chunks; with ``SPLIT`` the last program of a tile to arrive sums the partials in split order."""
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        BN: gl.constexpr = 16 * NW  # one 16-row stripe per consumer warp
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES * CPS, BM, 64], x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES * CPS, NW, 128], w_desc.layout)
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES * CPS, NW, 32], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        steps = gl.minimum(STEPS, TOTAL_STEPS - pid_k * STEPS)
        grid_dependency_wait()  # launched with PDL: the k-slot pass may still be writing x_desc's tensor
        (acc,) = gl.warp_specialize(
            [
                (_tc_consumer, (x_smem, w_smem, s_smem, ready, empty, steps, BM, NW, CPS, STAGES)),
                (_tc_loader, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, pid_m * BM, pid_n * NW,
                              pid_k * STEPS * CPS, steps, CPS, STAGES)),
            ],
            [1],
            [24],
        )  # fmt: skip
        LO: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, NW], [0, 1])  # 8 consecutive outputs per thread
        acc = gl.convert_layout(acc, LO)
        offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LO))[:, None]
        offs_m = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, LO))[None, :]
        mask = (offs_m < M) & (offs_n < N)
        y_off = offs_m.to(gl.int64) * N + offs_n
        scale = gl.load(g_ptr) * 128.0
        if not SPLIT:
            gl.store(y_ptr + y_off, (acc * scale).to(gl.bfloat16), mask=mask)
        else:
            tile_elems = N.to(gl.int64) * M  # M may be the constant 1 (Triton specialises it), N never is
            gl.store(part_ptr + pid_k * tile_elems + y_off, acc, mask=mask)
            gl.thread_barrier()  # every thread's partial is written before the release below
            arrived = gl.atomic_add(count_ptr + pid_m * gl.num_programs(0) + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = gl.zeros([BN, BM], gl.float32, LO)
                for split in range(SPLIT_K):
                    total += gl.load(part_ptr + split * tile_elems + y_off, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(y_ptr + y_off, (total * scale).to(gl.bfloat16), mask=mask)

    _launch_kslot = Launcher(_kslot_kernel)
    _launch_transform = Launcher(_transform_kernel)
    _launch_tc = Launcher(_tc_kernel)  # Triton's generic launch took 0.56x bf16 at eager batch 32 (docs/benchmarks.md)
