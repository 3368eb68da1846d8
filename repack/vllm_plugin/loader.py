"""``--load-format nvfp4_repack``: vLLM builds its model from a bundle, and no layer's NVFP4 weights are repacked.

vLLM's normal load is: build the model, feed checkpoint tensors through each parameter's weight loader (which
fuses q/k/v and gate/up and cuts this rank's shard), then ``process_weights_after_loading``, where every NVFP4
layer's scheme turns its per-partition global scales into one multiplier and its kernel pads, swizzles and
repacks the weight into the kernel's layout. A bundle already holds that layout for this rank, so this loader:

1. refuses, in one line, a bundle this stack cannot serve (see :func:`open_rank_bundle`);
2. builds vLLM's model as ``DefaultModelLoader`` does (from the bundle's config.json);
3. for each quantized layer: makes the layer's NVFP4 kernel the one the bundle was made for, points the
   scheme's weight and block-scale parameters at the bundle's tensors, and sets its per-partition global
   scales so that the scheme derives the bundle's multiplier;
4. for each layer with online transforms (vLLM builds their modules from the bundle's transform_config): copies
   the bundle's matrices, already normalized, into the tensors vLLM shares between partitions and layers, and
   marks them normalized (:func:`_install_transforms`);
5. loads every other tensor through vLLM's own weight loaders (``model.load_weights``);
6. for each FusedMoE module (MoE bundles): refuses what vLLM would hold otherwise and hooks its MoE post-load so
   that vLLM's expert conversion returns the bundle's tensors (:mod:`.experts`);
7. runs vLLM's ``process_weights_after_loading`` unchanged, except that for the bundle's layers the kernel's
   ``process_weights_after_loading`` (the padding, swizzle and FlashInfer repack) is replaced, for that one
   call, by :func:`_restore`: it installs the bundle's multiplier and the state the kernel keeps beside its
   tensors (``weights_padding_cols``; on sm100 the 6-D scale view over the stored buffer);
8. on sm90, hands each layer's online input transform to this project's kernel class, which applies it inside
   its kernels (:func:`_kernels_take_input_transforms`); sm100 and sm120 run vLLM's transform method as it is,
   QuTLASS's (``QutlassNvFP4LinearMethod``) too: on a W4A4 bundle its post-load derives ``fused_alpha``,
   ``fused_global_scale`` and ``hadamard_matrix`` from what this loader installed, as from the source.

Everything else vLLM does after loading (its schemes' Python-side state, W4A4 activation scales, KV-cache
scales, attention, tied embeddings, the model's own hook) runs as in a load from the source. vLLM's
``weights_already_processed()`` route skips all of it instead, and compressed-tensors layers refuse it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Iterator

import torch
import vllm
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel, NvFp4LinearLayerConfig
from vllm.model_executor.layers.fusion.quant_activation import expose_input_quant_key
from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from ..bundle.manifest import MANIFEST_NAME, LayerRecord
from ..bundle.reader import Bundle, open_bundle, rank_dir
from ..errors import RepackError
from ..targets import Target
from ..targets.engines import check_running
from ..targets.families import linear_backend
from .experts import check_kept_scales, check_method, check_placement, moe_modules, preimage, serve_experts
from .kernels import MARLIN_KERNEL, kernel_class

LOAD_FORMAT = "nvfp4_repack"
HUMMING = "HummingNvFP4HadamardLinearMethod"  # vLLM 0.34's method for Hadamard-rotated W4A4 layers on Blackwell

# Per vLLM quantization method: the NVFP4 scheme's parameters that its process step reads before the
# kernel runs (packed codes, block scales, per-partition global scale, and for W4A4 the per-partition activation
# scale), and whether the global scales are stored as reciprocals (compressed-tensors: its input_global_scale is
# vLLM's input_global_scale_inv) or as the multipliers themselves (ModelOpt: its input_scale is input_global_scale).
SCHEME_PARAMS: dict[str, tuple[str, str, str, bool, str]] = {
    "modelopt_fp4": ("weight", "weight_scale", "weight_scale_2", False, "input_scale"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", True, "input_global_scale"),
}


def running_capability() -> tuple[int, int] | None:
    capability = current_platform.get_device_capability()
    return None if capability is None else (capability.major, capability.minor)


def open_rank_bundle(path: str | Path, tp_size: int, tp_rank: int) -> Bundle:
    """This rank's bundle under ``path``, or a one-line refusal naming what to run instead."""
    root = Path(path)
    folder = rank_dir(root, tp_rank)
    if not (folder / MANIFEST_NAME).is_file():
        raise RepackError(
            f"{root} is not an nvfp4-repack bundle (no {MANIFEST_NAME}); convert it first with "
            f"'nvfp4-repack convert {root} --target TARGET --fuse --tp {tp_size}', or serve the source with "
            f"--load-format auto"
        )
    bundle = open_bundle(folder)
    manifest = bundle.manifest
    if bundle.target.engine != "vllm":
        raise RepackError(f"{folder}: the bundle holds {bundle.target.engine}'s state ({manifest.layout_id}), not "
                          f"vLLM's; serve it with {bundle.target.engine}, or re-convert without --engine")
    if (manifest.tp_size, manifest.tp_rank) != (tp_size, tp_rank if manifest.tp_size > 1 else 0):
        raise RepackError(
            f"{folder}: the bundle is rank {manifest.tp_rank} of tensor-parallel size {manifest.tp_size}, but vLLM "
            f"runs rank {tp_rank} of --tensor-parallel-size {tp_size}; serve it with --tensor-parallel-size "
            f"{manifest.tp_size} or re-convert with --tp {tp_size}"
        )
    if not manifest.fusion:
        raise RepackError(
            f"{folder}: the bundle keeps the checkpoint's unfused modules (q/k/v_proj, gate/up_proj); vLLM holds "
            f"qkv_proj and gate_up_proj: re-convert with --fuse"
        )
    check_engine(bundle, vllm.__version__)
    _check_device(bundle.target)
    _check_flashinfer(bundle)
    return bundle


def check_engine(bundle: Bundle, running: str) -> None:
    """A bundle is served by the vLLM versions its manifest lists (``engines``, targets/engines.py) only: their state
    after loading is the bundle's; another version's may differ (0.34 serves Hadamard-rotated W4A4 layers with
    Humming's own layout)."""
    check_running("vllm", bundle.manifest.engines.get("vllm", []), running, bundle.root)


def is_marlin(target: Target) -> bool:
    """Whether the bundle's layout is Marlin's (sm80 / sm75 families; their W4A4 variants too)."""
    return MARLIN_KERNEL in target.kernels


def _check_device(target: Target) -> None:
    """A bundle runs on its own GPU family only; on a CPU-only host (tests) there is no family to check. Marlin's
    layout runs on every GPU from sm75 where vLLM runs Marlin (its auto below sm90 and for weight-only checkpoints on
    sm120; --linear-backend / --moe-backend marlin elsewhere)."""
    capability = running_capability()
    if capability is not None and is_marlin(target) and capability >= (7, 5):
        return
    if capability is not None and capability not in target.compute_capabilities:
        have = f"sm{capability[0]}{capability[1]}"
        raise RepackError(
            f"this bundle is for {target.name} ({', '.join(f'sm{a}{b}' for a, b in target.compute_capabilities)}) "
            f"but this GPU is {have}; convert the source with --target {have}"
        )


def _check_flashinfer(bundle: Bundle) -> None:
    """A FlashInfer layout is served only by the FlashInfer releases it was checked against."""
    if bundle.target.backend != "flashinfer":
        return
    try:
        installed = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        installed = "none"
    if installed not in bundle.manifest.flashinfer_versions:
        raise RepackError(
            f"{bundle.root}: the {bundle.manifest.layout_id} layout was checked against FlashInfer "
            f"{', '.join(bundle.manifest.flashinfer_versions)}, but flashinfer-python {installed} is installed; "
            f"install one of those or re-convert with an nvfp4-repack that knows {installed}"
        )


def _kernel_holder(module: nn.Module) -> object | None:
    """The object whose ``kernel`` is the layer's NVFP4 kernel (ModelOpt: the quant method; CT: the scheme)."""
    for holder in (getattr(module, "quant_method", None), getattr(module, "scheme", None)):
        if isinstance(getattr(holder, "kernel", None), NvFp4LinearKernel):
            return holder
    return None


def _nvfp4_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if _kernel_holder(module) is not None}


def _stored_reciprocal(multiplier: torch.Tensor) -> torch.Tensor:
    """A float32 ``g`` with ``1 / g == multiplier`` in float32, so compressed-tensors' ``1 / max(g)`` rebuilds the
    bundle's multiplier exactly (and with it W4A4's ``alpha``); one of the neighbours of ``1 / m`` is such a ``g``
    whenever ``m`` itself was a float32 reciprocal, as a compressed-tensors multiplier is."""
    return preimage(multiplier, lambda g: 1.0 / g, (1.0 / multiplier.double()).float())


def _restore(layer: nn.Module, kernel: NvFp4LinearKernel, target: Target, record: LayerRecord,
             multiplier: torch.Tensor) -> None:
    """What the kernel's ``process_weights_after_loading`` leaves beside the bundle's tensors, and no repack. The
    W4A4 kernels keep nothing beside their padded weight and swizzled scales (the scheme's scalars are vLLM's own,
    computed from the partition scales :meth:`BundleModelLoader._install` set). Marlin replaces the global scale by
    its folded one (``multiplier``: the bundle's), pads and permutes a bias (:func:`_marlin_bias`) and keeps nothing
    else."""
    if is_marlin(target):
        replace_parameter(layer, "weight_global_scale", multiplier)
        _marlin_bias(layer)
    elif target.scheme == "W4A16":
        if target.name == "sm100":
            from ..runtime.backends.flashinfer import sm100_scale_view

            geometry = target.geometry(record.n, record.k)
            replace_parameter(layer, "weight_scale", sm100_scale_view(layer.weight_scale.data, geometry.n_padded,
                                                                      geometry.k_padded))
        replace_parameter(layer, "weight_global_scale", multiplier)
        layer.weights_padding_cols = record.weights_padding_cols
    del kernel.process_weights_after_loading  # the instance hook; the class's method is untouched


def _marlin_bias(layer: nn.Module) -> None:
    """A layer's bias (Qwen2's q/k/v: the checkpoint's, which vLLM's own loader fused and cut) as FP4 Marlin's
    ``prepare_fp4_layer_for_marlin`` leaves it: padded to Marlin's N and permuted, by vLLM's own functions (no NVFP4
    state: a bundle passes biases through, as for SGLang)."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils

    if getattr(layer, "bias", None) is None:
        return
    n = layer.output_size_per_partition
    padded_n, _ = marlin_utils.marlin_padded_nk(n, layer.input_size_per_partition, 16)
    replace_parameter(layer, "bias", marlin_utils.marlin_permute_bias(marlin_utils.marlin_pad_dim(layer.bias, n,
                                                                                                  padded_n)))


def _install_transforms(module: nn.Module, prefix: str, bundle: Bundle, installed: set[int]) -> None:
    """Give the layer's online-transform modules (vLLM builds them from the bundle's transform_config) the bundle's
    matrices, copied into vLLM's own tensors so that its sharing between partitions and layers stays as it built
    it; each is marked as normalized, so vLLM's post-load does not divide it by sqrt(block) a second time.
    ``installed``: the tensors this load has filled (a shared one must get one value)."""
    held = {f"{name}.weight.partitions.{i}": partition
            for name, child in module.named_children() if isinstance(child, HadamardTransform)
            for i, partition in child.weight.partitions.items()}
    stored = bundle.vllm_transforms(prefix)
    if set(held) != set(stored):
        missing = sorted(set(held) ^ set(stored))[0]
        raise RepackError(f"{prefix}.{missing}: vLLM's online transforms (from config.json's transform_config) are "
                          f"not the bundle's; re-convert the source with --fuse")
    with torch.no_grad():
        for name, partition in held.items():
            value = stored[name]
            if (partition.dtype, partition.shape) != (value.dtype, value.shape):
                raise RepackError(f"{prefix}.{name}: vLLM holds it as {partition.dtype} {list(partition.shape)}, "
                                  f"the bundle as {value.dtype} {list(value.shape)}; serve with --dtype "
                                  f"{str(value.dtype).removeprefix('torch.')}")
            pointer = partition.data_ptr()
            if pointer in installed and not torch.equal(partition, value.to(partition.device)):
                raise RepackError(f"{prefix}.{name}: differs from the matrix vLLM shares it with; run verify")
            partition.copy_(value)
            installed.add(pointer)
            HadamardTransform.scaled_data_ptrs.add(pointer)


def _kernels_take_input_transforms(model: nn.Module, bundle: Bundle) -> None:
    """sm90: each layer's online input transform runs inside this project's kernel class (its activation pre-pass
    and in-kernel Walsh-Hadamard) instead of vLLM's separate dense GEMM or hadacore call before it; vLLM's transform
    module keeps its state, its method stops calling it. Output transforms stay vLLM's."""
    from vllm.model_executor.layers.quantization.compressed_tensors.transform.linear import (  # circular at import
        CompressedTensorsLinearTransformMethod,
    )

    for prefix, module in _nvfp4_layers(model).items():
        method = module.quant_method
        inputs = [t for t in bundle.layer(prefix).transforms if t.location == "input"]
        if inputs and type(method) is CompressedTensorsLinearTransformMethod and method.input_transform is not None:
            _kernel_holder(module).kernel.take_input_transform(module, bundle.transform_matrix(inputs[0].matrix))
            method.input_transform = None


def _check_w4a4_kernel(bundle: Bundle, chosen: str) -> None:
    """A W4A4 bundle keeps the kernel vLLM picked (its ``auto``: cute-dsl on sm10x, FlashInfer CUTLASS on sm12x, Marlin
    below sm90; ``--linear-backend marlin`` for Marlin's W4A4 variant elsewhere) when that kernel reads the bundle's
    layout; any other is refused, naming the --linear-backend that picks the bundle's kernel."""
    if chosen not in bundle.target.kernels:
        wanted = linear_backend(bundle.target.kernels[0])
        raise RepackError(
            f"{bundle.root}: vLLM chose {chosen} for this W4A4 bundle, but its {bundle.manifest.layout_id} layout is "
            f"read by {', '.join(bundle.target.kernels)} only; serve it with --linear-backend {wanted}, or re-convert "
            f"for {chosen}"
        )


def _refuse_qutlass(prefix: str, module: nn.Module, bundle: Bundle) -> None:
    """vLLM gives a layer with a block-16..128 input Hadamard QutlassNvFP4LinearMethod on Blackwell, whose FP4 x FP4
    GEMM a W4A16 bundle's layout does not feed. For a W4A4 checkpoint converted with --weight-only the W4A4 bundle
    serves; a weight-only (NVFP4A16) checkpoint gets the same method in vLLM 0.33 (``is_qutlass_fp4_scheme`` does
    not look at ``use_a16``), which its source's load would run on the W4A16 kernel's weights too."""
    if getattr(module.scheme, "use_a16", False):
        raise RepackError(f"{prefix}: vLLM 0.33 gives this weight-only (NVFP4A16) layer with its input Hadamard "
                          f"QutlassNvFP4LinearMethod on this GPU, an FP4 x FP4 GEMM that a weight-only checkpoint "
                          f"cannot feed (its own load of the source does the same); serve it on sm90 or with a vLLM "
                          f"that keeps such layers on the W4A16 kernel")
    raise RepackError(f"{prefix}: vLLM serves this W4A4 layer with its input Hadamard through "
                      f"QutlassNvFP4LinearMethod, whose W4A4 GEMM the bundle's {bundle.manifest.layout_id} layout "
                      f"does not feed; re-convert without --weight-only")


class BundleModelLoader(BaseModelLoader):
    """Loads an nvfp4-repack bundle (``vllm serve BUNDLE --load-format nvfp4_repack``)."""

    def _bundle(self, model_config: ModelConfig) -> Bundle:
        if get_pp_group().world_size != 1:
            raise RepackError(f"the {LOAD_FORMAT} loader does not support pipeline parallelism; use "
                              f"--pipeline-parallel-size 1")
        return open_rank_bundle(model_config.model, get_tensor_model_parallel_world_size(),
                                get_tensor_model_parallel_rank())

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: a bundle is a local folder (vLLM may call this before its distributed state
        exists, so the refusals run in ``load_model``)."""

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        self._restored: set[str] = set()
        self._opened = self._bundle(model_config)  # refuse before vLLM allocates anything
        model = super().load_model(vllm_config, model_config, prefix)
        missed = sorted({*self._opened.manifest.layers, *self._opened.moe_layers()} - self._restored)
        if missed:
            raise RepackError(f"vLLM never post-processed bundle layer {missed[0]!r} ({len(missed)} in all)")
        if self._opened.target.name == "sm90":
            _kernels_take_input_transforms(model, self._opened)
        return model

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        bundle = getattr(self, "_opened", None) or self._bundle(model_config)
        names = SCHEME_PARAMS.get(model_config.quantization)
        if names is None:
            raise RepackError(f"vLLM reads this bundle as {model_config.quantization!r} quantization; bundles are "
                              f"served as one of {', '.join(SCHEME_PARAMS)}")
        layers = _nvfp4_layers(model)
        extra = sorted(set(bundle.manifest.layers) - set(layers))
        if extra:
            raise RepackError(f"{bundle.root}: layer {extra[0]!r} is not an NVFP4 layer of vLLM's "
                              f"{type(model).__name__}; was the bundle converted with --fuse for this model?")
        absent = sorted(set(layers) - set(bundle.manifest.layers))
        if absent:
            raise RepackError(f"{bundle.root}: vLLM's NVFP4 layer {absent[0]!r} has no tensors in the bundle")
        qutlass = [name for name, module in layers.items()
                   if type(module.quant_method).__name__ == "QutlassNvFP4LinearMethod"]
        if qutlass and bundle.target.scheme != "W4A4":  # QuTLASS's FP4 x FP4 GEMM reads the W4A4 layout only
            _refuse_qutlass(qutlass[0], layers[qutlass[0]], bundle)
        humming = [name for name, module in layers.items() if type(module.quant_method).__name__ == HUMMING]
        if humming:  # convert refuses these for 0.34 (engines.py): a bundle listing 0.34 never reaches here
            raise RepackError(f"{humming[0]}: vLLM {vllm.__version__} serves this W4A4 layer with its input Hadamard "
                              f"through {HUMMING}, whose layout Humming's CUDA ops make at load and no bundle holds; "
                              f"serve it with vLLM 0.33 (convert --vllm 0.33)")
        self._install_experts(model, bundle)
        installed: set[int] = set()
        for name, module in layers.items():
            self._install(module, name, bundle, names)
            _install_transforms(module, name, bundle, installed)
        model.load_weights(self._passthrough(bundle))

    def _install_experts(self, model: nn.Module, bundle: Bundle) -> None:
        """Each FusedMoE module gets the bundle's tensors through its own post-load (:func:`serve_experts`), after
        one-line refusals of what vLLM would hold otherwise (another backend, other experts or sizes per rank, a
        loaded scale it keeps that the bundle lacks)."""
        modules, records = moe_modules(model), bundle.moe_layers()
        extra = sorted(set(records) - set(modules))
        if extra:
            raise RepackError(f"{bundle.root}: {extra[0]!r} is not a FusedMoE module of vLLM's "
                              f"{type(model).__name__}; was the bundle converted for this model?")
        absent = sorted(set(modules) - set(records))
        if absent:
            raise RepackError(f"{bundle.root}: vLLM's FusedMoE module {absent[0]!r} has no tensors in the bundle; "
                              f"MoE bundles are converted with --fuse for --target sm100, sm120 or sm80")
        for name, module in modules.items():
            record = records[name]
            check_method(name, module, record.backend)
            check_placement(name, module, record.expert_map, record.local_experts, record.intermediate)
            check_kept_scales(name, module, record.members, set(bundle.manifest.passthrough))
            serve_experts(name, module, bundle.moe_tensors(name), lambda name=name: self._restored.add(name))

    @staticmethod
    def _passthrough(bundle: Bundle) -> Iterator[tuple[str, torch.Tensor]]:
        for name in bundle.manifest.passthrough:
            yield name, bundle.read(name)

    def _install(self, module: nn.Module, prefix: str, bundle: Bundle, names: tuple[str, str, str, bool, str]) -> None:
        """Give one vLLM layer the bundle's tensors and its target's kernel, and hook that kernel's post-load."""
        record = bundle.layer(prefix)
        if (module.output_size_per_partition, module.input_size_per_partition) != (record.n, record.k):
            raise RepackError(
                f"{prefix}: vLLM's layer is [N={module.output_size_per_partition}, "
                f"K={module.input_size_per_partition}] on this rank but the bundle's is [N={record.n}, K={record.k}]"
            )
        holder = _kernel_holder(module)
        dtype = str(module.params_dtype).removeprefix("torch.")
        if is_marlin(bundle.target) and dtype != bundle.target.dtype:
            raise RepackError(f"{prefix}: vLLM runs this model in {dtype}, the bundle's Marlin scales are for "
                              f"{bundle.target.dtype} activations; serve it with --dtype {bundle.target.dtype}")
        if bundle.target.scheme == "W4A4":
            _check_w4a4_kernel(bundle, type(holder.kernel).__name__)
        else:
            wanted = kernel_class(bundle.target)
            if type(holder.kernel) is not wanted:  # e.g. Marlin (vLLM's sm12x default) or a W4A4 kernel
                module.__dict__.pop("_input_quant_key", None)
                holder.kernel = wanted(NvFp4LinearLayerConfig())
                expose_input_quant_key(module, holder.kernel)
        runtime = bundle.runtime_layer(prefix)
        packed, scales, partition_scale, reciprocal, input_scale = names
        device = getattr(module, packed).device
        getattr(module, packed).data = runtime.weight.to(device)
        getattr(module, scales).data = runtime.weight_scale.to(device)
        multiplier = runtime.weight_global_scale.to(device)  # the kernel's (Marlin: folded)
        source = runtime.source_multiplier.to(device)
        getattr(module, partition_scale).data.fill_(float(_stored_reciprocal(source) if reciprocal else source))
        if bundle.target.scheme == "W4A4":  # the scheme's max over these is the bundle's scale (or inverse)
            stored = runtime.input_global_scale_inv if reciprocal else runtime.input_global_scale
            getattr(module, input_scale).data.fill_(float(stored))
        kernel = holder.kernel

        def restore(layer: nn.Module) -> None:
            _restore(layer, kernel, bundle.target, record, multiplier)
            self._restored.add(prefix)

        kernel.process_weights_after_loading = restore
