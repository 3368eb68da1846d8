"""Time convert and verify against a plain copy of the same checkpoint, and report each one's peak RSS.

    python scripts/bench_convert.py --gb 1.0
    python scripts/bench_convert.py --gb 1.0 --jobs sm100 sm120+sm90 verify:sm90

Each job runs in a fresh subprocess so its peak RSS is its own; `cp -r` of the checkpoint is timed in the same
run (page cache warm for both: the checkpoint was just written, and each job reads it once before timing is
over anyway), plain and with an fsync of every copied file (convert makes its bundles durable before it
publishes them, so the disk's write speed bounds it; `cp` does not wait for the disk). Every job and copy
starts after an `os.sync()`, so none pays for the writeback of an earlier one; `load` is the 1-minute load
average when the job started (other work on the machine slows every row). A job is a target (`sm100`),
several targets in one pass (`sm100+sm120+sm90`), either with `:no-fsync` (convert --no-fsync: published
without waiting for the disk), `verify:T` (verify the bundle of target T against the source; `verify:T1+T2`: the
several-target output, the source hashed once). The run also
measures the costs no convert avoids, on the same checkpoint: sha256 and xxh3 of every byte (CPU seconds,
from a mapping) and the CPU of `cp -r` itself (the kernel's copy into new page-cache pages), and prints the
bound they imply on 2 cores. The checkpoint is made of [N, K] = [4096, 14336] layers
(the largest tensor of a Llama-8B MLP), so peak RSS should stay near the import baseline plus a few layers,
whatever the model size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from repack.sample.synthetic import random_nvfp4, write_checkpoint  # noqa: E402

# VmHWM (peak RSS of this process image) rather than ru_maxrss, which Linux carries over from the parent.
CHILD = """
import json, re, sys, time
import repack.convert, repack.verify
hwm = lambda: int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
base = hwm()
model, job, out = sys.argv[1:4]
t = time.perf_counter()
if job.startswith("verify:"):
    report = repack.verify.verify_output(out, source=model)
    assert report.passed, report.failures
    result = {"bytes_in": 0, "bytes_out": 0}
else:
    targets, _, flag = job.partition(":")
    targets = targets.split("+")
    summary = repack.convert.convert(model, targets[0] if len(targets) == 1 else targets, out,
                                     fsync=flag != "no-fsync")
    summaries = summary if isinstance(summary, list) else [summary]
    result = {"bytes_in": summaries[0].bytes_in, "bytes_out": sum(s.bytes_out for s in summaries)}
print(json.dumps({"seconds": time.perf_counter() - t, "baseline_kb": base, "peak_kb": hwm(), **result}))
"""


def measure_child(child: str, *args: str) -> dict:
    """Run the Python source ``child`` with ``args`` in a fresh process; its last line of output, as JSON.

    The child runs with glibc's malloc as a user gets it: its peak RSS includes the freed blocks malloc keeps
    for reuse (what the machine sees). Forcing ``MALLOC_MMAP_THRESHOLD_=1MB``, as an earlier version of this
    script did to count live data only, made every tensor a fresh mapping whose page faults cost 20-30% of a
    convert's time (docs/benchmarks.md).
    """
    done = subprocess.run([sys.executable, "-c", child, *args], check=True,
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model: Path, job: str, out: Path) -> dict:
    """Run one job in a child process; its timing and memory as a dict."""
    return measure_child(CHILD, str(model), job, str(out))


def hash_seconds(model: Path, algorithm: Callable) -> float:
    """CPU seconds of one digest over every byte of the checkpoint's shards, read through a mapping."""
    started = time.thread_time()
    for file in sorted(model.glob("*.safetensors")):
        with open(file, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            algorithm(data).digest()
    return time.thread_time() - started


def copy_cpu(model: Path, destination: Path) -> float:
    """CPU seconds (user + system) of ``cp -r`` of the checkpoint: the kernel's copy into new page-cache pages."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    time_copy(model, destination)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def time_copy(model: Path, destination: Path, durable: bool = False) -> float:
    """Wall time of ``cp -r`` of the checkpoint (the copy is deleted afterwards); ``durable``: and of the fsync of
    every copied file and folder, as convert does before it publishes a bundle."""
    os.sync()  # nothing of an earlier job still being written
    started = time.perf_counter()
    subprocess.run(["cp", "-r", str(model), str(destination)], check=True)
    if durable:
        for path in [*destination.iterdir(), destination]:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    seconds = time.perf_counter() - started
    shutil.rmtree(destination)
    return seconds


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
    parser.add_argument("--jobs", nargs="+", default=["sm100", "sm120", "sm90", "sm100+sm120+sm90", "sm100:no-fsync",
                                                      "sm120:no-fsync", "sm100+sm120+sm90:no-fsync",
                                                      "verify:sm100", "verify:sm120", "verify:sm90",
                                                      "verify:sm100+sm120+sm90"])
    parser.add_argument("--dir", type=Path, default=None, help="Work folder (default: a temporary one).")
    args = parser.parse_args()
    if args.dir is not None and not args.dir.is_dir():  # a usage error, one line like the CLI's
        print(f"Error: --dir {args.dir}: no such folder", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model = Path(tmp) / "model"
        t = time.perf_counter()
        layer_bytes = make_model(model, args.gb)
        print(f"wrote {args.gb} GB checkpoint in {time.perf_counter() - t:.1f} s; largest layer {layer_bytes / 1e6:.1f} MB")
        copy = min(time_copy(model, Path(tmp) / "copy") for _ in range(3))
        durable = min(time_copy(model, Path(tmp) / "copy", durable=True) for _ in range(3))
        print(f"cp -r: {copy:.2f} s (best of 3); cp -r + fsync of every file: {durable:.2f} s (best of 3)")
        sha, xxh = hash_seconds(model, hashlib.sha256), hash_seconds(model, xxhash.xxh3_128)
        cp_cpu = min(copy_cpu(model, Path(tmp) / "copy") for _ in range(3))
        bound = max((2 * sha + xxh + cp_cpu) / 2, sha)  # one output shard's sha256 is one sequential stream
        print(f"CPU seconds for the checkpoint: sha256 {sha:.2f}, xxh3 {xxh:.2f}, cp -r {cp_cpu:.2f} (best of 3). "
              f"A single-target convert hashes the source and its output with sha256, the output with xxh3, and "
              f"writes it (one shard of <= 5 GB: its sha256 is one stream): at least {bound:.2f} s on 2 cores ({bound / copy:.2f}x cp), and with its fsync at least "
              f"{max(bound, durable):.2f} s\n")
        print("| job | bytes in | bytes out | time (s) | x cp | x (cp + fsync) | baseline RSS (MB) | peak RSS (MB) | "
              "peak - baseline (MB) | load |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for job in args.jobs:
            name = job.split(":")[-1] if job.startswith("verify:") else job
            out = Path(tmp) / f"out-{name.replace('+', '-').replace(':', '-')}"
            if job.startswith("verify:") and not out.exists():
                measure(model, name, out)
            os.sync()  # each job starts with nothing of the previous one still being written
            load = os.getloadavg()[0]
            r = measure(model, job, out)
            if "+" in job or ":no-fsync" in job:  # plain single-target bundles stay for the verify jobs
                shutil.rmtree(out)
            print(f"| {job} | {r['bytes_in'] / 1e9:.2f} GB | {r['bytes_out'] / 1e9:.2f} GB | {r['seconds']:.2f} | "
                  f"{r['seconds'] / copy:.2f} | {r['seconds'] / durable:.2f} | {r['baseline_kb'] / 1e3:.0f} | "
                  f"{r['peak_kb'] / 1e3:.0f} | {(r['peak_kb'] - r['baseline_kb']) / 1e3:.0f} | {load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
