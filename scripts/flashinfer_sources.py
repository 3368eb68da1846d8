"""Compare, between FlashInfer releases, the source of the functions whose output this project's sm100 / sm120 layouts
reproduce (the FlashInfer versions a layout is checked against: ``FLASHINFER_CHECKED``, repack/targets/families.py).

    python scripts/flashinfer_sources.py A B [C ...]

Each argument is an installed ``flashinfer`` package folder (``.../site-packages/flashinfer``), an unpacked
``flashinfer_python`` wheel, or the wheel file itself. For each function (Python: a top-level ``def`` or assignment
found by ``ast``; C++/CUDA: the definition's text up to its matching brace) it prints where each release holds it and
whether its text is the same in all of them, then the line-level difference where it is not. Exit status 1 where a
function differs or is missing in a release. Docstrings, comments and assertion messages count as differences:
read the printed difference to judge them.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
import tempfile
import zipfile
from pathlib import Path

# vLLM's FlashInfer calls for the dense W4A16 cute-dsl layouts (sm100, sm120) and the TRT-LLM-gen MoE layout, and the
# helpers they call; the C++ kernel behind nvfp4_block_scale_interleave and its 128x4 offset.
PYTHON = ("prepare_bf16_fp4_weights", "_prepare_cute_dsl", "_prepare_cute_dsl_sm100", "_prepare_cute_dsl_sm12x",
          "_cute_dsl_pack_fp4_weight", "_e4m3_to_s0e5m3", "_CUTE_DSL_PACK_TILE_K", "_CUTE_DSL_PACK_TILE_N",
          "_CUTE_DSL_PACK_INTS_PER_TILE", "_unswizzle_sf_128x4", "convert_sf_to_mma_layout", "shuffle_matrix_a",
          "shuffle_matrix_sf_a", "get_shuffle_matrix_a_row_indices", "get_shuffle_matrix_sf_a_row_indices",
          "get_shuffle_block_size", "reorder_rows_for_gated_act_gemm", "_maybe_get_cached_w3_w1_permute_indices",
          "get_w2_permute_indices_with_cache", "nvfp4_block_scale_interleave", "block_scale_interleave")
CPP = ("block_scale_interleave_kernel", "invokeBlockScaleInterleave", "get_sf_out_offset_128x4",
       "BlockScaleInterleave", "blockScaleInterleaveHost")


def package_root(path: Path, scratch: Path) -> Path:
    """The ``flashinfer`` folder of an installed package, an unpacked wheel or a wheel file."""
    if path.is_file() and path.suffix == ".whl":
        target = scratch / path.stem
        with zipfile.ZipFile(path) as wheel:
            wheel.extractall(target, [n for n in wheel.namelist()
                                      if n.startswith("flashinfer/") and n.endswith((".py", ".cu", ".cuh", ".cpp", ".h"))])
        path = target
    return path / "flashinfer" if (path / "flashinfer" / "__init__.py").exists() else path


def python_definitions(root: Path) -> dict[str, list[tuple[str, str]]]:
    """name -> [(file, source)] of the top-level definitions named in PYTHON."""
    found: dict[str, list[tuple[str, str]]] = {}
    for file in sorted(root.rglob("*.py")):
        try:
            text = file.read_text()
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
            for name in set(names) & set(PYTHON):
                found.setdefault(name, []).append((str(file.relative_to(root)), "".join(lines[start - 1 : node.end_lineno])))
    return found


def cpp_definitions(root: Path) -> dict[str, list[tuple[str, str]]]:
    """name -> [(file, text)] of the C++/CUDA definitions named in CPP: the signature line to its matching brace."""
    found: dict[str, list[tuple[str, str]]] = {}
    for file in sorted(p for ext in ("*.cu", "*.cuh", "*.cpp", "*.h") for p in root.rglob(ext)):
        text = file.read_text(errors="replace")
        for name in CPP:
            for match in re.finditer(rf"^[^\n;]*\b{name}\s*\([^;{{]*\{{", text, re.M):
                depth, end = 0, match.end() - 1
                for end in range(match.end() - 1, len(text)):
                    depth += {"{": 1, "}": -1}.get(text[end], 0)
                    if depth == 0:
                        break
                found.setdefault(name, []).append((str(file.relative_to(root)), text[match.start() : end + 1]))
    return found


def compare(roots: dict[str, Path]) -> int:
    defs = {label: {**python_definitions(root), **cpp_definitions(root)} for label, root in roots.items()}
    labels, status = list(roots), 0
    for name in (*PYTHON, *CPP):
        held = [defs[label].get(name, []) for label in labels]
        if not any(held):
            print(f"{name}: in none of them")
            status = 1
            continue
        texts = [sorted(h) for h in held]
        same = all(t == texts[0] for t in texts)
        where = sorted({f for h in held for f, _ in h})
        print(f"{name}: {'identical' if same else 'DIFFERS'} ({', '.join(where)})")
        if not same:
            status = 1
            for label, text in zip(labels[1:], texts[1:]):
                a = "".join(s for _, s in texts[0]).splitlines()
                b = "".join(s for _, s in text).splitlines()
                sys.stdout.writelines(f"    {line}\n" for line in difflib.unified_diff(
                    a, b, labels[0], label, lineterm="", n=0))  # fmt: skip
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="+", type=Path, help="flashinfer package folders or wheels")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        roots = {str(p): package_root(p, Path(scratch)) for p in args.releases}
        for label, root in roots.items():
            if not root.is_dir():
                print(f"flashinfer_sources.py: error: no flashinfer package at {label}", file=sys.stderr)
                return 2
        return compare(roots)


if __name__ == "__main__":
    sys.exit(main())
