"""vLLM serving on a Hopper GPU: an NVFP4 source (vLLM's own load and default kernel) vs its sm90 bundle (the
``nvfp4_repack`` loader and this project's kernel) vs the same weights dequantized to bf16.

    PYTHONPATH=.:/tmp/site python3 scripts/bench_vllm_serve.py --work /tmp/bench [--layers 32] [--shape 8b]
        [--modes default,eager] [--models bundle,source,bf16] [--batches 1,8,32,128] [--json out.json]
    PYTHONPATH=.:/tmp/site python3 scripts/bench_vllm_serve.py --work /tmp/bench --prepare-only   # models only

Models (``--prepare-only`` writes them; a run reuses what ``WORK/ready.json`` records, ``--wait-ready`` waits for
a preparation running elsewhere): a compressed-tensors NVFP4A16 Llama of Llama-3-8B's (or 70B's) decoder shapes,
``--layers`` layers, vocab 128256, random weights of standard deviation about 0.01 (``tests/vllm_gpu.py``); its
bundle from the CLI (``convert --target sm90 --fuse --no-fsync``, timed); and its dequantized bf16 copy.

Each model and mode runs in a fresh process with a fresh HOME (cold vLLM compile, Triton and Humming caches) and
vLLM's engine in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the load can be measured):

* engine start: ``LLM(...)`` wall time (load, memory profiling, KV cache, torch.compile, CUDA graph capture);
* model load: the model runner's ``load_model`` wall time, and the peak of allocated GPU memory during it above what
  was allocated before (the source's load also holds its repack's temporaries);
* decode tok/s at each batch: ``batch x 128`` greedy tokens over the time between a 16-token and a 144-token
  generation of the same 32-token prompts (prefill and engine overhead cancel; best of 2);
* prefill tok/s: 4 fresh prompts of 2000 tokens, one output token (best of 3);
* prompt log-probabilities of 4 fixed prompts of 64 tokens: the mean |difference| to bf16's is printed.

Modes: ``default`` (vLLM's torch.compile and CUDA graphs), ``eager`` (``enforce_eager=True``). Engines: TRITON_ATTN,
``max_model_len`` 4096, ``max_num_batched_tokens`` 8192, ``max_num_seqs`` 128, prefix caching off, no tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests import vllm_gpu  # noqa: E402

SHAPES = {"8b": vllm_gpu.LLAMA3_8B, "70b": vllm_gpu.LLAMA3_70B}
VOCAB = 128256
MODES = {"default": {}, "eager": {"enforce_eager": True}}
ENGINE = dict(max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=128, enable_prefix_caching=False)
DECODE_PROMPT, DECODE_SHORT, DECODE_STEPS = 32, 16, 128
PREFILL_PROMPTS, PREFILL_LEN = 4, 2000
CHECK_PROMPTS, CHECK_LEN = 4, 64


def prepare(work: Path, shape: str, layers: int) -> dict[str, object]:
    """Write source, bundle and bf16 models into ``work`` (once: ``ready.json`` records them)."""
    ready = work / "ready.json"
    if ready.is_file():
        return json.loads(ready.read_text())
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    source = vllm_gpu.write_shaped_llama(work / "source", SHAPES[shape], layers, VOCAB, torch.Generator().manual_seed(0))
    written = time.perf_counter()
    subprocess.run([sys.executable, "-m", "repack.cli", "convert", str(source), "--target", "sm90", "--fuse",
                    "--no-fsync", "-o", str(work / "bundle")], check=True, cwd=ROOT)  # fmt: skip
    converted = time.perf_counter()
    vllm_gpu.write_dequantized(source, work / "bf16")
    info = {"shape": shape, "layers": layers, "write_source_s": written - started, "convert_s": converted - written,
            "write_bf16_s": time.perf_counter() - converted,
            "gb": {name: sum(f.stat().st_size for f in (work / name).glob("*.safetensors")) / 1e9
                   for name in ("source", "bundle", "bf16")}}  # fmt: skip
    ready.write_text(json.dumps(info, indent=1))
    return info


def wait_ready(work: Path, seconds: float) -> dict[str, object]:
    deadline = time.monotonic() + seconds
    while not (work / "ready.json").is_file():
        if time.monotonic() > deadline:
            raise SystemExit(f"Error: {work}/ready.json did not appear within {seconds:.0f} s")
        time.sleep(5)
    return json.loads((work / "ready.json").read_text())


def hook_load(stats: dict[str, float]) -> None:
    """Time the model runner's ``load_model`` and read the allocator's peak during it (vLLM 0.33 has two model
    runners, ``v1/worker/gpu/model_runner.py`` the one its GPU worker built here: both are wrapped)."""
    import importlib

    for module in ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"):
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


def decode_tps(llm: object, batch: int, gen: torch.Generator) -> float:
    prompts = vllm_gpu.random_prompts(batch, DECODE_PROMPT, VOCAB, gen)

    def seconds(tokens: int) -> float:
        started = time.perf_counter()
        vllm_gpu.greedy(llm, prompts, tokens)
        return time.perf_counter() - started

    seconds(4)
    best = min(seconds(DECODE_SHORT + DECODE_STEPS) - seconds(DECODE_SHORT) for _ in range(2))
    return batch * DECODE_STEPS / best


def prefill_tps(llm: object, gen: torch.Generator) -> float:
    times = []
    for _ in range(4):  # the first warms up
        prompts = vllm_gpu.random_prompts(PREFILL_PROMPTS, PREFILL_LEN, VOCAB, gen)
        started = time.perf_counter()
        vllm_gpu.greedy(llm, prompts, 1)
        times.append(time.perf_counter() - started)
    return PREFILL_PROMPTS * PREFILL_LEN / min(times[1:])


def child(model: str, load_format: str, mode: str, batches: list[int]) -> dict[str, object]:
    """One engine: start, load, speed and prompt log-probabilities (runs in its own process)."""
    from vllm import LLM

    from repack.vllm_plugin import register

    register()
    stats: dict[str, object] = {}
    hook_load(stats)
    started = time.perf_counter()
    llm = LLM(model=model, load_format=load_format, **vllm_gpu.KIT_ENGINE, **ENGINE, **MODES[mode])
    stats["start_s"] = time.perf_counter() - started
    stats["kernels"] = llm.apply_model(vllm_gpu.linear_kernels)[0]
    gen = torch.Generator().manual_seed(1)
    stats["logprobs"] = vllm_gpu.prompt_logprobs(llm, vllm_gpu.random_prompts(CHECK_PROMPTS, CHECK_LEN, VOCAB, gen)).tolist()
    stats["decode_tps"] = {str(b): decode_tps(llm, b, gen) for b in batches}
    stats["prefill_tps"] = prefill_tps(llm, gen)
    return stats


def run_child(work: Path, name: str, mode: str, batches: list[int], timeout: float, logs: Path) -> dict[str, object]:
    """``child`` in a fresh process and HOME; its result, or the error and the log's tail."""
    model, load_format = (work / "bundle", "nvfp4_repack") if name == "bundle" else (work / name, "auto")
    home = tempfile.mkdtemp(prefix=f"home-{mode}-{name}-", dir=work)
    env = {**os.environ, "HOME": home, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = logs / f"{mode}-{name}.log"
    command = [sys.executable, __file__, "--child", str(model), load_format, mode, ",".join(map(str, batches))]
    try:
        with log.open("w") as out:
            subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = log.read_text().splitlines()
    results = [line for line in lines if line.startswith("RESULT ")]
    if not results:
        return {"error": "no result", "tail": lines[-40:]}
    return json.loads(results[-1][len("RESULT "):])


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def table(results: dict[str, dict[str, dict]], batches: list[int]) -> str:
    """Markdown: one row per mode and measure, bf16 / source / bundle and the bundle's ratios."""
    rows = ["| mode | measure | bf16 | source (vLLM) | bundle | bundle / source | bundle / bf16 |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode, by_model in results.items():
        def cell(name, key, sub=None):
            value = by_model.get(name, {}).get(key)
            return value.get(sub) if isinstance(value, dict) else value

        measures = [(f"decode tok/s, batch {b}", "decode_tps", str(b), "{:.0f}") for b in batches]
        measures += [("prefill tok/s (4 x 2000)", "prefill_tps", None, "{:.0f}"), ("engine start s", "start_s", None, "{:.1f}"),
                     ("model load s", "load_s", None, "{:.1f}"), ("peak GPU GiB during load", "load_peak_gib", None, "{:.2f}"),
                     ("GPU GiB after load", "loaded_gib", None, "{:.2f}")]  # fmt: skip
        for label, key, sub, fmt in measures:
            values = {name: cell(name, key, sub) for name in ("bf16", "source", "bundle")}
            shown = [fmt.format(v) if isinstance(v, (int, float)) else "-" for v in values.values()]
            rows.append(f"| {mode} | {label} | {' | '.join(shown)} | {ratio(values['bundle'], values['source'])} | "
                        f"{ratio(values['bundle'], values['bf16'])} |")
        dense = by_model.get("bf16", {}).get("logprobs")
        for name in ("source", "bundle"):
            mine = by_model.get(name, {}).get("logprobs")
            if dense and mine:
                diff = (torch.tensor(mine) - torch.tensor(dense)).abs().mean()
                rows.append(f"| {mode} | mean abs(logprob - bf16), {name} | | | | | {float(diff):.4f} |")
        for name, stats in by_model.items():
            rows.append(f"| {mode} | {name}: kernels / error | {stats.get('kernels', '')} {stats.get('error', '')} | | | | |")
    return "\n".join(rows)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        model, load_format, mode, batches = sys.argv[2:6]
        print("RESULT " + json.dumps(child(model, load_format, mode, [int(b) for b in batches.split(",")])), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prepare-only", action="store_true")
    parser.add_argument("--wait-ready", type=float, default=0.0, help="seconds to wait for WORK/ready.json")
    parser.add_argument("--modes", default="default,eager")
    parser.add_argument("--models", default="bundle,source,bf16")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds for all engines; later ones skip")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.prepare_only:
        print(json.dumps(prepare(args.work, args.shape, args.layers)))
        return
    info = wait_ready(args.work, args.wait_ready) if args.wait_ready else prepare(args.work, args.shape, args.layers)
    print("models:", json.dumps(info), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    deadline = time.monotonic() + args.budget
    results: dict[str, dict[str, dict]] = {}
    for mode in args.modes.split(","):
        for name in args.models.split(","):
            left = deadline - time.monotonic()
            if left < 60:
                results.setdefault(mode, {})[name] = {"error": "skipped: out of time"}
                continue
            started = time.perf_counter()
            results.setdefault(mode, {})[name] = stats = run_child(args.work, name, mode, batches, min(left, 420), logs)
            print(f"{mode} {name}: {time.perf_counter() - started:.0f} s "
                  f"{ {k: v for k, v in stats.items() if k != 'logprobs'} }", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"models": info, "results": results}, indent=1))
    print(table(results, batches))


if __name__ == "__main__":
    main()
