"""SGLang 0.5.23's dense NVFP4 W4A4 state, as engine data over the W4A4 layout vLLM's kernels share (:mod:`.w4a4`).

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

Names, scalars and padding rules only: the layout math is :mod:`.w4a4`'s and :mod:`.layout`'s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..errors import RepackError
from ..nvfp4 import BLOCK_SIZE, NVFP4Weight
from . import w4a4
from .base import LayerGeometry, RuntimeLayer, Target, TensorSpec
from .engines import (
    SGLANG_0523,
    SGLANG_BF16_FP4_LAYOUT,
    SGLANG_DENSE_BACKENDS,
    SGLANG_LAYOUTS,
    SGLANG_MARLIN_FAMILIES,
    SGLANG_MARLIN_LAYOUTS,
    SGLANG_SAME_STATE_BACKENDS,
    SGLANG_WEIGHT_ONLY_FAMILIES,
)
from .layout import pad_2d, swizzle_128x4, swizzled_scale_shape

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


def variants(family: Target) -> tuple[Target, ...]:
    """``family``'s SGLang layouts, one per source format (empty where SGLang has no dense W4A4 backend)."""
    if family.name not in DENSE_BACKENDS:
        return ()
    base = w4a4.variant(family)
    return tuple(
        replace(base, layout_id=layout, engine=ENGINE, source_format=fmt, kernels=(DENSE_BACKENDS[family.name],),
                to_runtime=lambda weight, f=fmt: to_runtime(f, weight),
                from_runtime=lambda layer, n, k, f=fmt: from_runtime(f, layer, n, k),
                partition_specs=lambda n, k, parts, f=fmt: partition_specs(f, n, k, parts),
                from_named=lambda tensors, n, k, f=fmt: from_named(f, tensors, n, k))
        for fmt, layout in LAYOUTS.items())


# --- weight-only: FP4 Marlin (prepare_nvfp4_layer_for_marlin) and FlashInfer's bf16 x fp4 GEMM ---
# SGLang's FP4 Marlin holds the bytes of vLLM's Marlin layout (targets/marlin.py: padding, gptq_marlin_repack, the
# permuted S0E5M3 scales) with neither vLLM's power-of-two scale factor nor its flush of the smallest scales, and the
# global scale in bf16 (nvfp4_marlin_process_global_scale of the multiplier cast to the activation dtype, [1]).
MARLIN_DTYPE = torch.bfloat16  # the models' activation dtype on sm80 and up
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
# Marlin; ModelOpt W4A4 below sm100: Marlin only, its other backends refuse there)
_NOT_BF16_FP4 = ("flashinfer_cutlass", "flashinfer_trtllm", MARLIN_KERNEL)
BACKENDS = {SGLANG_MARLIN_LAYOUTS["modelopt", "W4A16"]: (*SGLANG_SAME_STATE_BACKENDS, "flashinfer_trtllm", MARLIN_KERNEL),
            SGLANG_MARLIN_LAYOUTS["compressed-tensors", "W4A16"]: _NOT_BF16_FP4,
            SGLANG_MARLIN_LAYOUTS["compressed-tensors", "W4A4"]: _NOT_BF16_FP4,
            SGLANG_MARLIN_LAYOUTS["modelopt", "W4A4"]: (MARLIN_KERNEL,),
            SGLANG_BF16_FP4_LAYOUT: ("flashinfer_cutedsl",)}


def backends(layout_id: str) -> tuple[str, ...]:
    """The ``--fp4-gemm-backend`` values under which SGLang holds ``layout_id``'s state (the plugin refuses others)."""
    return BACKENDS.get(layout_id, SAME_STATE_BACKENDS)


def marlin_global_scale(multiplier: torch.Tensor) -> torch.Tensor:
    """bf16 ``[1]``: ``nvfp4_marlin_process_global_scale(multiplier.to(bf16))``; refused where bf16 overflows."""
    from . import marlin

    held = (multiplier.reshape(()).to(torch.float32).to(MARLIN_DTYPE) * marlin.global_exponent(MARLIN_DTYPE)).reshape(1)
    if not torch.isfinite(held).all():
        raise RepackError(f"a multiplier of {float(multiplier.max()):g} overflows SGLang's bf16 Marlin global scale; "
                          "SGLang would hold inf")
    return held


def marlin_read(weight: NVFP4Weight) -> NVFP4Weight:
    """``weight`` as SGLang's Marlin reads it: the multiplier rounded to bf16 (its scales are kept as they are)."""
    return replace(weight, multiplier=weight.multiplier.to(MARLIN_DTYPE).to(torch.float32).reshape(1),
                   input_scale=None, partition_scales=None)


def marlin_to_runtime(source_format: str, scheme: str, weight: NVFP4Weight) -> RuntimeLayer:
    """The Marlin layout (targets/marlin.py's, without its factor and flush) of ``weight``, holding SGLang's tensors:
    ``weight``, ``weight_scale``, ``weight_global_scale`` (bf16 ``[1]``), and for a ModelOpt W4A4 checkpoint the
    activation scalars ``ModelOptFp4LinearMethod`` keeps beside them (``input_global_scale`` the largest input scale)."""
    from . import marlin

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
    from . import marlin

    held = tensors["weight_global_scale"].to(torch.float32)
    return RuntimeLayer(tensors["weight"], tensors["weight_scale"], held.reshape(()),
                        marlin.geometry(n, k).weights_padding_cols,
                        weight_multiplier=held / marlin.global_exponent(MARLIN_DTYPE), named=dict(tensors))


def marlin_from_runtime(layer: RuntimeLayer, n: int, k: int) -> NVFP4Weight:
    """The weight as SGLang's Marlin reads it, with the partition scales a ModelOpt W4A4 layer keeps."""
    from . import marlin

    weight = marlin.from_runtime(layer, n, k, MARLIN_DTYPE)
    named = layer.named or {}
    if "weight_scale_2" in named:
        weight = replace(weight, partition_scales=(named["weight_scale_2"], named["input_scale"]))
    return weight


def marlin_specs(scheme_format: tuple[str, str], n: int, k: int, parts: int) -> dict[str, TensorSpec]:
    from . import marlin

    specs = marlin.runtime_specs(n, k)
    out = {"weight": specs["weight"], "weight_scale": specs["weight_scale"],
           "weight_global_scale": TensorSpec(MARLIN_DTYPE, (1,))}
    if scheme_format == ("modelopt", "W4A4"):
        out |= {name: TensorSpec(torch.float32, ()) for name in ("alpha", "input_scale_inv", "input_global_scale")}
        out |= {name: TensorSpec(torch.float32, (parts,)) for name in ("input_scale", "weight_scale_2")}
    return out


def marlin_variant(family: Target, source_format: str, scheme: str) -> Target:
    """``family``'s SGLang FP4 Marlin layout for a ``scheme`` checkpoint of ``source_format``."""
    from . import marlin

    key = (source_format, scheme)
    return replace(Target.of(
        family, to_runtime=lambda weight: marlin_to_runtime(source_format, scheme, weight),
        from_runtime=marlin_from_runtime, runtime_specs=lambda n, k: marlin_specs(key, n, k, 1),
        geometry=marlin.geometry, scheme=scheme, engine=ENGINE, source_format=source_format,
        partition_specs=lambda n, k, parts: marlin_specs(key, n, k, parts), from_named=marlin_from_named,
        read_as=marlin_read, runtime_layout="sm80"),
        layout_id=SGLANG_MARLIN_LAYOUTS[key], kernels=(MARLIN_KERNEL,), backend="reference")


# compressed-tensors NVFP4A16 on sm100: prepare_bf16_fp4_weights(weight_packed, swizzle_blockscale(weight_scale),
# 1 / weight_global_scale, backend="cute-dsl") keeps the codes unpadded, the 128x4-swizzled scales (which FlashInfer
# wraps in a 6-D view: the plugin calls it again on the bundle's buffer) and alpha, the multiplier float32 [1].
def bf16_fp4_to_runtime(weight: NVFP4Weight) -> RuntimeLayer:
    named = {"weight": weight.codes.contiguous(), "weight_scale_interleaved": swizzle_128x4(weight.block_scales),
             "alpha": weight.multiplier.reshape(1).to(torch.float32).clone()}
    return bf16_fp4_from_named(named, weight.n, weight.k)


def bf16_fp4_from_named(tensors: dict[str, torch.Tensor], n: int, k: int) -> RuntimeLayer:
    """SGLang's tensors -> the sm100 cute-dsl layout's RuntimeLayer (vLLM's bytes: the codes padded to 64)."""
    from .layout import pad_codes, vllm_geometry

    geometry = vllm_geometry(n, k)
    return RuntimeLayer(pad_codes(tensors["weight"], geometry), tensors["weight_scale_interleaved"],
                        tensors["alpha"].reshape(1), geometry.weights_padding_cols, named=dict(tensors))


def bf16_fp4_specs(n: int, k: int, parts: int = 1) -> dict[str, TensorSpec]:
    return {"weight": TensorSpec(torch.uint8, (n, k // 2)),
            "weight_scale_interleaved": TensorSpec(torch.float8_e4m3fn, swizzled_scale_shape(n, k)),
            "alpha": TensorSpec(torch.float32, (1,))}


def bf16_fp4_variant(family: Target) -> Target:
    """sm100's SGLang layout for compressed-tensors NVFP4A16 (FlashInfer's bf16 x fp4 cute-dsl GEMM)."""
    from . import sm100

    return replace(Target.of(
        family, to_runtime=bf16_fp4_to_runtime, from_runtime=sm100.from_runtime, runtime_specs=bf16_fp4_specs,
        geometry=lambda n, k: LayerGeometry(n, k, 0), scheme="W4A16", engine=ENGINE,
        source_format="compressed-tensors", partition_specs=bf16_fp4_specs, from_named=bf16_fp4_from_named,
        runtime_layout="sm100"),
        layout_id=SGLANG_BF16_FP4_LAYOUT, kernels=("flashinfer_cutedsl",))


def weight_only_variants(family: Target) -> tuple[Target, ...]:
    """``family``'s SGLang weight-only layouts: ModelOpt W4A16_NVFP4 on Marlin everywhere, compressed-tensors NVFP4A16
    on FlashInfer's bf16 x fp4 (sm100) or Marlin, and where SGLang's auto backend is Marlin (sm80-sm90) the W4A4
    checkpoints it serves weight-only there."""
    if family.name not in SGLANG_WEIGHT_ONLY_FAMILIES:
        return ()
    out = [marlin_variant(family, "modelopt", "W4A16"),
           bf16_fp4_variant(family) if family.name == "sm100" else marlin_variant(family, "compressed-tensors", "W4A16")]
    if family.name in SGLANG_MARLIN_FAMILIES:
        out += [marlin_variant(family, fmt, "W4A4") for fmt in ("modelopt", "compressed-tensors")]
    return tuple(out)
