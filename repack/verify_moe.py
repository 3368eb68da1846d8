"""Per-expert exactness of a FusedMoE layer's runtime tensors against the source checkpoint.

The layout's inverse recovers every expert's codes and block scales, which must equal the source's (cut to the
rank's rows) bit for bit; the scalars vLLM folds (alphas, the shared input scale) are not invertible, so they are
recomputed from the source's and compared byte for byte, and so is the padding once the experts' data is exact.
A corrupted expert, two swapped experts or swapped w1/w3 halves each show up as a named expert and projection.
Numerics then compute sampled experts from the held tensors read by the layout's index formulas, scaled as the
engine's kernel reads them (vLLM's folded alphas; SGLang's names and scalars: its layouts' ``kernel_scalars``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Callable, Mapping

import torch

from .bundle.layers import ExpertPlan, assemble_experts, expert_input_scales, expert_multipliers, largest_expert_scales
from .formats import SourceModel
from .nvfp4 import (BLOCK_SIZE, E2M1_MAX, E4M3_MAX, NVFP4Weight, dequantize, dequantize_activations,
                    dequantized_products, quantize_activations)
from .targets.moe import MADE_FROM, ExpertStack


def _differs(a: torch.Tensor, b: torch.Tensor) -> list[bool]:
    """Per expert (dim 0): whether the bytes differ."""
    ne = a.contiguous().reshape(len(a), -1).view(torch.uint8) != b.contiguous().reshape(len(b), -1).view(torch.uint8)
    return ne.any(dim=1).tolist()


CHECK_EXPERTS = 8  # experts compared at once, at most: memory holds a few copies of that many (each side's codes,
CHECK_BYTES = 48 << 20  # decode, layout and comparison) ... and at most this many bytes of held weights (a
# DeepSeek-R1 expert holds 24.8 MB: two at a time), so that verify's memory stays bounded whatever an expert's size

RowsOf = Callable[[str, int, int], torch.Tensor]  # a held tensor's rows (local experts) [first, last), by its name


def rows_of(held: Mapping[str, torch.Tensor]) -> RowsOf:
    """Rows of tensors already in memory (a large bundle's are read a chunk of experts at a time instead)."""
    return lambda name, first, last: held[name][first:last]


@dataclass(frozen=True)
class ExpertFindings:
    """What :func:`expert_findings` found: one line per problem, and the local experts whose scalars stand out
    (held scalars other than the source's, or gate and up multipliers that differ in the source), which a
    sampled numerics check must always include."""

    problems: list[str]
    odd: set[int]


def check_experts(source: SourceModel, plan: ExpertPlan, held: Mapping[str, torch.Tensor] | RowsOf,
                  layout: ModuleType) -> list[str]:
    """Problems found in ``held`` (a FusedMoE layer's tensors by vLLM's names, in ``layout``: a MoE layout module),
    one line each; ``[]`` if exact. See :func:`expert_findings`."""
    return expert_findings(source, plan, held, layout).problems


def expert_findings(source: SourceModel, plan: ExpertPlan, held: Mapping[str, torch.Tensor] | RowsOf,
                    layout: ModuleType) -> ExpertFindings:
    """Every expert's scalars (each recomputed from the source, whole layer at once: a few floats per expert), then
    its codes and block scales, ``CHECK_EXPERTS`` experts at a time. ``held``: the tensors, or (a large layer) a
    function giving rows of them, whose dtypes and shapes the caller has checked."""
    first, last = plan.experts
    specs = layout.runtime_specs(last - first, plan.group.hidden, plan.intermediate)
    if not callable(held):
        wrong = [f"{plan.prefix}: {name} is {t.dtype} {list(t.shape)}, expected {specs[name].dtype} "
                 f"{list(specs[name].shape)}" for name, t in held.items()
                 if name in specs and (t.dtype, tuple(t.shape)) != (specs[name].dtype, specs[name].shape)]
        missing = [f"{plan.prefix}: {name} is missing" for name in specs if name not in held]
        if wrong or missing:
            return ExpertFindings(missing + wrong, set())
        held = rows_of(held)
    scales = expert_input_scales(source, plan)
    # Marlin: one scale factor per layer, from the largest block scales of all of the rank's experts
    largest = largest_expert_scales(source, plan, layout, CHECK_EXPERTS)
    problems, odd = _check_scalars(source, plan, held, layout, scales, largest)
    weights = [name for name in specs if name in MADE_FROM]
    per_expert = sum(math.prod(specs[name].shape[1:]) * specs[name].dtype.itemsize for name in weights)
    step = max(1, min(CHECK_EXPERTS, CHECK_BYTES // max(1, per_expert)))
    for start in range(first, last, step):
        chunk = (start, min(start + step, last))
        part = {name: held(name, chunk[0] - first, chunk[1] - first)
                for name in (*weights, *layout.INVERSE_READS)}  # Marlin: what gives its factor
        problems += _check_chunk(source, plan, chunk, part, layout, scales, largest)
    return ExpertFindings(problems, odd)


def scalar_names(layout: ModuleType) -> list[str]:
    """The layout's per-expert scalars (float32 ``[E]``): the folded alphas and input scales (sm100: ``g1_scale_c``)."""
    return [name for name, spec in layout.runtime_specs(1, BLOCK_SIZE, BLOCK_SIZE).items() if len(spec.shape) == 1]


def engine_expert_findings(source: SourceModel, plan: ExpertPlan, held: Mapping[str, torch.Tensor],
                           weight_rows: RowsOf, layout: ModuleType) -> ExpertFindings:
    """Exactness of another engine's FusedMoE layer (SGLang's: its names, its loaded scales kept, its own scalars):
    every non-weight tensor (``held``) against the one the layout makes from the source's stored scales, byte for
    byte, then the experts' codes, block scales and padding (``weight_rows``), ``CHECK_EXPERTS`` at a time, as for
    vLLM's layouts, and the first and last expert once more read by the layout's index formulas alone
    (``decode_expert``, independent of its inverse). The problems, one line each, and the local experts whose
    scalars stand out (a row of a per-expert tensor other than the source gives, gate and up multipliers that differ:
    SGLang's TRT-LLM-gen holds both), which sampled numerics always run."""
    first, last = plan.experts
    plan = replace(plan, stored=True)
    multipliers, expected = _engine_expected(source, plan, layout, list(held))
    problems = [f"{plan.prefix}: {name} is not what SGLang computes from the source's scales"
                for name, tensor in held.items() if _differs_whole(tensor, expected[name])]
    odd = set((multipliers[:, 0] != multipliers[:, 1]).nonzero().flatten().tolist())
    for name, tensor in held.items():  # the rows of the tensors with one per local expert
        if tensor.dim() and tensor.shape[0] == last - first and tensor.shape == expected[name].shape:
            odd |= {e for e, bad in enumerate(_differs(tensor, expected[name])) if bad}
    weights = _weight_names(layout, plan)
    scales = expert_input_scales(source, plan)
    for start in range(first, last, CHECK_EXPERTS):
        chunk = (start, min(start + CHECK_EXPERTS, last))
        part = {name: weight_rows(name, chunk[0] - first, chunk[1] - first) for name in weights}
        problems += _check_chunk(source, plan, chunk, part, layout, scales)
    for e in sorted({0, last - first - 1}):
        one = {name: weight_rows(name, e, e + 1) for name in weights}
        stack = assemble_experts(source, plan, chunk=(first + e, first + e + 1), input_scales=scales)
        for which, projs in (("w13", (plan.group.gate, plan.group.up)), ("w2", (plan.group.down,))):
            codes, block = layout.decode_expert(one, 0, which, plan.group.hidden, plan.intermediate)
            if _differs_whole(codes, getattr(stack, f"{which}_codes")[0]) or _differs_whole(
                    block, getattr(stack, f"{which}_scales")[0]):
                problems.append(f"{'/'.join(p[first + e] for p in projs)}: codes or block scales read by the "
                                f"{layout.LAYOUT_ID} index formulas differ from the source's")
    return ExpertFindings(problems, odd)


def _engine_expected(source: SourceModel, plan: ExpertPlan, layout: ModuleType,
                     names: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The experts' gate and up multipliers (float32 ``[E, 2]``) and the non-weight tensors ``names`` as the engine
    computes them from the source's stored scales."""
    stack = assemble_experts(source, replace(plan, stored=True), fields=("multipliers",))
    return stack.w13_multiplier, layout.to_runtime(stack, plan.prefix, names)


def _weight_names(layout: ModuleType, plan: ExpertPlan) -> list[str]:
    """The layer's weight tensors (codes and block scales: ``MADE_FROM``) the layout stores."""
    first, last = plan.experts
    return [name for name in layout.runtime_specs(last - first, plan.group.hidden, plan.intermediate)
            if name in MADE_FROM]


def _differs_whole(held: torch.Tensor, want: torch.Tensor) -> bool:
    return held.dtype != want.dtype or held.shape != want.shape or not torch.equal(
        held.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))


def _check_scalars(source: SourceModel, plan: ExpertPlan, held: RowsOf, layout: ModuleType,
                   scales: tuple[torch.Tensor, torch.Tensor],
                   largest: tuple[float, float] | None = None) -> tuple[list[str], set[int]]:
    """Every expert's held scalars against the ones recomputed from the source's multipliers and input scales, and
    its gate and up multipliers against each other: vLLM keeps gate's (w1's) for both halves, so an expert whose up
    multiplier differs, not ``--rescale``d, computes another function than the source whatever the bundle holds.
    Returns the problems, each naming the expert, and the local experts that stood out."""
    group, (first, last) = plan.group, plan.experts
    names = scalar_names(layout)
    stack = assemble_experts(source, plan, fields=("multipliers",), input_scales=scales)
    expected = layout.to_runtime(replace(stack, largest_scales=largest), plan.prefix, names)
    local = slice(first, last)
    own = torch.stack([expert_multipliers(source, p[local]) for p in (group.gate, group.up)], 1)
    unequal = (own[:, 0] != own[:, 1]).nonzero().flatten().tolist()
    odd = set(unequal)
    problems = [] if plan.rescale else [
        f"{group.up[first + e]}: global scale multiplier {float(own[e, 1]):.9g} differs from "
        f"{group.gate[first + e].rpartition('.')[2]}'s {float(own[e, 0]):.9g}, which the bundle holds for both halves "
        "(vLLM keeps w1's); convert with --rescale" for e in unequal]
    for name in names:
        values, want = held(name, 0, last - first).reshape(-1), expected[name].reshape(-1)
        for e in (values.view(torch.int32) != want.view(torch.int32)).nonzero().flatten().tolist():
            odd.add(e)
            problems.append(f"{group.prefix}.{first + e}: {name} is {float(values[e]):.9g}, the source gives "
                            f"{float(want[e]):.9g}")
    return problems, odd


def _check_chunk(source: SourceModel, plan: ExpertPlan, chunk: tuple[int, int], held: dict[str, torch.Tensor],
                 layout: ModuleType, scales: tuple[torch.Tensor, torch.Tensor],
                 largest: tuple[float, float] | None = None) -> list[str]:
    """Codes, block scales and padding of global experts ``[chunk)``, whose rows of the layer's weight tensors
    are ``held`` (compared with the source's as the layout's kernel reads them: Marlin flushes its smallest
    scales)."""
    stack = replace(assemble_experts(source, plan, chunk=chunk, input_scales=scales), largest_scales=largest)
    source_stack = stack if layout.read_as is None else layout.read_as(stack)
    group, inter = plan.group, plan.intermediate
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
        del ours, checks
        problems += [f"{plan.prefix}: {name} differs outside the experts' data (padding)" for name in held
                     if any(_differs(held[name], layout.to_runtime(stack, plan.prefix, [name])[name]))]
    return problems


EXPERT_REL_ERROR = 1e-6  # float32 products of the folded scalars, read back in float64: ~1e-7 measured
# W4A4: both sides quantize the activations with the kernel's quantizer, so only the weights, the alpha and the held
# input scale (the activation codes it gives) can differ: 6e-8 measured on the producer fixtures at TP 1 and 2; a
# wrong alpha, weight or input scale is >= 1e-3.
EXPERT_W4A4_REL_ERROR = EXPERT_REL_ERROR
# W4A4 activations are drawn with this standard deviation relative to the calibrated amax (4 sigma inside it), the
# range the input scale was calibrated for (standard normal ones saturate whole blocks of ModelOpt's down_proj).
CALIBRATED_STD = 0.25


# One expert as its layer's kernel reads it: ``{"w13" | "w2": (codes, block scales read by the layout's index formulas
# (decode_expert), each projection's alpha (gate and up; down), the global scale its activations are quantized with
# (None: weight-only: the alpha is the weight's multiplier))}``, by the local expert's index.
KernelRead = Callable[[int], dict[str, tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]]]
# (the expert's source stack, its local index, "w13" | "w2") -> (the largest activation scale it is quantized for, the
# quantizer global scale the float64 reference quantizes the same activations with)
SourceQuantizer = Callable[[ExpertStack, int, str], tuple[torch.Tensor, torch.Tensor]]
PROJECTIONS = (("w13", ("gate", "up")), ("w2", ("down",)))


def expert_numerics(source: SourceModel, plan: ExpertPlan, held: Mapping[str, torch.Tensor] | RowsOf,
                    layout: ModuleType, experts: list[int], generator: torch.Generator, tokens: int = 8,
                    w4a4: bool = False) -> dict[str, float]:
    """Relative L2 error of ``x @ Wᵀ`` per sampled expert (indices among the plan's) and projection, the held side
    decoded by the layout's index formulas alone (``decode_expert``), against the float64 dequantized source (as the
    layout's kernel reads it: Marlin's ``read_as``), each
    projection with its own multiplier (so a w3 multiplier that differs from w1's, which vLLM drops, shows up).

    Weight-only (default): the held multiplier is read back as ``w*_weight_scale_2 / w*_input_scale``. ``w4a4``: as
    the FP4 x FP4 MoE GEMMs compute, bf16 ``x`` quantized as the GPU does (``quantize_activations``) with
    ``1 / w*_input_scale``, the product scaled by the held alpha ``w*_weight_scale_2``; the reference quantizes
    ``x`` the same way with ``1 / max`` of the source's input scales and multiplies in float64 (as dense verify's
    ``w4a4_products``: the format's float64 definition of the quantizer rounds apart from the kernel's float32 one
    on exact e4m3 ties, which calibrated scales make common, by a whole scale step), so a wrong held input scale
    (other activation codes) or alpha shows up as it would on the GPU, and nothing else does. ``held``: the tensors
    or a function giving rows of them (one expert's are read at a time)."""
    rows_held = held if callable(held) else rows_of(held)
    group, inter, weight_only = plan.group, plan.intermediate, layout.WEIGHT_ONLY  # Marlin: its own multiplier
    parts = ("weight", "weight_scale", "weight_scale_2", "input_scale")[:3 if weight_only else 4]

    def read(e: int) -> dict:
        out = {}
        for which, projs in PROJECTIONS:
            one = {f"{which}_{part}": rows_held(f"{which}_{part}", e, e + 1) for part in parts}
            codes, scales = layout.decode_expert(one, 0, which, group.hidden, inter)
            if weight_only:
                alpha, gs = layout.expert_multiplier(one, 0, which), None
            elif not w4a4:  # a W4A4 layout's multiplier, read back from its alpha and input scale
                alpha, gs = one[f"{which}_weight_scale_2"][0].double() / one[f"{which}_input_scale"][0].double(), None
            else:
                alpha, gs = one[f"{which}_weight_scale_2"][0], 1.0 / one[f"{which}_input_scale"][0]
            out[which] = (codes, scales, (alpha,) * len(projs), gs)
        return out

    def quantizer(stack: ExpertStack, e: int, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        scale = getattr(stack, f"{which}_input_scale").max().to(torch.float32)  # the largest the layer holds
        return scale, 1.0 / scale

    return _expert_numerics(source, plan, layout, experts, generator, tokens, w4a4, read, quantizer)


def engine_expert_numerics(source: SourceModel, plan: ExpertPlan, held: Mapping[str, torch.Tensor],
                           weight_rows: RowsOf, layout: ModuleType, experts: list[int], generator: torch.Generator,
                           tokens: int = 8) -> dict[str, float]:
    """:func:`expert_numerics` of another engine's FusedMoE layer (SGLang's: its names and scalars): each sampled
    expert's weights read by the layout's index formulas (``decode_expert``) from ``weight_rows``, scaled by what the
    engine's kernel reads from ``held`` (its non-weight tensors: ``layout.kernel_scalars``: each projection's alpha and
    the activations' quantizer global scale), FP4 x FP4 (or weight-only, ``layout.WEIGHT_ONLY``), against the float64
    source quantizing the same activations with the global scale the engine computes from the source's scales (as
    exactness restates it: the engine's own rule for whose input scales count)."""
    expected = _engine_expected(source, plan, layout, list(held))[1]
    weights = _weight_names(layout, plan)

    def read(e: int) -> dict:
        one = {name: weight_rows(name, e, e + 1) for name in weights}
        return {which: (*layout.decode_expert(one, 0, which, plan.group.hidden, plan.intermediate),
                        *layout.kernel_scalars(held, e, which)) for which, _ in PROJECTIONS}

    def quantizer(stack: ExpertStack, e: int, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        gs = layout.kernel_scalars(expected, e, which)[1].to(torch.float32)
        return 1.0 / gs, gs

    return _expert_numerics(source, plan, layout, experts, generator, tokens, not layout.WEIGHT_ONLY, read, quantizer)


def _expert_numerics(source: SourceModel, plan: ExpertPlan, layout: ModuleType, experts: list[int],
                     generator: torch.Generator, tokens: int, w4a4: bool, read: KernelRead,
                     quantizer: SourceQuantizer) -> dict[str, float]:
    """The error of each sampled expert's projections as ``read`` gives them, against the float64 source (as the
    layout's kernel reads it: ``layout.read_as``, where it is not None), activations quantized for FP4 x FP4 (``w4a4``)
    with the held global scale and, in the reference, ``quantizer``'s (see :func:`expert_numerics`)."""
    group = plan.group
    input_scales = expert_input_scales(source, plan)
    largest = largest_expert_scales(source, plan, layout, CHECK_EXPERTS)  # Marlin: the layer's one scale factor
    errors = {}
    for e in experts:
        at = plan.experts[0] + e
        source_stack = assemble_experts(source, plan, chunk=(at, at + 1), input_scales=input_scales)  # it alone
        if layout.read_as is not None:  # as the kernel reads it: vLLM's Marlin flushes the scales below its
            # factor's range, SGLang's rounds the multipliers to bf16
            source_stack = layout.read_as(replace(source_stack, largest_scales=largest))
        held = read(e)
        for which, projs in PROJECTIONS:
            codes, scales, alphas, gs = held[which]
            ref_codes = getattr(source_stack, f"{which}_codes")[0]
            ref_scales = getattr(source_stack, f"{which}_scales")[0]
            own = getattr(source_stack, f"{which}_multiplier")[0].reshape(-1)
            rows = codes.shape[0] // len(projs)
            for i, proj in enumerate(projs):
                part = slice(i * rows, (i + 1) * rows)
                ours = NVFP4Weight(codes[part], scales[part], torch.ones(1))  # both dequantized a block at a time
                ref = NVFP4Weight(ref_codes[part], ref_scales[part], own[i].reshape(1))
                x = torch.randn(tokens, ref.k, generator=generator)
                if w4a4:  # activations in the range the scale was calibrated for (amax = 2688 x input scale)
                    source_scale, source_gs = quantizer(source_stack, e, which)
                    x = (x * (CALIBRATED_STD * E2M1_MAX * E4M3_MAX) * source_scale.double()).to(torch.bfloat16)
                    x_codes, x_scales = quantize_activations(x, gs.reshape(1))
                    x_held = dequantize(NVFP4Weight(x_codes, x_scales, torch.ones(1)), torch.float64)
                    got = dequantized_products(x_held, ours) * alphas[i].double()
                    want = dequantized_products(
                        dequantize_activations(*quantize_activations(x, source_gs.reshape(1)), source_gs), ref)
                else:
                    x = x.double()
                    got = dequantized_products(x, ours) * alphas[i].double()
                    want = dequantized_products(x, ref)
                error = (got - want).norm() / want.norm().clamp(min=1e-300)
                errors[getattr(group, proj)[at]] = float(error)
    return errors
