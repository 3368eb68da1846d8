"""The decode kernel (``M <= 8``, and up to 16 on narrow layers): ``_gemv_kernel``, Gluon, no shared memory.

Decode-bound, so written for the fewest instructions per weight (about 20-22 per 32-bit word in the loop). One
inline-PTX block per thread and 64-column chunk (``ptx.gemv_asm``) decodes its 4 words (one scale pair: the v2
layout gives a thread one scale block per chunk) and chains 4 ``mma.sync.m16n8k16`` (8 for ``M > 8``) with the
activations as the B operand, read straight from global memory as two 16-byte vectors per chunk. A program owns
``spt`` 16-row stripes over the whole K; its warps split K and are summed once at the end (deterministic, no
workspace). ``maxnreg`` lets ptxas keep a step's loads ahead of their use.

An online input transform of Walsh-Hadamard type (``transforms.walsh_factors``: ``hadamard``, and
``random-hadamard`` where its matrix is Sylvester's up to signs) runs inside the kernel up to M = 8: each program
first loads its first step's weights, then transforms x once into shared memory, every lane butterflying its own 16
columns of one row in float32 (``ptx.walsh_asm``: lane shuffles for blocks of 32 and 64, two chunks per lane for
128) and rounding to bf16 once, and the loop reads its x fragments from there; the transform's 1 / sqrt(b) goes
into the output scale. Every program repeats the transform (a few hundred instructions per thread): cheaper than a
pre-pass kernel, whose completion the kernel would wait for (docs/benchmarks.md, "Online transforms").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ....targets import sm90 as layout
from ...transforms import WalshFactors
from .common import (
    MAX_WARPS_PER_SM,
    REGISTERS_PER_SM,
    DirectLaunch,
    Launcher,
    gl,
    gluon,
    grid_dependency_wait,
    require_triton,
    triton,
)
from .ptx import gemv_asm, walsh_asm

GEMV_MAX_M = 16  # the decode kernel's limit: two m16n8 B tiles per mma step
MAX_SMEM = 227 * 1024  # shared memory one program of the H200 may take


@dataclass(frozen=True)
class GemvConfig:
    """Work split of one ``_gemv_kernel`` launch."""

    spt: int  # 16-row stripes per program (and per thread: activations are reused across them): 1, 2, 4 or 8
    chunks: int  # 64-column chunks per warp per loop step (16-byte weight loads per stripe and round trip)
    num_warps: int  # warps per program, each taking every num_warps-th group of chunks along K
    maxnreg: int = 0  # register cap for ptxas (0: its default, which interleaves loads with use to save registers)


def gemv_config_for(m: int, n: int, k: int, sm_count: int) -> GemvConfig:
    """Work split for ``_gemv_kernel``: 8 warps per program hide more latency, 4 fit more programs per SM.

    Measured on the H200 (docs/benchmarks.md): the 8-warp split is 5-15% faster unless it needs more waves of
    programs than the 4-warp one (10240 x 8192 at M = 1: 640 programs, 528 resident 8-warp programs against
    660: 18.8 against 16.0 us), so take the 8-warp split exactly when it needs no more waves.
    """
    if m <= 8:
        wide, narrow = GemvConfig(spt=1, chunks=4, num_warps=8, maxnreg=64), GemvConfig(1, 4, 4, 96)
    else:
        wide, narrow = GemvConfig(spt=1, chunks=2, num_warps=8, maxnreg=80), GemvConfig(1, 2, 4, 96)
    programs = layout.padded_shape(n, k)[0] // layout.STRIPE
    return wide if _waves(programs, wide, sm_count) <= _waves(programs, narrow, sm_count) else narrow


def _waves(programs: int, config: GemvConfig, sm_count: int) -> int:
    """Rounds of ``programs`` one-stripe programs on ``sm_count`` SMs, residency bounded by the register cap."""
    per_sm = min(REGISTERS_PER_SM // (config.maxnreg * 32 * config.num_warps), MAX_WARPS_PER_SM // config.num_warps)
    return -(-programs // (per_sm * sm_count))


def _gemv_launch_args(x, weight, weight_scale, weight_global_scale, out, n, k, config: GemvConfig, pdl: bool = False,
                      walsh: WalshFactors | None = None):  # fmt: skip
    """``_gemv_kernel``'s grid, arguments and constexprs/options for one call (``pdl``, ``walsh``: as in
    ``gemv_linear``)."""
    m = x.shape[0]
    stripes, chunks = weight.shape[0], weight.shape[1] // 128
    hs = walsh.scale if walsh is not None else 1.0
    args = (x.view(torch.int32), weight, weight_scale.view(torch.int32), weight_global_scale, out, m, n, k, chunks, hs)
    rows, steps = walsh_smem_shape(m, k, config) if walsh is not None else (1, 1)
    kwargs = {"SPT": config.spt, "C_T": config.chunks, "WK": config.num_warps, "NT": 1 if m <= 8 else 2,
              "EVEN": k == 64 * chunks and chunks % (config.chunks * config.num_warps) == 0,
              "PDL": pdl, "WALSH": _walsh_asm(walsh) if walsh is not None else "",
              "HB": walsh.block if walsh is not None else 0, "RP": rows, "NS": steps,
              "num_warps": config.num_warps, "launch_pdl": pdl,
              **({"maxnreg": config.maxnreg} if config.maxnreg else {})}  # fmt: skip
    return (stripes // config.spt,), args, kwargs


def walsh_smem_shape(m: int, k: int, config: GemvConfig) -> tuple[int, int]:
    """Rows (M to a power of two) and loop steps (to a power of two) of the Walsh prologue's shared memory."""
    steps = -(-layout.padded_shape(16, k)[1] // 64 // (config.chunks * config.num_warps))
    return 1 << max(m - 1, 0).bit_length(), 1 << (steps - 1).bit_length()


def walsh_smem_bytes(m: int, k: int, config: GemvConfig) -> int:
    """Shared memory of the Walsh prologue: one program's transformed x, ``[rows, steps * chunks * 64]`` bf16."""
    rows, steps = walsh_smem_shape(m, k, config)
    return rows * steps * config.chunks * config.num_warps * 128


@lru_cache(maxsize=64)
def _walsh_asm(walsh: WalshFactors) -> str:
    return walsh_asm(walsh.block, walsh.d1, walsh.d2)


def gemv_linear(  # the layer's sm90 tensors, as ``layout.runtime_specs`` names them
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
    n: int, k: int,
    config: GemvConfig,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    walsh: WalshFactors | None = None,
) -> torch.Tensor:
    """The decode kernel (``M <= 16``) with an explicit work split; ``out`` (contiguous bf16 ``[M, N]``) optional.

    ``pdl``: launch with programmatic dependent launch while the kernel before it (the online transform's
    pre-pass, ``transformed_activations``) runs: each program loads its first step's weights, then waits for that
    kernel before any access to ``x`` or ``out``. False: plain stream order. ``walsh``: an online input transform
    of Walsh-Hadamard type (``transforms.walsh_factors``) applied by the kernel itself, no pre-pass: each program
    transforms x once into shared memory before its loop (M <= 8, ``walsh_smem_bytes`` within ``MAX_SMEM``)."""
    require_triton(x)
    m = x.shape[0]
    if m > GEMV_MAX_M:
        raise ValueError(f"the decode kernel takes at most {GEMV_MAX_M} rows, got {m}")
    if walsh is not None and (m > 8 or walsh_smem_bytes(m, k, config) > MAX_SMEM):
        raise ValueError(f"the in-kernel Walsh transform takes M <= 8 and {MAX_SMEM} bytes, got M={m}, K={k}")
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    _launch_gemv(*_gemv_launch_args(x, weight, weight_scale, weight_global_scale, out, n, k, config, pdl, walsh))
    return out


class GemvLaunch:
    """One layer's decode-kernel call at one M, reduced to an allocation and a launch: the kernel compiled (or found
    in Triton's cache) once here for 16-byte aligned activations, every other argument fixed (``DirectLaunch``). The
    caller guarantees a contiguous bf16 ``x [M, K]``, 16-byte aligned, on the current device
    (``dispatch.Prepared``); ``pdl`` and ``walsh`` as in ``gemv_linear``."""

    def __init__(self, weight, weight_scale, weight_global_scale, n: int, k: int, config: GemvConfig, m: int,
                 pdl: bool = False, walsh: WalshFactors | None = None) -> None:  # fmt: skip
        require_triton(weight)
        x = torch.empty((m, k), dtype=torch.bfloat16, device=weight.device)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=weight.device)
        grid, args, kwargs = _gemv_launch_args(x, weight, weight_scale, weight_global_scale, out, n, k, config, pdl,
                                               walsh)  # fmt: skip
        compiled, constexprs = _launch_gemv.compiled_for(grid, args, kwargs)
        self.launch = DirectLaunch(compiled, grid, args, constexprs, slots=(0, 4))  # x and out change per call
        self.shape, self.device = (m, n), weight.device
        self.stream = triton.runtime.driver.active.get_current_stream

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=torch.bfloat16, device=self.device)
        self.launch(self.stream(self.device.index), x, out)  # the launcher reads pointers only: x's bf16 storage
        return out  # is the kernel's int32 view


if triton is not None:
    _GEMV_ASM_1 = gl.constexpr(gemv_asm(1))
    _GEMV_ASM_2 = gl.constexpr(gemv_asm(2))

    @gluon.jit
    def _idx4(n: gl.constexpr, dim: gl.constexpr, L: gl.constexpr):
        """``arange(n)`` along ``dim`` of a rank-4 tensor in layout ``L`` (size 1 elsewhere)."""
        if dim == 0:
            return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))[:, None, None, None]
        elif dim == 1:
            return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))[None, :, None, None]
        elif dim == 2:
            return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))[None, None, :, None]
        else:
            return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))[None, None, None, :]

    @gluon.jit
    def _idx3(n: gl.constexpr, dim: gl.constexpr, L: gl.constexpr):
        """``arange(n)`` along ``dim`` of a rank-3 tensor in layout ``L`` (size 1 elsewhere)."""
        if dim == 0:
            return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))[:, None, None]
        elif dim == 1:
            return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))[None, :, None]
        else:
            return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))[None, None, :]

    @gluon.jit
    def _halves(t, L: gl.constexpr):
        """Split the last dimension (size 2, in registers) into two tensors of layout ``L``."""
        a, b = gl.split(t)
        return gl.convert_layout(a, L, assert_trivial=True), gl.convert_layout(b, L, assert_trivial=True)

    @gluon.jit
    def _idx5(n: gl.constexpr, dim: gl.constexpr, L: gl.constexpr):
        """``arange(n)`` along ``dim`` of a rank-5 tensor in layout ``L`` (size 1 elsewhere)."""
        if dim == 2:  # a rank-4 view without axis 1, where axis 2 becomes axis 1
            return gl.expand_dims(_idx4(n, 1, gl.SliceLayout(1, L)), 1)
        elif dim < 2:  # without axis 2
            return gl.expand_dims(_idx4(n, dim, gl.SliceLayout(2, L)), 2)
        else:
            return gl.expand_dims(_idx4(n, dim - 1, gl.SliceLayout(2, L)), 2)


    @gluon.jit
    def _gemv_load(w_ptr, s_ptr, x_ptr, s0, c0, KCH, M, K, SPT: gl.constexpr, C_T: gl.constexpr, WK: gl.constexpr,
                   NT: gl.constexpr, EVEN: gl.constexpr, L4: gl.constexpr, LX: gl.constexpr):  # fmt: skip
        """``_w_load`` and ``_x_load``: one step's words, scale words and x n-tiles 0 and 1."""
        words, sw = _w_load(w_ptr, s_ptr, s0, c0, KCH, SPT, C_T, WK, EVEN, L4)
        xa, xb = _x_load(x_ptr, c0, M, K, C_T, WK, NT, EVEN, LX)
        return words, sw, xa, xb

    @gluon.jit
    def _w_load(w_ptr, s_ptr, s0, c0, KCH, SPT: gl.constexpr, C_T: gl.constexpr, WK: gl.constexpr,
                EVEN: gl.constexpr, L4: gl.constexpr):  # fmt: skip
        """Words ``[SPT, CK, 32, 4]`` (one 16-byte run per thread, stripe and chunk) and scale words ``[SPT, CK, 32]``
        (the int32 holding the lane's uint16 pair and its neighbour's) of the step at chunk ``c0``, warp ``w``
        taking chunks ``c0 + w C_T ..``; nothing is read past KCH, and unless ``EVEN`` (no step partly past the
        end) what is not read is zero.

        Addresses are built as a per-thread pointer plus offsets that are constants per register (a rank-5 view
        with the thread's ``C_T`` chunks on their own axis), so that ptxas folds them into the loads' immediates.
        """
        L5: gl.constexpr = gl.BlockedLayout([SPT, 1, C_T, 1, 4], [1, 1, 1, 32, 1], [1, WK, 1, 1, 1], [4, 3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(4, L5)
        CK: gl.constexpr = C_T * WK
        first = c0 + _idx5(WK, 1, L5) * C_T
        w_ptrs = w_ptr + (((s0 + _idx5(SPT, 0, L5)) * KCH + first) * 128 + _idx5(32, 3, L5) * 4)
        w_ptrs = w_ptrs + (_idx5(C_T, 2, L5) * 128 + _idx5(4, 4, L5))
        first_s = c0 + _idx4(WK, 1, LS) * C_T
        s_ptrs = s_ptr + (((s0 + _idx4(SPT, 0, LS)) * KCH + first_s) * 16 + _idx4(32, 3, LS) // 2)
        s_ptrs = s_ptrs + _idx4(C_T, 2, LS) * 16
        if EVEN:
            words = gl.load(w_ptrs)
            sw = gl.load(s_ptrs)
        else:
            words = gl.load(w_ptrs, mask=first + _idx5(C_T, 2, L5) < KCH)
            sw = gl.load(s_ptrs, mask=first_s + _idx4(C_T, 2, LS) < KCH, other=0)  # zero scales: unread words are 0
        words = gl.convert_layout(gl.reshape(words, [SPT, CK, 32, 4]), L4)
        sw = gl.convert_layout(gl.reshape(sw, [SPT, CK, 32]), gl.SliceLayout(3, L4))
        return words, sw

    @gluon.jit
    def _x_load(x_ptr, c0, M, K, C_T: gl.constexpr, WK: gl.constexpr, NT: gl.constexpr, EVEN: gl.constexpr,
                LX: gl.constexpr):  # fmt: skip
        """x B fragments ``[1, CK, 32, 8]`` int32 (bf16 pairs) of chunks ``c0 ..`` for n-tiles 0 and 1 (rows 8..15).

        Lane (g, t) reads ``x[g, 64c + 16t .. +15]``, two 16-byte runs. Lanes of rows past M read row M - 1
        instead: finite values that only reach D columns which are never stored, and no predicated loads whose
        registers must be zeroed first (one instruction per word in the loop). Unless ``EVEN``, columns past K
        read as zero.
        """
        L5: gl.constexpr = gl.BlockedLayout([1, 1, C_T, 1, 8], [1, 1, 1, 32, 1], [1, WK, 1, 1, 1], [4, 3, 2, 1, 0])
        lane = _idx5(32, 3, L5)
        col = (c0 + _idx5(WK, 1, L5) * C_T) * 64 + (lane % 4) * 16  # the thread's first chunk
        inner = _idx5(C_T, 2, L5) * 32 + _idx5(8, 4, L5)  # constant per register
        xa_ptrs = x_ptr + (gl.minimum(lane // 4, M - 1).to(gl.int64) * (K // 2) + col // 2) + inner
        xb_ptrs = x_ptr + (gl.minimum(8 + lane // 4, M - 1).to(gl.int64) * (K // 2) + col // 2) + inner
        if EVEN:
            xa = gl.load(xa_ptrs)
            xb = xa
            if NT == 2:
                xb = gl.load(xb_ptrs)
        else:
            in_k = col + _idx5(C_T, 2, L5) * 64 < K
            xa = gl.load(xa_ptrs, mask=in_k, other=0)
            xb = xa
            if NT == 2:
                xb = gl.load(xb_ptrs, mask=in_k, other=0)
        CK: gl.constexpr = C_T * WK
        xa = gl.convert_layout(gl.reshape(xa, [1, CK, 32, 8]), LX)
        xb = gl.convert_layout(gl.reshape(xb, [1, CK, 32, 8]), LX)
        return xa, xb

    @gluon.jit
    def _words8(xs):
        """``[A, B, C, 8]`` -> its 8 slices along the last dimension, in order (each ``[A, B, C]``)."""
        A: gl.constexpr = xs.shape[0]
        B: gl.constexpr = xs.shape[1]
        C: gl.constexpr = xs.shape[2]
        q0, q1 = gl.split(gl.reshape(xs, [A, B, C, 4, 2]))
        a0, a1 = gl.split(gl.reshape(q0, [A, B, C, 2, 2]))
        b0, b1 = gl.split(gl.reshape(q1, [A, B, C, 2, 2]))
        w0, w4 = gl.split(a0)
        w2, w6 = gl.split(a1)
        w1, w5 = gl.split(b0)
        w3, w7 = gl.split(b1)
        return w0, w1, w2, w3, w4, w5, w6, w7

    @gluon.jit
    def _join8(w0, w1, w2, w3, w4, w5, w6, w7):
        """``_words8``' inverse."""
        A: gl.constexpr = w0.shape[0]
        B: gl.constexpr = w0.shape[1]
        C: gl.constexpr = w0.shape[2]
        q0 = gl.reshape(gl.join(gl.join(w0, w4), gl.join(w2, w6)), [A, B, C, 4])
        q1 = gl.reshape(gl.join(gl.join(w1, w5), gl.join(w3, w7)), [A, B, C, 4])
        return gl.reshape(gl.join(q0, q1), [A, B, C, 8])

    @gluon.jit
    def _walsh_units(v, WALSH: gl.constexpr, HB: gl.constexpr):
        """``ptx.walsh_asm`` on ``[U, 4, C2, 8]`` int32: unit u's 4 lanes (dimension 1) of C2 chunks of 8 words."""
        w0, w1, w2, w3, w4, w5, w6, w7 = _words8(v)  # [U, 4, C2] each
        if HB == 128:
            a0, b0 = gl.split(w0)
            a1, b1 = gl.split(w1)
            a2, b2 = gl.split(w2)
            a3, b3 = gl.split(w3)
            a4, b4 = gl.split(w4)
            a5, b5 = gl.split(w5)
            a6, b6 = gl.split(w6)
            a7, b7 = gl.split(w7)
            y = gl.inline_asm_elementwise(
                WALSH, "=r" + ",=r" * 15 + ",r" * 16,
                [a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7],
                dtype=(gl.int32,) * 16, is_pure=True, pack=1,
            )  # fmt: skip
            return _join8(gl.join(y[0], y[8]), gl.join(y[1], y[9]), gl.join(y[2], y[10]), gl.join(y[3], y[11]),
                          gl.join(y[4], y[12]), gl.join(y[5], y[13]), gl.join(y[6], y[14]), gl.join(y[7], y[15]))
        else:
            y = gl.inline_asm_elementwise(
                WALSH, "=r" + ",=r" * 7 + ",r" * 8, [w0, w1, w2, w3, w4, w5, w6, w7],
                dtype=(gl.int32,) * 8, is_pure=True, pack=1,
            )  # fmt: skip
            return _join8(y[0], y[1], y[2], y[3], y[4], y[5], y[6], y[7])

    @gluon.jit
    def _walsh_smem(x_ptr, M, K, KCH, WALSH: gl.constexpr, HB: gl.constexpr, C_T: gl.constexpr,
                    WK: gl.constexpr, RP: gl.constexpr, NS: gl.constexpr):  # fmt: skip
        """x ``[M, K]`` (int32 bf16 pairs), Walsh-transformed (``ptx.walsh_asm``) once per program into shared memory
        ``[NS steps, RP rows, CK chunks, 4 lanes, 8 words]`` (rows past M and chunks past KCH hold zeros), every lane
        on its own 16 columns of one row (of 2 consecutive chunks for blocks of 128), all loads at once."""
        C2: gl.constexpr = 2 if HB == 128 else 1
        CK: gl.constexpr = C_T * WK
        CP: gl.constexpr = CK // C2  # units (C2 chunks of one row) per step and row
        NU: gl.constexpr = NS * RP * CP
        L: gl.constexpr = gl.BlockedLayout([1, 1, C2, 8], [8, 4, 1, 1], [WK, 1, 1, 1], [3, 2, 1, 0])
        u = _idx4(NU, 0, L)
        row = (u // CP) % RP
        chunk = (u // (RP * CP)) * CK + (u % CP) * C2 + _idx4(C2, 2, L)
        offs = row.to(gl.int64) * (K // 2) + chunk * 32 + _idx4(4, 1, L) * 8 + _idx4(8, 3, L)
        v = gl.load(x_ptr + offs, mask=(row < M) & (chunk * 64 + _idx4(4, 1, L) * 16 < K), other=0)  # whole blocks
        v = gl.convert_layout(_walsh_units(v, WALSH, HB), L, assert_trivial=True)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        smem = gl.allocate_shared_memory(gl.int32, [NU, C2, 4, 8], flat)
        smem.permute([0, 2, 1, 3]).store(v)
        return smem._reinterpret(gl.int32, [NS, RP, CK, 4, 8], flat)  # a layout of one step: ``index`` takes one

    @gluon.jit
    def _x_smem_load(smem, step, C_T: gl.constexpr, WK: gl.constexpr, RP: gl.constexpr, LX: gl.constexpr):
        """One step's x ``[1, CK, 32, 8]`` from ``_walsh_smem``'s rows: lane (g, t) reads row ``g % RP``."""
        CK: gl.constexpr = C_T * WK
        L5: gl.constexpr = gl.BlockedLayout([1, 1, C_T, 1, 8], [8 // RP, RP, 1, 4, 1], [1, 1, WK, 1, 1],
                                            [4, 3, 2, 1, 0])  # fmt: skip
        x = smem.index(step).load(gl.SliceLayout(0, L5))  # [RP, CK, 4, 8]
        x = gl.expand_dims(x, 0) + gl.zeros([8 // RP, RP, CK, 4, 8], gl.int32, L5)
        x = gl.permute(gl.reshape(x, [8, CK, 4, 8]), [1, 0, 2, 3])
        return gl.convert_layout(gl.reshape(x, [1, CK, 32, 8]), LX, assert_trivial=True)

    @gluon.jit
    def _x_frags(xs, L3: gl.constexpr, LX: gl.constexpr):
        """x ``[1, CK, 32, 8]`` -> 8 tensors ``[1, CK, 32]`` in layout ``L3`` (broadcast over stripes),
        index ``2j + q``."""
        LX3: gl.constexpr = gl.SliceLayout(3, LX)
        CK: gl.constexpr = xs.shape[1]
        q0, q1 = gl.split(gl.reshape(xs, [1, CK, 32, 4, 2]))
        a0, a1 = gl.split(gl.reshape(q0, [1, CK, 32, 2, 2]))  # tile j = 2 * jh + jl
        b0, b1 = gl.split(gl.reshape(q1, [1, CK, 32, 2, 2]))
        x00, x20 = _halves(a0, LX3)
        x10, x30 = _halves(a1, LX3)
        x01, x21 = _halves(b0, LX3)
        x11, x31 = _halves(b1, LX3)
        return (
            gl.convert_layout(x00, L3), gl.convert_layout(x01, L3), gl.convert_layout(x10, L3),
            gl.convert_layout(x11, L3), gl.convert_layout(x20, L3), gl.convert_layout(x21, L3),
            gl.convert_layout(x30, L3), gl.convert_layout(x31, L3),
        )  # fmt: skip

    @gluon.jit
    def _gemv_chunk(words, sw, shift, xa, xb, accs, NT: gl.constexpr, L3: gl.constexpr, LX: gl.constexpr):
        """Decode and multiply one step's chunks into the accumulators (a tuple of 4 or 8 tensors)."""
        SPT: gl.constexpr = words.shape[0]
        CK: gl.constexpr = words.shape[1]
        wa, wb = gl.split(gl.reshape(words, [SPT, CK, 32, 2, 2]))
        w0, w2 = _halves(wa, L3)
        w1, w3 = _halves(wb, L3)
        x00, x01, x10, x11, x20, x21, x30, x31 = _x_frags(xa, L3, LX)
        if NT == 1:
            return gl.inline_asm_elementwise(
                _GEMV_ASM_1, "=f,=f,=f,=f,r,r,r,r,r,r" + ",r" * 8 + ",f,f,f,f",
                [w0, w1, w2, w3, sw, shift, x00, x01, x10, x11, x20, x21, x30, x31, accs[0], accs[1], accs[2], accs[3]],
                dtype=(gl.float32,) * 4, is_pure=True, pack=1,
            )  # fmt: skip
        else:
            y00, y01, y10, y11, y20, y21, y30, y31 = _x_frags(xb, L3, LX)
            return gl.inline_asm_elementwise(
                _GEMV_ASM_2, "=f" + ",=f" * 7 + ",r,r,r,r,r,r" + ",r" * 16 + ",f" * 8,
                [w0, w1, w2, w3, sw, shift, x00, x01, x10, x11, x20, x21, x30, x31,
                 y00, y01, y10, y11, y20, y21, y30, y31, accs[0], accs[1], accs[2], accs[3],
                 accs[4], accs[5], accs[6], accs[7]],
                dtype=(gl.float32,) * 8, is_pure=True, pack=1,
            )  # fmt: skip

    @gluon.jit
    def _gemv_store(y_ptr, acc0, acc1, acc2, acc3, m, n, M, N, scale):
        """Sum the K-split partials and write one m16n8 D fragment: d0 (m, n), d1 (m+1, n), d2 (m, n+8),
        d3 (m+1, n+8)."""
        gl.store(y_ptr + m * N + n, (gl.sum(acc0, axis=1) * scale).to(gl.bfloat16), mask=(m < M) & (n < N))
        gl.store(y_ptr + (m + 1) * N + n, (gl.sum(acc1, axis=1) * scale).to(gl.bfloat16), mask=(m + 1 < M) & (n < N))
        gl.store(y_ptr + m * N + n + 8, (gl.sum(acc2, axis=1) * scale).to(gl.bfloat16), mask=(m < M) & (n + 8 < N))
        y3 = (gl.sum(acc3, axis=1) * scale).to(gl.bfloat16)
        gl.store(y_ptr + (m + 1) * N + n + 8, y3, mask=(m + 1 < M) & (n + 8 < N))

    @gluon.jit
    def _gemv_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, M, N, K, KCH, hs,
        SPT: gl.constexpr, C_T: gl.constexpr, WK: gl.constexpr, NT: gl.constexpr, EVEN: gl.constexpr,
        PDL: gl.constexpr, WALSH: gl.constexpr, HB: gl.constexpr, RP: gl.constexpr, NS: gl.constexpr,
    ):  # fmt: skip
        """``EVEN``: no padded columns (``K == 64 KCH``) and ``KCH`` a multiple of the step (``C_T * WK`` chunks);
        ``PDL``: launched with PDL after the pre-pass (``gemv_linear``'s ``pdl``). ``HB``: the block of the in-kernel
        Walsh-Hadamard input transform (0: none; ``WALSH``, its asm), applied once per program into shared memory
        of ``NS`` steps and ``RP`` rows (``_walsh_smem``), which the loop reads instead of x; ``hs``: its scale,
        applied with the output's."""
        CK: gl.constexpr = C_T * WK  # chunks per loop step; warp w takes C_T of them
        L4: gl.constexpr = gl.BlockedLayout([SPT, C_T, 1, 4], [1, 1, 32, 1], [1, WK, 1, 1], [3, 2, 1, 0])
        LX: gl.constexpr = gl.BlockedLayout([1, C_T, 1, 8], [1, 1, 32, 1], [1, WK, 1, 1], [3, 2, 1, 0])
        L3: gl.constexpr = gl.SliceLayout(3, L4)  # [stripe, chunk, lane]: the hardware lane is the fragment lane
        s0 = gl.program_id(0) * SPT
        shift = (_idx3(32, 2, L3) % 2) * 16
        z = gl.zeros([SPT, CK, 32], gl.float32, L3)
        accs = (z, z, z, z, z, z, z, z) if NT == 2 else (z, z, z, z)
        start = 0
        if PDL or HB > 0:  # the first step's weights stream while the pre-pass (or the transform) still runs
            words, sw = _w_load(w_ptr, s_ptr, s0, 0, KCH, SPT, C_T, WK, EVEN, L4)
            if HB > 0:
                xsm = _walsh_smem(x_ptr, M, K, KCH, WALSH, HB, C_T, WK, RP, NS)
                gl.thread_barrier()
                xa = _x_smem_load(xsm, 0, C_T, WK, RP, LX)
                xb = xa
            else:
                grid_dependency_wait()
                xa, xb = _x_load(x_ptr, 0, M, K, C_T, WK, NT, EVEN, LX)
            accs = _gemv_chunk(words, sw, shift, xa, xb, accs, NT, L3, LX)
            start = CK
        for c in range(start, KCH, CK):
            if HB > 0:
                words, sw = _w_load(w_ptr, s_ptr, s0, c, KCH, SPT, C_T, WK, EVEN, L4)
                xa = _x_smem_load(xsm, c // CK, C_T, WK, RP, LX)
                xb = xa
            else:
                words, sw, xa, xb = _gemv_load(w_ptr, s_ptr, x_ptr, s0, c, KCH, M, K, SPT, C_T, WK, NT, EVEN, L4, LX)
            accs = _gemv_chunk(words, sw, shift, xa, xb, accs, NT, L3, LX)
        _gemv_epilogue(y_ptr, g_ptr, hs, accs, s0, M, N, SPT, NT, L3)

    @gluon.jit
    def _gemv_epilogue(y_ptr, g_ptr, hs, accs, s0, M, N, SPT: gl.constexpr, NT: gl.constexpr, L3: gl.constexpr):
        """Sum each accumulator over its chunks and warps, scale by ``multiplier * 2**7 * hs`` and store bf16."""
        LO: gl.constexpr = gl.SliceLayout(1, L3)
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, LO))[None, :]
        n = (s0 + gl.arange(0, SPT, layout=gl.SliceLayout(1, LO))[:, None]) * 16 + lane // 4
        m = (lane % 4) * 2
        scale = gl.load(g_ptr) * 128.0 * hs
        _gemv_store(y_ptr, accs[0], accs[1], accs[2], accs[3], m, n, M, N, scale)
        if NT == 2:
            _gemv_store(y_ptr, accs[4], accs[5], accs[6], accs[7], m + 8, n, M, N, scale)

    _launch_gemv = Launcher(_gemv_kernel)
