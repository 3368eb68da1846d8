"""vLLM's own load of an NVFP4 source vs the ``nvfp4_repack`` loader's load of its bundle: time and peak RSS (CPU).

    python scripts/bench_vllm_load.py --layers 6 --target sm100     # in the vLLM CPU environment (tests/vllm_cpu.py)

Writes a synthetic compressed-tensors NVFP4A16 Llama (hidden 4096, MLP 14336, 8 kv heads; each fused group
shares one global scale, as llm-compressor writes them), converts it with ``--fuse``, then loads each one in a
fresh child process through vLLM 0.33's ``load_model`` (source: ``DefaultModelLoader``, padding, swizzle and
FlashInfer's repack on load; bundle: this project's loader), with the CPU harness's patches. Each child reports
the load's wall time, its VmHWM (peak RSS) before and after, and the two runs alternate, twice each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_convert import measure_child

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from repack.convert import convert  # noqa: E402
from repack.sample.synthetic import write_llama  # noqa: E402

CHILD = """
import json, re, sys, time
from tests import vllm_cpu
hwm = lambda: int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
with vllm_cpu.world():
    base = hwm()
    t = time.perf_counter()
    model = vllm_cpu.load(sys.argv[1], sys.argv[2], target=sys.argv[3])
    print(json.dumps({"seconds": time.perf_counter() - t, "baseline_kb": base, "peak_kb": hwm()}))
"""


def make_model(root: Path, layers: int) -> int:
    """A Llama-3-8B-shaped checkpoint of ``layers`` decoder layers; returns its size in bytes."""
    write_llama(root, "compressed-tensors", hidden=4096, heads=32, kv_heads=8, intermediate=14336, head_dim=128,
                vocab=32000, layers=layers, generator=torch.Generator().manual_seed(0))
    return sum(f.stat().st_size for f in root.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--target", default="sm100", choices=["sm100", "sm120"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source, bundle = Path(tmp) / "source", Path(tmp) / "bundle"
        t = time.perf_counter()
        size = make_model(source, args.layers)
        print(f"wrote a {size / 1e9:.2f} GB checkpoint ({args.layers} layers) in {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        convert(source, args.target, bundle, fuse=True)
        print(f"converted to {args.target} (--fuse) in {time.perf_counter() - t:.0f} s")
        print("| run | load | time (s) | baseline RSS (MB) | peak RSS (MB) | peak - baseline (MB) |")
        print("|---|---|---|---|---|---|")
        for run in (1, 2):
            for what, path, load_format in (("vLLM from source", source, "safetensors"),
                                             ("nvfp4_repack from bundle", bundle, "nvfp4_repack")):
                r = measure_child(CHILD, str(path), load_format, args.target)
                print(f"| {run} | {what} | {r['seconds']:.1f} | {r['baseline_kb'] / 1e3:.0f} | "
                      f"{r['peak_kb'] / 1e3:.0f} | {(r['peak_kb'] - r['baseline_kb']) / 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
