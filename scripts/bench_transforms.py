"""Time an online block transform ``x @ blockdiag(T)`` against the sm90 GEMM it precedes (Hopper GPU).

Llama-3.1-8B layers (N x K): q_proj / o_proj 4096 x 4096, down_proj 4096 x 14336 and gate/up 14336 x 4096; M = 1,
8, 16, 128; blocks of 16, 32, 64 and 128 (QuIP's ``transform_block_size``) and, for down_proj, the whole K (SpinQuant's
R4 without a block size: a dense 14336 x 14336 matrix, never fused). T is a ``random-hadamard``-type matrix,
``diag(signs) @ H / sqrt(b)`` (Sylvester's H: what the in-kernel path takes, with its input signs, its costliest
case). Formulations, each checked against float64 first:

* ``pre-pass``: ``linear(x, transform=T)``: the transform in the activation pre-pass (the tensor-core kernel's
  k-slot pass; before the decode kernel, which launches with PDL and loads its first weights while the pre-pass
  runs): what the runtime runs for a general T;
* ``in-kernel`` (M <= 8 where its shared memory fits): ``gemv_linear(x, walsh=walsh_factors(T))``: the decode
  kernel alone, each program Walsh-transforming x once into shared memory before its loop;
* ``dispatch``: ``linear(x, transform=T, walsh=walsh_factors(T))``, what the runtime runs for Hadamard-type T:
  ``in-kernel`` where ``walsh_in_kernel`` says so, else ``pre-pass``;
* ``no-pdl`` (decode-kernel sizes only): the pre-pass, the decode kernel in plain stream order;
* ``matmul``: the separate ``block_transform`` (reshape, one batched matmul: cuBLAS), then the GEMM;
* ``bcast-sum``: the same product as a broadcast multiply and a sum over the block, ``torch.compile``-d into one
  Triton kernel (any matrix);
* ``fwht``: a fast Walsh-Hadamard transform (log2(b) butterfly stages, compiled into one kernel; Sylvester's H
  only, so checked against it, not T).

Times are CUDA-graph replays (bench_sm90's ``time_calls``: launch overhead excluded, as in a server's decode
graph), the GEMM alone and every formulation timed in turn, best of three (``best_of_interleaved``); ``gemm+T`` is
the transform and the GEMM in one graph, ``share`` = (gemm+T - gemm) / gemm.

    PYTHONPATH=. python3 scripts/bench_transforms.py [--json out.json] [--formulations pre-pass,in-kernel]
"""

from __future__ import annotations

import argparse
import math

import torch

from repack.runtime.backends import triton_sm90 as backend
from repack.runtime.transforms import block_transform, sylvester, walsh_factors
from scripts.bench_sm90 import best_of_interleaved, make_layer, write_json

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
MS = [1, 8, 16, 128]
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


def checked(name: str, y: torch.Tensor, x: torch.Tensor, exact: torch.Tensor, w64: torch.Tensor) -> None:
    """A formulation's output ``(x @ blockdiag(T)) @ W^T`` (weight copy 0) against float64, before it is timed."""
    ref = (x.double().unflatten(-1, (-1, exact.shape[0])) @ exact).flatten(-2) @ w64.T
    err = float((y.double() - ref).norm() / ref.norm())
    if not err < REL_TOL:
        raise AssertionError(f"{name}: relative error {err:.2e}")


def formulation_calls(name: str, fn, layer, x: torch.Tensor, matrix: torch.Tensor, m: int):
    """One graph's calls for ``name`` (one per weight copy, cycled against L2), or None where it does not apply."""
    n, k = layer.n, layer.k
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    decode = backend.uses_decode_kernel(m, n, sms)
    if name == "pre-pass":
        return [lambda t=t: backend.linear(x, **t, n=n, k=k, transform=matrix) for t in layer.copies]
    if not decode and name in ("in-kernel", "no-pdl"):
        return None
    config = backend.gemv_config_for(m, n, k, sms)
    walsh = walsh_factors(matrix)
    if name == "in-kernel":
        if m > 8 or backend.walsh_smem_bytes(m, k, config) > backend.MAX_SMEM:
            return None
        return [lambda t=t: backend.gemv_linear(x, **t, n=n, k=k, config=config, walsh=walsh) for t in layer.copies]
    if name == "dispatch":
        return [lambda t=t: backend.linear(x, **t, n=n, k=k, transform=matrix, walsh=walsh) for t in layer.copies]
    if name == "no-pdl":
        return [lambda t=t: backend.gemv_linear(backend.transformed_activations(x, matrix), **t, n=n, k=k,
                                                config=config) for t in layer.copies]  # fmt: skip
    return [lambda t=t: backend.linear(fn(x, matrix), **t, n=n, k=k) for t in layer.copies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--formulations", default="pre-pass,in-kernel", help="comma-separated subset")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="N x K, comma-separated")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    fused = ("pre-pass", "in-kernel", "dispatch", "no-pdl")
    candidates = {"matmul": lambda: block_transform, "bcast-sum": lambda: torch.compile(bcast_sum, dynamic=True),
                  "fwht": lambda: torch.compile(fwht, dynamic=True), **{name: lambda: None for name in fused}}
    formulations = {name: candidates[name]() for name in args.formulations.split(",")}
    rows = []
    print(f"{props.name}; times in microseconds (CUDA-graph replays, best of interleaved runs)")
    print(f"{'N x K':>12} {'M':>4} {'block':>6} {'formulation':>11} {'gemm':>8} {'gemm+T':>8} {'share':>7}")
    for n, k in (tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")):
        layer = make_layer(n, k, l2, seed=n + k)
        w64 = backend.dequantize(**layer.copies[0], n=n, k=k).double()
        blocks = BLOCKS + ([k] if k == 14336 and "matmul" in formulations else [])
        for m in MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            gemm = [lambda t=t: backend.linear(x, **t, n=n, k=k) for t in layer.copies]
            for b in blocks:
                signs = torch.randint(0, 2, (b, 1), generator=torch.Generator().manual_seed(b)).double() * 2 - 1
                exact = (signs * sylvester(b) / math.sqrt(b)).cuda() if b <= 128 else None
                matrix = (exact if exact is not None else torch.randn(b, b, device="cuda") / math.sqrt(b)).to(
                    torch.bfloat16)
                names, calls = [], []
                for name, fn in formulations.items():
                    if b > 128 and name != "matmul":
                        continue  # a whole-K broadcast would be M*K*K elements; butterflies need Sylvester sizes
                    chosen = formulation_calls(name, fn, layer, x, matrix, m)
                    if chosen is None:
                        continue
                    if exact is not None:  # fwht computes Sylvester's H alone
                        checked(name, chosen[0](), x, exact if name != "fwht" else exact / signs.cuda(), w64)
                    names.append(name)
                    calls.append(chosen)
                t_gemm, *t_both = best_of_interleaved([gemm, *calls])
                for name, t in zip(names, t_both):
                    share = (t - t_gemm) / t_gemm
                    rows.append(dict(n=n, k=k, m=m, block=b, formulation=name, gemm_us=t_gemm * 1e6,
                                     both_us=t * 1e6, share=share))  # fmt: skip
                    print(f"{f'{n} x {k}':>12} {m:>4} {b:>6} {name:>11} {t_gemm * 1e6:8.2f} {t * 1e6:8.2f} "
                          f"{share:7.1%}", flush=True)
            write_json(args.json, rows)
        del layer, w64
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
