"""Time an online block transform ``x @ blockdiag(T)`` against the sm90 GEMM it precedes (Hopper GPU).

Llama-3.1-8B layers (N x K): q_proj / o_proj 4096 x 4096 and down_proj 4096 x 14336; M = 1, 16, 128; blocks of
16, 32, 64 and 128 (QuIP's ``transform_block_size``) and, for down_proj, the whole K (SpinQuant's R4 without a block
size: a dense 14336 x 14336 matrix). Three formulations of the transform, each checked against float64 first:

* ``matmul``: the runtime's ``block_transform`` (reshape, one batched matmul: cuBLAS);
* ``bcast-sum``: the same product as a broadcast multiply and a sum over the block, ``torch.compile``-d into one
  Triton kernel (any matrix);
* ``fwht``: a fast Walsh-Hadamard transform (log2(b) butterfly stages, compiled into one kernel); it only computes
  Sylvester's Hadamard matrix (llm-compressor's ``hadamard`` type), not ``random-hadamard``'s.

Times are CUDA-graph replays (bench_sm90's ``time_calls``: launch overhead excluded, as in a server's decode
graph); ``gemm+T`` is the transform and the GEMM in one graph, ``share`` = (gemm+T - gemm) / gemm.

    PYTHONPATH=. python3 scripts/bench_transforms.py [--json out.json]
"""

from __future__ import annotations

import argparse
import math

import torch

from repack.runtime.backends import triton_sm90 as backend
from repack.runtime.transforms import block_transform
from scripts.bench_sm90 import make_layer, time_calls, write_json

SHAPES = [(4096, 4096), (4096, 14336)]
MS = [1, 16, 128]
BLOCKS = [16, 32, 64, 128]
REL_TOL = 1e-2


def bcast_sum(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    blocks = x.unflatten(-1, (-1, matrix.shape[0])).unsqueeze(-1)
    return (blocks.float() * matrix.float()).sum(-2).flatten(-2).to(x.dtype)


def fwht(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ blockdiag(H_b / sqrt(b))`` for Sylvester's H_b, by butterflies (``matrix`` only gives b)."""
    b = matrix.shape[0]
    y = x.float().unflatten(-1, (-1, b))
    h = 1
    while h < b:
        pairs = y.unflatten(-1, (-1, 2, h))
        y = torch.stack((pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]), -2).flatten(-3)
        h *= 2
    return (y.flatten(-2) / math.sqrt(b)).to(x.dtype)


def sylvester(b: int, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def checked(fn, x: torch.Tensor, matrix: torch.Tensor, exact: torch.Tensor) -> bool:
    ref = (x.double().unflatten(-1, (-1, exact.shape[0])) @ exact).flatten(-2)
    err = float((fn(x, matrix).double() - ref).norm() / ref.norm())
    if not err < REL_TOL:
        raise AssertionError(f"{fn.__name__}: relative error {err:.2e}")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--formulations", default="matmul,bcast-sum,fwht", help="comma-separated subset")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    candidates = {"matmul": lambda: block_transform, "bcast-sum": lambda: torch.compile(bcast_sum, dynamic=True),
                  "fwht": lambda: torch.compile(fwht, dynamic=True)}
    formulations = {name: candidates[name]() for name in args.formulations.split(",")}
    rows = []
    print(f"{props.name}; times in microseconds (CUDA-graph replays)")
    print(f"{'N x K':>12} {'M':>4} {'block':>6} {'formulation':>11} {'gemm':>8} {'T':>8} {'gemm+T':>8} {'share':>7}")
    for n, k in SHAPES:
        layer = make_layer(n, k, l2, seed=n + k)
        blocks = BLOCKS + ([k] if k == 14336 else [])
        for m in MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            gemm = [lambda t=t, v=x: backend.linear(v, **t, n=n, k=k) for t in layer.copies]
            t_gemm = time_calls(gemm)
            for b in blocks:
                exact = sylvester(b, "cuda") / math.sqrt(b) if b <= 128 else None
                matrix = (exact if exact is not None else torch.randn(b, b, device="cuda") / math.sqrt(b)).to(
                    torch.bfloat16)
                for name, fn in formulations.items():
                    if b > 128 and name != "matmul":
                        continue  # a whole-K broadcast would be M*K*K elements; butterflies need Sylvester sizes
                    if exact is not None:
                        checked(fn, x, matrix, exact)
                    t_t = time_calls([lambda f=fn, v=x: f(v, matrix)])
                    t_both = time_calls([lambda t=t, f=fn, v=x: backend.linear(f(v, matrix), **t, n=n, k=k)
                                         for t in layer.copies])
                    share = (t_both - t_gemm) / t_gemm
                    rows.append(dict(n=n, k=k, m=m, block=b, formulation=name, gemm_us=t_gemm * 1e6,
                                     transform_us=t_t * 1e6, both_us=t_both * 1e6, share=share))
                    print(f"{f'{n} x {k}':>12} {m:>4} {b:>6} {name:>11} {t_gemm * 1e6:8.2f} {t_t * 1e6:8.2f} "
                          f"{t_both * 1e6:8.2f} {share:7.1%}", flush=True)
            write_json(args.json, rows)
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
