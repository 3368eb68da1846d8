"""sm90 layout (CPU): exact round trip, declared specs, and the kernel's decode against the reference dequant."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from repack.nvfp4 import NVFP4Weight, dequantize, pack_codes
from repack.sample.synthetic import random_nvfp4
from repack.targets import TARGETS, resolve_target, sm90, target_for_capability

# (N, K): multiples of 16 but not of 64, N = 16, unaligned to the 128 x 256 padding, and large layers.
SHAPES = [(16, 16), (16, 4096), (48, 80), (208, 1040), (1040, 272), (4096, 4096), (14336, 4096), (4096, 14336)]


def random_weight(n: int, k: int, seed: int) -> NVFP4Weight:
    return random_nvfp4(n, k, torch.Generator().manual_seed(seed), allow_zero_scales=True)


def assert_same_weight(got: NVFP4Weight, want: NVFP4Weight) -> None:
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
    assert torch.equal(got.multiplier.view(torch.int32), want.multiplier.view(torch.int32))


@pytest.mark.parametrize("n,k", SHAPES)
def test_round_trip_is_exact(n: int, k: int) -> None:
    weight = random_weight(n, k, seed=n * 7919 + k)
    layer = sm90.to_runtime(weight)
    assert layer.weights_padding_cols == 0
    assert_same_weight(sm90.from_runtime(layer, n, k), weight)


@pytest.mark.parametrize("n,k", SHAPES)
def test_runtime_tensors_match_specs(n: int, k: int) -> None:
    layer = sm90.to_runtime(random_weight(n, k, seed=k))
    specs = sm90.runtime_specs(n, k)
    for name, tensor in layer.tensors().items():
        assert tensor.dtype == specs[name].dtype, name
        assert tuple(tensor.shape) == specs[name].shape, name
        assert tensor.is_contiguous(), name
        assert tensor.numel() * tensor.element_size() == specs[name].nbytes, name


@pytest.mark.parametrize("n,k", SHAPES[:6])
def test_kernel_decode_equals_reference_dequant(n: int, k: int) -> None:
    """The kernel's rotate-and-mask decode of the runtime words, in float64, equals ``dequantize``."""
    weight = random_weight(n, k, seed=3 * n + k)
    layer = sm90.to_runtime(weight)
    assert torch.equal(sm90.dequantize_runtime(layer, n, k), dequantize(weight))


def test_padding_decodes_to_zero() -> None:
    n, k = 208, 1040
    layer = sm90.to_runtime(random_weight(n, k, seed=5))
    np_, kp = sm90.padded_shape(n, k)
    full = sm90.dequantize_runtime(layer, np_, kp)
    assert not full[n:].any() and not full[:, k:].any()


def test_word_bit_fields_are_disjoint_and_complete() -> None:
    fields = [sm90.SIGN_SHIFT[e] for e in range(8)] + [sm90.MAG_SHIFT[e] + b for e in range(8) for b in range(3)]
    assert sorted(fields) == list(range(32))


def test_registered_and_resolvable() -> None:
    """The registry's sm90 row is sm90's vLLM layout, with SGLang's layouts of the family after it."""
    registered = resolve_target("SM90a")
    assert registered in TARGETS and target_for_capability(9, 0) is registered
    assert replace(registered, variants=()) == sm90.TARGET
    assert {t.engine for t in registered.variants} == {"sglang"}


def test_word_element_position_matches_documented_v2_formula() -> None:
    """One nonzero code at a time lands in the word and element the module docstring names."""
    n, k = 32, 256
    np_, kp = sm90.padded_shape(n, k)
    for row, col in [(0, 0), (9, 17), (31, 255), (20, 100), (13, 70)]:
        nibbles = torch.zeros((np_, kp), dtype=torch.uint8)
        nibbles[row, col] = 0x9  # sign bit and the lowest magnitude bit: both fields must land
        words = sm90.pack_words(pack_codes(nibbles))
        s, g, h = row // 16, row % 8, (row % 16) // 8
        c, t, j, q, p = col // 64, (col % 64) // 16, (col % 16) // 4, (col % 4) // 2, col % 2
        e = p + 2 * h + 4 * q
        want = torch.zeros_like(words)
        want[s, 128 * c + 4 * (4 * g + t) + j] = (1 << sm90.MAG_SHIFT[e]) | (1 << sm90.SIGN_SHIFT[e])
        assert torch.equal(words, want), (row, col)


def test_kslot_column_is_a_permutation_within_chunks() -> None:
    kslot = torch.arange(512)
    col = sm90.kslot_column(kslot)
    assert torch.equal(col.sort().values, kslot)
    assert torch.equal(col // 64, kslot // 64)
    # lane t (k-slots 2t, 2t+1, 2t+8, 2t+9 of each tile j) reads one 16-column scale block, 4t .. 4t+3 words of x
    assert torch.equal(col[[2, 3, 10, 11, 18, 19, 26, 27]], torch.tensor([16, 17, 18, 19, 20, 21, 22, 23]))


def test_activations_in_kslot_order() -> None:
    from repack.runtime.backends.triton_sm90 import kslot_order

    x = torch.randn(3, 80, dtype=torch.bfloat16)
    out = kslot_order(x, 256)
    padded = torch.nn.functional.pad(x, (0, 176))
    assert torch.equal(out, padded[:, sm90.kslot_column(torch.arange(256))])


def test_decode_shifts_deliver_the_rotated_bits() -> None:
    """Where the decode PTX uses a plain left shift instead of a rotate, every bit it keeps is the same."""
    from repack.runtime.backends.triton_sm90 import ptx

    unsigned = torch.randint(0, 2**32, (4096,), dtype=torch.int64, generator=torch.Generator().manual_seed(3))
    unsigned[:2] = torch.tensor([0xFFFFFFFF, 0x80000001])
    words = unsigned.to(torch.int32)  # the same bits, as the int32 decode holds them
    plain = 0
    for r, mask in ptx._rotation_masks().items():
        rotated = ((unsigned << r) | (unsigned >> (32 - r))) & 0xFFFFFFFF  # uint32 rotate, in int64
        assert torch.equal(sm90._rotl32(words, r), rotated.to(torch.int32)), r
        line = ptx._rotate_line("w", r, mask)
        shifted = (unsigned << r) & 0xFFFFFFFF if line.startswith("shl") else rotated
        assert torch.equal(shifted & mask, rotated & mask), line
        plain += line.startswith("shl")
    assert plain == 4  # rotations 1, 2, 3 and 6 keep no wrapped bit; 12 does


@pytest.mark.parametrize(
    "m,n,warps",
    [(1, 4096, 8), (1, 8192, 8), (1, 10240, 4), (1, 14336, 8), (1, 57344, 4), (16, 4096, 8), (16, 8192, 4)],
)
def test_decode_split_takes_eight_warps_unless_that_adds_a_wave(m: int, n: int, warps: int) -> None:
    """On 132 SMs: 8-warp programs fit 4 per SM (64 registers; 80 at M > 8: 3), 4-warp ones 5 (96 registers).

    10240 rows = 640 one-stripe programs: 2 waves of 528 against 1 of 660; 57344 rows: 7 waves against 6.
    """
    from repack.runtime.backends import triton_sm90 as backend

    assert backend.gemv_config_for(m, n, 4096, sm_count=132).num_warps == warps


@pytest.mark.parametrize(
    "m,n,decode",
    [(1, 57344, True), (8, 57344, True), (9, 57344, False), (16, 8192, False), (16, 4096, True), (12, 4096, True),
     (12, 4100, False), (17, 4096, False)],
)  # fmt: skip
def test_decode_kernel_up_to_eight_rows_and_on_narrow_layers_to_sixteen(m: int, n: int, decode: bool) -> None:
    """On 132 SMs: M 9..16 goes to 16-row tensor-core tiles from 66 tiles of 64 rows (N = 4100 pads to 4224), to
    the decode kernel below (N = 4096: 64 tiles); M > 16 always to the tensor-core kernel."""
    from repack.runtime.backends import triton_sm90 as backend

    assert backend.uses_decode_kernel(m, n, sm_count=132) is decode
    if not decode and m <= 16:
        assert backend.tc_config_for(m, n, 4096, sm_count=132).bm == 16


@pytest.mark.parametrize(
    "tiles,steps,bm,per_sm,split",
    [(64, 64, 64, 2, 2), (32, 64, 64, 2, 4), (40, 64, 64, 2, 3), (80, 64, 256, 1, 1), (32, 12, 64, 2, 1),
     (32, 16, 64, 2, 2), (20, 64, 256, 1, 4), (132, 64, 64, 2, 2), (448, 64, 64, 2, 1), (128, 32, 64, 2, 1),
     (128, 32, 128, 2, 1), (64, 112, 64, 2, 4), (128, 112, 128, 2, 2), (128, 64, 32, 4, 4), (128, 48, 64, 2, 2),
     (224, 32, 32, 4, 2)],
)  # fmt: skip
def test_tensor_core_split_fills_idle_sms_and_stacks_only_on_long_k(
    tiles: int, steps: int, bm: int, per_sm: int, split: int
) -> None:
    """On 132 SMs: K is split into up to 4 parts of >= 8 steps while that fills idle SMs (64 tiles: 2); beyond one
    program per SM only where each part keeps >= 24 steps (16 for <= 32-row tiles): 128 tiles of 32 steps stay
    whole, of 112 split in 2, of 64 with 32-row tiles in 4; never into a second wave (80 tiles of 256 rows)."""
    from repack.runtime.backends.triton_sm90 import tensor_core

    config = tensor_core.TcConfig(bm=bm, warpgroups=1 if bm < 256 else 2, stages=3, per_sm=per_sm)
    assert tensor_core._tc_split(tiles, steps, config, 132) == split


@pytest.mark.parametrize(
    "m,n,k,bm",
    [(17, 4096, 4096, 32), (64, 8192, 8192, 64), (65, 8192, 8192, 128), (200, 8192, 8192, 128),
     (128, 4096, 4096, 64), (128, 4160, 8192, 128), (200, 8192, 28672, 256), (256, 4096, 14336, 128),
     (256, 14336, 4096, 256), (256, 10240, 8192, 256), (256, 8192, 8192, 128), (257, 8192, 8192, 256),
     (1024, 8192, 8192, 256),
     (1024, 10240, 8192, 128), (1024, 14336, 4096, 128), (4096, 10240, 8192, 256)],
)  # fmt: skip
def test_tensor_core_tile_by_m_and_wave_fill(m: int, n: int, k: int, bm: int) -> None:
    """On 132 SMs, up to M = 128: 64-row tiles on layers of fewer than 66 (N = 4096), else 128-row; up to M = 256:
    256-row tiles where more than 66 (N > 8448) or where their K splits keep >= 64 steps (8192 x 28672: 2 splits of
    112), else 128-row; beyond, 256-row tiles unless 128-row ones fill the waves >= 10% better: 10240 x 8192 at
    M = 1024, 320 tiles of 256 rows (2.4 waves) against 640 of 128 (4.8)."""
    from repack.runtime.backends import triton_sm90 as backend

    config = backend.tc_config_for(m, n, k, sm_count=132)
    assert config.bm == bm and config.stages >= 2
    if m <= 256:  # one warpgroup per program, several programs per SM, unless the tile is 256 rows
        assert (config.warpgroups, config.per_sm > 1) == ((2, False) if bm == 256 else (1, True))
