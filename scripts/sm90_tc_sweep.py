"""Check and time the warp-specialised tensor-core kernel (``triton_sm90.tc_linear``) on the H200.

    PYTHONPATH=. python3 scripts/sm90_tc_sweep.py --check      # correctness of every candidate config (odd shapes)
    PYTHONPATH=. python3 scripts/sm90_tc_sweep.py [--json out.json]   # time candidates against cuBLAS and ``linear``
    ncu --profile-from-start off ... python3 scripts/sm90_tc_sweep.py --profile   # hardware counters

The timing table has, per layer and M, cuBLAS on dequantized bf16 weights, the current dispatch (``linear``) and
each candidate ``TcConfig`` (split-K by the default heuristic); how the dispatch for 16 < M was chosen.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from bench_sm90 import SHAPES, make_layer, time_calls

from repack.runtime.backends import triton_sm90 as backend
from repack.runtime.backends.triton_sm90 import TcConfig
from repack.targets import RuntimeLayer, sm90

CANDIDATES = {  # M -> configs (bm, warpgroups, stages, programs per SM); the first is tc_config_for's
    32: [TcConfig(32, 1, 4, 4), TcConfig(32, 1, 4, 2), TcConfig(32, 1, 4, 3), TcConfig(32, 1, 3, 4)],
    64: [TcConfig(64, 1, 4, 2), TcConfig(64, 1, 3, 3), TcConfig(64, 1, 2, 4)],
    128: [TcConfig(128, 2, 4, 1), TcConfig(128, 1, 2, 2)],
    256: [TcConfig(128, 2, 4, 1), TcConfig(256, 2, 3, 1)],
    1024: [TcConfig(256, 2, 3, 1), TcConfig(128, 2, 4, 1)],
    4096: [TcConfig(256, 2, 3, 1), TcConfig(128, 2, 4, 1)],
}
PROFILE = [(64, TcConfig(64, 1, 4, 2)), (128, TcConfig(128, 2, 4, 1)), (4096, TcConfig(256, 2, 3, 1))]
CHECK_SHAPES = [(208, 336), (4096, 4096), (1040, 2064)]  # N, K multiples of 16, not all of 64/128/256
CHECK_MS = [17, 33, 64, 100, 128, 200, 256, 300]


def reference(x: torch.Tensor, tensors: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    w64 = sm90.dequantize_runtime(RuntimeLayer(**tensors, weights_padding_cols=0), n, k)
    return x.double() @ w64.T


def check() -> None:
    """Every candidate config (and split-K 1 and the default) on odd shapes against float64; outputs poisoned."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    worst = 0.0
    configs = sorted({c for cs in CANDIDATES.values() for c in cs}, key=str)
    for n, k in CHECK_SHAPES:
        specs = sm90.runtime_specs(n, k)
        np_, kp = sm90.padded_shape(n, k)
        nib = torch.randint(0, 16, (np_, kp), dtype=torch.uint8, device="cuda", generator=gen)
        nib[n:] = 0
        nib[:, k:] = 0
        scales = torch.randint(0x28, 0x70, (np_, kp // 16), dtype=torch.uint8, device="cuda", generator=gen)
        scales[n:] = 0
        scales[:, (k + 15) // 16 :] = 0
        tensors = {
            "weight": sm90.pack_words(nib.cpu()).cuda(),
            "weight_scale": sm90.pack_scales(scales.cpu().view(torch.float8_e4m3fn)).cuda(),
            "weight_global_scale": torch.tensor([1 / 2688], dtype=torch.float32, device="cuda"),
        }
        assert tensors["weight"].shape == specs["weight"].shape
        for m in CHECK_MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
            ref = reference(x, tensors, n, k)
            for config in configs:
                for split in (1, 3, None):
                    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    y = backend.tc_linear(x, **tensors, n=n, k=k, config=config, split_k=split, out=out)
                    err = ((y.double() - ref).norm() / ref.norm()).item()
                    worst = max(worst, err if err == err else float("inf"))
                    if not err < 1e-2:
                        print(f"FAIL {n}x{k} M={m} {config} split={split}: rel err {err:.3g}")
    for m, k in ((1, 4096), (37, 336), (300, 2064)):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        counters = torch.full((1500,), 7, dtype=torch.int32, device="cuda")
        kp = sm90.padded_shape(16, k)[1]
        same = torch.equal(backend.kslot_activations(x, kp, counters), backend.kslot_order(x, kp))
        if not same or counters.any():
            print(f"FAIL kslot_activations M={m} K={k}: same={same} counters zeroed={not counters.any()}")
    torch.cuda.synchronize()
    print(f"check done: worst relative error {worst:.3g}")


def timing(json_path: str | None, ms: list[int]) -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for n, k in SHAPES:
        layer = make_layer(n, k, l2, seed=n + k)
        for m, configs in CANDIDATES.items():
            if ms and m not in ms:
                continue
            xs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
            cublas = time_calls([lambda i=i: F.linear(xs[i % 2], layer.dense[i]) for i in range(len(layer.dense))])
            ncopy = len(layer.copies)
            current = time_calls(
                [lambda i=i: backend.linear(xs[i % 2], **layer.copies[i], n=n, k=k) for i in range(ncopy)]
            )
            row = {"n": n, "k": k, "m": m, "cublas_us": cublas * 1e6, "linear_us": current * 1e6, "tc_us": {}}
            for config in configs:
                try:
                    t = time_calls(
                        [
                            lambda i=i, c=config: backend.tc_linear(xs[i % 2], **layer.copies[i], n=n, k=k, config=c)
                            for i in range(ncopy)
                        ]
                    )
                    row["tc_us"][str(tuple(config.__dict__.values()))] = t * 1e6
                except Exception as exc:  # report and go on: one bad config must not hide the others
                    row["tc_us"][str(tuple(config.__dict__.values()))] = f"{type(exc).__name__}: {exc}"[:80]
            rows.append(row)
            tcs = " ".join(
                f"{c}={v:.1f}({cublas * 1e6 / v:.2f}x)" if isinstance(v, float) else f"{c}={v}"
                for c, v in row["tc_us"].items()
            )
            print(
                f"{n}x{k} M={m}: cuBLAS {cublas * 1e6:.1f} linear {current * 1e6:.1f} "
                f"({cublas / current:.2f}x) | {tcs}",
                flush=True,
            )
        del layer
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def profile() -> None:
    """One launch per ``PROFILE`` entry on 8192 x 8192 between cudaProfilerStart/Stop (for ``ncu
    --profile-from-start off``)."""
    layer = make_layer(8192, 8192, 0, seed=1)
    xs = [torch.randn(m, 8192, dtype=torch.bfloat16, device="cuda") for m, _ in PROFILE]
    for x, (_, config) in zip(xs, PROFILE):  # compile outside the profiled range
        backend.tc_linear(x, **layer.copies[0], n=8192, k=8192, config=config)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for x, (_, config) in zip(xs, PROFILE):
        backend.tc_linear(x, **layer.copies[0], n=8192, k=8192, config=config)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--ms", help="comma-separated M values to time (default: all of CANDIDATES)")
    args = parser.parse_args()
    if args.check:
        check()
    elif args.profile:
        profile()
    else:
        timing(args.json, [int(m) for m in args.ms.split(",")] if args.ms else [])


if __name__ == "__main__":
    main()
