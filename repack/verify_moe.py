"""Per-expert exactness of a FusedMoE layer's runtime tensors against the source checkpoint.

The layout's inverse recovers every expert's codes and block scales, which must equal the source's (cut to the
rank's rows) bit for bit; the scalars vLLM folds (alphas, the shared input scale) are not invertible, so they are
recomputed from the source's and compared byte for byte, and so is the padding once the experts' data is exact.
A corrupted expert, two swapped experts or swapped w1/w3 halves each show up as a named expert and projection.
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

import torch

from .bundle.layers import ExpertPlan, assemble_experts, expert_input_scales, largest_expert_scales
from .formats import SourceModel
from .nvfp4 import E2M1_MAX, E4M3_MAX, NVFP4Weight, dequantize, dequantize_activations, quantize_activations


def _differs(a: torch.Tensor, b: torch.Tensor) -> list[bool]:
    """Per expert (dim 0): whether the bytes differ."""
    ne = a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)
    return ne.reshape(ne.shape[0], -1).any(dim=1).tolist()


CHECK_EXPERTS = 8  # experts compared at once: memory holds a few copies of that many, whatever the layer's size


def check_experts(source: SourceModel, plan: ExpertPlan, held: dict[str, torch.Tensor],
                  layout: ModuleType) -> list[str]:
    """Problems found in ``held`` (a FusedMoE layer's tensors by vLLM's names, in ``layout``: a MoE layout module),
    one line each; ``[]`` if exact. Every layout tensor is expert by expert: compared ``CHECK_EXPERTS`` at a time."""
    first, last = plan.experts
    specs = layout.runtime_specs(last - first, plan.group.hidden, plan.intermediate)
    wrong = [f"{plan.prefix}: {name} is {t.dtype} {list(t.shape)}, expected {specs[name].dtype} "
             f"{list(specs[name].shape)}" for name, t in held.items()
             if name in specs and (t.dtype, tuple(t.shape)) != (specs[name].dtype, specs[name].shape)]
    missing = [f"{plan.prefix}: {name} is missing" for name in specs if name not in held]
    if wrong or missing:
        return missing + wrong
    scales = expert_input_scales(source, plan)
    # Marlin: one scale factor per layer, from all of the rank's experts
    largest = largest_expert_scales(source, plan, CHECK_EXPERTS) if hasattr(layout, "largest_scales") else None
    problems = []
    for start in range(first, last, CHECK_EXPERTS):
        chunk = (start, min(start + CHECK_EXPERTS, last))
        part = {name: held[name][chunk[0] - first: chunk[1] - first] for name in specs}
        problems += _check_chunk(source, plan, chunk, part, layout, scales, largest)
    return problems


def _check_chunk(source: SourceModel, plan: ExpertPlan, chunk: tuple[int, int], held: dict[str, torch.Tensor],
                 layout: ModuleType, scales: tuple[torch.Tensor, torch.Tensor],
                 largest: tuple[float, float] | None = None) -> list[str]:
    """:func:`check_experts` on global experts ``[chunk)``, whose rows of the layer's tensors are ``held``."""
    source_stack = replace(assemble_experts(source, plan, chunk=chunk, input_scales=scales), largest_scales=largest)
    expected = layout.to_runtime(source_stack, plan.prefix)
    if hasattr(layout, "read_as"):  # the experts as the layout's kernel reads them (Marlin: flushed scales)
        source_stack = layout.read_as(source_stack)
    group, inter, offset = plan.group, plan.intermediate, chunk[0] - plan.experts[0]
    ours = layout.from_runtime(held, group.hidden, inter)
    halves = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
    checks = {proj: [(what, _differs(getattr(ours, f"w13_{what}")[:, rows],
                                     getattr(source_stack, f"w13_{what}")[:, rows]))
                     for what in ("codes", "scales")] for proj, rows in halves.items()}
    checks["down"] = [(what, _differs(getattr(ours, f"w2_{what}"), getattr(source_stack, f"w2_{what}")))
                      for what in ("codes", "scales")]
    local = slice(*chunk)
    names = {"gate": group.gate[local], "up": group.up[local], "down": group.down[local]}
    problems = []
    for e in range(len(names["gate"])):
        for proj, results in checks.items():
            problems += [f"{names[proj][e]}: {'codes' if what == 'codes' else 'block scales'} differ"
                         for what, bad in results if bad[e]]
    if not problems:  # the experts' data is exact: anything else that differs is padding
        problems += [f"{plan.prefix}: {name} differs outside the experts' data (padding)"
                     for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
                     if any(_differs(held[name], expected[name]))]
    scalars = [name for name in expected if held[name].dim() == 1]
    for name in scalars:
        bad = _differs(held[name].reshape(-1, 1), expected[name].reshape(-1, 1))
        problems += [f"{plan.prefix}: {name} differs (expert {offset + e})" for e, b in enumerate(bad) if b]
    return problems


EXPERT_REL_ERROR = 1e-6  # float32 products of the folded scalars, read back in float64: ~1e-7 measured
# W4A4: both sides quantize the activations with the kernel's quantizer, so only the weights, the alpha and the held
# input scale (the activation codes it gives) can differ: 6e-8 measured on the producer fixtures at TP 1 and 2; a
# wrong alpha, weight or input scale is >= 1e-3.
EXPERT_W4A4_REL_ERROR = EXPERT_REL_ERROR
# W4A4 activations are drawn with this standard deviation relative to the calibrated amax (4 sigma inside it), the
# range the input scale was calibrated for (standard normal ones saturate whole blocks of ModelOpt's down_proj).
CALIBRATED_STD = 0.25


def expert_numerics(source: SourceModel, plan: ExpertPlan, held: dict[str, torch.Tensor], layout: ModuleType,
                    experts: list[int], generator: torch.Generator, tokens: int = 8,
                    w4a4: bool = False) -> dict[str, float]:
    """Relative L2 error of ``x @ Wᵀ`` per sampled expert (indices among the plan's) and projection, the held side
    decoded by the layout's index formulas alone (``decode_expert``), against the float64 dequantized source, each
    projection with its own multiplier (so a w3 multiplier that differs from w1's, which vLLM drops, shows up).

    Weight-only (default): the held multiplier is read back as ``w*_weight_scale_2 / w*_input_scale``. ``w4a4``: as
    the FP4 x FP4 MoE GEMMs compute, bf16 ``x`` quantized as the GPU does (``quantize_activations``) with
    ``1 / w*_input_scale``, the product scaled by the held alpha ``w*_weight_scale_2``; the reference quantizes
    ``x`` the same way with ``1 / max`` of the source's input scales and multiplies in float64 (as dense verify's
    ``w4a4_products``: the format's float64 definition of the quantizer rounds apart from the kernel's float32 one
    on exact e4m3 ties, which calibrated scales make common, by a whole scale step), so a wrong held input scale
    (other activation codes) or alpha shows up as it would on the GPU, and nothing else does."""
    group, inter = plan.group, plan.intermediate
    input_scales = expert_input_scales(source, plan)
    errors = {}
    for e in experts:
        at = plan.experts[0] + e
        source_stack = assemble_experts(source, plan, chunk=(at, at + 1), input_scales=input_scales)  # it alone
        for which, projs in (("w13", ("gate", "up")), ("w2", ("down",))):
            codes, scales = layout.decode_expert(held, e, which, group.hidden, inter)
            ours = dequantize(NVFP4Weight(codes, scales, torch.ones(1)), torch.float64)
            if hasattr(layout, "expert_multiplier"):  # weight-only layouts without input scales (Marlin)
                alpha, a_scale = layout.expert_multiplier(held, e, which), torch.ones((), dtype=torch.float64)
            else:
                alpha, a_scale = held[f"{which}_weight_scale_2"][e], held[f"{which}_input_scale"][e]
            ref_codes = getattr(source_stack, f"{which}_codes")[0]
            ref_scales = getattr(source_stack, f"{which}_scales")[0]
            own = getattr(source_stack, f"{which}_multiplier")[0].reshape(-1)
            source_scale = getattr(source_stack, f"{which}_input_scale").max().to(torch.float32)
            source_gs = 1.0 / source_scale
            rows = ours.shape[0] // len(projs)
            for i, proj in enumerate(projs):
                part = slice(i * rows, (i + 1) * rows)
                ref = dequantize(NVFP4Weight(ref_codes[part], ref_scales[part], own[i].reshape(1)), torch.float64)
                x = torch.randn(tokens, ref.shape[1], generator=generator)
                if w4a4:  # activations in the range the scale was calibrated for (amax = 2688 x input scale)
                    x = (x * (CALIBRATED_STD * E2M1_MAX * E4M3_MAX) * source_scale.double()).to(torch.bfloat16)
                    x_codes, x_scales = quantize_activations(x, (1.0 / a_scale).reshape(1))
                    x_held = dequantize(NVFP4Weight(x_codes, x_scales, torch.ones(1)), torch.float64)
                    got = (x_held @ ours[part].T) * alpha.double()
                    want = dequantize_activations(*quantize_activations(x, source_gs.reshape(1)), source_gs) @ ref.T
                else:
                    x = x.double()
                    got = x @ ours[part].T * (alpha.double() / a_scale.double())
                    want = x @ ref.T
                error = (got - want).norm() / want.norm().clamp(min=1e-300)
                errors[getattr(group, proj)[plan.experts[0] + e]] = float(error)
    return errors
