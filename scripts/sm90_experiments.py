"""Scratch measurements behind the sm90 decode kernel (H200): copy bandwidth, a loads-only stream kernel and
the work splits of ``triton_sm90.gemv_linear`` at M = 1 and 16, against cuBLAS, on rotating weight copies.

    PYTHONPATH=. python3 scripts/sm90_experiments.py [--json out.json] [--best-config-file best.txt]

Prints one table per part. ``--best-config-file`` receives, for M = 1 and M = 16, the work split
(``spt,chunks,warps,maxnreg``: ``GemvConfig``) with the lowest geometric-mean time over every shape, as
``bench_sm90.py --gemv`` takes them.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from bench_sm90 import REL_TOL, SHAPES, copy_bandwidth, make_layer, time_calls, write_json
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from repack.runtime.backends import triton_sm90 as backend
from repack.runtime.backends.triton_sm90 import GemvConfig

GEMV_CONFIGS = {  # per M: spt, chunks, warps, maxnreg (0: ptxas default, which sinks loads next to their use)
    1: [GemvConfig(*c) for c in [(1, 2, 8, 0), (1, 4, 4, 96), (1, 2, 8, 64), (1, 4, 8, 128), (1, 8, 4, 168),
                                 (2, 2, 8, 96), (2, 4, 4, 168), (1, 2, 4, 64)]],
    16: [GemvConfig(*c) for c in [(1, 2, 8, 0), (1, 2, 4, 96), (1, 2, 8, 96), (2, 2, 4, 128), (2, 2, 8, 128),
                                  (1, 4, 4, 168), (2, 1, 8, 96)]],
}  # fmt: skip
STREAM_CONFIGS = [GemvConfig(1, 1, 8), GemvConfig(1, 2, 8)]
STREAM_SHAPES = [(8192, 8192), (57344, 8192)]


@gluon.jit
def _stream_kernel(w_ptr, s_ptr, y_ptr, KCH, SPT: gl.constexpr, C_T: gl.constexpr, WK: gl.constexpr):
    """The decode kernel's weight and scale loads only, folded into a sum so that they stay live."""
    CK: gl.constexpr = C_T * WK
    L4: gl.constexpr = gl.BlockedLayout([SPT, C_T, 1, 4], [1, 1, 32, 1], [1, WK, 1, 1], [3, 2, 1, 0])
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    s0 = gl.program_id(0) * SPT
    acc = gl.zeros([SPT, CK, 32, 4], gl.int32, L4)
    sacc = gl.zeros([SPT, CK, 32], gl.int32, L3)
    for c in range(0, KCH, CK):
        c4 = c + backend._idx4(CK, 1, L4)
        w_off = (s0 + backend._idx4(SPT, 0, L4)) * KCH + c4
        w_off = w_off * 128 + backend._idx4(32, 2, L4) * 4 + backend._idx4(4, 3, L4)
        c3 = c + backend._idx3(CK, 1, L3)
        s_off = ((s0 + backend._idx3(SPT, 0, L3)) * KCH + c3) * 32 + backend._idx3(32, 2, L3)
        acc = acc ^ gl.load(w_ptr + w_off, mask=c4 < KCH)
        sacc = sacc ^ gl.load(s_ptr + s_off, mask=c3 < KCH).to(gl.int32)
    total = gl.sum(gl.sum(gl.sum(gl.sum(acc, axis=3), axis=2), axis=1), axis=0) + gl.sum(gl.sum(gl.sum(sacc, 2), 1), 0)
    gl.store(y_ptr + gl.program_id(0), total)


def stream(tensors: dict[str, torch.Tensor], config: GemvConfig, out: torch.Tensor) -> None:
    weight = tensors["weight"]
    _stream_kernel[(weight.shape[0] // config.spt,)](
        weight, tensors["weight_scale"].view(torch.uint16), out, weight.shape[1] // 128,
        SPT=config.spt, C_T=config.chunks, WK=config.num_warps, num_warps=config.num_warps,
    )  # fmt: skip


def name(config: GemvConfig) -> str:
    return f"{config.spt},{config.chunks},{config.num_warps},{config.maxnreg}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--best-config-file")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs; copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    report: dict = {"copy_bw": bandwidth, "stream": {}, "gemv": {}, "cublas": {}}
    log_times = {m: {name(c): [] for c in configs} for m, configs in GEMV_CONFIGS.items()}
    for n, k in SHAPES:
        layer = make_layer(n, k, props.L2_cache_size, seed=n + k)
        quant = layer.quant_bytes
        if (n, k) in STREAM_SHAPES:
            sink = torch.empty(layer.copies[0]["weight"].shape[0], dtype=torch.int32, device="cuda")
            for config in STREAM_CONFIGS:
                t = time_calls([lambda tt=tt, c=config: stream(tt, c, sink) for tt in layer.copies])
                report["stream"][f"{n}x{k} {name(config)}"] = t * 1e6
                print(f"stream {n}x{k} {name(config)}: {t * 1e6:.1f} us, {100 * quant / t / bandwidth:.0f}% of copy BW",
                      flush=True)  # fmt: skip
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x, layer.dense[0]).double()
            t_dense = time_calls([lambda w=w: F.linear(x, w) for w in layer.dense])
            report["cublas"][f"{n}x{k}x{m}"] = t_dense * 1e6
            row = []
            for config in GEMV_CONFIGS[m]:
                fn = lambda x, c=config, **kw: backend.gemv_linear(x, **kw, config=c)
                try:
                    y = fn(x, **layer.copies[0], n=n, k=k).double()
                except Exception as error:  # a candidate that does not compile is reported, not fatal
                    print(f"FAILED {name(config)}: {type(error).__name__}: {str(error)[-600:]}", flush=True)
                    log_times[m][name(config)].append(float("inf"))
                    continue
                err = float((y - ref).norm() / ref.norm())
                if not math.isfinite(err) or err >= REL_TOL:
                    print(f"WRONG {n}x{k} M={m} {name(config)}: relative error {err:.3e}", flush=True)
                    log_times[m][name(config)].append(float("inf"))
                    continue
                t = time_calls([lambda tt=tt: fn(x, **tt, n=n, k=k) for tt in layer.copies])
                report["gemv"][f"{n}x{k}x{m} {name(config)}"] = (t * 1e6, err)
                log_times[m][name(config)].append(math.log(t))
                row.append(f"{name(config)} {t * 1e6:.1f}")
            best = min(((v[0], key.split(" ")[1]) for key, v in report["gemv"].items() if key.startswith(f"{n}x{k}x{m} ")),
                       default=(float("nan"), "none"))  # fmt: skip
            print(f"{n}x{k} M={m}: cuBLAS {t_dense * 1e6:.1f} us | " + " | ".join(row)
                  + f" || best {best[1]} {best[0]:.1f} us = {t_dense * 1e6 / best[0]:.2f}x, "
                  f"{100 * (quant + 2 * m * (n + k)) / (best[0] * 1e-6) / bandwidth:.0f}% BW", flush=True)  # fmt: skip
        write_json(args.json, report)
        del layer
        torch.cuda.empty_cache()
    best = []
    for m, times in log_times.items():
        geo = {key: math.exp(sum(v) / len(v)) * 1e6 for key, v in times.items() if v and all(map(math.isfinite, v))}
        print(f"M={m} geometric-mean us per config: "
              + ", ".join(f"{key} {v:.1f}" for key, v in sorted(geo.items(), key=lambda kv: kv[1])))  # fmt: skip
        best.append(min(geo, key=geo.get))
    if args.best_config_file:
        with open(args.best_config_file, "w") as f:
            f.write(";".join(best))

if __name__ == "__main__":
    main()
