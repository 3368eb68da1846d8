"""The CPU port of Marlin's load (repack/targets/marlin.py, moe_marlin.py) against vLLM's own CUDA op and
post-load functions on a GPU, bit for bit (vLLM 0.33 or 0.34, whichever is staged: their Marlin code is the same
for NVFP4). Skips without a CUDA GPU or without vLLM's ``_C`` (CI has neither).

On the H200 (vLLM 0.33 staged by ../shared/vllm-gpu, 0.34 by scripts/stage_vllm_gpu.sh; docs/serving.md):

    PYTHONPATH=.:/tmp/site python3 -m pytest -q -p no:cacheprovider tests/test_gpu_marlin.py

- ``torch.ops._C.gptq_marlin_repack`` (csrc/quantization/gptq_marlin/gptq_marlin_repack.cu, 4 bits) on random
  codes of many shapes (every multiple-of-tile case vLLM pads to, odd counts of tiles, large layers) against
  :func:`~repack.targets.marlin.repack_codes` and its inverse;
- vLLM's ``prepare_fp4_layer_for_marlin`` (dense, bf16 and fp16 activations) and
  ``prepare_nvfp4_moe_layer_for_marlin`` (MoE, intermediate sizes vLLM pads) run on the GPU against the CPU port.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from repack.nvfp4 import NVFP4Weight
from repack.targets import marlin, moe_marlin
from repack.targets.moe import ExpertStack


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM (../shared/vllm-gpu)"
    return None


REASON = _unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

# (N, K) of the codes as gptq_marlin_repack takes them (already padded: N % 64, K % 16 and one of the tile
# families): one tile, odd tile counts, the padded shapes vLLM makes of odd layers, Llama-3-8B's and MoE shapes.
REPACK_SHAPES = [(64, 16), (64, 128), (128, 64), (192, 48), (320, 80), (64, 1024), (1024, 64), (448, 272),
                 (576, 1104), (4096, 4096), (6144, 4096), (4096, 14336), (28672, 128), (1536, 2048), (2048, 768),
                 (512, 2880), (2880, 512), (64, 7168), (7168, 256), (192, 16), (960, 112), (128, 5120)]
# (N, K) of dense layers before vLLM pads them: aligned, padded on N or K or both, tiny.
DENSE_SHAPES = [(64, 128), (96, 80), (200, 48), (16, 16), (4096, 4096), (1000, 1008), (2880, 2880), (128, 64),
                (40, 4112), (8192, 1024)]
# (E, H, I) of MoE layers: Qwen3-30B-A3B's experts, I padded to 64 (H % 128) and to 128 (H % 128 = 64).
MOE_SHAPES = [(8, 2048, 768), (4, 128, 48), (3, 192, 64), (2, 320, 80), (4, 1024, 208)]


def _repack_on_gpu(codes: torch.Tensor) -> torch.Tensor:
    import vllm._custom_ops as ops

    n, half_k = codes.shape
    qweight = codes.cuda().view(torch.int32).T.contiguous()
    return ops.gptq_marlin_repack(qweight, size_k=2 * half_k, size_n=n, num_bits=4).cpu()


@pytest.mark.parametrize(("n", "k"), REPACK_SHAPES)
def test_repack_codes_is_vllms_cuda_op(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 100003 + k)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    expected = _repack_on_gpu(codes)
    got = marlin.repack_codes(codes, n, k)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.equal(got, expected), f"N={n} K={k}: {(got != expected).sum()} int32 differ"
    assert torch.equal(marlin.unrepack_codes(got, n, k), codes)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in logical order, 0-d tensors too (vLLM holds Marlin's global scale as float32 [], which
    ``view(torch.uint8)`` refuses)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class _Layer(torch.nn.Module):
    """The attributes vLLM's Marlin preparation reads off a linear or FusedMoE layer."""


def _scales(gen: torch.Generator, shape: tuple[int, ...], top: float) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) * top).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("n", "k"), DENSE_SHAPES)
def test_dense_layer_is_vllms_prepare(n: int, k: int, dtype: torch.dtype) -> None:
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_fp4_layer_for_marlin

    gen = torch.Generator().manual_seed(n * 7 + k)
    weight = NVFP4Weight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                         _scales(gen, (n, k // 16), 60.0), torch.tensor([3e-4]))
    layer = _Layer()
    layer.weight = torch.nn.Parameter(weight.codes.cuda(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(weight.block_scales.cuda(), requires_grad=False)
    # float32 [], as vLLM's NVFP4 schemes hold it after loading (tests/test_vllm_marlin_conformance.py)
    layer.weight_global_scale = torch.nn.Parameter(weight.multiplier.reshape(()).cuda(), requires_grad=False)
    layer.output_size_per_partition, layer.input_size_per_partition, layer.params_dtype = n, k, dtype
    prepare_fp4_layer_for_marlin(layer)
    runtime = marlin.to_runtime(weight, dtype)
    for name in ("weight", "weight_scale", "weight_global_scale"):
        held, ours = getattr(layer, name).detach().cpu(), getattr(runtime, name)
        assert held.dtype == ours.dtype and held.shape == ours.shape, (name, held.shape, ours.shape)
        assert torch.equal(raw_bytes(held), raw_bytes(ours)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("e", "h", "i"), MOE_SHAPES)
def test_moe_layer_is_vllms_prepare(e: int, h: int, i: int, dtype: torch.dtype) -> None:
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_nvfp4_moe_layer_for_marlin

    gen = torch.Generator().manual_seed(e * 13 + h + i)
    stack = ExpertStack(
        w13_codes=torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=gen),
        w13_scales=_scales(gen, (e, 2 * i, h // 16), 100.0), w13_multiplier=torch.rand(e, 2, generator=gen) * 1e-3,
        w13_input_scale=torch.ones(e, 2),
        w2_codes=torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=gen),
        w2_scales=_scales(gen, (e, h, i // 16), 3.0), w2_multiplier=torch.rand(e, generator=gen) * 1e-3,
        w2_input_scale=torch.ones(e),
    )
    layer = _Layer()
    layer.num_experts, layer.hidden_size, layer.intermediate_size_per_partition, layer.params_dtype = e, h, i, dtype
    held = prepare_nvfp4_moe_layer_for_marlin(
        layer, stack.w13_codes.cuda(), stack.w13_scales.cuda(), stack.w13_multiplier[:, 0].contiguous().cuda(),
        stack.w2_codes.cuda(), stack.w2_scales.cuda(), stack.w2_multiplier.cuda(), True)
    ours = moe_marlin.to_runtime(stack, dtype=dtype)
    names = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale", "w2_weight_scale_2")
    for name, tensor in zip(names, held):
        tensor = tensor.detach().cpu().contiguous()
        assert tensor.dtype == ours[name].dtype and tensor.shape == ours[name].shape, (name, tensor.shape)
        assert torch.equal(raw_bytes(tensor), raw_bytes(ours[name])), name


# --- serving: Marlin bundles through the plugin against vLLM's own Marlin load of the source and a bf16 model ---
# Qwen3-30B-A3B's decoder (hidden 2048, 32 heads of 128, 4 kv heads, 128 experts of 768, top-8), cut to 4 layers.
QWEN3_30B_A3B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, intermediate=768, top_k=8)
MARLIN_ENGINE = dict(linear_backend="marlin", moe_backend="marlin")  # vLLM's Marlin on this Hopper GPU
PROMPTS, PROMPT_LEN = 4, 48


def _sane_weights(root, gen: torch.Generator) -> None:
    """A random checkpoint whose activations stay finite through its layers: e4m3 block scales 0.5 .. 1.9, a
    multiplier of 0.005 (ModelOpt's weight_scale_2), embeddings, lm_head and routers of standard deviation 0.02."""
    from safetensors.torch import load_file, save_file

    for file in root.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if t.dtype == torch.float8_e4m3fn:
                tensors[name] = torch.randint(0x30, 0x40, t.shape, dtype=torch.uint8, generator=gen).view(t.dtype)
            elif name.endswith("weight_scale_2"):
                tensors[name] = torch.full_like(t, 0.005)
            elif t.dtype == torch.bfloat16 and t.dim() == 2:
                tensors[name] = (torch.randn(t.shape, generator=gen) * 0.02).to(torch.bfloat16)
        save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def measured_loads():
    """Each model load's wall time and peak GPU memory allocated during it (vLLM's in-process engine)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    loads: list[tuple[str, float, float]] = []
    original = BaseModelLoader.load_model

    def timed(self, vllm_config, model_config, prefix=""):
        import time

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before, start = torch.cuda.memory_allocated(), time.perf_counter()
        model = original(self, vllm_config, model_config, prefix)
        torch.cuda.synchronize()
        loads.append((type(self).__name__, time.perf_counter() - start,
                      (torch.cuda.max_memory_allocated() - before) / 2**30))
        return model

    BaseModelLoader.load_model = timed
    yield loads
    BaseModelLoader.load_model = original


def state_digest(model: torch.nn.Module) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Every parameter and buffer of a vLLM model on the GPU: dtype, shape and a digest of its bytes (module-level,
    for ``LLM.apply_model``). A parameter vLLM 0.34 retired (ModelOpt's loaded ``input_scale`` /
    ``w13_input_scale`` / ``w2_input_scale``, which weight-only Marlin never reads) is compared by its flag, not its
    bytes: vLLM keeps the source's per-partition values there and the bundle its one folded scale, as
    tests/vllm/plugin_checks.py's ``tensor_state`` compares them on CPU (docs/serving.md, known differences)."""
    import hashlib

    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        retired = bool(getattr(t, "retired", False))
        data = raw_bytes(t).cpu().numpy() if t.numel() and not retired else b""
        out[name] = (str(t.dtype), tuple(t.shape), retired, hashlib.sha256(data).hexdigest())
    return out


def _serve_three(source, bundle, dense, prompts, loads, **engine):
    """Prompt log-probabilities of the bundle (plugin), the source (vLLM's own Marlin load) and the bf16 model."""
    from tests import vllm_gpu

    out = {}
    for key, path, extra in (("bundle", bundle, dict(load_format="nvfp4_repack", **MARLIN_ENGINE)),
                             ("source", source, MARLIN_ENGINE), ("bf16", dense, {})):
        with vllm_gpu.engine(path, enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.05,
                             kv_cache_memory_bytes=256 << 20, max_num_seqs=8, **extra, **engine) as llm:
            out[key] = vllm_gpu.prompt_logprobs(llm, prompts)
            out[f"{key}:kernels"] = llm.apply_model(vllm_gpu.linear_kernels)[0]
            if key != "bf16":
                out[f"{key}:state"] = llm.apply_model(state_digest)[0]
        out[f"{key}:load"] = loads[-1]
    return out


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_marlin_bundle_serves_as_vllms_own_marlin_load(case, tmp_path, measured_loads):
    """A Marlin bundle (``--target sm80``) served by the staged vLLM (0.33 or 0.34) on this GPU with its Marlin
    kernels (the plugin, no repack) against vLLM's own Marlin load of the source and a bf16 model of the dequantized weights: the bundle's
    prompt log-probabilities are the source's (same bytes, same kernel) and as close to bf16."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from repack.convert import convert
    from repack.sample.synthetic import write_qwen_moe
    from repack.vllm_plugin import register
    from tests import vllm_gpu

    register()
    gen = torch.Generator().manual_seed(0)
    if case == "dense":
        source = vllm_gpu.write_shaped_llama(tmp_path / "source", vllm_gpu.LLAMA3_8B, 2, 4096, gen)
    else:
        shape = dict(QWEN3_30B_A3B)
        source = write_qwen_moe(tmp_path / "source", "modelopt", generator=gen, layers=4, vocab=4096, **shape)
        _sane_weights(source, gen)
    import vllm

    convert(source, "sm80", tmp_path / "bundle", fuse=True, vllm=".".join(vllm.__version__.split(".")[:2]))
    dense = vllm_gpu.write_dequantized(source, tmp_path / "bf16")
    prompts = vllm_gpu.random_prompts(PROMPTS, PROMPT_LEN, 4096, gen)
    out = _serve_three(source, tmp_path / "bundle", dense, prompts, measured_loads)
    bundle_err = float((out["bundle"] - out["bf16"]).abs().mean())
    source_err = float((out["source"] - out["bf16"]).abs().mean())
    same = float((out["bundle"] - out["source"]).abs().max())
    print(f"\n{case}: mean |logprob - bf16| bundle {bundle_err:.4f} source {source_err:.4f}; max |bundle - source| "
          f"{same:.2e}; kernels {out['bundle:kernels']} / {out['source:kernels']}; loads (loader, s, peak GiB): "
          f"bundle {out['bundle:load']} source {out['source:load']} bf16 {out['bf16:load']}")
    assert out["bundle:kernels"] == out["source:kernels"] == ["MarlinNvFp4LinearKernel"]
    differ = [k for k in out["source:state"] if out["bundle:state"].get(k) != out["source:state"][k]]
    assert not differ and set(out["bundle:state"]) == set(out["source:state"]), differ[:8]  # vLLM's state, on the GPU
    # the same state through the same kernels: equal for dense layers; Marlin's MoE GEMM reduces with atomics (its
    # sums' order varies from run to run), 0.031 nats at most measured on 4 x 47 prompt tokens
    assert same <= (0.0 if case == "dense" else 0.1), same
    assert bundle_err <= 2 * source_err + 0.005 and bundle_err < 0.1, (bundle_err, source_err)
