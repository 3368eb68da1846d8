"""NVFP4 MoE through Marlin: what vLLM 0.33's ``MarlinExperts`` holds after ``process_weights_after_loading``.

vLLM's ``auto`` picks ``MARLIN`` for an NVFP4 MoE wherever no FP4 x FP4 MoE backend answers: every GPU from sm75 to
sm89, and weight-only checkpoints on sm100 / sm120 (``select_nvfp4_moe_backend``; on sm90 Humming outranks it).
``prepare_nvfp4_moe_layer_for_marlin`` (``quantization/utils/marlin_utils_fp4.py``) per FusedMoE layer, with ``I``
the rank's intermediate size padded to ``Ip`` (64 when H is a multiple of 128, else 128; H a multiple of 64):

w13_weight: int32 ``[E, H/16, 2 * 2 Ip]``: each expert's gate rows then up rows, each half zero-padded to ``Ip``
    rows, through ``gptq_marlin_repack`` (:func:`.marlin.repack_codes`) with N = 2 Ip, K = H.
w2_weight: int32 ``[E, Ip/16, 2 H]``: each expert's ``[H, I/2]`` codes, K zero-padded to ``Ip``, repacked.
w13_weight_scale / w2_weight_scale: float8_e4m3fn ``[E, H/16, 2 Ip]`` / ``[E, Ip/16, H]``: each expert's scales
    as the dense layout holds them (:func:`.marlin.process_scales`), with one factor ``sf`` for all of the layer's
    experts (from the largest block scale among them).
w13_weight_scale_2 / w2_weight_scale_2: float32 ``[E]``: each expert's multiplier (gate's for w13, as vLLM keeps)
    times ``2^(bias - 7)`` over ``sf``.

The inverse needs ``sf``: a bundle keeps each expert's source multiplier (``w13_weight_multiplier``,
``w2_weight_multiplier``, not loaded into vLLM), as the dense layout does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from types import ModuleType
from typing import Callable, Collection, Sequence

import torch

from ..errors import RepackError
from ..nvfp4 import BLOCK_SIZE
from . import marlin
from .base import TensorSpec
from .layout import round_up
from .moe import VLLM_GATE_UP, VLLM_TP_ALIGNMENT, ExpertCodes, ExpertStack

LAYOUT_ID = "moe-marlin-v1"
FP16_LAYOUT_ID = "moe-marlin-fp16-v1"  # sm75 (T4): fp16 activations change the scales' bytes (FP16 below)
BACKEND = "MARLIN"  # vLLM's NvFp4MoeBackend
KERNEL = "MarlinExperts"
KERNELS = (KERNEL,)
# Marlin runs bf16 (fp16) activations: no input scales held; an expert's multiplier is expert_multiplier's
WEIGHT_ONLY = True
# One scale factor for all of a layer's experts, from their largest block scale (ExpertStack.largest_scales);
# what it flushes is read_as's
LAYER_SCALE_FACTOR = True
SCALARS = ("w13_weight_scale_2", "w2_weight_scale_2")
KEPT = ("w13_weight_multiplier", "w2_weight_multiplier")  # in the bundle for the inverse, not loaded into vLLM
INVERSE_READS = (*SCALARS, *KEPT)  # besides the weight tensors, what from_runtime reads (the scale factors)
GATE_UP_REFUSAL, TP_ALIGNMENT = VLLM_GATE_UP, VLLM_TP_ALIGNMENT  # the plan's (bundle.layers.plan_layers)
NAMED = False  # vLLM's names and scalars, the rank's experts' alone (moe.moe_specs; SGLang's layouts: True)
TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", *SCALARS, *KEPT)
MADE_FROM = {"w13_weight": "w13_codes", "w13_weight_scale": "w13_scales", "w2_weight": "w2_codes",
             "w2_weight_scale": "w2_scales"}


def check_shape(experts: int, hidden: int, intermediate: int, name: str = "MoE layer") -> None:
    """vLLM's refusal, in one line (:func:`padded_intermediate`)."""
    padded_intermediate(hidden, intermediate, name)


def padded_intermediate(hidden: int, intermediate: int, name: str = "MoE layer") -> int:
    """vLLM's ``padded_N``: I to 64 when H is a multiple of 128, else to 128 (H must be a multiple of 64)."""
    if hidden % 64 or intermediate % BLOCK_SIZE:
        raise RepackError(f"{name}: Marlin MoE needs hidden size a multiple of 64 (got {hidden}) and intermediate "
                          f"size per rank a multiple of 16 (got {intermediate}), as vLLM 0.33 does")
    return round_up(intermediate, 64 if hidden % 128 == 0 else 128)


def _pad_halves(t: torch.Tensor, padded: int) -> torch.Tensor:
    """``[E, 2I, C]`` -> ``[E, 2 Ip, C]``: gate and up each zero-padded to ``Ip`` rows."""
    e, rows, cols = t.shape
    if rows // 2 == padded:
        return t.contiguous()
    out = torch.zeros((e, 2, padded, cols), dtype=t.dtype, device=t.device)
    out[:, :, : rows // 2] = t.view(e, 2, rows // 2, cols)
    return out.view(e, 2 * padded, cols)


def layer_factors(largest: tuple[float, float], dtype: torch.dtype) -> tuple[float, float]:
    """``sf`` of w13 and w2 from the largest block scale among the layer's experts (what vLLM's
    ``_nvfp4_compute_scale_factor`` finds over the whole stack)."""
    return tuple(marlin.scale_factor(torch.tensor([value]).to(torch.float8_e4m3fn), dtype) for value in largest)


def largest_scales(stack: ExpertStack) -> tuple[float, float]:
    """The largest w13 and w2 block scale of the stack's experts."""
    return (float(stack.w13_scales.float().max()), float(stack.w2_scales.float().max()))


def to_runtime(stack: ExpertStack, name: str = "MoE layer", parts: Collection[str] = TENSORS,
               dtype: torch.dtype = torch.bfloat16, padded: int | None = None,
               factors: tuple[float, float] | None = None) -> dict[str, torch.Tensor]:
    """The tensors vLLM holds on the FusedMoE module (and the kept multipliers), expert by expert; ``sf`` from
    ``stack.largest_scales`` when set (a chunk of the layer's experts), else from the stack's own scales.
    Another engine's Marlin MoE (SGLang's) gives its own ``padded`` intermediate size and ``factors`` (``(1, 1)``:
    no scale factor, no flush) and takes the weight tensors alone."""
    hidden, inter = stack.hidden, stack.intermediate
    padded = padded_intermediate(hidden, inter, name) if padded is None else padded
    flush = factors is None
    sf13, sf2 = layer_factors(stack.largest_scales or largest_scales(stack), dtype) if factors is None else factors

    def each(values: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return torch.stack([make(v) for v in values])

    def codes13() -> torch.Tensor:
        return each(_pad_halves(stack.w13_codes, padded), lambda c: marlin.repack_codes(c, 2 * padded, hidden))

    def scales13() -> torch.Tensor:
        return each(_pad_halves(stack.w13_scales, padded),
                    lambda s: marlin.process_scales(s, 2 * padded, hidden, sf13, dtype, flush))

    make: dict[str, Callable[[], torch.Tensor]] = {
        "w13_weight": codes13,
        "w13_weight_scale": scales13,
        "w2_weight": lambda: each(stack.w2_codes, lambda c: marlin.repack_codes(c, hidden, padded)),
        "w2_weight_scale": lambda: each(stack.w2_scales,
                                       lambda s: marlin.process_scales(s, hidden, padded, sf2, dtype, flush)),
        "w13_weight_scale_2": lambda: marlin.held_multiplier(stack.w13_multiplier[:, 0], sf13, dtype).reshape(-1),
        "w2_weight_scale_2": lambda: marlin.held_multiplier(stack.w2_multiplier, sf2, dtype).reshape(-1),
        "w13_weight_multiplier": lambda: stack.w13_multiplier[:, 0].to(torch.float32),
        "w2_weight_multiplier": lambda: stack.w2_multiplier.to(torch.float32),
    }
    # dense strides: one expert's column of [1, 2] is "contiguous" to torch with stride 2 (an --ep rank of one expert)
    return {part: make[part]().clone(memory_format=torch.contiguous_format) if part in INVERSE_READS else make[part]()
            for part in parts}


def codes_from_pieces(which: str, pieces: Sequence[tuple[torch.Tensor, ...]], hidden: int,
                      intermediate: int, padded: int | None = None) -> torch.Tensor:
    """:func:`to_runtime`'s ``w13_weight`` (``which`` "w13"; ``pieces``: each expert's ``(gate, up)`` rows) or
    ``w2_weight`` ("w2"; each expert's ``(down,)``), each expert repacked from its pieces (gate and up padded apart)."""
    padded = padded_intermediate(hidden, intermediate) if padded is None else padded
    if which == "w13":
        out = []
        for gate, up in pieces:
            halves = torch.zeros((2, padded, hidden // 2), dtype=torch.uint8)
            halves[0, :intermediate], halves[1, :intermediate] = gate, up
            out.append(marlin.repack_codes(halves.view(2 * padded, -1), 2 * padded, hidden))
        return torch.stack(out)
    return torch.stack([marlin.repack_codes(down.contiguous(), hidden, padded) for (down,) in pieces])


def _factor(held: torch.Tensor, multiplier: torch.Tensor, dtype: torch.dtype) -> float:
    ratio = multiplier.double() * marlin.global_exponent(dtype) / held.double()
    return float(torch.exp2(torch.log2(ratio).round()).reshape(-1)[0])


def from_runtime(tensors: dict[str, torch.Tensor], hidden: int, intermediate: int,
                 dtype: torch.dtype = torch.bfloat16, padded: int | None = None,
                 factors: tuple[float, float] | None = None) -> ExpertCodes:
    """Exact inverse of :func:`to_runtime` on codes and block scales (flushed scales as 0, as Marlin reads them);
    ``padded`` and ``factors`` as :func:`to_runtime` took them (None: vLLM's, the factors from the kept
    multipliers)."""
    padded = padded_intermediate(hidden, intermediate) if padded is None else padded
    sf13, sf2 = factors or (_factor(tensors["w13_weight_scale_2"], tensors["w13_weight_multiplier"], dtype),
                            _factor(tensors["w2_weight_scale_2"], tensors["w2_weight_multiplier"], dtype))

    def halves(t: torch.Tensor) -> torch.Tensor:  # [E, 2 Ip, C] -> [E, 2I, C]
        e, _, cols = t.shape
        return t.view(e, 2, padded, cols)[:, :, :intermediate].reshape(e, 2 * intermediate, cols)

    w13_codes = torch.stack([marlin.unrepack_codes(w, 2 * padded, hidden) for w in tensors["w13_weight"]])
    w13_scales = torch.stack([marlin.unprocess_scales(s, 2 * padded, hidden, sf13)
                              for s in tensors["w13_weight_scale"]])
    return ExpertCodes(
        w13_codes=halves(w13_codes).contiguous(),
        w13_scales=halves(w13_scales).contiguous(),
        w2_codes=torch.stack([marlin.unrepack_codes(w, hidden, intermediate) for w in tensors["w2_weight"]]),
        w2_scales=torch.stack([marlin.unprocess_scales(s, hidden, intermediate, sf2)
                               for s in tensors["w2_weight_scale"]]),
    )


def runtime_specs(experts: int, hidden: int, intermediate: int, padded: int | None = None) -> dict[str, TensorSpec]:
    """dtype and shape of every tensor :func:`to_runtime` makes, from sizes alone (for shard planning; the shape
    check is :func:`check_shape`'s)."""
    padded = round_up(intermediate, 64 if hidden % 128 == 0 else 128) if padded is None else padded
    scalar = TensorSpec(torch.float32, (experts,))
    return {
        "w13_weight": TensorSpec(torch.int32, (experts, hidden // 16, 4 * padded)),
        "w13_weight_scale": TensorSpec(torch.float8_e4m3fn, (experts, hidden // BLOCK_SIZE, 2 * padded)),
        "w2_weight": TensorSpec(torch.int32, (experts, padded // 16, 2 * hidden)),
        "w2_weight_scale": TensorSpec(torch.float8_e4m3fn, (experts, padded // BLOCK_SIZE, hidden)),
        **{name: scalar for name in (*SCALARS, *KEPT)},
    }


def read_as(stack: ExpertStack, dtype: torch.dtype = torch.bfloat16) -> ExpertStack:
    """``stack`` as Marlin reads it: block scales below its flush threshold are 0 (what :func:`from_runtime`
    returns), with the layer's factors (``stack.largest_scales``, else the stack's own)."""
    sf13, sf2 = layer_factors(stack.largest_scales or largest_scales(stack), dtype)
    return replace(stack, w13_scales=marlin.flushed(stack.w13_scales, sf13),
                   w2_scales=marlin.flushed(stack.w2_scales, sf2))


# --- index formulas (verify's numerics): expert e's codes and scales gathered by the dense Marlin formulas ---
def decode_expert(tensors: dict[str, torch.Tensor], expert: int, which: str, hidden: int,
                  intermediate: int, padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes uint8 ``[N, K/2]`` and block scales (float64, times ``sf * 2^7``: :func:`expert_multiplier` holds the
    rest) of one expert's ``w13`` (gate then up rows) or ``w2``, gathered by the index formulas of
    ``runtime/formulas.py`` (independent of :func:`from_runtime`'s permutes)."""
    from ..runtime.formulas import marlin_code_offsets, marlin_scale_offsets, s0e5m3_scales

    padded = padded_intermediate(hidden, intermediate) if padded is None else padded
    n, k = (2 * intermediate, hidden) if which == "w13" else (hidden, intermediate)
    rows = torch.arange(n)
    held_rows = rows + (rows >= intermediate) * (padded - intermediate) if which == "w13" else rows
    held_n, held_k = (2 * padded, hidden) if which == "w13" else (hidden, padded)
    positions = marlin_code_offsets(held_rows, torch.arange(k), held_n, held_k)
    flat = tensors[f"{which}_weight"][expert].contiguous().view(torch.uint8).reshape(-1)
    nibbles = (flat[positions >> 1] >> ((positions & 1) * 4).to(torch.uint8)) & 0xF
    scales = s0e5m3_scales(tensors[f"{which}_weight_scale"][expert],
                           marlin_scale_offsets(held_rows, torch.arange(k // BLOCK_SIZE), held_n, held_k))
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scales


def expert_multiplier(tensors: dict[str, torch.Tensor], expert: int, which: str,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What multiplies :func:`decode_expert`'s scales: ``w*_weight_scale_2 / 2^bias`` (float64)."""
    return tensors[f"{which}_weight_scale_2"][expert].double() * 2.0 ** -(7 + math.log2(marlin.global_exponent(dtype)))


def _with_dtype(dtype: torch.dtype, layout_id: str) -> ModuleType:
    """This layout with activations of ``dtype`` (its scales' bytes and global scales depend on it): the same names,
    the dtype-taking functions bound to ``dtype``, its own layout id."""
    module = ModuleType(f"{__name__}[{layout_id}]")
    module.__dict__.update({k: v for k, v in globals().items() if not k.startswith("__")})
    for name in ("to_runtime", "from_runtime", "read_as", "expert_multiplier"):
        setattr(module, name, functools.partial(globals()[name], dtype=dtype))
    module.LAYOUT_ID = layout_id
    return module


FP16 = _with_dtype(torch.float16, FP16_LAYOUT_ID)  # sm75's Marlin MoE: what vLLM holds there (T4 runs fp16)
