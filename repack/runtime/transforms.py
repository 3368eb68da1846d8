"""Online transforms at run time: ``x -> x @ blockdiag(T, T, ...)`` on the last dimension.

Computed in the matrix's dtype and returned in the value's, as vLLM's dense transform path does (it holds ``T``
in the model dtype). A reshape and one batched matmul, so it traces under ``torch.compile(fullgraph=True)`` and
captures into CUDA graphs; see docs/benchmarks.md for its cost next to the GEMM.
"""

from __future__ import annotations

import torch


def block_transform(value: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``value @ blockdiag(matrix, ...)``: each consecutive block of ``matrix.shape[0]`` features times ``matrix``."""
    blocks = value.to(matrix.dtype).unflatten(-1, (-1, matrix.shape[0]))
    return (blocks @ matrix).flatten(-2).to(value.dtype)
