"""SGLang 0.5.23 as the oracle, on CPU: load a checkpoint through SGLang's own model loader (``get_model``: its
config, quantization method, weight loaders, fusion, ``process_weights_after_loading``) and dump every tensor each
NVFP4 linear layer holds after it.

Runs in the SGLang virtualenv (tests/sglang/make_env.sh), never in the project's env, and imports nothing from the
project. The GPU is emulated through SGLang's own platform override (``override_platform``: ``is_sm100`` /
``is_sm120``, ``is_blackwell``, the capability), and ``initialize_fp4_gemm_config`` runs under it, as the scheduler
runs it, so SGLang's ``auto`` picks the dense FP4 backend of that GPU (its probes of ``is_cuda`` and the capability
answer as that GPU: Marlin on sm80-sm90). Replaced, in the blocks marked PATCH: the ``.cuda()`` that ends ModelOpt's
scale swizzle, torch.cuda's capability (read by compressed-tensors' scheme check), the rotary embedding's choice of
vLLM's custom op (a module of another engine, taken on a non-CUDA build; RoPE holds no NVFP4 state), FP4 Marlin's
CUDA leaf calls (``gptq_marlin_repack``: the torch port of tests/vllm/ports.py; its scratch workspace sized for a
132-SM GPU) and FlashInfer's public ``prepare_bf16_fp4_weights``, which refuses CPU tensors (its sm100 cute-dsl
prepare runs itself). torchvision (image processing, CUDA builds only for this torch) is stubbed
(tests/sglang/stubs.py). Every patched name is asserted to exist and the versions are pinned, so that an upgrade
fails loudly instead of testing something else.

    python harness.py --tp N --job NAME=CKPT:ARCH [--job ...] --out DIR
        ARCH: sm100 | sm120 | sm90 | sm80 (SGLang's auto backends on that GPU: dense FP4 GEMM and NVFP4 MoE; a
        dense layer FP4 Marlin serves records backend "marlin", whatever the backend), optionally
        ARCH@MOE_BACKEND (``--moe-runner-backend MOE_BACKEND``), ARCH%FP4_BACKEND (``--fp4-gemm-backend FP4_BACKEND``:
        ``sm100%marlin``) and a trailing ``+ep`` (``--ep-size`` = TP: expert parallelism); ARCH-plugin: CKPT is a
        bundle, loaded
        with --load-format nvfp4_repack through the project's SGLang plugin (registered as SGLang's plugin loader
        runs it: the one job kind that imports the project)

FusedMoE layers: ServerArgs is resolved on the emulated GPU (SGLang's MoE runner backend choice reads the platform and
the checkpoint: ``_moe_runner_backend_quant_constraints``, the model overrides) and ``initialize_moe_config`` seeds
the MoE flags from it, as the scheduler does. FlashInfer (SGLang's pin, 0.7.2) runs its row permutations as is; its
``nvfp4_block_scale_interleave`` (a JIT-built CUDA op) is the torch port of tests/vllm/ports.py (PATCH MoE 1).

writes ``OUT/NAME/rank-R.safetensors`` (per layer ``P.<name>``: each tensor's whole storage, as uint8) and
``OUT/NAME/rank-R.json`` (per layer: its quantization method and backend, its non-tensor state, each tensor's dtype,
shape, stride, offset and the earlier name whose storage it shares, if any), or ``OUT/NAME/refused.txt`` with
SGLang's error when it refuses.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/: oracle_cli
import stubs  # noqa: E402

stubs.install()

import flashinfer  # noqa: E402
from flashinfer.gemm import gemm_bf16_fp4_cute_dsl as fi_cute  # noqa: E402
import sglang  # noqa: E402
import torch  # noqa: E402
from oracle_cli import layer_tensors, main, storage_bytes, view_record  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from sglang.srt.configs.device_config import DeviceConfig  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.distributed import (  # noqa: E402
    destroy_distributed_environment,
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from sglang.srt.layers.quantization import fp4_utils  # noqa: E402
from sglang.srt.layers.quantization import marlin_utils_fp4, modelopt_quant  # noqa: E402
from sglang.srt.layers.moe import utils as moe_utils  # noqa: E402
from sglang.srt.layers.rotary_embedding import base as rope  # noqa: E402
from sglang.srt.model_loader import get_model  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, override_platform, publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

assert sglang.__version__ == "0.5.23", sglang.__version__
assert flashinfer.__version__ == "0.7.2", flashinfer.__version__
assert hasattr(flashinfer, "nvfp4_block_scale_interleave") and hasattr(moe_utils, "initialize_moe_config")
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert isinstance(rope._is_cpu, bool)
assert hasattr(modelopt_quant.ModelOptFp4LinearMethod, "process_weights_after_loading")
assert not hasattr(marlin_utils_fp4, "gptq_marlin_repack") and hasattr(marlin_utils_fp4, "marlin_make_workspace")
assert hasattr(fp4_utils, "is_cuda") and hasattr(fp4_utils, "get_device_capability")
assert hasattr(modelopt_quant, "is_cuda") and hasattr(modelopt_quant, "get_device_capability")

# Our arch -> SGLang's platform facts for that GPU (the names its probes answer under override_platform).
PLATFORMS = {
    "sm100": dict(is_sm100=True, is_sm120=False, is_blackwell=True, device_capability=(10, 0), device_sm=100),
    "sm120": dict(is_sm100=False, is_sm120=True, is_blackwell=True, device_capability=(12, 0), device_sm=120),
    "sm90": dict(is_sm100=False, is_sm120=False, is_blackwell=False, device_capability=(9, 0), device_sm=90),
    "sm80": dict(is_sm100=False, is_sm120=False, is_blackwell=False, device_capability=(8, 0), device_sm=80),
}
SMS = 132  # the emulated GPU's multiprocessor count: the size of Marlin's scratch workspace
_current = {"capability": (10, 0)}  # the job's emulated GPU
NON_TENSOR = ("weights_padding_cols", "input_size_per_partition", "output_size_per_partition", "logical_widths",
              "use_flashinfer_bf16_fp4", "flashinfer_backend")
MOE_NON_TENSOR = ("intermediate_size_per_partition", "num_local_experts", "num_experts", "moe_ep_size", "moe_ep_rank",
                  "moe_tp_size", "trtllm_padded_hidden_size")


def _ports():
    """tests/vllm/ports.py (torch only), by its path: the torch ports of FlashInfer's CUDA-only leaf calls the vLLM
    oracle uses, shared (``tests/vllm`` is not importable as ``vllm`` here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ports", Path(__file__).resolve().parent.parent / "vllm" / "ports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def patch() -> None:
    # PATCH 1: ModelOpt's dense post-processing ends its scale swizzle in .cuda(); run SGLang's own method with
    # Tensor.cuda an identity.
    method = modelopt_quant.ModelOptFp4LinearMethod
    process = method.process_weights_after_loading

    def process_on_cpu(self, layer):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return process(self, layer)
        finally:
            torch.Tensor.cuda = cuda

    method.process_weights_after_loading = process_on_cpu

    # PATCH 2: on a build that is neither CUDA nor SGLang's CPU engine, RotaryEmbedding imports vLLM's custom op;
    # the CPU engine's answer (torch RoPE) instead. Not NVFP4 state.
    rope._is_cpu = True

    # PATCH 3: compressed-tensors' scheme check asks torch.cuda for the capability; the emulated GPU's.
    torch.cuda.get_device_capability = lambda device=None: _current["capability"]

    ports = _ports()

    # PATCH 4: initialize_fp4_gemm_config picks Marlin on sm80-sm90 through utils' is_cuda and
    # get_device_capability (not the platform override); they answer as the emulated GPU.
    fp4_utils.is_cuda = lambda: True
    fp4_utils.get_device_capability = lambda device_id=0: _current["capability"]
    # ... and ModelOpt's NVFP4 MoE method picks FP4 Marlin on sm80-sm9x by modelopt_quant's own (``__init__``,
    # ``create_moe_runner``; on sm100 / sm120 they answer as SGLang's auto does there).
    modelopt_quant.is_cuda = lambda: True
    modelopt_quant.get_device_capability = lambda device_id=0: _current["capability"]

    # PATCH 5: FP4 Marlin's CUDA leaf calls (imported only on a CUDA build): gptq_marlin_repack as the torch port the
    # vLLM oracle runs (tests/vllm/ports.py, checked against the CUDA op by tests/test_gpu_marlin.py), and the scratch
    # workspace sized by the emulated GPU's multiprocessor count instead of torch.cuda's.
    def repack(b_q_weight, perm, size_k, size_n, num_bits):
        assert perm.numel() == 0, "act-order"
        return ports.gptq_marlin_repack(b_q_weight, size_k, size_n, num_bits)

    marlin_utils_fp4.gptq_marlin_repack = repack
    marlin_utils_fp4.marlin_make_workspace = lambda device, max_blocks_per_sm=1: torch.zeros(
        SMS * max_blocks_per_sm, dtype=torch.int, device=device)

    # PATCH 6: FlashInfer's public prepare_bf16_fp4_weights refuses CPU tensors (its backend checks ask the device);
    # its sm100 cute-dsl prepare itself (a view of the swizzled scales) runs on CPU.
    def prepare_on_cpu(b, b_descale, alpha=None, *, backend, block_size=16):
        assert backend == "cute-dsl" and _current["capability"][0] == 10, (backend, _current["capability"])
        return fi_cute._prepare_cute_dsl_sm100(b, b_descale, alpha, block_size)

    flashinfer.prepare_bf16_fp4_weights = prepare_on_cpu

    # PATCH MoE 1: FlashInfer's nvfp4_block_scale_interleave is a JIT-built CUDA op; its torch port (SGLang's
    # prepare_static_weights_for_trtllm_fp4_moe imports it from flashinfer at call time).
    flashinfer.nvfp4_block_scale_interleave = ports.block_scale_interleave


def nvfp4_layers(model):
    """``(prefix, layer)`` of every dense NVFP4 linear module (FusedMoE modules hold ``w13_*`` instead)."""
    for prefix, layer in model.named_modules():
        names = set(layer_tensors(layer))
        if names & {"weight_scale", "weight_scale_interleaved"} and "w13_weight" not in names:
            yield prefix, layer


def moe_state(layer) -> dict:
    """A FusedMoE module's non-tensor post-load state: the CUTLASS SwiGLU parameters (None, or their shapes), the
    dispatcher's quant config (each value None, or the module's tensor it is), whether the packed names remain."""
    names = {id(v): k for k, v in layer_tensors(layer).items()}
    out = {"packed": sorted(n for n in ("w13_weight_packed", "w2_weight_packed") if hasattr(layer, n))}
    if hasattr(layer, "_cutlass_swiglu_params"):
        out["cutlass_swiglu_params"] = [None if t is None else list(t.shape) for t in layer._cutlass_swiglu_params]
    config = getattr(getattr(layer, "dispatcher", None), "quant_config", None)
    if isinstance(config, dict):
        out["dispatcher_quant_config"] = {k: None if v is None else names.get(id(v), "?") for k, v in config.items()}
    return out


def moe_layers(model):
    """``(prefix, layer)`` of every NVFP4 FusedMoE module."""
    for prefix, layer in model.named_modules():
        names = set(layer_tensors(layer))
        if "w13_weight" in names and "w13_weight_scale" in names:
            yield prefix, layer


def dump(model, out: Path, rank: int, backend: str) -> None:
    tensors, meta = {}, {}
    moe_backend = moe_utils.get_moe_runner_backend().value
    layers = [(p, l, False) for p, l in nvfp4_layers(model)] + [(p, l, True) for p, l in moe_layers(model)]
    for prefix, layer, moe in layers:
        scheme = getattr(layer, "scheme", None)
        if moe:
            info = {"method": type(scheme or layer.quant_method).__name__, "backend": moe_backend, "moe": True,
                    "tensors": {}}
            info.update({k: getattr(layer, k) for k in MOE_NON_TENSOR if hasattr(layer, k)})
            info.update(moe_state(layer))
        else:
            kernel = "marlin" if hasattr(layer, "workspace") else backend  # FP4 Marlin serves it whatever the backend
            info = {"method": type(scheme or layer.quant_method).__name__, "backend": kernel, "tensors": {}}
            info.update({k: getattr(layer, k) for k in NON_TENSOR if hasattr(layer, k)})
        seen: dict[tuple[int, int], str] = {}
        for name, value in sorted(layer_tensors(layer).items()):
            key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
            record = view_record(value)
            if key in seen:
                record["alias"] = seen[key]
            else:
                seen[key] = name
                tensors[f"{prefix}.{name}"] = storage_bytes(value)
            info["tensors"][name] = record
        meta[prefix] = info
    save_file(tensors, out / f"rank-{rank}.safetensors")
    (out / f"rank-{rank}.json").write_text(json.dumps(meta, indent=2))


def register_plugin() -> None:
    """The project's SGLang plugin, as ``load_plugins`` runs an entry point's function, then SGLang's hooks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from repack.sglang_plugin import register
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()


def load(ckpt: str, arch: str, tp: int, rank: int, out: Path) -> None:
    ep = arch.endswith("+ep")
    arch, _, moe_backend = arch.removesuffix("+ep").partition("@")
    plugin = arch.endswith("-plugin")
    if plugin:
        register_plugin()
    arch, _, fp4_backend = arch.removesuffix("-plugin").partition("%")
    _current["capability"] = PLATFORMS[arch]["device_capability"]
    with override_platform(**PLATFORMS[arch]):
        # resolved on the emulated GPU (its MoE runner backend choice reads the platform), as on that GPU
        args = ServerArgs(model_path=ckpt, device="cpu", tp_size=tp, dtype="bfloat16", skip_tokenizer_init=True,
                          load_format="nvfp4_repack" if plugin else "auto", moe_runner_backend=moe_backend or "auto",
                          fp4_gemm_runner_backend=fp4_backend or "auto", ep_size=tp if ep else 1)
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
        moe_utils.initialize_moe_config()  # as the scheduler does
        if not torch.distributed.is_initialized():
            init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"file://{out.parent / 'dist-init'}")
            initialize_model_parallel(backend="gloo")
        fp4_utils.FP4_GEMM_RUNNER_BACKEND = None
        fp4_utils.initialize_fp4_gemm_config()  # as the scheduler does, on the emulated GPU
        model = get_model(model_config=ModelConfig.from_server_args(args),
                          load_config=LoadConfig(load_format=args.load_format), device_config=DeviceConfig("cpu"))
        dump(model, out, rank, fp4_utils.get_fp4_gemm_runner_backend().value)


def cleanup() -> None:
    destroy_model_parallel()
    destroy_distributed_environment()


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_LOGGING_LEVEL", "ERROR")
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main(__file__, load, patch, cleanup))
