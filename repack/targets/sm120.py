"""sm120 / sm121 (Blackwell RTX, RTX PRO, GB10): the family's layouts, and FlashInfer's sm12x cute-dsl repack.

vLLM's ``auto`` serves a weight-only checkpoint there with Marlin (``init_nvfp4_linear_kernel``: the cute-dsl W4A16
kernel only on sm100 / sm103): the family's W4A16 layout is Marlin's (targets/marlin.py, sm80's bytes), and with
``--weight-only`` a W4A4 checkpoint gets Marlin's W4A4 variant (vLLM's ``--linear-backend marlin``); a W4A4 checkpoint
gets the FP4 x FP4 layout (targets/w4a4.py). FlashInfer's cute-dsl W4A16 kernel holds the layout below when vLLM is
told ``--linear-backend flashinfer_cutedsl`` (``convert --linear-backend flashinfer_cutedsl``):

The same as ``_prepare_cute_dsl_sm12x`` applied to vLLM's 64-padded codes and 128x4-swizzled scales, computed
straight from the canonical linear scales (the swizzle and FlashInfer's unswizzle cancel):

weight: int32 ``[Kp/16, 2*Np]``. The transposed codes ``[Kp/2, Np]`` are cut into tiles of 8 packed rows
x 64 columns; tile ``(kt, nt)`` becomes 128 little-endian int32 at ``[kt, nt*128 : nt*128+128]``. Byte ``j``
of int32 ``p`` comes from packed row ``r + 4q`` and column ``32s + 16h + 8w + c`` of the tile, where
``p = 64w + 8c + 2r + s`` and ``j = 2h + q``: a pure permutation of an 8-D view.

weight_scale: uint8 ``[Kp/16, Np]``: linear scales transposed, each e4m3 byte re-encoded as "S0E5M3"
``(fp16_bits(e4m3) >> 7) & 0xFF`` (lossless for non-negative scales; decode: ``byte << 7`` as fp16 bits).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..nvfp4 import BLOCK_SIZE, NVFP4Weight
from . import families, marlin, w4a4
from .base import RuntimeLayer, Target, TensorSpec
from .layout import pad_2d, pad_codes, vllm_geometry

# Packed-code tile (rows x cols) -> int32 order, as axes of the 8-D view of [Np, Kp/2]:
# codes.view(NT, s, h, w, c, KT, q, r) -> (KT, NT, w, c, r, s, h, q).


def pack_tiles(padded_codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[Np, Kp/2]`` (Np % 64 == 0, Kp % 16 == 0) -> int32 ``[Kp/16, 2*Np]``.

    One tile column (64 code rows, every ``kt``) at a time: its ``[64, Kp/2]`` bytes, contiguous, gathered into
    tile order by :func:`tile_order` with int32 indices, then copied to their ``[Kp/16, 512]`` place. The 8-D
    view's permutation moves runs of one or two bytes, where torch's strided copy is at its slowest: permuting
    views (even in two copies, through int64 words) took about 1.4x as long."""
    n, k_half = padded_codes.shape
    order = tile_order(k_half, padded_codes.device)
    rows = padded_codes.contiguous().view(n // 64, 64 * k_half)
    out = torch.empty(k_half // 8, n * 8, dtype=torch.uint8, device=padded_codes.device)
    column = torch.empty(k_half // 8, 512, dtype=torch.uint8, device=padded_codes.device)
    for nt in range(n // 64):
        torch.index_select(rows[nt], 0, order, out=column.view(-1))
        out[:, nt * 512 : (nt + 1) * 512].copy_(column)
    return out.view(torch.int32)


def unpack_tiles(packed: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`pack_tiles`: int32 ``[Kp/16, 2*Np]`` -> uint8 ``[Np, Kp/2]``.

    One tile column at a time: its ``[Kp/16, 512]`` bytes copied out whole, then gathered into row order by the
    inverse of :func:`tile_order`."""
    kt, np_ = packed.shape[0], packed.shape[1] // 2
    order = tile_order(kt * 8, packed.device)
    inverse = torch.empty_like(order)
    inverse[order.long()] = torch.arange(order.numel(), dtype=order.dtype, device=packed.device)
    packed_bytes = packed.contiguous().view(torch.uint8)
    out = torch.empty(np_, kt * 8, dtype=torch.uint8, device=packed.device)
    column = torch.empty(kt, 512, dtype=torch.uint8, device=packed.device)
    for nt in range(np_ // 64):
        column.copy_(packed_bytes[:, nt * 512 : (nt + 1) * 512])
        torch.index_select(column.view(-1), 0, inverse, out=out[nt * 64 : (nt + 1) * 64].view(-1))
    return out


def tile_order(k_half: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 ``[Kp/16 * 512]``: for one tile column, the byte of its 64 code rows ``[64, Kp/2]`` (row-major) that
    each of its ``[Kp/16, 512]`` bytes holds: the module doc's 8-D view permutation, applied to positions."""
    positions = torch.arange(64 * k_half, dtype=torch.int32, device=device).view(1, 2, 2, 2, 8, k_half // 8, 2, 4)
    return positions.permute(5, 0, 3, 4, 7, 1, 2, 6).reshape(-1)


def e4m3_to_s0e5m3(scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> uint8 S0E5M3 (drop fp16's sign bit and the 7 mantissa bits e4m3 never sets)."""
    bits = scales.to(torch.float16).view(torch.int16).to(torch.int32)
    return ((bits >> 7) & 0xFF).to(torch.uint8)


def s0e5m3_to_e4m3(encoded: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`e4m3_to_s0e5m3` for non-negative scales."""
    bits = (encoded.to(torch.int32) << 7).to(torch.int16)
    return bits.view(torch.float16).to(torch.float8_e4m3fn)


S0E5M3 = e4m3_to_s0e5m3(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn))  # e4m3 byte -> its S0E5M3


def transposed_scales(scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``[Np, Kp/16]`` -> uint8 S0E5M3 ``[Kp/16, Np]``: one table lookup per byte (a third of the
    time of converting through float16), on indices widened and transposed in one copy."""
    index = scales.view(torch.uint8).t().to(torch.int32, memory_format=torch.contiguous_format)
    return S0E5M3.to(scales.device).index_select(0, index.reshape(-1)).view(index.shape)


def to_runtime(weight: NVFP4Weight) -> RuntimeLayer:
    geometry = vllm_geometry(weight.n, weight.k)
    scales = pad_2d(weight.block_scales.view(torch.uint8), geometry.n_padded, geometry.k_padded // BLOCK_SIZE)
    return RuntimeLayer(
        weight=pack_tiles(pad_codes(weight.codes, geometry)),
        weight_scale=transposed_scales(scales.view(torch.float8_e4m3fn)),
        weight_global_scale=weight.multiplier.reshape(1).to(torch.float32).clone(),
        weights_padding_cols=geometry.weights_padding_cols,
    )


def from_runtime(layer: RuntimeLayer, n: int, k: int) -> NVFP4Weight:
    codes = unpack_tiles(layer.weight)
    scales = s0e5m3_to_e4m3(layer.weight_scale).t()
    return NVFP4Weight(
        codes=codes[:n, : k // 2].contiguous(),
        block_scales=scales[:n, : k // BLOCK_SIZE].contiguous(),
        multiplier=layer.weight_global_scale.reshape(1).clone(),
    )


def runtime_specs(n: int, k: int) -> dict[str, TensorSpec]:
    geometry = vllm_geometry(n, k)
    return {
        "weight": TensorSpec(torch.int32, (geometry.k_padded // 16, 2 * geometry.n_padded)),
        "weight_scale": TensorSpec(torch.uint8, (geometry.k_padded // BLOCK_SIZE, geometry.n_padded)),
        "weight_global_scale": TensorSpec(torch.float32, (1,)),
    }


CUTE_DSL = replace(Target.of(
    families.SM120,
    to_runtime=to_runtime,
    from_runtime=from_runtime,
    runtime_specs=runtime_specs,
    geometry=vllm_geometry,
), layout_id=families.SM120_CUTE_DSL, kernels=families.W4A16_CUTE_DSL)
MARLIN = marlin.target(families.SM120)
TARGET = replace(MARLIN, variants=(*MARLIN.variants, w4a4.variant(CUTE_DSL), CUTE_DSL))
