"""Benchmark the sm90 Triton W4A16 linear against bf16 cuBLAS on the same weights (Hopper GPU).

One run prints one table: for each layer N x K and batch M, the median time of ``F.linear`` on the
weights dequantized to bf16 (cuBLAS), of ``triton_sm90.linear`` (the dispatching op), the speedup,
and the op's achieved bandwidth against the device-to-device copy bandwidth measured in the same run.
Times are CUDA-graph replays of many calls, each call on another copy of the weights so that the
60 MB L2 never holds them; cuBLAS and the op are timed in turn three times and each keeps its best (the same
code moved by up to 9% between runs at large M, docs/benchmarks.md round 7); every shape is first checked against
a float64 reference.

    PYTHONPATH=. python3 scripts/bench_sm90.py [--json out.json] [--gemv SPT,CHUNKS,WARPS,MAXNREG[;...]]

``scripts/sm90_tc_sweep.py`` times the tensor-core kernel's candidate work splits (how ``tc_config_for`` was
chosen). ``--gemv`` replaces ``gemv_config_for`` (the decode kernel's work split) for this run, to time candidates
from ``scripts/sm90_experiments.py`` before making them the default: one ``GemvConfig`` for every M <= 16,
or two separated by ``;`` for M <= 8 and M = 9 .. 16.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from repack.runtime.backends import triton_sm90 as backend
from repack.runtime.backends.triton_sm90 import GemvConfig
from repack.targets import RuntimeLayer, sm90

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (10240, 8192), (57344, 8192), (8192, 28672)]
MS = [1, 4, 16, 32, 64, 128, 256, 1024, 4096]
REL_TOL = 1e-2
GRAPH_MS = 3.0  # device time per timed graph replay
REPEATS = 3  # interleaved timings of each candidate, best kept



@dataclass
class Layer:
    n: int
    k: int
    copies: list[dict[str, torch.Tensor]]  # sm90 runtime tensors, one dict per weight copy
    dense: list[torch.Tensor]  # the same weights dequantized to bf16, for cuBLAS

    @property
    def quant_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies[0].values())


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes read + written per second by a large device-to-device copy kernel (the physical ceiling here).

    Timed eagerly with events: a copy captured in a CUDA graph becomes a memcpy node that runs slower.
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(samples)


def time_calls(calls: list[Callable[[], object]]) -> float:
    """Median seconds per call: CUDA-graph replays of ``calls`` cycled, after a warm-up."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    end.synchronize()
    estimate_ms = start.elapsed_time(end) / len(calls)
    reps = max(len(calls), min(400, math.ceil(GRAPH_MS / max(estimate_ms, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    samples = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    del graph
    return statistics.median(samples) * 1e-3


def best_of_interleaved(candidates: list[list[Callable[[], object]]], repeats: int = REPEATS) -> list[float]:
    """Each candidate's fastest ``time_calls``, timed in turn ``repeats`` times: a slow stretch of the machine
    (clocks, power, a neighbour) then falls on every candidate, not on whichever ran during it."""
    times: list[list[float]] = [[] for _ in candidates]
    for _ in range(repeats):
        for samples, calls in zip(times, candidates):
            samples.append(time_calls(calls))
    return [min(samples) for samples in times]


def write_json(path: str | None, data: object) -> None:
    """Write ``data`` to ``path`` as indented JSON, if a path was given (the scripts' ``--json``)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def make_layer(n: int, k: int, l2_bytes: int, seed: int) -> Layer:
    """Random weights (random words are a valid layout: every bit pattern is a code) in enough copies to defeat L2."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    specs = sm90.runtime_specs(n, k)
    quant_bytes = sum(s.nbytes for s in specs.values())
    copies = []
    for _ in range(max(2, math.ceil(3 * l2_bytes / quant_bytes))):
        words = torch.randint(-(2**31), 2**31, specs["weight"].shape, dtype=torch.int32, device="cuda", generator=gen)
        scales = torch.randint(0x28, 0x70, specs["weight_scale"].shape, dtype=torch.uint8, device="cuda", generator=gen)
        mult = torch.tensor([1 / 2688], dtype=torch.float32, device="cuda")
        copies.append({"weight": words, "weight_scale": scales.view(torch.float8_e4m3fn), "weight_global_scale": mult})
    n_dense = max(2, math.ceil(3 * l2_bytes / (2 * n * k)))
    dense = [backend.dequantize(**copies[i % len(copies)], n=n, k=k) for i in range(n_dense)]
    return Layer(n, k, copies, dense)


def check_layer(layer: Layer) -> float:
    """Worst relative error of ``linear`` against float64 over a few M (one dispatch path each)."""
    tensors = layer.copies[0]
    w64 = sm90.dequantize_runtime(RuntimeLayer(**tensors, weights_padding_cols=0), layer.n, layer.k)
    worst = 0.0
    for m in (1, 16, 64, 128, 1024):
        x = torch.randn(m, layer.k, dtype=torch.bfloat16, device="cuda")
        y = backend.linear(x, **tensors, n=layer.n, k=layer.k)
        ref = x.double() @ w64.T
        err = float((y.double() - ref).norm() / ref.norm())
        if not torch.isfinite(y).all() or err >= REL_TOL:
            raise AssertionError(f"{layer.n}x{layer.k} M={m}: relative error {err:.3e}")
        worst = max(worst, err)
    del w64
    return worst


def op_calls(layer: Layer, x: torch.Tensor, fn: Callable[..., torch.Tensor]) -> list[Callable[[], object]]:
    return [lambda t=t: fn(x, **t, n=layer.n, k=layer.k) for t in layer.copies]


def checked_time(layer: Layer, x: torch.Tensor, fn: Callable[..., torch.Tensor], ref: torch.Tensor) -> float | str:
    """Seconds per call of candidate ``fn``, once its output on ``layer.copies[0]`` is within ``REL_TOL`` of
    ``ref``; otherwise (or if it fails to compile or run) a short reason, so that one bad candidate of a sweep
    does not hide the others."""
    try:
        err = float((fn(x, **layer.copies[0], n=layer.n, k=layer.k).double() - ref).norm() / ref.norm())
        if not err < REL_TOL:
            raise AssertionError(f"WRONG: relative error {err:.2e}")
        return time_calls(op_calls(layer, x, fn))
    except Exception as exc:  # reported in the sweep's table
        return f"{type(exc).__name__}: {exc}"[:80]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write all numbers to this file (rewritten after every shape)")
    parser.add_argument("--gemv", help="decode-kernel work split(s) SPT,CHUNKS,WARPS,MAXNREG[;...] (see above)")
    args = parser.parse_args()
    if args.gemv:
        small, *large = [GemvConfig(*map(int, part.split(","))) for part in args.gemv.split(";")]
        backend.gemv_config_for = lambda m, n, k, sm_count: small if m <= 8 or not large else large[0]
        print(f"decode kernel work split overridden: {args.gemv}")
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MB, torch {torch.__version__}")
    print(f"device copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    report: dict = {"device": props.name, "copy_bw": bandwidth, "rows": []}
    for n, k in SHAPES:
        layer = make_layer(n, k, props.L2_cache_size, seed=n * 31 + k)
        print(f"{n}x{k}: checked, worst relative error {check_layer(layer):.2e} (< {REL_TOL})", flush=True)
        for m in MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            t_dense, t_op = best_of_interleaved(
                [[lambda w=w: F.linear(x, w) for w in layer.dense], op_calls(layer, x, backend.linear)]
            )
            moved = layer.quant_bytes + 2 * m * (k + n)
            report["rows"].append({"n": n, "k": k, "m": m, "cublas_us": t_dense * 1e6, "op_us": t_op * 1e6,
                                   "speedup": t_dense / t_op, "pct_copy_bw": 100 * moved / t_op / bandwidth})  # fmt: skip
        write_json(args.json, report)
        del layer
        torch.cuda.empty_cache()
    if report["rows"]:  # the table for docs/benchmarks.md
        print("\n| N x K | M | cuBLAS bf16 (us) | sm90 W4A16 (us) | speedup | % of copy BW |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in report["rows"]:
            print(f"| {r['n']}x{r['k']} | {r['m']} | {r['cublas_us']:.1f} | {r['op_us']:.1f} | {r['speedup']:.2f}x "
                  f"| {r['pct_copy_bw']:.0f}% |")  # fmt: skip


if __name__ == "__main__":
    main()
