"""FusedMoE layers served from a bundle: vLLM's own MoE post-load, with only its expert conversion replaced.

vLLM 0.33's NVFP4 MoE methods (ModelOpt's ``ModelOptNvFp4FusedMoE``, compressed-tensors'
``CompressedTensorsW4A4Nvfp4MoEMethod``) end their load in ``process_weights_after_loading``: it calls
``convert_to_nvfp4_moe_kernel_format`` (w3/w1 order, one input scale for all experts, and per backend the
padding, row shuffles and block-scale interleave), installs its eight results on the module, builds the quant
config and the modular kernel, and lets the experts class fold the input scale into ``w*_weight_scale_2``
(TRT-LLM-gen also registers ``g1_scale_c``). A bundle holds the converted tensors, so for that one call the
conversion is replaced by :func:`serve_experts`'s, which returns the bundle's tensors (the multipliers as the
float32 values vLLM's fold turns into the bundle's bytes) and leaves on ``moe_config`` the padded sizes vLLM's
TRT-LLM-gen preparation leaves there. Everything else (compressed-tensors' ``w*_weight_packed`` -> ``w*_weight``
rename and plain-attribute input scales, the quant config, prepare/finalize, the experts class, ``g1_scale_c``,
``_expert_map``) is vLLM's own code, run as in a load from the source.

vLLM's ``weights_already_processed()`` is not used: it accepts pre-processed MoE from ModelOpt with TRT-LLM-gen
only (not compressed-tensors, not FlashInfer CUTLASS on sm120), and it would skip every other layer's post-load
too (see loader.py).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

from ..errors import RepackError

# What vLLM's conversion returns, in its order.
CONVERTED = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w13_input_scale",
             "w2_weight", "w2_weight_scale", "w2_weight_scale_2", "w2_input_scale")
CONVERT = "convert_to_nvfp4_moe_kernel_format"
MARLIN_KEPT = ("w13_weight_multiplier", "w2_weight_multiplier")  # a Marlin bundle's, for its inverse: not installed
METHODS = ("ModelOptNvFp4FusedMoE", "CompressedTensorsW4A4Nvfp4MoEMethod")
# Per method, the experts' source scales it keeps on the module as loaded after its post-load (no kernel reads them),
# which a bundle carries as passthrough tensors under the source's names (weight-only experts have no input scale:
# vLLM leaves that parameter as allocated, the plugin zeroed).
KEPT_SCALES = {"CompressedTensorsW4A4Nvfp4MoEMethod": ("weight_global_scale", "input_global_scale")}
WEIGHT_ONLY_BACKEND = "MARLIN"  # what vLLM runs weight-only (use_a16) NVFP4 experts with on every GPU but sm90


def moe_modules(model: nn.Module) -> dict[str, nn.Module]:
    """vLLM's FusedMoE modules (``RoutedExperts``: ``<owner>.experts.routed_experts`` in Qwen2/3-MoE), by name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, RoutedExperts)}


def preimage(target: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor],
             guess: torch.Tensor) -> torch.Tensor:
    """Elementwise, a float32 ``x`` among ``guess`` and its two neighbours with ``forward(x) == target``, where one
    is (else ``guess``): what vLLM's own float32 step ``forward`` turns into the bundle's ``target`` bytes."""
    found = guess
    for candidate in (torch.nextafter(guess, guess * 0), torch.nextafter(guess, guess * 2), guess):
        found = torch.where(forward(candidate) == target, candidate, found)
    return found


def unfolded_scale(folded: torch.Tensor, input_scale: torch.Tensor, name: str) -> torch.Tensor:
    """The float32 ``m`` with ``m * input_scale == folded``, bit for bit: the experts classes' post-load multiplies
    ``w*_weight_scale_2`` by the input scale in place, so it is given the multiplier the bundle's folded one came
    from (or a float32 neighbour of it with the same product)."""
    found = preimage(folded, lambda m: m * input_scale, (folded.double() / input_scale.double()).float())
    if not torch.equal(found * input_scale, folded):
        raise RepackError(f"{name}: the bundle's value is not a float32 product with its input scale, as vLLM "
                          f"folds it; run verify")
    return found


def check_method(name: str, module: nn.Module, backend: str) -> None:
    """One line when vLLM's method for the module is not an NVFP4 MoE method on the bundle's backend (weight-only
    experts: Marlin's only)."""
    method = module.quant_method
    kind = type(method).__name__
    if kind not in METHODS:
        raise RepackError(f"{name}: vLLM serves this MoE layer with {kind}; bundles hold NVFP4 MoE for "
                          f"{', '.join(METHODS)} only; serve the source with --load-format auto")
    if getattr(method, "use_a16", False) and backend != WEIGHT_ONLY_BACKEND:
        raise RepackError(f"{name}: vLLM serves this MoE layer weight-only (W4A16: Marlin), the bundle holds the "
                          f"{backend} layout for W4A4 experts; re-convert the weight-only checkpoint")
    if getattr(method, "per_token_activation", False):
        raise RepackError(f"{name}: vLLM quantizes this MoE layer's activations per token (quantization_config "
                          f"moe.activation nvfp4_per_token), the bundle holds experts for the checkpoint's static "
                          f"input scales; serve it without that override")
    chosen = method.nvfp4_backend.value
    if chosen != backend:
        raise RepackError(f"{name}: vLLM chose the {chosen} MoE backend on this GPU, but the bundle holds the "
                          f"{backend} layout; serve it with --moe-backend {backend.lower()} on the GPU family it was "
                          f"converted for, or re-convert the source for this GPU")


def check_kept_scales(name: str, module: nn.Module, members: dict[str, list[str]], passthrough: set[str]) -> None:
    """One line when the bundle lacks a source scale of the held experts (``members``) that vLLM's method keeps on
    the module as loaded (a bundle converted before it carried them): the module would hold zeros there."""
    kept = KEPT_SCALES.get(type(module.quant_method).__name__, ())
    kept = kept[:1] if getattr(module.quant_method, "use_a16", False) else kept
    missing = sorted(f"{member}.{scale}" for names in members.values() for member in names for scale in kept
                     if f"{member}.{scale}" not in passthrough)
    if missing:
        raise RepackError(f"{name}: the bundle has no {missing[0]}, which vLLM keeps on this MoE layer as loaded; "
                          f"re-convert the source")


def check_placement(name: str, module: nn.Module, expert_map: list[int] | None, experts: int,
                    intermediate: int) -> None:
    """The bundle's experts (its ``_expert_map`` under ``--ep``, else all of them) and per-rank intermediate size
    must be what vLLM placed on this rank: the same TP size, and ``--enable-expert-parallel`` as ``--ep`` was; and
    no expert load balancing, which moves experts between ranks and shares one input scale over all of them."""
    if module.moe_config.moe_parallel_config.enable_eplb:
        raise RepackError(f"{name}: vLLM balances this MoE layer's experts (--enable-eplb), which MoE bundles are not "
                          f"made for; serve it without --enable-eplb")
    held = module._expert_map
    ours = None if held is None else held.tolist()
    have = (ours, module.local_num_experts, module.moe_config.intermediate_size_per_partition)
    if have != (expert_map, experts, intermediate):
        mode = "with" if ours is not None else "without"
        raise RepackError(
            f"{name}: vLLM holds {module.local_num_experts} of {module.global_num_experts} experts with intermediate "
            f"size {have[2]} on this rank ({mode} expert parallelism), the bundle {experts} with {intermediate}"
            f"{' under --ep' if expert_map is not None else ''}; serve it with the --tensor-parallel-size it was "
            f"converted for (--tp), with --enable-expert-parallel exactly when it was converted with --ep"
        )


def _pad_dims(layer: nn.Module, w2: torch.Tensor) -> None:
    """The sizes vLLM's TRT-LLM-gen preparation (``prepare_nvfp4_moe_layer_for_fi_or_cutlass``) leaves on
    ``moe_config``: the unpadded hidden size kept, the padded hidden and per-rank intermediate sizes of the held
    ``w2``."""
    config = layer.moe_config
    if config.hidden_dim_unpadded is None:
        config.hidden_dim_unpadded = config.hidden_dim
    config.hidden_dim = w2.shape[1]
    config.intermediate_size_per_partition = w2.shape[2] * 2


@contextlib.contextmanager
def _conversion(method: object, convert: Callable[..., tuple[torch.Tensor, ...]]) -> Iterator[None]:
    """``convert`` as the conversion ``method``'s post-load calls (a name bound in its module), for one call."""
    home = sys.modules[type(method).__module__]
    original = getattr(home, CONVERT)
    setattr(home, CONVERT, convert)
    try:
        yield
    finally:
        setattr(home, CONVERT, original)


def serve_experts(name: str, module: nn.Module, tensors: dict[str, torch.Tensor], done: Callable[[], None]) -> None:
    """Hook the module's MoE post-load so that it installs ``tensors`` (vLLM's names: the eight converted ones and
    ``g1_scale_c`` on TRT-LLM-gen, from ``Bundle.moe_tensors``) instead of converting its own; ``done`` is called
    once it ran. The per-expert float32 scalars vLLM allocated are zeroed rather than left as uninitialized memory:
    its post-load compares w1's and w3's before converting (a warning). Compressed-tensors' loaded global scales,
    which stay on the module after it (no kernel reads them), are then loaded over the zeros from the bundle's
    passthrough tensors by vLLM's own expert weight loader, as from the source."""
    method = module.quant_method
    missing = sorted(set(CONVERTED) - set(tensors) - ({"w13_input_scale", "w2_input_scale"}
                                                      if MARLIN_KEPT[0] in tensors else set()))
    if missing:
        raise RepackError(f"{name}: the bundle has no {missing[0]} for this MoE layer; run verify")
    params = dict(module.named_parameters(recurse=False))
    tensors = {part: t.to(params[next(iter(params))].device) for part, t in tensors.items()}
    with torch.no_grad():
        for param in params.values():
            if param.dtype == torch.float32:
                param.zero_()
    held = {part: t for part, t in tensors.items() if part not in MARLIN_KEPT}
    if "w13_input_scale" not in tensors:  # Marlin: weight-only, its conversion returns no input scales
        held.update(w13_input_scale=None, w2_input_scale=None)
    else:
        for scale, activation in (("w13_weight_scale_2", "w13_input_scale"), ("w2_weight_scale_2", "w2_input_scale")):
            held[scale] = unfolded_scale(tensors[scale], tensors[activation], f"{name}.{scale}")

    def convert(*, nvfp4_backend: NvFp4MoeBackend, layer: nn.Module, **_: object) -> tuple[torch.Tensor, ...]:
        if nvfp4_backend == NvFp4MoeBackend.FLASHINFER_TRTLLM:
            _pad_dims(layer, held["w2_weight"])
        return tuple(held[part] for part in CONVERTED)

    def process(layer: nn.Module) -> None:
        del method.process_weights_after_loading  # the instance hook; the class's method is untouched
        with _conversion(method, convert):
            method.process_weights_after_loading(layer)
        expected = tensors.get("g1_scale_c")
        if expected is not None and not torch.equal(layer.g1_scale_c, expected):
            raise RepackError(f"{name}.g1_scale_c: vLLM derives another value from the bundle's scales; run verify")
        done()

    method.process_weights_after_loading = process
