"""Inline PTX shared by the sm90 kernels: a block-scale pair and a 32-bit word of the layout -> bf16x2 A fragments.

A word decodes (5 rotates, 4 of them issued as plain left shifts; 6 masks; 4 ``mul.bf16x2`` that apply the block
scale and the exponent bias at once) into the four bf16x2 registers one thread feeds to a 16x16 A tile. A block
scale pair goes ``cvt.f16x2.e4m3x2`` -> shift into bf16 -> two exact power-of-two ``mul.bf16x2`` (2**231 does not
fit in one bf16); weights come out as ``e2m1 * scale * 2**-7``, exact and normal in bf16, and each kernel's
epilogue multiplies by ``multiplier * 2**7``.
"""

from __future__ import annotations

from ....targets import sm90 as layout


def _scale_lines(pair: str) -> list[str]:
    """PTX: the (h=0, h=1) e4m3 scale pair in ``pair`` -> ``s0`` = (S_h0, S_h0), ``s1`` = (S_h1, S_h1), S = s * 2**119.

    e4m3 -> exact f16 -> bits >> 3 are the bf16 of s * 2**-112 -> * 2**115 * 2**116.
    """
    return [
        f"cvt.rn.f16x2.e4m3x2 f, {pair};",
        "shr.b32 f, f, 3;",
        "mov.b32 c0, 0x79007900;",
        "mov.b32 c1, 0x79807980;",
        "mul.rn.bf16x2 f, f, c0;",
        "mul.rn.bf16x2 f, f, c1;",
        "prmt.b32 s0, f, f, 0x1010;",
        "prmt.b32 s1, f, f, 0x3232;",
    ]


def _rotation_masks() -> dict[int, int]:
    """Each nonzero rotation of ``DECODE_ROTATIONS`` -> the union of the masks applied to its result."""
    masks: dict[int, int] = {}
    for rm, rs in layout.DECODE_ROTATIONS:
        for r, mask in ((rm, layout.PAIR_MAG_MASK), (rs, layout.PAIR_SIGN_MASK)):
            if r:
                masks[r] = masks.get(r, 0) | mask
    return dict(sorted(masks.items()))


def _rotate_line(word: str, r: int, mask: int) -> str:
    """PTX for ``r{r} = rotl(word, r)`` where only the bits in ``mask`` are used afterwards.

    Where no used bit wraps around (none below bit ``r``) a left shift gives the same bits, and ptxas may issue
    it as ``IMAD.SHL`` on the FMA pipe: the funnel shift and the masks share the integer ALU pipe, the decode
    kernel's busiest (62% of active cycles; 7-12% faster at M = 1, docs/benchmarks.md).
    """
    if mask & ((1 << r) - 1):
        return f"shf.l.wrap.b32 r{r}, {word}, {word}, {r};"
    return f"shl.b32 r{r}, {word}, {r};"


def _word_lines(word: str) -> list[str]:
    """PTX: one word -> ``p0..p3``, the bf16x2 A-fragment registers ``e2m1 * S`` (pair i uses ``s{i % 2}``)."""
    mag, sign = layout.PAIR_MAG_MASK, layout.PAIR_SIGN_MASK
    lines = [_rotate_line(word, r, mask) for r, mask in _rotation_masks().items()]
    for i, (rm, rs) in enumerate(layout.DECODE_ROTATIONS):
        src_m, src_s = (f"r{rm}" if rm else word), (f"r{rs}" if rs else word)
        if rm == rs:
            lines.append(f"and.b32 p{i}, {src_m}, {mag | sign:#010x};")
        else:
            lines += [f"and.b32 t, {src_m}, {mag:#010x};", f"and.b32 u, {src_s}, {sign:#010x};", f"or.b32 p{i}, t, u;"]
        lines.append(f"mul.rn.bf16x2 p{i}, p{i}, s{i % 2};")  # exact: e2m1 * 2**-126 * s * 2**119
    return lines


def _asm_block(lines: list[str]) -> str:
    rotated = [f".reg .b32 r{r};" for r in _rotation_masks()]
    regs = [".reg .b32 f, c0, c1, s0, s1, t, u, p<4>;", ".reg .b16 lo, hi;", *rotated]
    return "{\n" + "\n".join(regs + lines) + "\n}"


def scale_asm() -> str:
    """``$2`` uint16 scale pair -> ``$0``, ``$1``: the splatted bf16x2 scales ``s0``, ``s1``."""
    return _asm_block(_scale_lines("$2") + ["mov.b32 $0, s0;", "mov.b32 $1, s1;"])


def decode_asm() -> str:
    """``$8`` word, ``$9``/``$10`` splatted scales -> ``$0..$7`` bf16 weights, element e = p + 2h + 4q."""
    lines = ["mov.b32 s0, $9;", "mov.b32 s1, $10;", *_word_lines("$8")]
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, p{i};" for i in range(4)]
    return _asm_block(lines)


def gemv_asm(nt: int) -> str:
    """One thread's chunk: 4 words, their scale pair, x B fragments and accumulators -> accumulators.

    Operands: ``$0 .. $(4nt-1)`` float32 results (m16n8 D fragments of n-tiles ``u < nt``); then the 4
    words (tiles j), the 32-bit word holding this lane's uint16 scale pair and its neighbour's, the shift
    (0 or 16) selecting this lane's, ``8 nt`` x registers (index ``8u + 2j + q``: bf16 pair of k-slots
    ``2t + 8q`` of tile j) and ``4 nt`` float32 accumulators in. Tile j's mma uses the chain's previous
    result as its C operand.
    """
    o = 4 * nt
    words = [f"${o + i}" for i in range(4)]
    xb = [f"${o + 6 + i}" for i in range(8 * nt)]
    acc_in = [f"${o + 6 + 8 * nt + i}" for i in range(4 * nt)]
    lines = [f"shr.b32 t, ${o + 4}, ${o + 5};", "mov.b32 {lo, hi}, t;", *_scale_lines("lo")]
    for j in range(4):
        lines += _word_lines(words[j])
        for u in range(nt):
            d = [f"${4 * u + i}" for i in range(4)]
            c = acc_in[4 * u : 4 * u + 4] if j == 0 else d
            lines.append(
                f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{', '.join(d)}}}, {{p0, p1, p2, p3}}, "
                f"{{{xb[8 * u + 2 * j]}, {xb[8 * u + 2 * j + 1]}}}, {{{', '.join(c)}}};"
            )
    return _asm_block(lines)

