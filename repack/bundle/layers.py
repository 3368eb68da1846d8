"""Which source slices make each output layer: the source's own layers, vLLM's fused modules, TP ranks.

Planning only: names and index ranges from the headers and config.json, plus the 4-byte global scales
(read up front so that unequal partitions are refused before anything is written). The data path
(:func:`assemble`) cuts the source tensors along these ranges and concatenates them along N; the result
goes through the target's one transform, so fusion and sharding never touch layout code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..errors import RepackError
from ..formats import QuantizedLayer, SourceModel
from ..formats.moe import (
    GLOBAL_INPUT_SCALES,
    MOE_ARCHITECTURES,
    ExpertGroup,
    architecture,
    expert_groups,
    read_input_scales,
)
from ..formats.safetensors_io import TensorEntry, read_tensor
from ..formats.transforms import HADAMARD_TYPES, LayerTransform, SourceMatrix, SourceTransforms
from ..nvfp4 import BLOCK_SIZE, InputScale, NVFP4Weight, check_block_scales, dequantize
from ..targets.layout import round_up
from ..targets.moe import VLLM_GATE_UP, ExpertStack

# vLLM 0.33.0's packed_modules_mapping, identical for these classes (checked in their model files).
VLLM_FUSION: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# vLLM 0.33.0's deepseek_v2.py and qwen2_moe.py: the shared experts are a dense MLP of their own (DeepseekV2MLP at
# mlp.shared_experts, Qwen2MoeMLP at mlp.shared_expert), fused and split as the dense one (DeepSeek-V3's
# first_k_dense_replace layers and Qwen2-MoE's mlp_only_layers fuse by VLLM_FUSION).
ARCHITECTURE_FUSION: dict[str, dict[str, tuple[str, ...]]] = {
    "DeepseekV3ForCausalLM": {"shared_experts.gate_up_proj": ("shared_experts.gate_proj", "shared_experts.up_proj")},
    "Qwen2MoeForCausalLM": {"shared_expert.gate_up_proj": ("shared_expert.gate_proj", "shared_expert.up_proj")},
}
# Its MLA projections: vLLM fuses q_a_proj + kv_a_proj_with_mqa into fused_qkv_a_proj held whole on every rank
# (disable_tp) and dequantizes kv_b_proj at load for its attention kernels; not planned (NVFP4 MLA is refused).
MLA_PROJECTIONS = ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "self_attn.kv_b_proj")
FUSABLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# split along K; every other fused layer along N
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj", "shared_experts.down_proj", "shared_expert.down_proj")


@dataclass(frozen=True)
class Piece:
    """Rows ``[rows)`` and columns ``[cols)`` (elements) of source layer ``source``; ``scale_ratio`` is folded
    into its block scales (1.0 unless ``--rescale`` had to equalise a fused layer's global scales)."""

    source: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    scale_ratio: float = 1.0


@dataclass(frozen=True)
class OutputLayer:
    """One bundle layer: its pieces stacked along N, in order; ``input_scale``: a W4A4 plan's activation global
    scale, the one vLLM keeps for the module (its partitions' by the format's rule)."""

    prefix: str
    pieces: tuple[Piece, ...]
    input_scale: InputScale | None = None
    partition_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # NVFP4Weight.partition_scales (SGLang)

    @property
    def n(self) -> int:
        return sum(p.rows[1] - p.rows[0] for p in self.pieces)

    @property
    def k(self) -> int:
        return self.pieces[0].cols[1] - self.pieces[0].cols[0]


@dataclass(frozen=True)
class LayerPlan:
    """The layers of one bundle: a whole model (``tp_size`` 1) or one tensor-parallel rank; ``experts``: its FusedMoE
    layers by vLLM's module name (``ep``: placed by expert parallelism)."""

    layers: dict[str, OutputLayer]
    fusion: dict[str, list[str]]
    tp_size: int = 1
    tp_rank: int = 0
    experts: dict[str, "ExpertPlan"] = field(default_factory=dict)
    ep: bool = False


def whole_piece(layer: QuantizedLayer) -> Piece:
    """All of ``layer``: what an unfused, unsharded output layer is made of."""
    return Piece(layer.prefix, (0, layer.n), (0, layer.k))


def _check_architecture(config: dict) -> None:
    """A one-line refusal of an architecture whose fused modules (dense) or FusedMoE layers vLLM 0.33 was not
    checked to hold as planned here."""
    supported = (*FUSABLE_ARCHITECTURES, *MOE_ARCHITECTURES)
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in supported:
        what = f"architecture {archs[0] if archs else 'unknown'!r}"
        raise RepackError(f"--fuse/--tp: {what} is not supported; supported: {', '.join(supported)}")


def vllm_fusion(config: dict) -> dict[str, tuple[str, ...]]:
    """vLLM's fused modules for the checkpoint's architecture: ``{fused: its partitions}`` (``VLLM_FUSION``, plus
    what ``ARCHITECTURE_FUSION`` adds)."""
    return {**VLLM_FUSION, **ARCHITECTURE_FUSION.get(architecture(config), {})}


def _fused_groups(source: SourceModel) -> tuple[dict[str, list[QuantizedLayer]], list[QuantizedLayer]]:
    """``{fused prefix: its source layers in vLLM's order}`` and the layers that stay as they are."""
    fusion = vllm_fusion(source.checkpoint.config)
    members = {m: fused for fused, parts in fusion.items() for m in parts}
    found: dict[tuple[str, str], dict[str, QuantizedLayer]] = {}
    alone = []
    for prefix, layer in source.layers.items():
        owner, module = _split_owner(prefix)
        if module in MLA_PROJECTIONS:
            raise RepackError(f"--fuse/--tp: {prefix} is NVFP4; MLA attention is supported unquantized only (vLLM "
                              "fuses q_a_proj with kv_a_proj_with_mqa unsharded and dequantizes kv_b_proj at load)")
        if module in members:
            found.setdefault((owner, members[module]), {})[module] = layer
        else:
            alone.append(layer)
    groups = {}
    for (owner, fused), have in found.items():
        missing = [m for m in fusion[fused] if m not in have]
        if missing:
            raise RepackError(f"{owner}.{fused}: cannot fuse, {owner}.{missing[0]} is not an NVFP4 layer of the source")
        parts = [have[m] for m in fusion[fused]]
        if len({p.k for p in parts}) != 1:
            raise RepackError(f"{owner}.{fused}: cannot fuse, its partitions have different K")
        groups[f"{owner}.{fused}"] = parts
    return groups, alone


def _split_owner(prefix: str) -> tuple[str, str]:
    """``model.layers.0.self_attn.q_proj`` -> (``model.layers.0``, ``self_attn.q_proj``)."""
    head, _, name = prefix.rpartition(".")
    owner, _, block = head.rpartition(".")
    return owner, f"{block}.{name}"


def _unit_rows(units: int, size: int, tp: int, rank: int, what: str, replicate: bool) -> tuple[int, int]:
    """Rows of ``units`` blocks of ``size`` rows that rank ``rank`` holds: vLLM's split, or for k/v with fewer
    heads than ranks its ``num_kv_head_replicas`` (rank r holds head ``r // (tp / heads)``)."""
    if units % tp == 0:
        per = units // tp
        return rank * per * size, (rank + 1) * per * size
    if replicate and tp % units == 0:
        head = rank // (tp // units)
        return head * size, (head + 1) * size
    rule = f"divide {tp} or be a multiple of it" if replicate else f"be a multiple of {tp}"
    raise RepackError(f"--tp {tp}: {what} ({units}) must {rule}, as vLLM requires")


def _column_pieces(fused: str, layers: list[QuantizedLayer], config: dict, tp: int, rank: int) -> list[Piece]:
    if not fused.endswith("qkv_proj"):
        return [Piece(p.prefix, _unit_rows(p.n, 1, tp, rank, f"{p.prefix} N", False), (0, p.k)) for p in layers]
    q, k, v = layers
    heads = int(config.get("num_attention_heads", 0))
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or (config.get("hidden_size", 0) // max(heads, 1)))
    if heads <= 0 or q.n != heads * head_dim or k.n != v.n or k.n != kv_heads * head_dim:
        raise RepackError(
            f"{fused}: q/k/v rows {q.n}/{k.n}/{v.n} do not match config.json's {heads} heads, "
            f"{kv_heads} kv heads of size {head_dim}"
        )
    q_rows = _unit_rows(heads, head_dim, tp, rank, "num_attention_heads", False)
    kv_rows = _unit_rows(kv_heads, head_dim, tp, rank, "num_key_value_heads", True)
    return [Piece(q.prefix, q_rows, (0, q.k)), Piece(k.prefix, kv_rows, (0, k.k)), Piece(v.prefix, kv_rows, (0, v.k))]


def _row_piece(layer: QuantizedLayer, tp: int, rank: int) -> Piece:
    if layer.k % tp or (layer.k // tp) % BLOCK_SIZE:
        raise RepackError(
            f"--tp {tp}: {layer.prefix} K={layer.k} gives a per-rank K that is not a multiple of {BLOCK_SIZE} "
            "(vLLM refuses it for ModelOpt and builds wrong block scales for compressed-tensors)"
        )
    per = layer.k // tp
    return Piece(layer.prefix, (0, layer.n), (rank * per, (rank + 1) * per))


def _rank_layers(source: SourceModel, tp: int, rank: int) -> dict[str, OutputLayer]:
    groups, alone = _fused_groups(source)
    layers = {fused: OutputLayer(fused, tuple(_column_pieces(fused, parts, source.checkpoint.config, tp, rank)))
              for fused, parts in groups.items()}
    for layer in alone:
        if tp > 1 and not layer.prefix.endswith(ROW_PARALLEL):
            raise RepackError(f"--tp {tp}: {layer.prefix} is neither a fused module nor o_proj/down_proj; "
                              "cannot shard it")
        layers[layer.prefix] = OutputLayer(layer.prefix, (_row_piece(layer, tp, rank) if tp > 1 else whole_piece(layer),))
    return dict(sorted(layers.items()))


def _multipliers(source: SourceModel) -> dict[str, torch.Tensor]:
    return {p: source.scheme.to_multiplier(source.checkpoint.read(layer.tensor_names[2]).reshape(1))
            for p, layer in source.layers.items()}


def _equalise(layer: OutputLayer, multipliers: dict[str, torch.Tensor], rescale: bool) -> OutputLayer:
    """vLLM keeps one multiplier per fused layer and leaves block scales alone: partitions must agree, or
    (``rescale``) each folds ``own / max`` into its block scales so the layer takes the largest multiplier."""
    values = [multipliers[p.source] for p in layer.pieces]
    if all(torch.equal(v, values[0]) for v in values):
        return layer
    top = max(float(v) for v in values)
    if not rescale:
        low = min(layer.pieces, key=lambda p: float(multipliers[p.source]))
        raise RepackError(
            f"{layer.prefix}: partition global scales differ ({low.source} is {top / float(multipliers[low.source]):.6g}x "
            "smaller than the largest); vLLM would mis-scale it; pass --rescale to fold the ratios into the block scales"
        )
    pieces = tuple(Piece(p.source, p.rows, p.cols, float(multipliers[p.source]) / top) for p in layer.pieces)
    return OutputLayer(layer.prefix, pieces)


def with_input_scales(layers: dict[str, OutputLayer], source: SourceModel) -> dict[str, OutputLayer]:
    """Each layer with the activation global scale vLLM keeps for it: its source layer's, or for a fused module
    the one the format's rule picks from its partitions' (vLLM only warns when they differ: the partitions share
    one input, and ``alpha`` follows the kept scale, so the output is scaled right, only quantized on that
    scale's grid; --tp ranks keep the whole layer's scale, as vLLM's do)."""
    read = {p.source: source.read_input_scale(p.source) for layer in layers.values() for p in layer.pieces}
    return {prefix: replace(layer, input_scale=source.scheme.fuse_input_scales([read[p.source] for p in layer.pieces]))
            for prefix, layer in layers.items()}


def with_partition_scales(layers: dict[str, OutputLayer], source: SourceModel) -> dict[str, OutputLayer]:
    """Each layer with its pieces' weight and input global scales as the checkpoint stores them, float32 ``[P]``
    each, in piece order: what SGLang loads into a fused module's per-partition scalars (and keeps)."""
    def stored(name: str) -> torch.Tensor:
        return source.checkpoint.read(name).reshape(()).to(torch.float32)

    return {prefix: replace(layer, partition_scales=(
                torch.stack([stored(source.layers[p.source].tensor_names[2]) for p in layer.pieces]),
                torch.stack([stored(source.input_scale_name(p.source)) for p in layer.pieces])))
            for prefix, layer in layers.items()}


def plan_layers(source: SourceModel, *, fuse: bool = False, tp: int = 1, rescale: bool = False,
                input_scales: bool = False, ep: bool = False, partition_scales: bool = False,
                expert_scales: bool | None = None,
                moe_rank_alignment: int = 1, moe_gate_up: str | None = VLLM_GATE_UP) -> list[LayerPlan]:
    """One :class:`LayerPlan` per bundle to write: the source's layers as they are, or vLLM's fused modules,
    once or per tensor-parallel rank (``tp > 1`` implies fusion: vLLM's ranks hold fused modules), and for an MoE
    model its FusedMoE layers (``ep``: vLLM's expert parallelism, which needs ``tp > 1``).
    ``input_scales``: read each layer's activation global scale (for W4A4 layouts); ``partition_scales``: and its
    partitions' stored global scales (for SGLang's layouts); ``moe_rank_alignment``: :func:`plan_experts`';
    ``moe_gate_up``: why the MoE layout refuses experts whose gate and up multipliers differ (None: it holds both)."""
    if tp < 1:
        raise RepackError(f"--tp {tp}: expected a positive number of ranks")
    if ep and tp == 1:
        raise RepackError("--ep: expert parallelism places experts on --tp N ranks; give --tp N with N > 1")
    def scaled(layers: dict[str, OutputLayer]) -> dict[str, OutputLayer]:
        layers = with_input_scales(layers, source) if input_scales else layers
        return with_partition_scales(layers, source) if partition_scales else layers

    if not (fuse or tp > 1):
        return [LayerPlan(scaled({p: OutputLayer(p, (whole_piece(layer),)) for p, layer in source.layers.items()}), {})]
    _check_architecture(source.checkpoint.config)
    fusion = vllm_fusion(source.checkpoint.config)
    moe = expert_groups(source)
    if ep and not moe:
        raise RepackError("--ep: expert parallelism applies to MoE models; this one has no routed experts")
    members = {m for group in moe.values() for m in group.members}
    dense = {p: layer for p, layer in source.layers.items() if p not in members}
    if source.transforms.layers:
        _check_vllm_transforms(source.transforms, tp)
    dense_source = replace(source, layers=dense)  # the experts are the FusedMoE layers'
    unequal = {prefix: _unequal_gate_up(source, group, rescale, moe_gate_up) for prefix, group in moe.items()}
    multipliers = _multipliers(dense_source)
    plans = []
    for rank in range(tp):
        layers = {p: _equalise(layer, multipliers, rescale)
                  for p, layer in _rank_layers(dense_source, tp, rank).items()}
        for layer in layers.values():
            layer_transforms(source.transforms, layer)  # refused here, before anything is written
        experts = {plan.module: replace(plan, rescale=bool(unequal[prefix][slice(*plan.experts)].any()))
                   for prefix, plan in plan_experts(source, tp, rank, ep,
                                                 partition_scales if expert_scales is None else expert_scales,
                                                 moe_rank_alignment).items()
                   } if moe else {}
        plans.append(LayerPlan(scaled(layers), {fused: list(parts) for fused, parts in fusion.items()}, tp, rank,
                               experts, ep))
    return plans


def _check_vllm_transforms(transforms: SourceTransforms, tp: int) -> None:
    """What vLLM 0.33's transform path (``compressed_tensors/transform/``) cannot hold as the source means it."""
    if tp > 1:  # HadamardTransform and SharedWeightParameter raise NotImplementedError under TP
        raise RepackError(f"--tp {tp}: vLLM 0.33 does not support online transforms (transform_config) with tensor "
                          "parallelism; convert with --fuse and serve with --tensor-parallel-size 1")
    shared: dict[tuple[str, int], set[str]] = {}
    for matrix in transforms.matrices.values():
        shared.setdefault((matrix.scheme, matrix.size), set()).add(matrix.weight)
        if len(shared[matrix.scheme, matrix.size]) > 1:  # its SharedWeightParameter keys tensors by (scheme, size)
            raise RepackError(f"--fuse: transform scheme {matrix.scheme!r} stores more than one [{matrix.size}, "
                              f"{matrix.size}] matrix; vLLM 0.33 would load them into one shared tensor")
        if matrix.perm is not None:  # its HadamardTransform has no parameter for the permutation
            raise RepackError(f"--fuse: {matrix.perm}: vLLM 0.33 cannot load randomized transforms (the "
                              "permutation); convert without --fuse")
        if matrix.type not in HADAMARD_TYPES:  # it divides every matrix by sqrt(b): random-matrix is not normalized
            raise RepackError(f"--fuse: {matrix.weight}: vLLM 0.33 divides {matrix.type} transforms by sqrt(block), "
                              "which the checkpoint does not mean; convert without --fuse")


@dataclass(frozen=True)
class PlacedTransform:
    """One online transform of an output layer: ``partitions``, the indices of the layer's pieces whose rows it
    rotates each on its own, or ``None`` where it applies to the whole layer (every piece alike, or one piece)."""

    transform: LayerTransform
    partitions: tuple[int, ...] | None = None

    @property
    def location(self) -> str:
        return self.transform.location

    @property
    def matrix(self) -> SourceMatrix:
        return self.transform.matrix


def layer_transforms(transforms: SourceTransforms, layer: OutputLayer) -> tuple[PlacedTransform, ...]:
    """An output layer's online transforms, as vLLM holds them on a fused module: one input transform, the same on
    every partition (vLLM refuses partitions that differ); output transforms per partition, of one scheme (vLLM's
    rule), each matrix on the partitions that use it: a whole-layer one where every partition uses the same."""
    own = [transforms.layers.get(p.source, ()) for p in layer.pieces]
    inputs = [next((t for t in ts if t.location == "input"), None) for ts in own]
    if any(t != inputs[0] for t in inputs):
        other = next(p.source for p, t in zip(layer.pieces, inputs) if t != inputs[0])
        raise RepackError(f"{layer.prefix}: cannot fuse, {other} and {layer.pieces[0].source} have different online "
                          f"input transforms (vLLM requires the same input transform on every partition, from one "
                          f"apply entry)")
    outputs = [next((t for t in ts if t.location == "output"), None) for ts in own]
    used = [t for t in outputs if t is not None]
    if len({t.matrix.scheme for t in used}) > 1:
        raise RepackError(f"{layer.prefix}: cannot fuse, its partitions' online output transforms are of different "
                          f"schemes ({', '.join(sorted({t.matrix.scheme for t in used}))}; vLLM requires one)")
    placed = [PlacedTransform(inputs[0])] if inputs[0] is not None else []
    if len(used) == len(outputs) and len({t.matrix for t in used}) == 1:
        placed.append(PlacedTransform(used[0]))
    else:
        for matrix in dict.fromkeys(t.matrix for t in used):  # in partition order
            parts = tuple(i for i, t in enumerate(outputs) if t is not None and t.matrix == matrix)
            placed.append(PlacedTransform(outputs[parts[0]], parts))  # type: ignore[arg-type]
    return tuple(placed)


def cut(weight: NVFP4Weight, piece: Piece) -> NVFP4Weight:
    """``piece``'s rows and columns of ``weight`` (views, no copy), its ``scale_ratio`` folded into the block scales."""
    (r0, r1), (c0, c1) = piece.rows, piece.cols
    scales = weight.block_scales[r0:r1, c0 // BLOCK_SIZE : c1 // BLOCK_SIZE]
    if piece.scale_ratio != 1.0:
        scales = (scales.to(torch.float32) * piece.scale_ratio).to(torch.float8_e4m3fn)
    return NVFP4Weight(weight.codes[r0:r1, c0 // 2 : c1 // 2], scales, weight.multiplier)


def assemble(source: SourceModel, layer: OutputLayer,
             load: Callable[[str], NVFP4Weight] | None = None) -> NVFP4Weight:
    """The layer's canonical weight: its pieces cut from the source (ratios folded in) and stacked along N,
    with the pieces' common multiplier (the largest, after a rescale). ``load``: a source layer's weight by
    prefix (a pass shares one read among its bundles); by default each is read here."""
    loaded: dict[str, NVFP4Weight] = {}
    cuts = []
    for piece in layer.pieces:
        if piece.source not in loaded:
            loaded[piece.source] = (load(piece.source) if load is not None
                                    else source.load_layer(source.layers[piece.source]))
        cuts.append(cut(loaded[piece.source], piece))
    multiplier = max((c.multiplier for c in cuts), key=float)
    return NVFP4Weight(torch.cat([c.codes for c in cuts]), torch.cat([c.block_scales for c in cuts]), multiplier)


def source_function(source: SourceModel, layer: OutputLayer) -> torch.Tensor:
    """float64 ``[n, k]``: what the unfused source computes for this layer, each piece with its own scales."""
    return torch.cat([
        dequantize(cut(source.load_layer(source.layers[p.source]), Piece(p.source, p.rows, p.cols)))
        for p in layer.pieces
    ])


def rescale_error(source: SourceModel, layer: OutputLayer, assembled: NVFP4Weight | None = None) -> float:
    """Relative L2 error that ``--rescale`` adds to ``layer``'s weights (0.0 where nothing was rescaled):
    ``assembled`` (default: assembled here), the rescaled weight, against the unfused source's function."""
    if all(p.scale_ratio == 1.0 for p in layer.pieces):
        return 0.0
    exact = source_function(source, layer)
    weight = assembled if assembled is not None else assemble(source, layer)
    error = float((dequantize(weight) - exact).norm() / exact.norm().clamp(min=1e-300))
    return error if math.isfinite(error) else math.inf


ROUTED_EXPERTS = "routed_experts"


@dataclass(frozen=True)
class ExpertPlan:
    """One FusedMoE layer of one bundle: experts ``[experts)`` of ``group``, their intermediate rows ``[rows)``.
    vLLM's TP split cuts w1, w3 and w2's K to the rank's slice of the intermediate size for every expert; its expert
    parallelism gives each rank whole experts instead."""

    group: ExpertGroup
    rows: tuple[int, int]
    experts: tuple[int, int]
    ep: bool = False
    rescale: bool = False  # --rescale: each expert's gate and up block scales take own / max of their multipliers
    stored: bool = False  # SGLang's: the stack carries the stored global scales (ExpertStack.stored: SGLang keeps
    # them), and the module is the FusedMoE itself

    @property
    def prefix(self) -> str:
        return self.group.prefix

    @property
    def module(self) -> str:
        """vLLM 0.33's module holding the layer's tensors: the FusedMoE runner ``<owner>.experts`` keeps them on its
        ``routed_experts`` child (``RoutedExperts``; its weight mapping's ``routed_experts_prefix``); SGLang's
        (``stored``) is the FusedMoE ``<owner>.experts`` itself."""
        return self.group.prefix if self.stored else f"{self.group.prefix}.{ROUTED_EXPERTS}"

    @property
    def intermediate(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def expert_map(self) -> list[int]:
        """vLLM's ``_expert_map`` under expert parallelism: global expert -> local index, -1 elsewhere."""
        first, last = self.experts
        return [e - first if first <= e < last else -1 for e in range(self.group.experts)]


def expert_range(experts: int, ranks: int, rank: int) -> tuple[int, int]:
    """vLLM's ``determine_expert_map`` ("linear"): ``experts // ranks`` each, one more for the first
    ``experts % ranks`` ranks."""
    base, extra = divmod(experts, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def plan_experts(source: SourceModel, tp: int = 1, rank: int = 0, ep: bool = False,
                 stored: bool = False, rank_alignment: int = 1) -> dict[str, ExpertPlan]:
    """The FusedMoE layers of rank ``rank`` of ``tp``: every expert with the intermediate size split, or (``ep``,
    vLLM's ``--enable-expert-parallel``) the rank's experts whole; ``stored``: their stacks carry the stored global
    scales (:attr:`ExpertPlan.stored`). ``rank_alignment``: an engine that pads each rank's share ``I / tp`` up to
    a multiple of it before loading (SGLang's TRT-LLM-gen: 64) cuts the checkpoint's rows at that padded share, the
    last ranks holding fewer (their padding zeros)."""
    plans = {}
    for prefix, group in expert_groups(source).items():
        if ep:
            if group.experts < tp:
                raise RepackError(f"--tp {tp} with expert parallelism: {prefix} has only {group.experts} experts")
            plans[prefix] = ExpertPlan(group, (0, group.intermediate), expert_range(group.experts, tp, rank), ep=True,
                                       stored=stored)
            continue
        per, left = divmod(group.intermediate, tp)
        if left or per % BLOCK_SIZE:
            raise RepackError(f"--tp {tp}: {prefix} intermediate size {group.intermediate} gives a per-rank size "
                              f"that is not a multiple of {BLOCK_SIZE}, as vLLM requires")
        share = round_up(per, rank_alignment)
        rows = (rank * share, min(group.intermediate, (rank + 1) * share))
        if rows[0] >= rows[1]:
            raise RepackError(f"--tp {tp}: {prefix} intermediate size {group.intermediate} padded to {share} per rank "
                              f"leaves rank {rank} no rows")
        plans[prefix] = ExpertPlan(group, rows, (0, group.experts), stored=stored)
    return plans


def _unequal_gate_up(source: SourceModel, group: ExpertGroup, rescale: bool,
                     refusal: str | None = VLLM_GATE_UP) -> torch.Tensor:
    """bool ``[E]``: the experts whose gate and up multipliers differ. vLLM 0.33's NVFP4 MoE methods keep gate's (w1's)
    for both and only warn (``w1_weight_scale_2 must match w3_weight_scale_2``), so up would be mis-scaled: refused
    in one line naming the first (``refusal``: why; None: the layout holds both), unless ``rescale`` (folded into the
    block scales by :func:`assemble_experts`)."""
    own = torch.stack([expert_multipliers(source, names) for names in (group.gate, group.up)], 1)
    unequal = own[:, 0] != own[:, 1]
    if refusal is None:  # the layout holds both multipliers: nothing to fold
        return torch.zeros_like(unequal)
    if unequal.any() and not rescale:
        e = int(unequal.nonzero()[0])
        gate, up = (names[e].rpartition(".")[2] for names in (group.gate, group.up))
        low, high = (up, gate) if own[e, 1] < own[e, 0] else (gate, up)
        raise RepackError(
            f"{group.prefix}.{e}: {gate} and {up} global scales differ ({low} is {float(own[e].max() / own[e].min()):.6g}x "
            f"smaller than {high}); " + refusal.format(gate=gate, up=up))
    return unequal


RESCALE_CHUNK = 8  # experts dequantized at once to measure what --rescale changed


def expert_rescale_error(source: SourceModel, plan: ExpertPlan) -> float:
    """The largest relative L2 error ``--rescale`` adds to one of the plan's experts' gate/up weights (its rows of
    them; 0.0 where nothing was rescaled): the rescaled stack against the source's, expert by expert."""
    if not plan.rescale:
        return 0.0
    fields, worst = ("w13_codes", "w13_scales", "multipliers"), 0.0
    scales = expert_input_scales(source, plan)
    for start in range(plan.experts[0], plan.experts[1], RESCALE_CHUNK):
        chunk = (start, min(start + RESCALE_CHUNK, plan.experts[1]))
        stacks = [assemble_experts(source, p, chunk=chunk, fields=fields, input_scales=scales)
                  for p in (plan, replace(plan, rescale=False))]
        for e in range(chunk[1] - chunk[0]):
            rescaled, exact = (_w13_weight(stack, e) for stack in stacks)
            error = float((rescaled - exact).norm() / exact.norm().clamp(min=1e-300))
            worst = max(worst, error if math.isfinite(error) else math.inf)
    return worst


def _w13_weight(stack: ExpertStack, e: int) -> torch.Tensor:
    """float64 ``[2I, H]``: expert ``e``'s gate rows then up rows, each with its own multiplier."""
    inter = stack.w13_codes.shape[1] // 2
    return torch.cat([dequantize(NVFP4Weight(stack.w13_codes[e, rows], stack.w13_scales[e, rows],
                                             stack.w13_multiplier[e, i].reshape(1)))
                      for i, rows in enumerate((slice(0, inter), slice(inter, 2 * inter)))])


STACK_FIELDS = ("w13_codes", "w13_scales", "w2_codes", "w2_scales", "multipliers")


def expert_input_scales(source: SourceModel, plan: ExpertPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[E', 2]`` (w1, w3) and ``[E']`` (w2): the activation scales of the experts whose largest the layer
    holds. vLLM's FlashInfer MoE backends quantize the inputs of all of a rank's experts with the largest input
    scale it loaded: every expert's for ModelOpt, the rank's own for compressed-tensors (the same without expert
    parallelism). ``E' = 0`` for weight-only experts (Marlin reads none)."""
    group = plan.group
    if source.activation_scheme != "W4A4":  # weight-only experts: none (only the W4A4 layouts read them)
        return torch.zeros((0, 2), dtype=torch.float32), torch.zeros((0,), dtype=torch.float32)
    scope = slice(None) if GLOBAL_INPUT_SCALES[source.format] else slice(*plan.experts)
    return (read_input_scales(source, group.gate[scope] + group.up[scope]).view(2, -1).T.contiguous(),
            read_input_scales(source, group.down[scope]))


def expert_multipliers(source: SourceModel, prefixes: tuple[str, ...]) -> torch.Tensor:
    """float32 ``[len(prefixes)]``: the layers' dequant multipliers, 4 bytes read each (as :meth:`load_layer` makes
    them, and refused as it refuses them: not finite and positive)."""
    values = torch.cat([source.scheme.to_multiplier(source.checkpoint.read(source.layers[p].tensor_names[2]).reshape(1))
                        for p in prefixes])
    bad = (~(torch.isfinite(values) & (values > 0))).nonzero()
    if len(bad):
        raise RepackError(f"{prefixes[int(bad[0])]}: global scale must be finite and positive, got {float(values[bad[0]])}")
    return values


def largest_expert_scales(source: SourceModel, plan: ExpertPlan, layout: object,
                          step: int) -> tuple[float, float] | None:
    """The largest w13 and w2 block scale among the plan's experts (its rows; --rescale's folded gate/up scales),
    ``step`` experts read at a time, for a MoE ``layout`` that takes one scale factor per layer from them (its
    ``LAYER_SCALE_FACTOR``: Marlin's); None for every other layout, without reading anything."""
    if not layout.LAYER_SCALE_FACTOR:
        return None
    top = [0.0, 0.0]
    for first in range(plan.experts[0], plan.experts[1], step):
        chunk = (first, min(first + step, plan.experts[1]))
        stack = assemble_experts(source, plan, None, chunk, ("w13_scales", "w2_scales"))
        for i, scales in enumerate((stack.w13_scales, stack.w2_scales)):
            top[i] = max(top[i], float(scales.float().max()))
    return top[0], top[1]


def _placeholder(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """A field no requested tensor is made from: its shape, no memory (every element one zero)."""
    return torch.zeros((), dtype=dtype).expand(*shape)


def expert_tensor_reader(source: SourceModel, read: Callable[[TensorEntry], torch.Tensor] = read_tensor
                         ) -> Callable[[str, str], torch.Tensor]:
    """``(prefix, what) -> tensor``: an expert layer's ``"codes"`` or ``"block_scales"`` alone, read with ``read``
    (block scales checked as :meth:`SourceModel.load_layer` checks them; shapes were checked from the headers when
    the source was opened). Each layout weight tensor is made from one of the two, so a pass that makes them one
    after the other reads each source tensor once (``load_layer`` reads both)."""

    def fetch(prefix: str, what: str) -> torch.Tensor:
        name = source.layers[prefix].tensor_names[0 if what == "codes" else 1]
        tensor = read(source.checkpoint.entry(name))
        if what == "block_scales":
            check_block_scales(tensor, prefix)
        return tensor

    return fetch


def expert_pieces(plan: ExpertPlan, fetch: Callable[[str, str], torch.Tensor], chunk: tuple[int, int], which: str,
                  what: str) -> list[tuple[torch.Tensor, ...]]:
    """Each expert's source pieces of the bundle's ``w13`` (``(gate, up)``: the rank's rows) or ``w2`` (``(down,)``:
    the rank's columns) ``what`` (``"codes"`` / ``"block_scales"``), for global experts ``chunk``: views of what
    ``fetch`` (:func:`expert_tensor_reader`) read, no copy. :func:`assemble_experts` stacks them; a layout's
    ``codes_from_pieces`` copies them once into its own order."""
    group, (r0, r1), local = plan.group, plan.rows, slice(*chunk)
    if which == "w13":
        return [(fetch(gate, what)[r0:r1], fetch(up, what)[r0:r1])
                for gate, up in zip(group.gate[local], group.up[local])]
    per_block = 2 if what == "codes" else BLOCK_SIZE
    return [(fetch(down, what)[:, r0 // per_block: r1 // per_block],) for down in group.down[local]]


def assemble_experts(source: SourceModel, plan: ExpertPlan, fetch: Callable[[str, str], torch.Tensor] | None = None,
                     chunk: tuple[int, int] | None = None, fields: tuple[str, ...] = STACK_FIELDS,
                     input_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> ExpertStack:
    """The canonical expert stack of one bundle's FusedMoE layer: the rank's experts read once, cut to its rows and
    stacked in one copy per field (no per-expert work beyond the reads).

    Args:
        fetch: :func:`expert_tensor_reader`'s ``(prefix, what) -> tensor`` (a pass shares one read among its
            bundles); by default each is read here.
        chunk: global experts ``[first, last)`` (within the plan's) instead of all of the plan's: convert writes a
            large layer's tensors a chunk of experts at a time.
        fields: the :data:`STACK_FIELDS` to read (only the source tensors they are made from are read); the others
            are zero-stride placeholders of their shape (for a layout asked for the tensors made from these only,
            ``targets.moe.MADE_FROM``).
        input_scales: :func:`expert_input_scales`, if already read.
    """
    fetch = fetch or expert_tensor_reader(source)
    group, (r0, r1) = plan.group, plan.rows
    first, last = chunk or plan.experts
    experts, inter, hidden, local = last - first, r1 - r0, group.hidden, slice(first, last)

    def w13(what: str, dtype: torch.dtype, per_block: int) -> torch.Tensor:  # [gate; up] rows of each expert
        if f"w13_{what}" not in fields:
            return _placeholder(dtype, experts, 2 * inter, hidden // per_block)
        pieces = expert_pieces(plan, fetch, (first, last), "w13", "codes" if what == "codes" else "block_scales")
        pairs = torch.stack([t for pair in pieces for t in pair])
        if what == "scales" and ratios is not None:  # as cut folds a dense partition's ratio
            pairs = (pairs.to(torch.float32) * ratios.reshape(-1, 1, 1)).to(torch.float8_e4m3fn)
        return pairs.view(experts, 2 * inter, -1)

    def w2(what: str, dtype: torch.dtype, per_block: int) -> torch.Tensor:  # the rank's columns of each down_proj
        if f"w2_{what}" not in fields:
            return _placeholder(dtype, experts, hidden, inter // per_block)
        pieces = expert_pieces(plan, fetch, (first, last), "w2", "codes" if what == "codes" else "block_scales")
        return torch.stack([down for (down,) in pieces])

    ratios = None  # [E, 2]: what --rescale folds into each expert's gate and up block scales (own / max)
    if plan.rescale and {"w13_scales", "multipliers"} & set(fields):
        own = torch.stack([expert_multipliers(source, names[local]) for names in (group.gate, group.up)], 1)
        top = own.max(dim=1, keepdim=True).values
        ratios, w13_multiplier = own / top, top.expand(-1, 2).contiguous()
    elif "multipliers" in fields:
        w13_multiplier = torch.stack([expert_multipliers(source, names[local]) for names in (group.gate, group.up)], 1)
    if "multipliers" in fields:
        w2_multiplier = expert_multipliers(source, group.down[local])
    else:
        w13_multiplier, w2_multiplier = _placeholder(torch.float32, experts, 2), _placeholder(torch.float32, experts)
    w13_input_scale, w2_input_scale = input_scales or expert_input_scales(source, plan)
    stored = stored_expert_scales(source, plan, local) if plan.stored and "multipliers" in fields else None
    return ExpertStack(
        w13_codes=w13("codes", torch.uint8, 2), w13_scales=w13("scales", torch.float8_e4m3fn, BLOCK_SIZE),
        w13_multiplier=w13_multiplier, w13_input_scale=w13_input_scale,
        w2_codes=w2("codes", torch.uint8, 2), w2_scales=w2("scales", torch.float8_e4m3fn, BLOCK_SIZE),
        w2_multiplier=w2_multiplier, w2_input_scale=w2_input_scale, stored=stored,
    )


def stored_expert_scales(source: SourceModel, plan: ExpertPlan, local: slice) -> tuple[torch.Tensor, ...]:
    """:attr:`ExpertStack.stored` of experts ``local``: the weight global scales and the input scales SGLang loads
    (ModelOpt's of every expert, compressed-tensors' of the rank's: ``GLOBAL_INPUT_SCALES``), as the checkpoint
    stores them, in float32, 4 bytes read each."""
    group = plan.group
    scope = slice(None) if GLOBAL_INPUT_SCALES[source.format] else slice(*plan.experts)

    def read(names: tuple[str, ...], input_scale: bool) -> torch.Tensor:
        if input_scale and source.input_scale_name(names[0]) not in source.checkpoint.tensors:
            return torch.ones(len(names))  # a weight-only checkpoint: SGLang's ModelOpt MoE fills its input scales 1.0
        return torch.stack([source.checkpoint.read(source.input_scale_name(p) if input_scale
                                                   else source.layers[p].tensor_names[2]).reshape(()) for p in names]
                           ).to(torch.float32)

    def pairs(gate: tuple[str, ...], up: tuple[str, ...], input_scale: bool) -> torch.Tensor:
        return torch.stack([read(gate, input_scale), read(up, input_scale)], 1)

    return (pairs(group.gate[local], group.up[local], False), pairs(group.gate[scope], group.up[scope], True),
            read(group.down[local], False), read(group.down[scope], True))
