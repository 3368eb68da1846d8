"""The README's commands work as written, CI runs the README's test command, and every page it links exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from repack.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES_WITH_SAMPLE_COMMANDS = ["README.md", "docs/fusion.md", "docs/serving.md", "docs/usage.md"]


def _command_lines(page: str) -> list[str]:
    """The shell lines of ``page``'s indented code blocks (comments after ``#`` dropped)."""
    lines = (ROOT / page).read_text().splitlines()
    return [re.sub(r"\s+#.*$", "", line.strip()) for line in lines if line.startswith("    ") and
            line.strip().startswith(("nvfp4-repack ", "pip install ", "vllm serve "))]


def test_ci_runs_the_readme_test_command():
    readme = _command_lines("README.md")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert len(ci) == 1 and ci[0] in readme


@pytest.mark.parametrize("page", PAGES_WITH_SAMPLE_COMMANDS)
def test_sample_commands_run_as_written(page, tmp_path, monkeypatch, capsys):
    """Each ``nvfp4-repack`` step of every line that works on the built-in sample, in order, in one folder (a
    line's later steps read what its first wrote, as `&&` runs them)."""
    monkeypatch.chdir(tmp_path)
    lines = [line for line in _command_lines(page) if "--sample" in line]
    assert lines, f"{page} shows no command on the built-in sample"
    for line in lines:
        for step in line.split("&&"):
            argv = shlex.split(step)
            if argv[0] == "nvfp4-repack":
                assert main(argv[1:]) == 0, f"{page}: {step.strip()}: {capsys.readouterr().err[-2000:]}"


def test_readme_serving_command_names_the_output_it_converted():
    """`vllm serve OUT` in the README serves the folder the line before it wrote, with its TP size."""
    lines = _command_lines("README.md")
    serve = next(shlex.split(line) for line in lines if line.startswith("vllm serve"))
    convert = next(shlex.split(line.split("&&")[0]) for line in lines if "--tp" in line and "--sample" in line)
    assert serve[2] == convert[convert.index("-o") + 1]
    assert serve[serve.index("--tensor-parallel-size") + 1] == convert[convert.index("--tp") + 1]
    assert serve[serve.index("--load-format") + 1] == "nvfp4_repack"


def test_every_linked_page_exists():
    for page in ["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]:
        text = (ROOT / page).read_text()
        for link in re.findall(r"\]\(([^)#:]+\.md)\)", text):
            assert (ROOT / page).parent.joinpath(link).is_file(), f"{page} links to missing {link}"
