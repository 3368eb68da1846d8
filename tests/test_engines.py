"""Engine versions as data (repack/targets/engines.py): the manifest's ``engines``, ``convert --vllm``, the refusal
of what a version cannot serve, and ``inspect`` / ``targets`` showing them. Whether each version's state really is the
bundle's is tests/test_vllm_conformance.py's work (one oracle per version)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.convert import convert, engine_target
from repack.errors import RepackError
from repack.formats import read_source
from repack.targets import TARGETS, engines, resolve_target
from repack.targets.moe import moe_layout

from .conftest import PRODUCERS

ROTATED_W4A4 = "ct_quip_vu_had32_nvfp4"  # W4A4, Hadamard input rotations of block 32: QuTLASS in 0.33, Humming in 0.34
BOTH = {"vllm": ["0.33", "0.34"]}


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_layout_written_is_held_by_every_vllm_version():
    """Every layout convert can write (dense per scheme, MoE) is a row's; a layout missing from the table would make
    every bundle of it unservable, silently."""
    written = {t.layout_id for target in TARGETS for t in target.layouts if t.engine == "vllm"}
    for target in TARGETS:
        try:
            written.add(moe_layout(target.name).LAYOUT_ID)
        except RepackError:  # sm90: no MoE layout
            pass
    for version in engines.engine_versions("vllm"):
        assert written <= set(version.layouts), (version.label, written - set(version.layouts))


def test_every_sglang_layout_written_is_held_by_its_sglang_version():
    sglang = [t for target in TARGETS for t in target.layouts if t.engine == "sglang"]
    written = {t.layout_id for t in sglang}
    w4a4 = [t for t in sglang if t.layout_id in engines.SGLANG_LAYOUTS.values()]
    moe = {moe_layout(t).LAYOUT_ID for t in w4a4}
    marlin = {moe_layout(t).LAYOUT_ID for t in sglang if t.name in engines.SGLANG_MARLIN_FAMILIES}  # FP4 Marlin MoE
    assert written == {*engines.SGLANG_LAYOUTS.values(), *engines.SGLANG_MARLIN_LAYOUTS.values(),
                       engines.SGLANG_BF16_FP4_LAYOUT}
    assert moe == set(engines.SGLANG_MOE_LAYOUTS.values())
    assert marlin == set(engines.SGLANG_MARLIN_MOE_LAYOUTS.values())
    moe |= marlin
    assert written | moe == set(engines.SGLANG_0523.layouts)


@pytest.mark.parametrize("fixture,options", [
    ("ct_nvfp4a16", {}), ("modelopt_nvfp4", {"fuse": True}), (ROTATED_W4A4, {"target": "sm90"}),
    # random-hadamard input rotations: QuTLASS in 0.33, vLLM 0.34's transform method around the W4A4 kernel (no
    # Humming), which reads the W4A4 layout as it is
    ("ct_quip_vu_rhad16_nvfp4", {"fuse": True})])
def test_a_bundle_both_versions_hold_lists_both(fixture, options, tmp_path):
    """sm90 (Hopper): vLLM 0.34 has no Humming Hadamard route there (it needs capability 10.0)."""
    options = {"target": "sm100", **options}
    for vllm in (None, "0.33", "0.34"):
        out = tmp_path / str(vllm)
        convert(PRODUCERS / fixture, options["target"], out, vllm=vllm, **{k: v for k, v in options.items() if k != "target"})
        manifest = open_bundle(out).manifest
        assert (manifest.bundle_format_version, manifest.engines) == (6, BOTH)


def test_rotated_w4a4_is_refused_for_034_in_one_line_naming_033(tmp_path, capsys):
    """vLLM 0.34 serves its Hadamard-rotated layers through Humming's Hadamard kernel (its own layout): refused by default (the newest) and
    for --vllm 0.34, nothing written; --vllm 0.33 writes the QuTLASS bundle, for 0.33 only."""
    for flags in ([], ["--vllm", "0.34"], ["--weight-only"]):  # --weight-only too: vLLM follows the checkpoint
        code, _, err = cli(capsys, "convert", PRODUCERS / ROTATED_W4A4, "-t", "sm100", "--fuse", "-o", tmp_path / "b",
                           *flags)
        assert code == 1 and err.count("\n") == 1 and "--vllm 0.33" in err and "Humming" in err, err
        assert not (tmp_path / "b").exists()
    convert(PRODUCERS / ROTATED_W4A4, "sm100", tmp_path / "b", fuse=True, vllm="0.33")
    bundle = open_bundle(tmp_path / "b")
    assert bundle.manifest.engines == {"vllm": ["0.33"]}
    assert any(bundle.runs_qutlass(p) for p in bundle.manifest.layers)
    code, text, _ = cli(capsys, "inspect", tmp_path / "b")
    assert code == 0 and "serves: vllm 0.33\n" in text


@pytest.mark.parametrize("fixture,flags", [("ct_quip_v_had16_nvfp4a16", []), ("ct_quip_v_rhad32_nvfp4a16", []),
                                           (ROTATED_W4A4, ["--weight-only"]), ("ct_quip_vu_rhad16_nvfp4", ["--weight-only"])])
def test_rotated_layers_marlin_serves_on_sm120_are_refused_for_033(fixture, flags, tmp_path, capsys):
    """sm120's weight-only bundles are Marlin's: vLLM 0.33 gives a layer with block-16..128 input Hadamards QuTLASS's
    method there, which refuses Marlin's kernel (its own load of the source fails: tests/test_vllm_marlin_conformance.py),
    so --vllm 0.33 is refused in one line naming 0.34; 0.34 (the default) serves it with its transform method around
    Marlin (--linear-backend marlin keeps Humming out, so the W4A4 one is not refused for 0.34 here)."""
    code, _, err = cli(capsys, "convert", PRODUCERS / fixture, "-t", "sm120", "--fuse", "-o", tmp_path / "b",
                       "--vllm", "0.33", *flags)
    assert code == 1 and err.count("\n") == 1 and "--vllm 0.34" in err and "QuTLASS" in err, err
    assert not (tmp_path / "b").exists()
    code, _, err = cli(capsys, "convert", PRODUCERS / fixture, "-t", "sm120", "--fuse", "-o", tmp_path / "b", *flags)
    assert code == 0, err
    assert open_bundle(tmp_path / "b").manifest.engines == {"vllm": ["0.34"]}
    assert open_bundle(tmp_path / "b").manifest.layout_id.startswith("marlin-v1")
    convert(PRODUCERS / "ct_spinquant_r1r2r4_rhad_nvfp4a16", "sm120", tmp_path / "whole", fuse=True)  # whole-K R4
    assert open_bundle(tmp_path / "whole").manifest.engines == BOTH  # 0.33: its transform method, no QuTLASS


@pytest.mark.parametrize("version", ["0.32", "0.35", "abc", "v", "vv0.34", "v0.35"])
def test_an_unsupported_version_is_a_usage_error(version, tmp_path, capsys):
    code, _, err = cli(capsys, "convert", "--sample", "-t", "sm100", "-o", tmp_path / "b", "--vllm", version)
    assert code == 2 and err.count("\n") == 1 and "supported versions: 0.33, 0.34" in err, err
    with pytest.raises(RepackError, match="supported versions: 0.33, 0.34"):
        convert(PRODUCERS / "ct_nvfp4a16", "sm100", tmp_path / "b", vllm=version)


def test_a_version_written_as_a_tag_converts(tmp_path, capsys):
    """``--vllm v0.34`` (vLLM's tags write the leading v) was refused as unsupported (review)."""
    code, _, err = cli(capsys, "convert", "--sample", "-t", "sm100", "-o", tmp_path / "b", "--vllm", "V0.34")
    assert code == 0, err


def test_a_release_names_its_series():
    assert engines.resolve_version("vllm", "0.34.0") is engines.VLLM_034
    for tag in ("v0.34", "V0.34", " v0.34.0"):  # as vLLM's release tags write it
        assert engines.resolve_version("vllm", tag) is engines.VLLM_034, tag
    assert engines.resolve_version("vllm", "v0.33") is engines.VLLM_033
    assert engines.resolve_version("vllm", None) is engines.newest("vllm") is engines.VLLM_034
    assert engines.running_row("vllm", "0.34.1.dev3+g1234") is engines.VLLM_034
    assert engines.running_row("vllm", "0.35.0") is None
    assert engines.running_row("sglang", "0.5.23.post1") is engines.SGLANG_0523  # SGLang's rows name a release
    assert engines.running_row("sglang", "0.5.2") is engines.running_row("sglang", "0.5.24") is None


@pytest.mark.parametrize("engine,listed,running,says", [
    ("vllm", ["0.33"], "0.34.0", "b: the bundle is for vLLM 0.33, but vLLM 0.34.0 is running; serve it with vLLM 0.33, "
                                 "or re-convert it with --vllm 0.34"),
    ("vllm", ["0.33", "0.34"], "0.35.1", "b: the bundle is for vLLM 0.33, 0.34, but vLLM 0.35.1 is running, which "
                                         "nvfp4-repack does not support (vLLM 0.33, 0.34); serve it with vLLM 0.33 or "
                                         "0.34"),
    ("sglang", ["0.5.23"], "0.5.24", "b: the bundle is for SGLang 0.5.23, but SGLang 0.5.24 is running, which "
                                     "nvfp4-repack does not support (SGLang 0.5.23); serve it with SGLang 0.5.23"),
])
def test_a_plugin_refuses_a_bundle_of_another_version_in_one_line(engine, listed, running, says):
    """The vLLM plugin's refusal (tests/vllm/plugin_checks.py checks it inside vLLM), and the SGLang plugin's, which
    served a bundle under any SGLang (audit)."""
    with pytest.raises(RepackError) as refused:
        engines.check_running(engine, listed, running, "b")
    assert str(refused.value) == says
    engines.check_running(engine, listed, listed[-1] + ".0", "b")  # a listed release is served


def test_bundles_before_format_6_are_vllm_033s(tmp_path):
    """A format 5 manifest has no ``engines``: it was checked against vLLM 0.33 only."""
    convert(PRODUCERS / "ct_nvfp4a16", "sm100", tmp_path / "b")
    path = tmp_path / "b" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["engines"]
    manifest["bundle_format_version"] = 5
    path.write_text(json.dumps(manifest))
    assert open_bundle(tmp_path / "b").manifest.engines == {"vllm": ["0.33"]}
    manifest["bundle_format_version"] = 6
    path.write_text(json.dumps(manifest))
    with pytest.raises(RepackError, match="missing 'engines'"):
        open_bundle(tmp_path / "b")


def test_inspect_and_targets_show_the_versions(tmp_path, capsys):
    convert(PRODUCERS / "ct_nvfp4a16", "sm100", tmp_path / "b")
    code, text, _ = cli(capsys, "inspect", tmp_path / "b")
    assert code == 0 and "serves: vllm 0.33, 0.34" in text
    assert json.loads(cli(capsys, "inspect", tmp_path / "b", "--json")[1])[0]["engines"] == BOTH
    rows = json.loads(cli(capsys, "targets", "--json")[1])
    assert all(layout["engines"] == BOTH for row in rows for layout in row["layouts"].values())
    code, text, _ = cli(capsys, "targets")
    assert code == 0 and "refuses hadamard-w4a4" in " ".join(text.split())


def test_targets_names_sglang_where_it_has_layouts(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # the table (a narrower terminal gets one block per target)
    code, out, _ = cli(capsys, "targets")
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    assert code == 0 and {"sm100", "sm120", "sm90"} <= set(rows)
    assert {name for name, line in rows.items() if "sglang 0.5.23" in line} == {"sm100", "sm120", "sm90", "sm80"}


def test_inspect_names_the_engine_whose_kernels_a_bundle_records(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    convert(PRODUCERS / "modelopt_w4a16_nvfp4", "sm90", tmp_path / "out", engine="sglang")
    code, out, _ = cli(capsys, "inspect", tmp_path / "out")
    assert code == 0 and "scheme W4A16; SGLang kernels: marlin" in " ".join(out.split())


def test_several_targets_for_sglang_are_refused_naming_the_engine(tmp_path):
    """Audit: ``convert(..., ["sm100", "sm120"], engine="sglang")`` said "--fuse/--tp take one target", flags the user
    never gave (an SGLang bundle is fused as SGLang holds it)."""
    with pytest.raises(RepackError, match=r"^--engine sglang \(its bundles are fused, as the engine holds them\) "
                                          "takes one target family; convert each target in a run of its own$"):
        convert(PRODUCERS / "ct_nvfp4", ["sm100", "sm120"], tmp_path / "out", engine="sglang")
    assert not list(tmp_path.iterdir())


def test_engine_is_case_insensitive_as_target_is(tmp_path, capsys):
    """Audit: ``-t SM100`` worked, ``--engine SGLang`` was a usage error."""
    code, _, err = cli(capsys, "convert", "--sample", "-t", "SM100", "--engine", "SGLang", "-o", tmp_path / "b")
    assert code == 0, err
    assert open_bundle(tmp_path / "b").manifest.engines == {"sglang": ["0.5.23"]}


def test_inspect_names_sglangs_moe_backend_not_vllms(tmp_path, capsys, monkeypatch):
    """Audit: an SGLang MoE bundle's table read "(vLLM backend auto, CompressedTensorsW4A4Nvfp4MoE)"."""
    monkeypatch.setenv("COLUMNS", "300")
    convert(PRODUCERS / "ct_moe_nvfp4", "sm120", tmp_path / "out", engine="sglang")
    code, out, _ = cli(capsys, "inspect", tmp_path / "out")
    text = " ".join(out.split())
    assert code == 0 and "(SGLang backend auto, CompressedTensorsW4A4Nvfp4MoE)" in text and "vLLM" not in text, text


def test_inspect_of_a_source_says_which_vllm_versions_each_target_serves(capsys, monkeypatch):
    """Audit (issue 35.1): ``inspect`` of a rotated W4A4 source said "possible targets: sm100, ..." and the default
    convert then refused sm100 (vLLM 0.34 runs Humming's kernel there); now it names the version per target."""
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _ = cli(capsys, "inspect", PRODUCERS / ROTATED_W4A4)
    assert code == 0 and ("possible targets: sm100 (vLLM 0.33 only: convert --vllm 0.33), sm120 (vLLM 0.33 only: "
                          "convert --vllm 0.33), sm90, sm80, sm75") in out, out
    info = json.loads(cli(capsys, "inspect", PRODUCERS / "ct_quip_v_had16_nvfp4a16", "--json")[1])
    assert info["vllm_versions"] == {"sm100": ["0.33", "0.34"], "sm120": ["0.34"], "sm90": ["0.33", "0.34"],
                                     "sm80": ["0.33", "0.34"], "sm75": ["0.33", "0.34"]}
    assert "sm120 (vLLM 0.34 only), sm90" in cli(capsys, "inspect", PRODUCERS / "ct_quip_v_had16_nvfp4a16")[1]
    assert json.loads(cli(capsys, "inspect", PRODUCERS / "modelopt_moe_nvfp4", "--json")[1])["vllm_versions"] == {
        name: ["0.33", "0.34"] for name in ("sm100", "sm120", "sm80", "sm75")}


def test_convert_reads_what_an_engine_refuses_from_its_row():
    """convert picks an engine's layout and refusals by its row, not its name (review: ``_convert`` branched on
    ``engine.engine == "vllm"``): vLLM's row with SGLang's transforms refusal refuses a QuIP checkpoint in those
    words; as it is, it writes the W4A4 layout its auto holds."""
    source, sm100 = read_source(PRODUCERS / "ct_quip_vu_had32_nvfp4"), resolve_target("sm100")
    refusing = dataclasses.replace(engines.VLLM_033, transforms=engines.SGLANG_0523.transforms)
    with pytest.raises(RepackError, match="^--engine sglang: online transforms are not written for SGLang"):
        engine_target(sm100, refusing, source)
    assert engine_target(sm100, engines.VLLM_033, source).layout_id == "w4a4-cutlass-v1"
