"""NVFP4 MoE: the source's experts grouped into vLLM's FusedMoE layers, the sm120 FlashInfer CUTLASS MoE and sm100
TRT-LLM-gen layouts (round trips, index formulas, FlashInfer's permutations and the harness's port, refusals), the
per-expert exactness and numerics checks and inspect, on producer-made and synthetic Qwen3-MoE checkpoints. Byte
conformance with vLLM's own load: tests/test_vllm_moe_conformance.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from repack.bundle.layers import (
    VLLM_FUSION,
    _rank_layers,
    assemble_experts,
    expert_range,
    plan_experts,
    plan_layers,
    vllm_fusion,
)
from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.convert import convert
from repack.errors import RepackError
from repack.formats import read_source
from repack.formats.moe import expert_groups, find_expert_groups
from repack.nvfp4 import BLOCK_SIZE
from repack.sample.synthetic import write_qwen_moe
from repack.targets import moe, moe_cutlass, moe_marlin, moe_trtllm, resolve_target
from repack.targets.families import MOE_LAYOUTS
from repack.targets.layout import swizzle_128x4
from repack.verify import verify_output
from repack.verify_moe import EXPERT_REL_ERROR, EXPERT_W4A4_REL_ERROR, check_experts, expert_numerics

from .conftest import PRODUCERS, require
from .vllm.ports import block_scale_interleave

MOE_FIXTURES = ["modelopt_moe_nvfp4", "ct_moe_nvfp4"]
# (experts, hidden, intermediate): hidden 80 pads the scales' K to 8 and w2's rows to 128; 2I = 128 and 384.
SHAPES = [(3, 80, 64), (5, 48, 192), (1, 16, 64)]


def random_stack(experts: int, hidden: int, intermediate: int, gen: torch.Generator) -> moe.ExpertStack:
    def codes(n, k):
        return torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)

    def scales(n, k):
        return torch.randint(1, 0x7F, (experts, n, k // BLOCK_SIZE), dtype=torch.uint8, generator=gen).view(
            torch.float8_e4m3fn)

    def positive(*shape):
        return torch.rand(shape, generator=gen) * 1e-2 + 1e-4

    return moe.ExpertStack(codes(2 * intermediate, hidden), scales(2 * intermediate, hidden),
                                   positive(experts, 2), positive(experts, 2), codes(hidden, intermediate),
                                   scales(hidden, intermediate), positive(experts), positive(experts))


LAYOUTS = [moe_cutlass, moe_trtllm]
# TRT-LLM-gen pads I to 64 and H to 256, so it also takes 2I = 96 (48) and 2I = 32 (16).
TRTLLM_SHAPES = [(2, 64, 48), (3, 272, 16)]


def assert_round_trip(layout, stack: moe.ExpertStack, want: moe.ExpertStack, hidden: int, intermediate: int) -> dict:
    """``layout``'s tensors of ``stack``, after checking their specs and names and that ``from_runtime`` gives back
    ``want`` byte for byte (the stack itself, or as the layout's kernel reads it)."""
    held = layout.to_runtime(stack)
    specs = layout.runtime_specs(stack.experts, hidden, intermediate)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in held.items()} == {k: (s.dtype, s.shape) for k, s in specs.items()}
    assert set(held) == set(layout.TENSORS)
    back = layout.from_runtime(held, hidden, intermediate)
    for name in ("w13_codes", "w13_scales", "w2_codes", "w2_scales"):
        assert torch.equal(getattr(back, name).view(torch.uint8), getattr(want, name).view(torch.uint8)), name
    return held


@pytest.mark.parametrize("layout,experts,hidden,intermediate",
                         [(m, *s) for m in LAYOUTS for s in SHAPES] + [(moe_trtllm, *s) for s in TRTLLM_SHAPES],
                         ids=lambda v: getattr(v, "LAYOUT_ID", str(v)))
def test_moe_layout_round_trips_and_matches_its_index_formulas(layout, experts, hidden, intermediate, random_seed):
    stack = random_stack(experts, hidden, intermediate, torch.Generator().manual_seed(random_seed))
    held = assert_round_trip(layout, stack, stack, hidden, intermediate)
    for e in range(experts):
        for which in ("w13", "w2"):
            codes, scales = layout.decode_expert(held, e, which, hidden, intermediate)
            assert torch.equal(codes, getattr(stack, f"{which}_codes")[e]), (e, which)
            assert torch.equal(scales.view(torch.uint8), getattr(stack, f"{which}_scales")[e].view(torch.uint8))


@pytest.mark.parametrize("layout,experts,hidden,intermediate",
                         [(m, *s) for m in LAYOUTS for s in SHAPES] + [(moe_trtllm, *s) for s in TRTLLM_SHAPES]
                         + [(m, 2, 512, 128) for m in LAYOUTS]  # no padding: TRT-LLM-gen's permutations as reshapes
                         + [(moe_marlin, 2, 128, 48), (moe_marlin, 3, 192, 64)],  # Marlin: I padded to 64, to 128
                         ids=lambda v: getattr(v, "LAYOUT_ID", str(v)))
def test_codes_from_pieces_are_to_runtimes_codes(layout, experts, hidden, intermediate, random_seed):
    """convert copies each expert's source codes once into the layout (``codes_from_pieces``, from non-contiguous
    views as a --tp rank's columns are): the same bytes as ``to_runtime`` of the stacked experts."""
    stack = random_stack(experts, hidden, intermediate, torch.Generator().manual_seed(random_seed))
    held = layout.to_runtime(stack)
    wide = torch.cat([stack.w2_codes, stack.w2_codes], dim=2)  # a rank's columns of a wider down_proj
    pieces = {"w13": [(e[:intermediate], e[intermediate:]) for e in stack.w13_codes],
              "w2": [(e[:, : intermediate // 2],) for e in wide]}
    for which, parts in pieces.items():
        assert torch.equal(layout.codes_from_pieces(which, parts, hidden, intermediate), held[f"{which}_weight"]), which


def test_cutlass_moe_layout_is_w3_w1_each_expert_swizzled_and_scalars_folded(random_seed):
    """Against the definitions one by one: w3 (up) rows first, the dense 128x4 swizzle per expert, and the
    alphas = own multiplier (w1's) x the largest input scale of all experts, in float32."""
    stack = random_stack(3, 80, 64, torch.Generator().manual_seed(random_seed))
    held = moe_cutlass.to_runtime(stack)
    for e in range(3):
        up_then_gate = torch.cat((stack.w13_codes[e, 64:], stack.w13_codes[e, :64]))
        assert torch.equal(held["w13_weight"][e], up_then_gate)
        scales = torch.cat((stack.w13_scales[e, 64:], stack.w13_scales[e, :64]))
        assert torch.equal(held["w13_weight_scale"][e].view(torch.uint8), swizzle_128x4(scales).view(torch.uint8))
        assert torch.equal(held["w2_weight_scale"][e].view(torch.uint8),
                           swizzle_128x4(stack.w2_scales[e]).view(torch.uint8))
    a13, a2 = max(stack.w13_input_scale.flatten().tolist()), max(stack.w2_input_scale.tolist())
    assert held["w13_input_scale"].tolist() == [torch.tensor(a13, dtype=torch.float32).item()] * 3
    assert torch.equal(held["w13_weight_scale_2"], stack.w13_multiplier[:, 0] * torch.tensor(a13))
    assert torch.equal(held["w2_weight_scale_2"], stack.w2_multiplier * torch.tensor(a2))


def test_trtllm_row_permutations_are_flashinfers():
    """The composed w13 permutation and w2's shuffle against FlashInfer's own index functions (the project env's
    FlashInfer; the vLLM env's, 0.7.2.post1, runs them in the conformance harness)."""
    require("flashinfer")
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache

    for ip in (64, 128, 192, 1024):
        rows = torch.zeros(2 * ip, 8, dtype=torch.uint8)
        assert torch.equal(_maybe_get_cached_w3_w1_permute_indices({}, rows, 128, is_gated_act_gemm=True),
                           moe_trtllm.w13_rows(ip)), ip
        assert torch.equal(get_w2_permute_indices_with_cache({}, rows, 128), moe_trtllm.shuffle_rows(2 * ip)), ip


@pytest.mark.parametrize("experts,rows,cols", [(1, 128, 4), (3, 200, 5), (2, 256, 16)])
def test_block_scale_interleave_port_is_flashinfers_128x4(experts, rows, cols, random_seed):
    """The harness's port of FlashInfer's C++ blockScaleInterleaveHost: each expert's block read back by FlashInfer's
    own Python 128x4 unswizzle, padding zero, and equal to the layouts' swizzle_experts."""
    require("flashinfer")
    from flashinfer.gemm.gemm_bf16_fp4 import _unswizzle_sf_128x4

    sf = torch.randint(1, 256, (experts, rows, cols), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(random_seed))
    out = block_scale_interleave(sf if experts > 1 else sf[0])
    size = -(-rows // 128) * 128 * (-(-cols // 4) * 4)
    assert out.shape == (experts * size,)
    for e in range(experts):
        block = out[e * size: (e + 1) * size]
        assert torch.equal(_unswizzle_sf_128x4(block, rows, cols).view(torch.uint8).reshape(rows, cols), sf[e])
    assert int(out.count_nonzero()) == sf.numel()
    assert torch.equal(out, moe.swizzle_experts(sf.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1))


def test_each_family_has_the_moe_layout_vllms_auto_picks_and_sm90_is_refused():
    assert moe.moe_layout("sm100") is moe_trtllm and moe.moe_layout("sm120") is moe_cutlass
    assert moe.moe_layout("sm80") is moe.moe_layout("sm100", "W4A16") is moe.moe_layout("sm120", "W4A16") is moe_marlin
    sm120 = resolve_target("sm120")  # --weight-only on sm120: Marlin's dense W4A4 variant, so Marlin's MoE too
    assert moe.moe_layout(sm120.for_scheme("W4A4")) is moe_cutlass
    assert moe.moe_layout(sm120.for_scheme("W4A4", weight_only=True)) is moe_marlin
    assert moe.moe_layout("sm80", "W4A16") is moe_marlin  # weight-only experts: Marlin wherever vLLM has an MoE (issue 36)
    for family, schemes in MOE_LAYOUTS.items():  # the torch-free table names layout modules
        assert all(moe.moe_layout_by_id(layout_id) is moe.moe_layout(family, s) for s, layout_id in schemes.items())
    with pytest.raises(RepackError, match=r"--target sm90: .* Humming's MoE, whose weight transform is a GPU op not "
                                          r"ported here\); .* convert with --target sm80$"):
        moe.moe_layout("sm90")
    assert moe.moe_layout("sm75", "W4A16") is moe.moe_layout("sm75") is moe_marlin.FP16  # T4: fp16 (its own bytes)
    for scheme in ("W4A4", "W4A16"):
        with pytest.raises(RepackError, match=r"--target sm90: .* convert with --target sm80$"):
            moe.moe_layout("sm90", scheme)


@pytest.mark.parametrize("intermediate", [48, 96, 8])
def test_cutlass_moe_layout_refuses_what_vllm_refuses(intermediate):
    with pytest.raises(RepackError, match=rf"\(2 x {intermediate} = {2 * intermediate}\) must be a multiple of 128$"):
        moe_cutlass.check_shape(4, 64, intermediate)
    with pytest.raises(RepackError, match=r"multiple of 128; hidden size 40 must be a multiple of 16$"):
        moe_cutlass.check_shape(4, 40, intermediate)
    moe_cutlass.check_shape(4, 64, 64)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_producer_moe_checkpoints_group_into_fused_moe_layers(name):
    source = read_source(PRODUCERS / name)
    groups = expert_groups(source)
    assert list(groups) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for group in groups.values():
        assert (group.experts, group.hidden, group.intermediate) == (4, 64, 128)
        assert group.gate[3] == group.prefix + ".3.gate_proj"
    assert "model.layers.0.mlp.gate.weight" in source.passthrough  # the router stays bf16
    assert not any(".mlp.gate." in p or p.endswith(".mlp.gate") for p in source.layers)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_expert_stack_of_a_rank_is_the_source_cut(name):
    """TP 2: rank r holds rows [64 r, 64 r + 64) of every expert's gate and up, those columns of its down."""
    source = read_source(PRODUCERS / name)
    prefix = "model.layers.1.mlp.experts"
    for rank in range(2):
        stack = assemble_experts(source, plan_experts(source, 2, rank)[prefix])
        for e in (0, 3):
            gate = source.load_layer(source.layers[f"{prefix}.{e}.gate_proj"])
            up = source.load_layer(source.layers[f"{prefix}.{e}.up_proj"])
            down = source.load_layer(source.layers[f"{prefix}.{e}.down_proj"])
            rows = slice(64 * rank, 64 * rank + 64)
            assert torch.equal(stack.w13_codes[e], torch.cat((gate.codes[rows], up.codes[rows])))
            assert torch.equal(stack.w2_codes[e], down.codes[:, 32 * rank: 32 * rank + 32])
            assert torch.equal(stack.w2_scales[e].view(torch.uint8), down.block_scales[:, 4 * rank: 4 * rank + 4]
                               .view(torch.uint8))
            assert stack.w13_multiplier[e].tolist() == [float(gate.multiplier), float(up.multiplier)]


def test_shared_experts_and_dense_layers_stay_dense(tmp_path, random_seed):
    """DeepSeek-V3 / Qwen2-MoE naming: ``shared_experts.*`` / ``shared_expert.*`` (no index) and a dense first
    layer's ``mlp.*_proj`` are not routed experts; the FusedMoE layers are found around them."""
    root = write_qwen_moe(tmp_path / "m", "compressed-tensors", hidden=64, experts=2, intermediate=64, layers=2,
                           generator=torch.Generator().manual_seed(random_seed))
    layers = dict(read_source(root).layers)
    q = layers["model.layers.0.self_attn.q_proj"]
    extra = ["model.layers.0.mlp.shared_experts.gate_proj", "model.layers.1.mlp.shared_expert.down_proj",
             "model.layers.2.mlp.gate_proj", "model.layers.2.mlp.down_proj"]
    groups = find_expert_groups({**layers, **{p: dataclasses.replace(q, prefix=p) for p in extra}})
    assert list(groups) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert not set(extra) & {m for g in groups.values() for m in g.members}


# The other producer-made MoE architectures: (FusedMoE modules, experts, intermediate, expert 3's gate in the
# checkpoint, the modules of the other NVFP4 layers)
ATTENTION = {f"model.layers.{i}.self_attn" for i in range(2)}
MIXTRAL = [f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)]
DEEPSEEK = (["model.layers.1.mlp.experts"], 4, 128, "3.gate_proj",
            {"model.layers.0.mlp", "model.layers.1.mlp.shared_experts"})
QWEN2 = (["model.layers.1.mlp.experts"], 4, 128, "3.gate_proj",
         {*ATTENTION, "model.layers.0.mlp", "model.layers.1.mlp.shared_expert"})
ARCH_FIXTURES = {
    "modelopt_deepseek_v3_nvfp4": DEEPSEEK,  # attention bf16 (the fixture's choice: NVFP4 MLA is refused fused)
    "ct_deepseek_v3_nvfp4": DEEPSEEK,
    "modelopt_mixtral_nvfp4": (MIXTRAL, 4, 64, "3.w1", ATTENTION),
    "ct_mixtral_nvfp4": (MIXTRAL, 4, 64, "3.gate_proj", ATTENTION),
    "modelopt_qwen2_moe_nvfp4": QWEN2,
    "ct_qwen2_moe_nvfp4": QWEN2,
}


@pytest.mark.parametrize("name", ARCH_FIXTURES)
def test_deepseek_v3_mixtral_and_qwen2_moe_group_as_vllm_builds_them(name):
    """DeepSeek-V3 and Qwen2-MoE: the dense first layer and the shared expert stay dense layers, the routers (and
    DeepSeek-V3's score correction bias, Qwen2-MoE's shared expert gate) pass through unquantized. Mixtral:
    ModelOpt's ``w1/w3/w2`` are gate/up/down (vLLM's ckpt_names), llm-compressor's ``gate/up/down_proj`` too."""
    modules, experts, intermediate, gate, dense = ARCH_FIXTURES[name]
    source = read_source(PRODUCERS / name)
    groups = expert_groups(source)
    assert list(groups) == modules
    for group in groups.values():
        assert (group.experts, group.hidden, group.intermediate) == (experts, 64, intermediate)
        assert group.gate[3] == f"{group.prefix}.{gate}"
        router = group.prefix.removesuffix(".experts") + ".gate"
        assert f"{router}.weight" in source.passthrough and router not in source.layers
    members = {m for g in groups.values() for m in g.members}
    assert len(members) == sum(3 * g.experts for g in groups.values())
    assert {p.rpartition(".")[0] for p in source.layers if p not in members} == dense
    unquantized = {"deepseek": "mlp.gate.e_score_correction_bias", "qwen2": "mlp.shared_expert_gate.weight"}
    assert all(f"model.layers.1.{t}" in source.passthrough for arch, t in unquantized.items() if arch in name)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda m: m.LAYOUT_ID)
@pytest.mark.parametrize("name", ARCH_FIXTURES)
def test_moe_architectures_experts_verify_exact_and_compute_the_source(name, layout, random_seed):
    """verify's per-expert checks on their layouts: every expert exact, a swapped pair named (by the checkpoint's
    own names, ``w1`` for ModelOpt's Mixtral), and FP4 x FP4 numerics within the bound on two experts."""
    source = read_source(PRODUCERS / name)
    prefix = ARCH_FIXTURES[name][0][-1]
    plan = plan_experts(source)[prefix]
    held = layout.to_runtime(assemble_experts(source, plan))
    assert check_experts(source, plan, held, layout) == []
    swapped = {**held, "w13_weight": held["w13_weight"][[0, 2, 1, 3]]}
    gate = plan.group.gate[1].rpartition(".")[2]
    assert f"{prefix}.1.{gate}: codes differ" in check_experts(source, plan, swapped, layout)
    errors = expert_numerics(source, plan, held, layout, [1, 2], torch.Generator().manual_seed(random_seed),
                             tokens=16, w4a4=True)
    assert len(errors) == 6 and max(errors.values()) <= EXPERT_W4A4_REL_ERROR, errors


def test_inspect_shows_deepseek_v3_and_mixtral_and_names_what_it_supports(tmp_path, capsys):
    assert main(["inspect", str(PRODUCERS / "modelopt_deepseek_v3_nvfp4"), "--json"]) == 0
    moe = json.loads(capsys.readouterr().out)["moe"]
    assert (moe["fused_moe_layers"], moe["experts"], moe["shared_expert_modules"]) == (1, [4], 1)
    assert main(["inspect", str(PRODUCERS / "modelopt_mixtral_nvfp4")]) == 0
    assert "MoE: 2 FusedMoE layers of 4 experts (top-2)" in " ".join(capsys.readouterr().out.split())
    other = tmp_path / "gpt-oss"
    other.mkdir()
    for file in ("model.safetensors", "hf_quant_config.json", "config.json"):
        (other / file).write_bytes((PRODUCERS / "modelopt_mixtral_nvfp4" / file).read_bytes())
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["GptOssForCausalLM"]}))
    assert main(["inspect", str(other), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["moe"] == {"unsupported": (
        "MoE architecture 'GptOssForCausalLM' is not supported; supported: Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, "
        "DeepseekV3ForCausalLM, MixtralForCausalLM")}


def test_mixtral_w1_w3_w2_are_gate_up_down():
    """The two producers' Mixtral experts hold the same codes under their two namings (w1 = gate, w3 = up, w2 =
    down), wherever the quantizers agree: ModelOpt's and llm-compressor's codes differ by rounding only."""
    ours, theirs = (read_source(PRODUCERS / n) for n in ("modelopt_mixtral_nvfp4", "ct_mixtral_nvfp4"))
    for (a, b) in zip(expert_groups(ours).values(), expert_groups(theirs).values()):
        for pa, pb in zip(a.members, b.members):
            x, y = ours.load_layer(ours.layers[pa]), theirs.load_layer(theirs.layers[pb])
            assert (x.codes == y.codes).float().mean() > 0.9, (pa, pb)


def test_other_moe_architectures_are_refused_in_one_line():
    source = read_source(PRODUCERS / "modelopt_mixtral_nvfp4")
    for archs in (["GptOssForCausalLM"], ["DeepseekV2ForCausalLM"], []):
        config = {**source.checkpoint.config, "architectures": archs}
        other = dataclasses.replace(source, checkpoint=dataclasses.replace(source.checkpoint, config=config))
        with pytest.raises(RepackError, match=r"MoE architecture .* is not supported; supported: Qwen3MoeForCausalLM, "
                                              r"Qwen2MoeForCausalLM, DeepseekV3ForCausalLM, MixtralForCausalLM$"):
            expert_groups(other)
    both = dict(source.layers)
    both["model.layers.0.block_sparse_moe.experts.1.gate_proj"] = both["model.layers.0.block_sparse_moe.experts.1.w1"]
    with pytest.raises(RepackError, match="expert 1 has both w1 and gate_proj"):
        find_expert_groups(both, {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})


def test_deepseek_v3_dense_layers_fuse_as_vllm_and_nvfp4_mla_is_refused():
    """Beside the experts: the dense first layer's gate/up and the shared expert's fuse (vLLM's DeepseekV2MLP),
    down_proj split along K at TP 2; an NVFP4 MLA projection is refused in one line. vLLM's own load of the same:
    tests/test_vllm_moe_conformance.py::test_cli_convert_holds_vllms_fused_moe_state_byte_for_byte."""
    source = read_source(PRODUCERS / "ct_deepseek_v3_nvfp4")
    assert vllm_fusion(source.checkpoint.config) == {
        **VLLM_FUSION, "shared_experts.gate_up_proj": ("shared_experts.gate_proj", "shared_experts.up_proj")}
    assert vllm_fusion(read_source(PRODUCERS / "ct_nvfp4").checkpoint.config) == VLLM_FUSION
    experts = {m for group in expert_groups(source).values() for m in group.members}
    dense = dataclasses.replace(source, layers={p: x for p, x in source.layers.items() if p not in experts})
    planned = _rank_layers(dense, 2, 1)
    shared = "model.layers.1.mlp.shared_experts"
    assert sorted(planned) == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj",
                               f"{shared}.down_proj", f"{shared}.gate_up_proj"]
    assert [(p.source, p.rows) for p in planned[f"{shared}.gate_up_proj"].pieces] == [
        (f"{shared}.gate_proj", (64, 128)), (f"{shared}.up_proj", (64, 128))]
    assert [p.cols for p in planned[f"{shared}.down_proj"].pieces] == [(64, 128)]
    mla = {**dense.layers, "model.layers.0.self_attn.kv_b_proj": dataclasses.replace(
        dense.layers["model.layers.0.mlp.up_proj"], prefix="model.layers.0.self_attn.kv_b_proj")}
    with pytest.raises(RepackError, match=r"self_attn.kv_b_proj is NVFP4; MLA attention is supported unquantized only"):
        _rank_layers(dataclasses.replace(dense, layers=mla), 1, 0)


def test_expert_parallel_plans_whole_experts_as_vllm_places_them():
    assert [expert_range(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [expert_range(4, 3, r) for r in range(3)] == [(0, 2), (2, 3), (3, 4)]
    for name in MOE_FIXTURES:
        source = read_source(PRODUCERS / name)
        prefix = "model.layers.0.mlp.experts"
        plan = plan_experts(source, 2, 1, ep=True)[prefix]
        stack = assemble_experts(source, plan)
        assert (plan.experts, plan.rows, stack.experts, stack.intermediate) == ((2, 4), (0, 128), 2, 128)
        down = source.load_layer(source.layers[f"{prefix}.3.down_proj"])
        assert torch.equal(stack.w2_codes[1], down.codes)
        # ModelOpt's FusedMoE loads every expert's input scales under EP, compressed-tensors' only the rank's own
        assert len(stack.w2_input_scale) == (4 if name.startswith("modelopt") else 2)
        held = moe_cutlass.to_runtime(stack)
        assert check_experts(source, plan, held, moe_cutlass) == []
        held["w2_weight"][0, 0, 0] ^= 1
        assert check_experts(source, plan, held, moe_cutlass) == [f"{prefix}.2.down_proj: codes differ"]
    with pytest.raises(RepackError, match="only 4 experts"):
        plan_experts(read_source(PRODUCERS / "ct_moe_nvfp4"), 8, 0, ep=True)


def test_compressed_tensors_input_scales_are_inverted_in_float32():
    source = read_source(PRODUCERS / "ct_moe_nvfp4")
    group = expert_groups(source)["model.layers.0.mlp.experts"]
    stack = assemble_experts(source, plan_experts(source)[group.prefix])
    stored = source.checkpoint.read(group.down[2] + ".input_global_scale").reshape(())
    assert torch.equal(stack.w2_input_scale[2], 1.0 / stored)


def test_refusals_are_one_line(tmp_path, random_seed):
    gen = torch.Generator().manual_seed(random_seed)
    root = write_qwen_moe(tmp_path / "m", "modelopt", hidden=64, experts=3, intermediate=64, generator=gen)
    source = read_source(root)
    layers = dict(source.layers)
    del layers["model.layers.0.mlp.experts.1.up_proj"]
    with pytest.raises(RepackError, match=r"expert 1 has no NVFP4 up_proj") as err:
        find_expert_groups(layers)
    assert "\n" not in str(err.value)
    layers = dict(source.layers)
    layers["model.layers.0.mlp.experts.2.down_proj"] = layers["model.layers.0.self_attn.k_proj"]
    with pytest.raises(RepackError, match=r"experts.2: gate/up/down shapes"):
        find_expert_groups(layers)
    with pytest.raises(RepackError, match="--tp 8: .* not a multiple of 16"):
        plan_experts(source, 8, 0)
    with pytest.raises(RepackError, match="--ep: .* give --tp N with N > 1"):
        plan_layers(source, fuse=True, ep=True)
    unnamed = dataclasses.replace(source, layers={p: v for p, v in source.layers.items() if ".experts." not in p})
    with pytest.raises(RepackError, match="an MoE config, but no NVFP4 routed experts named"):
        expert_groups(unnamed)
    quantized_router = dataclasses.replace(
        source, layers={**source.layers, "model.layers.0.mlp.gate": source.layers["model.layers.0.self_attn.q_proj"]})
    with pytest.raises(RepackError, match="router is NVFP4-quantized"):
        expert_groups(quantized_router)


@pytest.mark.parametrize("per_check", [8, 3])  # experts compared at once: all 4, or 3 + 1
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda m: m.LAYOUT_ID)
@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_check_experts_passes_the_layout_and_catches_corrupt_and_swapped_experts(name, layout, per_check,
                                                                                   monkeypatch):
    monkeypatch.setattr("repack.verify_moe.CHECK_EXPERTS", per_check)
    source = read_source(PRODUCERS / name)
    plan = plan_experts(source, 2, 1)["model.layers.0.mlp.experts"]
    stack = assemble_experts(source, plan)
    held = layout.to_runtime(stack)
    assert check_experts(source, plan, held, layout) == []

    corrupt = {**held, "w2_weight": held["w2_weight"].clone()}
    row = 5 if layout is moe_cutlass else int(moe_trtllm.held_row(torch.tensor(5), "w2", 64, 64))  # hidden row 5
    corrupt["w2_weight"][2, row, 7] ^= 0x11
    assert check_experts(source, plan, corrupt, layout) == ["model.layers.0.mlp.experts.2.down_proj: codes differ"]

    swapped = {**held, "w13_weight_scale": held["w13_weight_scale"][[1, 0, 2, 3]]}
    assert check_experts(source, plan, swapped, layout) == [
        f"model.layers.0.mlp.experts.{e}.{p}_proj: block scales differ" for e in (0, 1) for p in ("gate", "up")]

    halves = layout.to_runtime(dataclasses.replace(stack, w13_codes=moe.w3w1(stack.w13_codes)))  # w1/w3 swapped
    assert check_experts(source, plan, {**held, "w13_weight": halves["w13_weight"]}, layout) == [
        f"model.layers.0.mlp.experts.{e}.{p}_proj: codes differ" for e in range(4) for p in ("gate", "up")]

    padding = {**held, "w2_weight_scale": held["w2_weight_scale"].clone()}
    padding["w2_weight_scale"].view(torch.uint8)[1, -1, -1] = 0x38
    assert check_experts(source, plan, padding, layout) == [
        "model.layers.0.mlp.experts: w2_weight_scale differs outside the experts' data (padding)"]

    alpha = {**held, "w2_weight_scale_2": held["w2_weight_scale_2"].clone()}
    alpha["w2_weight_scale_2"][3] = torch.nextafter(alpha["w2_weight_scale_2"][3], torch.tensor(1.0))
    held_alpha, source_alpha = (float(t[3]) for t in (alpha["w2_weight_scale_2"], held["w2_weight_scale_2"]))
    assert check_experts(source, plan, alpha, layout) == [
        f"model.layers.0.mlp.experts.3: w2_weight_scale_2 is {held_alpha:.9g}, the source gives {source_alpha:.9g}"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda m: m.LAYOUT_ID)
def test_expert_numerics_by_index_formulas_match_the_float64_source(layout, tmp_path, random_seed):
    """Sampled experts computed from the held tensors by the index formulas agree with the dequantized source;
    an expert whose w3 multiplier differs from its w1's (which vLLM drops) does not, by that ratio."""
    gen = torch.Generator().manual_seed(random_seed)
    for shared in (True, False):
        root = write_qwen_moe(tmp_path / f"m{shared}", "modelopt", hidden=80, experts=3, intermediate=128,
                               generator=gen, shared_scales=shared)
        source = read_source(root)
        plan = plan_experts(source, 2, 1)["model.layers.0.mlp.experts"]
        stack = assemble_experts(source, plan)
        errors = expert_numerics(source, plan, layout.to_runtime(stack), layout, [0, 2], gen)
        assert len(errors) == 6
        for name, error in errors.items():
            if shared or not name.endswith("up_proj"):
                assert error <= EXPERT_REL_ERROR, (name, error)
            else:
                e = int(name.split(".")[-2])
                ratio = float(stack.w13_multiplier[e, 0] / stack.w13_multiplier[e, 1])
                assert error == pytest.approx(abs(ratio - 1), rel=1e-4), (name, error, ratio)


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_expert_w4a4_numerics_follow_the_fp4_gemm_and_catch_a_wrong_alpha(name, random_seed):
    """FP4 x FP4 per expert: activations quantized as the GPU does with the held input scale, the held alpha,
    against the format's definition on the float64 source; an alpha off by 5 % is caught."""
    source = read_source(PRODUCERS / name)
    plan = plan_experts(source, 2, 0)["model.layers.1.mlp.experts"]
    held = moe_trtllm.to_runtime(assemble_experts(source, plan))
    gen = torch.Generator().manual_seed(random_seed)
    errors = expert_numerics(source, plan, held, moe_trtllm, [0, 3], gen, tokens=32, w4a4=True)
    assert len(errors) == 6 and max(errors.values()) <= EXPERT_W4A4_REL_ERROR, errors
    wrong = {**held, "w2_weight_scale_2": held["w2_weight_scale_2"] * 1.05}
    errors = expert_numerics(source, plan, wrong, moe_trtllm, [3], gen, tokens=32, w4a4=True)
    assert errors["model.layers.1.mlp.experts.3.down_proj"] > EXPERT_W4A4_REL_ERROR


def test_inspect_shows_experts_top_k_and_each_familys_moe_layout(capsys):
    assert main(["inspect", str(PRODUCERS / "modelopt_moe_i48_nvfp4"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["moe"] == {
        "fused_moe_layers": 2, "experts": [4], "top_k": 2, "hidden": 64, "intermediate": [48],
        "shared_expert_modules": 0,
        "layouts": {"sm100": moe_trtllm.LAYOUT_ID, "sm120": moe_cutlass.LAYOUT_ID, "sm90": None,
                    "sm80": moe_marlin.LAYOUT_ID, "sm75": moe_marlin.FP16_LAYOUT_ID}}
    assert main(["inspect", str(PRODUCERS / "ct_moe_nvfp4")]) == 0
    assert "MoE: 2 FusedMoE layers of 4 experts (top-2)" in " ".join(capsys.readouterr().out.split())
    assert main(["inspect", str(PRODUCERS / "ct_nvfp4"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["moe"] is None


def test_inspect_names_an_unsupported_expert_naming_in_one_line(tmp_path, capsys, random_seed):
    """Mixtral's ``experts.<e>.w1/w2/w3`` in a Qwen3-MoE checkpoint (vLLM's Qwen3-MoE loader reads only
    gate/up/down_proj): inspect still works and says why MoE layouts do not apply."""
    from safetensors.torch import load_file, save_file

    root = write_qwen_moe(tmp_path / "m", "modelopt", hidden=64, experts=2, intermediate=64,
                           generator=torch.Generator().manual_seed(random_seed))
    names = {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}
    tensors = load_file(root / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in names.items():
            name = name.replace(old, new) if ".experts." in name else name
        renamed[name] = tensor
    save_file(renamed, root / "model.safetensors", metadata={"format": "pt"})
    assert main(["inspect", str(root), "--json"]) == 0
    moe = json.loads(capsys.readouterr().out)["moe"]
    assert list(moe) == ["unsupported"] and "no NVFP4 routed experts named" in moe["unsupported"]
    assert main(["inspect", str(root)]) == 0
    assert "MoE: not supported: " in capsys.readouterr().out


@pytest.mark.parametrize("targets,message", [
    (["-t", "sm120"], "an NVFP4 MoE model (2 FusedMoE layers): convert it with --fuse or --tp N"),
    (["-t", "all"], "--target sm90: NVFP4 MoE layers are not supported there"),
    (["-t", "sm90"], "--target sm90: NVFP4 MoE layers are not supported there"),
])
def test_an_unfused_moe_convert_is_refused_as_inspect_says(tmp_path, capsys, targets, message):
    """Regression (issue 38): without --fuse/--tp an MoE checkpoint was written as per-expert dense layers, which no
    engine serves, and sm90 succeeded while inspect called it unsupported. Now refused in one line naming what to
    use, and inspect lists the targets convert writes the model for."""
    out = tmp_path / "bundle"
    assert main(["convert", str(PRODUCERS / "modelopt_moe_nvfp4"), *targets, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()
    assert main(["inspect", str(PRODUCERS / "modelopt_moe_nvfp4"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["targets"] == ["sm100", "sm120", "sm80", "sm75"]
    assert main(["inspect", str(PRODUCERS / "modelopt_moe_nvfp4")]) == 0
    assert "possible targets: sm100, sm120, sm80, sm75 (with --fuse or --tp N)" in " ".join(capsys.readouterr().out.split())
    for name in ("ct_moe_nvfp4a16", "modelopt_moe_w4a16_nvfp4"):  # W4A16 experts: vLLM's Marlin MoE on each
        assert main(["inspect", str(PRODUCERS / name), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["targets"] == ["sm100", "sm120", "sm80", "sm75"], name
        assert info["moe"]["layouts"] == {"sm100": "moe-marlin-v1", "sm120": "moe-marlin-v1", "sm90": None,
                                          "sm80": "moe-marlin-v1", "sm75": "moe-marlin-fp16-v1"}, name


def test_every_layout_of_an_engine_that_picks_its_own_moe_layout_names_it():
    """SGLang's layouts carry their MoE layout (``Target.moe_layout``): one that did not would silently take vLLM's
    ``families.MOE_LAYOUTS`` (review: moe_layout branched on the engine's name); vLLM's take that table, and every
    plan rule the plan reads is each MoE layout's own."""
    for name in ("sm100", "sm120", "sm90", "sm80", "sm75"):
        for layout in resolve_target(name).layouts:
            assert (layout.moe_layout is None) == (layout.engine == "vllm"), (name, layout.layout_id)
    for layout in (moe_trtllm, moe_cutlass, moe_marlin, moe_marlin.FP16):
        assert layout.TP_ALIGNMENT == 1 and "--rescale" in layout.GATE_UP_REFUSAL


def test_moe_layouts_declare_whether_they_hold_an_engines_own_names():
    """``NAMED`` is planning data (review: moe_specs and verify asked ``getattr(layout, "engine", "vllm")``): True
    exactly for the MoE layouts of SGLang's layouts, whose ModelOpt specs hold every expert's input scales (the layer's
    8 experts on a rank of 2), where vLLM's hold the rank's."""
    seen = set()
    for name in ("sm100", "sm120", "sm80", "sm75"):
        for layout in resolve_target(name).layouts:
            try:
                experts = moe.moe_layout(layout)
            except RepackError:  # SGLang's refusal of weight-only experts on Blackwell
                continue
            assert experts.NAMED == (layout.engine != "vllm"), (name, layout.layout_id)
            seen.add(experts.NAMED)
    assert seen == {True, False}
    for engine, named in (("sglang", (8, 2)), ("vllm", (2,))):
        layout = moe.moe_layout(resolve_target("sm100").for_engine(engine, "modelopt"))
        assert moe.moe_specs(layout, 2, 128, 128, 8)["w13_input_scale"].shape == named, engine
