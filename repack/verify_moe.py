"""Per-expert exactness of a FusedMoE layer's runtime tensors against the source checkpoint.

The layout's inverse recovers every expert's codes and block scales, which must equal the source's (cut to the
rank's rows) bit for bit; the scalars vLLM folds (alphas, the shared input scale) are not invertible, so they are
recomputed from the source's and compared byte for byte, and so is the padding once the experts' data is exact.
A corrupted expert, two swapped experts or swapped w1/w3 halves each show up as a named expert and projection.
"""

from __future__ import annotations

import torch

from types import ModuleType

from .bundle.layers import ExpertPlan, assemble_experts
from .formats import SourceModel
from .nvfp4 import NVFP4Weight, dequantize


def _differs(a: torch.Tensor, b: torch.Tensor) -> list[bool]:
    """Per expert (dim 0): whether the bytes differ."""
    ne = a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)
    return ne.reshape(ne.shape[0], -1).any(dim=1).tolist()


def check_experts(source: SourceModel, plan: ExpertPlan, held: dict[str, torch.Tensor],
                  layout: ModuleType) -> list[str]:
    """Problems found in ``held`` (a FusedMoE layer's tensors by vLLM's names, in ``layout``: a MoE layout module),
    one line each; ``[]`` if exact."""
    expected = layout.to_runtime(assemble_experts(source, plan), plan.prefix)
    wrong = [f"{plan.prefix}: {name} is {t.dtype} {list(t.shape)}, expected {expected[name].dtype} "
             f"{list(expected[name].shape)}" for name, t in held.items()
             if name in expected and (t.dtype, t.shape) != (expected[name].dtype, expected[name].shape)]
    missing = [f"{plan.prefix}: {name} is missing" for name in expected if name not in held]
    if wrong or missing:
        return missing + wrong
    group, inter = plan.group, plan.intermediate
    ours = layout.from_runtime(held, group.hidden, inter)
    source_stack = assemble_experts(source, plan)
    halves = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
    checks = {proj: [(what, _differs(getattr(ours, f"w13_{what}")[:, rows],
                                     getattr(source_stack, f"w13_{what}")[:, rows]))
                     for what in ("codes", "scales")] for proj, rows in halves.items()}
    checks["down"] = [(what, _differs(getattr(ours, f"w2_{what}"), getattr(source_stack, f"w2_{what}")))
                      for what in ("codes", "scales")]
    local = slice(*plan.experts)
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
        problems += [f"{plan.prefix}: {name} differs (expert {e})" for e, b in enumerate(bad) if b]
    return problems


EXPERT_REL_ERROR = 1e-6  # float32 products of the folded scalars, read back in float64: ~1e-7 measured


def expert_numerics(source: SourceModel, plan: ExpertPlan, held: dict[str, torch.Tensor], layout: ModuleType,
                    experts: list[int], generator: torch.Generator, tokens: int = 8) -> dict[str, float]:
    """Relative L2 error of ``x @ Wᵀ`` per sampled expert (indices among the plan's) and projection: ``W``
    decoded from ``held`` by the layout's index formulas alone (``decode_expert``), its multiplier read back from
    the folded scalars (``w*_weight_scale_2 / w*_input_scale``), against the float64 dequantized source, each
    projection with its own multiplier (so a w3 multiplier that differs from w1's, which vLLM drops, shows up)."""
    group, inter = plan.group, plan.intermediate
    source_stack = assemble_experts(source, plan)
    errors = {}
    for e in experts:
        for which, projs in (("w13", ("gate", "up")), ("w2", ("down",))):
            codes, scales = layout.decode_expert(held, e, which, group.hidden, inter)
            multiplier = held[f"{which}_weight_scale_2"][e].double() / held[f"{which}_input_scale"][e].double()
            ours = dequantize(NVFP4Weight(codes, scales, torch.ones(1)), torch.float64) * multiplier
            ref_codes = getattr(source_stack, f"{which}_codes")[e]
            ref_scales = getattr(source_stack, f"{which}_scales")[e]
            own = getattr(source_stack, f"{which}_multiplier")[e].reshape(-1)
            rows = ours.shape[0] // len(projs)
            for i, proj in enumerate(projs):
                part = slice(i * rows, (i + 1) * rows)
                ref = dequantize(NVFP4Weight(ref_codes[part], ref_scales[part], own[i].reshape(1)), torch.float64)
                x = torch.randn(tokens, ref.shape[1], generator=generator, dtype=torch.float64)
                want = x @ ref.T
                got = x @ ours[part].T
                error = (got - want).norm() / want.norm().clamp(min=1e-300)
                errors[getattr(group, proj)[plan.experts[0] + e]] = float(error)
    return errors
