"""``convert --fuse [--tp N] [--ep]`` on NVFP4 MoE checkpoints: the FusedMoE layers' manifest records, the bundle
reader's MoE API, verify on MoE bundles (a corrupted expert, swapped experts, swapped w1/w3 halves caught from the
command line), inspect, and the refusals. Byte conformance with vLLM's own load: tests/test_vllm_moe_conformance.py
(``-k cli``)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import repack.convert
import repack.formats.hashing
from repack.bundle.layers import assemble_experts, expert_multipliers, plan_experts
from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.convert import convert
from repack.errors import Interrupted, RepackError
from repack.formats import read_source
from repack.sample.synthetic import write_qwen_moe
from repack.targets import moe_cutlass, moe_marlin, moe_trtllm
from repack.targets.moe import w3w1

from .conftest import PRODUCERS
from .test_atomicity import tree_digest
from .test_verify import flip_tensor_byte, rewrite_consistently

LAYOUTS = {"sm100": moe_trtllm, "sm120": moe_cutlass}


@pytest.mark.parametrize("target", LAYOUTS)
@pytest.mark.parametrize("name,tp,ep,chunk", [("ct_moe_nvfp4", 1, False, None), ("modelopt_moe_nvfp4", 2, False, 1),
                                              ("ct_moe_nvfp4", 2, True, None), ("modelopt_moe_nvfp4", 2, True, 3)])
def test_convert_writes_each_fused_moe_layer_under_vllms_module_with_its_record(tmp_path, name, tp, ep, chunk, target,
                                                                                  monkeypatch):
    """Every rank's FusedMoE tensors, read through ``Bundle.moe_tensors``, are the layout of that rank's experts cut
    from the source (the whole stack, independently planned here), and the record says which experts, rows and
    layout. ``chunk``: experts convert transforms at once (1; 3, which straddles the --ep ranks' 2 + 2), else all."""
    if chunk is not None:
        monkeypatch.setattr("repack.convert.moe_chunk_experts", lambda per_expert, share, bundles: chunk)
    out = tmp_path / "out"
    args = ["convert", str(PRODUCERS / name), "-t", target, "--fuse", "-o", str(out), "--tp", str(tp)]
    assert main(args + (["--ep"] if ep else [])) == 0
    source = read_source(PRODUCERS / name)
    layout = LAYOUTS[target]
    for rank in range(tp):
        bundle = open_bundle(out / f"rank-{rank}" if tp > 1 else out)
        assert bundle.manifest.bundle_format_version == 6 and bundle.moe_layout is layout
        plans = plan_experts(source, tp, rank, ep)
        records = bundle.moe_layers()
        assert list(records) == [f"model.layers.{i}.mlp.experts.routed_experts" for i in range(2)]
        for module, record in records.items():
            plan = plans[record.source]
            first, last = plan.experts
            assert (record.layout_id, record.backend, record.kernels) == (layout.LAYOUT_ID, layout.BACKEND,
                                                                           list(layout.KERNELS))
            assert (record.num_experts, record.local_experts, record.experts, record.rows, record.hidden,
                    record.intermediate, record.top_k) == (4, last - first, [first, last], list(plan.rows), 64,
                                                           128 // (1 if ep else tp), 2)
            assert record.members["down"] == [f"{record.source}.{e}.down_proj" for e in range(first, last)]
            assert record.input_scales == ("all" if name.startswith("modelopt") else "local")
            assert record.expert_map == ([e - first if first <= e < last else -1 for e in range(4)] if ep else None)
            held = bundle.moe_tensors(module)
            expected = layout.to_runtime(assemble_experts(source, plan), plan.prefix)
            assert set(held) == set(expected) == set(layout.TENSORS)
            for part, tensor in expected.items():
                assert torch.equal(held[part].view(torch.uint8), tensor.view(torch.uint8)), (rank, module, part)
        # the experts' activation scales are folded into the records' tensors; compressed-tensors' global scales,
        # which vLLM keeps on its module as loaded, stay passthrough: the rank's experts', the source's bytes
        kept = [n for n in bundle.manifest.passthrough if ".experts." in n]
        assert sorted(kept) == (sorted(f"model.layers.{i}.mlp.experts.{e}.{proj}.{scale}" for i in range(2)
                                       for e in range(first, last) for proj in ("gate_proj", "up_proj", "down_proj")
                                       for scale in ("weight_global_scale", "input_global_scale"))
                                if name.startswith("ct_") else [])
        for n in kept:
            assert torch.equal(bundle.read(n).view(torch.uint8), source.checkpoint.read(n).view(torch.uint8)), n
        assert not [p for p in bundle.manifest.layers if ".experts." in p]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """ct_moe_nvfp4 converted with --tp 2 --ep for each family: rank 1 holds experts 2 and 3 of both layers."""
    out = {}
    for target in LAYOUTS:
        path = tmp_path_factory.mktemp("moe") / target
        assert main(["convert", str(PRODUCERS / "ct_moe_nvfp4"), "-t", target, "--tp", "2", "--ep", "-o",
                     str(path)]) == 0
        out[target] = path
    return out


def _verify(path, capsys) -> tuple[int, str]:
    code = main(["verify", str(path), "--seed", "7"])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("target", LAYOUTS)
def test_verify_passes_fused_moe_bundles_with_expert_numerics(converted, target, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["verify", str(converted[target]), "--report", str(report)]) == 0, capsys.readouterr().out
    layers = {c["name"]: c for c in json.loads(report.read_text())["layers"]}
    for rank in range(2):
        moe = layers[f"rank-{rank}/model.layers.0.mlp.experts.routed_experts"]
        assert moe["status"] == "ok" and 0 < moe["max_rel_error"] <= 1e-6  # two sampled experts, FP4 x FP4
    assert layers["reassembled/model.layers.1.mlp.experts"]["status"] == "ok"  # every expert on exactly one rank


MODULE = "model.layers.1.mlp.experts.routed_experts"


def _tamper(path, change) -> None:
    """Rank 1's ``MODULE`` tensors changed by ``change`` (held -> {name: new tensor}), its manifest rewritten to
    match: what only the comparison with the source catches."""
    rank = path / "rank-1"
    held = open_bundle(rank).moe_tensors(MODULE)
    for name, value in change(held).items():
        rewrite_consistently(rank, f"{MODULE}.{name}", value)


def _swapped_halves(target):
    """w13 built from each expert's up rows where its gate rows go and back (through the layout, so that the
    sm100 interleave puts them where the kernel reads gate rows)."""
    source = read_source(PRODUCERS / "ct_moe_nvfp4")
    plan = plan_experts(source, 2, 1, ep=True)["model.layers.1.mlp.experts"]
    stack = assemble_experts(source, plan)
    swapped = LAYOUTS[target].to_runtime(dataclasses.replace(stack, w13_codes=w3w1(stack.w13_codes)))
    return lambda held: {"w13_weight": swapped["w13_weight"]}


def _corrupt_expert(held):
    w2 = held["w2_weight"].clone()
    w2[1].view(-1)[100] ^= 0x22  # local expert 1 of rank 1: global expert 3
    return {"w2_weight": w2}


def _swap_experts(held):
    return {"w13_weight_scale": held["w13_weight_scale"][[1, 0]].contiguous()}


@pytest.mark.parametrize("target", LAYOUTS)
@pytest.mark.parametrize("case,expected", [
    ("corrupt", ["rank-1: model.layers.1.mlp.experts.3.down_proj: codes differ"]),
    ("swap", [f"rank-1: model.layers.1.mlp.experts.{e}.{p}_proj: block scales differ" for e in (2, 3)
              for p in ("gate", "up")]),
    ("halves", [f"rank-1: model.layers.1.mlp.experts.{e}.{p}_proj: codes differ" for e in (2, 3)
                for p in ("gate", "up")]),
])
def test_verify_names_a_corrupted_or_swapped_expert_or_swapped_halves(converted, target, case, expected, tmp_path,
                                                                      capsys):
    """A tamperer who rewrites the manifest too (digests consistent): verify exits 1 and names the expert and
    projection, one line each, from the source comparison."""
    path = tmp_path / "out"
    shutil.copytree(converted[target], path)  # its manifests still name the fixture as the source
    change = {"corrupt": _corrupt_expert, "swap": _swap_experts, "halves": _swapped_halves(target)}[case]
    _tamper(path, change)
    code, text = _verify(path, capsys)
    assert code == 1, text
    lines = [line.strip() for line in text.splitlines() if "mlp.experts." in line and "differ" in line]
    assert lines == expected, text


@pytest.mark.parametrize("target", LAYOUTS)
def test_verify_catches_a_kept_expert_scale_changed_or_missing(converted, target, tmp_path, capsys):
    """compressed-tensors' expert global scales vLLM keeps as loaded, passthrough in the bundle: one changed (manifest
    rewritten to match) or dropped fails against the source."""
    path = tmp_path / "out"
    shutil.copytree(converted[target], path)
    changed, dropped = (f"model.layers.1.mlp.experts.{e}.{p}" for e, p in ((3, "up_proj.weight_global_scale"),
                                                                            (2, "down_proj.input_global_scale")))
    rewrite_consistently(path / "rank-1", changed, open_bundle(path / "rank-1").read(changed) * 2)
    rewrite_consistently(path / "rank-1", dropped, None)
    code, text = _verify(path, capsys)
    assert code == 1, text
    assert f"rank-1: {changed}: differs from the source" in text, text
    assert f"rank-1: {dropped}: missing from the bundle (vLLM keeps it on {MODULE} as loaded)" in text, text


def test_a_flipped_expert_byte_fails_integrity(converted, tmp_path, capsys):
    path = tmp_path / "out"
    shutil.copytree(converted["sm100"], path)
    flip_tensor_byte(path / "rank-0", f"{MODULE}.w2_weight", offset=17)
    code, text = _verify(path, capsys)
    assert code == 1 and f"rank-0: {MODULE}.w2_weight: blake3 digest differs from the manifest" in text, text


def test_inspect_shows_the_bundles_fused_moe_layers(converted, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", str(converted["sm120"] / "rank-1")]) == 0
    text = capsys.readouterr().out
    assert (f"2 FusedMoE layers, layout {moe_cutlass.LAYOUT_ID} (vLLM backend FLASHINFER_CUTLASS, FlashInferExperts)"
            in text), text
    row = next(line for line in text.splitlines() if MODULE in line)
    cells = [cell.strip() for cell in row.split("│")[2:7]]
    assert cells == ["2:4 of 4 (expert parallel)", "2", "64", "128 (0:128)", "local experts"], row
    assert main(["inspect", str(converted["sm100"]), "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)
    assert [r["moe"][MODULE]["expert_map"] for r in ranks] == [[0, 1, -1, -1], [-1, -1, 0, 1]]
    assert {r["moe"][MODULE]["layout_id"] for r in ranks} == {moe_trtllm.LAYOUT_ID}


def test_a_chunk_of_experts_holds_about_32_mb_for_all_ranks():
    """The pass's bytes in flight grow with the ranks: --tp 8 cut into 16 MB per rank peaked at 1.7-1.9 GB RSS on the
    4.2 GB benchmark (docs/benchmarks.md), so a chunk holds about MOE_PASS_BYTES for all bundles, MOE_CHUNK_BYTES at
    most for one. DeepSeek-R1's w13 codes: 14.7 MB per expert."""
    w13 = 2 * 2048 * 7168 // 2
    assert repack.convert.moe_chunk_experts(w13, 1.0, 1) == 1  # --fuse: one expert, 14.7 MB
    assert repack.convert.moe_chunk_experts(w13, 1 / 8, 8) == 2  # --tp 8: 3.7 MB per rank, 29 MB in all
    assert repack.convert.moe_chunk_experts(w13, 1 / 2, 2) == 2  # --tp 2: 14.7 MB per rank
    assert repack.convert.moe_chunk_experts(w13 // 8, 1.0, 1) == 9  # block scales: 16.5 MB


@pytest.mark.parametrize("chunk", [None, 1])
def test_each_source_expert_tensor_is_read_once_for_every_rank(tmp_path, monkeypatch, chunk):
    """One pass for every rank, one read of each source expert tensor: every expert's codes and block scales are
    read (mapped or copied) exactly once by a convert, at --fuse (one bundle) as at --tp 2 and --tp 4 --ep (several),
    in one chunk of experts or one expert at a time. (Each layout weight tensor is made from one of them.)"""
    counts: dict[str, dict[str, int]] = {}
    real = repack.formats.hashing.map_tensor

    def counted(entry):
        reads = counts.setdefault(mode, {})
        reads[entry.name] = reads.get(entry.name, 0) + 1
        return real(entry)

    monkeypatch.setattr(repack.formats.hashing, "map_tensor", counted)
    if chunk is not None:
        monkeypatch.setattr("repack.convert.moe_chunk_experts", lambda per_expert, share, bundles: chunk)
    source = read_source(PRODUCERS / "modelopt_moe_nvfp4")
    expert_tensors = sorted(n for prefix, layer in source.layers.items() if ".experts." in prefix
                            for n in layer.tensor_names[:2])
    assert len(expert_tensors) == 2 * 4 * 3 * 2  # layers x experts x projections x (codes, block scales)
    for mode, args in (("fuse", ["--fuse"]), ("tp4", ["--tp", "4", "--ep"]), ("tp2", ["--tp", "2"])):
        assert main(["convert", str(PRODUCERS / "modelopt_moe_nvfp4"), "-t", "sm100", "-o", str(tmp_path / mode),
                     *args]) == 0
        assert {n: counts[mode].get(n, 0) for n in expert_tensors} == dict.fromkeys(expert_tensors, 1), mode


@pytest.mark.parametrize("name,args,code,message", [
    ("ct_moe_nvfp4", ["-t", "sm90", "--fuse"], 1, "Error: --target sm90: NVFP4 MoE layers are not supported there"),
    ("ct_moe_nvfp4a16", ["-t", "sm90", "--tp", "2"], 1, "(--moe-backend marlin): convert with --target sm80"),
    ("ct_moe_i48_nvfp4", ["-t", "sm120", "--fuse"], 1,  # 2I with its numbers, and no word of the hidden size (issue 38)
     "vLLM 0.33 does: 2 x intermediate size per rank (2 x 48 = 96) must be a multiple of 128\n"),
    ("ct_moe_nvfp4", ["-t", "sm100", "--fuse", "--ep"], 2, "--ep places whole experts on tensor-parallel ranks"),
])
def test_moe_refusals_are_one_line_and_write_nothing(tmp_path, capsys, name, args, code, message):
    out = tmp_path / "out"
    assert main(["convert", str(PRODUCERS / name), "-o", str(out), *args]) == code
    err = capsys.readouterr().err
    assert message in err and (code == 2 or err.count("\n") == 1), err
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("field,value,message", [
    ("experts", [3, 5], "experts \\[3, 5\\] \\(2 local\\) of 4 or rows"),
    ("local_experts", 3, "experts \\[2, 4\\] \\(3 local\\) of 4"),
    ("expert_map", [0, 1, -1], "expert_map must give each of the 4 experts"),
    ("input_scales", "some", "input_scales must be all, local or none"),
    ("members", {"gate": [], "up": [], "down": []}, "members must name each held expert"),
    ("layout_id", "moe-flashinfer-cutlass-v1", "is not sm100's \\(moe-flashinfer-trtllm-v1\\)"),
    ("tensors", "drop g1_scale_c", "are not the moe-flashinfer-trtllm-v1 layout's"),
])
def test_a_malformed_moe_record_is_refused_in_one_line(converted, tmp_path, field, value, message):
    rank = tmp_path / "rank-1"
    shutil.copytree(converted["sm100"] / "rank-1", rank)
    manifest = json.loads((rank / "manifest.json").read_text())
    record = manifest["moe"][MODULE]
    if value == "drop g1_scale_c":
        del record["tensors"]["g1_scale_c"]
    else:
        record[field] = value
    (rank / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RepackError, match=message) as err:
        open_bundle(rank)
    assert "\n" not in str(err.value)


def test_ctrl_c_then_resume_of_a_fused_moe_convert_matches_a_clean_run(tmp_path, monkeypatch):
    """Shards a Ctrl-C left (FusedMoE layers among them) are kept by --resume, and the result is byte-identical to an
    uninterrupted run (tests/test_resume.py for dense ones)."""
    source = PRODUCERS / "ct_moe_nvfp4"
    reference, out = tmp_path / "reference", tmp_path / "out"
    convert(source, "sm100", reference, fuse=True, max_shard_size="20KB")
    real, taken = repack.convert._Writing.take_experts, []

    def take(self, tensors, stack, last):
        if len(taken) == 5:  # layer 0's FusedMoE tensors (four weights in one chunk, the scalars) are queued
            raise KeyboardInterrupt
        taken.append(tensors[0].name)
        real(self, tensors, stack, last)

    monkeypatch.setattr(repack.convert._Writing, "take_experts", take)
    with pytest.raises(Interrupted) as caught:
        convert(source, "sm100", out, fuse=True, max_shard_size="20KB")
    staging = caught.value.kept[0][1]
    journal = json.loads((staging / ".nvfp4-repack-resume.json").read_text())
    assert any(f"{MODULE.replace('layers.1', 'layers.0')}.w13_weight" in shard["tensors"]
               for shard in journal["shards"].values()), journal  # layer 0's FusedMoE shard is kept
    monkeypatch.undo()
    summary = convert(source, "sm100", out, fuse=True, max_shard_size="20KB", resume=True)
    assert summary.kept_shards == caught.value.kept[0][2]
    assert tree_digest(out) == tree_digest(reference)


def test_verify_fails_a_tp_output_whose_ranks_miss_experts(converted, tmp_path, capsys):
    """A rank whose manifest lost a FusedMoE record (its own checks then have nothing to check): the ranks no longer
    hold every expert, which the output's check names."""
    path = tmp_path / "out"
    shutil.copytree(converted["sm120"], path)
    manifest = json.loads((path / "rank-1" / "manifest.json").read_text())
    del manifest["moe"][MODULE]
    (path / "rank-1" / "manifest.json").write_text(json.dumps(manifest))
    code, text = _verify(path, capsys)
    assert code == 1 and ("model.layers.1.mlp.experts: the ranks do not hold each expert's rows exactly once "
                          "(expert 2 is not all there)") in text, text


def test_a_non_finite_expert_multiplier_is_refused_naming_the_layer(tmp_path):
    """The scalars' pass reads the experts' multipliers from their 4-byte scales, refused as ``load_layer`` refuses
    them."""
    root = write_qwen_moe(tmp_path / "m", "modelopt", hidden=64, experts=3, intermediate=64,
                          generator=torch.Generator().manual_seed(0))
    tensors = load_file(root / "model.safetensors")
    tensors["model.layers.0.mlp.experts.1.down_proj.weight_scale_2"] = torch.tensor(float("nan"))
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    source = read_source(root)
    downs = tuple(f"model.layers.0.mlp.experts.{e}.down_proj" for e in range(3))
    with pytest.raises(RepackError, match=r"experts\.1\.down_proj: global scale must be finite and positive, got nan"):
        expert_multipliers(source, downs)
    with pytest.raises(RepackError, match=r"experts\.1\.down_proj: global scale must be finite and positive"):
        convert(root, "sm100", tmp_path / "out", fuse=True)  # the weights' pass refuses it first
    assert not (tmp_path / "out").exists()


def test_an_mlp_the_family_cannot_serve_is_refused_before_its_gate_up_scales(tmp_path):
    """sm90 has no MoE layout: its refusal comes first, not the gate/up one whose advice (--rescale) would only lead
    to it (review: the plan asked vLLM's MoE layout after the experts' scales, SGLang's before)."""
    root = write_qwen_moe(tmp_path / "m", "modelopt", hidden=128, experts=3, intermediate=128,
                          generator=torch.Generator().manual_seed(3), shared_scales=False)
    for options in ({"tp": 2}, {"fuse": True}):
        with pytest.raises(RepackError, match=r"^--target sm90: NVFP4 MoE layers are not supported there"):
            convert(root, "sm90", tmp_path / "out", **options)
    with pytest.raises(RepackError, match=r"gate_proj and up_proj global scales differ .* pass --rescale"):
        convert(root, "sm100", tmp_path / "out", tp=2)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,fuse", [("ct_moe_nvfp4", True), ("modelopt_moe_nvfp4", True), ("ct_nvfp4", False),
                                       ("modelopt_nvfp4", True)])
def test_the_summary_counts_the_passthrough_tensors_the_bundle_holds(tmp_path, name, fuse):
    """W4A4 sources fold their layers' input scales into the layer records, and compressed-tensors MoE bundles keep
    their experts' global scales as passthrough: the summary counts what the manifest holds, not the source's list."""
    summary = convert(PRODUCERS / name, "sm100", tmp_path / "out", fuse=fuse)
    source = read_source(PRODUCERS / name)
    held = open_bundle(tmp_path / "out").manifest.passthrough
    assert summary.passthrough == len(held)
    assert len(held) != len(source.passthrough)  # what the count used to be


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_experts_with_unequal_gate_and_up_scales_are_refused_or_rescaled(tmp_path, capsys, fmt):
    """Regression (issue 38): experts whose gate and up multipliers differ converted with exit 0 (``--rescale`` did
    nothing for them) and the bundle failed its own verify: vLLM keeps gate's multiplier for both. Now refused in one
    line naming the layer, as dense fused layers are; ``--rescale`` folds own / max into both halves' block scales,
    records the error it added, and verify checks the rescaled experts exactly and bounds that error."""
    root = write_qwen_moe(tmp_path / "m", fmt, hidden=64, experts=4, intermediate=128, layers=2, shared_scales=False,
                          generator=torch.Generator().manual_seed(3))
    for target, args in (("sm100", ["--fuse"]), ("sm120", ["--fuse"]), ("sm100", ["--tp", "2", "--ep"])):
        out = tmp_path / f"{target}{len(args)}"
        assert main(["convert", str(root), "-t", target, "-o", str(out), *args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("Error: model.layers.0.mlp.experts.0: gate_proj and up_proj global scales differ ("), err
        assert "pass --rescale" in err and err.count("\n") == 1 and not out.exists()
        assert main(["convert", str(root), "-t", target, "-o", str(out), "--rescale", *args]) == 0
        bundles = [out / f"rank-{r}" for r in range(2)] if "--tp" in args else [out]
        errors = [r.rescale_error for b in bundles for r in open_bundle(b).moe_layers().values()]
        assert len(errors) == 2 * len(bundles) and all(0 < e < 0.1 for e in errors), errors
        capsys.readouterr()
        assert main(["verify", str(out), "--numerics", "all"]) == 0, capsys.readouterr().out[-3000:]
    manifest = json.loads((out / "rank-1" / "manifest.json").read_text())
    record = manifest["moe"]["model.layers.1.mlp.experts.routed_experts"]
    record["rescale_error"] /= 2
    (out / "rank-1" / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    assert ("model.layers.1.mlp.experts.routed_experts: rescaled weights depart from the source by"
            in capsys.readouterr().out)
    record.pop("rescale_error")  # not rescaled, by the record: the held experts are not the source's
    (out / "rank-1" / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(out)]) == 1
    assert "block scales differ" in capsys.readouterr().out


@pytest.mark.parametrize("layers", [(1,), (0, 1)], ids=["one-layer", "every-layer"])
def test_a_layer_missing_its_last_experts_is_refused_against_the_config(tmp_path, capsys, layers):
    """Regression (issue 38): a checkpoint missing its highest-numbered expert (in one layer, or in all) converted and
    verified, and --ep split 3 experts 2 + 1 where vLLM splits the config's 4 as 2 + 2."""
    root = write_qwen_moe(tmp_path / "m", "modelopt", hidden=64, experts=4, intermediate=64, layers=2,
                          generator=torch.Generator().manual_seed(0))
    tensors = load_file(root / "model.safetensors")
    dropped = tuple(f"model.layers.{i}.mlp.experts.3." for i in layers)
    save_file({k: v for k, v in tensors.items() if not k.startswith(dropped)}, root / "model.safetensors",
              metadata={"format": "pt"})
    for args in (["--fuse"], ["--tp", "2", "--ep"]):
        assert main(["convert", str(root), "-t", "sm100", "-o", str(tmp_path / "out"), *args]) == 1
        err = capsys.readouterr().err
        assert err == (f"Error: model.layers.{layers[0]}.mlp.experts: config.json's num_experts is 4 but expert 3 has "
                       "no NVFP4 gate_proj; expected experts 0..3, each with gate_proj, up_proj, down_proj\n")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt,proj", [("modelopt", "gate_proj"), ("compressed-tensors", "down_proj")])
def test_a_routed_experts_bias_is_refused_in_one_line_naming_it(tmp_path, capsys, fmt, proj):
    """Regression (issue 36): an expert's ``experts.<e>.<proj>.bias`` (vLLM's ``w13_bias`` / ``w2_bias``) converted with
    exit 0 as a passthrough tensor that vLLM 0.33 / 0.34's expert loader skips (these FusedMoEs have no bias; SGLang's
    loaders skip it too), so the served model lost it. Now refused in one line naming the tensor, nothing written, for every target and engine."""
    root = write_qwen_moe(tmp_path / "m", fmt, hidden=128, experts=3, intermediate=128, layers=2,
                          shared_input_scales=True, generator=torch.Generator().manual_seed(0))
    name = f"model.layers.1.mlp.experts.2.{proj}.bias"
    tensors = load_file(root / "model.safetensors")
    tensors[name] = torch.ones(tensors[name.replace(".bias", ".weight_scale")].shape[0], dtype=torch.bfloat16)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    for args in (["-t", "sm100", "--fuse"], ["-t", "sm80", "--tp", "2", "--ep"], ["-t", "sm120", "--weight-only"],
                 ["-t", "sm100", "--engine", "sglang"]):
        assert main(["convert", str(root), "-o", str(tmp_path / "out"), *args]) == 1, args
        assert capsys.readouterr().err == (f"Error: {name}: routed experts with biases are not supported: vLLM's "
                                           "and SGLang's FusedMoE for Qwen3MoeForCausalLM hold no expert bias (their "
                                           "loaders drop it)\n"), args
        assert sorted(tmp_path.iterdir()) == [root], args


WEIGHT_ONLY = ["ct_moe_nvfp4a16", "modelopt_moe_w4a16_nvfp4"]  # llm-compressor's NVFP4A16, ModelOpt's W4A16_NVFP4


@pytest.mark.parametrize("target", ["sm80", "sm100", "sm120", "sm75"])
@pytest.mark.parametrize("name,tp,ep", [(WEIGHT_ONLY[0], 1, False), (WEIGHT_ONLY[1], 2, False),
                                        (WEIGHT_ONLY[0], 2, True), (WEIGHT_ONLY[1], 2, True)])
def test_weight_only_moe_converts_to_marlin_moe_on_every_family_vllm_serves_it(tmp_path, capsys, name, tp, ep, target):
    """Weight-only experts (no input scales) get vLLM's auto MoE backend for them on sm80, sm100 and sm120, Marlin's
    (issue 36): each rank's FusedMoE tensors are moe_marlin's of its experts (one scale factor over the rank's),
    the record says so and holds no input scales, compressed-tensors' kept global scales ride along (no input
    ones: the source has none), and verify passes, then names a corrupted expert."""
    out = tmp_path / "out"
    args = ["convert", str(PRODUCERS / name), "-t", target, "--fuse", "--tp", str(tp), "-o", str(out)]
    assert main(args + ["--ep"] * ep) == 0, capsys.readouterr().err
    source = read_source(PRODUCERS / name)
    for rank in range(tp):
        bundle = open_bundle(out / f"rank-{rank}" if tp > 1 else out)
        layout = moe_marlin.FP16 if target == "sm75" else moe_marlin  # T4 runs fp16: its own scale bytes
        assert bundle.manifest.scheme == "W4A16" and bundle.moe_layout is layout
        for module, record in bundle.moe_layers().items():
            plan = plan_experts(source, tp, rank, ep)[record.source]
            assert (record.layout_id, record.backend, record.input_scales) == (layout.LAYOUT_ID, "MARLIN", "none")
            stack = assemble_experts(source, plan)
            assert stack.w13_input_scale.shape == (0, 2) and stack.w2_input_scale.shape == (0,)
            want = moe_marlin.to_runtime(stack, plan.prefix, dtype=torch.float16 if target == "sm75" else torch.bfloat16)
            held = bundle.moe_tensors(module)
            assert set(held) == set(want), module
            for part, tensor in want.items():
                assert torch.equal(held[part].view(torch.uint8), tensor.view(torch.uint8)), (rank, module, part)
        kept = [n for n in bundle.manifest.passthrough if ".experts." in n]
        held_experts = 4 // tp if ep else 4
        assert all(n.endswith(".weight_global_scale") for n in kept), kept
        assert len(kept) == (0 if name.startswith("modelopt") else 2 * 3 * held_experts), kept  # layers x projs x experts
    assert _verify(out, capsys)[0] == 0
    rank = out / "rank-1" if tp > 1 else out
    held = open_bundle(rank).moe_tensors(MODULE)
    w2 = held["w2_weight"].clone()
    w2[-1].view(-1)[100] ^= 0x22  # the last expert of the (last) rank: global expert 3
    rewrite_consistently(rank, f"{MODULE}.w2_weight", w2)
    code, text = _verify(out, capsys)
    assert code == 1 and "model.layers.1.mlp.experts.3.down_proj: codes differ" in text, text


@pytest.mark.parametrize("w4a4", [False, True])
def test_marlin_moe_synthetic_shapes_round_trip_with_a_one_expert_rank(tmp_path, w4a4):
    """Fresh MoE checkpoints of both formats, a hidden size Marlin pads I to 128 for (192) and I = 96, to Marlin MoE
    (weight-only experts on sm80 and sm100; W4A4 ones on sm80), --tp 2 and --tp 2 --ep: every bundle verifies against
    its source. Regression: 3 experts under --ep leave rank 1 one expert, whose multiplier column torch calls
    contiguous with stride 2, which the writer could not view as bytes (an internal error)."""
    gen = torch.Generator().manual_seed(36)
    for fmt in ("modelopt", "compressed-tensors"):
        src = write_qwen_moe(tmp_path / fmt, fmt, hidden=192, experts=3, intermediate=96, generator=gen, layers=2,
                             w4a4=w4a4)
        assert read_source(src).activation_scheme == ("W4A4" if w4a4 else "W4A16")
        for target in ("sm80",) if w4a4 else ("sm80", "sm100"):
            for ep in (False, True):
                out = tmp_path / f"{fmt}-{target}-{ep}"
                convert(src, target, out, tp=2, ep=ep)
                assert open_bundle(out / "rank-1").moe_layout is moe_marlin
                assert main(["verify", str(out)]) == 0
