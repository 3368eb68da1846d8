"""vLLM serving on a Hopper GPU: an NVFP4 source (vLLM's own load and default kernel) vs its sm90 bundle (the
``nvfp4_repack`` loader and this project's kernel) vs the same weights dequantized to bf16.

    PYTHONPATH=.:/tmp/site python3 scripts/bench_vllm_serve.py --work /tmp/bench [--jobs JOBS] [--parallel N]
        [--gate FILE] [--budget S] [--batches 1,8,32,128] [--profile-eager] [--json out.json]
    PYTHONPATH=.:/tmp/site python3 scripts/bench_vllm_serve.py --work /tmp/bench [--jobs JOBS] --prepare-only

JOBS: waves separated by spaces, each ``SET:MODES:MODELS`` or several joined by ``+``; default
``8b-32:default,eager:bundle,source,bf16``. A set names its models: ``SHAPE-LAYERS`` (``8b`` or ``70b``:
Llama-3-8B's or Llama-3-70B's decoder shapes), with ``-hadB`` an online input Hadamard of block B on every decoder
linear (llm-compressor's QuIP "v" rotation, ``tests/vllm_gpu.add_input_hadamard``). In ``WORK/SET``
(``--prepare-only`` writes them, one process per set; a run reuses what ``WORK/SET/ready.json`` records and waits
for a preparation running elsewhere): a compressed-tensors NVFP4A16 Llama, vocab 128256 (32000 for ``70b``), random
weights of standard deviation about 0.01 (``tests/vllm_gpu.py``); its bundle from the CLI (``convert --target sm90
--fuse --no-fsync``, timed); its dequantized bf16 copy, when a job names ``bf16``.

Every engine runs in a fresh process with a fresh HOME (cold vLLM compile, Triton and Humming caches), vLLM's
engine in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the load can be measured). The engines of a wave
(at most ``--parallel N`` of them: a larger one is split) build at once, each with a fixed KV cache of ``--kv-gib``
when N > 1; once every engine of the wave is built (and the ``--gate`` file exists: a test run on the same GPU has
finished), they measure one at a time in the order of JOBS while the others wait idle, each exiting when done;
then the next wave starts. A wave's engine start times are therefore taken while the other engines build. Per
engine:

* engine start: ``LLM(...)`` wall time (load, memory profiling, KV cache, torch.compile, CUDA graph capture);
* model load: the model runner's ``load_model`` wall time, and the peak of allocated GPU memory during it above what
  was allocated before (the source's load also holds its repack's temporaries);
* decode tok/s at each batch: ``batch x 128`` greedy tokens over the time between a 16-token and a 144-token
  generation of the same 32-token prompts (prefill and engine overhead cancel; best of 2, eager: one);
* prefill tok/s: 4 fresh prompts of 2000 tokens, one output token (best of 3);
* prompt log-probabilities of 4 fixed prompts of 64 tokens: the mean |difference| to bf16's is printed;
* ``--profile-eager``: in eager mode, the host-side time per op of 8 greedy steps at batch 1 and 32
  (``torch.profiler``, CPU only), the ops with the most self time.

Modes: ``default`` (vLLM's torch.compile and CUDA graphs), ``eager`` (``enforce_eager=True``). Engines: TRITON_ATTN,
``max_model_len`` 4096, ``max_num_batched_tokens`` 8192, ``max_num_seqs`` 128, prefix caching off, no tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests import vllm_gpu  # noqa: E402

SHAPES = {"8b": vllm_gpu.LLAMA3_8B, "70b": vllm_gpu.LLAMA3_70B}
# Llama-3's vocabulary; the 70B-shaped layers get 32000 (their bf16 embeddings and lm_head at 8192 wide would double
# the set on the GPU machine's 64 GiB disk). Prompts draw token ids below 32000.
VOCABS = {"8b": 128256, "70b": 32000}
PROMPT_VOCAB = 32000
MODES = {"default": {}, "eager": {"enforce_eager": True}}
MODELS = ("bundle", "source", "bf16")
ENGINE = dict(max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=128, enable_prefix_caching=False)
DECODE_PROMPT, DECODE_SHORT, DECODE_STEPS = 32, 16, 128
PREFILL_PROMPTS, PREFILL_LEN = 4, 2000
CHECK_PROMPTS, CHECK_LEN = 4, 64
PROFILE_BATCHES, PROFILE_STEPS, PROFILE_TOP = (1, 32), 8, 12
DEFAULT_JOBS = "8b-32:default,eager:bundle,source,bf16"


@dataclass(frozen=True)
class Job:
    set: str
    mode: str
    model: str

    @property
    def name(self) -> str:
        return f"{self.set}-{self.mode}-{self.model}"


def parse_set(name: str) -> tuple[str, int, int]:
    """``8b-32`` -> ("8b", 32, 0); ``8b-8-had128`` -> ("8b", 8, 128)."""
    match = re.fullmatch(r"(8b|70b)-(\d+)(?:-had(\d+))?", name)
    if match is None:
        raise SystemExit(f"Error: set {name!r} is not SHAPE-LAYERS[-hadB] (SHAPE 8b or 70b)")
    return match[1], int(match[2]), int(match[3] or 0)


def parse_jobs(spec: str) -> list[list[Job]]:
    """``SET:MODES:MODELS[+SET:MODES:MODELS] ...`` -> waves of jobs in that order (mode-major within a set)."""
    waves = []
    for wave in spec.split():
        jobs = []
        for group in wave.split("+"):
            parts = group.split(":")
            if len(parts) != 3:
                raise SystemExit(f"Error: job group {group!r} is not SET:MODES:MODELS")
            parse_set(parts[0])
            for mode in parts[1].split(","):
                for model in parts[2].split(","):
                    if mode not in MODES or model not in MODELS:
                        raise SystemExit(f"Error: {group!r}: modes are {sorted(MODES)}, models {list(MODELS)}")
                    jobs.append(Job(parts[0], mode, model))
        waves.append(jobs)
    return waves


def prepare(work: Path, name: str, dense: bool) -> dict[str, object]:
    """Write a set's source, bundle and (``dense``) bf16 models into ``work/name`` (once: ``ready.json``)."""
    root, ready = work / name, work / name / "ready.json"
    if ready.is_file():
        return json.loads(ready.read_text())
    shape, layers, block = parse_set(name)
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    source = vllm_gpu.write_shaped_llama(root / "source", SHAPES[shape], layers, VOCABS[shape],
                                         torch.Generator().manual_seed(0))  # fmt: skip
    if block:
        vllm_gpu.add_input_hadamard(source, block)
    written = time.perf_counter()
    subprocess.run([sys.executable, "-m", "repack.cli", "convert", str(source), "--target", "sm90", "--fuse",
                    "--no-fsync", "-o", str(root / "bundle")], check=True, cwd=ROOT)  # fmt: skip
    converted = time.perf_counter()
    if dense:
        vllm_gpu.write_dequantized(source, root / "bf16")
    info = {"set": name, "write_source_s": written - started, "convert_s": converted - written,
            "write_bf16_s": time.perf_counter() - converted if dense else None,
            "gb": {model: sum(f.stat().st_size for f in (root / model).glob("*.safetensors")) / 1e9
                   for model in MODELS if (root / model).is_dir()}}  # fmt: skip
    ready.write_text(json.dumps(info, indent=1))
    return info


def wait_for(path: Path, seconds: float) -> bool:
    """Whether ``path`` appeared within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


def hook_load(stats: dict[str, float]) -> None:
    """Time the model runner's ``load_model`` and read the allocator's peak during it (vLLM 0.33 has two model
    runners, ``v1/worker/gpu/model_runner.py`` the one its GPU worker built here: both are wrapped; 0.34 has only
    that one)."""
    import importlib
    import importlib.util

    for module in ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"):
        if importlib.util.find_spec(module) is None:
            continue
        runner = importlib.import_module(module).GPUModelRunner
        runner.load_model = timed_load(runner.load_model, stats)


def timed_load(load_model, stats: dict[str, float]):
    def timed(self, *args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        load_model(self, *args, **kwargs)
        torch.cuda.synchronize()
        stats.update(load_s=time.perf_counter() - started,
                     load_peak_gib=(torch.cuda.max_memory_allocated() - before) / 2**30,
                     loaded_gib=(torch.cuda.memory_allocated() - before) / 2**30)  # fmt: skip

    return timed


def decode_tps(llm: object, batch: int, gen: torch.Generator, rounds: int) -> float:
    prompts = vllm_gpu.random_prompts(batch, DECODE_PROMPT, PROMPT_VOCAB, gen)

    def seconds(tokens: int) -> float:
        started = time.perf_counter()
        vllm_gpu.greedy(llm, prompts, tokens)
        return time.perf_counter() - started

    seconds(4)
    best = min(seconds(DECODE_SHORT + DECODE_STEPS) - seconds(DECODE_SHORT) for _ in range(rounds))
    return batch * DECODE_STEPS / best


def prefill_tps(llm: object, gen: torch.Generator) -> float:
    times = []
    for _ in range(4):  # the first warms up
        prompts = vllm_gpu.random_prompts(PREFILL_PROMPTS, PREFILL_LEN, PROMPT_VOCAB, gen)
        started = time.perf_counter()
        vllm_gpu.greedy(llm, prompts, 1)
        times.append(time.perf_counter() - started)
    return PREFILL_PROMPTS * PREFILL_LEN / min(times[1:])


def host_profile(llm: object, batch: int, gen: torch.Generator) -> dict[str, object]:
    """Host time of ``PROFILE_STEPS`` greedy steps at ``batch`` (after the prompt's step, timed apart): the wall
    time per step and the ops with the most self CPU time per step (us)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = vllm_gpu.random_prompts(batch, DECODE_PROMPT, PROMPT_VOCAB, gen)
    vllm_gpu.greedy(llm, prompts, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        vllm_gpu.greedy(llm, prompts, PROFILE_STEPS + 1)
        wall = time.perf_counter() - started
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:PROFILE_TOP]
    return {"wall_ms_per_step": 1e3 * wall / PROFILE_STEPS,
            "top_self_us_per_step": [(e.key, round(e.self_cpu_time_total / PROFILE_STEPS, 1),
                                      round(e.count / PROFILE_STEPS, 1)) for e in events]}  # fmt: skip


def child(spec: dict[str, object]) -> dict[str, object]:
    """One engine: build it, say so (``spec['built']``), wait for its turn (``spec['go']``), then measure."""
    from vllm import LLM

    from repack.vllm_plugin import register

    register()
    stats: dict[str, object] = {}
    hook_load(stats)
    started = time.perf_counter()
    llm = LLM(model=spec["model"], load_format=spec["load_format"], **vllm_gpu.KIT_ENGINE, **ENGINE,
              **MODES[spec["mode"]], **spec["memory"])  # fmt: skip
    stats["start_s"] = time.perf_counter() - started
    stats["kernels"] = llm.apply_model(vllm_gpu.linear_kernels)[0]
    print("RESULT " + json.dumps(stats), flush=True)  # what survives if the engine is killed before it measures
    Path(spec["built"]).touch()
    if not wait_for(Path(spec["go"]), spec["wait_s"]):
        stats["note"] = "measured without waiting for its turn"
    gen = torch.Generator().manual_seed(1)
    stats["logprobs"] = vllm_gpu.prompt_logprobs(llm, vllm_gpu.random_prompts(CHECK_PROMPTS, CHECK_LEN, PROMPT_VOCAB,
                                                                             gen)).tolist()  # fmt: skip
    rounds = 1 if spec["mode"] == "eager" else 2  # an eager step is 20-60 ms: one round is steady, two cost a minute
    stats["decode_tps"] = {str(b): decode_tps(llm, b, gen, rounds) for b in spec["batches"]}
    stats["prefill_tps"] = prefill_tps(llm, gen)
    if spec["profile"] and spec["mode"] == "eager":
        stats["profile"] = {str(b): host_profile(llm, b, gen) for b in PROFILE_BATCHES}
    return stats


def start_child(work: Path, job: Job, wave: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, Path]:
    """``child`` for ``job`` in a fresh process group and HOME, its output in ``work/logs``."""
    root = work / job.set
    spec = {"model": str(root / job.model), "load_format": "nvfp4_repack" if job.model == "bundle" else "auto",
            "mode": job.mode, "batches": [int(b) for b in args.batches.split(",")], "profile": args.profile_eager,
            "built": str(wave / f"{job.name}.built"), "go": str(wave / f"{job.name}.go"),
            "done": str(wave / f"{job.name}.done"),
            "wait_s": args.budget if math.isfinite(args.budget) else 3600.0,
            "memory": {} if args.parallel == 1 else {"kv_cache_memory_bytes": int(args.kv_gib * 2**30),
                                                     "gpu_memory_utilization": 0.05}}  # fmt: skip
    home = tempfile.mkdtemp(prefix=f"home-{job.name}-", dir=work)
    env = {**os.environ, "HOME": home, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = work / "logs" / f"{job.name}.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)  # fmt: skip
    return process, log


def result_of(log: Path, returncode: int | None) -> dict[str, object]:
    """A child's last ``RESULT`` (after its build, after its measures), with why it stopped if it did not finish
    (``returncode`` None: killed at the deadline)."""
    lines = log.read_text(errors="replace").splitlines()
    results = [line for line in lines if line.startswith("RESULT ")]
    stats = json.loads(results[-1][len("RESULT "):]) if results else {"tail": [line[:300] for line in lines[-15:]]}
    if returncode != 0 or "decode_tps" not in stats:
        stats["error"] = "killed at the deadline" if returncode is None else f"exit {returncode}"
    return stats


def run_wave(work: Path, jobs: list[Job], index: int, args: argparse.Namespace, deadline: float,
             gate: Path | None) -> dict[Job, dict[str, object]]:  # fmt: skip
    """Build the wave's engines at once; once all are built and the gate is open, let them measure one at a time,
    in the order of ``jobs``; kill what is left at the deadline."""
    wave = work / f"wave{index}"
    wave.mkdir(exist_ok=True)
    running = {job: start_child(work, job, wave, args) for job in jobs}
    results: dict[Job, dict[str, object]] = {}
    while running:
        for job, (process, log) in list(running.items()):
            if process.poll() is not None:
                results[job] = result_of(log, process.returncode)
                del running[job]
                report(job, results[job])
        built = all((wave / f"{job.name}.built").exists() for job in running)
        measuring = any((wave / f"{job.name}.go").exists() and not (wave / f"{job.name}.done").exists()
                        for job in running)  # fmt: skip
        gate_open = gate is None or gate.exists() or time.monotonic() > args.gate_by
        turn = next((job for job in jobs if job in running and not (wave / f"{job.name}.go").exists()), None)
        if built and not measuring and gate_open and turn is not None:
            (wave / f"{turn.name}.go").write_text(f"gate {'open' if gate is None or gate.exists() else 'timed out'}\n")
        if time.monotonic() > deadline:
            for job, (process, log) in running.items():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                results[job] = result_of(log, None)
                report(job, results[job])
            break
        time.sleep(1)
    return results


def report(job: Job, stats: dict[str, object]) -> None:
    shown = {k: v for k, v in stats.items() if k not in ("logprobs", "profile")}
    print(f"{job.name}: {shown}", flush=True)
    for batch, profile in stats.get("profile", {}).items():
        print(f"  host profile, batch {batch}: {profile['wall_ms_per_step']:.2f} ms per step; top self us per "
              f"step (op, us, calls): {profile['top_self_us_per_step']}", flush=True)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def table(results: dict[Job, dict[str, object]], batches: list[int]) -> str:
    """Markdown: one row per set, mode and measure, bf16 / source / bundle and the bundle's ratios."""
    rows = ["| set | mode | measure | bf16 | source (vLLM) | bundle | bundle / source | bundle / bf16 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    measures = [(f"decode tok/s, batch {b}", "decode_tps", str(b), "{:.0f}") for b in batches]
    measures += [("prefill tok/s (4 x 2000)", "prefill_tps", None, "{:.0f}"),
                 ("engine start s", "start_s", None, "{:.1f}"), ("model load s", "load_s", None, "{:.1f}"),
                 ("peak GPU GiB during load", "load_peak_gib", None, "{:.2f}"),
                 ("GPU GiB after load", "loaded_gib", None, "{:.2f}")]
    for set_name, mode in dict.fromkeys((job.set, job.mode) for job in results):
        by_model = {job.model: stats for job, stats in results.items() if (job.set, job.mode) == (set_name, mode)}

        def cell(model: str, key: str, sub: str | None) -> object:
            value = by_model.get(model, {}).get(key)
            return value.get(sub) if isinstance(value, dict) else value

        for label, key, sub, fmt in measures:
            values = {model: cell(model, key, sub) for model in ("bf16", "source", "bundle")}
            shown = [fmt.format(v) if isinstance(v, (int, float)) else "-" for v in values.values()]
            rows.append(f"| {set_name} | {mode} | {label} | {' | '.join(shown)} | "
                        f"{ratio(values['bundle'], values['source'])} | {ratio(values['bundle'], values['bf16'])} |")
        dense = by_model.get("bf16", {}).get("logprobs")
        for model in ("source", "bundle"):
            mine = by_model.get(model, {}).get("logprobs")
            if dense and mine:
                diff = float((torch.tensor(mine) - torch.tensor(dense)).abs().mean())
                rows.append(f"| {set_name} | {mode} | mean abs(logprob - bf16), {model} | | | | | {diff:.4f} |")
        for model, stats in by_model.items():
            rows.append(f"| {set_name} | {mode} | {model}: kernels / error | {stats.get('kernels', '')} "
                        f"{stats.get('error', '')} | | | | | |")
    return "\n".join(rows)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        spec = json.loads(sys.argv[2])
        print("RESULT " + json.dumps(child(spec)), flush=True)
        Path(spec["done"]).touch()  # the next engine's turn: this one's teardown is no part of its measures
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--jobs", default=DEFAULT_JOBS, help=f"SET:MODES:MODELS ... (default {DEFAULT_JOBS!r})")
    parser.add_argument("--prepare-only", action="store_true")
    parser.add_argument("--wait-ready", type=float, default=0.0, help="seconds to wait for each set's ready.json "
                        "(written by a --prepare-only run elsewhere); 0: prepare here")  # fmt: skip
    parser.add_argument("--parallel", type=int, default=1, help="engines built at once (one wave)")
    parser.add_argument("--kv-gib", type=float, default=4.0, help="KV cache per engine when --parallel > 1")
    parser.add_argument("--gate", type=Path, help="measure only once this file exists ...")
    parser.add_argument("--gate-wait", type=float, default=math.inf, help="... or this many seconds have passed")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--profile-eager", action="store_true", help="host profile of eager decode steps")
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds for all engines; later ones skip")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.parallel < 1:
        parser.error("--parallel must be at least 1")
    waves = [jobs[i : i + args.parallel] for jobs in parse_jobs(args.jobs) for i in range(0, len(jobs), args.parallel)]
    jobs = [job for wave in waves for job in wave]
    sets = {job.set: any(j.model == "bf16" for j in jobs if j.set == job.set) for job in jobs}
    if args.prepare_only:  # one process per set (CPU only: no CUDA in the forked children)
        with ProcessPoolExecutor(len(sets)) as pool:
            for info in pool.map(prepare, [args.work] * len(sets), sets, sets.values()):
                print(json.dumps(info), flush=True)
        return
    started = time.monotonic()
    deadline, args.gate_by = started + args.budget, started + args.gate_wait
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    info: dict[str, object] = {}
    results: dict[Job, dict[str, object]] = {}
    for index, wave in enumerate(waves):
        for name in dict.fromkeys(job.set for job in wave):
            if name not in info:
                ready = args.work / name / "ready.json"
                if args.wait_ready and not wait_for(ready, max(0.0, min(args.wait_ready, deadline - time.monotonic()))):
                    raise SystemExit(f"Error: {ready} did not appear in time")
                info[name] = json.loads(ready.read_text()) if ready.is_file() else prepare(args.work, name, sets[name])
                print(f"models {name}: {json.dumps(info[name])}", flush=True)
        if deadline - time.monotonic() < 60:
            results |= {job: {"error": "skipped: out of time"} for job in wave}
            continue
        results |= run_wave(args.work, wave, index, args, deadline, args.gate)
        if args.json:
            args.json.write_text(json.dumps({"models": info, "results": {job.name: stats for job, stats in
                                                                          results.items()}}, indent=1))  # fmt: skip
    print(table(results, [int(b) for b in args.batches.split(",")]))


if __name__ == "__main__":
    main()
