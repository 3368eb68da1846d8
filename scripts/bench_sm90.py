"""Benchmark the sm90 Triton W4A16 linear against bf16 cuBLAS and Humming on the same weights (Hopper GPU).

Two tables. First, the CPU time one eager call costs at M = 1, 32 and 128 (``--overhead-ms``: the decode kernel, then
the tensor-core kernel with its k-slot pass): ``F.linear`` and ``nn.Linear`` on bf16 weights, the op as a model
calls it (``PackedLinear``, ``nvfp4_linear``), the backend (``triton_sm90.linear``, the prepared per-layer path,
and that path with the tensor-core kernel through ``tc_linear`` instead of its prepared ``TcLaunch``),
the custom op's own dispatch, and Humming: host time of a burst of calls that the GPU queue absorbs without
blocking. Then, for each layer N x K and batch M, the median time of ``F.linear`` on the
weights dequantized to bf16 (cuBLAS), of ``triton_sm90.linear`` (the dispatching op), of Humming (the kernel
vLLM 0.33 picks for NVFP4 W4A16 on sm90, prepared and called as its ``HummingNvFp4LinearKernel`` does; skipped if
``humming`` is not importable), the speedups, and the op's achieved bandwidth against the device-to-device copy
bandwidth measured in the same run. Times are CUDA-graph replays of many calls, each call on another copy of the
weights so that the 60 MB L2 never holds them; the candidates are timed in turn three times and each keeps its
best (the same code moved by up to 9% between runs at large M, docs/benchmarks.md); every shape is first checked
against a float64 reference, the op and Humming alike.

    PYTHONPATH=.:scripts python3 scripts/bench_sm90.py [--json out.json] [--shapes 4096x4096,...] [--ms 1,16]
                                                       [--overhead-only] [--overhead-ms 1,32,128] [--profile]

``scripts/sm90_sweep.py`` times candidate work splits of either kernel (how ``gemv_config_for`` and
``tc_config_for`` were chosen).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from repack.runtime import PackedLinear, nvfp4_linear
from repack.runtime.backends import triton_sm90 as backend
from repack.runtime.backends.triton_sm90.dispatch import Prepared
from repack.targets import RuntimeLayer, sm90

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (10240, 8192), (57344, 8192), (8192, 28672)]
MS = [1, 4, 16, 32, 64, 128, 256, 1024, 4096]
REL_TOL = 1e-2
GRAPH_MS = 3.0  # device time per timed graph replay
REPEATS = 3  # interleaved timings of each candidate, best kept
OVERHEAD_SHAPES = [(4096, 4096), (14336, 4096)]
OVERHEAD_MS = (1, 32, 128)  # the decode kernel's launch, and the tensor-core kernel's (with its k-slot pass)
# vLLM 0.33's HummingNvFp4LinearKernel: compressed-tensors NVFP4 through humming's own loader, default compute config
HUMMING_QUANT = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "type": "float",
                 "num_bits": 4, "strategy": "group", "group_size": 16}  # fmt: skip
HUMMING_COMPUTE = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "dense"})


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


class Humming:
    """One layer for Humming: the canonical weight decoded from the sm90 tensors (the same function as the op's),
    stored as compressed-tensors does (``weight_global_scale`` is the reciprocal multiplier) and prepared by
    humming's loader with vLLM's padding (N to 256, K to 128), then called through ``humming_forward``."""

    def __init__(self, tensors: dict[str, torch.Tensor], n: int, k: int) -> None:
        from humming.schema import BaseWeightSchema, HummingInputSchema
        from humming.transform import prepare_layer_config, transform_humming_tensors

        w = sm90.from_runtime(RuntimeLayer(**tensors, weights_padding_cols=0), n, k)
        source = {"weight_packed": w.codes, "weight_scale": w.block_scales,
                  "weight_global_scale": torch.reciprocal(w.multiplier).reshape(1)}  # fmt: skip
        schema, prepared = BaseWeightSchema.from_config(HUMMING_QUANT).convert_humming(
            tensors=source, shape_n_stacks=[n], shape_k_stacks=[k], param_dtype=torch.bfloat16
        )
        self.config = prepare_layer_config(
            shape_n=n, shape_k=k, weight_schema=schema, input_schema=HummingInputSchema(), pad_n_to_multiple=256,
            pad_k_to_multiple=128, has_bias=False, torch_dtype=torch.bfloat16, device=w.codes.device,
        )  # fmt: skip
        self.tensors = transform_humming_tensors(self.config, prepared)
        self.hadamard = schema.hadamard_block_size
        self.locks = torch.zeros(1024, dtype=torch.int32, device=w.codes.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from humming.forward import humming_forward

        t = self.tensors
        return humming_forward(
            self.config, inputs=x, weight=t["weight"], weight_scale=t.get("weight_scale"),
            zero_point=t.get("zero_point"), bias=None, weight_scale_2=t.get("weight_scale_2"),
            hadamard_block_size=self.hadamard, locks=self.locks, compute_config=HUMMING_COMPUTE,
        )  # fmt: skip


def humming_available() -> bool:
    try:
        import humming  # noqa: F401
    except Exception as exc:  # a missing wheel, or one that cannot load its native launcher here
        print(f"Humming not importable, its column is skipped: {type(exc).__name__}: {exc}")
        return False
    return True


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


def check_layer(layer: Layer, humming: Humming | None) -> tuple[float, float]:
    """Worst relative errors of ``linear`` and of Humming against float64 over a few M (one dispatch path each)."""
    tensors = layer.copies[0]
    w64 = sm90.dequantize_runtime(RuntimeLayer(**tensors, weights_padding_cols=0), layer.n, layer.k)
    worst = [0.0, 0.0]
    for m in (1, 16, 64, 128, 1024):
        x = torch.randn(m, layer.k, dtype=torch.bfloat16, device="cuda")
        ref = x.double() @ w64.T
        candidates = [("op", backend.linear(x, **tensors, n=layer.n, k=layer.k))]
        if humming is not None:
            candidates.append(("Humming", humming(x)))
        for i, (name, y) in enumerate(candidates):
            err = float((y.double() - ref).norm() / ref.norm())
            if not torch.isfinite(y).all() or err >= REL_TOL:
                raise AssertionError(f"{name} {layer.n}x{layer.k} M={m}: relative error {err:.3e}")
            worst[i] = max(worst[i], err)
    del w64
    return worst[0], worst[1]


def host_us_per_call(call: Callable[[], object], calls: int = 200, repeats: int = 7) -> float:
    """Median host time per call of a burst of ``calls`` eager calls (the CPU cost: the GPU queue absorbs them
    without blocking, and each kernel takes less GPU time than its launch costs here), synchronised between bursts."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def overhead_rows(with_humming: bool, profile: bool = False, ms: Sequence[int] = OVERHEAD_MS) -> list[dict]:
    """Per-call CPU cost at each M of each way to call one layer, measured in turn on the same weights."""
    rows = []
    for (n, k), m in itertools.product(OVERHEAD_SHAPES, ms):
        layer = make_layer(n, k, 0, seed=n + k)
        tensors = layer.copies[0]
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        dense = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        dense.weight.data = layer.dense[0]
        packed = PackedLinear(RuntimeLayer(**tensors, weights_padding_cols=0), n, k, "sm90", "triton", x.device)
        prepared = backend.prepare(**tensors, n=n, k=k)
        through_run = Prepared(**tensors, n=n, k=k, prepared_tc=False)  # the tensor-core kernel as before TcLaunch
        args = (tensors["weight"], tensors["weight_scale"], tensors["weight_global_scale"], n, k, "sm90", "triton")
        calls = {
            "F.linear (bf16)": lambda: F.linear(x, dense.weight),
            "nn.Linear (bf16)": lambda: dense(x),
            "PackedLinear(x)": lambda: packed(x),
            "nvfp4_linear": lambda: nvfp4_linear(x, packed),
            "torch.ops.nvfp4_repack.linear": lambda: torch.ops.nvfp4_repack.linear(x, *args),
            "triton_sm90.linear": lambda: backend.linear(x, **tensors, n=n, k=k),
            "triton_sm90.prepare(...)(x)": lambda: prepared(x),
            "Prepared(prepared_tc=False)(x)": lambda: through_run(x),
        }
        if with_humming:
            humming = Humming(tensors, n, k)
            calls["Humming humming_forward"] = lambda: humming(x)
        ref = F.linear(x, dense.weight).double()
        for name, call in calls.items():
            y = call()
            err = float((y.double() - ref).norm() / ref.norm())
            assert err < REL_TOL, f"{name}: relative error {err:.2e}"
        times = {name: [] for name in calls}
        for _ in range(3):  # in turn, best kept, as the GPU tables do
            for name, call in calls.items():
                times[name].append(host_us_per_call(call))
        rows += [{"n": n, "k": k, "m": m, "call": name, "host_us": min(t)} for name, t in times.items()]
        if profile:
            profile_calls(calls["PackedLinear(x)"], f"PackedLinear(x), {n}x{k}, M = {m}")
        del layer
    return rows


def profile_calls(call: Callable[[], object], title: str, calls: int = 2000) -> None:
    """Where one call's CPU time goes: cProfile of a burst of calls, the top functions by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of {calls} calls of {title} (own time; profiling inflates every entry):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


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
    parser.add_argument("--shapes", help="layers NxK[,NxK...] (default: the seven Llama-3 shapes)")
    parser.add_argument("--ms", help="batch sizes M[,M...] (default: %s)" % ",".join(map(str, MS)))
    parser.add_argument("--overhead-only", action="store_true", help="only the per-call CPU cost table")
    parser.add_argument("--overhead-ms", default=",".join(map(str, OVERHEAD_MS)),
                        help="batch sizes of the per-call CPU cost table (1: the decode kernel, 32: tensor-core)")
    parser.add_argument("--profile", action="store_true", help="also a cProfile of PackedLinear(x) at each of them")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    ms = [int(m) for m in args.ms.split(",")] if args.ms else MS
    props = torch.cuda.get_device_properties(0)
    with_humming = humming_available()
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MB, torch {torch.__version__}")
    overhead_ms = [int(m) for m in args.overhead_ms.split(",")]
    overhead = overhead_rows(with_humming, args.profile, overhead_ms)
    report: dict = {"device": props.name, "overhead": overhead, "rows": []}
    print("\n| N x K | M | call | CPU us per call |\n| --- | --- | --- | --- |")
    for r in report["overhead"]:
        print(f"| {r['n']}x{r['k']} | {r['m']} | {r['call']} | {r['host_us']:.1f} |")
    write_json(args.json, report)
    if args.overhead_only:
        return
    bandwidth = copy_bandwidth()
    report["copy_bw"] = bandwidth
    print(f"device copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    for n, k in shapes:
        layer = make_layer(n, k, props.L2_cache_size, seed=n * 31 + k)
        hummings = [Humming(t, n, k) for t in layer.copies] if with_humming else []
        errs = check_layer(layer, hummings[0] if hummings else None)
        print(f"{n}x{k}: checked, worst relative error op {errs[0]:.2e}, Humming {errs[1]:.2e} (< {REL_TOL})", flush=True)
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            candidates = [[lambda w=w: F.linear(x, w) for w in layer.dense], op_calls(layer, x, backend.linear)]
            if hummings:
                candidates.append([lambda h=h: h(x) for h in hummings])
            t_dense, t_op, *t_hum = best_of_interleaved(candidates)
            moved = layer.quant_bytes + 2 * m * (k + n)
            row = {"n": n, "k": k, "m": m, "cublas_us": t_dense * 1e6, "op_us": t_op * 1e6, "speedup": t_dense / t_op,
                   "pct_copy_bw": 100 * moved / t_op / bandwidth}  # fmt: skip
            if t_hum:
                row |= {"humming_us": t_hum[0] * 1e6, "vs_humming": t_hum[0] / t_op}
            report["rows"].append(row)
        write_json(args.json, report)
        del layer, hummings
        torch.cuda.empty_cache()
    if report["rows"]:  # the table for docs/benchmarks.md
        print("\n| N x K | M | cuBLAS bf16 (us) | Humming (us) | sm90 W4A16 (us) | vs cuBLAS | vs Humming | % of copy BW |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in report["rows"]:
            hum, vs = (f"{r['humming_us']:.1f}", f"{r['vs_humming']:.2f}x") if "humming_us" in r else ("-", "-")
            print(f"| {r['n']}x{r['k']} | {r['m']} | {r['cublas_us']:.1f} | {hum} | {r['op_us']:.1f} | {r['speedup']:.2f}x "
                  f"| {vs} | {r['pct_copy_bw']:.0f}% |")  # fmt: skip


if __name__ == "__main__":
    main()
