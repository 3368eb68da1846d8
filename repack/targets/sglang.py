"""SGLang 0.5.23's dense NVFP4 state, as engine data over the layouts vLLM's kernels share (W4A4: :mod:`.w4a4`).

SGLang's ``auto`` dense FP4 backend (``fp4_utils.initialize_fp4_gemm_config``) is FlashInfer cute-dsl on sm100 and
FlashInfer CUTLASS on sm120; both hold the same bytes after ``process_weights_after_loading``, which are vLLM's W4A4
bytes (the 128x4 swizzle, the codes padded to 32) under other names and scalars, per source format:

ModelOpt (``ModelOptFp4LinearMethod``): ``weight`` padded to ``[round_up(N, 32), round_up(K, 32)/2]``
(``pad_nvfp4_weight``), ``weight_scale_interleaved`` the swizzled scales, which SGLang writes into ``weight_scale``'s
own storage (an alias: ``alias_or_bind_derived_param``) when the padded shape is the loaded one, else ``weight_scale``
keeps the loaded ``[N, K/16]`` scales; ``alpha = max(input_scale) * max(weight_scale_2)`` and ``input_scale_inv =
1 / max(input_scale)`` (float32 ``[]``), ``input_scale`` and ``weight_scale_2`` as loaded: one float32 per partition
of the fused module.

compressed-tensors (``CompressedTensorsW4A4Fp4``): ``weight_packed`` not padded, ``weight_scale`` swizzled,
``weight_global_scale`` and ``input_global_scale`` the partitions' largest as stored (float32 ``[]``), ``alpha =
1 / (input_global_scale * weight_global_scale)``.

Weight-only (ModelOpt ``W4A16_NVFP4`` everywhere, compressed-tensors ``NVFP4A16`` off sm100, W4A4 checkpoints where
SGLang serves them weight-only): FP4 Marlin, :mod:`.marlin`'s bytes without vLLM's scale factor and flush, the global
scale bf16; compressed-tensors ``NVFP4A16`` on sm100: FlashInfer's bf16 x fp4 cute-dsl state, the sm100 swizzle of
:mod:`.layout` over unpadded codes (the section "weight-only" below).

NVFP4 MoE (FusedMoE): :class:`MoELayout`, the bytes of :mod:`.moe_trtllm` (ModelOpt, sm100: no hidden padding, the
intermediate size padded per rank before loading) and :mod:`.moe_cutlass` (ModelOpt sm120, compressed-tensors) under
SGLang's names and scalars (docs/sglang.md).

Names, scalars and padding rules only: the layout math is :mod:`.w4a4`'s, :mod:`.marlin`'s, :mod:`.layout`'s and
the MoE layouts'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Collection, Sequence

import torch

from ..errors import RepackError
from ..nvfp4 import BLOCK_SIZE, NVFP4Weight
from . import families, marlin, moe_cutlass, moe_trtllm, sm100, w4a4
from .base import LayerGeometry, RuntimeLayer, Target, TensorSpec
from .engines import (
    SGLANG_0523,
    SGLANG_ALL_LAYERS_MOE,
    SGLANG_FUSED_SHARED_EXPERT,
    SGLANG_BF16_FP4_LAYOUT,
    SGLANG_DENSE_BACKENDS,
    SGLANG_LAYOUTS,
    SGLANG_MARLIN_LAYOUTS,
    SGLANG_MOE_ARCHITECTURES,
    SGLANG_MOE_BACKENDS,
    SGLANG_MOE_LAYOUTS,
    SGLANG_MOE_UNCHECKED_BACKENDS,
    SGLANG_SAME_STATE_BACKENDS,
    SGLANG_WEIGHT_ONLY_FAMILIES,
)
from .layout import pad_2d, pad_codes, swizzle_128x4, swizzled_scale_shape, vllm_geometry
from .moe import ExpertCodes, ExpertStack, stored_scales, swizzle_experts, w3w1
from .sglang_marlin_moe import DTYPE as MARLIN_DTYPE  # the models' activation dtype on sm80 and up
from .sglang_marlin_moe import marlin_global_scale, marlin_moe_variant

ENGINE = SGLANG_0523.engine
DENSE_BACKENDS, LAYOUTS, SAME_STATE_BACKENDS = SGLANG_DENSE_BACKENDS, SGLANG_LAYOUTS, SGLANG_SAME_STATE_BACKENDS
# per source format: the names SGLang binds to another's storage (ModelOpt: its swizzled scales written into
# weight_scale's when they fit), absent from a bundle where SGLang aliases them; and whether it keeps
# weights_padding_cols on the layer
ALIASES = {"modelopt": {"weight_scale_interleaved": "weight_scale"}, "compressed-tensors": {}}
KEEPS_PADDING = {"modelopt": True, "compressed-tensors": False}


def _scale_aliased(n: int, k: int) -> bool:
    """Whether SGLang writes ModelOpt's swizzled scales into ``weight_scale``'s own storage: the padded shape is the
    loaded one (``alias_or_bind_derived_param`` broadcasts only equal shapes here)."""
    return w4a4.swizzled_scale_shape(n, k) == (n, k // BLOCK_SIZE)


def _modelopt_scalars(stored: NVFP4Weight) -> dict[str, torch.Tensor]:
    """The scalars ``ModelOptFp4LinearMethod`` derives from a fused module's partitions before any backend's
    preparation: ``alpha``, ``input_scale_inv``, and ``input_scale``, ``weight_scale_2`` as loaded."""
    weight_scale_2, input_scale = stored.partition_scales
    top_input, top_weight = input_scale.max(), weight_scale_2.max()
    return {"alpha": (top_input * top_weight).to(torch.float32), "input_scale_inv": (1 / top_input).to(torch.float32),
            "input_scale": input_scale, "weight_scale_2": weight_scale_2}


def _modelopt(layer: RuntimeLayer, n: int, k: int, stored: NVFP4Weight) -> dict[str, torch.Tensor]:
    out = {"weight": layer.weight, "weight_scale": layer.weight_scale, **_modelopt_scalars(stored)}
    if not _scale_aliased(n, k):
        out["weight_scale"] = stored.block_scales.contiguous()
        out["weight_scale_interleaved"] = layer.weight_scale
    return out


def _compressed_tensors(layer: RuntimeLayer, n: int, k: int, stored: NVFP4Weight) -> dict[str, torch.Tensor]:
    global_scale, input_global_scale = (s.max().to(torch.float32) for s in stored.partition_scales)
    return {"weight_packed": layer.weight[:n, : k // 2].contiguous(), "weight_scale": layer.weight_scale,
            "weight_global_scale": global_scale, "input_global_scale": input_global_scale,
            "alpha": 1 / (input_global_scale * global_scale)}


NAMED: dict[str, Callable[[RuntimeLayer, int, int, NVFP4Weight], dict[str, torch.Tensor]]] = {
    "modelopt": _modelopt, "compressed-tensors": _compressed_tensors}


def to_runtime(source_format: str, weight: NVFP4Weight) -> RuntimeLayer:
    """The W4A4 layout of ``weight``, holding SGLang's tensors by its names (``RuntimeLayer.named``)."""
    if weight.partition_scales is None:
        raise RepackError("an SGLang layer needs its partitions' stored global scales (convert --engine sglang)")
    layer = w4a4.to_runtime(weight)
    return replace(layer, named=NAMED[source_format](layer, weight.n, weight.k, weight))


def from_named(source_format: str, tensors: dict[str, torch.Tensor], n: int, k: int) -> RuntimeLayer:
    """SGLang's tensors of one layer -> the W4A4 layout's :class:`RuntimeLayer` (its ``named``: the tensors), whose
    scalars follow from SGLang's as the source format's reader computes them (:mod:`repack.formats`)."""
    geometry = w4a4.geometry(n, k)
    if source_format == "modelopt":
        scale, multiplier = tensors["input_scale"].max(), tensors["weight_scale_2"].max()
        weight, swizzled = tensors["weight"], tensors.get("weight_scale_interleaved", tensors["weight_scale"])
        inverse = (1.0 / scale).to(torch.float32)
    else:
        inverse, stored = tensors["input_global_scale"], tensors["weight_global_scale"]
        weight = pad_2d(tensors["weight_packed"], geometry.n_padded, geometry.k_padded // 2)
        swizzled, scale, multiplier = tensors["weight_scale"], (1.0 / inverse).to(torch.float32), torch.reciprocal(stored)
    return RuntimeLayer(weight, swizzled, w4a4.scalar(multiplier), geometry.weights_padding_cols,
                        input_global_scale=w4a4.scalar(scale), input_global_scale_inv=w4a4.scalar(inverse),
                        alpha=w4a4.scalar(scale) * w4a4.scalar(multiplier), named=dict(tensors))


def from_runtime(source_format: str, layer: RuntimeLayer, n: int, k: int) -> NVFP4Weight:
    """:func:`w4a4.from_runtime`, with the partition scales SGLang keeps (ModelOpt: each partition's; compressed-
    tensors: the largest, all that SGLang keeps and all that its scalars follow from)."""
    weight = w4a4.from_runtime(layer, n, k)
    named = layer.named or {}
    if source_format == "modelopt":
        scales = (named["weight_scale_2"], named["input_scale"])
    else:
        scales = (named["weight_global_scale"].reshape(1), named["input_global_scale"].reshape(1))
    return replace(weight, partition_scales=scales)


def restated_differences(target: Target, layer: RuntimeLayer, n: int, k: int) -> list[str]:
    """The names of an SGLang layer's tensors that :func:`to_runtime` does not give back from its codes, scales and
    kept scalars (a derived scalar such as ``alpha``, or ModelOpt's unswizzled ``weight_scale``, that does not follow
    from the rest): what verify's exactness fails."""
    again = target.to_runtime(target.from_runtime(layer, n, k)).named or {}
    held = layer.named or {}
    return sorted(name for name in set(held) | set(again) if name not in held or name not in again
                  or held[name].shape != again[name].shape or held[name].dtype != again[name].dtype
                  or not torch.equal(held[name].reshape(-1).view(torch.uint8), again[name].reshape(-1).view(torch.uint8)))


def partition_specs(source_format: str, n: int, k: int, parts: int) -> dict[str, TensorSpec]:
    """dtype and shape of each SGLang tensor of an ``[n, k]`` layer fused from ``parts`` partitions."""
    vllm = w4a4.runtime_specs(n, k)
    scalar = TensorSpec(torch.float32, ())
    if source_format == "compressed-tensors":
        return {"weight_packed": TensorSpec(torch.uint8, (n, k // 2)), "weight_scale": vllm["weight_scale"],
                **{name: scalar for name in ("weight_global_scale", "input_global_scale", "alpha")}}
    vector = TensorSpec(torch.float32, (parts,))
    out = {"weight": vllm["weight"], "weight_scale": vllm["weight_scale"], "alpha": scalar,
           "input_scale_inv": scalar, "input_scale": vector, "weight_scale_2": vector}
    if not _scale_aliased(n, k):
        out["weight_scale"] = TensorSpec(torch.float8_e4m3fn, (n, k // BLOCK_SIZE))
        out["weight_scale_interleaved"] = vllm["weight_scale"]
    return out


def layouts(family: Target) -> tuple[Target, ...]:
    """SGLang's layouts of ``family`` (the family's vLLM layouts: its row in the registry, targets/__init__.py): its
    W4A4 ones, then its weight-only ones."""
    return (*variants(family), *weight_only_variants(family))


def variants(family: Target) -> tuple[Target, ...]:
    """``family``'s SGLang W4A4 layouts, one per source format, over the family's vLLM W4A4 layout (empty where SGLang
    has no dense W4A4 backend)."""
    if family.name not in DENSE_BACKENDS:
        return ()
    base = family.with_layout(families.W4A4_LAYOUT_ID)
    return tuple(
        replace(base, layout_id=layout, engine=ENGINE, source_format=fmt, kernels=(DENSE_BACKENDS[family.name],),
                moe_layout=moe_variant,
                to_runtime=lambda weight, f=fmt: to_runtime(f, weight),
                from_runtime=lambda layer, n, k, f=fmt: from_runtime(f, layer, n, k),
                partition_specs=lambda n, k, parts, f=fmt: partition_specs(f, n, k, parts),
                from_named=lambda tensors, n, k, f=fmt: from_named(f, tensors, n, k))
        for fmt, layout in LAYOUTS.items())


# --- weight-only: FP4 Marlin (prepare_nvfp4_layer_for_marlin) and FlashInfer's bf16 x fp4 GEMM ---
# SGLang's FP4 Marlin holds the bytes of vLLM's Marlin layout (targets/marlin.py: padding, gptq_marlin_repack, the
# permuted S0E5M3 scales) with neither vLLM's power-of-two scale factor nor its flush of the smallest scales, and the
# global scale in bf16 (nvfp4_marlin_process_global_scale of the multiplier cast to the activation dtype, [1]).
MARLIN_KERNEL = "marlin"
# what SGLang's post-load leaves on a layer besides a bundle's tensors, per layout: the loaded parameters it deletes,
# the plain attributes it sets, whether it keeps a scratch ``workspace`` (marlin_make_workspace, sized by the GPU)
DELETED = {SGLANG_MARLIN_LAYOUTS["modelopt", "W4A16"]: ("input_scale", "weight_scale_2"),
           SGLANG_MARLIN_LAYOUTS["compressed-tensors", "W4A16"]: ("weight_packed",),
           SGLANG_MARLIN_LAYOUTS["compressed-tensors", "W4A4"]: ("weight_packed", "input_global_scale"),
           SGLANG_BF16_FP4_LAYOUT: ("weight_packed", "weight_scale", "weight_global_scale")}
ATTRIBUTES: dict[str, dict[str, object]] = {
    SGLANG_MARLIN_LAYOUTS["compressed-tensors", "W4A16"]: {"use_flashinfer_bf16_fp4": False},
    SGLANG_MARLIN_LAYOUTS["compressed-tensors", "W4A4"]: {"use_flashinfer_bf16_fp4": False},
    SGLANG_MARLIN_LAYOUTS["modelopt", "W4A4"]: {"weights_padding_cols": 0},
    SGLANG_BF16_FP4_LAYOUT: {"use_flashinfer_bf16_fp4": True, "flashinfer_backend": "cute-dsl"}}
# the --fp4-gemm-backend values under which SGLang holds each weight-only layout (ModelOpt W4A16_NVFP4: Marlin under
# every one; compressed-tensors: FlashInfer's bf16 x fp4 under cute-dsl / cudnn, which hold other bytes each, else
# Marlin; W4A4 checkpoints on Marlin: marlin, SGLang's auto below sm100 and what serves them weight-only on Blackwell,
# where its other backends hold the W4A4 state)
_NOT_BF16_FP4 = ("flashinfer_cutlass", "flashinfer_trtllm", MARLIN_KERNEL)
BACKENDS = {SGLANG_MARLIN_LAYOUTS["modelopt", "W4A16"]: (*SGLANG_SAME_STATE_BACKENDS, "flashinfer_trtllm", MARLIN_KERNEL),
            SGLANG_MARLIN_LAYOUTS["compressed-tensors", "W4A16"]: _NOT_BF16_FP4,
            SGLANG_MARLIN_LAYOUTS["compressed-tensors", "W4A4"]: (MARLIN_KERNEL,),
            SGLANG_MARLIN_LAYOUTS["modelopt", "W4A4"]: (MARLIN_KERNEL,),
            SGLANG_BF16_FP4_LAYOUT: ("flashinfer_cutedsl",)}


def backends(layout_id: str) -> tuple[str, ...]:
    """The ``--fp4-gemm-backend`` values under which SGLang holds ``layout_id``'s state (the plugin refuses others)."""
    return BACKENDS.get(layout_id, SAME_STATE_BACKENDS)


def marlin_read(weight: NVFP4Weight) -> NVFP4Weight:
    """``weight`` as SGLang's Marlin reads it: the multiplier rounded to bf16 (its scales are kept as they are)."""
    return replace(weight, multiplier=weight.multiplier.to(MARLIN_DTYPE).to(torch.float32).reshape(1),
                   input_scale=None, partition_scales=None)


def marlin_to_runtime(source_format: str, scheme: str, weight: NVFP4Weight) -> RuntimeLayer:
    """The Marlin layout (targets/marlin.py's, without its factor and flush) of ``weight``, holding SGLang's tensors:
    ``weight``, ``weight_scale``, ``weight_global_scale`` (bf16 ``[1]``), and for a ModelOpt W4A4 checkpoint the
    activation scalars ``ModelOptFp4LinearMethod`` keeps beside them (``input_global_scale`` the largest input scale)."""
    g = marlin.geometry(weight.n, weight.k)
    held = marlin_global_scale(weight.multiplier)
    named = {"weight": marlin.repack_codes(weight.codes, g.n_padded, g.k_padded),
             "weight_scale": marlin.process_scales(weight.block_scales, g.n_padded, g.k_padded, 1.0, MARLIN_DTYPE,
                                                   flush=False),
             "weight_global_scale": held}
    if (source_format, scheme) == ("modelopt", "W4A4"):
        if weight.partition_scales is None:
            raise RepackError("an SGLang layer needs its partitions' stored global scales (convert --engine sglang)")
        scalars = _modelopt_scalars(weight)
        named |= {**scalars, "input_global_scale": scalars["input_scale"].max().to(torch.float32)}
    return marlin_from_named(named, weight.n, weight.k)


def marlin_from_named(tensors: dict[str, torch.Tensor], n: int, k: int) -> RuntimeLayer:
    """SGLang's Marlin tensors -> the Marlin layout's RuntimeLayer (the held global scale in float32, the bf16
    multiplier it carries as the source multiplier, whose ratio tells marlin.from_runtime a factor of 1)."""
    held = tensors["weight_global_scale"].to(torch.float32)
    return RuntimeLayer(tensors["weight"], tensors["weight_scale"], held.reshape(()),
                        marlin.geometry(n, k).weights_padding_cols,
                        weight_multiplier=held / marlin.global_exponent(MARLIN_DTYPE), named=dict(tensors))


def marlin_from_runtime(layer: RuntimeLayer, n: int, k: int) -> NVFP4Weight:
    """The weight as SGLang's Marlin reads it, with the partition scales a ModelOpt W4A4 layer keeps."""
    weight = marlin.from_runtime(layer, n, k, MARLIN_DTYPE)
    named = layer.named or {}
    if "weight_scale_2" in named:
        weight = replace(weight, partition_scales=(named["weight_scale_2"], named["input_scale"]))
    return weight


def marlin_specs(scheme_format: tuple[str, str], n: int, k: int, parts: int) -> dict[str, TensorSpec]:
    specs = marlin.runtime_specs(n, k)
    out = {"weight": specs["weight"], "weight_scale": specs["weight_scale"],
           "weight_global_scale": TensorSpec(MARLIN_DTYPE, (1,))}
    if scheme_format == ("modelopt", "W4A4"):
        out |= {name: TensorSpec(torch.float32, ()) for name in ("alpha", "input_scale_inv", "input_global_scale")}
        out |= {name: TensorSpec(torch.float32, (parts,)) for name in ("input_scale", "weight_scale_2")}
    return out


def marlin_variant(family: Target, source_format: str, scheme: str) -> Target:
    """``family``'s SGLang FP4 Marlin layout for a ``scheme`` checkpoint of ``source_format``."""
    key = (source_format, scheme)
    return replace(Target.of(
        family, to_runtime=lambda weight: marlin_to_runtime(source_format, scheme, weight),
        from_runtime=marlin_from_runtime, runtime_specs=lambda n, k: marlin_specs(key, n, k, 1),
        geometry=marlin.geometry, scheme=scheme, engine=ENGINE, source_format=source_format,
        partition_specs=lambda n, k, parts: marlin_specs(key, n, k, parts), from_named=marlin_from_named,
        read_as=marlin_read, runtime_layout=families.SM80.layout_id),
        layout_id=SGLANG_MARLIN_LAYOUTS[key], kernels=(MARLIN_KERNEL,), backend="reference",
        moe_layout=marlin_moe_variant)


# compressed-tensors NVFP4A16 on sm100: prepare_bf16_fp4_weights(weight_packed, swizzle_blockscale(weight_scale),
# 1 / weight_global_scale, backend="cute-dsl") keeps the codes unpadded, the 128x4-swizzled scales (which FlashInfer
# wraps in a 6-D view: the plugin calls it again on the bundle's buffer) and alpha, the multiplier float32 [1].
def bf16_fp4_to_runtime(weight: NVFP4Weight) -> RuntimeLayer:
    named = {"weight": weight.codes.contiguous(), "weight_scale_interleaved": swizzle_128x4(weight.block_scales),
             "alpha": weight.multiplier.reshape(1).to(torch.float32).clone()}
    return bf16_fp4_from_named(named, weight.n, weight.k)


def bf16_fp4_from_named(tensors: dict[str, torch.Tensor], n: int, k: int) -> RuntimeLayer:
    """SGLang's tensors -> the sm100 cute-dsl layout's RuntimeLayer (vLLM's bytes: the codes padded to 64)."""
    geometry = vllm_geometry(n, k)
    return RuntimeLayer(pad_codes(tensors["weight"], geometry), tensors["weight_scale_interleaved"],
                        tensors["alpha"].reshape(1), geometry.weights_padding_cols, named=dict(tensors))


def bf16_fp4_specs(n: int, k: int, parts: int = 1) -> dict[str, TensorSpec]:
    return {"weight": TensorSpec(torch.uint8, (n, k // 2)),
            "weight_scale_interleaved": TensorSpec(torch.float8_e4m3fn, swizzled_scale_shape(n, k)),
            "alpha": TensorSpec(torch.float32, (1,))}


def bf16_fp4_variant(family: Target) -> Target:
    """sm100's SGLang layout for compressed-tensors NVFP4A16 (FlashInfer's bf16 x fp4 cute-dsl GEMM)."""
    return replace(Target.of(
        family, to_runtime=bf16_fp4_to_runtime, from_runtime=sm100.from_runtime, runtime_specs=bf16_fp4_specs,
        geometry=lambda n, k: LayerGeometry(n, k, 0), scheme="W4A16", engine=ENGINE,
        source_format="compressed-tensors", partition_specs=bf16_fp4_specs, from_named=bf16_fp4_from_named,
        runtime_layout=families.SM100.layout_id),
        layout_id=SGLANG_BF16_FP4_LAYOUT, kernels=("flashinfer_cutedsl",), moe_layout=marlin_moe_variant)


def weight_only_variants(family: Target) -> tuple[Target, ...]:
    """``family``'s SGLang weight-only layouts: ModelOpt W4A16_NVFP4 on Marlin everywhere, compressed-tensors NVFP4A16
    on FlashInfer's bf16 x fp4 (sm100) or Marlin, and W4A4 checkpoints on Marlin: SGLang's auto where it is Marlin
    (sm80-sm90), ``--fp4-gemm-backend marlin`` on sm100 / sm120 (``convert --weight-only``; after their W4A4 layouts,
    which :meth:`Target.for_engine` picks first)."""
    if family.name not in SGLANG_WEIGHT_ONLY_FAMILIES:
        return ()
    return (marlin_variant(family, "modelopt", "W4A16"),
            bf16_fp4_variant(family) if family.name == "sm100" else marlin_variant(family, "compressed-tensors", "W4A16"),
            *(marlin_variant(family, fmt, "W4A4") for fmt in ("modelopt", "compressed-tensors")))


# --- NVFP4 MoE (FusedMoE) -----------------------------------------------------------------------------------------
# SGLang 0.5.23's FusedMoE state (ModelOptNvFp4FusedMoEMethod, CompressedTensorsW4A4Nvfp4MoE): the bytes of FlashInfer's
# MoE layouts (moe_trtllm's shuffle, moe_cutlass's [up; gate] and per-expert swizzle) under SGLang's names, with its
# own padding and scalars. Engine data only: the layout math is moe_trtllm's, moe_cutlass's and moe.py's.
TRTLLM_HIDDEN_ALIGNMENT = 1  # trtllm_nvfp4_hidden_alignment (per-tensor activation scales, gated): no hidden padding
MOE_SCALE_ALIASES = {"w13_blockscale_swizzled": "w13_weight_scale", "w2_blockscale_swizzled": "w2_weight_scale"}
MOE_METHODS = {"modelopt": "ModelOptNvFp4FusedMoEMethod", "compressed-tensors": "CompressedTensorsW4A4Nvfp4MoE"}
CT_MOE_SCALAR_ALIASES = {"w2_input_scale_quant": "w2_input_global_scale"}  # compressed-tensors: one tensor, two names
_FLOAT32 = torch.float32


def _modelopt_moe_scalars(stored: tuple[torch.Tensor, ...], trtllm: bool) -> dict[str, torch.Tensor]:
    """``ModelOptNvFp4FusedMoEMethod.process_weights_after_loading`` on the FlashInfer TRT-LLM-gen / CUTLASS paths:
    one input scale for all experts (the largest loaded), the GEMM alphas of gate and up apart, the loaded scales
    kept as loaded (``[gate, up]``)."""
    w13_weight, w13_input, w2_weight, w2_input = stored
    a13, a2 = w13_input.max().to(_FLOAT32), w2_input.max().to(_FLOAT32)
    up = (a13 * w13_weight[:, 1]).to(_FLOAT32)
    out = {"w13_weight_scale_2": w13_weight, "w13_input_scale": w13_input, "w2_weight_scale_2": w2_weight,
           "w2_input_scale": w2_input, "g1_alphas": (a13 * w13_weight[:, 0]).to(_FLOAT32), "g1_alphas_up": up,
           "g2_alphas": (a2 * w2_weight).to(_FLOAT32), "w13_input_scale_quant": (1 / a13).to(_FLOAT32),
           "w2_input_scale_quant": (1 / a2).to(_FLOAT32)}
    if trtllm:  # _compute_g1_scale_c: the up half's dequant times GEMM2's input quantization
        out["g1_scale_c"] = (out["w2_input_scale_quant"] * up).to(_FLOAT32)
    return out


def _ct_moe_scalars(stored: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """``CompressedTensorsW4A4Nvfp4MoE.process_weights_after_loading`` off TRT-LLM: the loaded global scales kept,
    gate's weight scale for both halves, each expert's largest w13 input scale (``min`` of the stored inverses);
    ``w2_input_scale_quant`` is the loaded ``w2_input_global_scale`` itself (an alias)."""
    w13_global, w13_input, w2_global, w2_input = stored
    scale_13, scale_2 = 1 / w13_global[:, 0], 1 / w2_global
    quant_13 = w13_input.min(dim=1).values.to(_FLOAT32)
    return {"w13_weight_global_scale": w13_global, "w13_input_global_scale": w13_input,
            "w2_weight_global_scale": w2_global, "w2_input_global_scale": w2_input,
            "w13_weight_scale_2": scale_13, "w2_weight_scale_2": scale_2, "w13_input_scale_quant": quant_13,
            "g1_alphas": (1 / quant_13) * scale_13, "g2_alphas": ((1 / w2_input) * scale_2).to(_FLOAT32)}


def _moe_scalar_specs(source_format: str, trtllm: bool, experts: int, num_experts: int) -> dict[str, TensorSpec]:
    vector, pairs, scalar = (TensorSpec(_FLOAT32, shape) for shape in ((experts,), (experts, 2), ()))
    every, every_pairs = TensorSpec(_FLOAT32, (num_experts,)), TensorSpec(_FLOAT32, (num_experts, 2))
    if source_format == "compressed-tensors":
        return {"w13_weight_global_scale": pairs, "w13_input_global_scale": pairs, "w2_weight_global_scale": vector,
                "w2_input_global_scale": vector, **{n: vector for n in ("w13_weight_scale_2", "w2_weight_scale_2",
                                                                         "w13_input_scale_quant", "g1_alphas",
                                                                         "g2_alphas")}}
    out = {"w13_weight_scale_2": pairs, "w13_input_scale": every_pairs, "w2_weight_scale_2": vector, "w2_input_scale": every,
           "g1_alphas": vector, "g1_alphas_up": vector, "g2_alphas": vector, "w13_input_scale_quant": scalar,
           "w2_input_scale_quant": scalar}
    return {**out, "g1_scale_c": vector} if trtllm else out


@dataclass(frozen=True)
class MoELayout:
    """SGLang's state of an NVFP4 FusedMoE layer for one source format and family: the interface of the MoE layout
    modules (``moe_trtllm``, ``moe_cutlass``: ``LAYOUT_ID``, ``BACKEND``, ``KERNELS``, ``to_runtime``, ...), under
    SGLang's names. ``BACKEND``: SGLang's MoE runner backend it is for; ``KERNELS``: its quantization method."""

    LAYOUT_ID: str
    BACKEND: str
    KERNELS: tuple[str, ...]
    source_format: str
    family: str
    WEIGHT_ONLY, LAYER_SCALE_FACTOR, INVERSE_READS = False, False, ()  # as moe_trtllm's / moe_cutlass's
    NAMED = True  # SGLang's names and scalars (ModelOpt's input scales every expert's): moe.moe_specs, verify
    read_as = None  # as moe_trtllm's / moe_cutlass's: the kernel reads the experts as stored

    @property
    def trtllm(self) -> bool:
        return self.BACKEND == "flashinfer_trtllm"

    @property
    def GATE_UP_REFUSAL(self) -> str | None:  # noqa: N802
        """Why experts whose gate and up multipliers differ are refused (bundle.layers' ``moe_gate_up``): SGLang's
        CUTLASS paths scale both halves with gate's alpha; TRT-LLM-gen holds both (``g1_alphas``, ``g1_scale_c``)."""
        if self.trtllm:
            return None
        return ("SGLang 0.5.23's FlashInfer CUTLASS MoE scales both halves with {gate}'s and would mis-scale {up} "
                "(its FlashInfer TRT-LLM-gen, ModelOpt on sm100, holds both)")

    @property
    def TP_ALIGNMENT(self) -> int:  # noqa: N802
        """TRT-LLM-gen pads each rank's intermediate share to 64 before loading (``create_weights``), so the loader
        cuts the checkpoint's rows at that padded share (bundle.layers.plan_experts)."""
        return moe_trtllm.INTERMEDIATE_ALIGNMENT if self.trtllm else 1

    @property
    def TENSORS(self) -> tuple[str, ...]:  # noqa: N802 (the layout modules' name)
        """Every name the layout may store (which of them a layer stores depends on its shape: :meth:`aliases`)."""
        return tuple(dict.fromkeys([*self.runtime_specs(1, 16, 16), *self._weight_names(True)]))

    def _weight_names(self, every: bool = False) -> tuple[str, ...]:
        names = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
        return names + (tuple(MOE_SCALE_ALIASES) if every and self.source_format == "modelopt" and not self.trtllm
                        else ())

    def aliases(self, hidden: int, intermediate: int) -> dict[str, str]:
        """Name -> the stored name whose tensor SGLang holds under it too (one storage, not stored twice): TRT-LLM-gen
        aliases the swizzled-scale placeholders to the scales; ModelOpt's CUTLASS path writes the swizzled scales
        into the loaded scales' storage where their shapes agree (``alias_or_bind_derived_param``)."""
        if self.source_format == "compressed-tensors":
            return dict(CT_MOE_SCALAR_ALIASES)
        if self.trtllm:
            return dict(MOE_SCALE_ALIASES)
        same = self._same_shape(hidden, intermediate)
        return {alias: name for alias, name in MOE_SCALE_ALIASES.items() if same[name]}

    @staticmethod
    def _same_shape(hidden: int, intermediate: int) -> dict[str, bool]:
        """Whether the 128x4-swizzled scales have the loaded shape (no row or column padding)."""
        k13, k2 = hidden // BLOCK_SIZE, intermediate // BLOCK_SIZE
        return {"w13_weight_scale": (2 * intermediate) % 128 == 0 and k13 % 4 == 0,
                "w2_weight_scale": hidden % 128 == 0 and k2 % 4 == 0}

    def check_shape(self, experts: int, hidden: int, intermediate: int, name: str = "MoE layer") -> None:
        """SGLang's refusals, in one line: TRT-LLM-gen needs the hidden size a multiple of 128 (it pads none; FlashInfer's
        block-scale shuffle asserts it), ModelOpt's CUTLASS path 2I a multiple of 128 (it pads no gated halves)."""
        if self.trtllm and hidden % 128:
            raise RepackError(f"{name}: SGLang 0.5.23's FlashInfer TRT-LLM-gen MoE refuses this layer: hidden size "
                              f"{hidden} must be a multiple of 128 (SGLang pads none, and FlashInfer's scale shuffle "
                              "asserts it)")
        if self.source_format == "modelopt" and not self.trtllm and (2 * intermediate) % 128:
            raise RepackError(f"{name}: SGLang 0.5.23's FlashInfer CUTLASS MoE refuses this layer: 2 x intermediate "
                              f"size per rank (2 x {intermediate}) must be a multiple of 128 (it pads no gated halves)")

    def to_runtime(self, stack: ExpertStack, name: str = "MoE layer",
                   parts: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors SGLang holds on the FusedMoE module, by its names (``parts``: only these), aliases once."""
        hidden, inter = stack.hidden, stack.intermediate
        self.check_shape(stack.experts, hidden, inter, name)
        parts = list(self.runtime_specs(stack.experts, hidden, inter)) if parts is None else parts
        weights = [p for p in parts if p in self._weight_names(True)]
        if self.trtllm:
            got = moe_trtllm.to_runtime(stack, name, weights, hidden_alignment=TRTLLM_HIDDEN_ALIGNMENT)
        else:
            got = self._cutlass(stack, weights)
        if len(weights) < len(parts):
            got.update(_modelopt_moe_scalars(stored_scales(stack), self.trtllm) if self.source_format == "modelopt"
                       else _ct_moe_scalars(stored_scales(stack)))
        return {part: got[part] for part in parts}

    def _cutlass(self, stack: ExpertStack, parts: Collection[str]) -> dict[str, torch.Tensor]:
        """The CUTLASS path's weights: moe_cutlass's bytes (codes in [up; gate], each expert's scales swizzled); where
        ModelOpt's swizzled scales do not fit the loaded shape, ``w*_weight_scale`` keep the loaded ones ([up; gate])
        and ``w*_blockscale_swizzled`` hold the swizzled."""
        same = self._same_shape(stack.hidden, stack.intermediate)
        swizzled = {"w13": lambda: swizzle_experts(w3w1(stack.w13_scales)), "w2": lambda: swizzle_experts(stack.w2_scales)}
        loaded = {"w13": lambda: w3w1(stack.w13_scales).contiguous(), "w2": lambda: stack.w2_scales.contiguous()}
        make: dict[str, Callable[[], torch.Tensor]] = {
            "w13_weight": lambda: w3w1(stack.w13_codes).contiguous(), "w2_weight": lambda: stack.w2_codes.contiguous()}
        for which in ("w13", "w2"):
            kept = self.source_format == "modelopt" and not same[f"{which}_weight_scale"]
            make[f"{which}_weight_scale"] = loaded[which] if kept else swizzled[which]
            make[f"{which}_blockscale_swizzled"] = swizzled[which]
        return {part: make[part]() for part in parts}

    def codes_from_pieces(self, which: str, pieces: Sequence[tuple[torch.Tensor, ...]], hidden: int,
                          intermediate: int) -> torch.Tensor:
        if self.trtllm:
            return moe_trtllm.codes_from_pieces(which, pieces, hidden, intermediate, TRTLLM_HIDDEN_ALIGNMENT)
        return moe_cutlass.codes_from_pieces(which, pieces, hidden, intermediate)

    def _layout_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """SGLang's weight tensors by the FlashInfer layout's names (its swizzled scales under ``w*_weight_scale``)."""
        return {"w13_weight": tensors["w13_weight"], "w2_weight": tensors["w2_weight"],
                **{f"{w}_weight_scale": tensors.get(f"{w}_blockscale_swizzled", tensors[f"{w}_weight_scale"])
                   for w in ("w13", "w2")}}

    def from_runtime(self, tensors: dict[str, torch.Tensor], hidden: int, intermediate: int) -> ExpertCodes:
        """Exact inverse of :meth:`to_runtime` on codes and block scales."""
        held = self._layout_tensors(tensors)
        if self.trtllm:
            return moe_trtllm.from_runtime(held, hidden, intermediate, TRTLLM_HIDDEN_ALIGNMENT)
        return moe_cutlass.from_runtime(held, hidden, intermediate)

    def decode_expert(self, tensors: dict[str, torch.Tensor], expert: int, which: str, hidden: int,
                      intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._layout_tensors(tensors)
        if self.trtllm:
            return moe_trtllm.decode_expert(held, expert, which, hidden, intermediate, TRTLLM_HIDDEN_ALIGNMENT)
        return moe_cutlass.decode_expert(held, expert, which, hidden, intermediate)

    def kernel_scalars(self, tensors: dict[str, torch.Tensor], expert: int,
                       which: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """What SGLang's FP4 x FP4 MoE kernel scales local expert ``expert``'s ``which`` (``w13``, ``w2``) GEMM by,
        from the layer's non-weight tensors (``tensors``, by SGLang's names): each projection's alpha (gate and up; down)
        and the global scale its activations are quantized with (``w13_input_scale_quant``: one for every expert, or
        compressed-tensors' each expert's). TRT-LLM-gen reads the up half's alpha only folded with GEMM2's input
        quantization into ``g1_scale_c`` (``output1_scale_scalar``): up's alpha is its ratio to
        ``w2_input_scale_quant``, float64; the CUTLASS paths scale both halves by ``g1_alphas``."""
        held = {**{alias: tensors[name] for alias, name in CT_MOE_SCALAR_ALIASES.items() if name in tensors}, **tensors}

        def value(name: str) -> torch.Tensor:
            return held[name][expert] if held[name].dim() else held[name]

        quantizer = value(f"{which}_input_scale_quant")
        if which == "w2":
            return (value("g2_alphas"),), quantizer
        gate = value("g1_alphas")
        up = value("g1_scale_c").double() / value("w2_input_scale_quant").double() if self.trtllm else gate
        return (gate, up), quantizer

    def runtime_specs(self, experts: int, hidden: int, intermediate: int,
                      num_experts: int | None = None) -> dict[str, TensorSpec]:
        """dtype and shape of every tensor a layer stores (its aliases not: :meth:`aliases`), for ``experts`` of the
        layer's ``num_experts`` (ModelOpt's input scales are every expert's: SGLang loads them all)."""
        if self.trtllm:
            specs = moe_trtllm.runtime_specs(experts, hidden, intermediate, TRTLLM_HIDDEN_ALIGNMENT)
        else:
            specs = moe_cutlass.runtime_specs(experts, hidden, intermediate)
        weights = {name: specs[name] for name in self._weight_names()}
        if self.source_format == "modelopt" and not self.trtllm:
            for which, rows, k in (("w13", 2 * intermediate, hidden), ("w2", hidden, intermediate)):
                weights[f"{which}_blockscale_swizzled"] = specs[f"{which}_weight_scale"]
                weights[f"{which}_weight_scale"] = TensorSpec(torch.float8_e4m3fn, (experts, rows, k // BLOCK_SIZE))
        aliased = self.aliases(hidden, intermediate)
        every = {**weights, **_moe_scalar_specs(self.source_format, self.trtllm, experts, num_experts or experts)}
        return {name: spec for name, spec in every.items() if name not in aliased}


def moe_variant(target: Target) -> MoELayout:
    """SGLang's MoE layout for ``target`` (an SGLang W4A4 layout of a family, :func:`variants`; its weight-only layouts
    take :func:`marlin_moe_variant`), or a one-line refusal."""
    key = (target.source_format, target.name)
    if key not in SGLANG_MOE_LAYOUTS:
        raise RepackError(f"--engine sglang -t {target.name}: NVFP4 MoE layers are not written for SGLang there")
    return MoELayout(SGLANG_MOE_LAYOUTS[key], SGLANG_MOE_BACKENDS[key], (MOE_METHODS[target.source_format],),
                     target.source_format, target.name)


MOE_REFUSED_ARCHITECTURES = {
    "MixtralForCausalLM": "SGLang 0.5.23 loads a ModelOpt Mixtral's experts as dense layers (QuantMixtralForCausalLM) "
                          "and a compressed-tensors one's gate/up/down_proj experts not at all (its FusedMoE maps only "
                          "w1/w2/w3): serve it from the source",
}


def check_sglang_moe_architecture(config: dict, moe_modules: Collection[str], backend: str) -> None:
    """A one-line refusal of an MoE architecture whose SGLang load is not checked here (or not an NVFP4 FusedMoE) on
    the MoE runner ``backend``, of a checkpoint whose dense MLP layers SGLang builds as FusedMoE
    (``SGLANG_ALL_LAYERS_MOE``; ``moe_modules``: the source's FusedMoE layers, ``model.layers.N.mlp.experts``), and of
    one whose shared expert SGLang fuses into the FusedMoE (``SGLANG_FUSED_SHARED_EXPERT``)."""
    arch = (config.get("architectures") or ["?"])[0]
    if backend in SGLANG_MOE_UNCHECKED_BACKENDS.get(arch, ()):
        raise RepackError(f"--engine sglang: {arch} MoE checkpoints on SGLang's {backend} MoE are not checked against "
                          "its load here (the producers' fixture, hidden size 64, is refused there); not written")
    counts = (config.get("n_routed_experts"), config.get("n_shared_experts"))
    if counts == SGLANG_FUSED_SHARED_EXPERT.get(arch):
        raise RepackError(f"--engine sglang: SGLang 0.5.23 fuses the shared expert of a {arch} with {counts[0]} routed "
                          f"experts and {counts[1]} shared one into its FusedMoE as one more expert (on sm80 and up); "
                          "that state is not written")
    if arch in SGLANG_ALL_LAYERS_MOE:
        sparse = {int(m.split(".")[2]) for m in moe_modules}
        dense = [i for i in range(int(config.get("num_hidden_layers", 0))) if i not in sparse]
        if dense:
            raise RepackError(f"--engine sglang: {arch} layer {', '.join(map(str, dense))} has a dense MLP "
                              f"(mlp_only_layers / decoder_sparse_step), but SGLang 0.5.23 builds every {arch} layer "
                              "as MoE: it would load no experts there and drop the dense MLP; serve it with vLLM")
    if arch in SGLANG_MOE_ARCHITECTURES:
        return
    why = MOE_REFUSED_ARCHITECTURES.get(arch, f"its SGLang load is not checked here yet; written for SGLang: "
                                              f"{', '.join(SGLANG_MOE_ARCHITECTURES)}")
    raise RepackError(f"--engine sglang: {arch} MoE checkpoints are not written for SGLang: {why}")
