"""Time programmatic dependent launch (PDL) of the tensor-core kernel, and both kernels at M = 9..16.

    PYTHONPATH=.:scripts python3 scripts/sm90_pdl_sweep.py [--ms 1,4,16,32,64,128,1024] [--json out.json]

One line per layer and M, in microseconds per call (CUDA-graph replays of back-to-back calls, as
``bench_sm90.py`` times them): cuBLAS on dequantized bf16 weights; the dispatch (``linear``) with PDL off and on;
with ``+producer``, each call preceded by an in-place ``x.mul_(1)`` so that a non-PDL kernel writes the
activations just before (as a norm or activation kernel would in a model) for cuBLAS, PDL off and on; at M = 9..16
also the decode kernel (``gemv``) and the tensor-core kernel (``tc``) on their own. Every candidate is first
compared with cuBLAS on the same inputs (WRONG past 1e-2); correctness proper is the GPU tests'.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F
from bench_sm90 import SHAPES, checked_time, make_layer, op_calls, time_calls, write_json

from repack.runtime.backends import triton_sm90 as backend


def with_pdl(pdl: bool, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def call(*args, **kwargs):
        backend.PDL = pdl
        try:
            return fn(*args, **kwargs)
        finally:
            backend.PDL = True

    return call


def candidates(m: int, n: int, k: int, sm_count: int) -> dict[str, Callable[..., torch.Tensor]]:
    """At M = 9 .. 16 both kernels in their configs for M (``uses_decode_kernel`` picks one of them)."""
    if not 8 < m <= backend.GEMV_MAX_M:
        return {}
    gemv, tc = backend.gemv_config_for(m, n, k, sm_count), backend.tc_config_for(m, n, k, sm_count)
    return {
        "gemv": lambda x, **kw: backend.gemv_linear(x, **kw, config=gemv),
        "tc": lambda x, **kw: backend.tc_linear(x, **kw, config=tc),
    }


def producer_calls(calls: list[Callable[[], object]], x: torch.Tensor) -> list[Callable[[], object]]:
    return [lambda call=call: (x.mul_(1.0), call()) for call in calls]


def timing(json_path: str | None, ms: list[int]) -> None:
    props = torch.cuda.get_device_properties(0)
    rows = []
    for n, k in SHAPES:
        layer = make_layer(n, k, props.L2_cache_size, seed=n + 3 * k)
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            dense = [lambda w=w: F.linear(x, w) for w in layer.dense]
            times = {
                "cublas": time_calls(dense),
                "pdl_off": time_calls(op_calls(layer, x, with_pdl(False, backend.linear))),
                "pdl_on": time_calls(op_calls(layer, x, backend.linear)),
                "cublas+producer": time_calls(producer_calls(dense, x)),
                "pdl_off+producer": time_calls(producer_calls(op_calls(layer, x, with_pdl(False, backend.linear)), x)),
                "pdl_on+producer": time_calls(producer_calls(op_calls(layer, x, backend.linear), x)),
            }
            ref = F.linear(x, layer.dense[0]).double()
            for name, fn in candidates(m, n, k, props.multi_processor_count).items():
                times[name] = checked_time(layer, x, fn, ref)
            us = {key: v * 1e6 if isinstance(v, float) else v for key, v in times.items()}
            rows.append({"n": n, "k": k, "m": m, "us": us})
            cells = " ".join(f"{key}={v:.1f}" if isinstance(v, float) else f"{key}=<{v}>" for key, v in us.items())
            print(f"{n}x{k} M={m}: {cells}", flush=True)
        del layer
        torch.cuda.empty_cache()
    write_json(json_path, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--ms", default="1,4,16,32,64,128,1024", help="comma-separated M values")
    args = parser.parse_args()
    timing(args.json, [int(m) for m in args.ms.split(",")])


if __name__ == "__main__":
    main()
