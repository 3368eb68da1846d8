"""Triton/Gluon W4A16 linear for Hopper (sm90): bf16 activations x NVFP4 weights in the ``sm90`` layout -> bf16.

Two kernels read the same layout (``repack/targets/sm90.py``), whose 32-bit words are tensor-core A
fragments: a word decodes (5 rotates, 4 of them issued as plain left shifts; 6 masks; 4 ``mul.bf16x2``
that apply the block scale and the exponent bias at once) into the four bf16x2 registers one thread
feeds to a 16x16 A tile. A block scale pair goes ``cvt.f16x2.e4m3x2`` -> shift into bf16 -> two exact
power-of-two ``mul.bf16x2`` (2**231 does not fit in one bf16); weights come out as ``e2m1 * scale * 2**-7``,
exact and normal in bf16, and the epilogue multiplies by ``multiplier * 2**7``. Accumulation is float32 on
the tensor cores.

* ``_gemv_kernel`` (Gluon, ``M <= 8``, and up to 16 on narrow layers): decode-bound, so written for the fewest
  instructions per weight (about 20-22 per 32-bit word in the loop). One inline-PTX block per thread and
  64-column chunk decodes its 4 words (one scale pair: the v2 layout gives a thread one scale block per chunk)
  and chains 4 ``mma.sync.m16n8k16`` (8 for ``M > 8``) with the activations as the B operand, read straight from
  global memory as two 16-byte vectors per chunk. No shared memory in the loop. A program owns ``spt`` 16-row
  stripes over the whole K; its warps split K and are summed once at the end (deterministic, no workspace).
  ``maxnreg`` lets ptxas keep a step's loads ahead of their use.
* ``_tc_kernel`` (Gluon, warp-specialised, the other sizes): a program computes a ``[64 warpgroups, BM]`` tile
  of ``y^T = W x^T`` over a K range. A loader warp streams words, scales and activation tiles by TMA into a ring
  of shared-memory slots (mbarriers with byte counts); the consumer warpgroups decode each word straight into
  their wgmma A registers and issue an asynchronous ``wgmma`` with the activation tile as the shared-memory B
  operand, decoding the next chunk while it runs. The activations are permuted into the layout's k-slot order
  first (``kslot_activations``, one pass), so that a TMA box lines up with the decoded fragments; the kernel is
  launched with programmatic dependent launch (PDL) so that its launch and set-up overlap that pass, and waits
  for it before anything else. Split-K (only while the tiles do not fill one wave) is atomic-free and
  deterministic: each split writes a float32 partial tile, bumps a per-tile counter (release/acquire at GPU
  scope after a CTA barrier), and the last split to arrive sums the partials in split order and writes bf16.

Every path captures into CUDA graphs and runs under ``torch.compile`` (no host synchronisation,
nothing cached between calls apart from the SM count), and neither materialises bf16 weights.

Dispatch (``linear``), measured on an H200 (docs/benchmarks.md, "sm90 Triton W4A16 (H200)"):

* ``M <= 8``, and ``M <= 16`` on layers of fewer than half as many 64-row tiles as SMs (``uses_decode_kernel``):
  ``_gemv_kernel`` with ``gemv_config_for`` (8 warps per program unless that needs more waves of programs than 4).
* Otherwise ``_tc_kernel`` with ``tc_config_for`` (activation tile 16 / 32 / 64 / 128 / 256 rows by M), at every
  large M too: dequantize + cuBLAS was slower than it on 38 of 42 layer and M points up to M = 8192, never
  faster by more than 3%, and needs a bf16 copy of W (round 7; rounds 3 and 5 alike), so there is no crossover.

``dequantize`` (bf16 weights rounded once) serves the benchmarks' cuBLAS baseline and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ...targets import sm90 as layout

try:
    import triton
    import triton.language as tl
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
    triton = tl = gluon = gl = None

GEMV_MAX_M = 16  # the decode kernel's limit: two m16n8 B tiles per mma step


@dataclass(frozen=True)
class GemvConfig:
    """Work split of one ``_gemv_kernel`` launch."""

    spt: int  # 16-row stripes per program (and per thread: activations are reused across them): 1, 2, 4 or 8
    chunks: int  # 64-column chunks per warp per loop step (16-byte weight loads per stripe and round trip)
    num_warps: int  # warps per program, each taking every num_warps-th group of chunks along K
    maxnreg: int = 0  # register cap for ptxas (0: its default, which interleaves loads with use to save registers)


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
_REGISTERS_PER_SM = 65536
# Programmatic dependent launch of ``_tc_kernel``: it starts while ``kslot_activations`` (always its predecessor)
# runs, and waits for it (``griddepcontrol.wait``) before anything else. False: plain stream order (the tests
# compare both).
PDL = True
_MAX_WARPS_PER_SM = 64


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
    per_sm = min(_REGISTERS_PER_SM // (config.maxnreg * 32 * config.num_warps), _MAX_WARPS_PER_SM // config.num_warps)
    return -(-programs // (per_sm * sm_count))


def uses_decode_kernel(m: int, n: int, sm_count: int) -> bool:
    """``M <= 8``, and ``M <= 16`` on layers with fewer 64-row tiles than half the SMs: the decode kernel, else the
    tensor-core kernel. At M = 9 .. 16 the decode kernel runs two n-tiles of mma.sync and reads the activations
    from L2 in every warp, where 16-row wgmma tiles read them once per program from shared memory (H200, M = 16,
    us: 57344 x 8192 99 against 84, 8192 x 28672 57 against 47, 14336 x 4096 20 against 18, 8192 x 8192 and
    10240 x 8192 even); with 64 tiles (N = 4096) too few programs share out K (4096 x 14336 18 against 19,
    4096 x 4096 8 against 10)."""
    if m <= 8:
        return True
    return m <= GEMV_MAX_M and _narrow(n, sm_count)


def _narrow(n: int, sm_count: int) -> bool:
    """Fewer 64-row tiles than half the SMs (N <= 4224 on 132): too few programs unless they split K or M finely."""
    return 2 * (layout.padded_shape(n, 64)[0] // 64) < sm_count


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
    if m <= 64 or (m <= 128 and _narrow(n, sm_count)):
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


def _require_triton(t: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the sm90 W4A16 backend needs Triton (pip install triton); it is not importable here")
    if not t.is_cuda:
        raise RuntimeError(f"the sm90 W4A16 backend runs on CUDA tensors, got a tensor on {t.device}")


def _check_operands(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, n: int, k: int
) -> None:
    """Shape/dtype checks on metadata only (no device synchronisation)."""
    specs = layout.runtime_specs(n, k)
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"x must be contiguous bf16 [M, {k}], got {x.dtype} {list(x.shape)}")
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("weight_global_scale", weight_global_scale)):
        spec = specs[name]
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {spec.dtype} {list(spec.shape)}, got {t.dtype} {list(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    n: int,
    k: int,
) -> torch.Tensor:
    """``x @ W^T`` for bf16 ``x [M, K]`` and the sm90 runtime tensors of ``W [N, K]``; returns bf16 ``[M, N]``."""
    _require_triton(x)
    _check_operands(x, weight, weight_scale, weight_global_scale, n, k)
    m = x.shape[0]
    sm_count = _sm_count(x.device.index or 0)
    if uses_decode_kernel(m, n, sm_count):
        return gemv_linear(x, weight, weight_scale, weight_global_scale, n, k, gemv_config_for(m, n, k, sm_count))
    return tc_linear(x, weight, weight_scale, weight_global_scale, n, k, tc_config_for(m, n, k, sm_count))


def gemv_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    n: int,
    k: int,
    config: GemvConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode kernel (``M <= 16``) with an explicit work split; ``out`` (contiguous bf16 ``[M, N]``) optional."""
    _require_triton(x)
    m = x.shape[0]
    if m > GEMV_MAX_M:
        raise ValueError(f"the decode kernel takes at most {GEMV_MAX_M} rows, got {m}")
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    stripes, chunks = weight.shape[0], weight.shape[1] // 128
    _gemv_kernel[(stripes // config.spt,)](
        x.view(torch.int32), weight, weight_scale.view(torch.int32), weight_global_scale, out,
        m, n, k, chunks,
        SPT=config.spt, C_T=config.chunks, WK=config.num_warps, NT=1 if m <= 8 else 2,
        EVEN=k == 64 * chunks and chunks % (config.chunks * config.num_warps) == 0,
        num_warps=config.num_warps, **({"maxnreg": config.maxnreg} if config.maxnreg else {}),
    )  # fmt: skip
    return out


def tc_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    n: int,
    k: int,
    config: TcConfig,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The warp-specialised tensor-core kernel (any M; ``linear`` takes it wherever ``uses_decode_kernel`` is false)
    with an explicit work split (``linear`` picks one with ``tc_config_for``; benchmarks and tests sweep them);
    ``split_k`` defaults to ``_tc_split``, ``out`` (contiguous bf16 ``[M, N]``) to a new tensor."""
    _require_triton(x)
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    if config.stages < 2:
        raise ValueError(f"the tensor-core kernel needs at least 2 pipeline stages: {config}")
    stripes, kp = weight.shape[0], weight.shape[1] // 2
    n_tiles, m_tiles = stripes // (4 * config.warpgroups), triton.cdiv(m, config.bm)  # a 16-row stripe per warp
    total_steps = kp // 64 // _TC_CHUNKS
    if split_k is None:
        split_k = _tc_split(n_tiles * m_tiles, total_steps, config, _sm_count(x.device.index or 0))
    steps = triton.cdiv(total_steps, split_k)
    split_k = triton.cdiv(total_steps, steps)  # no empty split
    counters = torch.empty((n_tiles * m_tiles if split_k > 1 else 0,), dtype=torch.int32, device=x.device)
    x_desc, w_desc, s_desc = tc_descriptors(kslot_activations(x, kp, counters), weight, weight_scale, config)
    if split_k > 1:
        partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    else:
        partials, counters = out, out  # unused by the SPLIT=False specialisation
    _tc_kernel[(n_tiles, m_tiles, split_k)](
        x_desc, w_desc, s_desc, weight_global_scale, out, partials, counters, m, n, steps, total_steps, split_k,
        SPLIT=split_k > 1, **tc_launch_options(config),
    )  # fmt: skip
    return out


def tc_descriptors(
    xk: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, config: TcConfig
) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    """TMA views: activation tiles ``[bm, 64]`` (k-slot order; the wgmma B operand, 128-byte swizzle), and per
    program and chunk the words ``[stripes, 128]`` and scale pairs ``[stripes, 32]`` (int16)."""
    rows = 4 * config.warpgroups

    def descriptor(t: torch.Tensor, block: list[int], swizzle: int) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8 * t.element_size(), rank=2)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    return (
        descriptor(xk, [config.bm, 64], 128),
        descriptor(weight, [rows, 128], 0),
        descriptor(weight_scale.view(torch.int16), [rows, 32], 0),
    )


def tc_launch_options(config: TcConfig) -> dict[str, int]:
    """``_tc_kernel``'s constexprs and launch options for ``config``: consumer warps, and a register cap that lets
    ``per_sm`` programs (consumers plus the 4-warp loader group) share the register file."""
    warps = 4 * config.warpgroups
    maxnreg = _REGISTERS_PER_SM // (config.per_sm * 32 * (warps + 4)) // 8 * 8
    return {"BM": config.bm, "NW": warps, "CPS": _TC_CHUNKS, "STAGES": config.stages, "num_warps": warps,
            "maxnreg": maxnreg, "launch_pdl": PDL}  # fmt: skip


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


def kslot_activations(x: torch.Tensor, kp: int, counters: torch.Tensor) -> torch.Tensor:
    """``kslot_order`` in one Triton pass (the TMA then loads activation tiles that match the decoded A fragments),
    which also zeroes the split-K ``counters``: one launch fewer than a separate memset (1.8 us on the H200)."""
    m, k = x.shape
    out = torch.empty((m, kp), dtype=x.dtype, device=x.device)
    _kslot_kernel[(triton.cdiv(m, 32), kp // 256)](x, out, counters, m, k, kp, counters.numel(), BR=32, num_warps=4)
    return out


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


def dequantize(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """bf16 ``[n, k]`` weights (``e2m1 * scale * multiplier`` rounded once to bf16) from the sm90 tensors."""
    _require_triton(weight)
    out = torch.empty((n, k), dtype=torch.bfloat16, device=weight.device)
    bn, bk = 64, 128  # 81-87% of copy bandwidth on the H200; 0-5% ahead of 64 x 256 on 6 of 7 layers (docs/benchmarks.md)
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _dequant_kernel[grid](
        weight, weight_scale.view(torch.uint16), weight_global_scale, out, n, k, weight.shape[1] // 128,
        BN=bn, BK=bk, num_warps=4,
    )  # fmt: skip
    return out


def _scale_lines(pair: str) -> list[str]:
    """PTX: the (h=0, h=1) e4m3 scale pair in ``pair`` -> ``s0`` = (S_h0, S_h0), ``s1`` = (S_h1, S_h1), S = s * 2**119.

    e4m3 -> exact f16 -> bits >> 3 are the bf16 of s * 2**-112 -> * 2**115 * 2**116.
    """
    return [
        f"cvt.rn.f16x2.e4m3x2 f, {pair};",
        "shr.b32 f, f, 3;",
        "mov.b32 c0, 0x79007900;",
        "mov.b32 c1, 0x79807980;",
        "mul.rn.bf16x2 f, f, c0;",
        "mul.rn.bf16x2 f, f, c1;",
        "prmt.b32 s0, f, f, 0x1010;",
        "prmt.b32 s1, f, f, 0x3232;",
    ]


def _rotation_masks() -> dict[int, int]:
    """Each nonzero rotation of ``DECODE_ROTATIONS`` -> the union of the masks applied to its result."""
    masks: dict[int, int] = {}
    for rm, rs in layout.DECODE_ROTATIONS:
        for r, mask in ((rm, layout.PAIR_MAG_MASK), (rs, layout.PAIR_SIGN_MASK)):
            if r:
                masks[r] = masks.get(r, 0) | mask
    return dict(sorted(masks.items()))


def _rotate_line(word: str, r: int, mask: int) -> str:
    """PTX for ``r{r} = rotl(word, r)`` where only the bits in ``mask`` are used afterwards.

    Where no used bit wraps around (none below bit ``r``) a left shift gives the same bits, and ptxas may issue
    it as ``IMAD.SHL`` on the FMA pipe: the funnel shift and the masks share the integer ALU pipe, the decode
    kernel's busiest (62% of active cycles; 7-12% faster at M = 1, docs/benchmarks.md).
    """
    if mask & ((1 << r) - 1):
        return f"shf.l.wrap.b32 r{r}, {word}, {word}, {r};"
    return f"shl.b32 r{r}, {word}, {r};"


def _word_lines(word: str) -> list[str]:
    """PTX: one word -> ``p0..p3``, the bf16x2 A-fragment registers ``e2m1 * S`` (pair i uses ``s{i % 2}``)."""
    mag, sign = layout.PAIR_MAG_MASK, layout.PAIR_SIGN_MASK
    lines = [_rotate_line(word, r, mask) for r, mask in _rotation_masks().items()]
    for i, (rm, rs) in enumerate(layout.DECODE_ROTATIONS):
        src_m, src_s = (f"r{rm}" if rm else word), (f"r{rs}" if rs else word)
        if rm == rs:
            lines.append(f"and.b32 p{i}, {src_m}, {mag | sign:#010x};")
        else:
            lines += [f"and.b32 t, {src_m}, {mag:#010x};", f"and.b32 u, {src_s}, {sign:#010x};", f"or.b32 p{i}, t, u;"]
        lines.append(f"mul.rn.bf16x2 p{i}, p{i}, s{i % 2};")  # exact: e2m1 * 2**-126 * s * 2**119
    return lines


def _asm_block(lines: list[str]) -> str:
    rotated = [f".reg .b32 r{r};" for r in _rotation_masks()]
    regs = [".reg .b32 f, c0, c1, s0, s1, t, u, p<4>;", ".reg .b16 lo, hi;", *rotated]
    return "{\n" + "\n".join(regs + lines) + "\n}"


def _scale_asm() -> str:
    """``$2`` uint16 scale pair -> ``$0``, ``$1``: the splatted bf16x2 scales ``s0``, ``s1``."""
    return _asm_block(_scale_lines("$2") + ["mov.b32 $0, s0;", "mov.b32 $1, s1;"])


def _decode_asm() -> str:
    """``$8`` word, ``$9``/``$10`` splatted scales -> ``$0..$7`` bf16 weights, element e = p + 2h + 4q."""
    lines = ["mov.b32 s0, $9;", "mov.b32 s1, $10;", *_word_lines("$8")]
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, p{i};" for i in range(4)]
    return _asm_block(lines)


def _gemv_asm(nt: int) -> str:
    """One thread's chunk: 4 words, their scale pair, x B fragments and accumulators -> accumulators.

    Operands: ``$0 .. $(4nt-1)`` float32 results (m16n8 D fragments of n-tiles ``u < nt``); then the 4
    words (tiles j), the 32-bit word holding this lane's uint16 scale pair and its neighbour's, the shift
    (0 or 16) selecting this lane's, ``8 nt`` x registers (index ``8u + 2j + q``: bf16 pair of k-slots
    ``2t + 8q`` of tile j) and ``4 nt`` float32 accumulators in. Tile j's mma uses the chain's previous
    result as its C operand.
    """
    o = 4 * nt
    words = [f"${o + i}" for i in range(4)]
    xb = [f"${o + 6 + i}" for i in range(8 * nt)]
    acc_in = [f"${o + 6 + 8 * nt + i}" for i in range(4 * nt)]
    lines = [f"shr.b32 t, ${o + 4}, ${o + 5};", "mov.b32 {lo, hi}, t;", *_scale_lines("lo")]
    for j in range(4):
        lines += _word_lines(words[j])
        for u in range(nt):
            d = [f"${4 * u + i}" for i in range(4)]
            c = acc_in[4 * u : 4 * u + 4] if j == 0 else d
            lines.append(
                f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{', '.join(d)}}}, {{p0, p1, p2, p3}}, "
                f"{{{xb[8 * u + 2 * j]}, {xb[8 * u + 2 * j + 1]}}}, {{{', '.join(c)}}};"
            )
    return _asm_block(lines)


if triton is not None:
    _SCALE_ASM = tl.constexpr(_scale_asm())
    _DECODE_ASM = tl.constexpr(_decode_asm())
    _GEMV_ASM_1 = gl.constexpr(_gemv_asm(1))
    _GEMV_ASM_2 = gl.constexpr(_gemv_asm(2))
    _BIAS_FIX = tl.constexpr(2.0**7)  # the decode leaves weights as e2m1 * scale * 2**-7

    @triton.jit
    def _prepare_scales(scales):
        """uint16 scale pairs -> int32 (bf16x2) splats of the h=0 and h=1 scales, ``s * 2**119``."""
        return tl.inline_asm_elementwise(
            asm=_SCALE_ASM, constraints="=r,=r,h", args=[scales], dtype=(tl.int32, tl.int32), is_pure=True, pack=1
        )

    @triton.jit
    def _decode_words(words, s0, s1):
        """int32 words and splatted scales (same shape) -> 8 bf16 tensors, element e = p + 2h + 4q."""
        return tl.inline_asm_elementwise(
            asm=_DECODE_ASM,
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
            args=[words, s0, s1],
            dtype=(tl.bfloat16,) * 8,
            is_pure=True,
            pack=1,
        )

    @triton.jit
    def _dequant_tile(words, s0, s1, BN: tl.constexpr, BK: tl.constexpr):
        """``[BN/16, BK/64, 32, 4]`` words + scales -> bf16 ``[BN, BK]`` (times ``2**-7 / multiplier``), columns in
        true order (the joins and the permute only relabel registers)."""
        e0, e1, e2, e3, e4, e5, e6, e7 = _decode_words(words, s0, s1)
        q0 = tl.join(tl.join(e0, e1), tl.join(e2, e3))  # [..., p, h]
        q1 = tl.join(tl.join(e4, e5), tl.join(e6, e7))
        w = tl.join(q0, q1)  # [s, c, lane, j, p, h, q]
        w = tl.reshape(w, (BN // 16, BK // 64, 8, 4, 4, 2, 2, 2))  # s, c, g, t, j, p, h, q
        w = tl.permute(w, (0, 6, 2, 1, 3, 4, 7, 5))  # s, h, g | c, t, j, q, p
        return tl.reshape(w, (BN, BK))

    @triton.jit
    def _tile_offsets(pid_n, KCH, BN: tl.constexpr, BK: tl.constexpr):
        """One K step's word offsets ``[BN/16, BK/64, 32, 4]`` (int32 units) and scale-pair offsets
        ``[BN/16, BK/64, 32]`` (uint16 units; one pair per lane serves its 4 words)."""
        stripe = pid_n * (BN // 16) + tl.arange(0, BN // 16)
        chunk = tl.arange(0, BK // 64)
        lane = tl.arange(0, 32)
        tile = tl.arange(0, 4)
        base = stripe[:, None, None] * KCH + chunk[None, :, None]
        w_off = (base[:, :, :, None] * 32 + lane[None, None, :, None]) * 4 + tile[None, None, None, :]
        s_off = base * 32 + lane[None, None, :]
        return w_off, s_off

    @triton.jit
    def _load_step(w_ptr, s_ptr, w_off, s_off, step, BN: tl.constexpr, BK: tl.constexpr):
        """Words and splatted scales (broadcast over each lane's 4 words) of K step ``step``."""
        words = tl.load(w_ptr + w_off + step * (BK * 2))
        s0, s1 = _prepare_scales(tl.load(s_ptr + s_off + step * (BK // 2)))
        shape: tl.constexpr = (BN // 16, BK // 64, 32, 4)
        return words, tl.broadcast_to(s0[:, :, :, None], shape), tl.broadcast_to(s1[:, :, :, None], shape)

    @triton.jit
    def _kslot_kernel(x_ptr, out_ptr, count_ptr, M, K, KP, COUNTERS, BR: tl.constexpr):
        """``kslot_activations``: rows ``BR`` x 256 columns per program; program (0, 0) also zeroes the counters."""
        tl.extra.cuda.gdc_launch_dependents()  # the tensor-core kernel (PDL) may launch and set up meanwhile
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        if pid_r == 0 and pid_c == 0:
            for start in range(0, COUNTERS, 1024):
                offs = start + tl.arange(0, 1024)
                tl.store(count_ptr + offs, tl.zeros([1024], tl.int32), mask=offs < COUNTERS)
        rows = (pid_r * BR + tl.arange(0, BR)).to(tl.int64)[:, None]
        cols = pid_c * 256 + tl.arange(0, 256)[None, :]
        x = tl.load(x_ptr + rows * K + cols, mask=(rows < M) & (cols < K), other=0.0)
        # column 64c + 16t + 4j + 2q + p -> k-slot 64c + 16j + 8q + 2t + p
        x = tl.reshape(tl.permute(tl.reshape(x, (BR, 4, 4, 4, 2, 2)), (0, 1, 3, 4, 2, 5)), (BR, 256))
        tl.store(out_ptr + rows * KP + cols, x, mask=rows < M)

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K, KCH, BN: tl.constexpr, BK: tl.constexpr):
        pid_n = tl.program_id(0)
        step = tl.program_id(1)
        w_off, s_off = _tile_offsets(pid_n, KCH, BN, BK)
        words, s0, s1 = _load_step(w_ptr, s_ptr, w_off, s_off, step, BN, BK)
        w = _dequant_tile(words, s0, s1, BN, BK).to(tl.float32) * (tl.load(g_ptr) * _BIAS_FIX)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = step * BK + tl.arange(0, BK)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], w.to(tl.bfloat16), mask=mask)

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
    def _grid_dependency_wait():
        """Wait until the previous kernel in the stream has finished and its writes are visible (a no-op unless
        launched with PDL): no activation, output or workspace access may come before this."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

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
        """Words ``[SPT, CK, 32, 4]`` (one 16-byte run per thread, stripe and chunk), scale words ``[SPT, CK, 32]``
        (the int32 holding the lane's uint16 pair and its neighbour's) and x n-tiles 0 and 1 (``_x_load``) of the
        step at chunk ``c0``, warp ``w`` taking chunks ``c0 + w C_T ..``; nothing is read past KCH or K, and unless
        ``EVEN`` (no step partly past the end) what is not read is zero.

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
        xa, xb = _x_load(x_ptr, c0, M, K, C_T, WK, NT, EVEN, LX)
        return words, sw, xa, xb

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
        x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, M, N, K, KCH,
        SPT: gl.constexpr, C_T: gl.constexpr, WK: gl.constexpr, NT: gl.constexpr, EVEN: gl.constexpr,
    ):  # fmt: skip
        """``EVEN``: no padded columns (``K == 64 KCH``) and ``KCH`` a multiple of the step (``C_T * WK`` chunks)."""
        CK: gl.constexpr = C_T * WK  # chunks per loop step; warp w takes C_T of them
        L4: gl.constexpr = gl.BlockedLayout([SPT, C_T, 1, 4], [1, 1, 32, 1], [1, WK, 1, 1], [3, 2, 1, 0])
        LX: gl.constexpr = gl.BlockedLayout([1, C_T, 1, 8], [1, 1, 32, 1], [1, WK, 1, 1], [3, 2, 1, 0])
        L3: gl.constexpr = gl.SliceLayout(3, L4)  # [stripe, chunk, lane]: the hardware lane is the fragment lane
        s0 = gl.program_id(0) * SPT
        shift = (_idx3(32, 2, L3) % 2) * 16
        z = gl.zeros([SPT, CK, 32], gl.float32, L3)
        accs = (z, z, z, z, z, z, z, z) if NT == 2 else (z, z, z, z)
        for c in range(0, KCH, CK):
            words, sw, xa, xb = _gemv_load(w_ptr, s_ptr, x_ptr, s0, c, KCH, M, K, SPT, C_T, WK, NT, EVEN, L4, LX)
            accs = _gemv_chunk(words, sw, shift, xa, xb, accs, NT, L3, LX)
        _gemv_epilogue(y_ptr, g_ptr, accs, s0, M, N, SPT, NT, L3)

    @gluon.jit
    def _gemv_epilogue(y_ptr, g_ptr, accs, s0, M, N, SPT: gl.constexpr, NT: gl.constexpr, L3: gl.constexpr):
        """Sum each accumulator over its chunks and warps, scale by ``multiplier * 2**7`` and store bf16."""
        LO: gl.constexpr = gl.SliceLayout(1, L3)
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, LO))[None, :]
        n = (s0 + gl.arange(0, SPT, layout=gl.SliceLayout(1, LO))[:, None]) * 16 + lane // 4
        m = (lane % 4) * 2
        scale = gl.load(g_ptr) * 128.0
        _gemv_store(y_ptr, accs[0], accs[1], accs[2], accs[3], m, n, M, N, scale)
        if NT == 2:
            _gemv_store(y_ptr, accs[4], accs[5], accs[6], accs[7], m + 8, n, M, N, scale)


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
        _grid_dependency_wait()  # launched with PDL: the k-slot pass may still be writing x_desc's tensor
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
