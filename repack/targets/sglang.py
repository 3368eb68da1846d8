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
from .base import RuntimeLayer, Target, TensorSpec
from .engines import SGLANG_0523, SGLANG_DENSE_BACKENDS, SGLANG_LAYOUTS, SGLANG_SAME_STATE_BACKENDS
from .layout import pad_2d

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


def _modelopt(layer: RuntimeLayer, n: int, k: int, stored: NVFP4Weight) -> dict[str, torch.Tensor]:
    weight_scale_2, input_scale = stored.partition_scales
    top_input, top_weight = input_scale.max(), weight_scale_2.max()
    out = {"weight": layer.weight, "weight_scale": layer.weight_scale,
           "alpha": (top_input * top_weight).to(torch.float32), "input_scale_inv": (1 / top_input).to(torch.float32),
           "input_scale": input_scale, "weight_scale_2": weight_scale_2}
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
