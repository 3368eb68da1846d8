"""Marlin (sm75-sm89, sm120 weight-only): what vLLM 0.33's ``MarlinNvFp4LinearKernel`` holds after its load.

vLLM serves NVFP4 weight-only with Marlin wherever no FP4 x FP4 kernel runs (``is_fp4_marlin_supported``: compute
capability >= 7.5; Humming outranks it only on sm90). ``prepare_fp4_layer_for_marlin``
(``quantization/utils/marlin_utils_fp4.py``) turns the checkpoint's tensors into:

weight: int32 ``[Kp/16, 2 Np]``: the codes zero-padded to ``marlin_padded_nk`` (N to 64 and K to 128, or N to 128
    and K to 64, the smaller), in GPTQ order (``weight.view(int32).T``) then ``gptq_marlin_repack``
    (csrc/quantization/gptq_marlin/gptq_marlin_repack.cu, 4 bits, no act-order): per 16 x 64 tile, thread ``t`` of
    warp ``w`` packs 8 codes into int32 ``4 t + w`` (:func:`repack_codes`, a permute).
weight_scale: float8_e4m3fn ``[Kp/16, Np]`` holding S0E5M3 bytes: the scales transposed, zero-padded, cast to
    the activation dtype, each 64 columns an 8 x 8 transpose (``marlin_permute_scales``), each 4 swapped
    ``[0, 2, 1, 3]``, multiplied by a power of two ``sf`` (bf16 only; the largest scale near 448), times 2^7, below
    2 flushed to 0, and the top byte of the fp16 bits shifted left by one (``nvfp4_marlin_process_scales``).
weight_global_scale: float32 ``[1]``: the multiplier times ``2^(bias - 7)`` (bias 126 for bf16, 14 for fp16) over
    ``sf`` (``nvfp4_marlin_process_global_scale``).
bias (a layer with one: Qwen2's q/k/v): the activation dtype ``[Np]``, zero-padded and each 32 entries a 4 x 4
    transpose of pairs (``marlin_permute_bias``: :func:`permute_bias`). A bundle passes biases through whole, as the
    source holds them (vLLM's loader fuses and cuts them per rank); the vLLM and SGLang plugins apply their engine's
    own pad and permute after that load.

The inverse is exact except for the block scales Marlin flushes (``scale * sf * 2^7 < 2``: below 2^-6 / sf), which
come back as 0 as Marlin reads them (:func:`flushed`); ``sf`` is recovered from the source multiplier, which a
bundle keeps as ``weight_multiplier`` (vLLM's state cannot tell ``sf`` from the scales alone).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch

from ..errors import RepackError
from ..nvfp4 import BLOCK_SIZE, InputScale, NVFP4Weight
from . import families, w4a4
from .base import W4A4_SCALARS, LayerGeometry, RuntimeLayer, Target, TensorSpec
from .families import Family
from .layout import round_up

TILE_K, TILE_N = 16, 64  # gptq_marlin_repack's tile (marlin::tile_k_size, tile_n_size)
FP8_MAX = 448.0
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
W4A4_IDS = {"marlin-v1": "marlin-v1-w4a4", "marlin-fp16-v1": "marlin-fp16-v1-w4a4"}  # Marlin's W4A4 variants, by dtype


def padded_nk(n: int, k: int) -> tuple[int, int]:
    """``marlin_padded_nk(n, k, 16)``: the cheaper of (N to 64, K to 128) and (N to 128, K to 64)."""
    candidates = ((round_up(n, 64), round_up(k, math.lcm(128, BLOCK_SIZE))),
                  (round_up(n, 128), round_up(k, math.lcm(64, BLOCK_SIZE))))
    return min(candidates, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def geometry(n: int, k: int) -> LayerGeometry:
    n_padded, k_padded = padded_nk(n, k)
    return LayerGeometry(n_padded, k_padded, (k_padded - k) // 2)


# --- codes: gptq_marlin_repack (4 bits, no perm) as one permute ---
# Within a 16 x 64 tile, k = 8a + 2r + b and n = 16w + 8c + t go to int32 4(4t + r) + w ... precisely: thread
# th = 4t + r of warp w writes int32 4 th + w, whose nibble i = 4b + 2c + a holds that code (pack_idx 0 2 4 6 1 3 5 7).
def _unpack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> one code per byte ``[N, K]`` (low nibble first)."""
    return torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(codes.shape[0], -1)


def _pack(nibbles: torch.Tensor) -> torch.Tensor:
    """``[..., 2m]`` codes -> ``[..., m]`` bytes, even index in the low nibble."""
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


SLAB_NIBBLES = 1 << 22  # codes unpacked at once (a few MB of temporaries whatever the layer's size)


def repack_codes(codes: torch.Tensor, n_padded: int, k_padded: int) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> int32 ``[Kp/16, 2 Np]``: ``gptq_marlin_repack(pad(codes.view(int32).T), Kp, Np, 4)``,
    a slab of k tiles at a time (output rows are k tiles)."""
    n, half_k = codes.shape
    k_tiles = k_padded // 16
    out = torch.empty((k_tiles, 2 * n_padded), dtype=torch.int32, device=codes.device)
    step = max(1, SLAB_NIBBLES // (16 * n_padded))
    for first in range(0, k_tiles, step):
        last = min(k_tiles, first + step)
        slab = torch.zeros((n_padded, 16 * (last - first)), dtype=torch.uint8, device=codes.device)
        cols = codes[:, 8 * first: min(half_k, 8 * last)]
        slab[:n, : 2 * cols.shape[1]] = _unpack(cols)
        # [N, K] as (nt, w, c, t, kt, a, r, b) -> (kt, nt, t, r, w, b, c, a)
        tiles = slab.view(n_padded // 64, 4, 2, 8, last - first, 2, 4, 2).permute(4, 0, 3, 6, 1, 7, 2, 5)
        out[first:last] = _pack(tiles.reshape(last - first, -1)).view(torch.int32)
    return out


def unrepack_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Exact inverse of :func:`repack_codes`: uint8 ``[N, K/2]``."""
    k_tiles, cols = packed.shape
    n_padded, k_padded = cols // 2, k_tiles * 16
    nibbles = _unpack(packed.contiguous().view(torch.uint8).reshape(1, -1)).view(
        k_tiles, n_padded // 64, 8, 4, 4, 2, 2, 2)  # (kt, nt, t, r, w, b, c, a)
    full = nibbles.permute(1, 4, 6, 2, 0, 7, 3, 5).reshape(n_padded, k_padded)
    return _pack(full[:n, :k]).contiguous()


# --- scales ---
def _permute_columns(s: torch.Tensor) -> torch.Tensor:
    """``marlin_permute_scales`` (group 16 < K): each 64 columns an 8 x 8 transpose, then each 4 swapped
    ``[0, 2, 1, 3]`` (``nvfp4_marlin_process_scales``'s fp8 layout). Returns the permutation applied to columns."""
    g, n = s.shape
    s = s.reshape(g, n // 64, 8, 8).transpose(2, 3).reshape(g, n // 4, 4)
    return s[:, :, [0, 2, 1, 3]].reshape(g, n)


def _unpermute_columns(s: torch.Tensor) -> torch.Tensor:
    g, n = s.shape
    s = s.reshape(g, n // 4, 4)[:, :, [0, 2, 1, 3]]
    return s.reshape(g, n // 64, 8, 8).transpose(2, 3).reshape(g, n)


def permute_bias(bias: torch.Tensor, n_padded: int) -> torch.Tensor:
    """``marlin_permute_bias(marlin_pad_dim(bias, n, n_padded))``: zero-padded to ``n_padded``, each 32 entries (4
    groups of 4 pairs) read group-major (``scale_perm_single``: ``[0, 1, 8, 9, 16, 17, 24, 25, 2, 3, ...]``)."""
    padded = torch.nn.functional.pad(bias, (0, n_padded - bias.shape[0]))
    return padded.reshape(-1, 4, 4, 2).transpose(1, 2).reshape(n_padded).contiguous()


def unpermute_bias(held: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`permute_bias`'s inverse: the first ``n`` entries in the source's order."""
    return held.reshape(-1, 4, 4, 2).transpose(1, 2).reshape(-1)[:n].contiguous()


def scale_factor(scales: torch.Tensor, dtype: torch.dtype) -> float:
    """``_nvfp4_compute_scale_factor``: the power of two bringing the largest scale up to (448/2, 448] (1 for
    fp16 activations, or when no scale is positive)."""
    if dtype == torch.float16:
        return 1.0
    ws = scales.to(dtype).to(torch.half).float() * 2**7
    positive = ws[ws > 0]
    if positive.numel() and positive.max() < FP8_MAX * 2**7:
        return (FP8_MAX * 2**7 / positive.max()).log2().floor().exp2().item()
    return 1.0


def process_scales(scales: torch.Tensor, n_padded: int, k_padded: int, sf: float,
                   dtype: torch.dtype, flush: bool = True) -> torch.Tensor:
    """float8_e4m3fn ``[N, K/16]`` -> the S0E5M3 bytes ``[Kp/16, Np]`` Marlin reads (as float8_e4m3fn). ``flush``:
    vLLM's zeroing of ``scale * sf * 2^7 < 2`` (SGLang's ``nvfp4_marlin_process_scales`` keeps them)."""
    n, groups = scales.shape
    s = torch.zeros((k_padded // BLOCK_SIZE, n_padded), dtype=dtype, device=scales.device)
    s[:groups, :n] = scales.T.to(dtype)
    s = _permute_columns(s).to(torch.half)
    if sf > 1.0:
        s = (s.float() * sf).to(torch.half)
    s = s * 2**7
    if flush:
        s[s < 2] = 0
    return ((s.view(torch.int16) << 1).view(torch.uint8).view(s.shape[0], -1, 2)[..., 1]).contiguous().view(
        torch.float8_e4m3fn)


def unprocess_scales(held: torch.Tensor, n: int, k: int, sf: float) -> torch.Tensor:
    """Inverse of :func:`process_scales`: float8_e4m3fn ``[N, K/16]`` (flushed scales as 0)."""
    bits = held.contiguous().view(torch.uint8).to(torch.int16) << 7
    s = bits.view(torch.half).float() / 2**7 / sf
    return _unpermute_columns(s)[: k // BLOCK_SIZE, :n].T.to(torch.float8_e4m3fn).contiguous()


def global_exponent(dtype: torch.dtype) -> float:
    """``nvfp4_marlin_process_global_scale``'s factor ``2^(bias - 7)``: bias 2^7 - 2 (bf16) or 2^4 - 2 (fp16)."""
    target = 8 if dtype == torch.bfloat16 else 5
    return 2.0 ** (2 ** (target - 1) - 2 - 7)


def held_multiplier(multiplier: torch.Tensor, sf: float, dtype: torch.dtype) -> torch.Tensor:
    """``nvfp4_marlin_process_global_scale(multiplier) / sf``; refused where float32 overflows (vLLM would hold inf)."""
    held = (multiplier.to(torch.float32) * global_exponent(dtype)) / sf
    if not torch.isfinite(held).all():
        raise RepackError(f"a multiplier of {float(multiplier.max()):g} overflows Marlin's global scale (times "
                          f"{global_exponent(dtype):g}): vLLM's Marlin would hold inf; use another --target")
    return held


def flushed(scales: torch.Tensor, sf: float) -> torch.Tensor:
    """The block scales as Marlin reads them: those with ``scale * sf * 2^7 < 2`` are 0."""
    return torch.where(scales.float() * sf * 2**7 < 2, torch.zeros((), dtype=scales.dtype), scales)


def read_as(weight: NVFP4Weight, dtype: torch.dtype = torch.bfloat16) -> NVFP4Weight:
    """``weight`` as Marlin reads it (:func:`flushed` scales): what :func:`from_runtime` returns."""
    sf = scale_factor(weight.block_scales, dtype)
    return NVFP4Weight(weight.codes, flushed(weight.block_scales, sf), weight.multiplier, weight.input_scale)


# --- the layer ---
def to_runtime(weight: NVFP4Weight, dtype: torch.dtype = torch.bfloat16) -> RuntimeLayer:
    g = geometry(weight.n, weight.k)
    sf = scale_factor(weight.block_scales, dtype)
    multiplier = weight.multiplier.reshape(1).to(torch.float32)
    return RuntimeLayer(
        weight=repack_codes(weight.codes, g.n_padded, g.k_padded),
        weight_scale=process_scales(weight.block_scales, g.n_padded, g.k_padded, sf, dtype),
        weight_global_scale=held_multiplier(multiplier, sf, dtype).reshape(()),
        weights_padding_cols=g.weights_padding_cols,
        weight_multiplier=multiplier.clone(),
    )


def to_runtime_w4a4(weight: NVFP4Weight, dtype: torch.dtype = torch.bfloat16) -> RuntimeLayer:
    """A W4A4 checkpoint served weight-only by Marlin: the Marlin layer, plus the activation scalars vLLM's W4A4
    method computes before the kernel's load and keeps (``input_global_scale``, its inverse, ``alpha``), unused."""
    if weight.input_scale is None:
        raise RepackError("a W4A4 layer served by Marlin needs its input global scale")
    held = replace(to_runtime(weight, dtype), input_global_scale=w4a4.scalar(weight.input_scale.scale),
                   input_global_scale_inv=w4a4.scalar(weight.input_scale.inverse))
    return replace(held, alpha=held.input_global_scale * w4a4.scalar(weight.multiplier))


def from_runtime_w4a4(layer: RuntimeLayer, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> NVFP4Weight:
    if layer.input_global_scale is None or layer.input_global_scale_inv is None:
        raise RepackError("a W4A4 layer served by Marlin needs input_global_scale and input_global_scale_inv")
    return replace(from_runtime(layer, n, k, dtype), input_scale=InputScale(
        w4a4.scalar(layer.input_global_scale), w4a4.scalar(layer.input_global_scale_inv)))


def recovered_factor(layer: RuntimeLayer, dtype: torch.dtype) -> float:
    """``sf`` from the held global scale and the kept source multiplier (a power of two, exactly)."""
    assert layer.weight_multiplier is not None, "a Marlin layer needs its source multiplier"
    ratio = (layer.weight_multiplier.double() * global_exponent(dtype) / layer.weight_global_scale.double()).item()
    return 2.0 ** round(math.log2(ratio))


def from_runtime(layer: RuntimeLayer, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> NVFP4Weight:
    sf = recovered_factor(layer, dtype)
    return NVFP4Weight(
        codes=unrepack_codes(layer.weight, n, k),
        block_scales=unprocess_scales(layer.weight_scale, n, k, sf),
        multiplier=layer.weight_multiplier.reshape(1).clone(),
    )


def runtime_specs(n: int, k: int) -> dict[str, TensorSpec]:
    n_padded, k_padded = padded_nk(n, k)
    return {
        "weight": TensorSpec(torch.int32, (k_padded // TILE_K, 2 * n_padded)),
        "weight_scale": TensorSpec(torch.float8_e4m3fn, (k_padded // BLOCK_SIZE, n_padded)),
        "weight_global_scale": TensorSpec(torch.float32, ()),
        "weight_multiplier": TensorSpec(torch.float32, (1,)),
    }


def runtime_specs_w4a4(n: int, k: int) -> dict[str, TensorSpec]:
    return {**runtime_specs(n, k), **{name: TensorSpec(torch.float32, ()) for name in W4A4_SCALARS}}


def target(family: Family) -> Target:
    """``family``'s Marlin layout, for its activation dtype; its W4A4 variant (a W4A4 checkpoint, which vLLM serves
    weight-only there) holds the same bytes and the activation scalars vLLM keeps beside them. A family whose W4A4
    layout is another (sm120: FP4 x FP4) gets sm80's ids: the same bytes and scalars. Marlin has
    no GPU backend here: the reference one everywhere; no FlashInfer code runs at its load."""
    dtype = DTYPES[family.dtype]
    weight_only = replace(Target.of(
        family,
        to_runtime=partial(to_runtime, dtype=dtype),
        from_runtime=partial(from_runtime, dtype=dtype),
        runtime_specs=runtime_specs,
        geometry=geometry,
        read_as=partial(read_as, dtype=dtype),
    ), backend="reference", flashinfer_versions=(), kernels=families.MARLIN)
    w4a4_layout = replace(weight_only, layout_id=W4A4_IDS[family.layout_id], scheme="W4A4",
                          to_runtime=partial(to_runtime_w4a4, dtype=dtype),
                          from_runtime=partial(from_runtime_w4a4, dtype=dtype), runtime_specs=runtime_specs_w4a4)
    return replace(weight_only, variants=(w4a4_layout,))


TARGETS = (target(families.SM80), target(families.SM75))
