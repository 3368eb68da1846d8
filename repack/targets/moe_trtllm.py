"""NVFP4 MoE on sm100 / sm103: what vLLM 0.33's FlashInfer TRT-LLM-gen MoE holds after its
``process_weights_after_loading``.

vLLM's ``auto`` tries ``FLASHINFER_TRTLLM`` first and takes it on sm10x for a W4A4 NVFP4 MoE with a routing method
it lists (Qwen3-MoE's Renormalize, DeepSeek-V3's, ...). ``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` then, per
FusedMoE layer (``quantization/utils/flashinfer_fp4_moe.py``, ``flashinfer_utils.py``, FlashInfer's
``fused_moe/core.py`` and ``utils.py``, ``TrtLlmNvFp4ExpertsMonolithic``):

1. w13 rows in w3/w1 order (up, then gate); one input scale for all experts (as :mod:`.moe_cutlass`).
2. Hidden size H zero-padded to ``Hp = round_up(H, 256)`` (w13's K, w2's rows), intermediate I to
   ``Ip = round_up(I, 64)`` with up and gate padded apart (w13 rows ``[0, I)`` and ``[Ip, Ip + I)``; w2's K).
3. Every expert's rows permuted: w13 by the gated-activation reorder (``[up0, gate0, up1, gate1, ...]``) composed
   with ``shuffle_matrix_a``'s row shuffle for epilogue tile 128 (blocks of 32 rows, row ``o`` to
   ``(o % 4) * 8 + o // 4``); w2 by the row shuffle alone. Block scales take the same rows, then FlashInfer's
   ``nvfp4_block_scale_interleave``, which is the 128x4 swizzle of each expert (checked against its C++).
4. ``w13_weight_scale_2``, ``w2_weight_scale_2``: multiplier x shared input scale; ``g1_scale_c`` =
   ``w13_weight_scale_2 / w2_input_scale`` (float32, ``_compute_g1_scale_c``), registered on the module.

Shapes: w13_weight uint8 ``[E, 2Ip, Hp/2]``, w13_weight_scale e4m3 ``[E, 2Ip, Hp/16]``, w2_weight ``[E, Hp, Ip/2]``,
w2_weight_scale ``[E, Hp, Ip/16]``; the scalars float32 ``[E]``.
"""

from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch

from ..nvfp4 import BLOCK_SIZE
from .base import TensorSpec
from .layout import aligned, round_up
from .moe import (SCALARS, VLLM_GATE_UP, VLLM_TP_ALIGNMENT, ExpertCodes, ExpertStack, scale_offset,
                  shared_input_scale, swizzle_experts, unswizzle_experts, w3w1)

LAYOUT_ID = "moe-flashinfer-trtllm-v1"
BACKEND = "FLASHINFER_TRTLLM"
KERNEL = "TrtLlmNvFp4ExpertsMonolithic"
# vLLM 0.33 takes the modular class instead where the monolithic kernel lacks the routing (softmax top-k without
# renormalization, Qwen2-MoE's norm_topk_prob false: RoutingMethodType.Default); the held tensors are the same.
KERNELS = (KERNEL, "TrtLlmNvFp4ExpertsModular")
WEIGHT_ONLY = False  # FP4 x FP4: the layer holds its input scale and folded alphas (moe_marlin.WEIGHT_ONLY)
LAYER_SCALE_FACTOR = False  # the experts' block scales as the source's (moe_marlin.LAYER_SCALE_FACTOR)
read_as = None  # the kernel reads the experts as stored (moe_marlin.read_as: what Marlin's reads differ in)
INVERSE_READS = ()  # from_runtime reads the weight tensors alone (moe_marlin.INVERSE_READS)
GATE_UP_REFUSAL, TP_ALIGNMENT = VLLM_GATE_UP, VLLM_TP_ALIGNMENT  # the plan's (bundle.layers.plan_layers)
NAMED = False  # vLLM's names and scalars, the rank's experts' alone (moe.moe_specs; SGLang's layouts: True)
HIDDEN_ALIGNMENT = 256  # trtllm_nvfp4_hidden_alignment for gated layers with per-tensor activation scales
INTERMEDIATE_ALIGNMENT = 64  # gated: 2 x Ip a multiple of 128, as FlashInfer's block-scale shuffle asserts
SHUFFLE_BLOCK = 32  # get_shuffle_block_size(epilogue_tile_m=128)
TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", *SCALARS, "g1_scale_c")


def check_shape(experts: int, hidden: int, intermediate: int, name: str = "MoE layer") -> None:
    """Every NVFP4 MoE layer shape is served (vLLM pads hidden to 256 and intermediate to 64 here, where FlashInfer
    CUTLASS would refuse): the layouts' common check, which refuses nothing on sm100."""


def padded_sizes(hidden: int, intermediate: int, hidden_alignment: int = HIDDEN_ALIGNMENT) -> tuple[int, int]:
    """``(Hp, Ip)``; ``hidden_alignment``: an engine's padding of the hidden size (vLLM 256, SGLang 1: none)."""
    return round_up(hidden, hidden_alignment), round_up(intermediate, INTERMEDIATE_ALIGNMENT)


def shuffle_rows(rows: int) -> torch.Tensor:
    """``get_shuffle_matrix_a_row_indices`` for epilogue tile 128: held row ``n`` <- source row."""
    n = torch.arange(rows)
    inside = n % SHUFFLE_BLOCK
    return n - inside + (inside % 8) * 4 + inside // 8


def w13_rows(padded_intermediate: int) -> torch.Tensor:
    """Held w13 row ``n`` <- row of the padded ``[up; gate]`` matrix: the gated reorder (``p -> p // 2 +
    (p % 2) * Ip``) after the shuffle, as ``_maybe_get_cached_w3_w1_permute_indices`` composes them."""
    shuffled = shuffle_rows(2 * padded_intermediate)
    return shuffled // 2 + (shuffled % 2) * padded_intermediate


def _gather(t: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, cols: int) -> torch.Tensor:
    """``t[:, rows]`` as one gather, rows not ``valid`` (padding) zeroed, columns zero-padded to ``cols``."""
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if t.shape[2] % w.itemsize == 0)
    out = aligned(t.view(torch.uint8), word.itemsize).view(word).index_select(1, rows.clamp(max=t.shape[1] - 1))
    out.index_fill_(1, torch.nonzero(~valid).flatten(), 0)  # whole rows: moving words, not bytes, is faster
    out = out.view(torch.uint8)
    if out.shape[2] < cols:
        out = torch.nn.functional.pad(out, (0, cols - out.shape[2]))
    return out.view(t.dtype)


def w13_source_rows(intermediate: int, padded_intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held w13 row -> row of the canonical ``[gate; up]`` stack (the w3/w1 swap and Ip padding folded into the
    permutation), and which held rows are padding."""
    padded = w13_rows(padded_intermediate)  # row of [up padded to Ip; gate padded to Ip]
    up = padded < padded_intermediate
    inside = torch.where(up, padded, padded - padded_intermediate)
    return torch.where(up, inside + intermediate, inside), inside < intermediate


def to_runtime(stack: ExpertStack, name: str = "MoE layer",
               parts: Collection[str] = TENSORS, hidden_alignment: int = HIDDEN_ALIGNMENT) -> dict[str, torch.Tensor]:
    """The tensors vLLM holds on the FusedMoE module, by its names (``name``: for messages; nothing is refused;
    ``parts``: only these; each is expert by expert, so a stack of some experts gives those experts' rows of
    every tensor). Each weight tensor is one gather from the canonical stack: pads, w3/w1 swap and row
    permutations folded."""
    hidden, inter = stack.hidden, stack.intermediate
    hp, ip = padded_sizes(hidden, inter, hidden_alignment)
    rows13, valid13 = w13_source_rows(inter, ip)
    rows2 = shuffle_rows(hp)
    valid2 = rows2 < hidden
    a13 = shared_input_scale(stack.w13_input_scale, stack.experts)
    a2 = shared_input_scale(stack.w2_input_scale, stack.experts)
    alpha13 = stack.w13_multiplier[:, 0].to(torch.float32) * a13
    make: dict[str, Callable[[], torch.Tensor]] = {
        "w13_weight": lambda: _gather(stack.w13_codes, rows13, valid13, hp // 2),
        "w13_weight_scale": lambda: swizzle_experts(_gather(stack.w13_scales, rows13, valid13, hp // BLOCK_SIZE)),
        "w2_weight": lambda: _gather(stack.w2_codes, rows2, valid2, ip // 2),
        "w2_weight_scale": lambda: swizzle_experts(_gather(stack.w2_scales, rows2, valid2, ip // BLOCK_SIZE)),
        "w13_weight_scale_2": lambda: alpha13,
        "w13_input_scale": lambda: a13,
        "w2_weight_scale_2": lambda: stack.w2_multiplier.to(torch.float32) * a2,
        "w2_input_scale": lambda: a2,
        "g1_scale_c": lambda: alpha13 * (1.0 / a2),
    }
    return {part: make[part]() for part in parts}


def codes_from_pieces(which: str, pieces: Sequence[tuple[torch.Tensor, ...]], hidden: int,
                      intermediate: int, hidden_alignment: int = HIDDEN_ALIGNMENT) -> torch.Tensor:
    """:func:`to_runtime`'s ``w13_weight`` (``which`` "w13"; ``pieces``: each expert's ``(gate, up)`` rows, ``[I, H/2]``
    each) or ``w2_weight`` ("w2"; each expert's ``(down,)``, ``[H, I/2]``), copied once from the pieces instead of
    stacked and then gathered: unpadded, both row permutations are reshapes (the 32-row shuffle moves row ``4k + j``
    of a block to ``8j + k``; the gated reorder interleaves up and gate). Padded, the pieces are stacked first."""
    hp, ip = padded_sizes(hidden, intermediate, hidden_alignment)
    if (hp, ip) != (hidden, intermediate):  # padded: stacked, then gathered as to_runtime does
        if which == "w13":
            rows, valid = w13_source_rows(intermediate, ip)
            stack = torch.stack([t for pair in pieces for t in pair]).view(len(pieces), 2 * intermediate, -1)
            return _gather(stack, rows, valid, hp // 2)
        rows = shuffle_rows(hp)
        return _gather(torch.stack([down for (down,) in pieces]), rows, rows < hidden, ip // 2)
    if which == "w13":  # held row 32a + 16 j1 + 8 j0 + k <- row 16a + 2k + j1 of (up, gate)[j0]
        out = torch.empty((len(pieces), 2 * ip, hp // 2), dtype=torch.uint8)
        for held, (gate, up) in zip(out, pieces):
            tiles = held.view(-1, 2, 2, 8, hp // 2)
            for j0, half in enumerate((up, gate)):
                tiles[:, :, j0].copy_(half.view(-1, 8, 2, hp // 2).transpose(1, 2))
        return out
    out = torch.empty((len(pieces), hp, ip // 2), dtype=torch.uint8)
    for held, (down,) in zip(out, pieces):
        held.view(-1, 4, 8, ip // 2).copy_(down.view(-1, 8, 4, ip // 2).transpose(1, 2))
    return out


def from_runtime(tensors: dict[str, torch.Tensor], hidden: int, intermediate: int,
                 hidden_alignment: int = HIDDEN_ALIGNMENT) -> ExpertCodes:
    """Exact inverse of :func:`to_runtime` on codes and block scales (padding dropped, w1/w3 order restored)."""
    hp, ip = padded_sizes(hidden, intermediate, hidden_alignment)
    back13, back2 = torch.argsort(w13_rows(ip)), torch.argsort(shuffle_rows(hp))

    def unpad13(t: torch.Tensor, cols: int) -> torch.Tensor:
        t = t.index_select(1, back13)
        return w3w1(torch.cat((t[:, :intermediate, :cols], t[:, ip: ip + intermediate, :cols]), dim=1)).contiguous()

    scales13 = unswizzle_experts(tensors["w13_weight_scale"], 2 * ip, hp // BLOCK_SIZE)
    scales2 = unswizzle_experts(tensors["w2_weight_scale"], hp, ip // BLOCK_SIZE)
    return ExpertCodes(
        w13_codes=unpad13(tensors["w13_weight"], hidden // 2),
        w13_scales=unpad13(scales13, hidden // BLOCK_SIZE),
        w2_codes=tensors["w2_weight"].index_select(1, back2)[:, :hidden, : intermediate // 2].contiguous(),
        w2_scales=scales2.index_select(1, back2)[:, :hidden, : intermediate // BLOCK_SIZE].contiguous(),
    )


def runtime_specs(experts: int, hidden: int, intermediate: int,
                  hidden_alignment: int = HIDDEN_ALIGNMENT) -> dict[str, TensorSpec]:
    hp, ip = padded_sizes(hidden, intermediate, hidden_alignment)
    scalar = TensorSpec(torch.float32, (experts,))
    return {
        "w13_weight": TensorSpec(torch.uint8, (experts, 2 * ip, hp // 2)),
        "w13_weight_scale": TensorSpec(torch.float8_e4m3fn, (experts, 2 * ip, hp // BLOCK_SIZE)),
        "w2_weight": TensorSpec(torch.uint8, (experts, hp, ip // 2)),
        "w2_weight_scale": TensorSpec(torch.float8_e4m3fn, (experts, hp, ip // BLOCK_SIZE)),
        **{name: scalar for name in (*SCALARS, "g1_scale_c")},
    }


def held_row(row: torch.Tensor, which: str, hidden: int, intermediate: int,
             hidden_alignment: int = HIDDEN_ALIGNMENT) -> torch.Tensor:
    """Canonical row (w13: gate rows ``[0, I)``, up rows ``[I, 2I)``) -> the row that holds it, by formula: its
    padded row (up first), then the inverse of the gated reorder and of the 32-row shuffle."""
    hp, ip = padded_sizes(hidden, intermediate, hidden_alignment)
    if which == "w13":
        up = row >= intermediate
        padded = torch.where(up, row - intermediate, row + ip)  # [up; gate], each half padded to Ip
        reordered = torch.where(padded < ip, 2 * padded, 2 * (padded - ip) + 1)  # inverse of p // 2 + (p % 2) Ip
    else:
        reordered = row
    inside = reordered % SHUFFLE_BLOCK  # inverse of the shuffle: source o sits at (o % 4) * 8 + o // 4
    return reordered - inside + (inside % 4) * 8 + inside // 4


def decode_expert(tensors: dict[str, torch.Tensor], expert: int, which: str, hidden: int,
                  intermediate: int, hidden_alignment: int = HIDDEN_ALIGNMENT) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K/2]`` and block scales ``[N, K/16]`` of one expert's ``w13`` (w1 then w3 rows) or ``w2``, by
    gathering with the index formulas alone (independent of :func:`from_runtime`'s argsorts)."""
    hp, ip = padded_sizes(hidden, intermediate, hidden_alignment)
    n, k, rows_held, cols_held = ((2 * intermediate, hidden, 2 * ip, hp // BLOCK_SIZE) if which == "w13"
                                  else (hidden, intermediate, hp, ip // BLOCK_SIZE))
    rows = held_row(torch.arange(n), which, hidden, intermediate, hidden_alignment)
    codes = tensors[f"{which}_weight"][expert].index_select(0, rows)[:, : k // 2]
    flat = tensors[f"{which}_weight_scale"].reshape(-1).view(torch.uint8)
    scales = flat[scale_offset(expert, rows, rows_held, cols_held)].view(torch.float8_e4m3fn)[:, : k // BLOCK_SIZE]
    return codes, scales
