"""Time `nvfp4-repack convert` and `verify` through the CLI, as a user runs them (startup included), against
`cp -r` of the same checkpoint, with each run's peak RSS; print a ready-to-paste table with the issue's goals.

    python scripts/bench_convert.py                      # 32 Llama-3-8B decoder layers (3.9 GB), 3 rounds
    python scripts/bench_convert.py --layers 8 --rounds 1 --jobs sm100 sm100:no-fsync verify:sm100
    python scripts/bench_convert.py --repo /tmp/old-tree  # the same jobs with another checkout's CLI (A/B)
    python scripts/bench_convert.py --moe --rounds 1      # DeepSeek-R1-shaped MoE (4.2 GB): --fuse and --tp 8

A job is a target (`sm100`), several targets in one pass (`sm100+sm120+sm90`), with flags after colons:
`:no-fsync` (`convert --no-fsync`), `:fuse` (`--fuse`), `:tpN` (`--tp N`); or `verify:T` (`verify OUT --source
MODEL` of target T's bundle; `verify:T1+T2`: of a several-target output). `--moe` times a synthetic MoE checkpoint
with DeepSeek-R1's expert shapes (hidden 7168, intermediate 2048; Qwen3-MoE-shaped config, ModelOpt NVFP4 W4A4, 4
shards; `--layers` FusedMoE layers of `--experts` experts: 2 x 82 by default, 4.2 GB with the attention layers)
instead, with `MOE_JOBS` (issue 28's goals: <= 2.0x cp, peak RSS <= 1.5 GB, the ranks of one output in one pass). Each runs as `python -m repack.cli ...` in a process of its own, timed from its start to
its exit, with its CPU seconds and peak RSS from the kernel (wait4; this script imports no torch, so a child's
peak RSS is its own). To measure as on a machine of N cores, run the script under `taskset -c 0-(N-1)`. The baselines are `cp -r MODEL COPY` and `cp -r MODEL COPY && sync` (the goal of a
durable convert, which fsyncs its bundle before publishing it). Every job and copy starts after a `sync`, so none
pays for the writeback of an earlier one. Rounds alternate all jobs and copies, and the table gives medians:
the machine may be shared, so each row also gives the 1-minute load average (median) when its runs started.
The run also prints the CPU seconds of hashing every byte of the checkpoint (sha256, BLAKE3 on one thread).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
MAKE_MODEL = """
import sys, torch
from pathlib import Path
from repack.sample.synthetic import write_llama
write_llama(Path(sys.argv[1]), "modelopt", hidden=4096, heads=32, kv_heads=8, intermediate=14336, head_dim=128,
            generator=torch.Generator().manual_seed(0), layers=int(sys.argv[2]))
"""  # Llama-3-8B decoder layers of random NVFP4 weights (ModelOpt, one shard)
MAKE_MOE_MODEL = """
import sys, torch
from pathlib import Path
from repack.sample.synthetic import write_qwen_moe
write_qwen_moe(Path(sys.argv[1]), "modelopt", hidden=7168, experts=int(sys.argv[3]), intermediate=2048, heads=56,
               kv_heads=8, head_dim=128, generator=torch.Generator().manual_seed(0), layers=int(sys.argv[2]), top_k=8,
               shards=4)
"""  # DeepSeek-R1's expert shapes (its 256 experts per layer cut to --experts), Qwen3-MoE-shaped config, ModelOpt W4A4
DEFAULT_JOBS = ["sm100", "sm120", "sm90", "sm100+sm120+sm90", "sm100:no-fsync", "sm120:no-fsync",
                "sm100+sm120+sm90:no-fsync", "verify:sm100", "verify:sm120", "verify:sm90"]
MOE_JOBS = ["sm100:fuse:no-fsync", "sm100:tp8:no-fsync"]


def goal(job: str) -> tuple[str, float] | None:
    """The issue's goal for ``job``: (baseline, largest ratio to it)."""
    targets, *flags = job.removesuffix(BASE).split(":")
    base = "cp" if "no-fsync" in flags else "cp+sync"
    if job.startswith("verify:"):
        return ("cp", 2.0)
    if "fuse" in flags or any(f.startswith("tp") for f in flags):  # issue 28's, for MoE checkpoints
        return (base, 2.0)
    if "+" in targets:
        return (base, 2.5)
    if targets in ("sm100", "sm120"):
        return (base, 1.5)
    return None


BASE = " [base]"  # a job run with --base's CLI


def cli_command(model: Path, job: str, out: Path) -> list[str]:
    """The command line a user types for ``job``."""
    cli = [sys.executable, "-m", "repack.cli"]
    if job.startswith("verify:"):
        return [*cli, "verify", str(out), "--source", str(model)]
    targets, *flags = job.split(":")
    chosen = [arg for t in targets.split("+") for arg in ("-t", t)]
    options = [arg for flag in flags for arg in (["--tp", flag[2:]] if flag.startswith("tp") else [f"--{flag}"])]
    return [*cli, "convert", str(model), *chosen, "-o", str(out), *options]


def run_timed(command: list[str], repo: Path) -> dict:
    """Run ``command`` in ``repo``'s checkout: wall and CPU seconds, peak RSS (the kernel's, from wait4)."""
    os.sync()  # nothing of an earlier job still being written
    load = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=repo, env=env, stdout=log, stderr=log)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            log.seek(0)
            raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{log.read()[-3000:].decode()}")
    return {"seconds": seconds, "cpu": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1e3, "load": load}


def time_copy(model: Path, destination: Path, durable: bool) -> dict:
    """``cp -r`` of the checkpoint (``durable``: followed by ``sync``), timed like a job; the copy is deleted."""
    script = f"cp -r '{model}' '{destination}'" + (" && sync" if durable else "")
    result = run_timed(["sh", "-c", script], Path.cwd())
    shutil.rmtree(destination)
    return result


# Library-level measurement, for tests/test_memory.py and scripts/bench_vllm_load.py.
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
    """Run one job through the library (not the CLI) in a child process; its timing and memory as a dict, with the
    child's peak RSS above its baseline after the imports (tests/test_memory.py)."""
    return measure_child(CHILD, str(model), job, str(out))


def make_layers_model(root: Path, gigabytes: float, n: int = 4096, k: int = 14336) -> int:
    """Write ``gigabytes`` of NVFP4 layers of shape [n, k] (in 2 shards); returns the largest layer's bytes."""
    import torch

    from repack.sample.synthetic import random_nvfp4, write_checkpoint

    layer_bytes = n * k // 2 + n * k // 16 + 4
    count = max(1, int(gigabytes * 1e9 // layer_bytes))
    gen = torch.Generator().manual_seed(0)
    layers = {f"model.layers.{i}.mlp.down_proj": random_nvfp4(n, k, gen) for i in range(count)}
    write_checkpoint(root, layers, {"model.norm.weight": torch.ones(n)}, fmt="modelopt", shards=2)
    return layer_bytes


def hash_seconds(model: Path, algorithm: Callable) -> float:
    """CPU seconds of one digest over every byte of the checkpoint's shards, read through a mapping."""
    started = time.thread_time()
    for file in sorted(model.glob("*.safetensors")):
        with open(file, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            algorithm(data).digest()
    return time.thread_time() - started


def hash_costs(model: Path) -> str:
    """:func:`hash_seconds` of sha256 and BLAKE3, measured in a child process: the mappings would otherwise
    raise this process's peak RSS, which every later child's inherits."""
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); import bench_convert as b, hashlib, blake3; "
            f"m = b.Path(sys.argv[1]); print(f'sha256 {{b.hash_seconds(m, hashlib.sha256):.2f}}, BLAKE3 (one thread) "
            f"{{b.hash_seconds(m, lambda d: blake3.blake3(d, max_threads=1)):.2f}}')")
    return subprocess.run([sys.executable, "-c", code, str(model)], check=True, capture_output=True,
                          text=True).stdout.strip()


def table(jobs: list[str], runs: dict[str, list[dict]]) -> str:
    """Medians per job, as a markdown table with ratios to both baselines and the goal."""
    median = {job: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for job, rs in runs.items()}
    base = {"cp": median["cp -r"]["seconds"], "cp+sync": median["cp -r && sync"]["seconds"]}
    lines = ["| job | runs (s) | median (s) | x cp | x (cp + sync) | goal | CPU (s) | peak RSS (MB) | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for job in ["cp -r", "cp -r && sync", *jobs]:
        m, wanted = median[job], goal(job)
        verdict = "-"
        if wanted is not None:
            ratio = m["seconds"] / base[wanted[0]]
            verdict = f"<= {wanted[1]}x {wanted[0]}: {'met' if ratio <= wanted[1] else 'not met'}"
        each = ", ".join(f"{r['seconds']:.2f}" for r in runs[job])
        lines.append(f"| {job} | {each} | {m['seconds']:.2f} | {m['seconds'] / base['cp']:.2f} | "
                     f"{m['seconds'] / base['cp+sync']:.2f} | {verdict} | {m['cpu']:.2f} | {m['peak_mb']:.0f} | "
                     f"{m['load']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None,
                        help="Llama-3-8B decoder layers (123 MB each; default 32), or FusedMoE layers with --moe (2).")
    parser.add_argument("--moe", action="store_true", help="A DeepSeek-R1-shaped MoE checkpoint, MOE_JOBS by default.")
    parser.add_argument("--experts", type=int, default=82, help="--moe: experts per layer (24.8 MB each).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of every job and copy, alternating.")
    parser.add_argument("--jobs", nargs="+", default=None)
    parser.add_argument("--dir", type=Path, default=None, help="Work folder (default: a temporary one).")
    parser.add_argument("--model", type=Path, default=None,
                        help="An existing checkpoint to time instead of a new synthetic one (--layers is then unused).")
    parser.add_argument("--repo", type=Path, default=REPO, help="The checkout whose CLI runs (default: this script's).")
    parser.add_argument("--base", type=Path, default=None,
                        help="Another checkout: each job also runs with its CLI, right after --repo's (A/B).")
    args = parser.parse_args()
    problem = None  # a usage error is one line, like the CLI's
    if args.dir is not None and not args.dir.is_dir():
        problem = f"--dir {args.dir}: no such folder"
    elif args.model is not None and not (args.model / "config.json").is_file():
        problem = f"--model {args.model}: not a model folder (no config.json)"
    else:
        problem = next((f"{r}: not an nvfp4-repack checkout" for r in filter(None, (args.repo, args.base))
                        if not (r / "repack" / "cli").is_dir()), None)
    if problem is not None:
        print(f"Error: {problem}", file=sys.stderr)
        sys.exit(2)
    args.layers = args.layers or (2 if args.moe else 32)
    args.jobs = args.jobs or (MOE_JOBS if args.moe else DEFAULT_JOBS)
    clis = {"": args.repo, **({BASE: args.base} if args.base else {})}
    labels = [job + suffix for job in args.jobs for suffix in clis]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model = args.model or Path(tmp) / "model"
        started = time.perf_counter()
        if args.model is None:
            maker = [MAKE_MOE_MODEL, str(model), str(args.layers), str(args.experts)] if args.moe else [
                MAKE_MODEL, str(model), str(args.layers)]
            subprocess.run([sys.executable, "-c", *maker], check=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        size = sum(f.stat().st_size for f in model.iterdir())
        what = (f"{args.layers} FusedMoE layers of {args.experts} DeepSeek-R1-shaped experts" if args.moe else
                f"{args.layers} Llama-3-8B layers")
        made = f"{what}, made in {time.perf_counter() - started:.0f} s" if args.model is None else model
        print(f"checkpoint: {size / 1e9:.2f} GB ({made}); {len(os.sched_getaffinity(0))} cores; CLI of {args.repo}"
              + (f"; rows marked{BASE}: CLI of {args.base}" if args.base else ""))
        print(f"CPU seconds to hash the checkpoint once: {hash_costs(model)}")
        runs: dict[str, list[dict]] = {}
        bundles = {}  # what each verify job reads, made by its own CLI
        for label in labels:
            job, suffix = label.removesuffix(BASE), label[len(label.removesuffix(BASE)):]
            if job.startswith("verify:"):
                bundles[label] = Path(tmp) / f"for-{job.partition(':')[2]}{suffix and '-base'}"
                if not bundles[label].exists():
                    run_timed(cli_command(model, job.partition(":")[2], bundles[label]), clis[suffix])
        for round_ in range(args.rounds):
            for label in ["cp -r", "cp -r && sync", *labels]:
                job, suffix = label.removesuffix(BASE), label[len(label.removesuffix(BASE)):]
                if job.startswith("cp"):
                    result = time_copy(model, Path(tmp) / "copy", durable="sync" in job)
                else:
                    out = bundles.get(label, Path(tmp) / "out")
                    result = run_timed(cli_command(model, job, out), clis[suffix])
                    if not job.startswith("verify:"):
                        shutil.rmtree(out)
                runs.setdefault(label, []).append(result)
                print(f"round {round_ + 1}: {label}: {result['seconds']:.2f} s, load {result['load']:.1f}", flush=True)
        print()
        print(table(labels, runs))


if __name__ == "__main__":
    main()
