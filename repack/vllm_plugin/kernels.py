"""Which vLLM NVFP4 linear kernel runs a bundle's layers, and this project's Hopper kernel as a vLLM kernel class.

sm100 bundles (and sm120's cute-dsl ones) hold exactly what vLLM's ``FlashInferCuteDslNvFp4W4A16LinearKernel``
leaves on its layers, Marlin bundles what ``MarlinNvFp4LinearKernel`` leaves, so they run that class unchanged. vLLM has no NVFP4 layout of its own for sm90 that this project's
kernels read, so sm90 bundles run :class:`RepackSm90NvFp4LinearKernel`: ``apply_weights`` is this project's
``nvfp4_repack::linear`` op (the Triton kernels on the GPU, the reference backend on CPU), and
``process_weights_after_loading`` is the offline transform run at load time, so the class also serves a
source checkpoint through vLLM's own loader. A bundle layer's online input transform, handed over by the
plugin's loader (``take_input_transform``), runs inside that op instead of in vLLM's transform module.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel, NvFp4LinearLayerConfig
from vllm.model_executor.kernels.linear.nvfp4.flashinfer import FlashInferCuteDslNvFp4W4A16LinearKernel
from vllm.model_executor.kernels.linear.nvfp4.marlin import MarlinNvFp4LinearKernel
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from ..nvfp4 import NVFP4Weight
from ..runtime.backends import fuses_input_transform, prepare_backend
from ..runtime.op import nvfp4_matmul
from ..runtime.transforms import WalshFactors, walsh_factors
from ..targets import Target, sm90


class RepackSm90NvFp4LinearKernel(NvFp4LinearKernel):
    """BF16 x NVFP4 GEMM on Hopper with nvfp4-repack's sm90 layout (``sm90-triton-v2``) and Triton kernels."""

    input_transform: torch.Tensor | None = None  # the layer's online input transform T (x @ T), once taken over
    fuse_input = False
    walsh: WalshFactors | None = None
    input_walsh = ""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if compute_capability is None:
            if not current_platform.is_cuda():
                return True, None  # CPU: the reference backend decodes the same layout
            capability = current_platform.get_device_capability()
            if capability is None:
                return False, "CUDA compute capability is unavailable"
            compute_capability = capability.to_int()
        if compute_capability != 90:
            return False, "nvfp4-repack's sm90 kernel requires sm_90"
        if importlib.util.find_spec("triton") is None:
            return False, "nvfp4-repack's sm90 kernel requires Triton"
        return True, None

    @classmethod
    def can_implement(cls, config: NvFp4LinearLayerConfig) -> tuple[bool, str | None]:
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """vLLM's source tensors -> the sm90 layout (the same transform ``convert --target sm90`` runs offline)."""
        device = layer.weight.device
        source = NVFP4Weight(
            codes=layer.weight.data.cpu(),
            block_scales=layer.weight_scale.data.cpu(),
            multiplier=layer.weight_global_scale.data.reshape(1).float().cpu(),
        )
        runtime = sm90.TARGET.to_runtime(source)
        for name, tensor in runtime.tensors().items():
            replace_parameter(layer, name, tensor.to(device))
        layer.weights_padding_cols = runtime.weights_padding_cols

    def take_input_transform(self, layer: torch.nn.Module, matrix: torch.Tensor) -> None:
        """Apply the layer's online input transform ``x @ matrix`` here instead of in vLLM's separate transform
        module (the caller stops calling that one): inside the Triton kernels where they fuse it (their activation
        pre-pass; the in-kernel Walsh-Hadamard at M = 1 for Sylvester-type matrices), else just before the GEMM."""
        self.input_transform = matrix.to(layer.weight.device)
        self.fuse_input = fuses_input_transform(_backend(layer), self.input_transform)
        self.walsh = walsh_factors(self.input_transform) if self.fuse_input else None
        self.input_walsh = self.walsh.key() if self.walsh is not None else ""

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Eager calls (``enforce_eager``, prefill outside CUDA graphs) take the layer's prepared launch, as
        ``PackedLinear`` does: through the op's Python dispatch a call cost more CPU time than the kernel's GPU
        time at decode sizes (0.56x Humming at eager batch 1). vLLM's compiled graph calls the op."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"nvfp4-repack sm90 W4A16 requires BF16 input, got {x.dtype}")
        backend = _backend(layer)
        fused = self.input_transform if self.fuse_input else None
        prepared = None if torch.compiler.is_compiling() else prepared_launch(layer, backend, fused, self.walsh)
        return nvfp4_matmul(
            x, layer.weight, layer.weight_scale, layer.weight_global_scale,
            layer.output_size_per_partition, layer.input_size_per_partition, sm90.TARGET.name, backend, bias,
            prepared, self.input_transform, self.fuse_input, self.input_walsh,
        )


def _backend(layer: torch.nn.Module) -> str:
    return "triton" if layer.weight.is_cuda else "reference"


def prepared_launch(layer: torch.nn.Module, backend: str, transform: torch.Tensor | None = None,
                    walsh: WalshFactors | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's backend bound to its current tensors and fused input ``transform`` (``prepare_backend``: checked
    once), kept on the layer and rebuilt when vLLM replaces its weight (a reload installs new parameters)."""
    held = layer.__dict__.get("_nvfp4_repack_prepared")
    if held is None or held[0] is not layer.weight or held[1] != backend or held[2] is not transform:
        launch = prepare_backend(backend, layer.weight, layer.weight_scale, layer.weight_global_scale,
                                 layer.output_size_per_partition, layer.input_size_per_partition, sm90.TARGET.name,
                                 transform, walsh)  # fmt: skip
        held = layer.__dict__["_nvfp4_repack_prepared"] = (layer.weight, backend, transform, launch)
    return held[3]


KERNELS: dict[str, type[NvFp4LinearKernel]] = {cls.__name__: cls for cls in (
    FlashInferCuteDslNvFp4W4A16LinearKernel, MarlinNvFp4LinearKernel, RepackSm90NvFp4LinearKernel)}
MARLIN_KERNEL = MarlinNvFp4LinearKernel.__name__  # sm80, sm75 and sm120's weight-only layout (targets/marlin.py)


def kernel_class(target: Target) -> type[NvFp4LinearKernel]:
    """The kernel class that reads ``target``'s weight-only layout (the capability table's first)."""
    return KERNELS[target.kernels[0]]
