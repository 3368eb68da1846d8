#!/usr/bin/env python3
"""Time the MoE layouts' ``to_runtime`` on random experts of DeepSeek-R1's shapes against a copy of the same bytes.

    PYTHONPATH=$PWD python scripts/bench_moe_layout.py [--experts 32] [--hidden 7168] [--intermediate 256]

Defaults: 32 of DeepSeek-R1's 256 experts at TP 8 (per-rank intermediate 2048 / 8); best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from repack.targets import moe_cutlass, moe_trtllm
from repack.targets.moe import ExpertStack


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    e, h, i = args.experts, args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(0)

    def codes(n, k):
        return torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)

    def scales(n, k):
        return torch.randint(1, 127, (e, n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)

    stack = ExpertStack(codes(2 * i, h), scales(2 * i, h), torch.rand(e, 2), torch.rand(e, 2), codes(h, i),
                        scales(h, i), torch.rand(e), torch.rand(e))
    parts = (stack.w13_codes, stack.w13_scales, stack.w2_codes, stack.w2_scales)
    mib = sum(t.numel() * t.element_size() for t in parts) / 2**20
    copy = best(lambda: [t.clone() for t in parts], args.repeat)
    for layout in (moe_cutlass, moe_trtllm):
        took = best(lambda: layout.to_runtime(stack), args.repeat)
        print(f"{layout.LAYOUT_ID}: {mib:.0f} MiB of experts, to_runtime {took * 1e3:.0f} ms, "
              f"copy {copy * 1e3:.0f} ms ({took / copy:.1f}x)")


if __name__ == "__main__":
    main()
