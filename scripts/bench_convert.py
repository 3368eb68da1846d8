"""Convert a synthetic checkpoint of a given size and report wall time and peak RSS per target.

    python scripts/bench_convert.py --gb 1.0 --targets sm100 sm120

Each conversion runs in a fresh subprocess so its peak RSS (ru_maxrss) is its own. The checkpoint is
made of [N, K] = [4096, 14336] layers (the largest tensor of a Llama-8B MLP), so peak RSS should stay
near the import baseline plus a few layers, whatever the model size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from repack.sample.synthetic import random_nvfp4, write_checkpoint  # noqa: E402

# VmHWM (peak RSS of this process image) rather than ru_maxrss, which Linux carries over from the parent.
CHILD = """
import json, re, sys, time
import repack.convert
hwm = lambda: int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
base = hwm()
t = time.perf_counter()
summary = repack.convert.convert(sys.argv[1], sys.argv[2], sys.argv[3])
print(json.dumps({"seconds": time.perf_counter() - t, "baseline_kb": base, "peak_kb": hwm(),
                  "bytes_in": summary.bytes_in, "bytes_out": summary.bytes_out}))
"""


def measure_child(child: str, *args: str) -> dict:
    """Run the Python source ``child`` with ``args`` in a fresh process; its last line of output, as JSON.

    glibc's malloc keeps freed medium-sized blocks (its mmap threshold grows up to 32 MB after each free),
    so RSS would count memory the child no longer holds; a fixed 1 MB threshold returns every
    tensor-sized block to the OS when freed, making peak RSS the peak of live data.
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run([sys.executable, "-c", child, *args], check=True, env=env,
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model: Path, target: str, out: Path) -> dict:
    """Run one conversion in a child process; its timing and memory as a dict."""
    return measure_child(CHILD, str(model), target, str(out))


def make_model(root: Path, gigabytes: float, n: int = 4096, k: int = 14336) -> int:
    """Write ``gigabytes`` of NVFP4 layers of shape [n, k] (in 2 shards); returns the largest layer's bytes."""
    layer_bytes = n * k // 2 + n * k // 16 + 4
    count = max(1, int(gigabytes * 1e9 // layer_bytes))
    gen = torch.Generator().manual_seed(0)
    layers = {f"model.layers.{i}.mlp.down_proj": random_nvfp4(n, k, gen) for i in range(count)}
    write_checkpoint(root, layers, {"model.norm.weight": torch.ones(n)}, fmt="modelopt", shards=2)
    return layer_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--targets", nargs="+", default=["sm100", "sm120"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        t = time.perf_counter()
        layer_bytes = make_model(model, args.gb)
        print(f"wrote {args.gb} GB checkpoint in {time.perf_counter() - t:.1f} s; largest layer {layer_bytes / 1e6:.1f} MB")
        print("| target | bytes in | bytes out | time (s) | MB/s | baseline RSS (MB) | peak RSS (MB) | peak - baseline (MB) |")
        print("|---|---|---|---|---|---|---|---|")
        for target in args.targets:
            r = measure(model, target, Path(tmp) / f"out-{target}")
            print(f"| {target} | {r['bytes_in'] / 1e9:.2f} GB | {r['bytes_out'] / 1e9:.2f} GB | {r['seconds']:.1f} | "
                  f"{r['bytes_in'] / 1e6 / r['seconds']:.0f} | {r['baseline_kb'] / 1e3:.0f} | {r['peak_kb'] / 1e3:.0f} | "
                  f"{(r['peak_kb'] - r['baseline_kb']) / 1e3:.0f} |")


if __name__ == "__main__":
    main()
