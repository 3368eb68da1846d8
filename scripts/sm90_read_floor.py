"""Measure the decode goals' floor: the time to merely read a layer's sm90 bytes, timed like the benchmark.

    PYTHONPATH=.:scripts python3 scripts/sm90_read_floor.py [--json out.json]

``bench_sm90.py``'s physical limit is bytes / copy bandwidth, the bandwidth of one 4 GB copy: it leaves out what
every kernel of a few microseconds pays (launch, the first loads' latency, the last wave's tail). Here a streaming
read kernel (16-byte loads, one int32 written per program; the fastest of a few work splits) reads exactly the
layer's weight and scale bytes, in the same CUDA-graph replays of back-to-back calls over copies that defeat L2, so
its time is the least any M = 1 kernel can take on this machine. One line per layer: the read floor, the op at
M = 1 and cuBLAS, and what they imply for the goals (speedup over cuBLAS, share of copy bandwidth).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_sm90 import SHAPES, copy_bandwidth, make_layer, op_calls, time_calls, write_json

from repack.runtime.backends import triton_sm90 as backend

SPLITS = [(4096, 4), (8192, 8), (16384, 8)]  # (int32 per program, warps)


@triton.jit
def _read_kernel(w_ptr, s_ptr, out_ptr, NW, NS, BLOCK: tl.constexpr):
    """Program p reads int32 block p of the words, then (past them) of the scales; writes their xor."""
    pid = tl.program_id(0)
    w_blocks = tl.cdiv(NW, BLOCK)
    offs = tl.arange(0, BLOCK)
    if pid < w_blocks:
        idx = pid.to(tl.int64) * BLOCK + offs
        v = tl.load(w_ptr + idx, mask=idx < NW, other=0)
    else:
        idx = (pid - w_blocks).to(tl.int64) * BLOCK + offs
        v = tl.load(s_ptr + idx, mask=idx < NS, other=0)
    tl.store(out_ptr + pid, tl.reduce(v, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_calls(tensors: list[dict[str, torch.Tensor]], block: int, warps: int) -> list:
    """One streaming-read launch per weight copy."""
    first = tensors[0]
    nw, ns = first["weight"].numel(), first["weight_scale"].numel() // 4
    programs = triton.cdiv(nw, block) + triton.cdiv(ns, block)
    out = torch.empty(programs, dtype=torch.int32, device="cuda")
    return [
        lambda t=t: _read_kernel[(programs,)](t["weight"], t["weight_scale"].view(torch.int32), out, nw, ns,
                                              BLOCK=block, num_warps=warps)  # fmt: skip
        for t in tensors
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the numbers to this file")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    print(f"{props.name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| N x K | MB read | read floor (us) | floor % of copy BW | op M=1 (us) | op / floor | cuBLAS M=1 (us) "
          "| cuBLAS / floor (best speedup) | cuBLAS / op |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for n, k in SHAPES:
        layer = make_layer(n, k, props.L2_cache_size, seed=n * 31 + k)
        floor = min(time_calls(read_calls(layer.copies, block, warps)) for block, warps in SPLITS)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        op = time_calls(op_calls(layer, x, backend.linear))
        cublas = time_calls([lambda w=w: F.linear(x, w) for w in layer.dense])
        nbytes = layer.quant_bytes
        row = {"n": n, "k": k, "bytes": nbytes, "floor_us": floor * 1e6, "op_us": op * 1e6, "cublas_us": cublas * 1e6}
        rows.append(row)
        print(f"| {n}x{k} | {nbytes / 1e6:.1f} | {floor * 1e6:.1f} | {100 * nbytes / floor / bandwidth:.0f}% "
              f"| {op * 1e6:.1f} | {op / floor:.2f} | {cublas * 1e6:.1f} | {cublas / floor:.2f}x "
              f"| {cublas / op:.2f}x |", flush=True)  # fmt: skip
        del layer
        torch.cuda.empty_cache()
    write_json(args.json, {"device": props.name, "copy_bw": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
