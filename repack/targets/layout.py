"""Layout math shared by the target families: padding and the 128x4 block-scale swizzle.

Pure torch on CPU or GPU. Each transform has its exact inverse next to it; the swizzle follows
cuBLAS/CUTLASS's "128x4" scale-factor layout as vLLM's ``swizzle_blockscale`` and FlashInfer's
``_unswizzle_sf_128x4`` define it (see docs/NVFP4_REFERENCE.md §3).
"""

from __future__ import annotations

import torch

from ..nvfp4 import BLOCK_SIZE
from .base import LayerGeometry

PAD_ALIGNMENT = 64  # vLLM's pad_nvfp4_weight_for_cutlass(alignment=64), on N and on K (elements)


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def vllm_geometry(n: int, k: int, alignment: int = PAD_ALIGNMENT) -> LayerGeometry:
    """vLLM's ``pad_nvfp4_weight_for_cutlass``: N and K to multiples of ``alignment`` (64 as the W4A16 cute-dsl
    kernel calls it; its default 32 for the W4A4 kernels), the K padding stored in BYTES (activations are padded
    by twice that). Shared by the sm100, sm120 and W4A4 layouts."""
    k_padded = round_up(k, alignment)
    return LayerGeometry(round_up(n, alignment), k_padded, (k_padded - k) // 2)


def swizzled_scale_shape(n: int, k: int) -> tuple[int, int]:
    """``[round_up(N, 128), round_up(K/16, 4)]``: uses the ORIGINAL N, as vLLM does."""
    return round_up(n, 128), round_up(k // BLOCK_SIZE, 4)


def pad_2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the bottom and right to ``[rows, cols]`` (dtype-agnostic)."""
    if tuple(t.shape) == (rows, cols):
        return t.contiguous()
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def pad_codes(codes: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> ``[n_padded, k_padded/2]`` with zero codes (zero weights) appended."""
    return pad_2d(codes, geometry.n_padded, geometry.k_padded // 2)


def is_aligned(t: torch.Tensor, nbytes: int) -> bool:
    """Whether contiguous ``t`` can be viewed as ``nbytes``-wide words: its data address and its offset in its
    storage are multiples of ``nbytes`` (a tensor mapped from a file is only as aligned as its offset there)."""
    return t.data_ptr() % nbytes == 0 and t.storage_offset() * t.element_size() % nbytes == 0


def aligned(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``t`` contiguous and :func:`is_aligned`, copied only if it is not."""
    t = t.contiguous()
    return t if is_aligned(t, nbytes) else t.clone()


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[N, K_sf]`` scales -> the canonical 128x4-swizzled ``[round_up(N,128), round_up(K_sf,4)]``.

    Byte ``(n, k)`` lands at ``((n//128)*(Kp/4) + k//4)*512 + (n%32)*16 + ((n%128)//32)*4 + k%4``:
    view the padded matrix as ``(N/128, 4, 32, Kp/4)`` 4-byte words (``k%4`` inside the word) and bring the
    32-row index inside the 4x4 atom; moving whole words is several times faster than moving bytes.
    """
    rows, cols = swizzled_scale_shape(scales.shape[0], scales.shape[1] * BLOCK_SIZE)
    words = aligned(pad_2d(scales.view(torch.uint8), rows, cols), 4).view(torch.int32)
    tiles = words.view(rows // 128, 4, 32, cols // 4).permute(0, 3, 2, 1)
    return tiles.reshape(rows, cols // 4).view(torch.uint8).view(scales.dtype)


def swizzle_128x4_offsets(rows: torch.Tensor, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``[R, B]`` byte offsets of scales ``(rows [R], blocks [B])`` in the 128x4 layout of an ``[n, k]`` layer, by the
    formula alone (the index-formula decoders' reading, independent of :func:`swizzle_128x4`'s permute):
    ``((r//128)*(Kp/4) + b//4)*512 + (r%32)*16 + ((r%128)//32)*4 + b%4``, ``Kp = round_up(K/16, 4)``."""
    kp = round_up(k // BLOCK_SIZE, 4)
    row = (rows // 128) * (kp // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4
    return row[:, None] + ((blocks // 4) * 512 + blocks % 4)[None, :]


def unswizzle_128x4(swizzled: torch.Tensor, n: int, k_sf: int) -> torch.Tensor:
    """Exact inverse of :func:`swizzle_128x4`: the linear ``[n, k_sf]`` scales, padding dropped."""
    rows, cols = swizzled_scale_shape(n, k_sf * BLOCK_SIZE)
    words = aligned(swizzled.view(torch.uint8), 4).view(torch.int32).reshape(rows // 128, cols // 4, 32, 4)
    linear = words.permute(0, 3, 2, 1).reshape(rows, cols // 4).view(torch.uint8)
    return linear[:n, :k_sf].contiguous().view(swizzled.dtype)
