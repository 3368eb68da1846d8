"""What the engine oracles (tests/vllm/harness.py, tests/sglang/harness.py) share, in the engines' own venvs: the
command line (``--job NAME=CKPT:ARCH``, ``--tp``, one process per rank), the job loop that records an engine's
refusal, and the dump of every tensor a loaded layer holds. Imports only torch and safetensors (each harness imports
its engine).

    python harness.py --tp N --job NAME=CKPT:ARCH [--job ...] --out DIR
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch

Load = Callable[[str, str, int, int, Path], None]  # (checkpoint, arch, tp, rank, job folder) -> None


def layer_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a layer holds after its load: parameters (each of its names: an engine may register one Parameter
    under two, vLLM 0.34 ``weight_packed`` and ``weight``, SGLang ``weight_scale`` and ``weight_scale_interleaved``),
    buffers and plain tensor attributes."""
    found = {**layer._parameters, **layer._buffers}
    found.update({k: v for k, v in vars(layer).items() if isinstance(v, torch.Tensor)})
    return {k: v for k, v in found.items() if v is not None}


def storage_bytes(value: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``value``, as uint8 (a view's bytes outside the view included)."""
    return torch.empty(0, dtype=torch.uint8).set_(value.untyped_storage()).clone()


def view_record(value: torch.Tensor) -> dict:
    """dtype (``torch.`` dropped), shape, stride and storage offset of ``value``."""
    return {"dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape),
            "stride": list(value.stride()), "offset": value.storage_offset()}


def run_jobs(jobs: list[str], tp: int, rank: int, out: Path, load: Load) -> None:
    """Each ``NAME=CKPT:ARCH`` job into ``out/NAME``, or ``out/NAME/refused.txt`` with the engine's error."""
    for job in jobs:
        name, _, rest = job.partition("=")
        ckpt, _, arch = rest.rpartition(":")
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            load(ckpt, arch, tp, rank, folder)
        except Exception as exc:  # the engine refused the checkpoint: the test compares with our refusal
            (folder / "refused.txt").write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


def main(script: str, load: Load, patch: Callable[[], None], cleanup: Callable[[], None]) -> int:
    """Parse the command line; for ``--tp N`` start one process per rank (``--rank R``), as the engines run them; in
    each, ``patch()`` the engine, :func:`run_jobs` with ``load``, then ``cleanup()`` (its process groups)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", action="append", required=True, help="NAME=CKPT:ARCH")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=None, help="internal: run one rank of --tp")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rank is None and args.tp > 1:
        ranks = [subprocess.Popen([sys.executable, script, *sys.argv[1:], "--rank", str(r)]) for r in range(args.tp)]
        return max(p.wait() for p in ranks)
    patch()
    try:
        run_jobs(args.job, args.tp, args.rank or 0, out, load)
    finally:
        cleanup()
    return 0
