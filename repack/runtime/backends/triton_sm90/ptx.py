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


def _sign_lines(reg: str, signs: tuple[int, ...], first: int, parts: int) -> list[str]:
    """PTX: flip the bf16 signs of the pair in ``reg`` where ``signs`` (+-1 per block position) is negative, for the
    pair at block positions ``first + 16u`` and ``+1``, ``u`` = the lane's block part (``parts`` of them: ``u`` is in
    register ``u``, its ``prmt`` selector in ``sel``). One xor with a constant where the pair's signs do not depend
    on the lane, else a byte select from two constants (byte ``u``: 0x80 where negative) and one masked xor."""
    lo = [signs[first + 16 * u] < 0 for u in range(parts)]
    hi = [signs[first + 16 * u + 1] < 0 for u in range(parts)]
    if len(set(lo)) == 1 and len(set(hi)) == 1:
        mask = (lo[0] << 15) | (hi[0] << 31)
        return [f"xor.b32 {reg}, {reg}, {mask:#010x};"] if mask else []
    a = sum(0x80 << (8 * u) for u in range(parts) if lo[u])
    b = sum(0x80 << (8 * u) for u in range(parts) if hi[u])
    return [f"mov.b32 ka, {a:#010x};", f"mov.b32 kb, {b:#010x};", "prmt.b32 m, ka, kb, sel;",
            "and.b32 m, m, 0x80008000;", f"xor.b32 {reg}, {reg}, m;"]  # fmt: skip


def walsh_asm(block: int, d1: tuple[int, ...], d2: tuple[int, ...]) -> str:
    """One thread's ``x -> x @ diag(d1) @ H_block @ diag(d2)`` (Sylvester's H, unnormalised) on its bf16 pairs.

    The thread holds 16 consecutive columns ``16u .. 16u + 15`` of a block per 64-column chunk, ``u`` = its lane's
    low bits (lanes ``t ^ 1``, ``t ^ 2`` hold the block's other parts), and for ``block`` = 128 two consecutive
    chunks. Operands: ``$0 ..`` the transformed words out, then the words in (8, or 16: chunk 0 then 1). The
    butterflies run in float32 and round to bf16 once: the bits of a position inside the thread by adds, lane bits
    by ``shfl.sync.bfly`` (the first one on the bf16 words, half the shuffles of float32 values), the chunk bit of
    128 across the two chunks. The signs are constants folded into the code (one compile per matrix)."""
    chunks = 2 if block == 128 else 1
    words, parts = 8 * chunks, min(block, 64) // 16
    lane_bits = [d for d in (1, 2) if d < parts]  # lane xor distances of the cross-lane stages
    ins = [f"${words + i}" for i in range(words)]
    regs = [".reg .b32 w<16>, q<16>, l, u, sel, m, ka, kb;", ".reg .f32 v<32>, p<32>, s;", ".reg .pred up;"]
    lines = [f"mov.b32 w{i}, {ins[i]};" for i in range(words)]
    if parts > 1:
        lines += ["mov.u32 l, %laneid;", f"and.b32 u, l, {parts - 1};", "mad.lo.u32 sel, u, 0x1010, 0x4000;"]
    for c in range(chunks):  # d1 on the inputs
        for w in range(8):
            lines += _sign_lines(f"w{8 * c + w}", d1, 64 * c + 2 * w, parts)

    def unpack(src: str, dst: str, i: int) -> list[str]:  # bf16 pair -> two float32 (element 2i, 2i+1)
        return [f"shl.b32 {dst}{2 * i}, {src}{i}, 16;", f"and.b32 {dst}{2 * i + 1}, {src}{i}, 0xffff0000;"]

    def lane_sign(d: int) -> list[str]:  # s = -1 on the lane holding the upper half of the pair, else +1
        return [f"and.b32 m, l, {d};", "setp.ne.u32 up, m, 0;", "selp.f32 s, 0fBF800000, 0f3F800000, up;"]

    values = 16 * chunks
    if lane_bits:  # the first lane stage on the bf16 words: both lanes' values are exact in float32
        d = lane_bits[0]
        lines += [f"shfl.sync.bfly.b32 q{i}, w{i}, {d}, 0x1f, 0xffffffff;" for i in range(words)]
        lines += lane_sign(d)
        for i in range(words):
            lines += unpack("w", "v", i) + unpack("q", "p", i)
        lines += [f"fma.rn.f32 v{i}, v{i}, s, p{i};" for i in range(values)]
    else:
        for i in range(words):
            lines += unpack("w", "v", i)
    for d in lane_bits[1:]:
        lines += [f"shfl.sync.bfly.b32 p{i}, v{i}, {d}, 0x1f, 0xffffffff;" for i in range(values)]
        lines += lane_sign(d)
        lines += [f"fma.rn.f32 v{i}, v{i}, s, p{i};" for i in range(values)]
    if chunks == 2:  # the chunk bit: value i of chunk 0 with value i of chunk 1
        for i in range(16):
            lines += [f"add.f32 p{i}, v{i}, v{i + 16};", f"sub.f32 v{i + 16}, v{i}, v{i + 16};", f"mov.f32 v{i}, p{i};"]
    for h in (1, 2, 4, 8):  # the bits inside the thread's 16 columns
        for c in range(chunks):
            for i in range(16):
                if not i & h:
                    a, b = f"v{16 * c + i}", f"v{16 * c + i + h}"
                    lines += [f"add.f32 p0, {a}, {b};", f"sub.f32 {b}, {a}, {b};", f"mov.f32 {a}, p0;"]
    for i in range(words):
        lines.append(f"cvt.rn.bf16x2.f32 w{i}, v{2 * i + 1}, v{2 * i};")
    for c in range(chunks):  # d2 on the outputs
        for w in range(8):
            lines += _sign_lines(f"w{8 * c + w}", d2, 64 * c + 2 * w, parts)
    lines += [f"mov.b32 ${i}, w{i};" for i in range(words)]
    return "{\n" + "\n".join(regs + lines) + "\n}"
