"""What the NVFP4 MoE layouts share: the canonical expert stack they transform, the per-expert 128x4 swizzle, and
the two steps every FlashInfer MoE backend of vLLM 0.33 applies (w3/w1 order, one input scale for all experts).
Pure torch; the layouts themselves are :mod:`.moe_cutlass` (sm120) and :mod:`.moe_trtllm` (sm100)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from ..errors import RepackError
from ..nvfp4 import BLOCK_SIZE
from .layout import round_up, swizzle_128x4, swizzle_128x4_offsets, unswizzle_128x4

SCALARS = ("w13_weight_scale_2", "w13_input_scale", "w2_weight_scale_2", "w2_input_scale")
# The weight tensors each layout holds, and the one ExpertStack field each is made from, expert by expert (the
# scalars are made from the multipliers and input scales): a layout asked for some of its tensors reads only these.
MADE_FROM = {"w13_weight": "w13_codes", "w13_weight_scale": "w13_scales", "w2_weight": "w2_codes",
             "w2_weight_scale": "w2_scales"}


@dataclass(frozen=True)
class ExpertStack:
    """One FusedMoE layer's routed experts in canonical NVFP4 form, stacked as vLLM loads them.

    Attributes:
        w13_codes (`torch.Tensor`): uint8 ``[E, 2I, H/2]``, each expert's gate (w1) rows then up (w3) rows.
        w13_scales (`torch.Tensor`): float8_e4m3fn ``[E, 2I, H/16]``.
        w13_multiplier (`torch.Tensor`): float32 ``[E, 2]``, the dequant multipliers of w1 and w3.
        w13_input_scale (`torch.Tensor`): float32 ``[E', 2]``, the activations' dequant scales of w1 and w3 of the
            experts vLLM loads them for (under expert parallelism, possibly more than this rank's E; ModelOpt
            ``input_scale``; compressed-tensors ``1 / input_global_scale``, in float32 as vLLM computes): only their
            largest is used.
        w2_codes, w2_scales: ``[E, H, I/2]`` and ``[E, H, I/16]``.
        w2_multiplier: float32 ``[E]``; w2_input_scale: float32 ``[E']``.
    """

    w13_codes: torch.Tensor
    w13_scales: torch.Tensor
    w13_multiplier: torch.Tensor
    w13_input_scale: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor
    w2_multiplier: torch.Tensor
    w2_input_scale: torch.Tensor

    @property
    def experts(self) -> int:
        return int(self.w13_codes.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.w13_codes.shape[2]) * 2

    @property
    def intermediate(self) -> int:
        return int(self.w2_codes.shape[2]) * 2


@dataclass(frozen=True)
class ExpertCodes:
    """What :func:`from_runtime` recovers exactly: every expert's codes and block scales, w1/w3 order restored."""

    w13_codes: torch.Tensor
    w13_scales: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor


def swizzle_experts(scales: torch.Tensor) -> torch.Tensor:
    """``[E, M, K_sf]`` -> ``[E, round_up(M, 128), round_up(K_sf, 4)]``: each expert 128x4-swizzled, as vLLM's
    ``swizzle_blockscale`` does on a 3-D tensor. Rows are padded per expert, then all experts go through one
    2-D swizzle (their 128-row tiles never straddle two experts)."""
    experts, rows, cols = scales.shape
    padded = scales
    if rows % 128:
        padded = torch.zeros((experts, round_up(rows, 128), cols), dtype=scales.dtype)
        padded[:, :rows] = scales
    flat = swizzle_128x4(padded.reshape(-1, cols))
    return flat.view(experts, -1, flat.shape[1])


def unswizzle_experts(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Exact inverse of :func:`swizzle_experts`: ``[E, rows, cols]``."""
    experts, rows_padded, _ = swizzled.shape
    flat = unswizzle_128x4(swizzled.reshape(experts * rows_padded, -1), experts * rows_padded, cols)
    return flat.view(experts, rows_padded, cols)[:, :rows].contiguous()


def w3w1(t: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` with halves swapped (w1/w3 <-> w3/w1): its own inverse."""
    half = t.shape[1] // 2
    return torch.cat((t[:, half:], t[:, :half]), dim=1)


def shared_input_scale(scales: torch.Tensor, experts: int) -> torch.Tensor:
    """``amax_for_moe_activation_quant(...).repeat(E)``: the largest scale, float32, once per expert."""
    return scales.max().to(torch.float32).repeat(experts)


def scale_offset(expert: int, rows: torch.Tensor, held_rows: int, cols: int) -> torch.Tensor:
    """``[R, cols]`` flat byte offsets of block scales ``rows`` x ``[0, cols)`` of ``expert`` in a swizzled
    ``[E, held_rows, cols]`` buffer (unpadded sizes): the 128x4 formula inside the expert's own padded block."""
    block = round_up(held_rows, 128) * round_up(cols, 4)
    return expert * block + swizzle_128x4_offsets(rows, torch.arange(cols), held_rows, cols * BLOCK_SIZE)


def moe_layout(family: str) -> ModuleType:
    """The MoE layout module of target family ``family``: the backend vLLM 0.33's ``auto`` picks there for a W4A4
    NVFP4 MoE (sm100: FlashInfer TRT-LLM-gen, sm120: FlashInfer CUTLASS); a one-line refusal elsewhere."""
    from . import moe_cutlass, moe_trtllm

    layouts = {name: module for module in (moe_trtllm, moe_cutlass) for name in module.FAMILIES}
    if family not in layouts:
        raise RepackError(f"--target {family}: NVFP4 MoE layers are not supported there yet (vLLM 0.33 serves them "
                          f"with Humming/Marlin); supported for MoE: {', '.join(layouts)}")
    return layouts[family]
