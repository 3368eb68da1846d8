"""Scratch measurements behind the sm90 dense path (H200): dequantize kernel tiles, and dequantize + cuBLAS done
in L2-sized chunks of output features through one reused bf16 buffer, against plain cuBLAS and the current op.

    PYTHONPATH=. python3 scripts/sm90_dense_experiments.py [--json out.json] [--ms 64,128,...] [--chunks-mb 8,16,...]

Part 1 times ``dequantize`` alone per tile (rows, columns, warps) into a full-size buffer (HBM writes) and into
one L2-sized buffer rewritten for every chunk (the chunked path's writes). Part 2 times ``dense_linear`` per
chunk size (``0``: one chunk, the whole matrix) and M, and checks each result against the one-chunk result.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from bench_sm90 import SHAPES, copy_bandwidth, make_layer, time_calls

from repack.runtime.backends import triton_sm90 as backend

TILES = [(64, 256, 4), (128, 256, 8), (64, 128, 4), (128, 128, 4), (32, 256, 4), (64, 512, 8)]


def chunk_rows(mb: int, n: int, k: int) -> int | None:
    """Rows of a ``mb`` MiB bf16 chunk, a multiple of 128 (None: the whole matrix)."""
    if mb == 0:
        return None
    return max(128, (mb << 20) // (2 * k) // 128 * 128)


def part_dequant(layer, bandwidth: float, report: dict) -> None:
    n, k = layer.n, layer.k
    full = torch.empty((n, k), dtype=torch.bfloat16, device="cuda")
    rows = chunk_rows(16, n, k)
    chunk = torch.empty((rows, k), dtype=torch.bfloat16, device="cuda")
    cells = []
    for tile in TILES:
        to_full = [lambda t=t: backend.dequantize(**t, n=n, k=k, out=full, tile=tile) for t in layer.copies]

        def chunked(t, tile=tile):
            for n0 in range(0, n, rows):
                s0, s1 = n0 // 16, min(n, n0 + rows) // 16
                backend.dequantize(t["weight"][s0:s1], t["weight_scale"][s0:s1], t["weight_global_scale"],
                                   (s1 - s0) * 16, k, out=chunk[: (s1 - s0) * 16], tile=tile)  # fmt: skip

        to_l2 = [lambda t=t: chunked(t) for t in layer.copies]
        t_full, t_l2 = time_calls(to_full), time_calls(to_l2)
        moved = layer.quant_bytes + 2 * n * k
        cells.append((tile, t_full * 1e6, 100 * moved / t_full / bandwidth, t_l2 * 1e6))
    report[f"{n}x{k}"] = cells
    print(f"{n}x{k} dequantize: " + "; ".join(
        f"{b}x{c}w{w} {tf:.1f} us ({pct:.0f}% BW), 16MB-chunks {tl:.1f} us" for (b, c, w), tf, pct, tl in cells),
        flush=True)  # fmt: skip


def part_chunks(layer, ms: list[int], chunks_mb: list[int], report: dict) -> None:
    n, k = layer.n, layer.k
    for m in ms:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        t_cublas = time_calls([lambda w=w: F.linear(x, w) for w in layer.dense])
        t_op = time_calls([lambda t=t: backend.linear(x, **t, n=n, k=k) for t in layer.copies])
        one = backend.dense_linear(x, **layer.copies[0], n=n, k=k).double()
        row = {"cublas": t_cublas * 1e6, "op": t_op * 1e6}
        for mb in chunks_mb:
            rows = chunk_rows(mb, n, k)
            y = backend.dense_linear(x, **layer.copies[0], n=n, k=k, chunk_rows=rows).double()
            err = float((y - one).norm() / one.norm())
            if not torch.isfinite(y).all() or err > 1e-3:
                raise AssertionError(f"{n}x{k} M={m} chunk {mb} MB: relative error {err:.2e} against one chunk")
            calls = [lambda t=t, r=rows: backend.dense_linear(x, **t, n=n, k=k, chunk_rows=r) for t in layer.copies]
            row[f"{mb}MB"] = time_calls(calls) * 1e6
        report[f"{n}x{k}x{m}"] = row
        best = min((key for key in row if key.endswith("MB")), key=row.get)
        print(f"{n}x{k} M={m}: " + ", ".join(f"{key} {v:.1f}" for key, v in row.items())
              + f"  | best {best}: {t_cublas * 1e6 / row[best]:.2f}x cuBLAS", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--ms", default="64,128,256,512,1024,2048,4096")
    parser.add_argument("--chunks-mb", default="0,4,8,16,24,32")
    parser.add_argument("--skip-dequant", action="store_true")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    print(f"{props.name}, L2 {props.L2_cache_size >> 20} MB, copy BW {bandwidth / 1e12:.2f} TB/s", flush=True)
    report: dict = {"copy_bw": bandwidth, "dequant": {}, "chunks": {}}
    ms = [int(v) for v in args.ms.split(",")]
    chunks_mb = [int(v) for v in args.chunks_mb.split(",")]
    for n, k in SHAPES:
        layer = make_layer(n, k, props.L2_cache_size, seed=n * 31 + k)
        if not args.skip_dequant:
            part_dequant(layer, bandwidth, report["dequant"])
        part_chunks(layer, ms, chunks_mb, report["chunks"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
