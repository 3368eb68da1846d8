"""The index-formula decoders against every target's ``to_runtime``: every code and scale position, odd shapes.

``repack/runtime/formulas.py`` computes each element's position from the documented formula and shares no
code with the targets' view-and-permute transforms, so these tests fail when either side moves a byte, a
nibble, a word element, a scale or the multiplier (a wrong transform and its wrong inverse still round-trip).
"""

from __future__ import annotations

import pytest
import torch

from repack.errors import RepackError
from repack.nvfp4 import BLOCK_SIZE, NVFP4Weight, dequantize
from repack.runtime import formulas
from repack.runtime.formulas import FORMULAS, decode, formula_for, index_dtype
from repack.sample.synthetic import random_nvfp4
from repack.targets import TARGETS, sm120

from .conftest import ODD_SHAPES

# Odd shapes, plus ones that cross sm90's 128-row / 256-column and sm100's 128-row scale tiles more than once.
SHAPES = ODD_SHAPES + [(272, 528), (1040, 272)]


# each family's weight-only layout, and sm120's cute-dsl one (--linear-backend flashinfer_cutedsl)
WEIGHT_ONLY = [*TARGETS, sm120.CUTE_DSL]


def test_every_layout_has_a_formula():
    assert sorted(FORMULAS) == sorted({layout.layout_key for t in TARGETS for layout in t.layouts})


@pytest.mark.parametrize("target", WEIGHT_ONLY, ids=lambda t: f"{t.name}-{t.layout_id}")
@pytest.mark.parametrize("n,k", SHAPES)
def test_formula_decode_of_to_runtime_is_the_source(target, n, k):
    """Every logical element, gathered where the formula says, is the source's value, bit for bit in float64."""
    weight = random_nvfp4(n, k, allow_zero_scales=True)
    assert torch.equal(decode(target.to_runtime(weight), n, k, target.layout_key, torch.float64),
                       dequantize(target.as_read(weight)))


@pytest.mark.parametrize("target", WEIGHT_ONLY, ids=lambda t: f"{t.name}-{t.layout_id}")
@pytest.mark.parametrize("multiplier", [1.7e-3, 3.1e-42, 2.9e35], ids=["normal", "subnormal-results", "overflowing"])
def test_float32_decode_is_the_float64_decode_rounded_once(target, multiplier):
    """decode computes float32 output in float32: it must equal the exact float64 values rounded to float32, also
    where products fall into float32's subnormals or overflow (a random multiplier of each kind)."""
    seed = int(torch.randint(0, 2**31, ()))
    n, k = 200, 272
    weight = random_nvfp4(n, k, torch.Generator().manual_seed(seed), allow_zero_scales=True)
    mult = torch.tensor([multiplier], dtype=torch.float32) * (1 + torch.rand(1, generator=torch.Generator().manual_seed(seed)))
    weight = NVFP4Weight(weight.codes, weight.block_scales, mult)
    if target.read_as is not None and target.dtype == "bfloat16" and multiplier > 1:  # Marlin: times 2^119, refused
        with pytest.raises(RepackError, match="Marlin"):
            target.to_runtime(weight)
        return
    runtime = target.to_runtime(weight)
    exact = decode(runtime, n, k, target.layout_key, torch.float64)
    assert torch.equal(exact, dequantize(target.as_read(weight))), f"seed {seed}"
    assert torch.equal(decode(runtime, n, k, target.layout_key).view(torch.int32), exact.to(torch.float32).view(torch.int32)), \
        f"seed {seed}"


def nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


@pytest.mark.parametrize("target", WEIGHT_ONLY, ids=lambda t: f"{t.name}-{t.layout_id}")
@pytest.mark.parametrize("n,k", SHAPES)
def test_formula_covers_every_position_once_and_padding_is_zero(target, n, k):
    """Over the padded grid the formula is a bijection onto the runtime buffers (every nibble / word element
    and every scale byte has exactly one (row, col)); the positions outside the logical [n, k] hold zeros."""
    runtime = target.to_runtime(random_nvfp4(n, k))
    formula = formula_for(target.layout_key)
    geometry = target.geometry(n, k)
    rows, cols = torch.arange(geometry.n_padded), torch.arange(geometry.k_padded)
    codes = formula.code_offsets(rows, cols, n, k)  # two per byte: nibbles, or sm90's 8 elements per int32
    assert torch.equal(codes.reshape(-1).sort().values, torch.arange(2 * nbytes(runtime.weight)))
    scale_rows = torch.arange(runtime.weight_scale.numel() // (geometry.k_padded // BLOCK_SIZE))
    scales = formula.scale_offsets(scale_rows, torch.arange(geometry.k_padded // BLOCK_SIZE), n, k)
    assert torch.equal(scales.reshape(-1).sort().values, torch.arange(nbytes(runtime.weight_scale)))
    full = formula.code_values(runtime.weight, codes)
    assert not full[n:].any() and not full[:, k:].any(), "padded codes must decode to zero"
    padded_scales = formula.scales(runtime.weight_scale, scales)
    assert not padded_scales[n:].any() and not padded_scales[:, k // BLOCK_SIZE :].any(), "padded scales must be 0"


@pytest.mark.parametrize("target", WEIGHT_ONLY, ids=lambda t: f"{t.name}-{t.layout_id}")
def test_one_code_and_one_scale_land_where_the_formula_says(target):
    """A single nonzero code (and scale) per position: the formula finds it, and nothing else is nonzero."""
    n, k = 48, 80
    for row, col in [(0, 0), (1, 0), (0, 1), (17, 33), (47, 79), (40, 64), (9, 17)]:
        codes = torch.zeros((n, k // 2), dtype=torch.uint8)
        codes[row, col // 2] = 0x7 << (4 * (col % 2))  # E2M1 6.0 at (row, col)
        scales = torch.zeros((n, k // BLOCK_SIZE), dtype=torch.uint8)
        scales[row, col // BLOCK_SIZE] = 0x38  # e4m3 1.0
        weight = NVFP4Weight(codes, scales.view(torch.float8_e4m3fn), random_nvfp4(n, k).multiplier)
        got = decode(target.to_runtime(weight), n, k, target.layout_key, torch.float64)
        want = torch.zeros((n, k), dtype=torch.float64)
        want[row, col] = 6.0 * float(weight.multiplier)
        assert torch.equal(got, want), (row, col)


def test_offsets_are_int64_once_a_buffer_has_2_to_the_31_positions():
    """Two positions per byte (nibbles, or sm90's 8 elements per int32 word) must fit the index type."""
    below = torch.empty(2**30 - 1, dtype=torch.uint8, device="meta")
    assert index_dtype(below) == torch.int32
    assert index_dtype(torch.empty(2**28, dtype=torch.int32, device="meta")) == torch.int64  # 2**30 bytes
    assert index_dtype(torch.empty(2**30, dtype=torch.uint8, device="meta")) == torch.int64


@pytest.mark.parametrize("target", WEIGHT_ONLY, ids=lambda t: f"{t.name}-{t.layout_id}")
def test_int64_offsets_decode_what_int32_offsets_decode(target, monkeypatch):
    """The int64 path (layers of 1 GiB and more) is the same formula: forced on a small layer, the same values."""
    n, k = 1040, 272
    runtime = target.to_runtime(random_nvfp4(n, k, allow_zero_scales=True))
    narrow = decode(runtime, n, k, target.layout_key, torch.float64)
    monkeypatch.setattr(formulas, "index_dtype", lambda buffer: torch.int64)
    assert torch.equal(decode(runtime, n, k, target.layout_key, torch.float64), narrow)
