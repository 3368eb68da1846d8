"""What the NVFP4 MoE layouts share: the canonical expert stack they transform, the per-expert 128x4 swizzle, and
the two steps every FlashInfer MoE backend of vLLM 0.33 applies (w3/w1 order, one input scale for all experts).
Pure torch; the layouts themselves are :mod:`.moe_cutlass` (sm120) and :mod:`.moe_trtllm` (sm100)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from ..errors import RepackError
from ..nvfp4 import BLOCK_SIZE
from .families import MARLIN
from .layout import round_up, swizzle_128x4, swizzle_128x4_offsets, unswizzle_128x4

if TYPE_CHECKING:
    from .base import Target

SCALARS = ("w13_weight_scale_2", "w13_input_scale", "w2_weight_scale_2", "w2_input_scale")
# The weight tensors each layout holds, and the one ExpertStack field each is made from, expert by expert (the
# scalars are made from the multipliers and input scales): a layout asked for some of its tensors reads only these.
MADE_FROM = {"w13_weight": "w13_codes", "w13_weight_scale": "w13_scales", "w2_weight": "w2_codes",
             "w2_weight_scale": "w2_scales",  # and SGLang's swizzled scales beside its loaded ones (targets/sglang.py)
             "w13_blockscale_swizzled": "w13_scales", "w2_blockscale_swizzled": "w2_scales"}


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
        largest_scales: the largest w13 and w2 block scale among all of the layer's (rank's) experts, where the
            stack holds some of them (Marlin's one scale factor per layer); ``None``: the stack's own.
        stored: the global scales as the checkpoint stores them (float32; compressed-tensors' are the reciprocals of
            the multipliers and input scales above), for an engine that keeps them as loaded (SGLang):
            ``(w13 weight [E, 2], w13 input [E', 2], w2 weight [E], w2 input [E'])``; ``None`` where not read.
    """

    w13_codes: torch.Tensor
    w13_scales: torch.Tensor
    w13_multiplier: torch.Tensor
    w13_input_scale: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor
    w2_multiplier: torch.Tensor
    w2_input_scale: torch.Tensor
    largest_scales: tuple[float, float] | None = None
    stored: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

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


def stored_scales(stack: ExpertStack) -> tuple[torch.Tensor, ...]:
    """An MoE layer's stored global scales (``ExpertStack.stored``), contiguous; refused where the plan read none."""
    if stack.stored is None:
        raise RepackError("an SGLang MoE layer's scalars need the stored global scales (convert --engine sglang)")
    return tuple(t.contiguous() for t in stack.stored)


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


# why vLLM's MoE layouts refuse experts whose gate and up multipliers differ ({gate}, {up}: their names): its NVFP4
# MoE methods keep gate's for both (each layout's GATE_UP_REFUSAL; SGLang's: targets/sglang.py)
VLLM_GATE_UP = ("vLLM keeps {gate}'s for both and would mis-scale {up}; pass --rescale to fold the ratios into the "
                "block scales")
# each rank's intermediate share of a vLLM MoE layer is cut unpadded, the layout pads it after (TP_ALIGNMENT: SGLang's
# TRT-LLM-gen pads the share before loading)
VLLM_TP_ALIGNMENT = 1

# vLLM's refusal-equivalent for the families without an MoE layout here (families.MOE_LAYOUTS has the others)
MOE_REFUSALS = {
    "sm90": "--target sm90: NVFP4 MoE layers are not supported there (vLLM 0.33 serves them with Humming's MoE, whose "
            "weight transform is a GPU op not ported here); vLLM also serves them with Marlin on Hopper "
            "(--moe-backend marlin): convert with --target sm80",
}


def moe_specs(layout: ModuleType, experts: int, hidden: int, intermediate: int, num_experts: int) -> dict:
    """``layout.runtime_specs`` of a rank's ``experts`` of the layer's ``num_experts``: a layout of another engine's
    names and scalars (``NAMED``) may hold some tensors for every expert (SGLang's ModelOpt MoE keeps all experts'
    input scales under expert parallelism); vLLM's hold the rank's alone."""
    if layout.NAMED:
        return layout.runtime_specs(experts, hidden, intermediate, num_experts)
    return layout.runtime_specs(experts, hidden, intermediate)


def moe_layout(target: "Target | str", scheme: str = "W4A4") -> ModuleType:
    """The MoE layout module for ``target`` (a Target, or a family name with the checkpoint's ``scheme``): the one
    vLLM's ``auto`` holds there for that scheme (``families.MOE_LAYOUTS``: sm100 W4A4 FlashInfer TRT-LLM-gen, sm120 W4A4
    FlashInfer CUTLASS, Marlin for sm80 and sm75 (fp16) and for weight-only experts on sm100 / sm120); a one-line
    refusal on sm90 (Humming's MoE)."""
    from .families import MOE_LAYOUTS

    if not isinstance(target, str) and target.moe_layout is not None:  # an engine's own choice (SGLang's)
        return target.moe_layout(target)  # type: ignore[return-value]  # the layout modules' interface
    family = target if isinstance(target, str) else target.name
    if not isinstance(target, str):  # a dense layout of Marlin (sm120 --weight-only: its W4A4 variant) is weight-only
        scheme = "W4A16" if target.kernels == MARLIN else target.scheme
    if family in MOE_REFUSALS:
        raise RepackError(MOE_REFUSALS[family])
    layout_id = MOE_LAYOUTS.get(family, {}).get(scheme)
    if layout_id is None:
        raise RepackError(f"--target {family}: NVFP4 MoE layers are not supported there; supported for MoE: "
                          f"{', '.join(MOE_LAYOUTS)}")
    layout = moe_layout_by_id(layout_id)
    assert layout is not None, layout_id  # tests/test_moe.py: every MOE_LAYOUTS id is a layout module's
    return layout


def moe_layout_by_id(layout_id: str) -> ModuleType | None:
    """The MoE layout module whose ``LAYOUT_ID`` is ``layout_id`` (a bundle's record), if any."""
    from . import moe_cutlass, moe_marlin, moe_trtllm

    return next((m for m in (moe_trtllm, moe_cutlass, moe_marlin, moe_marlin.FP16) if m.LAYOUT_ID == layout_id), None)
