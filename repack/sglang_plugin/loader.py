"""``--load-format nvfp4_repack``: SGLang builds its model from a bundle, and no layer's NVFP4 weights are processed.

SGLang's normal load builds the model, feeds checkpoint tensors through each parameter's weight loader (fusing
q/k/v and gate/up, cutting this rank's shard), then runs each quantization method's ``process_weights_after_loading``
(per-partition scalars folded, weights padded, scales swizzled). A ``convert --engine sglang`` bundle holds that
post-load state for this rank, under SGLang's names, so this loader:

1. refuses, in one line, a bundle this SGLang cannot serve (another engine's, another GPU family's, another TP
   size, a dense FP4 backend that holds other bytes, or another SGLang version: :func:`.refusals.open_rank_bundle`);
2. builds SGLang's model as ``DefaultModelLoader`` does (from the bundle's config.json, its quantization config);
3. loads every other tensor through SGLang's own weight loaders (``model.load_weights``);
4. gives each bundle layer the bundle's tensors, under SGLang's names, with the aliases SGLang makes
   (``weight_scale_interleaved`` sharing ``weight_scale``'s storage) and the state it keeps beside them
   (``weights_padding_cols``; FP4 Marlin's bias padded and permuted), instead of running its
   ``process_weights_after_loading``; each FusedMoE module
   likewise (its aliases, the packed names compressed-tensors drops, and the non-tensor state SGLang's MoE
   post-load sets: :func:`_finish_moe`), once SGLang's MoE runner backend is the bundle's; every other module's
   post-load runs as in a load from the source.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.layers.moe.utils import get_moe_runner_backend
from sglang.srt.layers.quantization.fp4_utils import get_fp4_gemm_runner_backend
from sglang.srt.model_loader.loader import (
    DefaultModelLoader,
    _get_quantization_config,
    _initialize_model,
    _modules_with_quant_method,
    device_loading_context,
    set_default_torch_dtype,
)
from sglang.srt.runtime_context import get_parallel, get_platform
from sglang.version import __version__ as SGLANG_VERSION
from torch import nn

from ..bundle.reader import Bundle
from ..errors import RepackError
from ..targets.engines import SGLANG_MARLIN_MOE_LAYOUTS
from ..targets.sglang_marlin_moe import DELETED as MARLIN_MOE_DELETED
from ..targets.sglang import (
    ALIASES,
    ATTRIBUTES,
    DELETED,
    KEEPS_PADDING,
    LAYOUTS,
    MARLIN_KERNEL,
    SGLANG_BF16_FP4_LAYOUT,
)
from . import LOAD_FORMAT
from .refusals import open_rank_bundle


def route_load_format(original: Callable, config: LoadConfig) -> None:
    """Around ``LoadConfig._verify_load_format``: ``nvfp4_repack`` becomes :class:`BundleModelLoader` (a loader class,
    which ``get_model_loader`` instantiates); every other name goes through SGLang's check."""
    if isinstance(config.load_format, str) and config.load_format.lower() == LOAD_FORMAT:
        config.load_format = BundleModelLoader
        return None
    return original(config)


def _install(module: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str], padding: int | None) -> None:
    """The layer's post-load state: each tensor under its name (an existing parameter keeps its class), the aliases
    SGLang makes where the bundle stores one tensor for two names, and ``weights_padding_cols``."""
    for name, tensor in tensors.items():
        param = getattr(module, name, None)
        if isinstance(param, nn.Parameter):
            param.data = tensor
            param.requires_grad_(False)
        else:
            setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    for alias, name in aliases.items():
        if alias not in tensors:
            setattr(module, alias, getattr(module, name))
    if padding is not None:
        module.weights_padding_cols = padding


def _weight_only_state(module: nn.Module, layout: str, kernel: str, device: torch.device) -> None:
    """What SGLang's weight-only post-load leaves beside the tensors: the loaded parameters it deletes, its plain
    attributes, and FP4 Marlin's scratch ``workspace`` (SGLang's own ``marlin_make_workspace``, sized by the GPU)."""
    from sglang.srt.layers.quantization import marlin_utils_fp4

    for name in DELETED.get(layout, ()):
        if hasattr(module, name):
            delattr(module, name)
    for name, value in ATTRIBUTES.get(layout, {}).items():
        setattr(module, name, value)
    if kernel == MARLIN_KERNEL:
        module.workspace = marlin_utils_fp4.marlin_make_workspace(device)
        if getattr(module, "bias", None) is not None:
            module.bias = nn.Parameter(_marlin_bias(module.bias, module.weight_scale.shape[1]), requires_grad=False)


def _marlin_bias(bias: torch.Tensor, padded_n: int) -> torch.Tensor:
    """A layer's bf16 bias (Qwen2's q/k/v: the checkpoint's, which SGLang's own loader fused and cut) as FP4 Marlin's
    ``prepare_nvfp4_layer_for_marlin`` leaves it: padded to Marlin's N and permuted by SGLang's own
    ``marlin_permute_bias`` (no NVFP4 state: a bundle passes biases through)."""
    from sglang.srt.layers.quantization import marlin_utils_fp4

    return marlin_utils_fp4.marlin_permute_bias(nn.functional.pad(bias, (0, padded_n - bias.shape[0])))


def _bf16_fp4_prepared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FlashInfer's ``prepare_bf16_fp4_weights`` (cute-dsl) on the bundle's tensors, as SGLang calls it: on sm100 a
    6-D view of the swizzled scales, no copy."""
    import flashinfer

    weight, scale, alpha = flashinfer.prepare_bf16_fp4_weights(
        tensors["weight"], tensors["weight_scale_interleaved"], tensors["alpha"], backend="cute-dsl")
    return {"weight": weight, "weight_scale_interleaved": scale, "alpha": alpha}


def check_moe_backend(bundle: Bundle, running: str) -> None:
    """A bundle's FusedMoE layers hold one SGLang MoE runner backend's state: refused, in one line, under another."""
    for record in bundle.manifest.moe.values():
        if record.backend != running:
            flag = "" if record.backend == "auto" else f" --moe-runner-backend {record.backend}"
            raise RepackError(f"{bundle.root}: the bundle's MoE layers hold SGLang's {record.backend} MoE state, but "
                              f"SGLang runs --moe-runner-backend {running}; serve it with{flag or ' the default'}")


def check_expert_parallelism(bundle: Bundle, bundle_ep: bool, ep_size: int) -> None:
    """An ``--ep`` bundle holds each rank's experts whole, a ``--tp`` one every expert's rank rows: SGLang must place
    them as the bundle does (``--ep-size`` = ``--tp``, or none)."""
    if bundle_ep != (ep_size > 1):
        tp = bundle.manifest.tp_size
        raise RepackError(f"{bundle.root}: the bundle's MoE layers are " + (
            f"split by expert (--ep), but SGLang runs --ep-size {ep_size}; serve it with --ep-size {tp}" if bundle_ep
            else f"split by rows (--tp), but SGLang runs --ep-size {ep_size}; serve it without --ep-size"))


def _install_moe(module: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
                 marlin: bool = False) -> None:
    """A FusedMoE module's post-load state: its tensors and aliases (compressed-tensors' packed names dropped, as
    SGLang renames them), then what SGLang's MoE post-load sets beside them."""
    for packed in ("w13_weight_packed", "w2_weight_packed"):
        if packed in module._parameters:
            delattr(module, packed)
    _install(module, tensors, aliases, None)
    if marlin:
        _finish_marlin_moe(module)
    else:
        _finish_moe(module)


def _finish_marlin_moe(module: nn.Module) -> None:
    """What ``prepare_moe_nvfp4_layer_for_marlin`` and compressed-tensors' weight-only MoE scheme leave beside the
    tensors: the loaded global scales they delete, and FP4 Marlin's scratch ``workspace`` (SGLang's own function)."""
    from sglang.srt.layers.quantization import marlin_utils_fp4

    for name in MARLIN_MOE_DELETED:
        if name in module._parameters:
            delattr(module, name)
    module.workspace = marlin_utils_fp4.marlin_make_workspace(module.w13_weight.device, 4)


def _finish_moe(module: nn.Module) -> None:
    """The non-tensor state SGLang's ``process_weights_after_loading`` leaves on an NVFP4 FusedMoE module, computed
    by its own helpers: TRT-LLM-gen's (unpadded) hidden size, the CUTLASS kernel's SwiGLU parameters, and ModelOpt's
    dispatcher quant config (its FP4 dispatch's input scale, where it dispatches in FP4)."""
    from sglang.srt.layers.moe.moe_runner.flashinfer_cutlass import materialize_swiglu_params_for_cutlass
    from sglang.srt.layers.quantization import modelopt_quant

    method, scheme = module.quant_method, getattr(module, "scheme", None)
    modelopt = isinstance(method, modelopt_quant.ModelOptNvFp4FusedMoEMethod)
    if modelopt and method.enable_flashinfer_trtllm_moe:
        module.trtllm_padded_hidden_size = None  # trtllm_nvfp4_hidden_alignment: 1 (the layout pads no hidden size)
    if (modelopt and method.enable_flashinfer_cutlass_moe) or (scheme is not None and not scheme.use_flashinfer_trtllm):
        module._cutlass_swiglu_params = materialize_swiglu_params_for_cutlass(
            module.moe_runner_config, int(module.num_local_experts), module.w13_weight.device)
    if modelopt:
        fp4 = not method.quant_config.use_per_token_activation and (
            modelopt_quant._use_nvfp4_dispatch() or modelopt_quant.should_use_flashinfer_cutlass_moe_fp4_allgather())
        module.dispatcher.set_quant_config({"input_global_scale": module.w13_input_scale_quant if fp4 else None})


class BundleModelLoader(DefaultModelLoader):
    """Loads a ``convert --engine sglang`` bundle (see the module docstring)."""

    def load_model(self, *, model_config, device_config) -> nn.Module:
        parallel = get_parallel()
        platform = get_platform()
        capability = tuple(platform.device_capability) if platform.is_cuda else None
        bundle = open_rank_bundle(model_config.model_path, parallel.tp_size, parallel.tp_rank, capability,
                                  get_fp4_gemm_runner_backend().value, SGLANG_VERSION)
        target_device = torch.device(device_config.device)
        quant_config = _get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = _initialize_model(model_config, self.load_config, quant_config)
            model.load_weights(self._passthrough(bundle))
            layers, moe, fmt = bundle.manifest.layers, bundle.manifest.moe, bundle.target.source_format
            layout = bundle.manifest.layout_id
            w4a4 = layout in LAYOUTS.values()  # else a weight-only layout (Marlin, FlashInfer's bf16 x fp4)
            if moe:
                check_moe_backend(bundle, get_moe_runner_backend().value)
            for prefix, module in model.named_modules():
                if prefix in layers:
                    tensors = {part: bundle.read(f"{prefix}.{part}").to(target_device) for part in layers[prefix].tensors}
                    if layout == SGLANG_BF16_FP4_LAYOUT:
                        tensors = _bf16_fp4_prepared(tensors)
                    padding = layers[prefix].weights_padding_cols if w4a4 and KEEPS_PADDING[fmt] else None
                    _install(module, tensors, ALIASES[fmt] if w4a4 else {}, padding)
                    if not w4a4:
                        _weight_only_state(module, layout, bundle.manifest.kernels[0], target_device)
                elif prefix in moe:
                    record = moe[prefix]
                    check_expert_parallelism(bundle, record.expert_map is not None, module.moe_ep_size)
                    tensors = {part: bundle.read(f"{prefix}.{part}").to(target_device) for part in record.tensors}
                    _install_moe(module, tensors, bundle.moe_layout.aliases(record.hidden, record.intermediate),
                                 record.layout_id in SGLANG_MARLIN_MOE_LAYOUTS.values())
            missing = (set(layers) | set(moe)) - {prefix for prefix, _ in model.named_modules()}
            if missing:
                raise RepackError(f"{bundle.root}: SGLang's model has no module {sorted(missing)[0]}; the bundle was "
                                  "converted from another architecture")
            served = {id(m) for p, m in model.named_modules() if p in layers or p in moe}
            for module, quant_method in _modules_with_quant_method(model):
                if id(module) not in served:
                    with device_loading_context(module, target_device):
                        quant_method.process_weights_after_loading(module)
        return model.eval()

    @staticmethod
    def _passthrough(bundle: Bundle) -> Iterator[tuple[str, torch.Tensor]]:
        for name in bundle.manifest.passthrough:
            yield name, bundle.read(name)
