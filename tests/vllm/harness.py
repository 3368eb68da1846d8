"""vLLM 0.33.0 as the oracle, on CPU: load a checkpoint through vLLM's own DefaultModelLoader and dump what
every fused linear layer holds after process_weights_after_loading.

Runs in the vLLM virtualenv (tests/vllm/make_env.sh), never in the project's env, and imports nothing
from the project. Only GPU-only leaf calls are replaced (the blocks marked PATCH, two of them the emulated
capability that the W4A4 kernels' is_supported and vLLM's choice of QuTLASS for rotated W4A4 layers read); vLLM's
config, model construction, kernel selection (its auto, for W4A4 jobs), weight loading and fusion, the
quantization scheme's post-processing, padding, swizzle and FlashInfer's per-arch repack run unmodified. Every
patched name is asserted to exist and the versions are pinned, so that an upgrade fails loudly instead of testing
something else.

    python harness.py --tp N --job NAME=CKPT:ARCH [--job ...] --out DIR
        ARCH: sm100 | sm120 (the W4A16 cute-dsl kernel, forced) | sm100-w4a4 | sm120-w4a4 (vLLM's auto choice
        among its W4A4 kernels for that capability) | sm80 | sm75 | sm100-auto | sm120-auto (vLLM's auto over its
        whole CUDA list: a weight-only checkpoint's kernel, Marlin or cute-dsl) | sm120-marlin | FAMILY-moe[-ep]
        (FAMILY: any of sm100, sm120, sm80, sm75, sm100-auto, sm120-auto, sm100-w4a4, sm120-w4a4, sm120-marlin: the
        dense layers' job; sm120-marlin-moe: a W4A4 checkpoint served weight-only, --moe-backend marlin too)

loads every job in one process (imports dominate the time) and writes ``OUT/NAME/rank-R.safetensors`` (per layer
``P.weight``, ``P.weight_global_scale`` and ``P.weight_scale``; for sm100 the 2-D buffer under vLLM's 6-D view; for
online transforms each ``P.<scheme>_<location>.weight.partitions.I``; W4A4 jobs: every tensor the layer holds,
each as its whole storage's bytes, and the transforms) and ``OUT/rank-R.json`` (``weights_padding_cols``, the
view's shape/stride/offset, the kernel class; W4A4 jobs: each tensor's dtype/shape/stride/offset, the layer's
non-tensor state and its quantization method's class), or ``OUT/NAME/refused.txt`` with vLLM's error when it
refuses. Between jobs it clears the one piece of class-wide state a load leaves (``HadamardTransform.
scaled_data_ptrs``), as a fresh process would have it.

MoE jobs (``sm100-moe``, ``sm120-moe``; ``-ep``: with vLLM's --enable-expert-parallel): vLLM's ``auto`` NVFP4 MoE
backend is chosen under the emulated capability (PATCH MoE 1), FlashInfer's JIT-built
``nvfp4_block_scale_interleave`` runs as a torch port of its C++ host code (tests/vllm/ports.py), and every tensor
of every FusedMoE module is dumped (``moe-rank-R.safetensors``, each tensor whole, plus ``moe-rank-R.json``: dtype,
shape, stride, offset, the backend and experts class); dense layers load and are dumped as for the job's family
(``sm100-moe``: the forced W4A16 cute-dsl kernel; ``sm100-w4a4-moe``, ``sm120-auto-moe``: vLLM's auto, what a user
gets).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # CpuPlatform, fixed before the first vllm import
os.environ.setdefault("VLLM_HAS_FLASHINFER_CUBIN", "1")  # no JIT here; kernel selection wants the flag
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/: oracle_cli

import flashinfer  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from flashinfer.gemm import gemm_bf16_fp4_cute_dsl as fi_cute  # noqa: E402
from oracle_cli import layer_tensors, main  # noqa: E402
from ports import block_scale_interleave, gptq_marlin_repack  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    destroy_distributed_environment,
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.kernels import linear as vlinear  # noqa: E402
from vllm.model_executor.kernels.linear import register_linear_kernel  # noqa: E402
from vllm.model_executor.kernels.linear.nvfp4 import flashinfer as vfi  # noqa: E402
from vllm.model_executor.kernels.linear.nvfp4 import marlin as vmarlin  # noqa: E402
import vllm._custom_ops as vops  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as moe_oracle  # noqa: E402
from vllm.model_executor.layers.quantization import modelopt as vmodelopt  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E402
    compressed_tensors_moe_w4a4_nvfp4 as vct_moe,
)
from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import (  # noqa: E402
    HadamardTransform,
)
from vllm.model_executor.layers.quantization.utils import flashinfer_fp4_moe as vfi_moe  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader  # noqa: E402
from vllm.model_executor.layers.quantization.utils import nvfp4_utils  # noqa: E402
from vllm.platforms import PlatformEnum  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.utils import flashinfer as vutils_fi  # noqa: E402

assert vllm.__version__ in ("0.33.0", "0.34.0"), vllm.__version__  # one oracle venv per version (make_env.sh)
V034 = vllm.__version__ == "0.34.0"
assert flashinfer.__version__ == "0.7.2.post1", flashinfer.__version__
assert torch.__version__.startswith("2.13.0"), torch.__version__

KERNEL = vfi.FlashInferCuteDslNvFp4W4A16LinearKernel
ARCH = {"sm100": (100, fi_cute._prepare_cute_dsl_sm100), "sm120": (120, fi_cute._prepare_cute_dsl_sm12x),
        "sm80": (80, None), "sm75": (75, None)}
# Auto jobs: vLLM's auto over its whole CUDA list under the emulated capability (every FP4 x FP4 kernel refuses
# below sm100; Marlin answers from sm75); sm75 runs fp16 (no bf16 there); "sm100-auto" / "sm120-auto": a weight-only
# checkpoint with --linear-backend auto (vLLM's weight-only branch, PATCH AUTO: the cute-dsl W4A16 kernel on sm100,
# Marlin on sm120); "sm120-marlin": a W4A4 checkpoint on sm120 with --linear-backend marlin (vLLM's own choice among
# its CUDA list filtered to Marlin)
MARLIN = vmarlin.MarlinNvFp4LinearKernel
AUTO_ARCHS = {"sm80": "bfloat16", "sm75": "float16", "sm100-auto": "bfloat16", "sm120-auto": "bfloat16",
              "sm120-marlin": "bfloat16"}
assert MARLIN in vlinear._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA]
assert hasattr(vops, "gptq_marlin_repack")
# vLLM's auto order for W4A4 on CUDA starts with these two: cute-dsl answers on sm10x, FlashInfer's CUTLASS on
# any other >= sm100 (sm12x). The CPU platform gets exactly this head of the CUDA list for W4A4 jobs.
W4A4_KERNELS = [vfi.FlashInferCuteDslNvFp4LinearKernel, vfi.FlashInferCutlassNvFp4LinearKernel]
NVFP4_KERNELS = vlinear._POSSIBLE_NVFP4_KERNELS
assert NVFP4_KERNELS[PlatformEnum.CUDA][:2] == W4A4_KERNELS, NVFP4_KERNELS[PlatformEnum.CUDA][:2]
assert hasattr(nvfp4_utils, "cutlass_fp4_supported") and hasattr(CpuPlatform, "get_device_capability")
for name in ("swizzle_blockscale", "flashinfer_prepare_bf16_fp4_weights"):
    assert hasattr(vfi, name), f"vLLM no longer binds {name} in {vfi.__name__}"
assert hasattr(torch.accelerator, "empty_cache")
# MoE job -> the capability emulated (and the dense layers' arch); "-ep": with vLLM's --enable-expert-parallel
MOE_ARCH = {f"{arch}-moe{ep}": arch for ep in ("", "-ep")
            for arch in ("sm100", "sm120", "sm80", "sm75", "sm100-auto", "sm120-auto", "sm100-w4a4", "sm120-w4a4",
                         "sm120-marlin")}
MOE_SELECTORS = (vmodelopt, vct_moe)  # the MoE methods that bind select_nvfp4_moe_backend by name
for module in MOE_SELECTORS:
    assert module.select_nvfp4_moe_backend is moe_oracle.select_nvfp4_moe_backend, module.__name__
assert hasattr(vfi_moe, "swizzle_blockscale") and hasattr(vutils_fi, "has_flashinfer_cutlass_fused_moe")
assert hasattr(flashinfer, "nvfp4_block_scale_interleave")

assert isinstance(HadamardTransform.scaled_data_ptrs, set)

register_linear_kernel(KERNEL, PlatformEnum.CPU, "nvfp4")  # public API: the CPU platform has no NVFP4 entry


# the job being loaded: which capability and FlashInfer layout to emulate; "auto": vLLM's own choice of dense kernel
_current: dict = {"arch": "sm100", "w4a4": False, "auto": False, "methods": []}


def is_w4a4(arch: str) -> bool:
    return arch.endswith("-w4a4")


def select(arch: str) -> tuple[str, str]:
    """``(FlashInfer arch, linear_backend)`` of a job, and the CPU platform's NVFP4 kernels set to match."""
    if arch in AUTO_ARCHS:  # vLLM's own choice over its CUDA list (auto, or --linear-backend marlin)
        NVFP4_KERNELS[PlatformEnum.CPU][:] = NVFP4_KERNELS[PlatformEnum.CUDA]
        _current["arch"], _current["w4a4"], _current["auto"] = arch.split("-")[0], False, True
        return _current["arch"], "marlin" if arch.endswith("-marlin") else "auto"
    NVFP4_KERNELS[PlatformEnum.CPU][:] = W4A4_KERNELS if is_w4a4(arch) else [KERNEL]
    _current["arch"], _current["w4a4"], _current["auto"] = arch.removesuffix("-w4a4"), is_w4a4(arch), False
    return _current["arch"], "auto" if is_w4a4(arch) else "flashinfer_cutedsl"


def patch() -> None:
    def cc() -> int:
        return ARCH[_current["arch"]][0]

    # PATCH W4A4: the W4A4 kernels' is_supported read the platform's capability and (FlashInfer CUTLASS)
    # cutlass_fp4_supported(), False on a CPU build; run vLLM's own checks with the platform answering the
    # emulated capability and CUTLASS FP4 present (as a CUDA 12.8+ build answers on sm100 / sm120).
    for kernel in W4A4_KERNELS:
        def emulated(cls, compute_capability=None, _original=kernel.is_supported.__func__):
            saved, fp4 = CpuPlatform.get_device_capability, nvfp4_utils.cutlass_fp4_supported
            CpuPlatform.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(cc() // 10, 0))
            nvfp4_utils.cutlass_fp4_supported = lambda: True
            try:
                return _original(cls, compute_capability)
            finally:
                CpuPlatform.get_device_capability, nvfp4_utils.cutlass_fp4_supported = saved, fp4

        kernel.is_supported = classmethod(emulated)

    # PATCH W4A4 2: vLLM gives W4A4 layers whose input transforms all have a block of 16..128 QuTLASS's method
    # (QutlassNvFP4LinearMethod) where current_platform.has_device_capability(100) holds, False on CPU; in W4A4
    # and auto jobs (vLLM's own kernel choice), while vLLM picks a layer's transform method, the platform answers the
    # emulated capability (sm120: vLLM 0.33 gives QuTLASS's method to a weight-only layer too, whose load then refuses
    # Marlin's kernel). The forced cute-dsl W4A16 jobs keep the CPU's answer (vLLM's transform method around it).
    # compressed_tensors first: transform.linear imported on its own is a circular import
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors  # noqa: F401
    from vllm.model_executor.layers.quantization.compressed_tensors.transform.linear import (
        CompressedTensorsLinearTransformMethod,
    )

    from_schemes = CompressedTensorsLinearTransformMethod.from_schemes.__func__

    def from_schemes_emulated(cls, *args, **kwargs):
        if not (_current["w4a4"] or _current["auto"]):
            return from_schemes(cls, *args, **kwargs)
        names = ("get_device_capability", "is_cuda")
        saved = {n: CpuPlatform.__dict__[n] for n in names if n in CpuPlatform.__dict__}
        CpuPlatform.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(cc() // 10, 0))
        if V034:  # Humming's Hadamard kernel's is_supported: a CUDA platform with the humming package (a GPU's answer)
            from vllm.model_executor.kernels.linear.nvfp4 import humming as vhumming

            CpuPlatform.is_cuda = lambda self: True
            has_humming, vhumming.has_humming = vhumming.has_humming, lambda: True
        try:
            method = from_schemes(cls, *args, **kwargs)
            _current["methods"].append(type(method).__name__)  # vLLM's choice, kept even where its load then fails
            return method
        finally:
            for n in names:
                if n in saved:
                    setattr(CpuPlatform, n, saved[n])
                elif n in CpuPlatform.__dict__:
                    delattr(CpuPlatform, n)
            if V034:
                vhumming.has_humming = has_humming

    CompressedTensorsLinearTransformMethod.from_schemes = classmethod(from_schemes_emulated)

    # PATCH AUTO: vLLM's weight-only branch of init_nvfp4_linear_kernel (--linear-backend auto) reads the platform's
    # capability (None on CPU: Marlin whatever the GPU) to pick the cute-dsl W4A16 kernel on sm100 / sm103, Marlin
    # elsewhere but sm90; in auto jobs the platform answers the emulated capability while it picks. Both NVFP4 schemes
    # (ModelOpt's, compressed-tensors') bind the function by name.
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as vct_scheme,
    )

    init_kernel = vlinear.init_nvfp4_linear_kernel
    assert vmodelopt.init_nvfp4_linear_kernel is init_kernel is vct_scheme.init_nvfp4_linear_kernel

    def init_kernel_emulated(*args, **kwargs):
        if not _current["auto"]:
            return init_kernel(*args, **kwargs)
        saved = CpuPlatform.__dict__.get("get_device_capability")
        CpuPlatform.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(cc() // 10, cc() % 10))
        try:
            return init_kernel(*args, **kwargs)
        finally:
            if saved is not None:
                CpuPlatform.get_device_capability = saved
            else:
                delattr(CpuPlatform, "get_device_capability")

    vmodelopt.init_nvfp4_linear_kernel = vct_scheme.init_nvfp4_linear_kernel = init_kernel_emulated

    # PATCH MARLIN: is_fp4_marlin_supported asks for CUDA and capability >= 7.5: the platform answers as CUDA with
    # the emulated capability while Marlin's is_supported runs; its one CUDA leaf call, gptq_marlin_repack, runs as
    # a torch port (tests/vllm/ports.py, the CUDA kernel's index arithmetic; checked against the CUDA op on a GPU by
    # tests/test_gpu_marlin.py and against the project's layout by tests/test_vllm_marlin_conformance.py).
    marlin_supported = MARLIN.is_supported.__func__

    def marlin_emulated(cls, compute_capability=None):
        saved = {n: CpuPlatform.__dict__[n] for n in ("is_cuda", "get_device_capability") if n in CpuPlatform.__dict__}
        CpuPlatform.is_cuda = lambda self: True
        CpuPlatform.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(cc() // 10, cc() % 10))
        try:
            return marlin_supported(cls, compute_capability)
        finally:
            for n in ("is_cuda", "get_device_capability"):
                if n in saved:
                    setattr(CpuPlatform, n, saved[n])
                else:
                    delattr(CpuPlatform, n)

    MARLIN.is_supported = classmethod(marlin_emulated)
    vops.gptq_marlin_repack = gptq_marlin_repack

    # PATCH 1: is_supported answers "requires CUDA" on CPU; run the original with the emulated capability.
    original = KERNEL.is_supported.__func__
    KERNEL.is_supported = classmethod(lambda cls, compute_capability=None: original(cls, compute_capability or cc()))

    # PATCH 2: swizzle_blockscale ends in .cuda(); run vLLM's own function with Tensor.cuda an identity.
    swizzle = vfi.swizzle_blockscale

    def swizzle_on_cpu(scale):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return swizzle(scale)
        finally:
            torch.Tensor.cuda = cuda

    vfi.swizzle_blockscale = swizzle_on_cpu

    # PATCH 3: FlashInfer's public prepare refuses CPU tensors; call its per-arch helper directly.
    def prepare_on_cpu(b, b_descale, alpha=None, *, backend, block_size=16):
        assert backend == "cute-dsl", backend
        return ARCH[_current["arch"]][1](b, b_descale, alpha, block_size)

    vfi.flashinfer_prepare_bf16_fp4_weights = prepare_on_cpu

    # PATCH 0.34: its CPU platform refuses an x86 host without Triton-CPU while it checks the config (its model runner
    # would need it; the harness runs none): the check sees Triton present, for that one call.
    if V034:
        import vllm.triton_utils as triton_utils

        check = CpuPlatform.check_and_update_config.__func__

        def check_with_triton(cls, vllm_config):
            saved, triton_utils.HAS_TRITON = triton_utils.HAS_TRITON, True
            try:
                return check(cls, vllm_config)
            finally:
                triton_utils.HAS_TRITON = saved

        CpuPlatform.check_and_update_config = classmethod(check_with_triton)

    # PATCH 4: torch.accelerator.empty_cache raises without an accelerator.
    torch.accelerator.empty_cache = lambda: None

    # PATCH MoE 1: vLLM's own select_nvfp4_moe_backend (its auto order, every experts class's is_supported_config)
    # runs with the platform answering as CUDA with the emulated capability and FlashInfer's MoE kernels present
    # (as a CUDA build with FlashInfer's cubins answers on that GPU). Only while it selects: the rest of the load
    # sees the CPU platform.
    select = moe_oracle.select_nvfp4_moe_backend

    def select_emulated(*args, **kwargs):
        major = cc() // 10
        names = ("is_cuda", "get_device_capability")
        saved = {n: CpuPlatform.__dict__[n] for n in names if n in CpuPlatform.__dict__}
        flags = {n: getattr(vutils_fi, n) for n in dir(vutils_fi) if n.startswith("has_flashinfer")}
        CpuPlatform.is_cuda = lambda self: True
        CpuPlatform.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(major, cc() % 10))
        for n in flags:
            setattr(vutils_fi, n, lambda: True)
        try:
            return select(*args, **kwargs)
        finally:
            for n in names:
                if n in saved:
                    setattr(CpuPlatform, n, saved[n])
                else:
                    delattr(CpuPlatform, n)
            for n, f in flags.items():
                setattr(vutils_fi, n, f)

    for module in MOE_SELECTORS:
        module.select_nvfp4_moe_backend = select_emulated

    # PATCH MoE 2: the MoE preparation binds vLLM's swizzle_blockscale (ends in .cuda()) too.
    vfi_moe.swizzle_blockscale = swizzle_on_cpu

    # PATCH MoE 3: FlashInfer's nvfp4_block_scale_interleave runs a JIT-built op (no CUDA toolkit here): its torch
    # port (prepare_static_weights_for_trtllm_fp4_moe imports it from flashinfer at call time). FlashInfer's row
    # permutations (shuffle_matrix_a's and the gated-activation reorder's indices) are torch already and run as is.
    flashinfer.nvfp4_block_scale_interleave = block_scale_interleave

    # PATCH MoE 4: TrtLlmNvFp4ExpertsMonolithic asks torch.accelerator for a device index (raises without one) for
    # tensors of optional SwiGLU parameters, which Qwen3-MoE does not set: any index does, 0.
    torch.accelerator.current_device_index = lambda: 0


def transform_state(layer, prefix: str) -> dict[str, torch.Tensor]:
    """The online-transform matrices the layer holds, per partition: ``P.<scheme>_<location>.weight.partitions.I``
    (vLLM's attribute path; partitions that share one tensor in vLLM are dumped once each)."""
    return {f"{prefix}.{name}.weight.partitions.{i}": part.data.detach().clone()
            for name, child in layer.named_children() if isinstance(child, HadamardTransform)
            for i, part in sorted(child.weight.partitions.items())}


NON_TENSOR = ("weights_padding_cols", "input_size_per_partition", "output_size_per_partition", "logical_widths",
              "is_w4a16_nvfp4", "flashinfer_gemm_backend")


def tensor_info(layer, name: str, value: torch.Tensor) -> dict:
    """A tensor's class, dtype, view (shape, stride, offset) and storage size, and vLLM 0.34's bookkeeping: ``retired``
    (a loaded parameter no kernel reads, left registered), ``runtime_name`` (the kernel's name of a Parameter held under
    two names) and ``aliases`` (the layer's other names for the same object)."""
    return {"class": type(value).__name__, "dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape),
            "stride": list(value.stride()), "offset": value.storage_offset(),
            "storage_nbytes": value.untyped_storage().nbytes(), "retired": bool(getattr(value, "retired", False)),
            "runtime_name": getattr(value, "runtime_name", None),
            "aliases": sorted(n for n, p in layer._parameters.items() if p is value and n != name)}


def logical_bytes(value: torch.Tensor) -> torch.Tensor:
    """A tensor's value, in its logical order, as bytes (a view into a larger loaded storage: its elements only)."""
    return value.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def fused_layers(model):
    """``(prefix, layer, its NVFP4 linear kernel)`` for every NVFP4 linear module (vLLM's fused ones, and e.g.
    DeepSeek-V3's ``mlp.shared_experts.gate_up_proj``); FusedMoE modules hold ``w13_*`` instead."""
    for prefix, layer in model.named_modules():
        if isinstance(getattr(layer, "weight_global_scale", None), torch.Tensor):
            yield prefix, layer, getattr(layer.quant_method, "kernel", None) or layer.scheme.kernel  # ModelOpt | ct


def dump_w4a4(model, out: Path, rank: int) -> None:
    """Every tensor of every fused NVFP4 layer as its logical value's bytes, with its view, storage size and vLLM's
    bookkeeping in the json (:func:`tensor_info`)."""
    tensors, meta = {}, {}
    for prefix, layer, kernel in fused_layers(model):
        info = {"kernel": type(kernel).__name__, "method": type(layer.quant_method).__name__, "tensors": {}}
        info.update({k: getattr(layer, k) for k in NON_TENSOR if hasattr(layer, k)})
        tensors.update(transform_state(layer, prefix))
        for name, value in sorted(layer_tensors(layer).items()):
            tensors[f"{prefix}.{name}"] = logical_bytes(value)
            info["tensors"][name] = tensor_info(layer, name, value)
        meta[prefix] = info
    save_file(tensors, out / f"rank-{rank}.safetensors")
    (out / f"rank-{rank}.json").write_text(json.dumps(meta, indent=2))


def dump(model, out: Path, rank: int) -> None:
    tensors, meta = {}, {}
    for prefix, layer, kernel in fused_layers(model):
        assert type(kernel) is KERNEL, type(kernel)
        scale = layer.weight_scale
        buffer = scale.detach() if scale.is_contiguous() else (  # sm100: the buffer its 6-D view looks at
            torch.empty(0, dtype=scale.dtype).set_(scale.untyped_storage()))
        tensors.update(transform_state(layer, prefix))
        tensors[f"{prefix}.weight"] = layer.weight.detach().contiguous()
        tensors[f"{prefix}.weight_scale"] = buffer.contiguous().view(torch.uint8).clone()
        tensors[f"{prefix}.weight_global_scale"] = layer.weight_global_scale.detach().reshape(-1).clone()
        meta[prefix] = {
            "weights_padding_cols": getattr(layer, "weights_padding_cols", None),
            "weight_scale_dtype": str(scale.dtype).replace("torch.", ""),
            "weight_scale_shape": list(buffer.shape),
            "weight_scale_view": [list(scale.shape), list(scale.stride()), scale.storage_offset()],
            "kernel": type(kernel).__name__,
        }
    save_file(tensors, out / f"rank-{rank}.safetensors")
    (out / f"rank-{rank}.json").write_text(json.dumps(meta, indent=2))


def dump_moe(model, out: Path, rank: int) -> None:
    """Every tensor (parameters, buffers, tensor attributes) of every FusedMoE module, whole."""
    tensors, meta = {}, {}
    for prefix, module in model.named_modules():
        if not isinstance(getattr(module, "w13_weight", None), torch.Tensor):
            continue
        found = layer_tensors(module)
        method = module.quant_method
        info = {"backend": method.nvfp4_backend.value, "experts": type(method.moe_kernel.fused_experts).__name__,
                "tensors": {}}
        for name, value in sorted(found.items()):
            tensors[f"{prefix}.{name}"] = value.detach().contiguous().clone()
            info["tensors"][name] = tensor_info(module, name, value)
        meta[prefix] = info
    save_file(tensors, out / f"moe-rank-{rank}.safetensors")
    (out / f"moe-rank-{rank}.json").write_text(json.dumps(meta, indent=2))


def load(ckpt: str, arch: str, tp: int, rank: int, out: Path) -> None:
    """One model build (one VllmConfig each: attention layers register their names in it)."""
    moe, ep = arch in MOE_ARCH, arch.endswith("-ep")
    _, backend = select(MOE_ARCH.get(arch, arch))
    # a fresh process's state: vLLM normalizes each transform tensor once per data_ptr, remembered class-wide, so
    # a later model's tensor at a freed address would be left unnormalized
    HadamardTransform.scaled_data_ptrs.clear()
    cfg = EngineArgs(
        model=ckpt, dtype=AUTO_ARCHS.get(MOE_ARCH.get(arch, arch), "bfloat16"), max_model_len=128, enforce_eager=True,
        load_format="safetensors",
        linear_backend=backend, moe_backend="marlin" if moe and backend == "marlin" else "auto",
        tensor_parallel_size=tp, distributed_executor_backend="mp",
        enable_expert_parallel=ep,
    ).create_engine_config()
    with set_current_vllm_config(cfg):
        if not torch.distributed.is_initialized():  # once per process, inside a config as vLLM wants
            init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"file://{out.parent / 'dist-init'}")
            initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
        else:  # vLLM makes the expert-parallel group for MoE models only: each job gets its own model's groups
            destroy_model_parallel()
            initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
        model = get_model_loader(cfg.load_config).load_model(vllm_config=cfg, model_config=cfg.model_config)
        if moe:
            dump_moe(model, out, rank)
        # the cute-dsl W4A16 kernel's state (forced, or vLLM's auto on sm100) as its buffers; every other kernel's
        # (W4A4, Marlin) every tensor
        cute_dsl = all(type(kernel) is KERNEL for _, _, kernel in fused_layers(model))
        (dump if cute_dsl else dump_w4a4)(model, out, rank)


def load_recording(ckpt: str, arch: str, tp: int, rank: int, out: Path) -> None:
    """:func:`load`, and the transform methods vLLM chose (Humming's on 0.34 cannot load on CPU: its choice is the
    record), in ``methods.json``, whether vLLM loads the checkpoint or refuses it."""
    _current["methods"] = []
    try:
        load(ckpt, arch, tp, rank, out)
    finally:
        (out / "methods.json").write_text(json.dumps(_current["methods"]))


def cleanup() -> None:
    destroy_model_parallel()
    destroy_distributed_environment()


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main(__file__, load_recording, patch, cleanup))
