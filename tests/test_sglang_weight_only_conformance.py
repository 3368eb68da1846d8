"""SGLang 0.5.23 itself as the oracle of its weight-only state: every ``convert --engine sglang`` bundle of a W4A16
checkpoint (ModelOpt ``W4A16_NVFP4``: FP4 Marlin on every GPU; compressed-tensors ``NVFP4A16``: FlashInfer's bf16 x fp4
GEMM on sm100, Marlin elsewhere) and of a W4A4 checkpoint where SGLang's auto backend is Marlin (sm80, sm90: served
weight-only) holds, per tensor-parallel rank, exactly what SGLang's own load leaves on each layer (every tensor by name,
dtype, shape, strides, offset and bytes; FlashInfer's 6-D view of the scales: its buffer), the plugin loads each
bundle into that state, and refusals are one line.

Runs SGLang as tests/test_sglang_conformance.py does (tests/sglang/harness.py, its own venv; FP4 Marlin's
``gptq_marlin_repack`` as the torch port of tests/vllm/ports.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from repack.bundle.reader import open_bundle
from repack.convert import convert
from repack.errors import RepackError
from repack.sample.synthetic import llama_layers, write_llama
from repack.targets.base import restated_differences
from repack.targets.engines import SGLANG_MARLIN_FAMILIES, SGLANG_MARLIN_LAYOUTS, SGLANG_WEIGHT_ONLY_FAMILIES
from repack.targets.sglang import DENSE_BACKENDS, marlin_global_scale

from .conftest import PRODUCERS, seeded_folder
from .test_sglang_conformance import (
    SYNTHETIC,
    assert_converts_to_sglangs_state,
    assert_same_state,
    oracle_dumps,
    run_harness,
)

FORMATS = ("modelopt", "compressed-tensors")
W4A16_FIXTURES = ["modelopt_w4a16_nvfp4", "ct_nvfp4a16"]
W4A4_FIXTURES = ["modelopt_nvfp4", "ct_nvfp4"]
# synthetic Llamas of tests/test_sglang_conformance.py's shapes, weight-only and W4A4, some block scales below 2^-6
# (vLLM's Marlin flushes them to 0, SGLang's keeps them) and multipliers that bf16 rounds
W4A16_NAMES = W4A16_FIXTURES + [f"{shape}-{fmt}-w4a16" for shape in SYNTHETIC for fmt in FORMATS]
W4A4_NAMES = W4A4_FIXTURES + [f"{shape}-{fmt}-w4a4" for shape in SYNTHETIC for fmt in FORMATS]
# W4A4 checkpoints on Marlin: SGLang's auto on sm80-sm90; on sm100 / sm120 under --fp4-gemm-backend marlin, which
# convert --weight-only writes (a job's arch "sm100%marlin")
MARLIN_W4A4_ARCHS = (*SGLANG_MARLIN_FAMILIES, *(f"{family}%marlin" for family in DENSE_BACKENDS))
JOBS = ([(name, arch) for name in W4A16_NAMES for arch in SGLANG_WEIGHT_ONLY_FAMILIES]
        + [(name, arch) for name in W4A4_NAMES for arch in MARLIN_W4A4_ARCHS])
TINY = 2.0**-8  # an e4m3 subnormal block scale


def _tiny_scales(quantized: dict, gen: torch.Generator) -> dict:
    """Every layer with some block scales set to :data:`TINY`."""
    out = {}
    for prefix, weight in quantized.items():
        mask = torch.rand(weight.block_scales.shape, generator=gen) < 0.1
        scales = torch.where(mask, TINY, weight.block_scales.float()).to(torch.float8_e4m3fn)
        out[prefix] = replace(weight, block_scales=scales)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    gen, root, _ = seeded_folder(tmp_path_factory, "sglang-weight-only-ckpts")
    out = {name: PRODUCERS / name for name in W4A16_FIXTURES + W4A4_FIXTURES}
    for shape, (hidden, heads, kv, inter) in SYNTHETIC.items():
        for fmt in FORMATS:
            for scheme in ("w4a16", "w4a4"):
                quantized = _tiny_scales(llama_layers(hidden, heads, kv, inter, gen, layers=2, head_dim=16), gen)
                name = f"{shape}-{fmt}-{scheme}"
                out[name] = write_llama(root / name, fmt, hidden=hidden, heads=heads, kv_heads=kv, intermediate=inter,
                                        generator=gen, layers=2, w4a4=scheme == "w4a4", quantized=quantized)
    return out


@pytest.fixture(scope="module")
def oracle(checkpoints, tmp_path_factory) -> dict[int, Path]:
    """SGLang's load-time result for every job, per TP size: ``{tp: folder}``."""
    return oracle_dumps(tmp_path_factory, "sglang-weight-only",
                        [f"{name}-{arch}={checkpoints[name]}:{arch}" for name, arch in JOBS])


def _convert_options(arch: str) -> dict:
    """A job's convert target and options: ``sm100%marlin`` is -t sm100 --weight-only."""
    family, _, backend = arch.partition("%")
    return {"target_name": family, "weight_only": backend == "marlin"}


def _refused_by_us(name: str, tp: int) -> bool:
    """At TP 2: the producers' fixtures (a down_proj of per-rank K 88: SGLang refuses ModelOpt's and loads
    compressed-tensors' block scales wrong, as for W4A4: tests/test_sglang_conformance.py), and "odd" (5 heads,
    which SGLang refuses too)."""
    return tp == 2 and (name in W4A16_FIXTURES + W4A4_FIXTURES or name.startswith("odd-"))


@pytest.mark.parametrize("name,arch", JOBS, ids=[f"{n}-{a}" for n, a in JOBS])
def test_bundle_is_byte_identical_to_sglang(name, arch, checkpoints, oracle, tmp_path):
    options = _convert_options(arch)
    assert_converts_to_sglangs_state(checkpoints[name], options.pop("target_name"), oracle[1] / f"{name}-{arch}",
                                     tmp_path / "bundle", **options)


@pytest.mark.parametrize("name,arch", JOBS, ids=[f"{n}-{a}" for n, a in JOBS])
def test_tp2_ranks_are_byte_identical_to_sglang_or_we_refuse(name, arch, checkpoints, oracle, tmp_path):
    dumped, out = oracle[2] / f"{name}-{arch}", tmp_path / "ranks"
    options = _convert_options(arch)
    target = options.pop("target_name")
    if _refused_by_us(name, 2):
        with pytest.raises(RepackError, match="--tp 2"):
            convert(checkpoints[name], target, out, tp=2, engine="sglang", **options)
        # SGLang refuses them too (odd; ModelOpt: K not a multiple of 16), or loads compressed-tensors' wrong
        assert (dumped / "refused.txt").exists() or name.startswith("ct_")
        return
    assert_converts_to_sglangs_state(checkpoints[name], target, dumped, out, tp=2, **options)


# The plugin: each bundle loaded by SGLang through --load-format nvfp4_repack against SGLang's own load of the
# source; and a refusal: a Marlin-only layout (ModelOpt W4A4 on sm90) under a backend that holds other bytes.
PLUGIN_REFUSALS = {"marlin-under-cutedsl": ("modelopt_nvfp4", "sm90", "sm100", "--fp4-gemm-backend marlin")}


@pytest.fixture(scope="module")
def plugin_oracle(checkpoints, tmp_path_factory) -> dict[int, Path]:
    bundles = tmp_path_factory.mktemp("sglang-weight-only-bundles")
    out = {}
    for tp in (1, 2):
        jobs = []
        for name, arch in JOBS:
            if not _refused_by_us(name, tp):
                folder = bundles / f"{name}-{arch}-tp{tp}"
                options = _convert_options(arch)
                convert(checkpoints[name], options.pop("target_name"), folder, tp=tp, engine="sglang", **options)
                jobs.append(f"{name}-{arch}={folder}:{arch}-plugin")
        if tp == 1:
            for job, (name, target, served_on, _) in PLUGIN_REFUSALS.items():
                convert(checkpoints[name], target, bundles / job, engine="sglang")
                jobs.append(f"{job}={bundles / job}:{served_on}-plugin")
        out[tp] = tmp_path_factory.mktemp(f"sglang-weight-only-plugin-tp{tp}")
        run_harness(tp, out[tp], jobs)
    return out


@pytest.mark.parametrize("name,arch", JOBS, ids=[f"{n}-{a}" for n, a in JOBS])
@pytest.mark.parametrize("tp", [1, 2])
def test_plugin_loads_sglangs_own_state(name, arch, tp, oracle, plugin_oracle):
    if _refused_by_us(name, tp):
        pytest.skip("refused at --tp 2 (test_tp2_ranks_are_byte_identical_to_sglang_or_we_refuse)")
    for rank in range(tp):
        assert_same_state(plugin_oracle[tp] / f"{name}-{arch}", oracle[tp] / f"{name}-{arch}", rank)


@pytest.mark.parametrize("job", sorted(PLUGIN_REFUSALS))
def test_plugin_refuses_in_one_line(job, plugin_oracle):
    says = PLUGIN_REFUSALS[job][3]
    refused = (plugin_oracle[1] / job / "refused.txt").read_text()
    assert says in refused.splitlines()[0] and refused.startswith("RepackError: "), refused[:500]


def test_marlin_keeps_what_vllms_marlin_flushes_and_rounds_the_multiplier_to_bf16(checkpoints, tmp_path):
    """SGLang's Marlin bytes are not vLLM's: no power-of-two factor, no flush of the smallest scales, the global scale
    in bf16 (what the oracle tests pin, stated on one layer)."""
    convert(checkpoints["odd-modelopt-w4a16"], "sm90", tmp_path / "sglang", engine="sglang")
    convert(checkpoints["odd-modelopt-w4a16"], "sm80", tmp_path / "vllm")
    prefix = "model.layers.0.mlp.down_proj"
    ours, theirs = open_bundle(tmp_path / "sglang"), open_bundle(tmp_path / "vllm")
    assert ours.manifest.layout_id == SGLANG_MARLIN_LAYOUTS["modelopt", "W4A16"]
    held = ours.read(f"{prefix}.weight_global_scale")
    assert held.dtype == torch.bfloat16 and held.shape == (1,)
    assert torch.equal(ours.read(f"{prefix}.weight"), theirs.read(f"{prefix}.weight"))  # the same repack
    assert not torch.equal(ours.read(f"{prefix}.weight_scale").view(torch.uint8),
                           theirs.read(f"{prefix}.weight_scale").view(torch.uint8))
    multiplier = torch.tensor([1e-3], dtype=torch.float32)
    assert float(marlin_global_scale(multiplier)) == float(multiplier.to(torch.bfloat16)) * 2.0**119


def test_sglang_bundles_refuse_in_one_line(tmp_path):
    for fixture, target, options, says in [
        ("modelopt_w4a16_nvfp4", "sm75", {}, "-t sm75: SGLang 0.5.23 serves no NVFP4"),
        ("modelopt_nvfp4", "sm75", {}, "-t sm75: SGLang 0.5.23 serves no NVFP4"),
        ("modelopt_moe_w4a16_nvfp4", "sm100", {}, "MoE layers served weight-only"),
        ("modelopt_moe_nvfp4", "sm100", {"weight_only": True}, "MoE layers served weight-only"),
    ]:
        with pytest.raises(RepackError, match=says) as refused:
            convert(PRODUCERS / fixture, target, tmp_path / "out", engine="sglang", **options)
        assert "\n" not in str(refused.value)
        assert not (tmp_path / "out").exists()



def test_verify_fails_a_marlin_scalar_that_does_not_follow_from_the_layer(tmp_path):
    """verify's exactness restates an SGLang Marlin layer from its codes, scales and kept scalars: the activation
    scalars SGLang keeps for a ModelOpt W4A4 checkpoint on sm90 follow from its partition scales."""
    convert(PRODUCERS / "modelopt_nvfp4", "sm90", tmp_path / "out", engine="sglang")
    bundle = open_bundle(tmp_path / "out")
    prefix = "model.layers.0.self_attn.qkv_proj"
    record, runtime = bundle.manifest.layers[prefix], bundle.runtime_layer(prefix)
    assert bundle.manifest.layout_id == SGLANG_MARLIN_LAYOUTS["modelopt", "W4A4"]
    assert restated_differences(bundle.target, runtime, record.n, record.k) == []
    wrong = {"alpha": runtime.named["alpha"] * 2, "input_global_scale": runtime.named["input_global_scale"] * 2}
    bad = replace(runtime, named={**runtime.named, **wrong})
    assert restated_differences(bundle.target, bad, record.n, record.k) == sorted(wrong)
