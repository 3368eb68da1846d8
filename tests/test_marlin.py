"""Marlin's layouts on CPU (repack/targets/marlin.py, moe_marlin.py): the repack against an independent port of the
CUDA kernel's index arithmetic (tests/vllm/ports.py, the conformance harness's leaf), exact inverses, the scale
factor and flush, and the MoE layout's index formulas. vLLM's own load: tests/test_vllm_marlin_conformance.py; the
CUDA op itself: tests/test_gpu_marlin.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from repack.errors import RepackError
from repack.nvfp4 import NVFP4Weight, dequantize
from repack.targets import marlin, moe, moe_marlin, resolve_target

from .conftest import ODD_SHAPES
from .test_moe import assert_round_trip

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from ports import gptq_marlin_repack  # noqa: E402

REPACK_SHAPES = [(64, 16), (64, 128), (128, 64), (192, 48), (320, 80), (448, 272), (960, 112)]


@pytest.mark.parametrize("n,k", REPACK_SHAPES)
def test_repack_is_the_cuda_kernels_index_arithmetic(n, k, random_seed):
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(random_seed))
    packed = marlin.repack_codes(codes, n, k)
    assert torch.equal(packed, gptq_marlin_repack(codes.view(torch.int32).T.contiguous(), k, n, 4))
    assert torch.equal(marlin.unrepack_codes(packed, n, k), codes)


def test_repack_in_slabs_is_the_whole_repack(monkeypatch, random_seed):
    """Large layers are repacked a slab of k tiles at a time (bounded temporaries): the same bytes."""
    codes = torch.randint(0, 256, (192, 200), dtype=torch.uint8, generator=torch.Generator().manual_seed(random_seed))
    whole = marlin.repack_codes(codes, 256, 448)
    monkeypatch.setattr(marlin, "SLAB_NIBBLES", 3 * 16 * 256)  # 3 k tiles a slab: 28 tiles in 10 slabs
    assert torch.equal(marlin.repack_codes(codes, 256, 448), whole)
    assert torch.equal(whole, gptq_marlin_repack(torch.nn.functional.pad(codes, (0, 24, 0, 64)).view(torch.int32).T
                                                 .contiguous(), 448, 256, 4))


@pytest.mark.parametrize("n,k", ODD_SHAPES)
def test_padding_is_vllms_cheaper_tile_family(n, k):
    n_padded, k_padded = marlin.padded_nk(n, k)
    assert (n_padded % 64, k_padded % 128) == (0, 0) or (n_padded % 128, k_padded % 64) == (0, 0)
    assert (n_padded, k_padded) in ((-(-n // 64) * 64, -(-k // 128) * 128), (-(-n // 128) * 128, -(-k // 64) * 64))


@pytest.mark.parametrize("n", [64, 130, 288])
def test_bias_permutation_is_scale_perm_single_and_round_trips(n, random_seed):
    """vLLM's ``scale_perm_single``, written out: each 32 entries ``[0, 1, 8, 9, 16, 17, 24, 25, 2, 3, ...]``."""
    single = [i + 8 * j + b for i in range(0, 8, 2) for j in range(4) for b in range(2)]
    bias = torch.randn(n).to(torch.bfloat16)
    n_padded = marlin.padded_nk(n, 128)[0]
    held = marlin.permute_bias(bias, n_padded)
    padded = torch.cat([bias, bias.new_zeros(n_padded - n)])
    assert torch.equal(held, padded.reshape(-1, 32)[:, single].reshape(-1))
    assert torch.equal(marlin.unpermute_bias(held, n), bias)


def test_scale_factor_lifts_the_largest_scale_near_448_and_flushes_the_rest_as_marlin_does():
    scales = torch.tensor([[3.0, 2.0**-9, 0.0, 1.5]]).to(torch.float8_e4m3fn)
    assert marlin.scale_factor(scales, torch.bfloat16) == 128.0  # 3 * 128 = 384 <= 448 < 768
    assert marlin.scale_factor(scales, torch.float16) == 1.0  # fp16 activations: never rescaled
    weight = NVFP4Weight(torch.zeros((1, 32), dtype=torch.uint8), scales, torch.tensor([1e-3]))
    assert marlin.read_as(weight, torch.bfloat16).block_scales.float().tolist() == [[3.0, 2.0**-9, 0.0, 1.5]]
    assert marlin.read_as(weight, torch.float16).block_scales.float().tolist() == [[3.0, 0.0, 0.0, 1.5]]  # < 2^-6
    sm80 = resolve_target("sm80")
    held = sm80.to_runtime(weight)
    assert float(held.weight_global_scale) == pytest.approx(1e-3 * 2.0**119 / 128, rel=1e-7)
    back = sm80.from_runtime(held, 1, 64)
    assert torch.equal(dequantize(back), dequantize(sm80.as_read(weight)))
    assert torch.equal(back.multiplier, weight.multiplier)


def test_a_multiplier_that_overflows_marlins_global_scale_is_refused():
    weight = NVFP4Weight(torch.zeros((64, 8), dtype=torch.uint8), torch.ones((64, 1)).to(torch.float8_e4m3fn),
                         torch.tensor([1e9]))
    with pytest.raises(RepackError, match="overflows Marlin's global scale"):
        resolve_target("sm80").to_runtime(weight)


def _stack(experts: int, hidden: int, inter: int, gen: torch.Generator) -> moe.ExpertStack:
    def codes(n: int, k: int) -> torch.Tensor:
        return torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)

    def scales(n: int, k: int, top: float) -> torch.Tensor:
        return (torch.rand((experts, n, k // 16), generator=gen) * top).to(torch.float8_e4m3fn)

    return moe.ExpertStack(codes(2 * inter, hidden), scales(2 * inter, hidden, 60), torch.rand(experts, 2) + 0.1,
                           torch.ones(experts, 2), codes(hidden, inter), scales(hidden, inter, 2),
                           torch.rand(experts) + 0.1, torch.ones(experts))


@pytest.mark.parametrize("experts,hidden,inter", [(2, 128, 48), (3, 192, 64), (2, 64, 128), (1, 256, 80)])
def test_moe_layout_round_trips_and_matches_its_index_formulas(experts, hidden, inter, random_seed):
    stack = _stack(experts, hidden, inter, torch.Generator().manual_seed(random_seed))
    read = moe_marlin.read_as(stack)
    held = assert_round_trip(moe_marlin, stack, read, hidden, inter)
    for e in range(experts):
        for which in ("w13", "w2"):
            codes, scales = moe_marlin.decode_expert(held, e, which, hidden, inter)
            assert torch.equal(codes, getattr(stack, f"{which}_codes")[e]), (e, which)
            own = stack.w13_multiplier[e, 0] if which == "w13" else stack.w2_multiplier[e]
            got = dequantize(NVFP4Weight(codes, scales, torch.ones(1))) * moe_marlin.expert_multiplier(held, e, which)
            want = dequantize(NVFP4Weight(codes, getattr(read, f"{which}_scales")[e], own.reshape(1)))
            assert torch.allclose(got, want, rtol=1e-6, atol=0), (e, which)


def test_moe_chunks_share_the_layers_scale_factor(random_seed):
    """convert writes a large layer a chunk of experts at a time: each chunk with the whole layer's largest
    scales gives that chunk's rows of the whole layer's tensors."""
    stack = _stack(4, 128, 64, torch.Generator().manual_seed(random_seed))
    whole = moe_marlin.to_runtime(stack)
    top = moe_marlin.largest_scales(stack)
    part = moe.ExpertStack(*(getattr(stack, f)[2:] for f in ("w13_codes", "w13_scales", "w13_multiplier",
                                                             "w13_input_scale", "w2_codes", "w2_scales",
                                                             "w2_multiplier", "w2_input_scale")), largest_scales=top)
    for name, tensor in moe_marlin.to_runtime(part).items():
        assert torch.equal(tensor.view(torch.uint8), whole[name][2:].view(torch.uint8)), name


def test_moe_shapes_vllm_refuses_are_refused():
    with pytest.raises(RepackError, match="hidden size a multiple of 64"):
        moe_marlin.check_shape(2, 96, 64)
    with pytest.raises(RepackError, match="multiple of 16"):
        moe_marlin.check_shape(2, 128, 40)


def test_gpu_state_checks_read_0d_tensors():
    """tests/test_gpu_marlin.py compares vLLM's state on the GPU byte for byte, and Marlin's global scale is a
    float32 [] there (its first H200 run failed reading it): the helpers read 0-d and strided tensors."""
    from .test_gpu_marlin import raw_bytes, state_digest

    module = torch.nn.Module()
    module.weight_global_scale = torch.nn.Parameter(torch.tensor(0.25), requires_grad=False)
    module.register_buffer("strided", torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, ::2])
    assert torch.equal(raw_bytes(module.weight_global_scale), torch.tensor(0.25).reshape(1).view(torch.uint8))
    assert torch.equal(raw_bytes(module.strided), module.strided.contiguous().reshape(-1).view(torch.uint8))
    digest = state_digest(module)
    assert digest["weight_global_scale"][:2] == ("torch.float32", ())
    assert digest["strided"][:2] == ("torch.float32", (3, 2))
