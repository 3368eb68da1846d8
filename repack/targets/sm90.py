"""sm90 (Hopper: H100, H200): the layout read by this project's Triton/Gluon W4A16 kernels.

The layout is this project's own (vLLM 0.33's Hopper kernel, Humming, repacks into its layout at every load),
made for ``repack/runtime/backends/triton_sm90/``. Its kernels feed the weights to the tensor cores as the
A operand of ``mma.m16n8k16`` / ``wgmma`` straight from registers, so the layout puts, for every
thread, the 8 values it feeds to one 16x16 A tile into one 32-bit word, and the 4 words of 4
consecutive tiles next to each other: one 16-byte load per thread per 64 K-elements, 512 contiguous
bytes per warp, no shared-memory shuffle.

The K order inside a 64-column chunk is permuted so that each thread's 4 words cover one 16-column
scale block (v2): the decode kernel then converts one scale pair per thread per chunk instead of four,
and reads its 16 activations per chunk as two 16-byte loads. The tensor cores do not care which
columns share a k-slot as long as weights and activations agree, so the kernels load the activations
in the same permuted order.

Shapes: ``Np = round_up(N, 128)``, ``Kp = round_up(K, 256)``; padding is zero codes and zero scales,
so padded weights are exactly 0. The kernel masks K on the activations, hence
``weights_padding_cols = 0`` (activations are never padded).

weight: int32 ``[Np/16, 2*Kp]``. Row ``s`` is the 16-row stripe ``16s .. 16s+15``; along it, chunk
``c`` (64 K-elements) holds 128 words at ``[s, 128c + 4l + j]`` for lane ``l = 4g + t`` (g < 8,
t < 4) and tile ``j`` < 4. Word element ``e = p + 2h + 4q`` (p, h, q in {0, 1}) is the weight at
row ``16s + g + 8h``, column ``64c + 16t + 4j + 2q + p``; as an A fragment it sits in k-slot
``2t + p + 8q`` of tile ``j`` (so k-slot ``16j + 8q + 2t + p`` of the chunk holds column
``16t + 4j + 2q + p``: :func:`kslot_column`).
Each element's E2M1 code is stored as 3 magnitude bits at ``MAG_SHIFT[e] .. +2`` (in code order) and
its sign at bit ``SIGN_SHIFT[e]``, chosen so that the kernel builds the bf16x2 pair of elements
``(2i, 2i+1)`` with one rotate and one or two masks (``DECODE_ROTATIONS``): that pair, read as bf16
bits, is ``e2m1 * 2**-126`` (E2M1 zero and subnormal land on bf16 zero and subnormals).

weight_scale: float8_e4m3fn ``[Np/16, Kp]``, unchanged e4m3 bytes: for stripe ``s`` and chunk ``c``,
64 bytes at ``[s, 64c + 8g + 2t + h]`` hold the block scale of row ``16s + g + 8h``, block ``4c + t``:
the (h=0, h=1) byte pair of lane ``4g + t`` is the uint16 at ``32 (s * Kp/64 + c) + l``, converted
with one ``cvt.f16x2.e4m3x2``.

weight_global_scale: the float32 ``[1]`` multiplier.
"""

from __future__ import annotations

from functools import cache

import torch

from ..nvfp4 import BLOCK_SIZE, NVFP4Weight
from . import families
from .base import LayerGeometry, RuntimeLayer, Target, TensorSpec
from .layout import aligned, pad_2d, round_up

ROW_ALIGN = 128  # the kernel's largest N tile: no masks on weight loads
K_ALIGN = 256  # the kernel's largest K step
STRIPE = 16  # rows of one A tile
CHUNK = 64  # K-elements of one 16-byte word group (4 tiles of 16)
PACK_ROWS = 256  # rows packed at a time (a multiple of ROW_ALIGN): temporaries stay in cache, memory flat
SCALE_BLOCK_BYTES = 1 << 18  # scale bytes gathered at a time (their int32 index: 1 MB)

# Element e of a word: lowest of its 3 magnitude bits, and its sign bit.
MAG_SHIFT = (6, 22, 3, 19, 0, 16, 26, 10)
SIGN_SHIFT = (15, 31, 14, 30, 9, 25, 13, 29)
# bf16x2 pair i = (element 2i, element 2i+1): (rotate-left for the magnitudes, rotate-left for the signs).
# Pair bits: magnitudes at 6..8 / 22..24 (bf16 mantissa top bit, exponent low bits), signs at 15 / 31.
DECODE_ROTATIONS = ((0, 0), (3, 1), (6, 6), (12, 2))
PAIR_MAG_MASK = 0x01C001C0
PAIR_SIGN_MASK = 0x80008000
DECODE_BIAS_LOG2 = -126  # a decoded pair is e2m1 * 2**DECODE_BIAS_LOG2


def padded_shape(n: int, k: int) -> tuple[int, int]:
    """``(Np, Kp)``: N rounded up to 128, K to 256."""
    return round_up(n, ROW_ALIGN), round_up(k, K_ALIGN)


def kslot_column(kslot: torch.Tensor) -> torch.Tensor:
    """Column (within K) held by A-fragment k-slot ``64c + 16j + 8q + 2t + p``: ``64c + 16t + 4j + 2q + p``."""
    c, r = kslot // CHUNK, kslot % CHUNK
    j, q, t, p = r // 16, (r // 8) % 2, (r // 2) % 4, r % 2
    return c * CHUNK + 16 * t + 4 * j + 2 * q + p


def _element_unview(words_order: torch.Tensor, np_: int, kp: int) -> torch.Tensor:
    """Elements in word order ``[s, c, g, t, j, q, h, p]`` -> ``[Np, Kp]``.

    Row = ``16s + 8h + g``, column = ``64c + 16t + 4j + 2q + p``.
    """
    return words_order.permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(np_, kp)


@cache  # built on first use, not at import: every CLI command imports the targets
def word_tables() -> torch.Tensor:
    """int32 ``[2, 65536]``: for ``h``, the word bits of the 4 codes in one little-endian uint16 of packed codes.

    That uint16 (packed columns ``2q``, ``2q + 1`` of one row) holds the codes of columns ``4j .. 4j+3`` of a
    16-column group, i.e. the elements ``e = p + 2h + 4q`` of one word for all (p, q); the word is the OR of the
    two uint16s of rows ``g`` and ``g + 8`` (h = 0, 1) looked up here, the bit fields being disjoint."""
    value = torch.arange(1 << 16, dtype=torch.int32)
    tables = torch.zeros(2, 1 << 16, dtype=torch.int32)
    for h in range(2):
        for q in range(2):
            for p in range(2):
                e = p + 2 * h + 4 * q
                code = (value >> (8 * q + 4 * p)) & 0xF
                tables[h] |= ((code & 7) << MAG_SHIFT[e]) | ((code >> 3) << SIGN_SHIFT[e])
    return tables


@cache
def code_tables() -> torch.Tensor:
    """int32 ``[2, 65536]``, the inverse of :func:`word_tables`: for the low (0) and high (1) 16 bits of a word, the
    bits they hold of the word's 8 codes, placed as the two uint16s of packed codes (rows ``g``, ``g + 8``) hold
    them, ``h`` in the upper half. Each code bit lives in exactly one half, so a word's codes are the OR of the
    two lookups."""
    value = torch.arange(1 << 16, dtype=torch.int32)
    tables = torch.zeros(2, 1 << 16, dtype=torch.int32)
    for e in range(8):
        p, h, q = e % 2, (e // 2) % 2, e // 4
        for bit, word_bit in ((0, MAG_SHIFT[e]), (1, MAG_SHIFT[e] + 1), (2, MAG_SHIFT[e] + 2), (3, SIGN_SHIFT[e])):
            half, shift = word_bit // 16, word_bit % 16
            tables[half] |= ((value >> shift) & 1) << (16 * h + 8 * q + 4 * p + bit)
    return tables


def pack_words(codes: torch.Tensor, np_: int | None = None, kp: int | None = None) -> torch.Tensor:
    """Packed codes uint8 ``[N, K/2]`` -> int32 words ``[Np/16, 2*Kp]`` (bit placement per element, see module doc),
    zero-padded to ``[np_, kp]`` (default: the codes' own shape, which must then be aligned).

    Two lookups per word in :func:`word_tables` (256 KB each, cache-resident) over the codes in their stored
    order, then one permutation of whole 16-word runs: placing nibbles one by one through an 8-D byte-granular
    view took about 20x longer. ``PACK_ROWS`` rows at a time, through scratch buffers allocated once: fresh
    temporaries per block cost a page fault per 4 KB, as much as the lookups."""
    np_, kp = np_ or codes.shape[0], kp or codes.shape[1] * 2
    chunks = kp // CHUNK
    words = torch.empty(np_ // STRIPE, 2 * kp, dtype=torch.int32, device=codes.device)
    index, low, high = (torch.empty(min(np_, PACK_ROWS) * kp // 8, dtype=torch.int32, device=codes.device)
                        for _ in range(3))
    for first in range(0, np_, PACK_ROWS):
        block = aligned(pad_2d(codes[first : first + PACK_ROWS], min(PACK_ROWS, np_ - first), kp // 2), 2)
        stripes = block.shape[0] // STRIPE
        count = stripes * 8 * chunks * 16
        pairs = block.view(torch.uint16).view(stripes, 2, 8, chunks, 16)  # s, h, g, c, (t, j); each (q, p)
        for h, out in ((0, low), (1, high)):
            index[:count].view(stripes, 8, chunks, 16).copy_(pairs[:, h])
            torch.index_select(word_tables()[h], 0, index[:count], out=out[:count])
        low[:count] |= high[:count]
        target = words[first // STRIPE : first // STRIPE + stripes].view(stripes, chunks, 8, 16)
        target.copy_(low[:count].view(stripes, 8, chunks, 16).permute(0, 2, 1, 3))
    return words


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`pack_words`: int32 ``[Np/16, 2*Kp]`` -> packed codes uint8 ``[Np, Kp/2]``.

    Two lookups per word in :func:`code_tables` give the uint16 pair of packed codes it came from (rows ``g``
    and ``g + 8``), then one permutation puts them back in row order: several times faster than extracting the
    8 fields of every word one by one. ``PACK_ROWS`` rows at a time through scratch buffers allocated once, as
    :func:`pack_words` does (fresh temporaries per step cost a page fault per 4 KB)."""
    stripes, kp2 = words.shape
    chunks, per_block = kp2 // 2 // CHUNK, PACK_ROWS // STRIPE
    codes = torch.empty(stripes * STRIPE, kp2 // 8, dtype=torch.uint16, device=words.device)  # [Np, Kp/4]
    word, index, pairs = (torch.empty(min(stripes, per_block) * kp2, dtype=torch.int32, device=words.device)
                          for _ in range(3))
    tables = code_tables().to(words.device)  # any device, as the other inverses
    for first in range(0, stripes, per_block):
        block = words[first : first + per_block]
        count = block.numel()
        word[:count].view(-1, 8, chunks, 16).copy_(block.view(-1, chunks, 8, 16).permute(0, 2, 1, 3))  # s, g, c, tj
        torch.bitwise_and(word[:count], 0xFFFF, out=index[:count])
        torch.index_select(tables[0], 0, index[:count], out=pairs[:count])
        torch.bitwise_right_shift(word[:count], 16, out=index[:count]).bitwise_and_(0xFFFF)
        pairs[:count] |= torch.index_select(tables[1], 0, index[:count], out=word[:count])
        halves = pairs[:count].view(torch.uint16).view(-1, 8, chunks, 16, 2)  # s, g, c, tj, h
        target = codes[first * STRIPE : (first + block.shape[0]) * STRIPE].view(-1, 2, 8, chunks, 16)
        target.copy_(halves.permute(0, 4, 1, 2, 3))
    return codes.view(torch.uint8)


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``[Np, Kp/16]`` -> ``[Np/16, Kp]``: per stripe and chunk, bytes in ``(g, t, h)`` order.

    A gather, ``SCALE_BLOCK_BYTES`` at a time, by one int32 index of a block's positions (the view permutation
    ``(s, h, g, c, t) -> (s, c, g, t, h)`` applied to them): the permutation's innermost run is one byte, on
    which torch's strided copy took 3x as long."""
    np_, kb = scales.shape
    stripe_bytes = STRIPE * kb
    per_block = stripe_bytes * max(1, min(np_ // STRIPE, SCALE_BLOCK_BYTES // stripe_bytes))
    positions = torch.arange(per_block, dtype=torch.int32, device=scales.device)
    order = positions.view(-1, 2, 8, kb // 4, 4).permute(0, 3, 2, 4, 1).reshape(-1)  # s, h, g, c, t (block 4c + t)
    flat = scales.contiguous().view(torch.uint8).view(-1)
    out = torch.empty(np_ * kb, dtype=torch.uint8, device=scales.device)
    for first in range(0, flat.numel(), per_block):  # a last, shorter block is whole stripes: a prefix of order
        count = min(per_block, flat.numel() - first)
        torch.index_select(flat[first : first + count], 0, order[:count], out=out[first : first + count])
    return out.view(np_ // STRIPE, kb * BLOCK_SIZE).view(scales.dtype)


def unpack_scales(packed: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`pack_scales`."""
    stripes, kp = packed.shape
    view = packed.contiguous().view(torch.uint8).view(stripes, kp // CHUNK, 8, 4, 2)  # s, c, g, t, h
    return view.permute(0, 4, 2, 1, 3).reshape(stripes * STRIPE, kp // BLOCK_SIZE).view(packed.dtype)


def to_runtime(weight: NVFP4Weight) -> RuntimeLayer:
    np_, kp = padded_shape(weight.n, weight.k)
    scales = pad_2d(weight.block_scales.view(torch.uint8), np_, kp // BLOCK_SIZE).view(torch.float8_e4m3fn)
    return RuntimeLayer(
        weight=pack_words(weight.codes, np_, kp),
        weight_scale=pack_scales(scales),
        weight_global_scale=weight.multiplier.reshape(1).to(torch.float32).clone(),
        weights_padding_cols=0,
    )


def from_runtime(layer: RuntimeLayer, n: int, k: int) -> NVFP4Weight:
    codes = unpack_words(layer.weight)
    scales = unpack_scales(layer.weight_scale)
    return NVFP4Weight(
        codes=codes[:n, : k // 2].contiguous(),
        block_scales=scales[:n, : k // BLOCK_SIZE].contiguous(),
        multiplier=layer.weight_global_scale.reshape(1).clone(),
    )


def stack_rows(layers: list[RuntimeLayer], ns: list[int], k: int) -> RuntimeLayer | None:
    """The runtime layer of ``layers`` (same K and multiplier) stacked along N, by copying 16-row stripes.

    Both tensors are one row per stripe and a layer's padding is whole zero stripes at its end, so when every
    N is a multiple of the stripe its real stripes, in order, then zero stripes up to the padded total are exactly
    what :func:`to_runtime` makes of the stacked weights. ``None`` when a stripe would straddle two layers.
    """
    if any(n % STRIPE for n in ns):
        return None
    stripes = round_up(sum(ns), ROW_ALIGN) // STRIPE

    def stack(parts: list[torch.Tensor]) -> torch.Tensor:
        rows = [part[: n // STRIPE] for part, n in zip(parts, ns)]
        rows.append(parts[0].new_zeros(stripes - sum(n // STRIPE for n in ns), parts[0].shape[1]))
        return torch.cat(rows)

    return RuntimeLayer(
        weight=stack([layer.weight for layer in layers]),
        weight_scale=stack([layer.weight_scale for layer in layers]),
        weight_global_scale=layers[0].weight_global_scale.clone(),
        weights_padding_cols=0,
    )


def runtime_specs(n: int, k: int) -> dict[str, TensorSpec]:
    np_, kp = padded_shape(n, k)
    return {
        "weight": TensorSpec(torch.int32, (np_ // STRIPE, 2 * kp)),
        "weight_scale": TensorSpec(torch.float8_e4m3fn, (np_ // STRIPE, kp)),
        "weight_global_scale": TensorSpec(torch.float32, (1,)),
    }


def _rotl32(word: torch.Tensor, r: int) -> torch.Tensor:
    """Rotate int32 values left by ``r`` as uint32 (torch's ``>>`` is arithmetic: the wrapped bits are masked)."""
    return (word << r) | ((word >> (32 - r)) & ((1 << r) - 1)) if r else word


def decode_pairs(words: torch.Tensor) -> torch.Tensor:
    """The kernel's bit decode: int32 words ``[...]`` -> int32 bf16x2 patterns ``[..., 4]``: pair i holds element
    2i in its low 16 bits and 2i+1 in its high 16 bits, so ``.view(torch.bfloat16)`` is ``[..., 8]`` in element
    order. In int32, as the kernel computes it (int64 arithmetic took 3x as long)."""
    word = words.to(torch.int32)
    sign_mask = PAIR_SIGN_MASK - (1 << 32)  # 0x80008000 as an int32
    pairs = [(_rotl32(word, rm) & PAIR_MAG_MASK) | (_rotl32(word, rs) & sign_mask) for rm, rs in DECODE_ROTATIONS]
    return torch.stack(pairs, dim=-1)


def dequantize_runtime(layer: RuntimeLayer, n: int, k: int) -> torch.Tensor:
    """float64 ``[n, k]`` weights decoded from the runtime tensors the way the kernel does.

    Uses the kernel's rotate-and-mask decode (bf16 bit patterns scaled by ``2**-126``), not the inverse
    layout transform, so it checks the bit placement against the kernel's arithmetic.
    """
    raw = decode_pairs(layer.weight).view(torch.bfloat16).to(torch.float64)  # [Np/16, 2Kp, 8], element order
    values = raw * 2.0**-DECODE_BIAS_LOG2
    stripes, kp2 = layer.weight.shape
    np_, kp = stripes * STRIPE, kp2 // 2
    dense = _element_unview(values.view(stripes, kp // CHUNK, 8, 4, 4, 2, 2, 2), np_, kp)
    scales = unpack_scales(layer.weight_scale).to(torch.float64).repeat_interleave(BLOCK_SIZE, dim=1)
    mult = layer.weight_global_scale.to(torch.float64).reshape(())
    return (dense * scales * mult)[:n, :k]


TARGET = Target.of(
    families.SM90,
    to_runtime=to_runtime,
    from_runtime=from_runtime,
    runtime_specs=runtime_specs,
    geometry=lambda n, k: LayerGeometry(*padded_shape(n, k), weights_padding_cols=0),
    stack_rows=stack_rows,
)