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


def gptq_marlin_repack(b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int,
                       is_a_8bit: bool = False) -> torch.Tensor:
    """Torch port of vLLM's CUDA ``gptq_marlin_repack`` (csrc/quantization/gptq_marlin/gptq_marlin_repack.cu, 4
    bits, no act-order), written from the kernel's own index arithmetic: thread ``th`` of warp ``w`` in k tile
    ``kt``, n tile ``nt`` reads the codes ``vals[i]`` at ``k = tc_row + (0, 1, 8, 9)[i % 4]``, ``n = 16 w + th // 4
    (+ 8 for i >= 4)``, ``tc_row = 2 (th % 4)``, and writes ``sum(vals[pack_idx[j]] << 4 j)`` at int32
    ``(kt * n_tiles + nt) * 128 + 4 th + w``. ``b_q_weight``: int32 ``[size_k / 8, size_n]`` (GPTQ order)."""
    assert num_bits == 4 and not is_a_8bit and b_q_weight.dtype == torch.int32, (num_bits, is_a_8bit)
    assert size_k % 16 == 0 and size_n % 64 == 0 and tuple(b_q_weight.shape) == (size_k // 8, size_n)
    k_tiles, n_tiles = size_k // 16, size_n // 64
    kt, nt, th, w, j = torch.meshgrid(torch.arange(k_tiles), torch.arange(n_tiles), torch.arange(32),
                                      torch.arange(4), torch.arange(8), indexing="ij")
    i = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])[j]  # pack_idx: nibble j holds vals[pack_idx[j]]
    k = kt * 16 + (th % 4) * 2 + torch.tensor([0, 1, 8, 9])[i % 4]
    n = nt * 64 + w * 16 + th // 4 + 8 * (i // 4)
    words = b_q_weight.view(torch.uint8).reshape(size_k // 8, size_n, 4).to(torch.int64)
    nibbles = (words[k // 8, n, (k % 8) // 2] >> (4 * (k % 2))) & 0xF  # [kt, nt, th, w, 8]
    packed = (nibbles << (4 * torch.arange(8))).sum(-1)  # [kt, nt, th, w]
    out = packed.permute(0, 1, 2, 3).reshape(k_tiles, n_tiles, 128)  # int32 4 th + w of each tile
    return out.to(torch.uint32).view(torch.int32).reshape(k_tiles, n_tiles * 128)
