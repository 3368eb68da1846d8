"""verify of MoE bundles (issue 40) and of --tp outputs (issue 38): every expert's scalars against the source
whatever --numerics says, numerics deterministic and counted honestly, the manifest's displayed fields checked."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.sample.synthetic import write_qwen_moe
from repack.verify import verify_output
from repack.verify_moe import EXPERT_REL_ERROR, EXPERT_W4A4_REL_ERROR, ExpertFindings

from .test_verify import rewrite_consistently

LAYER0 = "model.layers.0.mlp.experts"
MODULE0 = f"{LAYER0}.routed_experts"


def _moe_source(path, fmt="modelopt"):
    return write_qwen_moe(path, fmt, hidden=64, experts=4, intermediate=64, layers=2,
                          generator=torch.Generator().manual_seed(11))


def _verify(path, capsys, *args) -> tuple[int, str, dict]:
    """verify's exit code and text, and its --json report of the same run's arguments (a second run)."""
    code = main(["verify", str(path), *args])
    text = capsys.readouterr().out
    assert main(["verify", str(path), "--json", *args]) == code
    return code, text, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> dict:
    """A ModelOpt Qwen3-MoE fixture converted --fuse for sm100 and sm120."""
    root = tmp_path_factory.mktemp("moe")
    source = _moe_source(root / "src")
    out = {"source": source}
    for target in ("sm100", "sm120"):
        assert main(["convert", str(source), "-t", target, "--fuse", "-o", str(root / target)]) == 0
        out[target] = root / target
    return out


@pytest.mark.parametrize("target,args", [("sm100", ["--fuse"]), ("sm120", ["--fuse"]), ("sm100", ["--tp", "2", "--ep"])],
                         ids=["sm100", "sm120", "sm100-tp2-ep"])
@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_an_expert_whose_up_scale_differs_from_gates_fails_verify_naming_it(tmp_path, capsys, monkeypatch, fmt,
                                                                             target, args):
    """Regression (issue 40): one expert's up_proj global scale doubled (gate's kept), converted as 504f820 did
    (exit 0: vLLM keeps gate's scale for both halves), passed the default verify and passed or failed
    --numerics all by the random draw. Now both fail, every run alike, naming the expert."""
    source = _moe_source(tmp_path / "src", fmt)
    tensors = load_file(source / "model.safetensors")
    name = f"{LAYER0}.1.up_proj." + ("weight_scale_2" if fmt == "modelopt" else "weight_global_scale")
    tensors[name] = tensors[name] * (2 if fmt == "modelopt" else 0.5)  # CT stores the inverse
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with monkeypatch.context() as patch:  # convert as before issue 38's refusal
        patch.setattr("repack.bundle.layers._unequal_gate_up",
                      lambda source, group, rescale, *refusal: torch.zeros(group.experts, dtype=torch.bool))
        assert main(["convert", str(source), "-t", target, *args, "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    runs = [_verify(tmp_path / "out", capsys, *args) for args in ([], [], ["--numerics", "all"])]
    for code, text, report in runs:
        assert code == 1, text
        assert f"{LAYER0}.1.up_proj: global scale multiplier" in text, text  # exactness, whatever --numerics
        assert f"{LAYER0}.1.up_proj: relative error 0.5" in text, text  # the odd expert's numerics always run
        assert [c["name"].rpartition("/")[2] for c in report["layers"] if c["status"] == "fail"] == [MODULE0]
    assert runs[0][1] == runs[1][1] and runs[0][2] == runs[1][2]  # the same verdict, sample and seed every run
    assert runs[2][2]["numerics_experts"] == runs[2][2]["experts"] == 8


SCALARS = {"sm100": ("w13_weight_scale_2", "w13_input_scale", "w2_weight_scale_2", "w2_input_scale", "g1_scale_c"),
           "sm120": ("w13_weight_scale_2", "w13_input_scale", "w2_weight_scale_2", "w2_input_scale")}


@pytest.mark.parametrize("target,scalar", [(t, s) for t, names in SCALARS.items() for s in names])
def test_a_held_expert_scalar_other_than_the_sources_fails_naming_the_expert(fused, target, scalar, tmp_path, capsys):
    """Each folded scalar of one expert changed in the bundle (its digests rewritten to match): exactness fails
    naming the expert, with and without --numerics all."""
    path = tmp_path / "out"
    shutil.copytree(fused[target], path)
    held = open_bundle(path).moe_tensors(MODULE0)[scalar].clone()
    held[2] *= 2
    rewrite_consistently(path, f"{MODULE0}.{scalar}", held)
    for args in ([], ["--numerics", "all"]):
        code, text, _ = _verify(path, capsys, *args)
        assert code == 1 and f"{LAYER0}.2: {scalar} is " in text, text


def test_numerics_are_deterministic_and_counted(fused, capsys):
    """No --seed: the seed comes from the manifest (recorded in the report), so two runs agree; the default samples
    experts, --numerics all runs every expert of every layer, and the summary counts what ran."""
    first, second = (_verify(fused["sm100"], capsys) for _ in range(2))
    assert first[0] == 0 and first[1] == second[1] and first[2] == second[2], first[1]
    report = first[2]
    moe = [c for c in report["layers"] if c["numerics_experts"] is not None]
    assert report["experts"] == 8 and report["numerics_experts"] == sum(c["numerics_experts"] for c in moe) < 8
    assert report["numerics_layers"] == sum(c["max_rel_error"] is not None for c in report["layers"])
    assert (f"numerics on {report['numerics_layers']} of {len(report['layers'])} layers and "
            f"{report['numerics_experts']} of 8 experts" in first[1]), first[1]
    assert f"activation seed {report['seed']}" in first[1]
    code, text, every = _verify(fused["sm100"], capsys, "--numerics", "all")
    assert code == 0 and every["numerics_experts"] == 8 and all(c["numerics_experts"] == 4 for c in every["layers"]
                                                               if c["numerics_experts"] is not None), text
    assert every["numerics_layers"] == len(every["layers"])


def test_tp_reassembly_numerics_follow_numerics_and_are_counted(tmp_path, capsys):
    """Regression (issue 38): a --tp output's reassembly ran numerics on every source layer whatever --numerics said,
    and the summary did not count them."""
    source = _moe_source(tmp_path / "src")
    assert main(["convert", str(source), "-t", "sm100", "--tp", "2", "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    counts = {}
    for numerics in ("sample", "all"):
        code, text, report = _verify(tmp_path / "out", capsys, "--numerics", numerics)
        assert code == 0, text
        reassembled = [c for c in report["layers"] if c["name"].startswith("reassembled/")
                       and not c["name"].endswith(".experts")]
        ran = [c for c in reassembled if c["max_rel_error"] is not None]
        counts[numerics] = len(ran)
        assert report["numerics_layers"] == sum(c["max_rel_error"] is not None for c in report["layers"])
        assert f"numerics on {report['numerics_layers']} of {len(report['layers'])} layers" in text
    assert counts["all"] == 8 and counts["sample"] < 8, counts  # 2 layers x q, k, v, o_proj


@pytest.mark.parametrize("field,value,message", [
    ("global_scale", 2.0, "the manifest's global_scale"),
    ("top_k", 3, "top_k 3 is not config.json's num_experts_per_tok 2"),
    ("backend", "FLASHINFER_CUTLASS", "backend FLASHINFER_CUTLASS"),
])
def test_a_manifest_field_inspect_shows_is_checked_against_the_tensors(fused, field, value, message, tmp_path,
                                                                         capsys):
    """Regression (issue 38): a layer's global_scale doubled in the manifest (inspect then showed it) passed verify."""
    path = tmp_path / "out"
    shutil.copytree(fused["sm100"], path)
    manifest = json.loads((path / "manifest.json").read_text())
    if field == "global_scale":
        record = manifest["layers"]["model.layers.0.self_attn.qkv_proj"]
        record[field] *= value
    else:
        manifest["moe"][MODULE0][field] = value
    (path / "manifest.json").write_text(json.dumps(manifest))
    code, text, _ = _verify(path, capsys)
    assert code == 1 and message in text, text



# SGLang's MoE backend families (issue 37): (checkpoint format, W4A4 checkpoint, target) -> its layout
SGLANG_FAMILIES = {("modelopt", True, "sm100"): "sglang-modelopt-moe-trtllm-v1",
                   ("modelopt", True, "sm120"): "sglang-modelopt-moe-cutlass-v1",
                   ("compressed-tensors", True, "sm100"): "sglang-ct-moe-cutlass-v1",
                   ("modelopt", True, "sm90"): "sglang-modelopt-moe-marlin-v1",
                   ("compressed-tensors", False, "sm100"): "sglang-ct-moe-marlin-v1"}
SGLANG_JOBS = [(*family, tp) for family in SGLANG_FAMILIES for tp in (1, 2)]


def _sglang_job_id(job) -> str:
    fmt, w4a4, target, tp = job
    return f"{'ct' if fmt != 'modelopt' else fmt}-{'w4a4' if w4a4 else 'w4a16'}-{target}-tp{tp}"


@pytest.fixture(scope="module")
def sglang_sources(tmp_path_factory) -> dict:
    """Qwen3-MoE checkpoints every SGLang MoE backend takes (hidden 128, 2I a multiple of 128, I / 2 of 64), each
    expert's gate and up input scales equal as the producers calibrate them (SGLang refuses others)."""
    root = tmp_path_factory.mktemp("sglang-moe")
    return {(fmt, w4a4): write_qwen_moe(root / f"{fmt}-{w4a4}", fmt, hidden=128, experts=4, intermediate=128,
                                        generator=torch.Generator().manual_seed(12), w4a4=w4a4,
                                        shared_input_scales=True)
            for fmt in ("modelopt", "compressed-tensors") for w4a4 in (True, False)}


def _sglang_bundle(sglang_sources, job, out):
    """``convert --engine sglang`` of ``job``'s checkpoint; the folder holding rank 0's bundle (the whole bundle at
    TP 1)."""
    fmt, w4a4, target, tp = job
    args = ["convert", str(sglang_sources[fmt, w4a4]), "-t", target, "--engine", "sglang", "-o", str(out)]
    assert main(args + (["--tp", str(tp)] if tp > 1 else [])) == 0
    rank0 = out / "rank-0" if tp > 1 else out
    assert open_bundle(rank0).manifest.moe[LAYER0].layout_id == SGLANG_FAMILIES[job[:3]]
    return rank0


@pytest.mark.parametrize("job", SGLANG_JOBS, ids=_sglang_job_id)
def test_sglang_moe_numerics_run_pass_and_catch_a_corrupted_expert(sglang_sources, job, tmp_path, monkeypatch,
                                                                   capsys):
    """Issue 37: verify computed no numerics for an SGLang MoE bundle (exactness only). Now its sampled experts are
    computed as SGLang's kernel reads them (FP4 x FP4 with its quantizer scale and alphas, or FP4 Marlin's
    multiplier) and pass within vLLM's bound; expert 0 (always sampled) with its w13 codes flipped, its digests
    rewritten to match, fails numerics naming its gate and up projections, also with exactness blinded (as a layout
    inverse wrong the same way as the layout would be)."""
    out = tmp_path / "out"
    rank0 = _sglang_bundle(sglang_sources, job, out)
    capsys.readouterr()
    report = verify_output(out)
    moe = [c for c in report.layers if c.numerics_experts is not None]
    assert report.passed and moe and all(c.numerics_experts >= 1 for c in moe), report.summary()
    weight_only = open_bundle(rank0).moe_layout.WEIGHT_ONLY
    bound, kind = (EXPERT_REL_ERROR, "weight-only") if weight_only else (EXPERT_W4A4_REL_ERROR, "FP4 x FP4")
    assert report.numerics_experts == sum(c.numerics_experts for c in moe) and max(
        c.max_rel_error for c in moe) <= bound, [(c.name, c.max_rel_error) for c in moe]
    codes = open_bundle(rank0).moe_tensors(LAYER0)["w13_weight"].clone()
    codes[0].view(torch.uint8).reshape(-1)[:] ^= 0x5A
    rewrite_consistently(rank0, f"{LAYER0}.w13_weight", codes)
    for blind in (False, True):
        if blind:
            monkeypatch.setattr("repack.verify.engine_expert_findings", lambda *args: ExpertFindings([], set()))
        report = verify_output(out)
        numerics = report.summary().get("numerics", [])
        assert not report.passed and (bool(report.summary().get("exactness")) != blind), report.summary()
        for proj in ("gate_proj", "up_proj"):
            assert any(f"{LAYER0}.0.{proj}: relative error " in m and f"of the {kind} expert exceeds {bound:g}" in m
                       for m in numerics), numerics


@pytest.mark.parametrize("target,scalar,proj", [("sm100", "g1_scale_c", "up_proj"),
                                                ("sm120", "g1_alphas", "gate_proj")], ids=["trtllm", "cutlass"])
def test_an_sglang_expert_scalar_other_than_the_sources_joins_the_numerics_sample(sglang_sources, target, scalar,
                                                                                  proj, tmp_path):
    """Issue 37: an expert's held scalar changed (digests rewritten): exactness names the tensor, and that expert
    (not in the default sample: expert 2 of 4, seeded) is computed too and fails by the factor, as vLLM's odd experts
    are; TRT-LLM-gen's up half is read through g1_scale_c, which folds up's alpha with GEMM2's input scale."""
    out = tmp_path / "out"
    _sglang_bundle(sglang_sources, ("modelopt", True, target, 1), out)
    held = open_bundle(out).moe_tensors(LAYER0)[scalar].clone()
    held[2] *= 1.5
    rewrite_consistently(out, f"{LAYER0}.{scalar}", held)
    report = verify_output(out, seed=0)  # the seed's sample: experts 0 and 1
    summary = report.summary()
    assert [c.numerics_experts for c in report.layers if c.name == LAYER0] == [3], summary
    assert f"{LAYER0}: {scalar} is not what SGLang computes from the source's scales" in summary["exactness"], summary
    assert any(m.startswith(f"{LAYER0}.2.{proj}: relative error 0.5 ") for m in summary["numerics"]), summary


def test_verify_help_has_no_rst_markup(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["verify", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--tp output" in text and "``" not in text
