"""Index-formula decoders: each target's runtime tensors -> dense weights, every element gathered by formula.

A layout transform and its inverse can be wrong together and still round-trip bit for bit, so decoding
with a target's ``from_runtime`` cannot check ``to_runtime``. These decoders share no code with the
targets' view-and-permute transforms: for every logical weight ``(row, col)`` and block scale
``(row, block)`` they compute, from the layout's documented index formula (the targets' module
docstrings, docs/NVFP4_REFERENCE.md), where its bits live in the runtime buffers, gather them, and decode
the values arithmetically. The reference backend, and so ``verify``'s numerics on CPU, decode with them.

Every formula is a sum of a row term and a column term, so offsets are two small vectors broadcast
together, and layers are decoded in row blocks (:func:`decode_blocks`): memory is one block's temporaries
whatever the layer's size (the reference backend multiplies block by block). Offsets are int32 wherever the
buffer allows (:func:`index_dtype`) and gathers are ``index_select``: torch's int64 arithmetic with per-element
shifts and its advanced indexing made decoding 4x slower, and ``verify``'s CPU numerics are this decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..nvfp4 import BLOCK_SIZE, e2m1_to_float
from ..targets import RuntimeLayer, resolve_target
from ..targets.layout import round_up, swizzle_128x4_offsets
from ..targets.sm90 import DECODE_BIAS_LOG2, decode_pairs
from ..targets.w4a4 import LAYOUT_ID as W4A4_LAYOUT

ROW_BLOCK_ELEMENTS = 1 << 20  # elements gathered at a time: 4 MiB of int32 offsets
WORD_BLOCK = 1 << 18  # sm90 words decoded at a time: 4 MiB of int32 bf16x2 pairs

Offsets = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
Decode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayoutFormula:
    """Where one target keeps each code and block scale, and how it encodes them.

    Attributes:
        code_offsets: ``(rows [R], cols [C], n, k)`` -> ``[R, C]`` code positions: nibble index
            ``2 * byte + half`` (half 1 = high nibble) for byte layouts, ``8 * word + element`` for sm90.
        code_values: ``(weight buffer, positions)`` -> the E2M1 value at each position (bf16, exact).
        scale_offsets: ``(rows [R], blocks [B], n, k)`` -> ``[R, B]`` byte index into the scale buffer.
        scales: ``(scale buffer, byte indices)`` -> block scales as float64.
    """

    code_offsets: Offsets
    code_values: Decode
    scale_offsets: Offsets
    scales: Decode


def index_dtype(buffer: torch.Tensor) -> torch.dtype:
    """int32 when every position in ``buffer`` (at most 2 per byte: nibbles, or sm90's 8 per int32 word) and
    every partial sum of an offset formula fits, else int64."""
    return torch.int32 if 2 * buffer.numel() * buffer.element_size() < 2**31 else torch.int64


def _bytes(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.contiguous().reshape(-1).view(torch.uint8)


def _gather(flat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``flat[positions]`` for any shape of positions, through ``index_select`` (several times faster)."""
    return flat.index_select(0, positions.reshape(-1)).view(positions.shape)


def nibble_values(weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Position ``2 * byte + half`` of a byte buffer: E2M1 of the low nibble for half 0, of the high for half 1,
    looked up as entry ``2 * byte + half`` of a table of every byte's two nibbles."""
    entries = torch.arange(512, device=weight.device)
    table = e2m1_to_float((entries >> 1 >> (entries & 1) * 4) & 0xF, torch.bfloat16)
    byte = _gather(_bytes(weight), positions >> 1).to(positions.dtype)
    return _gather(table, (byte << 1) | (positions & 1))


def e4m3_scales(scales: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes at ``positions``, as float64 (torch's own e4m3 conversion)."""
    return _gather(_bytes(scales), positions).view(torch.float8_e4m3fn).to(torch.float64)


def s0e5m3_scales(scales: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """FlashInfer sm12x's S0E5M3 bytes: 5 exponent bits (bias 15), 3 mantissa bits, no sign; zero exponent is
    subnormal. Decoded from that definition, not by re-using the encoder's fp16 bit trick."""
    byte = _gather(_bytes(scales), positions).to(torch.int32)
    exponent, mantissa = byte >> 3, (byte & 7).to(torch.float64)
    normal = (8 + mantissa) * torch.exp2((exponent - 18).to(torch.float64))  # (1 + m/8) * 2**(e - 15)
    return torch.where(exponent == 0, mantissa * 2.0**-17, normal)


def sm90_values(words: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Position ``8 * word + element`` of the int32 words, decoded with the kernel's rotate-and-mask arithmetic
    (``decode_pairs``: pair i = elements 2i, 2i+1 as bf16 bits of ``e2m1 * 2**-126``), not the packer's tables.
    Each word in the positions' span is decoded once (a row block's positions fill a run of whole stripes)."""
    flat = words.contiguous().reshape(-1)
    first, last = int(positions.min()) >> 3, (int(positions.max()) >> 3) + 1
    span = torch.empty(8 * (last - first), dtype=torch.bfloat16, device=flat.device)
    for start in range(first, last, WORD_BLOCK):
        raw = decode_pairs(flat[start : min(last, start + WORD_BLOCK)]).view(torch.bfloat16).reshape(-1)
        at = 8 * (start - first)
        span[at : at + raw.numel()] = (raw.float() * 2.0**-DECODE_BIAS_LOG2).to(torch.bfloat16)
    return _gather(span, positions - 8 * first)


def sm100_code_offsets(rows: torch.Tensor, cols: torch.Tensor, n: int, k: int, alignment: int = 64) -> torch.Tensor:
    """Row-major ``[round_up(N, a), round_up(K, a)/2]`` bytes (``a`` 64; 32 for the W4A4 layout), element ``2i``
    in the low nibble: nibble ``row * round_up(K, a) + col``."""
    return (rows * round_up(k, alignment))[:, None] + cols[None, :]


def w4a4_code_offsets(rows: torch.Tensor, cols: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return sm100_code_offsets(rows, cols, n, k, alignment=32)


def sm120_code_offsets(rows: torch.Tensor, cols: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """FlashInfer's sm12x tiles (docs/NVFP4_REFERENCE.md §4): packed row ``kb = col//2`` of the transposed codes,
    tile ``(kb//8, row//64)``, int32 ``p = 64w + 8c + 2r + s`` byte ``j = 2h + q`` with ``row%64 = 32s + 16h
    + 8w + c`` and ``kb%8 = r + 4q``; row ``kt`` of the int32 ``[Kp/16, 2*Np]`` buffer is ``8*Np`` bytes."""
    np_ = round_up(n, 64)
    s, h, w, c = (rows % 64) // 32, (rows % 32) // 16, (rows % 16) // 8, rows % 8
    row_byte = (rows // 64) * 512 + 4 * (64 * w + 8 * c + s) + 2 * h
    kb = cols // 2
    r, q = kb % 4, (kb % 8) // 4
    col_byte = (kb // 8) * 8 * np_ + 4 * 2 * r + q
    return (2 * row_byte)[:, None] + (2 * col_byte + cols % 2)[None, :]


def sm120_scale_offsets(rows: torch.Tensor, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Transposed scales, ``[Kp/16, Np]`` bytes."""
    return rows[:, None] + (blocks * round_up(n, 64))[None, :]


def sm90_code_offsets(rows: torch.Tensor, cols: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """sm90-triton-v2 (``repack/targets/sm90.py``): row ``16s + 8h + g``, column ``64c + 16t + 4j + 2q + p``
    is element ``p + 2h + 4q`` of word ``[s, 128c + 4(4g + t) + j]`` of the ``[Np/16, 2*Kp]`` buffer."""
    kp = round_up(k, 256)
    s, h, g = rows // 16, (rows % 16) // 8, rows % 8
    c, t, j, q, p = cols // 64, (cols % 64) // 16, (cols % 16) // 4, (cols % 4) // 2, cols % 2
    row_word, col_word = s * 2 * kp + 16 * g, 128 * c + 4 * t + j
    return (8 * row_word + 2 * h)[:, None] + (8 * col_word + p + 4 * q)[None, :]


def sm90_scale_offsets(rows: torch.Tensor, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Block ``4c + t`` of row ``16s + 8h + g`` at byte ``[s, 64c + 8g + 2t + h]`` of the ``[Np/16, Kp]`` buffer."""
    kp = round_up(k, 256)
    s, h, g = rows // 16, (rows % 16) // 8, rows % 8
    row = s * kp + 8 * g + h
    return row[:, None] + (64 * (blocks // 4) + 2 * (blocks % 4))[None, :]


def marlin_code_offsets(rows: torch.Tensor, cols: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Marlin (``repack/targets/marlin.py``): row ``64 nt + 16 w + 8 c + t``, column ``16 kt + 8 a + 2 r + b`` is
    nibble ``4 b + 2 c + a`` of int32 ``[kt, 128 nt + 4 (4 t + r) + w]`` of the ``[Kp/16, 2 Np]`` buffer."""
    from ..targets.marlin import padded_nk

    np_ = padded_nk(n, k)[0]
    nt, w, c, t = rows // 64, (rows % 64) // 16, (rows % 16) // 8, rows % 8
    kt, a, r, b = cols // 16, (cols % 16) // 8, (cols % 8) // 2, cols % 2
    row_word, col_word = 128 * nt + 16 * t + w, kt * 2 * np_ + 4 * r
    return (8 * row_word + 2 * c)[:, None] + (8 * col_word + 4 * b + a)[None, :]


def marlin_scale_offsets(rows: torch.Tensor, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Block ``g`` of row ``n`` at byte ``[g, 64 (n // 64) + 4 (p // 4) + (0, 2, 1, 3)[p % 4]]`` of the ``[Kp/16,
    Np]`` buffer, ``p = 8 (n % 8) + (n % 64) // 8`` (an 8 x 8 transpose, then pairs swapped)."""
    from ..targets.marlin import padded_nk

    np_ = padded_nk(n, k)[0]
    m = rows % 64
    p = 8 * (m % 8) + m // 8
    column = 64 * (rows // 64) + 4 * (p // 4) + (p % 4 == 1).to(rows.dtype) - (p % 4 == 2).to(rows.dtype) + p % 4
    return column[:, None] + (blocks * np_)[None, :]


def marlin_scales(exponent_bias: int) -> Decode:
    """Marlin's S0E5M3 bytes (:func:`s0e5m3_scales`: the scale times ``sf * 2^7``) over ``2^bias``: the held global
    scale carries ``2^(bias - 7) / sf`` (bias 126 with bf16 activations, 14 with fp16)."""
    return lambda scales, positions: s0e5m3_scales(scales, positions) * 2.0**-exponent_bias


MARLIN_BF16 = LayoutFormula(marlin_code_offsets, nibble_values, marlin_scale_offsets, marlin_scales(126))
MARLIN_FP16 = LayoutFormula(marlin_code_offsets, nibble_values, marlin_scale_offsets, marlin_scales(14))
# By layout key (Target.layout_key: the layout id); Marlin's W4A4 variants hold its weight-only bytes
FORMULAS: dict[str, LayoutFormula] = {
    "sm100-cute-dsl-v1": LayoutFormula(sm100_code_offsets, nibble_values, swizzle_128x4_offsets, e4m3_scales),
    "sm120-cute-dsl-v1": LayoutFormula(sm120_code_offsets, nibble_values, sm120_scale_offsets, s0e5m3_scales),
    "sm90-triton-v2": LayoutFormula(sm90_code_offsets, sm90_values, sm90_scale_offsets, e4m3_scales),
    W4A4_LAYOUT: LayoutFormula(w4a4_code_offsets, nibble_values, swizzle_128x4_offsets, e4m3_scales),
    "marlin-v1": MARLIN_BF16, "marlin-v1-w4a4": MARLIN_BF16,
    "marlin-fp16-v1": MARLIN_FP16, "marlin-fp16-v1-w4a4": MARLIN_FP16,
}


def formula_for(target: str) -> LayoutFormula:
    """By layout key, or by target name (the family's W4A16 layout)."""
    return FORMULAS[target] if target in FORMULAS else FORMULAS[resolve_target(target).layout_key]


def decode_blocks(layer: RuntimeLayer, n: int, k: int, target: str,
                  dtype: torch.dtype = torch.float32) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, weights [rows, k])`` blocks of :func:`decode`, in row order, about ``ROW_BLOCK_ELEMENTS``
    each (a multiple of 16 rows)."""
    formula = formula_for(target)
    device = layer.weight.device
    compute = torch.float32 if dtype == torch.float32 else torch.float64
    index = index_dtype(layer.weight)
    cols = torch.arange(k, device=device, dtype=index)
    blocks = torch.arange(k // BLOCK_SIZE, device=device, dtype=index)
    multiplier = layer.weight_global_scale.to(compute).reshape(())
    step = max(16, ROW_BLOCK_ELEMENTS // k // 16 * 16)
    for first in range(0, n, step):
        rows = torch.arange(first, min(n, first + step), device=device, dtype=index)
        codes = formula.code_values(layer.weight, formula.code_offsets(rows, cols, n, k)).to(compute)
        scales = formula.scales(layer.weight_scale, formula.scale_offsets(rows, blocks, n, k)).to(compute)
        block = codes.view(len(rows), k // BLOCK_SIZE, BLOCK_SIZE) * scales.unsqueeze(-1)  # exact
        yield first, (block.view(len(rows), k) * multiplier).to(dtype)  # the one rounding


def decode(layer: RuntimeLayer, n: int, k: int, target: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``[n, k]`` weights ``e2m1 * block_scale * multiplier`` gathered from ``layer`` by ``target``'s formula.

    One rounding to ``dtype``: the product of a code (2 significant bits) and a scale (4) is exact even in
    float32, so float32 output is computed in float32 (half the memory traffic of float64) with one rounding,
    at the multiplier, as the exact float64 product rounded to float32 would be."""
    out = torch.empty((n, k), dtype=dtype, device=layer.weight.device)
    for first, block in decode_blocks(layer, n, k, target, dtype):
        out[first : first + len(block)] = block
    return out
