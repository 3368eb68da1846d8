"""Time candidate work splits of either sm90 kernel on the H200: how ``tc_config_for`` and ``gemv_config_for`` were
chosen (docs/benchmarks.md, rounds 1-7), and where a new candidate is tried before it becomes the default.

    PYTHONPATH=.:scripts python3 scripts/sm90_sweep.py [--kernel tc|gemv] [--shapes 4096x14336,...] [--ms 32,64]
                                                        [--splits 1,2,3,4] [--json out.json]
    ncu --profile-from-start off ... python3 scripts/sm90_sweep.py --profile   # tensor-core kernel counters

One line per layer and M: cuBLAS on dequantized bf16 weights, the current dispatch (``linear``) and each candidate
(``TcConfig`` for ``tc_linear``, split-K by the default heuristic, ``config/s`` with ``--splits``: forced to ``s``
splits; ``GemvConfig`` for ``gemv_linear``), each first compared with cuBLAS on the same inputs (WRONG past 1e-2
relative error). Correctness proper is the GPU tests'. The one-off scripts of rounds 1-7 (``sm90_experiments``,
``sm90_pdl_sweep``, ``sm90_profile``, ``sm90_read_floor``, ``sm90_sass``) are in git history before this file.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_sm90 import SHAPES, checked_time, make_layer, op_calls, time_calls, write_json

from repack.runtime.backends import triton_sm90 as backend
from repack.runtime.backends.triton_sm90 import GemvConfig, TcConfig

TC_CANDIDATES = {  # M -> configs (bm, warpgroups, stages, programs per SM)
    16: [TcConfig(16, 1, 4, 4)],
    32: [TcConfig(32, 1, 4, 4)],
    64: [TcConfig(64, 1, 4, 2)],
    128: [TcConfig(128, 1, 3, 2), TcConfig(64, 1, 4, 2), TcConfig(128, 2, 4, 1)],
    256: [TcConfig(128, 1, 3, 2), TcConfig(64, 1, 4, 2), TcConfig(256, 2, 3, 1), TcConfig(128, 2, 4, 1)],
    1024: [TcConfig(256, 2, 3, 1), TcConfig(128, 2, 4, 1), TcConfig(128, 2, 5, 1), TcConfig(128, 1, 3, 2)],
    4096: [TcConfig(256, 2, 3, 1), TcConfig(128, 2, 4, 1)],
}
GEMV_CANDIDATES = {  # M -> configs (stripes per program, chunks per warp, warps, maxnreg)
    m: [GemvConfig(1, 4, 8, 64), GemvConfig(1, 4, 4, 96), GemvConfig(1, 2, 8, 80), GemvConfig(1, 2, 4, 96)]
    for m in (1, 4, 8, 16)
}
PROFILE = [(16, TcConfig(16, 1, 4, 4)), (64, TcConfig(64, 1, 4, 2)), (128, TcConfig(128, 1, 3, 2)),
           (4096, TcConfig(256, 2, 3, 1))]


def candidate(kernel: str, config, split: int | None):
    if kernel == "gemv":
        return lambda x, **kw: backend.gemv_linear(x, **kw, config=config)
    return lambda x, **kw: backend.tc_linear(x, **kw, config=config, split_k=split)


def timing(json_path: str | None, kernel: str, ms: list[int], splits: list[int],
           shapes: list[tuple[int, int]] = SHAPES) -> None:  # fmt: skip
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for n, k in shapes:
        layer = make_layer(n, k, l2, seed=n + k)
        for m, configs in (GEMV_CANDIDATES if kernel == "gemv" else TC_CANDIDATES).items():
            if ms and m not in ms:
                continue
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            cublas = time_calls([lambda w=w: F.linear(x, w) for w in layer.dense])
            current = time_calls(op_calls(layer, x, backend.linear))
            row = {"n": n, "k": k, "m": m, "cublas_us": cublas * 1e6, "linear_us": current * 1e6, "candidates_us": {}}
            ref = F.linear(x, layer.dense[0]).double()  # dense[0] is copies[0] dequantized
            for config, split in [(c, s) for c in configs for s in [None, *(splits if kernel == "tc" else [])]]:
                name = str(tuple(config.__dict__.values())) + (f"/{split}" if split else "")
                t = checked_time(layer, x, candidate(kernel, config, split), ref)
                row["candidates_us"][name] = t * 1e6 if isinstance(t, float) else t
            rows.append(row)
            tcs = " ".join(
                f"{c}={v:.1f}({cublas * 1e6 / v:.2f}x)" if isinstance(v, float) else f"{c}={v}"
                for c, v in row["candidates_us"].items()
            )
            print(
                f"{n}x{k} M={m}: cuBLAS {cublas * 1e6:.1f} linear {current * 1e6:.1f} "
                f"({cublas / current:.2f}x) | {tcs}",
                flush=True,
            )
        del layer
        torch.cuda.empty_cache()
    write_json(json_path, rows)


def profile() -> None:
    """One launch per ``PROFILE`` entry on 8192 x 8192, each followed by cuBLAS on the same activations, between
    cudaProfilerStart/Stop (for ``ncu --profile-from-start off``)."""
    layer = make_layer(8192, 8192, 0, seed=1)
    xs = [torch.randn(m, 8192, dtype=torch.bfloat16, device="cuda") for m, _ in PROFILE]
    for x, (_, config) in zip(xs, PROFILE):  # compile (and let cuBLAS pick its kernels) outside the profiled range
        backend.tc_linear(x, **layer.copies[0], n=8192, k=8192, config=config)
        F.linear(x, layer.dense[0])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for x, (_, config) in zip(xs, PROFILE):
        backend.tc_linear(x, **layer.copies[0], n=8192, k=8192, config=config)
        F.linear(x, layer.dense[0])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--kernel", choices=("tc", "gemv"), default="tc")
    parser.add_argument("--json")
    parser.add_argument("--shapes", help="layers NxK[,NxK...] (default: the seven Llama-3 shapes)")
    parser.add_argument("--ms", help="comma-separated M values to time (default: all of the kernel's candidates)")
    parser.add_argument("--splits", default="", help="also time each candidate at these K splits (config/split)")
    args = parser.parse_args()
    if args.profile:
        profile()
    else:
        ms, splits = ([int(v) for v in text.split(",") if v] for text in (args.ms or "", args.splits))
        shapes = [tuple(map(int, v.split("x"))) for v in args.shapes.split(",")] if args.shapes else SHAPES
        timing(args.json, args.kernel, ms, splits, shapes)


if __name__ == "__main__":
    main()
