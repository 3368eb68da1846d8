"""What the SGLang plugin refuses, before SGLang builds a model: a bundle it cannot serve, in one line naming what to
run instead. Imports no SGLang (the loader passes in what SGLang runs), so the project's own tests check every refusal
without an SGLang install (tests/test_sglang_plugin.py); the SGLang oracle checks them inside SGLang's load."""

from __future__ import annotations

from pathlib import Path

from ..bundle.manifest import MANIFEST_NAME
from ..bundle.reader import Bundle, open_bundle, rank_dir
from ..errors import RepackError
from ..targets.engines import check_running
from ..targets.sglang import ENGINE, backends


def open_rank_bundle(path: str | Path, tp_size: int, tp_rank: int, capability: tuple[int, int] | None,
                     backend: str, version: str) -> Bundle:
    """This rank's SGLang bundle under ``path``, or a one-line refusal naming what to run instead: a bundle of another
    engine, TP size or rank, GPU family, dense FP4 backend (``--fp4-gemm-backend``) or SGLang version."""
    root = Path(path)
    folder = rank_dir(root, tp_rank)
    if not (folder / MANIFEST_NAME).is_file():
        raise RepackError(f"{root} is not an nvfp4-repack bundle (no {MANIFEST_NAME}); convert it first with "
                          f"'nvfp4-repack convert {root} --target TARGET --engine sglang --tp {tp_size}', or serve "
                          "the source with --load-format auto")
    bundle = open_bundle(folder)
    manifest, target = bundle.manifest, bundle.target
    if target.engine != ENGINE:
        raise RepackError(f"{folder}: the bundle holds {target.engine}'s state ({manifest.layout_id}), not SGLang's; "
                          f"re-convert with --engine sglang, or serve it with {target.engine}")
    check_running(ENGINE, manifest.engines.get(ENGINE, []), version, folder)
    if (manifest.tp_size, manifest.tp_rank) != (tp_size, tp_rank if manifest.tp_size > 1 else 0):
        raise RepackError(f"{folder}: the bundle is rank {manifest.tp_rank} of tensor-parallel size {manifest.tp_size}, "
                          f"but SGLang runs rank {tp_rank} of --tp {tp_size}; serve it with --tp {manifest.tp_size} "
                          f"or re-convert with --tp {tp_size}")
    if capability is not None and capability not in target.compute_capabilities:
        have = f"sm{capability[0]}{capability[1]}"
        raise RepackError(f"{folder}: the bundle is for {target.name} but this GPU is {have}; convert the source with "
                          f"--target {have} --engine sglang")
    if backend not in backends(manifest.layout_id):
        raise RepackError(f"{folder}: --fp4-gemm-backend {backend} holds other bytes than the bundle's "
                          f"({manifest.kernels[0]}); serve it with --fp4-gemm-backend {manifest.kernels[0]}")
    return bundle
