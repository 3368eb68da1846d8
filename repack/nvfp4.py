"""The canonical NVFP4 linear weight every reader yields and every target consumes.

Codes are E2M1 nibbles packed two per byte (element ``2i`` in the low nibble), one float8_e4m3fn
block scale per 16 elements along K, and one float32 dequantization multiplier
(``w = e2m1(code) * block_scale * multiplier``). ModelOpt stores the multiplier as ``weight_scale_2``;
compressed-tensors stores its reciprocal, which the reader inverts in float32 as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import RepackError

BLOCK_SIZE = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class InputScale:
    """A W4A4 layer's activation global scale, the pair vLLM holds: ``scale`` (``input_global_scale``, the
    activations' dequant multiplier) and ``inverse`` (``input_global_scale_inv``, what its quantizer multiplies by),
    float32 ``[]`` each. ModelOpt stores ``scale`` (``input_scale``) and vLLM computes ``inverse = 1 / scale``;
    compressed-tensors stores ``inverse`` (``input_global_scale``) and vLLM computes ``scale``: in float32 the
    round trip is not the identity, so both are kept as vLLM computes them."""

    scale: torch.Tensor
    inverse: torch.Tensor


@dataclass(frozen=True)
class NVFP4Weight:
    """One quantized linear layer in canonical form.

    Attributes:
        codes (`torch.Tensor`): uint8 ``[N, K/2]``.
        block_scales (`torch.Tensor`): float8_e4m3fn ``[N, K/16]``, finite and non-negative.
        multiplier (`torch.Tensor`): float32 ``[1]``, finite and positive.
        input_scale (`InputScale`, *optional*): the activations' global scale of a W4A4 layer.
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    multiplier: torch.Tensor
    input_scale: InputScale | None = None

    @property
    def n(self) -> int:
        return int(self.codes.shape[0])

    @property
    def k(self) -> int:
        return int(self.codes.shape[1]) * 2

    def validate(self, name: str) -> "NVFP4Weight":
        """Check dtypes, shapes and values; raise RepackError naming ``name`` on the first problem."""
        codes, scales, mult = self.codes, self.block_scales, self.multiplier
        if codes.dtype != torch.uint8 or codes.dim() != 2:
            raise RepackError(f"{name}: packed codes must be 2-D uint8, got {codes.dtype} {list(codes.shape)}")
        if scales.dtype != torch.float8_e4m3fn or scales.dim() != 2:
            raise RepackError(
                f"{name}: block scales must be 2-D float8_e4m3fn, got {scales.dtype} {list(scales.shape)}"
            )
        n, k = self.n, self.k
        if n == 0 or k == 0 or k % BLOCK_SIZE:
            raise RepackError(f"{name}: K={k} (N={n}) must be a positive multiple of {BLOCK_SIZE}")
        if tuple(scales.shape) != (n, k // BLOCK_SIZE):
            raise RepackError(
                f"{name}: block scales {list(scales.shape)} do not match weight [N={n}, K={k}] "
                f"(expected [{n}, {k // BLOCK_SIZE}])"
            )
        scale_bits = scales.view(torch.uint8)
        # One pass: every finite non-negative e4m3 byte is below 0x7F (NaN); only then look for which it is.
        if scale_bits.numel() and int(scale_bits.max()) >= 0x7F:
            if bool(((scale_bits & 0x7F) == 0x7F).any()):
                raise RepackError(f"{name}: block scales contain NaN")
            raise RepackError(f"{name}: block scales contain negative values")
        if mult.dtype != torch.float32 or mult.numel() != 1:
            raise RepackError(f"{name}: global scale must be one float32, got {mult.dtype} {list(mult.shape)}")
        value = float(mult.reshape(()))
        if not (torch.isfinite(mult).all() and value > 0.0):
            raise RepackError(f"{name}: global scale must be finite and positive, got {value}")
        if self.input_scale is not None:
            for value in (self.input_scale.scale, self.input_scale.inverse):
                if value.dtype != torch.float32 or value.numel() != 1 or not float(value.reshape(())) > 0.0 or (
                        not torch.isfinite(value).all()):
                    raise RepackError(f"{name}: input global scale must be one finite positive float32, "
                                      f"got {value.dtype} {value.reshape(-1)[:2].tolist()}")
        return self


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> uint8 nibbles ``[..., K]`` (low nibble first)."""
    return torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)


def pack_codes(nibbles: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_codes`."""
    pairs = nibbles.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def e2m1_to_float(nibbles: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode E2M1 nibbles to ``dtype`` by table lookup."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=nibbles.device)
    return table[nibbles.long()]


def dequantize(weight: NVFP4Weight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[N, K]`` weights in ``dtype``: ``e2m1(code) * block_scale * multiplier``.

    Each packed byte (two codes) is decoded by one lookup in a 256-entry table of pairs with int32 indices,
    and the scales are applied in place per 16-element block: memory is the output plus a fraction of it,
    where decoding nibble by nibble with int64 indices and expanded scales took several times the output."""
    n, k = weight.codes.shape[0], weight.codes.shape[1] * 2
    e2m1 = torch.tensor(E2M1_VALUES, dtype=dtype, device=weight.codes.device)
    pairs = torch.stack((e2m1.repeat(16), e2m1.repeat_interleave(16)), dim=-1)  # byte -> (low nibble, high nibble)
    values = pairs.index_select(0, weight.codes.reshape(-1).to(torch.int32)).view(n, k // BLOCK_SIZE, BLOCK_SIZE)
    values.mul_(weight.block_scales.to(dtype).unsqueeze(-1))
    values.mul_(weight.multiplier.to(dtype).reshape(()))
    return values.view(n, k)


def dequantize_activations(codes: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, K]``: ``e2m1(code) * block_scale / global_scale`` of quantized activations, exactly what an
    FP4 x FP4 GEMM with alpha multiplies them as (``global_scale``: the quantizer's, ``input_global_scale_inv``)."""
    ones = torch.ones(1, dtype=torch.float32, device=codes.device)
    return dequantize(NVFP4Weight(codes, block_scales, ones)) / global_scale.to(torch.float64).reshape(())


# --- STUB of the activation quantization the `actq` branch writes here: delete at the merge, actq's wins. ---
def quantize_activations(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 activations as vLLM's ``ref_nvfp4_quant``: uint8 codes ``[M, K/2]``, e4m3 scales ``[M, K/16]``."""
    m, k = x.shape
    gs = global_scale.to(torch.float32).reshape(())
    blocks = x.to(torch.float32).reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    scale = (gs * (blocks.abs().amax(-1, keepdim=True) * (1 / 6))).clamp(max=448).to(torch.float8_e4m3fn)
    s32 = scale.to(torch.float32)
    out_scale = torch.where(s32 == 0, 0.0, 1 / (s32 * (1 / gs)))
    a = (blocks * out_scale).clamp(-6, 6).reshape(m, k)
    mag = a.abs()
    index = ((mag > 0.25).int() + (mag >= 0.75).int() + (mag > 1.25).int() + (mag >= 1.75).int() + (mag > 2.5).int()
             + (mag >= 3.5).int() + (mag > 5.0).int())
    nibbles = torch.where((a < 0) & (index > 0), index + 8, index)
    return pack_codes(nibbles), scale.squeeze(-1)


def fake_quantize_activations(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_activations(x, global_scale)
    m, k = x.shape
    values = e2m1_to_float(unpack_codes(codes), torch.float64).view(m, k // BLOCK_SIZE, BLOCK_SIZE)
    return (values * scales.to(torch.float64).unsqueeze(-1) / global_scale.to(torch.float64).reshape(())).view(m, k)


def w4a4_reference(x: torch.Tensor, weight_f64: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    return fake_quantize_activations(x, input_global_scale) @ weight_f64.t()
# --- end of STUB ---
