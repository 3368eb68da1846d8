"""Triton W4A16 linear for Hopper (sm90): bf16 activations x NVFP4 weights in the ``sm90`` layout -> bf16.

Kernel (``_w4a16_kernel``): one program computes a ``[BN, BM]`` tile of ``y^T = W x^T`` over a K range,
with the dequantized weights as the wgmma A operand held in registers (``repack/targets/sm90.py``
lays the codes out as the A fragments, so they go from Triton's cp.async pipeline in shared memory
straight into the A registers) and ``x^T`` as the shared-memory B operand. Per 32-bit word (8 weights)
the decode is 5 rotates, 6 masks and 4 ``mul.bf16x2`` that apply the block scale and the exponent bias
at once; each (row, block) scale pair is read once per lane group and goes ``cvt.f16x2.e4m3x2`` ->
shift into bf16 -> two exact power-of-two ``mul.bf16x2`` (2**231 does not fit in one bf16).
Accumulation is float32 on the tensor cores; the epilogue multiplies by ``multiplier * 2**7`` (the part
of the bias left in the weights, which keeps every decoded weight exact and normal in bf16).

Split-K is atomic-free and deterministic: each split writes a float32 partial tile, bumps a per-tile
counter (release/acquire at GPU scope after a CTA barrier), and the last split to arrive sums the
partials in split order and writes bf16. The counters are zeroed by a memset inside the op, so it
captures into CUDA graphs and runs under ``torch.compile`` (no host synchronisation, nothing cached
between calls apart from the SM count).

Dispatch (``linear``), measured on an H200 (docs/benchmarks.md, "sm90 Triton W4A16 (H200)"):

* ``M <= 128``: the fused kernel, tiles from ``config_for`` (M buckets 16 / 32 / 64 / 128); K is split
  so that about two programs run per SM (``_split_k``), at least twice for ``BM >= 64``.
* ``M > 128`` (``dense_crossover_m``): ``dequantize`` (this module's ``_dequant_kernel``, bf16 weights
  rounded once) then cuBLAS through ``torch.nn.functional.linear``. Above 128 rows the fused kernel was
  slower than this on most swept shapes, and both are slower than cuBLAS on pre-dequantized weights
  (the dequantization pass writes 2 bytes a weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ...targets import sm90 as layout

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: importing must work, calling must say why it cannot
    triton = None
    tl = None

_PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch options of one ``_w4a16_kernel`` specialisation."""

    bn: int  # weight rows (output features) per program: 64 or 128
    bm: int  # activation rows per program, >= 16
    bk: int  # K per loop step: 64, 128 or 256
    num_warps: int
    num_stages: int
    min_split: int = 1  # fewest K splits (more programs in flight measured faster for bm >= 64)


def config_for(m: int) -> KernelConfig:
    """Tile shape for ``m`` activation rows: the fastest on most shapes of the H200 sweep (docs/benchmarks.md)."""
    if m <= 16:
        return KernelConfig(bn=64, bm=16, bk=256, num_warps=4, num_stages=3)
    if m <= 32:
        return KernelConfig(bn=64, bm=32, bk=256, num_warps=4, num_stages=3)
    if m <= 64:
        return KernelConfig(bn=128, bm=64, bk=128, num_warps=8, num_stages=4, min_split=2)
    return KernelConfig(bn=128, bm=128, bk=128, num_warps=8, num_stages=3, min_split=2)


def dense_crossover_m(n: int, k: int) -> int:
    """Smallest M served by dequantize + cuBLAS (same for every swept shape).

    At M = 256 dequantize + cuBLAS beat the best fused config on 4 of the 7 benchmark shapes and lost by at
    most 13% on the others; at M = 128 the fused kernel won on all 7.
    """
    return 129


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


def _split_k(config: KernelConfig, tiles: int, k_steps: int, sm_count: int) -> int:
    """K splits giving about two programs per SM (measured best), at least ``min_split``, >= 4 K steps each."""
    want = max(config.min_split, round(_PROGRAMS_PER_SM * sm_count / tiles))
    return max(1, min(want, k_steps // 4))


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
    if m >= dense_crossover_m(n, k):
        return torch.nn.functional.linear(x, dequantize(weight, weight_scale, weight_global_scale, n, k))
    return fused_linear(x, weight, weight_scale, weight_global_scale, n, k, config_for(m))


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    n: int,
    k: int,
    config: KernelConfig,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused kernel with an explicit tile config (``linear`` picks one; benchmarks and tests sweep them).

    ``split_k`` defaults to the occupancy heuristic; ``out`` (contiguous bf16 ``[M, N]``) to a new tensor.
    """
    _require_triton(x)
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    n_tiles, m_tiles = triton.cdiv(n, config.bn), triton.cdiv(m, config.bm)
    k_steps = weight.shape[1] // 2 // config.bk
    if split_k is None:
        split_k = _split_k(config, n_tiles * m_tiles, k_steps, _sm_count(x.device.index or 0))
    steps_per_split = triton.cdiv(k_steps, split_k)
    if split_k > 1:
        partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        counters = torch.zeros((n_tiles * m_tiles,), dtype=torch.int32, device=x.device)
    else:
        partials, counters = out, out  # unused by the SPLIT=False specialisation
    _w4a16_kernel[(n_tiles, m_tiles, split_k)](
        x, weight, weight_scale.view(torch.uint16), weight_global_scale, out, partials, counters,
        m, n, k, weight.shape[1] // 128, steps_per_split, split_k,
        BN=config.bn, BM=config.bm, BK=config.bk, SPLIT=split_k > 1,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def dequantize(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """bf16 ``[n, k]`` weights (``e2m1 * scale * multiplier`` rounded once to bf16) from the sm90 tensors."""
    _require_triton(weight)
    out = torch.empty((n, k), dtype=torch.bfloat16, device=weight.device)
    bn, bk = 64, 256
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _dequant_kernel[grid](
        weight, weight_scale.view(torch.uint16), weight_global_scale, out, n, k, weight.shape[1] // 128,
        BN=bn, BK=bk, num_warps=4,
    )  # fmt: skip
    return out


def _decode_asm() -> str:
    """PTX for one word: ``$8`` int32 word, ``$9`` the (h=0, h=1) e4m3 scale pair -> ``$0..$7`` bf16 weights."""
    rotations = sorted({r for pair in layout.DECODE_ROTATIONS for r in pair if r})
    mag, sign = layout.PAIR_MAG_MASK, layout.PAIR_SIGN_MASK
    lines = [
        ".reg .b32 f, c0, c1, s0, s1, t, u, p<4>;",
        *(f".reg .b32 r{r};" for r in rotations),
        # scales: e4m3 -> exact f16 -> bits >> 3 are the bf16 of s * 2**-112 -> * 2**115 * 2**116 = s * 2**119
        "cvt.rn.f16x2.e4m3x2 f, $9;",
        "shr.b32 f, f, 3;",
        "mov.b32 c0, 0x79007900;",
        "mov.b32 c1, 0x79807980;",
        "mul.rn.bf16x2 f, f, c0;",
        "mul.rn.bf16x2 f, f, c1;",
        "prmt.b32 s0, f, f, 0x1010;",  # (S_h0, S_h0)
        "prmt.b32 s1, f, f, 0x3232;",  # (S_h1, S_h1)
        *(f"shf.l.wrap.b32 r{r}, $8, $8, {r};" for r in rotations),
    ]
    for i, (rm, rs) in enumerate(layout.DECODE_ROTATIONS):
        src_m, src_s = (f"r{rm}" if rm else "$8"), (f"r{rs}" if rs else "$8")
        if rm == rs:
            lines.append(f"and.b32 p{i}, {src_m}, {mag | sign:#010x};")
        else:
            lines += [f"and.b32 t, {src_m}, {mag:#010x};", f"and.b32 u, {src_s}, {sign:#010x};", f"or.b32 p{i}, t, u;"]
        # pair i holds rows h = i % 2: e2m1 * 2**-126 times s * 2**119, exact in bf16
        lines.append(f"mul.rn.bf16x2 p{i}, p{i}, s{i % 2};")
        lines.append(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, p{i};")
    return "{\n" + "\n".join(lines) + "\n}"


if triton is not None:
    _DECODE_ASM = tl.constexpr(_decode_asm())
    _BIAS_FIX = tl.constexpr(2.0**7)  # the decode leaves weights as e2m1 * scale * 2**-7

    @triton.jit
    def _decode_words(words, scales):
        """int32 words and uint16 scale pairs (same shape) -> 8 bf16 tensors, element e = p + 2h + 4q."""
        return tl.inline_asm_elementwise(
            asm=_DECODE_ASM,
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h",
            args=[words, scales],
            dtype=(tl.bfloat16,) * 8,
            is_pure=True,
            pack=1,
        )

    @triton.jit
    def _dequant_tile(words, scales, BN: tl.constexpr, BK: tl.constexpr):
        """``[BN/16, BK/64, 32, 4]`` words + scale pairs -> bf16 ``[BN, BK]`` (times ``2**-7 / multiplier``).

        The joins and permute only relabel registers: the result is already in the wgmma A layout.
        """
        e0, e1, e2, e3, e4, e5, e6, e7 = _decode_words(words, scales)
        q0 = tl.join(tl.join(e0, e1), tl.join(e2, e3))  # [..., p, h]
        q1 = tl.join(tl.join(e4, e5), tl.join(e6, e7))
        w = tl.join(q0, q1)  # [s, c, lane, j, p, h, q]
        w = tl.reshape(w, (BN // 16, BK // 64, 8, 4, 4, 2, 2, 2))  # s, c, g, t, j, p, h, q
        w = tl.permute(w, (0, 6, 2, 1, 4, 7, 3, 5))  # s, h, g | c, j, q, t, p
        return tl.reshape(w, (BN, BK))

    @triton.jit
    def _tile_offsets(pid_n, KCH, BN: tl.constexpr, BK: tl.constexpr):
        """One K step's word offsets ``[BN/16, BK/64, 32, 4]`` (int32 units) and scale-pair offsets
        ``[BN/16, BK/64, 8, 4]`` (uint16 units; each (g, j) pair is shared by the 4 lanes of row group g)."""
        stripe = pid_n * (BN // 16) + tl.arange(0, BN // 16)
        chunk = tl.arange(0, BK // 64)
        lane = tl.arange(0, 32)
        group = tl.arange(0, 8)
        tile = tl.arange(0, 4)
        base = stripe[:, None, None, None] * KCH + chunk[None, :, None, None]
        w_off = (base * 32 + lane[None, None, :, None]) * 4 + tile[None, None, None, :]
        s_off = (base * 8 + group[None, None, :, None]) * 4 + tile[None, None, None, :]
        return w_off, s_off

    @triton.jit
    def _load_step(w_ptr, s_ptr, w_off, s_off, step, BN: tl.constexpr, BK: tl.constexpr):
        """Words and per-lane scale pairs of K step ``step``; the scales are read once and broadcast to lanes."""
        words = tl.load(w_ptr + w_off + step * (BK * 2))
        scales = tl.load(s_ptr + s_off + step * (BK // 2))
        scales = tl.broadcast_to(scales[:, :, :, None, :], (BN // 16, BK // 64, 8, 4, 4))
        return words, tl.reshape(scales, (BN // 16, BK // 64, 32, 4))

    @triton.jit(do_not_specialize=["M", "STEPS_PER_SPLIT", "SPLIT_K"])
    def _w4a16_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, part_ptr, count_ptr,
        M, N, K, KCH, STEPS_PER_SPLIT, SPLIT_K,
        BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        w_off, s_off = _tile_offsets(pid_n, KCH, BN, BK)
        offs_m = pid_m * BM + tl.arange(0, BM)
        x_rows = x_ptr + offs_m.to(tl.int64)[None, :] * K
        step_lo = pid_k * STEPS_PER_SPLIT
        step_hi = tl.minimum(step_lo + STEPS_PER_SPLIT, KCH // (BK // 64))
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for step in range(step_lo, step_hi):
            words, scales = _load_step(w_ptr, s_ptr, w_off, s_off, step, BN, BK)
            w = _dequant_tile(words, scales, BN, BK)
            offs_k = step * BK + tl.arange(0, BK)
            xt = tl.load(x_rows + offs_k[:, None], mask=(offs_m[None, :] < M) & (offs_k[:, None] < K), other=0.0)
            acc = tl.dot(w, xt, acc)
        offs_n = pid_n * BN + tl.arange(0, BN)
        out_mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        y_off = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        scale = tl.load(g_ptr) * _BIAS_FIX
        if not SPLIT:
            tl.store(y_ptr + y_off, (acc * scale).to(tl.bfloat16), mask=out_mask)
        else:
            tile_elems = M.to(tl.int64) * N
            tl.store(part_ptr + pid_k * tile_elems + y_off, acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partial is written before the release below
            arrived = tl.atomic_add(count_ptr + pid_m * tl.num_programs(0) + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BN, BM), dtype=tl.float32)
                for split in range(SPLIT_K):
                    part = tl.load(part_ptr + split * tile_elems + y_off, mask=out_mask, other=0.0, cache_modifier=".cg")
                    total += part
                tl.store(y_ptr + y_off, (total * scale).to(tl.bfloat16), mask=out_mask)

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K, KCH, BN: tl.constexpr, BK: tl.constexpr):
        pid_n = tl.program_id(0)
        step = tl.program_id(1)
        w_off, s_off = _tile_offsets(pid_n, KCH, BN, BK)
        words, scales = _load_step(w_ptr, s_ptr, w_off, s_off, step, BN, BK)
        w = _dequant_tile(words, scales, BN, BK).to(tl.float32) * (tl.load(g_ptr) * _BIAS_FIX)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = step * BK + tl.arange(0, BK)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], w.to(tl.bfloat16), mask=mask)
