"""Mutation audit: does the CPU suite catch a wrong nibble order, a wrong global scale, a wrong scale layout?

Each mutation is a list of exact source edits (file, old text, new text). For each one the working tree
(tracked and untracked, not ignored files) is copied to a fresh temporary folder, the edits are applied
(each ``old`` must occur exactly once), and the CPU suite runs there with ``CI=true``; the script prints a
markdown table ``mutation | CPU tests failing``. An unmutated copy runs first and must pass, so a failure
is the mutation's doing. Every test file selected runs in CI (``.ci/run`` runs all of ``tests/``); the
default selection is the files that check layouts and numerics (``DEFAULT_TESTS``), ``--all`` runs every
test file. To add a mutation, append an entry to ``MUTATIONS``.

    python scripts/mutations.py [--all] [--only SUBSTRING] [--tests tests/test_x.py ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = (
    "tests/test_formulas.py",
    "tests/test_outside_references.py",
    "tests/test_flashinfer_conformance.py",
    "tests/test_layouts.py",
    "tests/test_sm90_layout.py",
    "tests/test_readers.py",
    "tests/test_verify.py",
)


@dataclass(frozen=True)
class Edit:
    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    edits: tuple[Edit, ...]


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("canonical nibble order swapped (`unpack_codes` / `pack_codes`)", (
        Edit("repack/nvfp4.py", "torch.stack((codes & 0x0F, codes >> 4), dim=-1)",
             "torch.stack((codes >> 4, codes & 0x0F), dim=-1)"),
        Edit("repack/nvfp4.py", "pairs[..., 0] | (pairs[..., 1] << 4)", "pairs[..., 1] | (pairs[..., 0] << 4)"),
    )),
    Mutation("ModelOpt reader multiplier x2, synthetic writer changed to match", (
        Edit("repack/formats/modelopt.py", "to_multiplier=lambda stored: stored.to(torch.float32),",
             "to_multiplier=lambda stored: stored.to(torch.float32) * 2,"),
        Edit("repack/sample/synthetic.py", 'f"{prefix}.weight_scale_2": weight.multiplier.reshape(()),',
             'f"{prefix}.weight_scale_2": weight.multiplier.reshape(()) / 2,'),
    )),
    Mutation("compressed-tensors reader multiplier x2, synthetic writer changed to match", (
        Edit("repack/formats/compressed_tensors.py",
             "to_multiplier=lambda stored: torch.reciprocal(stored.to(torch.float32)),",
             "to_multiplier=lambda stored: torch.reciprocal(stored.to(torch.float32)) * 2,"),
        Edit("repack/sample/synthetic.py", "torch.reciprocal(weight.multiplier).reshape(1),",
             "torch.reciprocal(weight.multiplier / 2).reshape(1),"),
    )),
    Mutation("compressed-tensors reciprocal dropped (reader)", (
        Edit("repack/formats/compressed_tensors.py",
             "to_multiplier=lambda stored: torch.reciprocal(stored.to(torch.float32)),",
             "to_multiplier=lambda stored: stored.to(torch.float32),"),
    )),
    Mutation("sm90 scales: group/stripe order swapped (`pack_scales` and `unpack_scales`)", (
        Edit("repack/targets/sm90.py", "return view.permute(0, 3, 2, 4, 1).reshape(np_ // STRIPE, kb * BLOCK_SIZE)",
             "return view.permute(0, 3, 1, 4, 2).reshape(np_ // STRIPE, kb * BLOCK_SIZE)"),
        Edit("repack/targets/sm90.py", "view(stripes, kp // CHUNK, 8, 4, 2)  # s, c, g, t, h",
             "view(stripes, kp // CHUNK, 2, 4, 8)  # s, c, h, t, g"),
        Edit("repack/targets/sm90.py", "return view.permute(0, 4, 2, 1, 3).reshape(stripes * STRIPE",
             "return view.permute(0, 2, 4, 1, 3).reshape(stripes * STRIPE"),
    )),
    Mutation("sm100 nibble swap (`to_runtime` and `from_runtime`)", (
        Edit("repack/targets/sm100.py", "weight=pad_codes(weight.codes, geometry),",
             "weight=pad_codes((weight.codes << 4) | (weight.codes >> 4), geometry),"),
        Edit("repack/targets/sm100.py", "codes=layer.weight[:n, : k // 2].contiguous(),",
             "codes=((layer.weight << 4) | (layer.weight >> 4))[:n, : k // 2].contiguous(),"),
    )),
    Mutation("sm100 global scale x2 (`to_runtime` and `from_runtime`)", (
        Edit("repack/targets/sm100.py", "weight_global_scale=weight.multiplier.reshape(1).to(torch.float32).clone(),",
             "weight_global_scale=weight.multiplier.reshape(1).to(torch.float32) * 2,"),
        Edit("repack/targets/sm100.py", "multiplier=layer.weight_global_scale.reshape(1).clone(),",
             "multiplier=layer.weight_global_scale.reshape(1) / 2,"),
    )),
    Mutation("128x4 swizzle atom transposed (`swizzle_128x4` and `unswizzle_128x4`)", (
        Edit("repack/targets/layout.py", "view(rows // 128, 4, 32, cols // 4).permute(0, 3, 2, 1)",
             "view(rows // 128, 32, 4, cols // 4).permute(0, 3, 1, 2)"),
        Edit("repack/targets/layout.py", "linear = words.permute(0, 3, 2, 1)", "linear = words.permute(0, 2, 3, 1)"),
    )),
    Mutation("sm120 S0E5M3 shift off by one (encode and decode)", (
        Edit("repack/targets/sm120.py", "return ((bits >> 7) & 0xFF).to(torch.uint8)",
             "return ((bits >> 6) & 0xFF).to(torch.uint8)"),
        Edit("repack/targets/sm120.py", "bits = (encoded.to(torch.int32) << 7).to(torch.int16)",
             "bits = (encoded.to(torch.int32) << 6).to(torch.int16)"),
    )),
    Mutation("online-transform matrix transposed where convert stores it (`runtime_matrix`)", (
        Edit("repack/formats/transforms.py", "return (load_matrix(checkpoint, matrix) / matrix.scale).to(dtype).contiguous()",
             "return (load_matrix(checkpoint, matrix) / matrix.scale).t().to(dtype).contiguous()"),
    )),
)  # fmt: skip


def working_tree_copy(destination: Path) -> None:
    """Tracked and untracked-but-not-ignored files of the working tree, as they are now."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def apply(edits: tuple[Edit, ...], clone: Path) -> None:
    for edit in edits:
        path = clone / edit.file
        text = path.read_text()
        if text.count(edit.old) != 1:
            raise SystemExit(f"{edit.file}: expected exactly one {edit.old!r}, found {text.count(edit.old)}")
        path.write_text(text.replace(edit.old, edit.new))


def run_suite(clone: Path, tests: list[str]) -> tuple[list[str], str]:
    """Failed test ids, and pytest's summary line, for the CPU suite run inside ``clone``."""
    env = dict(os.environ, CI="true", PYTHONPATH=str(clone), PYTHONDONTWRITEBYTECODE="1")
    check = subprocess.run([sys.executable, "-c", "import repack; print(repack.__file__)"], cwd=clone, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(check).resolve().is_relative_to(clone.resolve()):
        raise SystemExit(f"the clone imports repack from {check}, not from {clone}")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-W", "ignore",
                             *tests], cwd=clone, env=env, capture_output=True, text=True)
    failed = sorted(set(re.findall(r"^FAILED (\S+)", result.stdout, re.MULTILINE)))
    summary = next((line for line in reversed(result.stdout.splitlines()) if " in " in line), result.stdout[-300:])
    return failed, summary.strip("= ")


def audit(mutation: Mutation | None, tests: list[str]) -> tuple[list[str], str]:
    with tempfile.TemporaryDirectory(prefix="nvfp4-mutation-") as tmp:
        clone = Path(tmp)
        working_tree_copy(clone)
        if mutation is not None:
            apply(mutation.edits, clone)
        return run_suite(clone, tests)


def by_test(test_ids: list[str]) -> str:
    """``file::test (count)`` per test function, parameters folded."""
    counts: dict[str, int] = {}
    for test_id in test_ids:
        name = test_id.removeprefix("tests/").split("[")[0]
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"`{name}` ({count})" for name, count in counts.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="run every test file, not DEFAULT_TESTS")
    parser.add_argument("--tests", nargs="+", help="test files or ids to run instead")
    parser.add_argument("--only", help="run only the mutations whose name contains this")
    args = parser.parse_args()
    tests = ["tests"] if args.all else list(args.tests or DEFAULT_TESTS)
    chosen = [m for m in MUTATIONS if args.only is None or args.only in m.name]
    start = time.monotonic()
    failed, summary = audit(None, tests)
    print(f"unmutated copy: {summary}", flush=True)
    if failed:
        raise SystemExit(f"the unmutated suite fails ({by_test(failed)}); fix that first")
    rows = []
    for mutation in chosen:
        failed, summary = audit(mutation, tests)
        rows.append((mutation.name, failed))
        print(f"{mutation.name}: {summary}", file=sys.stderr, flush=True)
    print(f"\ntests run: {' '.join(tests)}  ({time.monotonic() - start:.0f} s)\n")
    print("| mutation | CPU tests failing |\n| --- | --- |")
    for name, failed in rows:
        print(f"| {name} | {len(failed)}: {by_test(failed)} |" if failed else f"| {name} | **0 (not caught)** |")
    if any(not failed for _, failed in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
