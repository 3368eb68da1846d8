"""The canonical NVFP4 linear weight every reader yields and every target consumes.

Codes are E2M1 nibbles packed two per byte (element ``2i`` in the low nibble), one float8_e4m3fn
block scale per 16 elements along K, and one float32 dequantization multiplier
(``w = e2m1(code) * block_scale * multiplier``). ModelOpt stores the multiplier as ``weight_scale_2``;
compressed-tensors stores its reciprocal, which the reader inverts in float32 as vLLM does.
"""

from __future__ import annotations

import functools
import lzma
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import RepackError

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class InputScale:
    """A W4A4 layer's activation global scale, the pair vLLM holds: ``scale`` (``input_global_scale``, the
    activations' dequant multiplier) and ``inverse`` (``input_global_scale_inv``, what its quantizer multiplies by),
    float32 ``[]`` each. ModelOpt stores ``scale`` (``input_scale``) and vLLM computes ``inverse = 1 / scale``;
    compressed-tensors stores ``inverse`` (``input_global_scale``) and vLLM computes ``scale``: in float32 the
    round trip is not the identity, so both are kept as vLLM computes them."""

    scale: torch.Tensor
    inverse: torch.Tensor


def check_block_scales(scales: torch.Tensor, name: str) -> None:
    """Refuse block scales that are NaN or negative, naming ``name`` (a reader that loads them apart from their codes,
    as convert's MoE pass does, checks them with this)."""
    scale_bits = scales.view(torch.uint8)
    # One pass: every finite non-negative e4m3 byte is below 0x7F (NaN); only then look for which it is.
    if scale_bits.numel() and int(scale_bits.max()) >= 0x7F:
        if bool(((scale_bits & 0x7F) == 0x7F).any()):
            raise RepackError(f"{name}: block scales contain NaN")
        raise RepackError(f"{name}: block scales contain negative values")


@dataclass(frozen=True)
class NVFP4Weight:
    """One quantized linear layer in canonical form.

    Attributes:
        codes (`torch.Tensor`): uint8 ``[N, K/2]``.
        block_scales (`torch.Tensor`): float8_e4m3fn ``[N, K/16]``, finite and non-negative.
        multiplier (`torch.Tensor`): float32 ``[1]``, finite and positive.
        input_scale (`InputScale`, *optional*): the activations' global scale of a W4A4 layer.
        partition_scales (`tuple`, *optional*): float32 ``[P]`` each: the weight and input global scales of the
            layer's ``P`` fused partitions as the checkpoint stores them, which an engine that loads them per
            partition keeps (SGLang).
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    multiplier: torch.Tensor
    input_scale: InputScale | None = None
    partition_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def n(self) -> int:
        return int(self.codes.shape[0])

    @property
    def k(self) -> int:
        return int(self.codes.shape[1]) * 2

    def validate(self, name: str) -> "NVFP4Weight":
        """Check dtypes, shapes and values; raise RepackError naming ``name`` on the first problem."""
        codes, scales, mult = self.codes, self.block_scales, self.multiplier
        if codes.dtype != torch.uint8 or codes.dim() != 2:
            raise RepackError(f"{name}: packed codes must be 2-D uint8, got {codes.dtype} {list(codes.shape)}")
        if scales.dtype != torch.float8_e4m3fn or scales.dim() != 2:
            raise RepackError(
                f"{name}: block scales must be 2-D float8_e4m3fn, got {scales.dtype} {list(scales.shape)}"
            )
        n, k = self.n, self.k
        if n == 0 or k == 0 or k % BLOCK_SIZE:
            raise RepackError(f"{name}: K={k} (N={n}) must be a positive multiple of {BLOCK_SIZE}")
        if tuple(scales.shape) != (n, k // BLOCK_SIZE):
            raise RepackError(
                f"{name}: block scales {list(scales.shape)} do not match weight [N={n}, K={k}] "
                f"(expected [{n}, {k // BLOCK_SIZE}])"
            )
        check_block_scales(scales, name)
        if mult.dtype != torch.float32 or mult.numel() != 1:
            raise RepackError(f"{name}: global scale must be one float32, got {mult.dtype} {list(mult.shape)}")
        value = float(mult.reshape(()))
        if not (torch.isfinite(mult).all() and value > 0.0):
            raise RepackError(f"{name}: global scale must be finite and positive, got {value}")
        if self.input_scale is not None:
            for value in (self.input_scale.scale, self.input_scale.inverse):
                if value.dtype != torch.float32 or value.numel() != 1 or not float(value.reshape(())) > 0.0 or (
                        not torch.isfinite(value).all()):
                    raise RepackError(f"{name}: input global scale must be one finite positive float32, "
                                      f"got {value.dtype} {value.reshape(-1)[:2].tolist()}")
        return self


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> uint8 nibbles ``[..., K]`` (low nibble first)."""
    return torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)


def pack_codes(nibbles: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_codes`."""
    pairs = nibbles.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def e2m1_to_float(nibbles: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode E2M1 nibbles to ``dtype`` by table lookup."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=nibbles.device)
    return table[nibbles.long()]


def dequantize(weight: NVFP4Weight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[N, K]`` weights in ``dtype``: ``e2m1(code) * block_scale * multiplier``.

    Each packed byte (two codes) is decoded by one lookup in a 256-entry table of pairs with int32 indices,
    and the scales are applied in place per 16-element block: memory is the output plus a fraction of it,
    where decoding nibble by nibble with int64 indices and expanded scales took several times the output."""
    n, k = weight.codes.shape[0], weight.codes.shape[1] * 2
    e2m1 = torch.tensor(E2M1_VALUES, dtype=dtype, device=weight.codes.device)
    pairs = torch.stack((e2m1.repeat(16), e2m1.repeat_interleave(16)), dim=-1)  # byte -> (low nibble, high nibble)
    values = pairs.index_select(0, weight.codes.reshape(-1).to(torch.int32)).view(n, k // BLOCK_SIZE, BLOCK_SIZE)
    values.mul_(weight.block_scales.to(dtype).unsqueeze(-1))
    values.mul_(weight.multiplier.to(dtype).reshape(()))
    return values.view(n, k)


REFERENCE_ELEMENTS = 1 << 20  # weights dequantized at a time by dequantized_products (8 MB of float64)


def dequantized_products(x: torch.Tensor, weight: NVFP4Weight) -> torch.Tensor:
    """float64 ``x @ dequantize(weight).T``, dequantizing ``REFERENCE_ELEMENTS`` weights at a time: memory stays at
    one block of rows plus the output, where the whole float64 matrix of a large layer takes gigabytes (verify
    checks two at once). Every output element is the same single GEMM's as with the whole matrix."""
    x = x.to(torch.float64)
    out = torch.empty(x.shape[0], weight.n, dtype=torch.float64, device=x.device)
    step = max(1, REFERENCE_ELEMENTS // weight.k)
    for start in range(0, weight.n, step):
        rows = slice(start, start + step)
        block = dequantize(NVFP4Weight(weight.codes[rows], weight.block_scales[rows], weight.multiplier))
        out[:, rows] = x @ block.t()
    return out


def dequantize_activations(codes: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, K]``: ``e2m1(code) * block_scale / global_scale`` of quantized activations, exactly what an
    FP4 x FP4 GEMM with alpha multiplies them as (``global_scale``: the quantizer's, ``input_global_scale_inv``)."""
    ones = torch.ones(1, dtype=torch.float32, device=codes.device)
    return dequantize(NVFP4Weight(codes, block_scales, ones)) / global_scale.to(torch.float64).reshape(())


# --- W4A4: activation quantization as the GPU does it -------------------------------------------------------------
#
# vLLM 0.33's W4A4 linear kernels (FlashInfer cute-dsl / CUTLASS, vLLM's CUTLASS) quantize activations with
# ``scaled_fp4_quant`` -> ``torch.ops._C.scaled_fp4_quant``, vLLM's CUDA kernel ``cvt_warp_fp16_to_fp4``
# (csrc/quantization/fp4/nvfp4_utils.cuh, from TensorRT-LLM), per 16-element block, all float32:
#   amax  = max |x|                                  (exact: bf16/fp16 abs and max)
#   sf    = fp8_e4m3(gs * (amax * rcp(6)))           (cvt.rn.satfinite: round to nearest even, saturate to 448)
#   scale = sf != 0 ? rcp(sf * rcp(gs)) : 0          (rcp = rcp.approx.ftz.f32, NOT a correctly rounded 1/x)
#   code  = e2m1(x * scale)                          (cvt.rn.satfinite.e2m1x2.f32: nearest even, saturate to 6,
#                                                     the sign kept: -0.0 and negatives that round to 0 give 0x8)
# vLLM's CPU emulation (nvfp4_emulation_utils.ref_nvfp4_quant) is the same recipe with exact float32 division in
# place of rcp.approx; FlashInfer's fp4_quantize tests ``amax != 0`` instead of ``sf != 0``, so in a block whose
# scale underflows to 0 its codes are +-6 where vLLM's are +-0 (both dequantize to 0). We follow vLLM's kernel.


@functools.cache
def _rcp_approx_deltas() -> torch.Tensor:
    """int32 ``[2^23]``: ``rcp.approx.ftz.f32(1.m)`` minus the correctly rounded ``1/1.m``, in ulps, per mantissa.

    The hardware reciprocal is one ulp off on 13.2% of mantissas (1,108,522 of 2^23), which moves a code where
    ``x * scale`` lies within an ulp of an E2M1 rounding boundary. Measured on an H200 by
    scripts/measure_rcp_approx.py (exponent-independent over the normal range); Blackwell's MUFU is assumed to
    be the same unit: no Blackwell GPU has checked it."""
    raw = lzma.decompress((Path(__file__).parent / "data" / "rcp_approx_ftz_f32.xz").read_bytes())
    runs = int(np.frombuffer(raw, "<u4", 1)[0])
    lengths = np.frombuffer(raw, "<u2", runs, 4).astype(np.int64)
    values = np.frombuffer(raw, np.int8, runs, 4 + 2 * runs).astype(np.int32)
    return torch.from_numpy(np.repeat(values, lengths))


def _rcp_approx_ftz(x: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` of positive float32 ``x``: the correctly rounded reciprocal moved by the measured
    per-mantissa delta; subnormal inputs and results flush to zero (input 0 -> inf, result below 2^-126 -> 0)."""
    exact = torch.reciprocal(x)
    mantissa = (x.view(torch.int32) & 0x7FFFFF).long()
    approx = (exact.view(torch.int32) + _rcp_approx_deltas()[mantissa]).view(torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    approx = torch.where(exact < tiny, torch.zeros_like(x), approx)
    return torch.where(x < tiny, torch.full_like(x, torch.inf), approx)


def _e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """float32 -> E2M1 nibbles, round to nearest even and saturate (``cvt.rn.satfinite.e2m1x2.f32``)."""
    a = v.abs()
    # Ties at 0.25, 1.25, 2.5 and 5 go down to the even code, at 0.75, 1.75 and 3.5 up.
    magnitude = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
                 + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return (magnitude | (torch.signbit(v).int() << 3)).to(torch.uint8)


def _check_activations(x: torch.Tensor, global_scale: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2 or x.shape[1] % BLOCK_SIZE:
        raise RepackError(f"activations must be 2-D bf16/fp16 [M, K] with K a multiple of {BLOCK_SIZE}, "
                          f"got {x.dtype} {list(x.shape)}")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise RepackError(f"input global scale must be one float32, got {global_scale.dtype} "
                          f"{list(global_scale.shape)}")
    value = float(global_scale.reshape(()))
    if not (torch.finfo(torch.float32).tiny <= value <= torch.finfo(torch.float32).max):
        raise RepackError(f"input global scale must be a positive normal float32, got {value}")


def _quantize_activations(x: torch.Tensor, global_scale: torch.Tensor, reciprocal) -> tuple[torch.Tensor, torch.Tensor]:
    _check_activations(x, global_scale)
    m, k = x.shape
    gs = global_scale.reshape(()).to(x.device)
    blocks = x.float().view(m, k // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1)
    rcp6 = reciprocal(torch.tensor(E2M1_MAX, dtype=torch.float32))
    # torch's float8 cast rounds to nearest even like cvt.rn.satfinite for every float32 below 464 (checked
    # against the H200's cvt for all of them); above, older torch gives NaN where the GPU saturates (torch 2.13
    # saturates too): the clamp keeps the GPU's answer on every torch the project supports.
    block_scales = (gs * (amax * rcp6)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf = block_scales.float()
    scale = torch.where(sf != 0, reciprocal(sf * reciprocal(gs)), torch.zeros_like(sf))
    nibbles = _e2m1_round(blocks * scale.unsqueeze(-1))
    return pack_codes(nibbles.view(m, k)), block_scales


def quantize_activations(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to NVFP4 bit for bit as vLLM 0.33's ``scaled_fp4_quant`` CUDA kernel does.

    Args:
        x (`torch.Tensor`): bf16 or fp16 ``[M, K]``, K a multiple of 16.
        global_scale (`torch.Tensor`): one float32, the scale vLLM passes the kernel (the layer's
            ``input_global_scale_inv``): ``1 / input_scale`` in float32 for ModelOpt, the checkpoint's
            ``input_global_scale`` for compressed-tensors.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: codes uint8 ``[M, K/2]`` (element ``2i`` in the low nibble, as
        weights) and block scales float8_e4m3fn ``[M, K/16]`` in the linear (not swizzled) layout. The GEMM
        dequantizes ``e2m1(code) * block_scale / global_scale`` (``1/global_scale`` is its alpha's input part).
    """
    return _quantize_activations(x, global_scale, _rcp_approx_ftz)


def _round_to_grid(values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest point of ``grid`` (ascending, non-negative codes in order) to non-negative ``values``, ties to
    the even index (the even code), saturating at the last point."""
    hi = torch.searchsorted(grid, values).clamp(max=grid.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    below, above = values - grid[lo], grid[hi] - values
    pick_hi = (above < below) | ((above == below) & (hi % 2 == 0))
    return grid[torch.where(pick_hi, hi, lo)]


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative float8_e4m3fn value in code order, from the format's definition."""
    code = torch.arange(0x7F, dtype=torch.float64)
    exponent, mantissa = torch.div(code, 8, rounding_mode="floor"), code % 8
    return torch.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))


def fake_quantize_activations(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, K]``: the NVFP4 activations an FP4 GEMM multiplies, from the format's definition.

    Exact float64 math, written apart from :func:`quantize_activations` so the two check each other: block
    scale ``s = e4m3(gs * amax / 6)`` (nearest, ties to even, saturating at 448), values
    ``e2m1(x * gs / s) * s / gs`` (nearest, ties to even, saturating at 6), 0 where ``s`` is 0. The kernel's
    float32 steps and approximate reciprocals round differently only where ``gs * amax / 6`` or ``x * gs / s``
    lies within a few float32 ulps of a rounding boundary, and then by one step.
    """
    _check_activations(x, global_scale)
    m, k = x.shape
    gs = float(global_scale.reshape(()))
    blocks = x.to(torch.float64).view(m, k // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    s = _round_to_grid(gs * amax / E2M1_MAX, _e4m3_grid().to(x.device))
    e2m1 = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64, device=x.device)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    values = _round_to_grid((blocks * gs / safe).abs(), e2m1).copysign(blocks) * s / gs
    return torch.where(s > 0, values, torch.zeros_like(values)).view(m, k)


def w4a4_reference(x: torch.Tensor, weight: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, N]``: what an FP4 x FP4 GEMM with alpha computes, ``fake_quant(x) @ weight.T``.

    ``weight`` is the float64 dequantized weight ``[N, K]`` (:func:`dequantize`); ``input_global_scale`` is
    :func:`quantize_activations`' ``global_scale``. vLLM's alpha holds ``1/global_scale`` rounded to float32 (or
    ModelOpt's ``input_scale``) where this divides exactly: a relative difference of about 1e-7.
    """
    if weight.dtype != torch.float64 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise RepackError(f"weight must be float64 [N, K={x.shape[-1]}], got {weight.dtype} {list(weight.shape)}")
    return fake_quantize_activations(x, input_global_scale) @ weight.T
