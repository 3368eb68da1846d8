"""The ``nvfp4_repack`` vLLM model loader against vLLM 0.33's own load of the source; runs in the vLLM env.

    python -m pytest tests/vllm/plugin_checks.py      # in tests/vllm/make_env.sh's env, PYTHONPATH=<repo>

(tests/test_vllm_plugin.py runs it so from the project's suite.) Oracle: vLLM's ``DefaultModelLoader`` on the
source checkpoint, through harness.py's patches (q/k/v and gate/up fusion, TP sharding, the schemes'
post-processing, padding, swizzle and FlashInfer's per-arch preparation all run unmodified). The model the
plugin loads from the bundle, after the source's safetensors are deleted, must hold the same state: every
parameter and buffer (class, dtype, shape, strides, storage offset, the bytes of its whole storage, so a view is
compared with the buffer under it) and, per NVFP4 layer, the kernel class and the attributes the kernel reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import harness  # noqa: I001  (first: fixes vLLM's platform before anything imports vLLM)
import pytest
import torch
import vllm
from safetensors.torch import load_file, save_file
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import (
    destroy_distributed_environment,
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform
from vllm.model_executor.model_loader import get_model_loader

from repack.bundle.reader import open_bundle
from repack.convert import convert
from repack.errors import RepackError
from repack.formats import SourceModel, read_source
from repack.formats.transforms import load_matrix
from repack.nvfp4 import dequantize
from repack.sample import SAMPLE_DIR
from repack.sample.synthetic import write_llama, write_qwen_moe
from repack.vllm_plugin import register
from repack.vllm_plugin.experts import check_placement, moe_modules, unfolded_scale
from repack.vllm_plugin.kernels import RepackSm90NvFp4LinearKernel
from repack.vllm_plugin.loader import LOAD_FORMAT
from variants import OUTPUT_VARIANTS, output_variant

harness.patch()
register()  # what vLLM's plugin loader does through the vllm.general_plugins entry point
PRODUCERS = Path(__file__).resolve().parents[1] / "data" / "producers"
RUNNING = ".".join(vllm.__version__.split(".")[:2])  # the vLLM series this env runs: convert --vllm writes for it
# W4A4 checkpoints with layers vLLM 0.34's Humming Hadamard method takes on Blackwell: convert --vllm 0.34 refuses them
HUMMING_034 = {"ct_quip_vu_had32_nvfp4", "ct_spinquant_r1r2r4_had16_nvfp4", *OUTPUT_VARIANTS}


def refused_for_humming(fixture: str, source: Path, target: str, **options: object) -> bool:
    """On vLLM 0.34, a :data:`HUMMING_034` fixture's convert is refused in one line naming --vllm 0.33 (checked here);
    True then, and the caller has nothing to serve."""
    if not (harness.V034 and fixture in HUMMING_034):
        return False
    with pytest.raises(RepackError, match="--vllm 0.33"):
        convert(source, target, source.parent / "refused", fuse=True, vllm=RUNNING, **options)
    return True
# What a layer's NVFP4 kernel reads besides its three tensors.
KERNEL_ATTRS = ("weights_padding_cols", "output_size_per_partition", "input_size_per_partition", "logical_widths",
                "flashinfer_gemm_backend")  # QuTLASS's: its GEMM's FlashInfer backend


@contextlib.contextmanager
def world(tp_size: int = 1, rank: int = 0, init_file: str | None = None) -> Iterator[None]:
    """vLLM's distributed state for one rank on gloo (``init_file`` shared by the ranks of one world)."""
    init = init_file or os.path.join(tempfile.mkdtemp(prefix="vllm-plugin-"), "dist_init")
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=tp_size, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"file://{init}")
        initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def load(model: str | Path, load_format: str, target: str, tp_size: int = 1, w4a4: bool = False,
         ep: bool = False, **engine: object) -> nn.Module:
    """vLLM's ``load_model`` with its kernels emulating ``target`` (sm90: sm100's, which the plugin replaces; MoE:
    vLLM's auto NVFP4 MoE backend on that capability); ``w4a4``: vLLM's auto among its W4A4 kernels (else the
    W4A16 cute-dsl kernel, forced); ``ep``: vLLM's --enable-expert-parallel; ``engine``: more EngineArgs. Auto
    targets (sm80, sm75, sm100-auto, sm120-auto, ...: harness.AUTO_ARCHS): vLLM's auto over its CUDA list on that
    capability, in its dtype (sm75: fp16); sm120-marlin: Marlin forced, --linear-backend and --moe-backend marlin (a
    W4A4 checkpoint served weight-only, as the harness's sm120-marlin-moe)."""
    if target in harness.AUTO_ARCHS:
        _, backend = harness.select(target)
    else:
        arch = "sm120" if target == "sm120" else "sm100"
        _, backend = harness.select(f"{arch}-w4a4" if w4a4 else arch)
    HadamardTransform.scaled_data_ptrs.clear()  # a fresh process's state (see harness.load)
    engine = {"dtype": harness.AUTO_ARCHS.get(target, "bfloat16"), "moe_backend": "marlin" if backend == "marlin"
              else "auto", **engine}
    config = EngineArgs(model=str(model), max_model_len=128, enforce_eager=True,
                        load_format=load_format, linear_backend=backend, tensor_parallel_size=tp_size,
                        enable_expert_parallel=ep, **engine).create_engine_config()
    with set_current_vllm_config(config):
        return get_model_loader(config.load_config).load_model(vllm_config=config, model_config=config.model_config)


def tensor_state(t: torch.Tensor) -> tuple:
    """A tensor's class, dtype, view, device and bytes: vLLM 0.33 the bytes of its whole storage (a view is compared
    with the buffer under it); 0.34, which writes smaller results into the loaded parameter's own storage, its value
    and its storage's size, and its bookkeeping (``retired``, ``runtime_name``). The bytes after a 0.34 view's value
    (the loaded partitions' global scales behind a fused layer's, the [E, 2] behind MoE w13 scales) are the source's
    loaded values in vLLM's load and the bundle's multiplier in the plugin's: read by no kernel (docs/serving.md). A
    0.34 retired parameter (ModelOpt's loaded ``weight_scale_2`` / ``input_scale``) is compared by view and flag: vLLM
    keeps the source's per-partition values there, which a bundle folds into one scale (q/k/v input scales may
    differ); no kernel reads them (tests/test_vllm_conformance.py checks vLLM's against the source)."""
    view = (type(t).__name__, t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device.type)
    if not harness.V034:
        return (*view, bytes(t.untyped_storage()))
    retired = bool(getattr(t, "retired", False))  # its value: the source's per-partition scales (see RETIRED_VALUES)
    return (*view, t.untyped_storage().nbytes(), retired, getattr(t, "runtime_name", None),
            b"" if retired else bytes(t.detach().reshape(-1).contiguous().view(torch.uint8)))


def module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own parameters (under each of its names: vLLM 0.34 registers one under two) and buffers."""
    return [(n, t) for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]


def transform_state(name: str, module: HadamardTransform, first: dict[int, str]) -> dict[str, object]:
    """An online-transform module's matrices (not parameters: a dict on its SharedWeightParameter): per partition
    its tensor, the first partition of the model it shares memory with, whether vLLM counts it as normalized; and
    the schemes it applies."""
    state: dict[str, object] = {f"{name}:transforms": repr(module.transforms)}
    for i, part in sorted(module.weight.partitions.items()):
        key = f"{name}.weight.partitions.{i}"
        state[key] = tensor_state(part)
        state[f"{key}:shares"] = first.setdefault(part.data_ptr(), key)
        state[f"{key}:normalized"] = part.data_ptr() in HadamardTransform.scaled_data_ptrs
    return state


# What a FusedMoE kernel reads from its moe_config (vLLM's TRT-LLM-gen preparation pads the sizes in place).
MOE_CONFIG_ATTRS = ("hidden_dim", "hidden_dim_unpadded", "intermediate_size_per_partition", "num_experts",
                    "num_local_experts", "experts_per_token")


def object_state(name: str, obj: object, aliases: dict[int, str]) -> dict[str, object]:
    """The tensors (with the module tensor each aliases, if any) and plain scalars of a kernel-side object (a quant
    config, its descriptors, an experts class), one level of dataclass descriptors deep."""
    state: dict[str, object] = {f"{name}:class": type(obj).__name__}
    for attr, value in sorted(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            state[f"{name}.{attr}"] = (tensor_state(value), aliases.get(value.data_ptr()))
        elif isinstance(value, (int, float, str, bool, torch.dtype, type(None))):
            state[f"{name}.{attr}"] = value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            state.update(object_state(f"{name}.{attr}", value, aliases))
    return state


# vLLM 0.34's TRT-LLM-gen experts keep the gemm1 output scale they were built with (the unfolded w13 multiplier times
# a2_gscale) under this name, no kernel reading it after the post-load (it reads g1_scale_c): a bundle holds the folded
# multiplier, whose unfolded float32 can be either of two neighbours with the same product, so only its view is
# compared (docs/serving.md).
UNFOLDED_034 = {"_experts_g1_scale_c"}


def moe_state(name: str, module: nn.Module) -> dict[str, object]:
    """A FusedMoE module's plain tensor attributes (compressed-tensors' input scales), its MoE backend, the modular
    kernel's prepare/finalize and experts classes with their state, the quant config and the moe_config sizes."""
    tensors = {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}
    aliases = {t.data_ptr(): part for part, t in [*module_tensors(module), *tensors.items()]}
    method = module.quant_method
    state: dict[str, object] = {f"{name}.{part}": tensor_state(t)[:-1] if part in UNFOLDED_034 else tensor_state(t)
                                for part, t in tensors.items()}
    state[f"{name}:backend"] = method.nvfp4_backend.value
    state.update({f"{name}:moe_config.{a}": getattr(module.moe_config, a) for a in MOE_CONFIG_ATTRS})
    state.update(object_state(f"{name}:quant_config", method.moe_quant_config, aliases))
    state.update(object_state(f"{name}:experts", method.moe_kernel.fused_experts, aliases))
    state[f"{name}:prepare_finalize"] = type(method.moe_kernel.prepare_finalize).__name__
    return state


def layer_state(model: nn.Module) -> dict[str, object]:
    """Every parameter and buffer of ``model``, each NVFP4 layer's kernel class and kernel-read attributes, its
    quantization method's class, its online-transform modules' state, and each FusedMoE module's (``moe_state``)."""
    state: dict[str, object] = {}
    first: dict[int, str] = {}
    for name, module in model.named_modules():
        for part, t in module_tensors(module):
            state[f"{name}.{part}"] = tensor_state(t)
        for part, t in vars(module).items():  # plain tensor attributes (QuTLASS's hadamard_matrix)
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                state[f"{name}.{part}"] = (*tensor_state(t), first.get(t.data_ptr()))
        if isinstance(module, RoutedExperts):
            state.update(moe_state(name, module))
        if isinstance(module, HadamardTransform):
            state.update(transform_state(name, module, first))
        if hasattr(module, "quant_method"):
            state[f"{name}:quant_method"] = type(module.quant_method).__name__
        holder = getattr(module, "scheme", None) or getattr(module, "quant_method", None)
        kernel = getattr(holder, "kernel", None)
        if kernel is not None:
            state[f"{name}:kernel"] = type(kernel).__name__
            state[f"{name}:kernel_attrs"] = sorted(vars(kernel))
            for attr in KERNEL_ATTRS:
                state[f"{name}:{attr}"] = getattr(module, attr, None)
    return state


FIXTURES = ["modelopt_w4a16_nvfp4", "modelopt_nvfp4", "ct_nvfp4a16", "ct_nvfp4"]
W4A4_FIXTURES = ["modelopt_nvfp4", "ct_nvfp4"]
# vLLM's Llama fusion (packed_modules_mapping), written out independently of the planner under test.
PARTITIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def vllm_world():
    with world():
        yield


def _source(tmp_path: Path, fixture: str) -> Path:
    """A producer fixture's copy, or a variant of one (tests/vllm/variants.py)."""
    if fixture in OUTPUT_VARIANTS:
        return output_variant(tmp_path / "source", fixture)
    return Path(shutil.copytree(PRODUCERS / fixture, tmp_path / "source"))


def _delete_weights(source: Path) -> None:
    for file in source.glob("*.safetensors"):
        file.unlink()


# compressed-tensors' loaded MoE scalars, which vLLM's post-load leaves on the module (its kernels read the converted):
# a bundle carries them as passthrough tensors, so the plugin's values must be the source's too
KEPT = ("w13_weight_global_scale", "w13_input_global_scale", "w2_weight_global_scale", "w2_input_global_scale")


def _w4a4_states(source: Path, target: str, rescale: bool = False) -> tuple[dict, dict]:
    """The plugin's state from a W4A4 ``--fuse`` bundle of ``source`` (a private copy: its weights are deleted before
    the plugin loads) and vLLM's auto load of the source (``rescale``: a ``--rescale`` bundle, against vLLM's load of
    the checkpoint that --rescale means, ``_fold_gate_up``)."""
    bundle = source.parent / "bundle"
    convert(source, target, bundle, fuse=True, rescale=rescale, vllm=RUNNING)
    if rescale:
        _fold_gate_up(source)
    expected = layer_state(load(source, "safetensors", target, w4a4=True))
    kept = [v[-1] for k, v in expected.items() if k.rsplit(".", 1)[-1] in KEPT]  # compared byte for byte below
    method = json.loads((source / "config.json").read_text()).get("quantization_config", {}).get("quant_method")
    modules = [k for k in expected if k.endswith("routed_experts:backend")]
    assert len(kept) == 4 * len(modules) * (method == "compressed-tensors") and all(map(any, kept))
    _delete_weights(source)
    served = layer_state(load(bundle, LOAD_FORMAT, target, w4a4=True))
    return served, expected


def _fold_gate_up(source: Path) -> None:
    """Rewrite ``source``'s experts as ``--rescale`` means them, written here from the formats' definitions: each
    expert's gate and up block scales times own / largest of their two multipliers (ModelOpt ``weight_scale_2``,
    compressed-tensors ``1 / weight_global_scale``, float32), rounded to e4m3, and both global scales the larger
    multiplier's tensor."""
    for file in source.glob("*.safetensors"):
        tensors = load_file(file)
        ct = any(k.endswith(".weight_global_scale") for k in tensors)
        suffix = "weight_global_scale" if ct else "weight_scale_2"
        for gate in [k.removesuffix(f".{suffix}") for k in tensors if ".experts." in k and
                     k.endswith(f"gate_proj.{suffix}")]:
            pair = (gate, gate.replace("gate_proj", "up_proj"))
            own = [1.0 / tensors[f"{p}.{suffix}"] if ct else tensors[f"{p}.{suffix}"] for p in pair]
            top = max(range(2), key=lambda i: float(own[i]))
            for p, m in zip(pair, own):
                scales = tensors[f"{p}.weight_scale"]
                tensors[f"{p}.weight_scale"] = (scales.to(torch.float32) * (m / own[top])).to(scales.dtype)
            for p in pair:
                tensors[f"{p}.{suffix}"] = tensors[f"{pair[top]}.{suffix}"].clone()
        save_file(tensors, file, metadata={"format": "pt"})


def _differences(got: dict, expected: dict) -> list[str]:
    keys = sorted(set(got) | set(expected))
    return [k for k in keys if got.get(k, "<absent>") != expected.get(k, "<absent>")]


CUTE_DSL = [(f, "sm100") for f in FIXTURES] + [(f, "sm120") for f in FIXTURES if "a16" in f]


@pytest.mark.parametrize("fixture,target", CUTE_DSL)
def test_plugin_state_equals_vllm_load(vllm_world, tmp_path, fixture, target):
    """Bundles of the cute-dsl W4A16 layout against vLLM's load with that kernel: sm100's --weight-only ones (W4A4
    checkpoints too), sm120's --linear-backend flashinfer_cutedsl ones (weight-only checkpoints)."""
    source = _source(tmp_path, fixture)
    bundle = tmp_path / "bundle"
    options = dict(linear_backend="flashinfer_cutedsl") if target == "sm120" else dict(weight_only=True)
    convert(source, target, bundle, fuse=True, **options)
    expected = layer_state(load(source, "safetensors", target))
    _delete_weights(source)
    got = layer_state(load(bundle, LOAD_FORMAT, target))
    assert any(k.endswith("qkv_proj:kernel") for k in expected)
    assert not _differences(got, expected), f"{fixture} {target}: differs in {_differences(got, expected)[:8]}"


def sm120_weight_only(fixture: str) -> str:
    """vLLM's configuration on sm120 whose state ``convert -t sm120 --weight-only`` holds: its auto for a weight-only
    checkpoint, --linear-backend marlin for a W4A4 one (both Marlin: the harness's arch names)."""
    return "sm120-auto" if "a16" in fixture else "sm120-marlin"


@pytest.mark.parametrize("fixture", FIXTURES + ["ct_quip_vu_rhad16_nvfp4", "ct_spinquant_r1r2r4_rhad_nvfp4a16",
                                                "ct_quip_v_had16_nvfp4a16", *OUTPUT_VARIANTS])
def test_sm120_weight_only_plugin_state_equals_vllm_marlin_load(vllm_world, tmp_path, fixture):
    """``convert -t sm120 --weight-only`` (weight-only checkpoints: the default) is Marlin's bundle, its W4A4 variant
    for a W4A4 checkpoint: the plugin's state equals vLLM's Marlin load of the source on an emulated sm120 (auto, or
    --linear-backend marlin), MarlinNvFp4LinearKernel, transforms and vLLM's transform method included; no repack.
    Where vLLM refuses the source (0.33: a block-16..128 input Hadamard gets QuTLASS's method, which refuses Marlin's
    kernel), convert --vllm of the running version refuses it in one line."""
    source = _source(tmp_path, fixture)
    bundle, served = tmp_path / "bundle", sm120_weight_only(fixture)
    try:
        expected = layer_state(load(source, "safetensors", served))
    except ValueError as refusal:
        assert not harness.V034 and "QutlassNvFP4 transform requires a FlashInfer kernel" in str(refusal), refusal
        with pytest.raises(RepackError, match="--vllm 0.34"):
            convert(source, "sm120", bundle, fuse=True, weight_only=True, vllm=RUNNING)
        return
    convert(source, "sm120", bundle, fuse=True, weight_only=True, vllm=RUNNING)
    _delete_weights(source)
    got = layer_state(load(bundle, LOAD_FORMAT, served))
    assert {v for k, v in expected.items() if k.endswith(":kernel")} == {"MarlinNvFp4LinearKernel"}
    assert not _differences(got, expected), f"{fixture}: differs in {_differences(got, expected)[:8]}"


@pytest.mark.parametrize("target", ["sm100"])  # sm120's weight-only bundles are Marlin's: the test above
@pytest.mark.parametrize("fixture", ["ct_quip_vu_rhad16_nvfp4", "ct_spinquant_r1r2r4_rhad_nvfp4a16",
                                     *OUTPUT_VARIANTS])
def test_plugin_serves_transform_bundles_as_vllm_loads_them(vllm_world, tmp_path, fixture, target):
    """A QuIP (input and output rotations, a W4A4 checkpoint, --weight-only), a SpinQuant (whole-K R4, W4A16)
    bundle, and output transforms per partition (on q and v only; whole-N, one matrix per partition size): the
    same state as vLLM's load of the source with the W4A16 kernel, transform matrices, their sharing and vLLM's
    transform method included."""
    source = _source(tmp_path, fixture)
    bundle = tmp_path / "bundle"
    if refused_for_humming(fixture, source, target, weight_only=True):
        return
    convert(source, target, bundle, fuse=True, weight_only=True, vllm=RUNNING)
    reference = load(source, "safetensors", target)
    expected = layer_state(reference)
    _delete_weights(source)
    served = load(bundle, LOAD_FORMAT, target)
    got = layer_state(served)
    assert any(k.endswith(":transforms") for k in expected)
    assert any(v == "CompressedTensorsLinearTransformMethod" for v in expected.values())
    assert not _differences(got, expected), f"{fixture} {target}: differs in {_differences(got, expected)[:8]}"


def test_plugin_refuses_a_bundle_whose_transforms_vllm_does_not_build(vllm_world, tmp_path):
    convert(PRODUCERS / "ct_quip_v_had16_nvfp4a16", "sm100", tmp_path / "bundle", fuse=True)
    _edit_json(tmp_path / "bundle" / "config.json",
               lambda c: c["quantization_config"]["transform_config"]["config_groups"]["v"]["apply"][0]["ignore"]
               .append("re:.*down_proj$"))
    assert "down_proj.v_input.weight.partitions.0: vLLM's online transforms" in _refused(tmp_path / "bundle")


def test_plugin_refuses_transforms_in_another_dtype_than_the_servers(vllm_world, tmp_path):
    """A float16 model's bundle holds float16 matrices; served in bfloat16, vLLM would have rounded the source's
    matrix to bfloat16 itself: no cast of the bundle's reproduces that, so it is refused."""
    source = _source(tmp_path, "ct_quip_v_had16_nvfp4a16")
    _edit_json(source / "config.json", lambda c: c.update(dtype="float16"))
    convert(source, "sm100", tmp_path / "bundle", fuse=True)
    assert "vLLM holds it as torch.bfloat16 [16, 16], the bundle as torch.float16" in _refused(tmp_path / "bundle")


@pytest.mark.parametrize("fixture,says", [
    ("ct_quip_vu_rhad16_nvfp4", "re-convert without --weight-only"),  # W4A4, --weight-only: the W4A4 bundle serves
    ("ct_quip_v_had16_nvfp4a16", "weight-only (NVFP4A16) layer"),  # vLLM 0.33 gives NVFP4A16 layers QuTLASS too
])
def test_plugin_refuses_what_vllm_would_run_with_qutlass(vllm_world, tmp_path, monkeypatch, fixture, says):
    """On Blackwell vLLM 0.33 gives layers with a block-16..128 input Hadamard its QuTLASS method (W4A4 checkpoints
    and NVFP4A16 ones too), whose GEMM does not read the W4A16 layout; emulated here by answering vLLM's capability
    question as sm100 would. vLLM 0.34 has no QuTLASS: these random-Hadamard / weight-only layers load."""
    from vllm.platforms import current_platform

    convert(PRODUCERS / fixture, "sm100", tmp_path / "bundle", fuse=True, weight_only=True)

    def blackwell(capability, device_id=0) -> bool:
        return (capability if isinstance(capability, int) else capability[0] * 10 + capability[1]) <= 100

    monkeypatch.setattr(current_platform, "has_device_capability", blackwell)
    if harness.V034:  # no QuTLASS: its transform method around the bundle's W4A16 kernel (Humming's needs CUDA here)
        methods = {type(m.quant_method).__name__ for m in load(tmp_path / "bundle", LOAD_FORMAT, "sm100").modules()
                   if hasattr(m, "quant_method")}
        assert "CompressedTensorsLinearTransformMethod" in methods and not any("Qutlass" in m for m in methods)
        return
    message = _refused(tmp_path / "bundle")
    assert "QutlassNvFP4LinearMethod" in message and says in message


@pytest.mark.parametrize("target", ["sm100", "sm120"])
@pytest.mark.parametrize("fixture", ["ct_quip_vu_rhad16_nvfp4", "ct_quip_vu_had32_nvfp4",
                                     "ct_spinquant_r1r2r4_had16_nvfp4", "whole-n-output"])
def test_plugin_serves_rotated_w4a4_bundles_as_vllm_loads_them(vllm_world, tmp_path, fixture, target):
    """W4A4 rotated checkpoints on (emulated) Blackwell, where vLLM's auto gives layers whose input blocks are all
    16..128 QutlassNvFP4LinearMethod: the W4A4 bundle's model holds the state of vLLM's load of the source, its
    fused_alpha, fused_global_scale, hadamard_matrix (and which transform tensor that is), FlashInfer backend,
    transform matrices and method classes included. vLLM 0.34 (no QuTLASS): Humming's Hadamard method where it takes
    a layer, refused by convert; its transform method around the W4A4 kernel elsewhere, the same state."""
    source = _source(tmp_path, fixture)
    if refused_for_humming(fixture, source, target):
        return
    got, expected = _w4a4_states(source, target)
    qutlass = not harness.V034
    assert any(v == "QutlassNvFP4LinearMethod" for v in expected.values()) == qutlass
    assert any(k.endswith(".hadamard_matrix") for k in expected) == qutlass
    assert any(v == "CompressedTensorsLinearTransformMethod" for v in expected.values()) or qutlass
    assert not _differences(got, expected), f"{fixture} {target}: differs in {_differences(got, expected)[:8]}"


AUTO_W4A4 = {"sm100": "FlashInferCuteDslNvFp4LinearKernel", "sm120": "FlashInferCutlassNvFp4LinearKernel"}


@pytest.mark.parametrize("target", ["sm100", "sm120"])
@pytest.mark.parametrize("fixture", W4A4_FIXTURES)
def test_w4a4_plugin_state_equals_vllm_auto_load(vllm_world, tmp_path, fixture, target):
    """A W4A4 bundle (the default for these checkpoints) against vLLM's auto W4A4 load of the source: every
    parameter (input_global_scale, its inverse and alpha included) and the kernel class auto picks."""
    got, expected = _w4a4_states(_source(tmp_path, fixture), target)
    assert expected["model.layers.0.self_attn.qkv_proj:kernel"] == AUTO_W4A4[target]
    assert "model.layers.0.self_attn.qkv_proj.alpha" in expected
    assert not _differences(got, expected), f"{fixture} {target}: differs in {_differences(got, expected)[:8]}"


def test_w4a4_bundle_refuses_a_kernel_of_another_layout(vllm_world, tmp_path):
    convert(PRODUCERS / "ct_nvfp4", "sm100", tmp_path / "bundle", fuse=True)
    with pytest.raises(RepackError) as caught:
        load(tmp_path / "bundle", LOAD_FORMAT, "sm100")  # the CPU list holds only the W4A16 kernel: vLLM picks it
    assert "\n" not in str(caught.value)
    assert "vLLM chose FlashInferCuteDslNvFp4W4A16LinearKernel for this W4A4 bundle" in str(caught.value)


def _tp2_rank(rank: int, cases: list[tuple[str, str, str, bool, bool]], init_file: str, results: str) -> None:
    """One rank of a TP=2 world on gloo: vLLM's load of each source, then (its weights deleted) the plugin's; a
    case with ``ep`` loads with --enable-expert-parallel. A case whose source is "" expects the plugin to refuse."""
    import torch.distributed as dist

    out = {}
    with world(tp_size=2, rank=rank, init_file=init_file):
        for source, bundle, target, w4a4, ep in cases:
            if not source:
                try:
                    load(bundle, LOAD_FORMAT, target, tp_size=2, w4a4=w4a4, ep=ep)
                    out[bundle] = ["not refused"]
                except RepackError as refusal:
                    out[bundle] = [] if "--enable-expert-parallel exactly when" in str(refusal) else [str(refusal)]
                continue
            expected = layer_state(load(source, "safetensors", target, tp_size=2, w4a4=w4a4, ep=ep))
            dist.barrier()
            if rank == 0:
                _delete_weights(Path(source))
            dist.barrier()
            got = layer_state(load(bundle, LOAD_FORMAT, target, tp_size=2, w4a4=w4a4, ep=ep))
            out[Path(source).parent.name] = _differences(got, expected) or (
                [] if any(k.endswith("qkv_proj:kernel") for k in got) else ["no fused layer loaded"])
    Path(results, f"rank-{rank}.json").write_text(json.dumps(out))


# The producer fixtures' MLP (176) splits into per-rank K = 88, which vLLM cannot serve at TP = 2; this Llama
# splits cleanly and has one kv head, which vLLM replicates on both ranks.
def _tp2_llama(root: Path, fmt: str, gen: torch.Generator, w4a4: bool = False) -> Path:
    return write_llama(root, fmt, hidden=64, heads=4, kv_heads=1, intermediate=224, generator=gen, layers=2,
                       w4a4=w4a4)


MOE_TP2 = [("ct_moe_nvfp4", "sm100", False), ("modelopt_moe_nvfp4", "sm120", False),
           ("modelopt_moe_nvfp4", "sm100", True), ("ct_moe_nvfp4", "sm120", True)]


def test_plugin_state_equals_vllm_load_tp2(tmp_path):
    """Both formats and both targets at TP = 2, weight-only (sm120: Marlin, and cute-dsl with --linear-backend
    flashinfer_cutedsl) and W4A4 (vLLM's auto W4A4 kernels), MoE bundles with
    and without expert parallelism (and one refused where vLLM's placement differs), in one two-process world (each
    process imports vLLM once)."""
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for fmt, w4a4 in (("modelopt", False), ("compressed-tensors", True)):
        # sm120: Marlin's (vLLM's auto for a weight-only checkpoint, --linear-backend marlin for a W4A4 one)
        for target, served in (("sm100", "sm100"), ("sm120", "sm120-marlin" if w4a4 else "sm120-auto")):
            case = tmp_path / f"{fmt}-{target}"
            source = _tp2_llama(case / "source", fmt, gen, w4a4)
            convert(source, target, case / "bundle", fuse=True, tp=2, weight_only=True)
            cases.append((str(source), str(case / "bundle"), served, False, False))  # OUT, as `vllm serve OUT` is given
    case = tmp_path / "cute-dsl-sm120"  # sm120's cute-dsl W4A16 layout, vLLM's --linear-backend flashinfer_cutedsl
    source = _tp2_llama(case / "source", "modelopt", gen)
    convert(source, "sm120", case / "bundle", tp=2, linear_backend="flashinfer_cutedsl")
    cases.append((str(source), str(case / "bundle"), "sm120", False, False))
    for fmt, target in (("modelopt", "sm100"), ("compressed-tensors", "sm120")):  # W4A4 bundles, the default
        case = tmp_path / f"w4a4-{fmt}-{target}"
        source = _tp2_llama(case / "source", fmt, gen, w4a4=True)
        convert(source, target, case / "bundle", tp=2)
        cases.append((str(source), str(case / "bundle"), target, True, False))
    for fixture, target, ep in MOE_TP2:  # MoE bundles: experts split along the intermediate size, or whole (--ep)
        case = tmp_path / f"{fixture}-{target}-ep{int(ep)}"
        source = shutil.copytree(PRODUCERS / fixture, case / "source")
        convert(source, target, case / "bundle", tp=2, ep=ep)
        cases.append((str(source), str(case / "bundle"), target, True, ep))
    cases.append(("", cases[-1][1], cases[-1][2], True, False))  # an --ep bundle served without expert parallelism
    sample = shutil.copytree(SAMPLE_DIR, tmp_path / "sample" / "source")  # the docs' serving example, as written
    convert(sample, "sm100", tmp_path / "sample" / "bundle", fuse=True, tp=2)  # a weight-only checkpoint
    cases.append((str(sample), str(tmp_path / "sample" / "bundle"), "sm100", False, False))
    torch.multiprocessing.spawn(_tp2_rank, args=(cases, str(tmp_path / "dist_init"), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert len(result) == len(cases)
        assert all(not diff for diff in result.values()), f"rank {rank}: {result}"


def _sm90_model(tmp_path: Path, fixture: str) -> tuple[SourceModel, nn.Module, torch.Generator, int]:
    """The fixture's source, the model vLLM loads from its fused sm90 bundle, a seeded generator and its seed."""
    source = _source(tmp_path, fixture)
    convert(source, "sm90", tmp_path / "bundle", fuse=True)
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed={seed}")
    model = load(tmp_path / "bundle", LOAD_FORMAT, "sm90")
    return read_source(source), model, torch.Generator().manual_seed(seed), seed


def test_sample_tp2_output_holds_what_vllm_serve_reads(tmp_path):
    """`vllm serve OUT --tensor-parallel-size 2` on the built-in sample's --tp 2 output: vLLM's engine config and
    tokenizer come from OUT's top (the weights: test_plugin_state_equals_vllm_load_tp2)."""
    from vllm.tokenizers import get_tokenizer

    out = tmp_path / "sample-sm100-tp2"
    convert(SAMPLE_DIR, "sm100", out, tp=2)
    config = EngineArgs(model=str(out), load_format=LOAD_FORMAT, tensor_parallel_size=2).create_engine_config()
    assert (config.parallel_config.tensor_parallel_size, config.model_config.hf_config.intermediate_size) == (2, 160)
    tokenizer = get_tokenizer(out)
    ids = tokenizer.encode("Hello, NVFP4 bundle!")
    assert max(ids) < config.model_config.get_vocab_size() and tokenizer.decode(ids) == "Hello, NVFP4 bundle!"


@pytest.mark.parametrize("fixture", ["modelopt_w4a16_nvfp4", "ct_nvfp4"])
def test_sm90_kernel_class_matches_float64(vllm_world, tmp_path, fixture):
    """vLLM's own layer objects, loaded from an sm90 bundle, run through RepackSm90NvFp4LinearKernel (reference
    backend on CPU) = a float64 GEMM with the source's dequantized partitions."""
    weights, model, gen, seed = _sm90_model(tmp_path, fixture)
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "weights_padding_cols")}
    assert len(layers) == 8
    for name, layer in layers.items():
        assert type(layer.quant_method.kernel if hasattr(layer.quant_method, "kernel") else layer.scheme.kernel) \
            is RepackSm90NvFp4LinearKernel
        parent, _, leaf = name.rpartition(".")
        parts = [f"{parent}.{p}" for p in PARTITIONS.get(leaf, (leaf,))]
        w = torch.cat([dequantize(weights.load_layer(weights.layers[p])) for p in parts])
        x = torch.randn(5, layer.input_size_per_partition, generator=gen).to(torch.bfloat16)
        y = layer.quant_method.apply(layer, x)
        ref = x.double() @ w.t()
        err = float((y.double() - ref).norm() / ref.norm())
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        assert err <= 1e-2, f"{name}: relative L2 {err:.2e} (seed {seed})"


def _float64_transforms(weights, prefix: str) -> dict[str, torch.Tensor]:
    """The source's online transforms of the (fused) layer ``prefix``, normalized, float64 (its partitions share
    them: convert refuses fused modules whose partitions differ)."""
    parent, _, leaf = prefix.rpartition(".")
    first = f"{parent}.{PARTITIONS.get(leaf, (leaf,))[0]}"
    return {t.location: load_matrix(weights.checkpoint, t.matrix) / t.matrix.scale
            for t in weights.transforms.layers.get(first, ())}


def _blockdiag(x: torch.Tensor, matrix: torch.Tensor | None) -> torch.Tensor:
    return x if matrix is None else (x.unflatten(-1, (-1, matrix.shape[0])) @ matrix).flatten(-2)


@pytest.mark.parametrize("fixture", ["ct_quip_vu_rhad16_nvfp4", "ct_spinquant_r1r2r4_rhad_nvfp4a16"])
def test_sm90_kernel_class_applies_the_input_transform(vllm_world, tmp_path, fixture):
    """sm90 transform bundles: the input transform runs in RepackSm90NvFp4LinearKernel (on CPU its reference
    backend applies it before the GEMM; on the GPU the Triton kernels fuse blocks of 16-128: tests/
    test_gpu_transforms.py), vLLM's module no longer; the output transform stays vLLM's (its dense GEMM does not run
    on vLLM's CPU platform, so it is not run here). The scheme's GEMM = float64 (x T_in) W^T with the source's
    dequantized partitions and matrix."""
    weights, model, gen, seed = _sm90_model(tmp_path, fixture)
    taken = 0
    for name, layer in model.named_modules():
        if not hasattr(layer, "weights_padding_cols"):
            continue
        matrices = _float64_transforms(weights, name)
        kernel = layer.scheme.kernel
        assert type(kernel) is RepackSm90NvFp4LinearKernel
        assert (kernel.input_transform is not None) == ("input" in matrices), name
        if "input" in matrices:
            assert layer.quant_method.input_transform is None, "vLLM's own input transform no longer runs"
            assert not kernel.fuse_input, "the reference backend applies it before its GEMM"
            taken += 1
        parent, _, leaf = name.rpartition(".")
        w = torch.cat([dequantize(weights.load_layer(weights.layers[f"{parent}.{p}"]))
                       for p in PARTITIONS.get(leaf, (leaf,))])
        x = torch.randn(5, layer.input_size_per_partition, generator=gen).to(torch.bfloat16)
        assert (getattr(layer.quant_method, "output_transform", None) is not None) == ("output" in matrices), name
        y = layer.scheme.apply_weights(layer, x)
        ref = _blockdiag(x.double(), matrices.get("input")) @ w.t()
        err = float((y.double() - ref).norm() / ref.norm())
        assert err <= 1e-2, f"{name}: relative L2 {err:.2e} (seed {seed})"
    assert taken, "some layer has an input transform"


def test_sm90_kernel_class_eager_calls_skip_the_op(vllm_world, tmp_path, monkeypatch):
    """Eager ``apply_weights`` runs the layer's prepared launch, never the op's dispatch (its per-call CPU cost made
    enforce_eager 0.56x Humming on the H200), bound once per layer and rebound when vLLM installs a new weight."""
    import repack.runtime.op as op
    from vllm.model_executor.utils import replace_parameter

    convert(_source(tmp_path, "ct_nvfp4a16"), "sm90", tmp_path / "bundle", fuse=True)
    model = load(tmp_path / "bundle", LOAD_FORMAT, "sm90")
    layer = next(m for n, m in model.named_modules() if n.endswith("mlp.down_proj"))
    kernel = layer.scheme.kernel
    x = torch.randn(3, layer.input_size_per_partition).to(torch.bfloat16)
    expected = op._linear(x, layer.weight, layer.weight_scale, layer.weight_global_scale,
                          layer.output_size_per_partition, layer.input_size_per_partition, "sm90", "reference")

    def no_op(*args, **kwargs):
        raise AssertionError("an eager call went through the op")

    monkeypatch.setattr(op, "_linear", no_op)
    assert torch.equal(kernel.apply_weights(layer, x), expected)
    bound = layer.__dict__["_nvfp4_repack_prepared"]
    assert torch.equal(kernel.apply_weights(layer, x.clone()), expected)
    assert layer.__dict__["_nvfp4_repack_prepared"] is bound
    replace_parameter(layer, "weight", torch.zeros_like(layer.weight))  # all codes 0: every weight +0.0
    assert torch.equal(kernel.apply_weights(layer, x), torch.zeros_like(expected))


def _refused(path: Path, target: str = "sm100", w4a4: bool = False, **engine: object) -> str:
    with pytest.raises(RepackError) as caught:
        load(path, LOAD_FORMAT, target, w4a4=w4a4, **engine)
    message = str(caught.value)
    assert "\n" not in message
    return message


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.fixture
def sm100_bundle(tmp_path) -> Path:
    convert(PRODUCERS / "ct_nvfp4a16", "sm100", tmp_path / "bundle", fuse=True)
    return tmp_path / "bundle"


def test_refuses_a_source_checkpoint(vllm_world, tmp_path):
    assert "not an nvfp4-repack bundle" in _refused(_source(tmp_path, "ct_nvfp4a16"))


def test_refuses_another_gpu_family(vllm_world, sm100_bundle, monkeypatch):
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(current_platform, "get_device_capability", lambda device_id=0: DeviceCapability(12, 0))
    assert "this GPU is sm120; convert the source with --target sm120" in _refused(sm100_bundle)


def test_refuses_another_layout_id(vllm_world, sm100_bundle):
    _edit_json(sm100_bundle / "manifest.json", lambda m: m.update(layout_id="sm100-cute-dsl-v0"))
    assert "re-convert" in _refused(sm100_bundle)


def test_refuses_an_unchecked_flashinfer(vllm_world, sm100_bundle):
    _edit_json(sm100_bundle / "manifest.json", lambda m: m.update(flashinfer_versions=["0.6.18"]))
    assert "checked against FlashInfer 0.6.18" in _refused(sm100_bundle)


def test_refuses_another_tp_size(vllm_world, tmp_path):
    source = _tp2_llama(tmp_path / "source", "compressed-tensors", torch.Generator().manual_seed(0))
    convert(source, "sm100", tmp_path / "bundle", fuse=True, tp=2)
    assert "--tensor-parallel-size 2 or re-convert with --tp 1" in _refused(tmp_path / "bundle" / "rank-0")


def test_refuses_an_sglang_bundle(vllm_world, tmp_path):
    convert(PRODUCERS / "modelopt_nvfp4", "sm100", tmp_path / "bundle", engine="sglang")
    assert "holds sglang's state (sglang-modelopt-w4a4-v1), not vLLM's" in _refused(tmp_path / "bundle", w4a4=True)


def test_refuses_an_unfused_bundle(vllm_world, tmp_path):
    convert(PRODUCERS / "ct_nvfp4a16", "sm100", tmp_path / "bundle")
    assert "re-convert with --fuse" in _refused(tmp_path / "bundle")



MOE_FIXTURES = ["modelopt_moe_nvfp4", "ct_moe_nvfp4", "modelopt_moe_i48_nvfp4"]  # i48: I = 48 (sm100 pads to 64)


@pytest.mark.parametrize("target", ["sm100", "sm120"])
@pytest.mark.parametrize("fixture", MOE_FIXTURES)
def test_moe_plugin_state_equals_vllm_load(vllm_world, tmp_path, fixture, target):
    """A MoE bundle (W4A4 experts and dense layers) against vLLM's auto load of the source: every parameter and
    buffer, each FusedMoE module's backend, kernel classes, quant config and moe_config sizes (``moe_state``)."""
    if (fixture, target) == ("modelopt_moe_i48_nvfp4", "sm120"):  # 2I = 96: vLLM and convert refuse it
        with pytest.raises(RepackError, match="multiple of 128"):
            convert(_source(tmp_path, fixture), target, tmp_path / "bundle", fuse=True)
        return
    got, expected = _w4a4_states(_source(tmp_path, fixture), target)
    backend = expected["model.layers.0.mlp.experts.routed_experts:backend"]
    assert backend == {"sm100": "FLASHINFER_TRTLLM", "sm120": "FLASHINFER_CUTLASS"}[target]
    assert not _differences(got, expected), f"{fixture} {target}: differs in {_differences(got, expected)[:8]}"


# Fresh synthetic MoE checkpoints: "aligned" has a hidden size vLLM's TRT-LLM-gen does not pad (256), "odd" one it
# pads (80 -> 256) and scale rows w2 pads (80 -> 128); "wide" gate/up multipliers that differ (--rescale) and 5
# experts; "shared" is a Qwen2-MoE with a shared expert (a dense NVFP4 MLP beside the FusedMoE) and a dense first layer.
MOE_SYNTHETIC = {
    "aligned": dict(hidden=256, experts=3, intermediate=64),
    "odd": dict(hidden=80, experts=3, intermediate=64),
    "wide": dict(hidden=64, experts=5, intermediate=256, shared_scales=False),
    "shared": dict(hidden=64, experts=4, intermediate=128, layers=3, shared_expert=96, dense_layers=(0,)),
}


@pytest.mark.parametrize("target", ["sm100", "sm120"])
@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("shape", MOE_SYNTHETIC)
def test_moe_plugin_state_equals_vllm_load_synthetic(vllm_world, tmp_path, shape, fmt, target):
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed={seed}")
    write_qwen_moe(tmp_path / "synthetic", fmt, generator=torch.Generator().manual_seed(seed),
                   **{"layers": 2, **MOE_SYNTHETIC[shape]})
    source = Path(shutil.copytree(tmp_path / "synthetic", tmp_path / "source"))
    rescale = not MOE_SYNTHETIC[shape].get("shared_scales", True)
    if rescale:  # vLLM would keep gate's multiplier for up too: refused unless --rescale
        with pytest.raises(RepackError, match="gate_proj and up_proj global scales differ"):
            convert(source, target, tmp_path / "refused", fuse=True)
    got, expected = _w4a4_states(source, target, rescale)
    differences = _differences(got, expected)
    if rescale and fmt == "compressed-tensors":  # the bundle keeps the source's loaded gate/up global scales (no
        # kernel reads them), not the folded checkpoint's
        kept = [k for k in differences if k.endswith(".w13_weight_global_scale")]
        assert len(kept) == 2, differences  # each layer's, which the fold changed
        differences = [k for k in differences if k not in kept]
    assert not differences, f"{shape} {fmt} {target} (seed {seed}): differs in {differences[:8]}"


@pytest.mark.parametrize("fixture,target", [("ct_moe_nvfp4", "sm100"), ("modelopt_moe_nvfp4", "sm120")])
def test_moe_plugin_converts_no_expert_tensor(vllm_world, tmp_path, monkeypatch, fixture, target):
    """No expert tensor goes through vLLM's conversion in a plugin load: its entry point (as each MoE method binds
    it and as the oracle defines it), the FlashInfer preparation and the block-scale swizzle and interleave all
    raise if called; the modules still end with their kernels built."""
    convert(_source(tmp_path, fixture), target, tmp_path / "bundle", fuse=True)

    def never(*args, **kwargs):
        raise AssertionError("vLLM converted an expert tensor")

    for module in (*harness.MOE_SELECTORS, harness.moe_oracle):
        monkeypatch.setattr(module, "convert_to_nvfp4_moe_kernel_format", never)
    monkeypatch.setattr(harness.moe_oracle, "prepare_nvfp4_moe_layer_for_fi_or_cutlass", never)
    monkeypatch.setattr(harness.vfi_moe, "swizzle_blockscale", never)
    monkeypatch.setattr(harness.flashinfer, "nvfp4_block_scale_interleave", never)
    state = layer_state(load(tmp_path / "bundle", LOAD_FORMAT, target, w4a4=True))
    backends = [v for k, v in state.items() if k.endswith("routed_experts:backend")]
    assert backends == [{"sm100": "FLASHINFER_TRTLLM", "sm120": "FLASHINFER_CUTLASS"}[target]] * 2


def test_unfolded_scale_is_what_vllms_fold_turns_into_the_bundles_bytes():
    """vLLM's experts classes fold ``w*_weight_scale_2 *= input_scale`` in float32: the plugin gives them a value that
    folds into the bundle's bytes exactly, and refuses a bundle value no float32 folds into."""
    seed = int(torch.randint(0, 2**31, ()))
    gen = torch.Generator().manual_seed(seed)
    multiplier = torch.rand(4096, generator=gen) * 10.0 ** torch.randint(-6, 2, (4096,), generator=gen)
    scale = torch.full((4096,), float(torch.rand((), generator=gen) * 10.0 ** torch.randint(-4, 3, ()).item()))
    folded = multiplier * scale
    assert torch.equal(unfolded_scale(folded, scale, "x") * scale, folded), f"seed {seed}"
    three = torch.tensor([3.0])
    # near 1.75 a step of x (2^-24) moves x * 3 by 1.5 of the result's steps (2^-23): some results are never hit
    target = next(t for t in (torch.tensor([1.75]) + k * 2.0**-23 for k in range(8))
                  if not torch.any(_neighbours(t / 3, 16) * three == t))
    with pytest.raises(RepackError, match="not a float32 product with its input scale"):
        unfolded_scale(target, three, "x")


def _neighbours(x: torch.Tensor, n: int) -> torch.Tensor:
    """The ``2n + 1`` float32 values around ``x`` (a one-element tensor), step by step."""
    below, above, out = x, x, [x]
    for _ in range(n):
        below, above = torch.nextafter(below, below * 0), torch.nextafter(above, above * 2)
        out += [below, above]
    return torch.cat(out)


def _corrupt(bundle: Path, name: str) -> None:
    """Flip one bit of the first byte of tensor ``name`` in its shard (digests are verify's, not the loader's)."""
    entry = open_bundle(bundle).entry(name)
    with open(entry.file, "r+b") as f:
        f.seek(entry.begin)
        byte = f.read(1)[0]
        f.seek(entry.begin)
        f.write(bytes([byte ^ 0x01]))


def test_moe_refuses_a_g1_scale_c_vllm_does_not_derive(vllm_world, tmp_path):
    convert(_source(tmp_path, "ct_moe_nvfp4"), "sm100", tmp_path / "bundle", fuse=True)
    _corrupt(tmp_path / "bundle", "model.layers.1.mlp.experts.routed_experts.g1_scale_c")
    assert "routed_experts.g1_scale_c: vLLM derives another value from the bundle's scales; run verify" in \
        _refused(tmp_path / "bundle", w4a4=True)


def test_moe_refuses_another_backend(vllm_world, tmp_path):
    convert(_source(tmp_path, "ct_moe_nvfp4"), "sm120", tmp_path / "bundle", fuse=True)
    message = _refused(tmp_path / "bundle", "sm100", w4a4=True)  # an sm100's auto: TRT-LLM-gen
    assert "vLLM chose the FLASHINFER_TRTLLM MoE backend on this GPU, but the bundle holds the FLASHINFER_CUTLASS" \
        in message


def test_moe_refuses_a_weight_only_moe_method(vllm_world, tmp_path):
    """vLLM serves W4A16 NVFP4 experts with Marlin (here: a W4A4 bundle's config edited to weight-only, its dense
    layers loaded with the W4A16 kernel): a bundle of FP4 x FP4 experts is refused."""
    convert(_source(tmp_path, "ct_moe_nvfp4"), "sm100", tmp_path / "bundle", fuse=True)
    _edit_json(tmp_path / "bundle" / "config.json", lambda c: [
        g.update(input_activations=None) for g in c["quantization_config"]["config_groups"].values()])
    assert "weight-only (W4A16: Marlin), the bundle holds the FLASHINFER_TRTLLM layout for W4A4 experts" in \
        _refused(tmp_path / "bundle")


def test_moe_refuses_per_token_activations(vllm_world, tmp_path):
    """vLLM's ModelOpt MoE with ``quantization_config.moe.activation = nvfp4_per_token`` (TRT-LLM-gen only) quantizes
    activations per token and holds input scales of 1: not what the bundle's experts were converted for."""
    convert(_source(tmp_path, "modelopt_moe_nvfp4"), "sm100", tmp_path / "bundle", fuse=True)
    message = _refused(tmp_path / "bundle", w4a4=True, quantization_config={"moe": {"activation": "nvfp4_per_token"}})
    assert "activations per token (quantization_config moe.activation nvfp4_per_token)" in message


def test_moe_refuses_expert_load_balancing(vllm_world, tmp_path, monkeypatch):
    """vLLM's EPLB (CUDA only: vLLM's own config refuses it on this CPU platform, so the flag is set on a loaded
    module) moves experts between ranks and makes compressed-tensors' shared input scale the largest of all ranks'."""
    convert(_source(tmp_path, "ct_moe_nvfp4"), "sm100", tmp_path / "bundle", fuse=True)
    model = load(tmp_path / "bundle", LOAD_FORMAT, "sm100", w4a4=True)
    name, module = next(iter(moe_modules(model).items()))
    record = open_bundle(tmp_path / "bundle").moe_layers()[name]
    placed = (record.expert_map, record.local_experts, module.moe_config.intermediate_size_per_partition)
    check_placement(name, module, *placed)  # after the load: its sizes as vLLM left them
    monkeypatch.setattr(module.moe_config.moe_parallel_config, "enable_eplb", True)
    with pytest.raises(RepackError, match="balances this MoE layer's experts"):
        check_placement(name, module, *placed)


def test_moe_refuses_a_bundle_without_a_kept_scale(vllm_world, tmp_path):
    """A compressed-tensors MoE bundle without one of the experts' global scales vLLM keeps on its module as loaded
    (as bundles converted before they were carried): refused, not served with zeros there."""
    convert(_source(tmp_path, "ct_moe_nvfp4"), "sm120", tmp_path / "bundle", fuse=True)
    scale = "model.layers.1.mlp.experts.3.up_proj.weight_global_scale"
    _edit_json(tmp_path / "bundle" / "manifest.json", lambda m: m["passthrough"].pop(scale))
    assert f"routed_experts: the bundle has no {scale}, which vLLM keeps on this MoE layer as loaded; re-convert" \
        in _refused(tmp_path / "bundle", "sm120", w4a4=True)


def test_moe_refuses_a_bundle_without_the_models_experts(vllm_world, tmp_path):
    convert(_source(tmp_path, "modelopt_moe_nvfp4"), "sm100", tmp_path / "bundle", fuse=True)
    module = "model.layers.1.mlp.experts.routed_experts"
    _edit_json(tmp_path / "bundle" / "manifest.json", lambda m: m["moe"].pop(module))
    assert f"FusedMoE module {module!r} has no tensors" in _refused(tmp_path / "bundle", w4a4=True)


def test_plugin_refuses_a_bundle_for_another_vllm_version(vllm_world, tmp_path):
    """A bundle lists the vLLM versions whose state it is (manifest ``engines``); the plugin refuses it in another, in
    one line naming the version to re-convert for: a --vllm 0.33 bundle of a Hadamard-rotated W4A4 checkpoint (0.34
    serves it through Humming) on 0.34, and any bundle whose list lacks the running version."""
    bundle = tmp_path / "bundle"
    if harness.V034:
        convert(PRODUCERS / "ct_quip_vu_had32_nvfp4", "sm100", bundle, fuse=True, vllm="0.33")
        message = _refused(bundle, w4a4=True)
        assert "the bundle is for vLLM 0.33, but vLLM 0.34.0 is running" in message and "--vllm 0.34" in message
        return
    convert(PRODUCERS / "ct_nvfp4a16", "sm100", bundle, fuse=True)
    _edit_json(bundle / "manifest.json", lambda manifest: manifest.update(engines={"vllm": ["0.34"]}))
    message = _refused(bundle)
    assert "the bundle is for vLLM 0.34, but vLLM 0.33.0 is running" in message and "--vllm 0.33" in message


@pytest.mark.parametrize("target", ["sm80", "sm75"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_marlin_plugin_state_equals_vllm_load(vllm_world, tmp_path, fixture, target):
    """Marlin bundles (W4A4 checkpoints too: vLLM serves them weight-only there) against vLLM's auto load of the source
    on an emulated A100 / T4: every parameter and buffer, MarlinNvFp4LinearKernel and what it reads; no repack."""
    source = _source(tmp_path, fixture)
    bundle = tmp_path / "bundle"
    convert(source, target, bundle, fuse=True)
    expected = layer_state(load(source, "safetensors", target))
    _delete_weights(source)
    got = layer_state(load(bundle, LOAD_FORMAT, target))
    assert {v for k, v in expected.items() if k.endswith(":kernel")} == {"MarlinNvFp4LinearKernel"}
    assert not _differences(got, expected), f"{fixture} {target}: differs in {_differences(got, expected)[:8]}"


@pytest.mark.parametrize("target", ["sm80", "sm75"])
@pytest.mark.parametrize("fixture", MOE_FIXTURES + ["ct_moe_i48_nvfp4"])
def test_marlin_moe_plugin_state_equals_vllm_load(vllm_world, tmp_path, fixture, target):
    """A Marlin MoE bundle (sm80: MarlinExperts, one scale factor per layer; sm75: in fp16) against vLLM's auto load
    of the source: every parameter and buffer of every module, the MoE backend and experts class."""
    source = _source(tmp_path, fixture)
    convert(source, target, tmp_path / "bundle", fuse=True)
    expected = layer_state(load(source, "safetensors", target))
    assert expected["model.layers.0.mlp.experts.routed_experts:backend"] == "MARLIN"
    _delete_weights(source)
    got = layer_state(load(tmp_path / "bundle", LOAD_FORMAT, target))
    assert not _differences(got, expected), f"{fixture}: differs in {_differences(got, expected)[:8]}"


def test_marlin_bundle_refuses_another_dtype(vllm_world, tmp_path):
    """sm75's bundle holds fp16 Marlin scales (no rescale, fp16's exponent bias): served in bf16 it is refused."""
    convert(_source(tmp_path, "ct_nvfp4a16"), "sm75", tmp_path / "bundle", fuse=True)
    with pytest.raises(RepackError, match="scales are for float16 activations; serve it with --dtype float16"):
        load(tmp_path / "bundle", LOAD_FORMAT, "sm75", dtype="bfloat16")


# compressed-tensors' input global scales of weight-only experts: vLLM registers them, nothing loads them (the source
# has none) and no kernel reads them; vLLM's load leaves them as allocated, the plugin's zeroed: compared but for bytes
UNLOADED_WEIGHT_ONLY = ("w13_input_global_scale", "w2_input_global_scale")


@pytest.mark.parametrize("target", ["sm80", "sm100", "sm120", "sm75"])
@pytest.mark.parametrize("fixture", ["ct_moe_nvfp4a16", "modelopt_moe_w4a16_nvfp4"])
def test_weight_only_moe_plugin_state_equals_vllm_load(vllm_world, tmp_path, fixture, target):
    """A weight-only MoE checkpoint's bundle (issue 36: Marlin MoE wherever vLLM's auto serves it, sm80, sm100,
    sm120, and sm75 in fp16) against vLLM's auto load of the source: every parameter and buffer, the MARLIN backend and MarlinExperts,
    no repack."""
    source = _source(tmp_path, fixture)
    convert(source, target, tmp_path / "bundle", fuse=True, vllm=RUNNING)
    served = {"sm100": "sm100-auto", "sm120": "sm120-auto"}.get(target, target)  # vLLM's auto for the dense layers
    # too (sm120: Marlin; sm100: the cute-dsl W4A16 kernel), the bundle's layouts
    expected = layer_state(load(source, "safetensors", served))
    assert expected["model.layers.0.mlp.experts.routed_experts:backend"] == "MARLIN"
    _delete_weights(source)
    got = layer_state(load(tmp_path / "bundle", LOAD_FORMAT, served))
    unloaded = [k for k in expected if k.rsplit(".", 1)[-1] in UNLOADED_WEIGHT_ONLY]
    assert len(unloaded) == (4 if fixture.startswith("ct") else 0), unloaded  # 2 layers x (w13, w2)
    for key in unloaded:
        got[key], expected[key] = got[key][:-1], expected[key][:-1]
    assert not _differences(got, expected), f"{fixture} {target}: differs in {_differences(got, expected)[:8]}"


# Biased Marlin layers (Qwen2's q/k/v biases, random in the synthetic Qwen2-MoE): vLLM's FP4 Marlin post-load pads the
# bias to Marlin's N and permutes it (marlin_permute_bias); the plugin must leave the same bytes. (harness arch, our
# target, weight-only checkpoint): sm80 and sm75 Marlin, sm120's default for a weight-only checkpoint, and a W4A4 one
# converted with --weight-only for sm120 (vLLM: Marlin forced, sm120-marlin). Shapes: "aligned" q/k/v N 128 (64 per
# rank), "padded" N 288, which Marlin pads to 384 (per rank 192: one kv head, replicated).
BIASED_MARLIN = [("sm80", "sm80", False), ("sm75", "sm75", True), ("sm120-auto", "sm120", True),
                 ("sm120-marlin", "sm120", False)]
BIASED_SHAPES = {"aligned": dict(hidden=128, kv_heads=2), "padded": dict(hidden=192, kv_heads=1)}


def _biased_qwen(root: Path, shape: str, weight_only: bool, seed: int) -> Path:
    """A Qwen2-MoE with a dense first layer and a shared expert, random q/k/v biases."""
    return write_qwen_moe(root, "modelopt", generator=torch.Generator().manual_seed(seed), w4a4=not weight_only,
                          experts=3, intermediate=128, layers=2, heads=4, shared_expert=128, dense_layers=(0,),
                          **BIASED_SHAPES[shape])


@pytest.mark.parametrize("shape", BIASED_SHAPES)
@pytest.mark.parametrize("served,target,weight_only", BIASED_MARLIN)
def test_marlin_plugin_serves_biases_as_vllm_loads_them(vllm_world, tmp_path, served, target, weight_only, shape):
    """A biased checkpoint's Marlin bundle (dense q/k/v with biases, a dense MLP layer, a shared expert and Marlin
    experts) against vLLM's auto load of the source: every bias padded and permuted as vLLM's FP4 Marlin leaves it."""
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed={seed}")
    source = _biased_qwen(tmp_path / "source", shape, weight_only, seed)
    convert(source, target, tmp_path / "bundle", fuse=True, vllm=RUNNING, weight_only=served == "sm120-marlin")
    expected = layer_state(load(source, "safetensors", served))
    assert len([k for k in expected if k.endswith("qkv_proj.bias")]) == 2
    assert expected["model.layers.0.self_attn.qkv_proj:kernel"] == "MarlinNvFp4LinearKernel"
    _delete_weights(source)
    got = layer_state(load(tmp_path / "bundle", LOAD_FORMAT, served))
    assert not _differences(got, expected), f"{served}: differs in {_differences(got, expected)[:8]}"


def test_marlin_plugin_serves_biases_as_vllm_loads_them_tp2(tmp_path):
    """The same at TP = 2 (each rank's slice of the fused bias, padded and permuted), both shapes, in one two-process
    world."""
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed={seed}")
    cases = []
    for served, target, weight_only in BIASED_MARLIN:
        for shape in BIASED_SHAPES:
            case = tmp_path / f"{served}-{shape}"
            source = _biased_qwen(case / "source", shape, weight_only, seed)
            convert(source, target, case / "bundle", fuse=True, tp=2, vllm=RUNNING, weight_only=served == "sm120-marlin")
            cases.append((str(source), str(case / "bundle"), served, False, False))
    torch.multiprocessing.spawn(_tp2_rank, args=(cases, str(tmp_path / "dist_init"), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert len(result) == len(cases) and all(not diff for diff in result.values()), f"rank {rank}: {result}"
