"""Torch ports of FlashInfer's CUDA-only (JIT-built) leaf calls, for the harness (which runs in the vLLM venv) and
tested against FlashInfer's own Python reference formulas by tests/test_moe.py. Imports only torch."""

from __future__ import annotations

import torch


def block_scale_interleave(sf: torch.Tensor) -> torch.Tensor:
    """Torch port of FlashInfer's ``blockScaleInterleaveHost`` (csrc/nv_internal/tensorrt_llm/thop/fp4Op.cpp, its
    CPU branch of ``BlockScaleInterleave``): per expert, zero-pad ``[rows, cols]`` to ``[round_up(rows, 128),
    round_up(cols, 4)]`` and put element ``(r, c)`` at ``get_sf_out_offset_128x4`` (quantization_utils.cuh) in a flat
    uint8 buffer of all experts one after another."""
    assert sf.dtype == torch.uint8 and sf.dim() in (2, 3), (sf.dtype, sf.shape)
    experts = sf.shape[0] if sf.dim() == 3 else 1
    rows, cols = sf.shape[-2:]
    rows_p, cols_p = (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
    e, r, c = torch.meshgrid(torch.arange(experts), torch.arange(rows_p), torch.arange(cols_p), indexing="ij")
    offset = (e * rows_p * cols_p + (r // 128) * ((cols_p // 4) * 512) + (c // 4) * 512 + (r % 32) * 16
              + ((r % 128) // 32) * 4 + c % 4)
    padded = torch.zeros((experts, rows_p, cols_p), dtype=torch.uint8)
    padded[:, :rows, :cols] = sf.reshape(experts, rows, cols)
    out = torch.empty(experts * rows_p * cols_p, dtype=torch.uint8)
    out[offset.reshape(-1)] = padded.reshape(-1)
    return out
