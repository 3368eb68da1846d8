"""Routed experts of an NVFP4 MoE checkpoint: ``<owner>.experts.<e>.{gate,up,down}_proj`` found among its layers.

Both producers write each routed expert as three ordinary quantized linears (the naming of Qwen3-MoE, Qwen2-MoE,
DeepSeek-V3 and llm-compressor's Mixtral; ModelOpt keeps Mixtral's ``w1/w3/w2``, which vLLM reads as gate/up/down),
which the reader has already validated one by one. Here they are grouped into the FusedMoE layers vLLM builds
(``<owner>.experts``) and checked as a whole: experts ``0..E-1``, all three projections each, one shape. Shared
experts (``shared_expert(s).*_proj``) stay dense layers and the router (``<owner>.gate``) must be unquantized, as
both producers leave it. Only the MoE architectures in ``MOE_ARCHITECTURES`` are read: each was checked against
vLLM 0.33's own load of producer-made checkpoints (tests/test_vllm_moe_conformance.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import RepackError
from .source import QuantizedLayer, SourceModel

EXPERT = re.compile(r"^(?P<owner>.+)\.experts\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# The MoE architectures whose NVFP4 checkpoints (both producers) vLLM 0.33 was checked to load as read here.
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM", "MixtralForCausalLM")
# Other names an architecture's vLLM loader reads as gate/up/down: Mixtral's ckpt_names (it maps *_proj to them too).
EXPERT_ALIASES = {"MixtralForCausalLM": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}}
# Whose input scales a rank's FusedMoE loads under expert parallelism (vLLM 0.33, FlashInfer backends): ModelOpt's
# method holds every expert's (global_sf_num_experts), compressed-tensors' only the rank's own.
GLOBAL_INPUT_SCALES = {"modelopt": True, "compressed-tensors": False}
# Whether vLLM 0.33's method keeps the experts' loaded global scales on the FusedMoE module after its post-load (no
# kernel reads them): compressed-tensors' ``w13/w2_weight_global_scale`` and ``w13/w2_input_global_scale`` stay;
# ModelOpt's conversion replaces every scale it loaded.
KEEPS_LOADED_SCALES = {"modelopt": False, "compressed-tensors": True}


@dataclass(frozen=True)
class ExpertGroup:
    """One FusedMoE layer of the source: its routed experts' layer prefixes, expert by expert."""

    prefix: str  # vLLM's module, ``model.layers.0.mlp.experts``
    gate: tuple[str, ...]
    up: tuple[str, ...]
    down: tuple[str, ...]
    hidden: int
    intermediate: int

    @property
    def experts(self) -> int:
        return len(self.gate)

    @property
    def members(self) -> tuple[str, ...]:
        return (*self.gate, *self.up, *self.down)


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen, Mixtral (and transformers 5), DeepSeek


def is_moe_config(config: dict) -> bool:
    return any(key in config for key in EXPERT_COUNT_KEYS)


def check_expert_count(config: dict, groups: dict[str, ExpertGroup]) -> None:
    """Every FusedMoE layer holds the routed experts config.json counts (vLLM builds each with that many and
    splits them among --ep ranks by it): a layer missing its highest-numbered experts, which the contiguity check
    cannot see, is refused in one line, as is a count that is not a positive integer."""
    for key in EXPERT_COUNT_KEYS:
        if key not in config:
            continue
        count = config[key]
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise RepackError(f"config.json: {key} must be a positive integer, got {str(count)[:40]!r}")
        for module, group in groups.items():
            if group.experts != count:
                what = (f"expert {group.experts} has no NVFP4 {PROJECTIONS[0]}" if group.experts < count else
                        f"it has {group.experts}")
                raise RepackError(f"{module}: config.json's {key} is {count} but {what}; expected experts "
                                  f"0..{count - 1}, each with {', '.join(PROJECTIONS)}")


def find_expert_groups(layers: dict[str, QuantizedLayer],
                       aliases: dict[str, str] | None = None) -> dict[str, ExpertGroup]:
    """``{module prefix: its experts}`` for every ``<owner>.experts.<e>.<proj>`` layer, ``<proj>`` one of
    ``PROJECTIONS`` or an alias of one (``aliases``, the architecture's ``EXPERT_ALIASES``); one-line refusals for
    an incomplete or ragged set, or an expert named both ways."""
    names = {**{p: p for p in PROJECTIONS}, **(aliases or {})}
    found: dict[str, dict[str, dict[int, QuantizedLayer]]] = {}
    for prefix, layer in layers.items():
        match = EXPERT.match(prefix)
        if match and match["proj"] in names:
            projs = found.setdefault(f"{match['owner']}.experts", {p: {} for p in PROJECTIONS})
            by_index, index = projs[names[match["proj"]]], int(match["index"])
            if index in by_index:
                raise RepackError(f"{prefix}: expert {index} has both {by_index[index].prefix.rpartition('.')[2]} "
                                  f"and {match['proj']}; expected one naming, gate/up/down_proj or w1/w3/w2")
            by_index[index] = layer
    groups = {}
    for module, projs in sorted(found.items()):
        count = max(len(by_index) for by_index in projs.values())
        for proj, by_index in projs.items():
            missing = sorted(set(range(count)) - set(by_index))
            if missing or max(by_index, default=-1) != count - 1:
                raise RepackError(f"{module}: expert {missing[0] if missing else count} has no NVFP4 {proj}; "
                                  f"expected experts 0..{count - 1}, each with {', '.join(PROJECTIONS)}")
        gate, up, down = ([projs[p][e] for e in range(count)] for p in PROJECTIONS)
        intermediate, hidden = gate[0].n, gate[0].k
        for e in range(count):
            shapes = [(gate[e].n, gate[e].k), (up[e].n, up[e].k), (down[e].n, down[e].k)]
            if shapes != [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]:
                raise RepackError(f"{module}.{e}: gate/up/down shapes {shapes} differ from expert 0's "
                                  f"[{intermediate}, {hidden}] / [{hidden}, {intermediate}]")
        groups[module] = ExpertGroup(module, *(tuple(x.prefix for x in p) for p in (gate, up, down)), hidden,
                                     intermediate)
    return groups


def architecture(config: dict) -> str:
    """config.json's model class (its first ``architectures`` entry; ``""`` if none)."""
    return next(iter(config.get("architectures") or []), "")


def check_moe_architecture(config: dict) -> None:
    """One-line refusal of an MoE architecture outside ``MOE_ARCHITECTURES`` (its experts or routing may be named
    alike but were never checked against vLLM's load)."""
    if len(config.get("architectures") or []) != 1 or architecture(config) not in MOE_ARCHITECTURES:
        raise RepackError(f"MoE architecture {architecture(config) or 'unknown'!r} is not supported; supported: "
                          f"{', '.join(MOE_ARCHITECTURES)}")


def check_no_expert_biases(source: SourceModel, groups: dict[str, ExpertGroup]) -> None:
    """One-line refusal of a routed expert's ``bias`` (``<owner>.experts.<e>.<proj>.bias``, what vLLM's FusedMoE would
    load as ``w13_bias`` / ``w2_bias``): vLLM 0.33 and 0.34 build the FusedMoE of every architecture in
    ``MOE_ARCHITECTURES`` without those parameters and their expert loader skips such tensors (SGLang 0.5.23's model
    loaders skip a bias they have no parameter for), so a bundle passing it through would serve the experts without
    it (nothing may be lost)."""
    members = {prefix for group in groups.values() for prefix in group.members}
    for name in source.passthrough:
        owner, _, leaf = name.rpartition(".")
        if leaf == "bias" and owner in members:
            raise RepackError(f"{name}: routed experts with biases are not supported: vLLM's and SGLang's FusedMoE "
                              f"for {architecture(source.checkpoint.config)} hold no expert bias (their loaders drop it)")


def expert_groups(source: SourceModel) -> dict[str, ExpertGroup]:
    """The source's FusedMoE layers; refused in one line: an MoE architecture outside ``MOE_ARCHITECTURES``, a
    quantized router (vLLM builds it unquantized), an MoE config without NVFP4 layers named
    ``experts.<e>.{gate,up,down}_proj`` (Mixtral: or ``w1/w3/w2``)."""
    config = source.checkpoint.config
    moe = is_moe_config(config)
    if moe:
        check_moe_architecture(config)
    groups = find_expert_groups(source.layers, EXPERT_ALIASES.get(architecture(config)))
    if not groups and moe:
        raise RepackError(f"{source.checkpoint.root}: an MoE config, but no NVFP4 routed experts named "
                          f"<owner>.experts.<e>.{{{','.join(PROJECTIONS)}}} (Mixtral: or w1/w3/w2); only that naming "
                          "is supported")
    check_expert_count(config, groups)
    check_no_expert_biases(source, groups)
    for module in groups:
        router = module.removesuffix(".experts") + ".gate"
        if router in source.layers:
            raise RepackError(f"{router}: the MoE router is NVFP4-quantized; vLLM serves routers unquantized "
                              "(both producers leave them in bf16)")
    return groups


def input_scale_scope(source: SourceModel) -> str:
    """Whose input scales a FusedMoE layer of a bundle holds the largest of (a MoE record's ``input_scales``):
    ``all`` experts' or the rank's ``local`` ones (``GLOBAL_INPUT_SCALES``), ``none`` for weight-only experts."""
    if source.activation_scheme != "W4A4":
        return "none"
    return "all" if GLOBAL_INPUT_SCALES[source.format] else "local"


def read_input_scales(source: SourceModel, prefixes: tuple[str, ...]) -> torch.Tensor:
    """float32 ``[len(prefixes)]``: each layer's activation dequant scale as vLLM computes it (ModelOpt
    ``input_scale``, compressed-tensors ``1 / input_global_scale`` in float32), 4 bytes read each."""
    return torch.stack([source.read_input_scale(prefix).scale.reshape(()) for prefix in prefixes])


def kept_scales(source: SourceModel, group: ExpertGroup, experts: tuple[int, int]) -> list[str]:
    """The source tensors of experts ``[experts)`` that vLLM keeps on the module as loaded (``KEEPS_LOADED_SCALES``):
    each expert's ``weight_global_scale`` and (W4A4) ``input_global_scale``, which its expert weight loader places by name
    (gate/up into ``[e, 0]``/``[e, 1]`` of the ``w13_`` ones, down into ``[e]`` of the ``w2_`` ones, on the rank
    holding expert ``e``). A bundle carries them as passthrough tensors under these names."""
    if not KEEPS_LOADED_SCALES[source.format]:
        return []
    # a weight-only checkpoint has no input scales: vLLM's are left as allocated (no kernel reads them)
    suffixes = (source.scheme.global_scale, source.scheme.input_scale)[:2 if source.activation_scheme == "W4A4" else 1]
    return [f"{prefix}.{suffix}" for names in (group.gate, group.up, group.down)
            for prefix in names[slice(*experts)] for suffix in suffixes]


SHARED = re.compile(r"^(?P<module>.+\.shared_experts?)\.")


def moe_summary(source: SourceModel) -> dict | None:
    """What ``inspect`` shows of an MoE checkpoint (``None`` for a dense one): its FusedMoE layers, experts,
    top-k, sizes and shared-expert modules, or ``{"unsupported": why}``."""
    if not is_moe_config(source.checkpoint.config):
        return None
    try:
        groups = expert_groups(source)
    except RepackError as err:
        return {"unsupported": str(err)}
    shared = sorted({m["module"] for p in source.layers if (m := SHARED.match(p))})
    first = next(iter(groups.values()))
    return {
        "fused_moe_layers": len(groups),
        "experts": sorted({g.experts for g in groups.values()}),
        "top_k": source.checkpoint.config.get("num_experts_per_tok"),
        "hidden": first.hidden,
        "intermediate": sorted({g.intermediate for g in groups.values()}),
        "shared_expert_modules": len(shared),
    }
