"""Hardware-counter view of the sm90 kernels (H200): one launch of each dispatch path on one layer, between
cudaProfilerStart/Stop, for Nsight Compute started with ``--profile-from-start off``.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section Occupancy python3 scripts/sm90_profile.py [N K]
"""

from __future__ import annotations

import sys

import torch
from bench_sm90 import make_layer

from repack.runtime.backends import triton_sm90 as backend


def main() -> None:
    n, k = (int(v) for v in sys.argv[1:3]) if len(sys.argv) > 2 else (8192, 8192)
    layer = make_layer(n, k, 0, seed=1)
    tensors = layer.copies[0]
    xs = {m: torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for m in (1, 16, 64, 128)}
    for x in xs.values():  # compile outside the profiled range
        backend.linear(x, **tensors, n=n, k=k)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for m, x in xs.items():
        backend.linear(x, **tensors, n=n, k=k)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
