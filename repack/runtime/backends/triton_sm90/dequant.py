"""bf16 weights from the sm90 layout (``dequantize``): the benchmarks' cuBLAS baseline and the tests' reference path.

The same PTX decode as the kernels (``ptx.decode_asm``) in a plain Triton kernel; never on the op's path (neither
kernel materialises bf16 weights).
"""

from __future__ import annotations

import torch

from .common import require_triton, tl, triton
from .ptx import decode_asm, scale_asm

def dequantize(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """bf16 ``[n, k]`` weights (``e2m1 * scale * multiplier`` rounded once to bf16) from the sm90 tensors."""
    require_triton(weight)
    out = torch.empty((n, k), dtype=torch.bfloat16, device=weight.device)
    bn, bk = 64, 128  # 81-87% of copy bandwidth on the H200; 0-5% ahead of 64 x 256 on 6 of 7 layers (docs/benchmarks.md)
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _dequant_kernel[grid](
        weight, weight_scale.view(torch.uint16), weight_global_scale, out, n, k, weight.shape[1] // 128,
        BN=bn, BK=bk, num_warps=4,
    )  # fmt: skip
    return out


if triton is not None:
    _SCALE_ASM = tl.constexpr(scale_asm())
    _DECODE_ASM = tl.constexpr(decode_asm())
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
