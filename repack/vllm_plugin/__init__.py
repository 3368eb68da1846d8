"""vLLM plugin (``pip install "nvfp4-repack[vllm]"``): serve a bundle with ``--load-format nvfp4_repack``.

vLLM calls :func:`register` in each of its processes through the ``vllm.general_plugins`` entry point. Only
this subpackage imports vLLM; the rest of nvfp4-repack never imports it.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register the ``nvfp4_repack`` model loader and the sm90 NVFP4 linear kernel (idempotent: vLLM may call
    its plugins more than once per process)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.platforms import PlatformEnum

    from .kernels import RepackSm90NvFp4LinearKernel
    from .loader import LOAD_FORMAT, BundleModelLoader

    register_model_loader(LOAD_FORMAT)(BundleModelLoader)
    register_linear_kernel(RepackSm90NvFp4LinearKernel, PlatformEnum.CUDA, "nvfp4")
    _registered = True
