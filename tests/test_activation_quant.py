"""W4A4 activation quantization (``repack.nvfp4``) against outside truth and against itself.

1. vLLM 0.33's own CPU emulation (``nvfp4_emulation_utils.ref_nvfp4_quant`` and ``dequantize_to_dtype``) in the
   vLLM oracle venv: the kernel's recipe with exact float32 division where the CUDA kernel uses
   ``rcp.approx.ftz.f32``. Our recipe with exact reciprocals must match it bit for bit; the kernel's (measured)
   approximate reciprocals may move a code only where ``x * scale`` sits within float32 ulps of a rounding
   boundary, and then by one E2M1 step; vLLM must read our codes and scales as we do.
2. The producers' own quantizers on CPU: compressed-tensors' ``fake_quantize`` with the NVFP4 preset's
   ``input_activations`` args, ModelOpt's ``NVFP4QTensor.quantize`` / ``dequantize`` with ``1/gs`` as its scale 2.
3. ``quantize_activations`` (float32, kernel-exact) against ``fake_quantize_activations`` (float64, the format's
   definition): equal except near rounding boundaries; equal everywhere where the ties are exact in float32 too.
4. A reference without activation quantization is far from ``w4a4_reference`` (the mutation check).

Inputs: fresh random bf16/fp16 rows over 40 decades, M odd, K a multiple of 16 but not of 64, plus crafted
blocks on every E2M1 tie, saturated and underflowing scales, all-zero (and -0.0) blocks, e4m3-subnormal scales.
In CI the vLLM venv and the producer libraries must be there: these tests fail instead of skipping.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from repack.errors import RepackError
from repack.nvfp4 import (
    E2M1_VALUES,
    _e4m3_grid,
    _quantize_activations,
    _rcp_approx_deltas,
    _rcp_approx_ftz,
    e2m1_to_float,
    fake_quantize_activations,
    quantize_activations,
    unpack_codes,
    w4a4_reference,
)

from .conftest import SEED_ENV, require
from .test_vllm_conformance import HERE, _vllm_python

TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)  # E2M1 rounding boundaries
NEAR = 2.0**-20  # relative band around a boundary where float32 steps and float64 math may round apart


def _tie_blocks(gen: torch.Generator, rows: int, gs: float, scales: list[float], dtype) -> torch.Tensor:
    """Blocks of block scale ``s`` (an element at ``6 s / gs``) whose other elements are E2M1 ties or grid points
    (``t s / gs``) rounded to ``dtype``, random signs, one block per scale in ``scales``."""
    points = torch.cat([TIES, torch.tensor(E2M1_VALUES[:8], dtype=torch.float64)])
    pick = points[torch.randint(0, points.numel(), (rows, len(scales), 16), generator=gen)]
    pick[..., 0] = 6.0
    sign = torch.randint(0, 2, pick.shape, generator=gen) * 2 - 1
    s = torch.tensor(scales, dtype=torch.float64).view(1, -1, 1)
    x = (pick * sign * s / gs).to(dtype)
    assert torch.equal(_e4m3_nearest(gs * x.double().abs().amax(-1, keepdim=True) / 6), s.expand(rows, -1, 1))
    return x.view(rows, -1)


def _random_rows(gen: torch.Generator, rows: int, k: int, dtype, decades: float) -> torch.Tensor:
    magnitude = 10.0 ** ((torch.rand(rows, 1, generator=gen) * 2 - 1) * decades)
    return (torch.randn(rows, k, generator=gen) * magnitude).to(dtype)


def _cases(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (x, global scale float32 [1]); fresh random values from the test's seed."""
    out = {}
    for dtype, k, decades in ((torch.bfloat16, 1008, 20.0), (torch.float16, 80, 3.0)):
        x = _random_rows(gen, 37, k, dtype, decades)
        x[3] = 0.0
        x[4, :16] = -0.0
        x[5] = (x[5].float() * 1e-3).to(dtype)  # scales far below the row's: e4m3 subnormals, underflow to 0
        # Calibrated like a producer (gs = 448 * 6 / amax) on a random fraction of one row's amax: rows above
        # it saturate the block scale at 448, rows far below underflow it.
        calib = x[6].float().abs().amax() * float(torch.empty(()).uniform_(0.3, 1.5, generator=gen))
        out[f"random-{str(dtype)[6:]}"] = x, (448 * 6 / calib).reshape(1)
    # Exact ties in float32 too: power-of-two global scale and block scales (including e4m3 subnormal ones).
    out["ties-pow2"] = (_tie_blocks(gen, 9, 2.0**-3, [2.0**q for q in range(-9, 9)], torch.bfloat16),
                        torch.tensor([2.0**-3]))
    # Ties in exact math that float32 reciprocals resolve: with gs = 1.75 * 2^5 and s = 2^q the kernel's
    # rcp.approx gives the scale gs / s exactly where exact division is one ulp below, so x = s / 2^5 (a tie at
    # 1.75) rounds up on the GPU and down in vLLM's emulation; gs = 1.5 * 2^5 misses its ties either way.
    for gs in (56.0, 48.0):
        out[f"ties-{gs:g}"] = (_tie_blocks(gen, 7, gs, [2.0**q for q in range(-9, 9)], torch.bfloat16),
                               torch.tensor([gs]))
    out["saturate"] = (_random_rows(gen, 3, 48, torch.bfloat16, 30.0) * 1e8, torch.tensor([1e3]))
    return out


def _decode(codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """float64 dequantized activations from codes and block scales (``e2m1 * s / gs``)."""
    m = codes.shape[0]
    values = e2m1_to_float(unpack_codes(codes), torch.float64).view(m, -1, 16)
    return (values * scales.double().unsqueeze(-1) / float(gs)).view(m, -1)


def _near_boundary(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """bool ``[M, K]``: elements where float32 and float64 may round apart, those whose ``x * gs / s`` is within
    ``NEAR`` of an E2M1 tie, and every element of a block whose ``gs * amax / 6`` is near an e4m3 tie."""
    m, k = x.shape
    blocks = x.double().view(m, -1, 16)
    g = float(gs)
    target = g * blocks.abs().amax(-1, keepdim=True) / 6
    grid = _e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2
    block_near = ((target.unsqueeze(-1) - mids).abs() <= NEAR * mids).any(-1)
    s = _e4m3_nearest(target)
    value = (blocks.abs() * g / torch.where(s > 0, s, 1.0)).unsqueeze(-1)
    near = ((value - TIES).abs() <= NEAR * TIES).any(-1) & (s > 0)
    return (near | block_near).view(m, k)


def _e4m3_nearest(values: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value through torch's own float8 cast (RNE; saturated at 448 first)."""
    return values.clamp(max=448).to(torch.float8_e4m3fn).double()


def _assert_one_step_apart(ours: torch.Tensor, theirs: torch.Tensor, allowed: torch.Tensor, scale: torch.Tensor,
                           what: str) -> int:
    """``ours`` == ``theirs`` outside ``allowed``; inside, at most one E2M1 step (of ``scale`` units) apart."""
    differ = ours != theirs
    assert not (differ & ~allowed).any(), f"{what}: {int((differ & ~allowed).sum())} differences away from ties"
    steps = (ours - theirs).abs()[differ] / scale[differ]
    assert (steps <= 1.0 + 1e-9).all(), f"{what}: a difference of {float(steps.max())} E2M1 units"
    return int(differ.sum())


@pytest.fixture(scope="module")
def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    seed = int(os.environ.get(SEED_ENV) or torch.randint(0, 2**31, ()))
    print(f"activation cases seed {seed} ({SEED_ENV} reproduces it)")
    return _cases(torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def vllm_emulation(cases, vllm_version, tmp_path_factory) -> dict[str, torch.Tensor]:
    """vLLM's ``ref_nvfp4_quant`` of every case, and its reading of our codes, from the vLLM venv."""
    python = _vllm_python(vllm_version)
    folder = tmp_path_factory.mktemp("vllm-emulation")
    tensors = {}
    for name, (x, gs) in cases.items():
        codes, scales = quantize_activations(x, gs)
        tensors |= {f"{name}.x": x, f"{name}.gs": gs, f"{name}.codes": codes, f"{name}.scales": scales}
    save_file(tensors, folder / "in.safetensors")
    subprocess.run([str(python), str(HERE / "emulation.py"), str(folder / "in.safetensors"),
                    str(folder / "out.safetensors")], check=True, timeout=600)
    return load_file(folder / "out.safetensors")


def _scaled(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E2M1 values where the block scale is non-zero, 0 elsewhere. Where the scale underflows to 0 the kernel
    writes zero codes (its encode scale is 0) but vLLM's emulation multiplies by 1/(0 + 1e8) and can write
    non-zero ones: the values differ, the dequantized ones (times scale 0) do not."""
    live = (scales.float() != 0).repeat_interleave(16, dim=1)
    return torch.where(live, values, torch.zeros_like(values))


def test_recipe_matches_vllm_emulation_bit_for_bit(cases, vllm_emulation):
    """With exact reciprocals (vLLM's emulation's only difference from the CUDA kernel) every block scale and
    every E2M1 value equals vLLM's, ties and saturation included."""
    for name, (x, gs) in cases.items():
        codes, scales = _quantize_activations(x, gs, torch.reciprocal)
        values = e2m1_to_float(unpack_codes(codes)).view(x.shape)
        assert torch.equal(scales.float(), vllm_emulation[f"{name}.scale"]), name
        assert torch.equal(values, _scaled(vllm_emulation[f"{name}.fp4"], scales)), name


def test_kernel_reciprocals_move_codes_only_at_ties(cases, vllm_emulation):
    """The CUDA kernel's rcp.approx.ftz.f32 (measured table) against vLLM's exact division: same scales, codes
    one step apart at most, only at float32-ulp ties, and it does move some (``ties-56``)."""
    moved = 0
    for name, (x, gs) in cases.items():
        codes, scales = quantize_activations(x, gs)
        assert torch.equal(scales.float(), vllm_emulation[f"{name}.scale"]), name
        ours = e2m1_to_float(unpack_codes(codes), torch.float64).view(x.shape)
        theirs = _scaled(vllm_emulation[f"{name}.fp4"], scales).double()
        moved += _assert_one_step_apart(ours, theirs, _near_boundary(x, gs), _step(ours, theirs), name)
    assert moved > 0, "no input exercised the kernel's approximate reciprocal"


def _step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Width of the E2M1 step between two E2M1 values (0.5 below 2, 1 below 4, 2 above)."""
    top = torch.maximum(a.abs(), b.abs())
    return torch.where(top <= 2, 0.5, torch.where(top <= 4, 1.0, 2.0)).double()


def test_vllm_reads_our_codes_and_scales(cases, vllm_emulation):
    """vLLM's own dequantizer (linear scale layout) on our bytes gives ``e2m1(code) * block_scale``."""
    for name, (x, gs) in cases.items():
        codes, scales = quantize_activations(x, gs)
        expected = _decode(codes, scales, torch.ones(1)).float()
        assert torch.equal(vllm_emulation[f"{name}.decoded"], expected), name


def test_compressed_tensors_fake_quantize(cases):
    """llm-compressor's activation QDQ (NVFP4 preset, dynamic local block scales, the checkpoint's global scale)
    equals the float64 definition away from rounding ties."""
    require("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    args = preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    for name, (x, gs) in cases.items():
        x32 = x.float()  # compressed-tensors computes amax / 6 in the input's dtype; the kernel in float32
        scale, zero = compute_dynamic_scales_and_zp(value=x32, args=args, module=torch.nn.Module(), global_scale=gs)
        theirs = fake_quantize(x32, scale, zero, args, global_scale=gs).double()
        ours = fake_quantize_activations(x, gs)
        close = torch.isclose(ours, theirs, rtol=NEAR, atol=0.0)
        allowed = _near_boundary(x, gs)
        assert not (~close & ~allowed).any(), f"{name}: {int((~close & ~allowed).sum())} elements differ"


def test_modelopt_nvfp4_quantizer(cases):
    """ModelOpt's NVFP4 quantizer with ``1/gs`` as its per-tensor scale (what ModelOpt exports as input_scale)
    equals the float64 definition away from ties, except where the block scale underflows: ModelOpt clamps it
    to 2^-9 and quantizes the block, the kernel writes scale 0 (all of the block dequantizes to 0)."""
    require("modelopt")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    for name, (x, gs) in cases.items():
        qtensor, block_scale, scale_2 = NVFP4QTensor.quantize(x.float(), 16, weights_scaling_factor_2=1 / gs)
        theirs = qtensor.dequantize(torch.float64, scale=block_scale, double_scale=scale_2,
                                    block_sizes={-1: 16}).view(x.shape)
        ours = fake_quantize_activations(x, gs)
        m, k = x.shape
        amax = x.double().view(m, -1, 16).abs().amax(-1, keepdim=True)
        underflow = ((amax > 0) & (_e4m3_nearest(float(gs) * amax / 6) == 0)).expand(m, k // 16, 16).reshape(m, k)
        close = torch.isclose(ours, theirs, rtol=NEAR, atol=0.0)
        allowed = _near_boundary(x, gs) | underflow
        assert not (~close & ~allowed).any(), f"{name}: {int((~close & ~allowed).sum())} elements differ"


def test_kernel_result_against_float64_definition(cases):
    """quantize_activations (float32 steps, approximate reciprocals) and fake_quantize_activations (exact float64)
    agree everywhere except within float32 ulps of a tie; bit for bit where ties are exact in float32 too."""
    for name, (x, gs) in cases.items():
        codes, scales = quantize_activations(x, gs)
        ours, definition = _decode(codes, scales, gs), fake_quantize_activations(x, gs)
        scale = scales.double().repeat_interleave(16, dim=1) / float(gs)
        unit = _step(ours / torch.where(scale > 0, scale, 1.0), definition / torch.where(scale > 0, scale, 1.0))
        moved = _assert_one_step_apart(ours, definition, _near_boundary(x, gs), unit * scale, name)
        if name == "ties-pow2":
            assert moved == 0
    x, gs = cases["ties-pow2"]
    assert torch.equal(quantize_activations(x, gs)[1].double(), _e4m3_nearest(float(gs) * x.double().view(
        x.shape[0], -1, 16).abs().amax(-1) / 6)), "tie blocks' scales are exact"


def test_w4a4_reference_is_an_fp4_gemm_and_not_a_bf16_one(cases):
    """w4a4_reference is the FP4 x FP4 GEMM of the quantized activations (exactly, where activations are exact),
    and a reference that skips activation quantization is measurably far from it (the mutation check)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for name, (x, gs) in cases.items():
        weight = torch.randn(21, x.shape[1], generator=gen, dtype=torch.float64)
        reference = w4a4_reference(x, weight, gs)
        unquantized = x.double() @ weight.T
        rel = float((reference - unquantized).norm() / unquantized.norm())
        assert rel > 1e-2, f"{name}: skipping activation quantization changes the output by only {rel:.2e}"
    x, gs = cases["ties-pow2"]
    codes, scales = quantize_activations(x, gs)
    assert torch.equal(w4a4_reference(x, weight := torch.randn(5, x.shape[1], generator=gen, dtype=torch.float64), gs),
                       _decode(codes, scales, gs) @ weight.T)


def test_codes_keep_the_sign_of_zero():
    """cvt.rn keeps the sign: -0.0 and negatives that round to zero (or sit in a block whose scale underflows)
    give nibble 0x8, +0 gives 0x0 (vLLM's float emulation cannot tell them apart)."""
    x = torch.tensor([[-0.0, 0.0, -0.1, 0.1, -6.0] + [0.0] * 11, [-1e-30, 1e-30] + [0.0] * 14], dtype=torch.bfloat16)
    nibbles = unpack_codes(quantize_activations(x, torch.ones(1))[0])
    assert nibbles[0, :5].tolist() == [0x8, 0x0, 0x8, 0x0, 0xF] and nibbles[1, :2].tolist() == [0x8, 0x0]


def test_rcp_approx_table():
    """The measured rcp.approx.ftz.f32: one ulp off on 1,108,522 of 2^23 mantissas, never more, exact on powers of
    two and 6 (the kernel's rcp(6) is 1/6 rounded), flush-to-zero at both ends."""
    deltas = _rcp_approx_deltas()
    assert deltas.shape == (2**23,) and int(deltas.abs().max()) == 1
    assert int(deltas.count_nonzero()) == 1108522
    x = torch.tensor([1.0, 2.0**-100, 2.0**100, 6.0, 0.0, 1e-40, 2.0**127])
    expected = torch.tensor([1.0, 2.0**100, 2.0**-100, 1 / 6, torch.inf, torch.inf, 0.0])
    assert torch.equal(_rcp_approx_ftz(x), expected)
    # One known off-by-one from the measurement: mantissa 1449 (the first), one ulp below 1/x rounded.
    y = torch.tensor([1449], dtype=torch.int32).add(0x3F800000).view(torch.float32)
    assert int(_rcp_approx_ftz(y).view(torch.int32)) == int(torch.reciprocal(y).view(torch.int32)) - 1


@pytest.mark.parametrize("x,gs,match", [
    (torch.zeros(3, 24, dtype=torch.bfloat16), torch.ones(1), "multiple of 16"),
    (torch.zeros(3, 32), torch.ones(1), "bf16/fp16"),
    (torch.zeros(3, 32, dtype=torch.bfloat16), torch.ones(1, dtype=torch.float64), "one float32"),
    (torch.zeros(3, 32, dtype=torch.bfloat16), torch.zeros(1), "positive normal"),
    (torch.zeros(3, 32, dtype=torch.bfloat16), torch.full((1,), torch.inf), "positive normal"),
])
def test_refuses_bad_inputs(x, gs, match):
    for fn in (quantize_activations, fake_quantize_activations):
        with pytest.raises(RepackError, match=match):
            fn(x, gs)
    with pytest.raises(RepackError, match="float64"):
        w4a4_reference(torch.zeros(3, 32, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.float64), torch.ones(1))
