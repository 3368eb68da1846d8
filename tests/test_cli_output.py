"""What the CLI prints, where nobody watches a terminal: pipes, files, and the words of its messages (issue 38's
frictions: tables cut at 80 columns when piped, ``| head`` ending in a silent exit 1, "1 transform matrices",
``inspect`` counting a W4A4 source's activation scales as passthrough tensors)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from repack.cli import PIPE_CLOSED_EXIT, commands, main
from repack.targets import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
PRODUCERS = ROOT / "tests" / "data" / "producers"


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- pipes and files ------------------------------------------------------------------------------------------------


def test_tables_are_not_cut_when_stdout_is_not_a_terminal(capsys, monkeypatch):
    """Regression (issue 38): ``targets | grep`` read "flashin…": rich cut tables at 80 columns off a terminal."""
    monkeypatch.delenv("COLUMNS", raising=False)
    code, out, _ = _cli(["targets"], capsys)
    assert code == 0 and "…" not in out
    for family in FAMILIES:
        row = next(line for line in out.splitlines() if f" {family.name} " in line)
        assert family.backend in row and family.layout_id in row and family.description in row, row


def test_columns_still_sets_the_width(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    code, out, _ = _cli(["targets"], capsys)
    assert code == 0 and max(map(len, out.splitlines())) <= 60


@pytest.mark.parametrize("argv", [["targets"], ["targets", "--json"], ["--help"], ["convert", "--help"],
                                  ["--version"], ["inspect", "--sample"], ["inspect", "--sample", "--json"]],
                         ids=" ".join)
def test_a_reader_that_goes_away_ends_the_command_quietly(argv):
    """Regression (issue 38): ``nvfp4-repack targets | head -1`` ended in a silent exit 1 (rich's and Typer's answer
    to a closed pipe). Now nothing on stderr and exit code 141, what a shell reports for a tool SIGPIPE ended.
    The pipe's read end is closed before the child writes, so the child always meets it closed."""
    child = subprocess.Popen([sys.executable, "-m", "repack.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    child.stdout.close()
    err = child.stderr.read()
    assert child.wait(timeout=120) == PIPE_CLOSED_EXIT and err == b"", err[-2000:]


def test_head_in_a_shell_pipeline(tmp_path):
    """``| head -1`` as typed: the first line, no word on stderr, a status of 0 (all written) or 141 (pipe closed)."""
    script = (f"PYTHONPATH={ROOT} {sys.executable} -m repack.cli targets | head -1; "
              'echo "status ${PIPESTATUS[0]} ${PIPESTATUS[1]}" >&2')
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.stdout.strip() == "targets"
    status = run.stderr.strip().splitlines()
    assert len(status) == 1 and status[0] in ("status 0 0", f"status {PIPE_CLOSED_EXIT} 0"), run.stderr


def test_targets_in_a_narrow_terminal_cuts_nothing_and_names_the_kernels(capsys, monkeypatch):
    """Audit (issues 36.6, 38): at 100 columns the table cut every id ("sm100-cute…", "moe-marl…") and no kernel class
    was named; a terminal narrower than the table gets one block per target, each value whole."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = _cli(["targets"], capsys)
    assert code == 0 and "…" not in out and max(map(len, out.splitlines())) <= 100
    text = " ".join(out.split())
    for family in FAMILIES:
        assert f"{family.name}: {family.description};" in text and f"W4A16 layout: {family.layout_id}" in text
        assert f"{family.name} vLLM kernels: W4A16 {', '.join(family.kernels)}" in text
    assert "sm80 vLLM kernels: W4A16 MarlinNvFp4LinearKernel; W4A4 MarlinNvFp4LinearKernel" in text
    assert "takes a GPU name" in text


@pytest.mark.parametrize("gpu,family", [
    ("RTX 4090", "sm80"), ("NVIDIA GeForce RTX 3090 Ti", "sm80"), ("A100", "sm80"), ("NVIDIA A100-SXM4-80GB", "sm80"),
    ("L40S", "sm80"), ("a10g", "sm80"), ("RTX A6000", "sm80"), ("RTX 6000 Ada Generation", "sm80"), ("T4", "sm75"),
    ("Tesla T4", "sm75"), ("RTX 2080 Ti", "sm75"), ("Quadro RTX 6000", "sm75"), ("H100", "sm90"), ("NVIDIA H200 NVL", "sm90"), ("B200", "sm100"),
    ("GB300", "sm100"), ("RTX 5090", "sm120"), ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "sm120"),
    ("sm86", "sm80"),
])
def test_a_gpu_name_is_a_target(gpu, family):
    """Audit (issue 36.1): ``--target "RTX 4090"``, ``H100``, ``B200`` (the names ``targets`` lists as the families'
    GPUs, and nvidia-smi's) were unknown targets."""
    from repack.targets import resolve_family

    assert resolve_family(gpu).name == family


@pytest.mark.parametrize("gpu,says", [("RTX 6000", "names GPUs of several families (Quadro RTX 6000 is sm75"),
                                      ("RTX 5000", "RTX 5000 Ada sm80 (sm89)"), ("NVIDIA RTX 6000", "give the family"),
                                      ("rtx4000", "RTX PRO 4000 sm120"), ("V100", "unknown target 'V100'")])
def test_a_gpu_name_of_two_families_or_none_is_refused(gpu, says, tmp_path, capsys, monkeypatch):
    """"RTX 6000" is a Turing Quadro, an Ada and (PRO) a Blackwell card: the user picks; V100 (sm70) has no FP4
    Marlin. One line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(["convert", "--sample", "-t", gpu], capsys)
    assert code == 2 and err.count("\n") == 1 and says in err, err
    assert not list(tmp_path.iterdir())


def test_a_gpu_name_converts_into_a_folder_named_after_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(["convert", "--sample", "-t", "RTX 4090"], capsys)
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama-nvfp4-rtx-4090"]
    assert json.loads((tmp_path / "tiny-llama-nvfp4-rtx-4090" / "manifest.json").read_text())["target"] == "sm80"


@pytest.mark.parametrize("target,gpus,flashinfer", [("sm80", "A100, A30, A10, A40, L4, L40S", False),
                                                     ("sm100", "B200, GB200, B300", True)])
def test_inspect_names_a_bundles_gpus_and_no_empty_flashinfer_line(tmp_path, capsys, monkeypatch, target, gpus,
                                                                     flashinfer):
    """Audit (issue 36.6): ``inspect`` of a Marlin bundle named no GPU and printed "FlashInfer versions checked: "
    with nothing after it (Marlin runs no FlashInfer code at load)."""
    monkeypatch.setenv("COLUMNS", "200")
    assert _cli(["convert", "--sample", "-t", target, "-o", tmp_path / "b"], capsys)[0] == 0
    code, out, _ = _cli(["inspect", tmp_path / "b"], capsys)
    assert code == 0 and f"target {target} (" in out and gpus in out.splitlines()[0], out
    assert ("FlashInfer versions checked: 0.7" in out) == flashinfer and "checked: \n" not in out, out


def test_marlin_on_hopper_points_to_the_sm80_bundle(tmp_path, capsys, monkeypatch):
    """Audit (issue 36): ``-t sm90 --linear-backend marlin`` (vLLM's Marlin on an H100, as the GPU tests serve it) said
    only "--linear-backend auto"; the sm80 bundle is the one to convert, as the sm90 MoE refusal says."""
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(["convert", "--sample", "-t", "H100", "--linear-backend", "marlin", "-o", "b"], capsys)
    assert code == 1 and err.count("\n") == 1 and "; for vLLM's Marlin there, convert with -t sm80" in err, err
    assert not list(tmp_path.iterdir())


# --- words ------------------------------------------------------------------------------------------------------------


def test_one_of_a_thing_is_singular(tmp_path, capsys):
    """Regression (issue 38): "1 transform matrices"."""
    out = tmp_path / "b"
    assert _cli(["convert", PRODUCERS / "ct_quip_v_had16_nvfp4a16", "-t", "sm100", "-o", out], capsys)[0] == 0
    code, text, _ = _cli(["verify", out], capsys)
    text = " ".join(text.split())
    assert code == 0 and ", 1 transform matrix, " in text and "14 layers, 7 passthrough tensors" in text, text
    code, text, _ = _cli(["inspect", out], capsys)
    assert code == 0 and "1 online-transform matrix, each stored once" in " ".join(text.split())


@pytest.mark.parametrize("name,scales", [("ct_nvfp4", 14), ("modelopt_nvfp4", 14), ("ct_nvfp4a16", 0)])
def test_inspect_counts_activation_scales_apart_from_passthrough_tensors(tmp_path, capsys, name, scales):
    """Regression (issue 38): ``inspect`` of a W4A4 source counted 21 passthrough tensors where convert writes 7:
    its 14 activation input scales, which the W4A4 layouts fold into the layers, are counted on their own."""
    code, out, _ = _cli(["inspect", PRODUCERS / name, "--json"], capsys)
    info = json.loads(out)
    assert code == 0 and (info["passthrough_tensors"], info["activation_scales"]) == (7, scales)
    code, out, _ = _cli(["convert", PRODUCERS / name, "-t", "sm100", "-o", tmp_path / "b", "--json"], capsys)
    assert code == 0 and json.loads(out)[0]["passthrough"] == info["passthrough_tensors"]
    code, out, _ = _cli(["inspect", PRODUCERS / name], capsys)
    first = " ".join(out.split())
    expected = "14 quantized layers, 7 passthrough tensors (copied as they are)"
    assert expected + (f", {scales} activation input scales (the W4A4 layouts fold them in" if scales else " ") in first


@pytest.mark.parametrize("command", ["convert", "inspect", "targets", "verify"])
def test_help_prose_flows_at_the_terminals_width(command, capsys, monkeypatch):
    """Regression (review): ``verify --help`` broke sentences where its docstring's lines end. At two widths, each prose
    paragraph of the command's docstring is rendered as a greedy wrap of its words at that width (no line ends before
    the next word would have fitted); examples (a paragraph with indented lines) keep their lines."""
    doc = [p.splitlines() for p in inspect.getdoc(getattr(commands, command)).split("\n\n")]
    for width in (100, 160):
        monkeypatch.setenv("COLUMNS", str(width))
        code, out, _ = _cli([command, "--help"], capsys)
        lines = [line.strip() for line in out.split("Usage:", 1)[1].split("\n╭", 1)[0].splitlines()[1:]]
        rendered = [p.strip().splitlines() for p in "\n".join(lines).split("\n\n") if p.strip()]
        assert code == 0 and len(rendered) == len(doc), out
        for held, written in zip(rendered, doc):
            if any(line[:1].isspace() for line in written):  # examples: their lines where they fit
                fits = max(map(len, written)) < width - 2
                assert (held == [line.strip() for line in written] if fits else
                        " ".join(held).split() == " ".join(written).split()), (width, out)
            else:
                assert held == textwrap.wrap(" ".join(" ".join(written).split()), width - 2, break_long_words=False,
                                             break_on_hyphens=False), (width, out)


# --- where the output goes --------------------------------------------------------------------------------------------


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("targets", [["sm100"], ["all"]])
def test_an_empty_output_path_is_bad_usage(make_model, tmp_path, capsys, monkeypatch, targets):
    """Regression (issue 38): ``-o ""`` meant the current folder."""
    model = make_model(shapes=[(16, 32)])
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    code, _, err = _cli(["convert", model.path, *(a for t in targets for a in ("-t", t)), "-o", ""], capsys)
    assert code == 2 and err.count("\n") == 1 and "'--out': an empty path; name the output folder" in err, err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("targets", [["sm100"], ["all"]])
@pytest.mark.parametrize("where", ["bundle", "sub/bundle", "."])
def test_an_output_inside_the_source_is_bad_usage(make_model, tmp_path, capsys, targets, where):
    """Regression (issue 38): ``-o SRC/bundle`` wrote the bundle inside its own source without a word."""
    from repack.convert import convert
    from repack.errors import RepackError

    model = make_model(shapes=[(16, 32)])
    before = _tree(model.path)
    out = model.path / where
    code, _, err = _cli(["convert", model.path, *(a for t in targets for a in ("-t", t)), "-o", out], capsys)
    message = "would replace the input" if where == "." else "the output folder is inside the input"
    assert code == 2 and err.count("\n") == 1 and message in err, err
    with pytest.raises(RepackError, match=message):  # the library refuses it too (a Hub snapshot's folder)
        convert(model.path, targets[0], out)
    assert _tree(model.path) == before


def test_an_interrupted_several_target_convert_leaves_no_visible_output(make_model, tmp_path, capsys, monkeypatch):
    """Regression (issue 38): Ctrl-C during ``-t all`` left a visible, seemingly empty OUT (its targets were staged
    inside it). The output of several targets is staged whole as a hidden ``.OUT.partial-*`` beside it and renamed
    into place at the end, as one target's bundle is; ``--resume`` continues from it."""
    import repack.convert

    model = make_model(shapes=[(64, 128)] * 6)
    out = tmp_path / "out"
    argv = ["convert", model.path, "-t", "all", "-o", out, "--max-shard-size", "20KB"]
    real, seen = repack.convert._Writing.take_layer, []

    def take(self, layer, weight):  # Ctrl-C once a few layers went to the writers
        if len(seen) == 9:
            raise KeyboardInterrupt
        seen.append(layer.prefix)
        real(self, layer, weight)

    with monkeypatch.context() as patch:
        patch.setattr(repack.convert._Writing, "take_layer", take)
        code, _, err = _cli(argv, capsys)
    assert code == 130 and err.count("\n") == 1 and "--resume" in err, err
    assert not out.exists()
    [staged] = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert staged.startswith(".out.partial-")
    code, stdout, err = _cli([*argv, "--resume"], capsys)
    assert code == 0 and err == "", err
    assert "kept from the interrupted run" in " ".join(stdout.split())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert sorted(p.name for p in out.iterdir()) == ["nvfp4-repack-output.json", *sorted(f.name for f in FAMILIES)]
    assert _cli(["verify", out], capsys)[0] == 0
