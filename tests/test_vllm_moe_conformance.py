"""vLLM as the oracle for NVFP4 MoE, once per supported version (0.33.0, 0.34.0; 0.34's extra bookkeeping checked):
every tensor of every FusedMoE module, per TP rank, as its own load leaves it with the backend its ``auto`` picks on
an (emulated) sm100 (FlashInfer TRT-LLM-gen) and sm120 (FlashInfer CUTLASS MoE), byte for byte against our layout
of the same experts; vLLM's refusals are ours.

Checkpoints: the producer-made fixtures (ModelOpt and llm-compressor) of Qwen3-MoE (intermediate 128 and 48),
DeepSeek-V3 (MLA attention, a dense first layer, a shared expert, grouped routing with a score correction bias),
Qwen2-MoE (a dense first layer, a gated shared expert) and Mixtral (``w1/w3/w2`` from ModelOpt, ``gate/up/down_proj`` from llm-compressor; intermediate 64), and fresh
synthetic ones of odd shapes with random per-expert input scales, in both formats. vLLM runs through
tests/vllm/harness.py (``sm100-w4a4-moe`` / ``sm120-w4a4-moe`` jobs: the dense layers beside the experts under vLLM's
auto among its W4A4 kernels, the bundles' dense layout) in its own virtualenv, one process per rank.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from repack.bundle.layers import assemble_experts, plan_experts
from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.errors import RepackError
from repack.formats import read_source
from repack.formats.moe import expert_groups
from repack.sample.synthetic import write_qwen_moe
from repack.targets import moe_cutlass, moe_trtllm

from .conftest import PRODUCERS, seeded_folder
from .test_vllm_conformance import HERE, _assert_w4a4_rank_identical, _vllm_python

PRODUCER_FIXTURES = ["modelopt_moe_nvfp4", "ct_moe_nvfp4", "modelopt_moe_i48_nvfp4", "ct_moe_i48_nvfp4",
                     "modelopt_deepseek_v3_nvfp4", "ct_deepseek_v3_nvfp4", "modelopt_mixtral_nvfp4", "ct_mixtral_nvfp4",
                     "modelopt_qwen2_moe_nvfp4", "ct_qwen2_moe_nvfp4"]
# "odd" pads the scales' K (80 / 16 = 5 -> 8) and w2's rows (80 -> 128), and is refused at TP 2 on sm120 (per-rank
# 2I = 64); "wide" has 5 experts, 2I = 512 (256 per rank) and gate/up multipliers that differ (vLLM keeps w1's);
# "shared" is a Qwen2-MoE with a shared expert (a dense MLP beside the FusedMoE) and a dense first layer
# (mlp_only_layers). The i48 fixtures are refused at TP 1 on sm120 (2I = 96; sm100 pads I to 64) and by us at
# TP 2 (per-rank intermediate 24: not whole scale blocks; vLLM refuses on sm120, and on sm100 loads it mis-scaled).
# The Mixtral fixtures (intermediate 64) are refused at TP 2 on sm120 (per-rank 2I = 64; sm100 pads I to 64).
SYNTHETIC = {
    "odd": dict(hidden=80, experts=3, intermediate=64),
    "wide": dict(hidden=64, experts=5, intermediate=256, shared_scales=False),
    "shared": dict(hidden=64, experts=4, intermediate=128, layers=3, shared_expert=96, dense_layers=(0,)),
}
FORMATS = ("modelopt", "compressed-tensors")
# What vLLM keeps besides the kernel's tensors: compressed-tensors' loaded global scales (unused after the load).
CT_LEFTOVERS = {"w13_weight_global_scale", "w13_input_global_scale", "w2_weight_global_scale",
                "w2_input_global_scale"}
LAYOUTS = {"sm100": moe_trtllm, "sm120": moe_cutlass}  # harness arch "<family>-moe" -> our layout

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    gen, root, _ = seeded_folder(tmp_path_factory, "vllm-moe-ckpts")
    out = {name: PRODUCERS / name for name in PRODUCER_FIXTURES}
    for shape, kwargs in SYNTHETIC.items():
        for fmt in FORMATS:
            out[f"{shape}-{fmt}"] = write_qwen_moe(root / f"{shape}-{fmt}", fmt, generator=gen,
                                                   **{"layers": 2, **kwargs})
    return out


EP = ["modelopt_moe_nvfp4", "ct_moe_nvfp4", *PRODUCER_FIXTURES[4:], *(f"{s}-{f}" for s in ("wide", "shared")
                                                                   for f in FORMATS)]


@pytest.fixture(scope="module")
def oracle(checkpoints, vllm_version, tmp_path_factory) -> dict:
    """vLLM's FusedMoE state per TP size, and at TP 2 with expert parallelism (``"ep"``): ``{key: folder}``, and the
    version under ``"version"``."""
    python = _vllm_python(vllm_version)
    out: dict = {"version": vllm_version}
    for key, tp, names, suffix in ((1, 1, list(checkpoints), ""), (2, 2, list(checkpoints), ""), ("ep", 2, EP, "-ep")):
        folder = tmp_path_factory.mktemp(f"vllm{vllm_version}-moe-{key}")
        args = [arg for name in names for arch in LAYOUTS
                for arg in ("--job", f"{name}-{arch}={checkpoints[name]}:{arch}-w4a4-moe{suffix}")]
        subprocess.run([str(python), str(HERE / "harness.py"), "--tp", str(tp), "--out", str(folder), *args],
                       check=True, timeout=1500, stdout=subprocess.DEVNULL)
        out[key] = folder
    return out


CASES = [(name, arch, tp) for tp in (1, 2) for arch in LAYOUTS
         for name in PRODUCER_FIXTURES + [f"{s}-{f}" for s in SYNTHETIC for f in FORMATS]]


@pytest.mark.parametrize("name,arch,tp", CASES, ids=[f"{n}-{a}-tp{t}" for n, a, t in CASES])
def test_fused_moe_state_is_byte_identical_to_vllm_or_both_refuse(name, arch, tp, checkpoints, oracle):
    dumped, layout = oracle[tp] / f"{name}-{arch}", LAYOUTS[arch]
    source = read_source(checkpoints[name])
    refused = dumped / "refused.txt"
    if refused.exists():
        reason = refused.read_text()
        assert "Intermediate size padding for w1 and w3" in reason or tp > 1, reason[:2000]
        with pytest.raises(RepackError, match="multiple of"):
            for rank in range(tp):
                for plan in plan_experts(source, tp, rank).values():
                    layout.to_runtime(assemble_experts(source, plan), plan.prefix)
        return
    group = next(iter(expert_groups(source).values()))
    if (group.intermediate // tp) % 16:
        # vLLM 0.33 loads this on sm100 (TRT-LLM-gen pads the rank's intermediate 24 to 64), but its loader cuts
        # block scales as whole blocks (24 // 16 = 1 per rank: rank 1 gets block 1, for its elements 24..47), which
        # do not line up with the rank's elements: mis-scaled weights. We refuse instead, as for dense layers.
        with pytest.raises(RepackError, match="not a multiple of 16"):
            plan_experts(source, tp, 0)
        return
    _assert_ranks_identical(source, dumped, layout, tp, ep=False, version=oracle["version"])


def _assert_ranks_identical(source, dumped, layout, tp: int, ep: bool, version: str) -> None:
    for rank in range(tp):
        plans = plan_experts(source, tp, rank, ep=ep)
        held = {plan.module: (layout.to_runtime(assemble_experts(source, plan), prefix), plan.expert_map if ep else None)
                for prefix, plan in plans.items()}
        _assert_rank_state(dumped, rank, layout, held, source, (rank, "library"), version)


# vLLM 0.34's bookkeeping beside the kernel's tensors: compressed-tensors' loaded names of the packed weights (the same
# Parameters), and the private activation global scales its quant config derives (1 / the input scales; TRT-LLM-gen
# also its scaled gemm1 output scale, _experts_g1_scale_c, made by its experts class: its value is the plugin state
# test's, tests/vllm/plugin_checks.py)
MOE_ALIASES = {"0.34": {"w13_weight_packed": "w13_weight", "w2_weight_packed": "w2_weight"}}
MOE_DERIVED = {"0.34": {"_a1_gscale": "w13_input_scale", "_a2_gscale": "w2_input_scale"}}
MOE_PRIVATE = {"0.34": {"FLASHINFER_TRTLLM": {"_experts_g1_scale_c"}}}
# vLLM 0.34's ModelOpt MoE registers its input scales for weight-only experts too, which nothing loads or reads (retired;
# their bytes are whatever memory held): checked by name, dtype, rows and ``retired``
MOE_UNLOADED = {"0.34": {"modelopt": {"w13_input_scale", "w2_input_scale"}}}


def _assert_version_extras(module: str, info: dict, theirs: dict, ours: dict, fmt: str, backend: str,
                           version: str) -> set[str]:
    """vLLM ``version``'s extra FusedMoE tensors (:data:`MOE_ALIASES`, :data:`MOE_DERIVED`, :data:`MOE_PRIVATE`,
    :data:`MOE_UNLOADED`), checked; returns their names."""
    views = info["tensors"]
    aliases = MOE_ALIASES.get(version, {}) if fmt == "compressed-tensors" else {}
    for alias, name in aliases.items():
        assert views[alias]["aliases"] == [name] and views[alias]["runtime_name"] == name, (module, alias)
        assert torch.equal(theirs[f"{module}.{alias}"], theirs[f"{module}.{name}"]), (module, alias)
    derived = {} if backend == "MARLIN" else MOE_DERIVED.get(version, {})  # its W4A16 quant config derives none
    for name, scale in derived.items():
        assert torch.equal(theirs[f"{module}.{name}"], 1.0 / ours[scale]), (module, name)
    private = MOE_PRIVATE.get(version, {}).get(backend, set())
    for name in private:
        assert (views[name]["dtype"], views[name]["shape"]) == ("float32", [ours["w13_weight"].shape[0]]), (module, name)
    unloaded = MOE_UNLOADED.get(version, {}).get(fmt, set()) - set(ours)
    for name in unloaded:
        view = views[name]
        assert view["retired"] and view["dtype"] == "float32", (module, name)
        assert view["shape"][0] == ours["w13_weight"].shape[0], (module, name)
    return set(aliases) | set(derived) | private | unloaded


def _assert_rank_state(dumped, rank: int, layout, held: dict, source, where, version: str = "0.33") -> None:
    """Rank ``rank``'s FusedMoE modules as vLLM holds them (``dumped``) against ``held``: ``{module: (our tensors by
    vLLM's names, our _expert_map or None)}``: the same modules, tensors, dtypes, shapes, strides and bytes; besides
    them vLLM keeps compressed-tensors' loaded global scales and DeepSeek-V3's router bias (the router's own
    parameter, as loaded: a passthrough tensor of the bundle)."""
    meta = json.loads((dumped / f"moe-rank-{rank}.json").read_text())
    theirs = load_file(dumped / f"moe-rank-{rank}.safetensors")
    assert sorted(meta) == sorted(held), where
    for module, (ours, expert_map) in held.items():
        info = meta[module]
        assert info["backend"] == layout.BACKEND and info["experts"] in layout.KERNELS, (where, info)
        leftovers = CT_LEFTOVERS if source.format == "compressed-tensors" else set()
        bias = f"{module.removesuffix('.experts.routed_experts')}.gate.e_score_correction_bias"
        if bias in source.checkpoint.tensors:
            leftovers = leftovers | {"e_score_correction_bias"}
            assert torch.equal(theirs[f"{module}.e_score_correction_bias"], source.checkpoint.read(bias)), module
        extras = _assert_version_extras(module, info, theirs, ours, source.format, layout.BACKEND, version)
        assert set(info["tensors"]) == (set(ours) | leftovers | extras
                                        | ({"_expert_map"} if expert_map else set())), module
        if expert_map is not None:  # global expert -> local index, -1 elsewhere
            assert theirs[f"{module}._expert_map"].tolist() == expert_map, (where, module)
        for part, tensor in ours.items():
            ref = theirs[f"{module}.{part}"]
            assert (tensor.dtype, tensor.shape) == (ref.dtype, ref.shape), (where, module, part)
            assert info["tensors"][part]["stride"] == list(tensor.contiguous().stride()), (where, module, part)
            assert torch.equal(tensor.view(torch.uint8), ref.view(torch.uint8)), (where, module, part)


EP_CASES = [(name, arch) for arch in LAYOUTS for name in EP]


@pytest.mark.parametrize("name,arch", EP_CASES, ids=[f"{n}-{a}-ep2" for n, a in EP_CASES])
def test_expert_parallel_ranks_are_byte_identical_to_vllm(name, arch, checkpoints, oracle):
    """TP 2 with vLLM's --enable-expert-parallel: each rank holds whole experts ("linear" placement, 5 experts as
    3 + 2); the input scale it shares is the largest of every expert's (ModelOpt) or of its own (compressed-tensors)."""
    dumped = oracle["ep"] / f"{name}-{arch}"
    assert not (dumped / "refused.txt").exists(), (dumped / "refused.txt").read_text()[:2000]
    _assert_ranks_identical(read_source(checkpoints[name]), dumped, LAYOUTS[arch], 2, ep=True, version=oracle["version"])


CLI_FIXTURES = [*PRODUCER_FIXTURES, *(f"shared-{f}" for f in FORMATS)]
CLI_CASES = [(name, arch, mode) for mode in ("tp1", "tp2", "ep") for arch in LAYOUTS for name in CLI_FIXTURES
             if mode != "ep" or name in EP]


@pytest.mark.parametrize("name,arch,mode", CLI_CASES, ids=[f"cli-{n}-{a}-{m}" for n, a, m in CLI_CASES])
def test_cli_convert_holds_vllms_fused_moe_state_byte_for_byte(name, arch, mode, checkpoints, oracle, tmp_path,
                                                                 capsys):
    """``nvfp4-repack convert --fuse [--tp 2] [--ep]`` end to end: every tensor of every FusedMoE module of every
    rank's bundle, read back by ``Bundle.moe_tensors`` under the manifest's module names, is what vLLM's own load
    leaves; so is every NVFP4 linear module vLLM builds beside them in the same load, with its auto among its W4A4
    kernels (attention; DeepSeek-V3's dense first layer and its shared expert, ``mlp.shared_experts.gate_up_proj``;
    Qwen2-MoE's ``mlp.shared_expert.gate_up_proj`` and dense first layer): planned by the dense fusion rules with the
    experts left out, fused and split per rank as vLLM fuses and splits them. Where vLLM refuses, convert exits 1 with
    one line and writes nothing."""
    tp, ep = (1, False) if mode == "tp1" else (2, mode == "ep")
    dumped, layout = oracle["ep" if ep else tp] / f"{name}-{arch}", LAYOUTS[arch]
    out = tmp_path / "out"
    args = ["convert", str(checkpoints[name]), "-t", arch, "--fuse", "--tp", str(tp), "-o", str(out)]
    code = main(args + ["--ep"] * ep)
    err = capsys.readouterr().err
    source = read_source(checkpoints[name])
    group = next(iter(expert_groups(source).values()))
    if (dumped / "refused.txt").exists() or (not ep and (group.intermediate // tp) % 16):  # see the library test
        assert code == 1 and err.startswith("Error: ") and err.count("\n") == 1 and "multiple of" in err, err
        assert not out.exists()
        return
    assert code == 0, err
    for rank in range(tp):
        folder = out / f"rank-{rank}" if tp > 1 else out
        bundle = open_bundle(folder)
        assert (bundle.manifest.scheme, bundle.manifest.layout_id) == ("W4A4", "w4a4-cutlass-v1")
        held = {module: (bundle.moe_tensors(module), record.expert_map)
                for module, record in bundle.moe_layers().items()}
        _assert_rank_state(dumped, rank, layout, held, source, (rank, "cli"), oracle["version"])
        dense = _assert_w4a4_rank_identical(folder, dumped, rank, oracle["version"])
        assert dense == len(bundle.manifest.layers) > 0
