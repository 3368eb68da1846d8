"""Which tensors a bundle holds, in which shard, with which dtype and shape: sizes only, no data.

Planning before writing means every problem a header can reveal is found before a byte is written,
and the streaming writer knows each shard's header up front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from huggingface_hub import split_state_dict_into_shards_factory

from ..errors import RepackError
from ..formats import SourceModel
from ..formats.moe import kept_scales
from ..formats.safetensors_io import DTYPE_NAMES
from ..formats.transforms import SourceMatrix, model_dtype
from ..targets import Target
from ..targets.moe import moe_layout, moe_specs
from .layers import ExpertPlan, LayerPlan, OutputLayer

SHARD_PATTERN = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor. ``layer`` and ``part`` for converted tensors (``experts`` and ``part`` for a FusedMoE
    layer's, ``part`` its vLLM parameter name); ``source_name`` for passthrough; ``matrix`` for an online-transform
    matrix."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    nbytes: int
    layer: OutputLayer | None = None
    part: str = ""
    source_name: str = ""
    matrix: SourceMatrix | None = None
    experts: ExpertPlan | None = None


@dataclass(frozen=True)
class BundlePlan:
    """Every output tensor of one bundle: by shard file (each in write order), and by source unit (a layer's
    prefix or a passthrough tensor's name: what one read of the source yields)."""

    target: Target
    layers: LayerPlan
    shards: dict[str, list[PlannedTensor]]
    units: dict[str, list[PlannedTensor]] = field(default_factory=dict)

    @cached_property
    def file_of(self) -> dict[str, str]:
        """Output tensor name -> its shard file."""
        return {t.name: file for file, tensors in self.shards.items() for t in tensors}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for tensors in self.shards.values() for t in tensors)

    @property
    def is_sharded(self) -> bool:
        return len(self.shards) > 1


def _layer_outputs(layer: OutputLayer, target: Target) -> list[PlannedTensor]:
    return [
        PlannedTensor(
            name=f"{layer.prefix}.{part}",
            dtype_name=DTYPE_NAMES[spec.dtype],
            shape=spec.shape,
            nbytes=spec.nbytes,
            layer=layer,
            part=part,
        )
        for part, spec in target.layer_specs(layer.n, layer.k, len(layer.pieces)).items()
    ]


def _expert_outputs(plan: ExpertPlan, target: Target) -> list[PlannedTensor]:
    """A FusedMoE layer's tensors in the family's MoE layout (a one-line refusal where it has none, or where vLLM
    refuses the layer's shape)."""
    layout, experts = moe_layout(target), plan.experts[1] - plan.experts[0]
    layout.check_shape(experts, plan.group.hidden, plan.intermediate, plan.prefix)
    specs = moe_specs(layout, experts, plan.group.hidden, plan.intermediate, plan.group.experts)
    return [PlannedTensor(name=f"{plan.module}.{part}", dtype_name=DTYPE_NAMES[spec.dtype], shape=spec.shape,
                          nbytes=spec.nbytes, part=part, experts=plan) for part, spec in specs.items()]


# Binary units first: "4GIB" must not be read as "4GI" bytes.
SIZE_UNITS = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
              "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}


def parse_size(size: int | str) -> int:
    """``5GB``, ``500MB``, ``1.5GB``, ``4GiB``, ``5000000B`` or an int byte count, as a positive number of bytes
    (KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB powers of 1024; any letter case).

    A string must name its unit: a bare ``5`` is far more likely a forgotten ``GB`` than five bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        text = str(size).strip().upper()
        unit = next((u for u in SIZE_UNITS if text.endswith(u)), "")
        try:
            number = float(text[: len(text) - len(unit)].strip()) if unit else math.nan
        except ValueError:
            number = math.nan
        value = int(number * SIZE_UNITS[unit]) if math.isfinite(number) else 0
    if value <= 0:
        raise RepackError(f"shard size {str(size)[:40]!r}: expected a positive size with a unit, such as 5GB, 500MB or 4GiB")
    return value


def unit_order(source: SourceModel, layers: LayerPlan | None = None) -> list[str]:
    """The order in which a pass reads the source's units and every bundle writes them: by name. ``layers``:
    a fused or rank plan's output layers instead of the source's."""
    prefixes = source.layers if layers is None else [*layers.layers, *layers.experts]
    kept = [] if layers is None else expert_scales(source, layers)
    return sorted({*prefixes, *source.passthrough, *kept, *source.transforms.matrices})


def expert_scales(source: SourceModel, layers: LayerPlan) -> list[str]:
    """The experts' source scales a bundle keeps as passthrough tensors (:func:`kept_scales`): its FusedMoE layers'
    experts' (under expert parallelism the rank's own), so that vLLM's own expert weight loader places them."""
    return [name for plan in layers.experts.values() for name in kept_scales(source, plan.group, plan.experts)]


def plan_bundle(source: SourceModel, target: Target, layers: LayerPlan, max_shard_size: int | str = "5GB") -> BundlePlan:
    """Assign every output tensor to a shard, in name order.

    A layer's parts are one unit for the splitter, so they always share a shard and are written one after
    another: the layer is converted once and only one converted layer is ever held in memory.
    """
    units: dict[str, list[PlannedTensor]] = {layer.prefix: _layer_outputs(layer, target) for layer in layers.layers.values()}
    units.update({module: _expert_outputs(plan, target) for module, plan in layers.experts.items()})
    names = {t.name: prefix for prefix, parts in units.items() for t in parts}
    kept = expert_scales(source, layers)
    consumed = {source.input_scale_name(p) for p in source.layers} - set(kept) if target.scheme == "W4A4" else set()
    for name in sorted({*(n for n in source.passthrough if n not in consumed), *kept}):
        entry = source.checkpoint.tensors[name]
        if name in names:
            raise RepackError(f"tensor {name!r} would collide with the converted layer {names[name]!r}")
        units[name] = [PlannedTensor(name, entry.dtype_name, entry.shape, entry.nbytes, source_name=name)]
    dtype = model_dtype(source.checkpoint.config)
    for name, matrix in source.transforms.matrices.items():
        if name in names or name in units:
            raise RepackError(f"transform matrix {name!r} would collide with a tensor of the same name")
        nbytes = matrix.size * matrix.size * dtype.itemsize
        units[name] = [PlannedTensor(name, DTYPE_NAMES[dtype], (matrix.size, matrix.size), nbytes, matrix=matrix)]
    max_bytes = parse_size(max_shard_size)
    ordered = {key: units[key] for key in unit_order(source, layers) if key in units}
    split = split_state_dict_into_shards_factory(
        ordered,
        get_storage_size=lambda parts: sum(t.nbytes for t in parts),
        filename_pattern=SHARD_PATTERN,
        max_shard_size=max_bytes,
    )
    # Each shard lists its units in the splitter's iteration order, i.e. unit_order: a pass in that order fills
    # every shard of every bundle front to back.
    shards = {file: [t for key in keys for t in ordered[key]] for file, keys in split.filename_to_tensors.items()}
    return BundlePlan(target=target, layers=layers, shards=shards, units=ordered)
