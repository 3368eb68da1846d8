"""Online transforms at run time: ``x -> x @ blockdiag(T, T, ...)`` on the last dimension.

Computed in the matrix's dtype and returned in the value's, as vLLM's dense transform path does (it holds ``T``
in the model dtype). A reshape and one batched matmul, so it traces under ``torch.compile(fullgraph=True)`` and
captures into CUDA graphs; see docs/benchmarks.md for its cost next to the GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


def block_transform(value: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``value @ blockdiag(matrix, ...)``: each consecutive block of ``matrix.shape[0]`` features times ``matrix``."""
    blocks = value.to(matrix.dtype).unflatten(-1, (-1, matrix.shape[0]))
    return (blocks @ matrix).flatten(-2).to(value.dtype)


def rows_transform(value: torch.Tensor, parts: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """``value`` with each ``[start, stop)`` range of its last dimension rotated by its own matrix
    (:func:`block_transform`), the other features as they are: output transforms on some partitions of a fused
    layer, or one matrix per partition size (vLLM's per-partition output transforms)."""
    pieces, edge = [], 0
    for start, stop, matrix in sorted(parts, key=lambda part: part[0]):
        pieces += [value[..., edge:start], block_transform(value[..., start:stop], matrix)]
        edge = stop
    return torch.cat([*pieces, value[..., edge:]], dim=-1)


@dataclass(frozen=True)
class WalshFactors:
    """``T == scale * diag(d1) @ H @ diag(d2)`` exactly, ``H`` Sylvester's Hadamard matrix of order ``block`` (the
    ``hadamard`` and ``random-hadamard`` types of compressed-tensors where their matrix is Sylvester's up to signs),
    ``d1``, ``d2`` in {+1, -1} with ``d1[0] = +1``: what a fast Walsh-Hadamard transform needs instead of ``T``."""

    block: int
    scale: float
    d1: tuple[int, ...]
    d2: tuple[int, ...]

    def key(self) -> str:
        """A string for the custom op's schema (a constant under ``torch.compile``): ``from_key``'s input."""
        bits = lambda d: format(sum(1 << i for i, v in enumerate(d) if v < 0), "x")  # noqa: E731
        return f"{self.block}:{self.scale.hex()}:{bits(self.d1)}:{bits(self.d2)}"

    @classmethod
    def from_key(cls, key: str) -> WalshFactors:
        block, scale, d1, d2 = key.split(":")
        b = int(block)
        signs = lambda h: tuple(-1 if int(h, 16) >> i & 1 else 1 for i in range(b))  # noqa: E731
        return cls(b, float.fromhex(scale), signs(d1), signs(d2))


@lru_cache(maxsize=64)
def walsh_from_key(key: str) -> WalshFactors:
    """``WalshFactors.from_key``, once per key (the custom op passes the key on every call)."""
    return WalshFactors.from_key(key)


def sylvester(block: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order ``block`` (a power of two), float64: ``(-1) ** popcount(i & j)``."""
    i = torch.arange(block)
    both, parity = i[:, None] & i[None, :], torch.zeros(block, block, dtype=torch.int64)
    while both.any():
        parity ^= both & 1
        both = both >> 1
    return 1.0 - 2.0 * parity.double()


def walsh_factors(matrix: torch.Tensor) -> WalshFactors | None:
    """``matrix`` as ``WalshFactors`` if it is one exactly (read once from the stored matrix), else None: a square
    power-of-two matrix whose entries all have one magnitude and whose signs factor as ``d1 H d2``."""
    b = matrix.shape[0]
    if matrix.dim() != 2 or matrix.shape[1] != b or b < 2 or b & (b - 1) or not matrix.is_floating_point():
        return None
    t = matrix.detach().to("cpu", torch.float64)
    scale = float(t[0, 0].abs())
    if scale == 0 or not bool((t.abs() == scale).all()):
        return None
    signs, h = t.sign(), sylvester(b)
    d2 = signs[0]  # normalised so that d1[0] = +1 (H's first row and column are all +1)
    d1 = signs[:, 0] * signs[0, 0]
    if not torch.equal(d1[:, None] * h * d2[None, :], signs):
        return None
    if bool((d2 < 0).all()):  # one sign for every output (random-hadamard's d1[0] = -1): into the scale
        scale, d2 = -scale, -d2
    return WalshFactors(b, scale, tuple(int(v) for v in d1), tuple(int(v) for v in d2))
