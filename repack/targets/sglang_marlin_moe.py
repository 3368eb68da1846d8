"""SGLang 0.5.23's FP4 Marlin MoE state: :mod:`.moe_marlin`'s bytes under SGLang's names, padding and scalars.

SGLang serves an NVFP4 FusedMoE layer through FP4 Marlin (weight-only, bf16 activations) where:

- ModelOpt (``ModelOptNvFp4FusedMoEMethod``, NVFP4 and W4A16_NVFP4): its ``auto`` MoE runner backend on sm80-sm9x
  (``create_moe_runner``: capability 8.0 up to 10.0);
- compressed-tensors NVFP4A16 (``CompressedTensorsW4A16Nvfp4MoE``) on every GPU from sm80, and W4A4 checkpoints
  below ``CompressedTensorsW4A4Nvfp4MoE``'s minimum capability (sm100), served weight-only (their input global
  scales deleted).

``prepare_moe_nvfp4_layer_for_marlin`` then holds, per expert, :func:`.moe_marlin.to_runtime`'s bytes with the
gated intermediate size not padded (SGLang pads only non-gated experts), no scale factor and no flush of the
smallest scales (``nvfp4_marlin_process_scales``), and w13 in the checkpoint's [gate; up] order;
``w13_weight_scale_2`` / ``w2_weight_scale_2``: bf16 ``[E]``, gate's multiplier (compressed-tensors: ``1 /
weight_global_scale``, in float32) cast to bf16 times ``2^(bias - 7)`` (``nvfp4_marlin_process_global_scale``);
ModelOpt keeps ``w13_input_scale`` ``[E_all, 2]`` and ``w2_input_scale`` ``[E_all]`` as loaded (1.0 where a
W4A16_NVFP4 checkpoint stores none). Engine data only: the layout math is :mod:`.moe_marlin`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Sequence

import torch

from ..errors import RepackError
from . import marlin, moe_marlin
from .base import Target, TensorSpec
from .engines import SGLANG_MARLIN_FAMILIES, SGLANG_MARLIN_MOE_LAYOUTS
from .moe import ExpertCodes, ExpertStack, stored_scales

DTYPE = torch.bfloat16  # SGLang's FP4 Marlin, dense and MoE: the models' activation dtype (params_dtype) on sm80 and up
NO_FACTORS = (1.0, 1.0)  # nvfp4_marlin_process_scales: no scale factor, no flush
METHODS = {("modelopt", "W4A4"): "ModelOptNvFp4FusedMoEMethod", ("modelopt", "W4A16"): "ModelOptNvFp4FusedMoEMethod",
           ("compressed-tensors", "W4A4"): "CompressedTensorsW4A16Nvfp4MoE",
           ("compressed-tensors", "W4A16"): "CompressedTensorsW4A16Nvfp4MoE"}
WEIGHTS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
SCALARS = ("w13_weight_scale_2", "w2_weight_scale_2")
# compressed-tensors' loaded parameters its weight-only MoE scheme deletes (the plugin too)
DELETED = ("w13_weight_global_scale", "w2_weight_global_scale", "w13_input_global_scale", "w2_input_global_scale")


def marlin_global_scale(multiplier: torch.Tensor) -> torch.Tensor:
    """bf16, one per multiplier (a dense layer's ``[1]``, an MoE layer's experts' ``[E]``):
    ``nvfp4_marlin_process_global_scale(multiplier.to(bf16))``; refused where bf16 overflows."""
    held = (multiplier.to(torch.float32).to(DTYPE) * marlin.global_exponent(DTYPE)).reshape(-1)
    if not torch.isfinite(held).all():
        raise RepackError(f"a multiplier of {float(multiplier.max()):g} overflows SGLang's bf16 Marlin global scale; "
                          "SGLang would hold inf")
    return held


@dataclass(frozen=True)
class MarlinMoELayout:
    """SGLang's FP4 Marlin state of an NVFP4 FusedMoE layer for one source format and checkpoint scheme: the interface
    of the MoE layout modules (``LAYOUT_ID``, ``BACKEND``: SGLang's MoE runner backend, ``KERNELS``: its quantization
    method, ``to_runtime``, ...)."""

    LAYOUT_ID: str
    BACKEND: str
    source_format: str
    scheme: str
    WEIGHT_ONLY, LAYER_SCALE_FACTOR, INVERSE_READS, TP_ALIGNMENT = True, False, (), 1
    NAMED = True  # SGLang's names and scalars (ModelOpt's input scales every expert's): moe.moe_specs, verify

    @property
    def KERNELS(self) -> tuple[str, ...]:  # noqa: N802 (the layout modules' name)
        return (METHODS[self.source_format, self.scheme],)

    @property
    def modelopt(self) -> bool:
        return self.source_format == "modelopt"

    @property
    def GATE_UP_REFUSAL(self) -> str:  # noqa: N802
        """Why experts whose gate and up multipliers differ are refused: SGLang's Marlin MoE holds one w13 global scale
        per expert (ModelOpt: gate's, with a warning; compressed-tensors refuses them)."""
        return ("SGLang 0.5.23's FP4 Marlin MoE holds one w13 global scale per expert ({gate}'s; compressed-tensors' "
                "loader refuses them) and would mis-scale {up}")

    @property
    def TENSORS(self) -> tuple[str, ...]:  # noqa: N802
        return tuple(self.runtime_specs(1, 128, 64))

    def aliases(self, hidden: int, intermediate: int) -> dict[str, str]:
        return {}

    def check_shape(self, experts: int, hidden: int, intermediate: int, name: str = "MoE layer") -> None:
        """SGLang's refusals, in one line: compressed-tensors' (hidden a multiple of 128, intermediate per rank of 64);
        ModelOpt's, ``gptq_marlin_repack``'s tiles (N a multiple of 64, K of 16: hidden of 64, intermediate of 32)."""
        if not self.modelopt and (hidden % 128 or intermediate % 64):
            raise RepackError(f"{name}: SGLang 0.5.23's NVFP4 Marlin MoE refuses this layer: hidden size {hidden} must "
                              f"be a multiple of 128 and intermediate size per rank {intermediate} of 64")
        if hidden % 64 or intermediate % 32:
            raise RepackError(f"{name}: SGLang 0.5.23's FP4 Marlin MoE refuses this layer: gptq_marlin_repack needs "
                              f"hidden size {hidden} a multiple of 64 and 2 x intermediate size per rank "
                              f"(2 x {intermediate}) of 64")

    def _scalars(self, stack: ExpertStack) -> dict[str, torch.Tensor]:
        w13_weight, w13_input, w2_weight, w2_input = stored_scales(stack)
        if not self.modelopt:  # stored as divisors: the multiplier is 1 / weight_global_scale, in float32
            return {"w13_weight_scale_2": marlin_global_scale(1 / w13_weight[:, 0]),
                    "w2_weight_scale_2": marlin_global_scale(1 / w2_weight)}
        out = {"w13_weight_scale_2": marlin_global_scale(w13_weight[:, 0]),
               "w2_weight_scale_2": marlin_global_scale(w2_weight)}
        return out | {"w13_input_scale": w13_input, "w2_input_scale": w2_input}

    def to_runtime(self, stack: ExpertStack, name: str = "MoE layer",
                   parts: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors SGLang holds on the FusedMoE module, by its names (``parts``: only these)."""
        self.check_shape(stack.experts, stack.hidden, stack.intermediate, name)
        parts = list(self.runtime_specs(stack.experts, stack.hidden, stack.intermediate)) if parts is None else parts
        weights = [p for p in parts if p in WEIGHTS]
        got = moe_marlin.to_runtime(stack, name, weights, DTYPE, padded=stack.intermediate, factors=NO_FACTORS)
        if len(weights) < len(parts):
            got |= self._scalars(stack)
        return {part: got[part] for part in parts}

    def codes_from_pieces(self, which: str, pieces: Sequence[tuple[torch.Tensor, ...]], hidden: int,
                          intermediate: int) -> torch.Tensor:
        return moe_marlin.codes_from_pieces(which, pieces, hidden, intermediate, padded=intermediate)

    def from_runtime(self, tensors: dict[str, torch.Tensor], hidden: int, intermediate: int) -> ExpertCodes:
        """Exact inverse of :meth:`to_runtime` on codes and block scales."""
        return moe_marlin.from_runtime(tensors, hidden, intermediate, DTYPE, padded=intermediate, factors=NO_FACTORS)

    def decode_expert(self, tensors: dict[str, torch.Tensor], expert: int, which: str, hidden: int,
                      intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's codes and float8_e4m3fn block scales, read by the Marlin index formulas (the S0E5M3 scales
        hold ``scale * 2^7``: no factor)."""
        codes, scales = moe_marlin.decode_expert(tensors, expert, which, hidden, intermediate, padded=intermediate)
        return codes, (scales * 2.0**-7).to(torch.float8_e4m3fn)

    def kernel_scalars(self, tensors: dict[str, torch.Tensor], expert: int,
                       which: str) -> tuple[tuple[torch.Tensor, ...], None]:
        """What SGLang's FP4 Marlin MoE kernel multiplies local expert ``expert``'s ``which`` (``w13``, ``w2``) by after
        :meth:`decode_expert`'s block scales: ``w*_weight_scale_2 / 2^(bias - 7)`` (float64), the multiplier rounded to
        bf16 (one for gate and up); no activation quantizer (weight-only)."""
        multiplier = tensors[f"{which}_weight_scale_2"][expert].double() / marlin.global_exponent(DTYPE)
        return (multiplier,) * (2 if which == "w13" else 1), None

    @staticmethod
    def read_as(stack: ExpertStack) -> ExpertStack:
        """``stack`` as the kernel reads it: its multipliers rounded to bf16 (``nvfp4_marlin_process_global_scale``;
        the block scales as they are: no flush)."""
        return replace(stack, w13_multiplier=stack.w13_multiplier.to(DTYPE).to(torch.float32),
                       w2_multiplier=stack.w2_multiplier.to(DTYPE).to(torch.float32))

    def runtime_specs(self, experts: int, hidden: int, intermediate: int,
                      num_experts: int | None = None) -> dict[str, TensorSpec]:
        """dtype and shape of every tensor a layer stores; ``num_experts``: the layer's (ModelOpt's input scales are
        every expert's)."""
        specs = moe_marlin.runtime_specs(experts, hidden, intermediate, padded=intermediate)
        out = {name: specs[name] for name in WEIGHTS} | {name: TensorSpec(DTYPE, (experts,)) for name in SCALARS}
        if self.modelopt:
            every = num_experts or experts
            out |= {"w13_input_scale": TensorSpec(torch.float32, (every, 2)),
                    "w2_input_scale": TensorSpec(torch.float32, (every,))}
        return out


def marlin_moe_variant(target: Target) -> MarlinMoELayout:
    """SGLang's FP4 Marlin MoE layout for a weight-only ``target`` (its ``moe_layout``: targets/sglang.py), or a one-line refusal
    where SGLang serves those experts otherwise (ModelOpt on sm100 / sm120: its auto is TRT-LLM-gen; W4A4
    compressed-tensors served weight-only on Blackwell: its W4A4 CUTLASS MoE)."""
    fmt, scheme = target.source_format, target.scheme
    if target.name not in SGLANG_MARLIN_FAMILIES and (fmt == "modelopt" or scheme == "W4A4"):
        raise RepackError(f"--engine sglang -t {target.name}: NVFP4 MoE layers served weight-only are not written for "
                          f"SGLang there (its auto serves these experts with FP4 Marlin on sm80-sm90 only"
                          + (", compressed-tensors NVFP4A16 everywhere)" if fmt == "compressed-tensors" else ")"))
    return MarlinMoELayout(SGLANG_MARLIN_MOE_LAYOUTS[fmt], "auto", fmt, scheme)
