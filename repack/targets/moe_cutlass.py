"""NVFP4 MoE on sm120 / sm121: what vLLM 0.33's FlashInfer CUTLASS MoE holds after ``process_weights_after_loading``.

vLLM's ``auto`` picks ``FLASHINFER_CUTLASS`` for a W4A4 NVFP4 MoE on sm12x (``select_nvfp4_moe_backend``: TRT-LLM-gen
and CuTe-DSL answer only on sm10x). ``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` then, per FusedMoE layer
(``fused_moe/oracle/nvfp4.py``, ``quantization/utils/flashinfer_fp4_moe.py``, ``FlashInferExperts``):

w13_weight: uint8 ``[E, 2I, H/2]``, each expert's rows in w3/w1 order (``reorder_w1w3_to_w3w1``: up, then gate).
w13_weight_scale: float8_e4m3fn ``[E, 2I, round_up(H/16, 4)]``, each expert 128x4-swizzled (``swizzle_blockscale``
    on the 3-D tensor); vLLM refuses gated layers whose 2I is not a multiple of 128 (it would have to pad w1 and
    w3 apart), and so do we.
w2_weight: uint8 ``[E, H, I/2]`` as loaded; w2_weight_scale: ``[E, round_up(H, 128), round_up(I/16, 4)]`` swizzled.
w13_input_scale, w2_input_scale: float32 ``[E]``, the largest activation dequant scale of all experts (and of w1
    and w3) repeated (``amax_for_moe_activation_quant``): the kernel quantizes every expert's input with one scale.
w13_weight_scale_2, w2_weight_scale_2: float32 ``[E]``, each expert's weight multiplier (w1's for w13: vLLM keeps
    ``[:, 0]``) times that input scale (``FlashInferExperts.process_weights_after_loading``: the GEMMs' alphas).

The scalars are not invertible (vLLM drops w3's multiplier and all but the largest input scale): the inverse
returns the codes and block scales exactly and the scalars as held; verify recomputes the scalars from the source.
"""

from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch

from ..errors import RepackError
from ..nvfp4 import BLOCK_SIZE
from .base import TensorSpec
from .layout import round_up
from .moe import (SCALARS, VLLM_GATE_UP, VLLM_TP_ALIGNMENT, ExpertCodes, ExpertStack, scale_offset,
                  shared_input_scale, swizzle_experts, unswizzle_experts, w3w1)

LAYOUT_ID = "moe-flashinfer-cutlass-v1"
BACKEND = "FLASHINFER_CUTLASS"  # vLLM's NvFp4MoeBackend
KERNEL = "FlashInferExperts"
KERNELS = (KERNEL,)  # the experts classes vLLM holds this layout with
WEIGHT_ONLY = False  # FP4 x FP4: the layer holds its input scale and folded alphas (moe_marlin.WEIGHT_ONLY)
LAYER_SCALE_FACTOR = False  # the experts' block scales as the source's (moe_marlin.LAYER_SCALE_FACTOR)
read_as = None  # the kernel reads the experts as stored (moe_marlin.read_as: what Marlin's reads differ in)
INVERSE_READS = ()  # from_runtime reads the weight tensors alone (moe_marlin.INVERSE_READS)
GATE_UP_REFUSAL, TP_ALIGNMENT = VLLM_GATE_UP, VLLM_TP_ALIGNMENT  # the plan's (bundle.layers.plan_layers)
NAMED = False  # vLLM's names and scalars, the rank's experts' alone (moe.moe_specs; SGLang's layouts: True)
TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", *SCALARS)


def check_shape(experts: int, hidden: int, intermediate: int, name: str = "MoE layer") -> None:
    """vLLM's refusal, in one line naming only what fails: a gated layer's 2I per rank must be a multiple of 128 (it
    pads no w1/w3 halves; I is then a multiple of 64, so of the block size), the hidden size one of 16."""
    problems = []
    if (2 * intermediate) % 128:
        problems.append(f"2 x intermediate size per rank (2 x {intermediate} = {2 * intermediate}) must be a multiple of 128")
    if hidden % BLOCK_SIZE:
        problems.append(f"hidden size {hidden} must be a multiple of {BLOCK_SIZE}")
    if problems:
        raise RepackError(f"{name}: the sm120 MoE layout ({BACKEND}) refuses this layer, as vLLM 0.33 does: "
                          + "; ".join(problems))


def to_runtime(stack: ExpertStack, name: str = "MoE layer",
               parts: Collection[str] = TENSORS) -> dict[str, torch.Tensor]:
    """The tensors vLLM holds on the FusedMoE module, by its names (``parts``: only these; each is expert by
    expert, so a stack of some experts gives those experts' rows of every tensor)."""
    check_shape(stack.experts, stack.hidden, stack.intermediate, name)
    a13 = shared_input_scale(stack.w13_input_scale, stack.experts)
    a2 = shared_input_scale(stack.w2_input_scale, stack.experts)
    make: dict[str, Callable[[], torch.Tensor]] = {
        "w13_weight": lambda: w3w1(stack.w13_codes).contiguous(),
        "w13_weight_scale": lambda: swizzle_experts(w3w1(stack.w13_scales)),
        "w2_weight": lambda: stack.w2_codes.contiguous(),
        "w2_weight_scale": lambda: swizzle_experts(stack.w2_scales),
        "w13_weight_scale_2": lambda: stack.w13_multiplier[:, 0].to(torch.float32) * a13,
        "w13_input_scale": lambda: a13,
        "w2_weight_scale_2": lambda: stack.w2_multiplier.to(torch.float32) * a2,
        "w2_input_scale": lambda: a2,
    }
    return {part: make[part]() for part in parts}


def codes_from_pieces(which: str, pieces: Sequence[tuple[torch.Tensor, ...]], hidden: int,
                      intermediate: int) -> torch.Tensor:
    """:func:`to_runtime`'s ``w13_weight`` (``which`` "w13"; ``pieces``: each expert's ``(gate, up)`` rows) or
    ``w2_weight`` ("w2"; each expert's ``(down,)``), copied once from the pieces (up then gate: no stack first)."""
    if which == "w13":
        out = torch.empty((len(pieces), 2 * intermediate, hidden // 2), dtype=torch.uint8)
        for held, (gate, up) in zip(out, pieces):
            held[:intermediate].copy_(up)
            held[intermediate:].copy_(gate)
        return out
    return torch.stack([down for (down,) in pieces])


def from_runtime(tensors: dict[str, torch.Tensor], hidden: int, intermediate: int) -> ExpertCodes:
    """Exact inverse of :func:`to_runtime` on codes and block scales."""
    return ExpertCodes(
        w13_codes=w3w1(tensors["w13_weight"]).contiguous(),
        w13_scales=w3w1(unswizzle_experts(tensors["w13_weight_scale"], 2 * intermediate, hidden // BLOCK_SIZE)),
        w2_codes=tensors["w2_weight"].contiguous(),
        w2_scales=unswizzle_experts(tensors["w2_weight_scale"], hidden, intermediate // BLOCK_SIZE),
    )


def runtime_specs(experts: int, hidden: int, intermediate: int) -> dict[str, TensorSpec]:
    """dtype and shape of every tensor :func:`to_runtime` makes, from sizes alone (for shard planning)."""
    k13, k2 = round_up(hidden // BLOCK_SIZE, 4), round_up(intermediate // BLOCK_SIZE, 4)
    scalar = TensorSpec(torch.float32, (experts,))
    return {
        "w13_weight": TensorSpec(torch.uint8, (experts, 2 * intermediate, hidden // 2)),
        "w13_weight_scale": TensorSpec(torch.float8_e4m3fn, (experts, round_up(2 * intermediate, 128), k13)),
        "w2_weight": TensorSpec(torch.uint8, (experts, hidden, intermediate // 2)),
        "w2_weight_scale": TensorSpec(torch.float8_e4m3fn, (experts, round_up(hidden, 128), k2)),
        **{name: scalar for name in SCALARS},
    }


# --- index formulas: where expert e's (row, column) of each canonical matrix lies in the flat runtime buffers ---
def w13_row(row: torch.Tensor, intermediate: int) -> torch.Tensor:
    """Canonical w13 row (gate rows ``[0, I)``, up rows ``[I, 2I)``) -> its row in ``w13_weight``."""
    return (row + intermediate) % (2 * intermediate)


def decode_expert(tensors: dict[str, torch.Tensor], expert: int, which: str, hidden: int,
                  intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K/2]`` and block scales ``[N, K/16]`` of one expert's ``w13`` (w1 then w3 rows) or ``w2``, by
    gathering with the index formulas alone (independent of :func:`from_runtime`'s permutes)."""
    n, k = (2 * intermediate, hidden) if which == "w13" else (hidden, intermediate)
    rows = torch.arange(n)
    held_rows = w13_row(rows, intermediate) if which == "w13" else rows
    codes = tensors[f"{which}_weight"][expert].index_select(0, held_rows)
    flat = tensors[f"{which}_weight_scale"].reshape(-1).view(torch.uint8)
    scales = flat[scale_offset(expert, held_rows, n, k // BLOCK_SIZE)].view(torch.float8_e4m3fn)
    return codes, scales
