"""Source checkpoints normalized to canonical layers, whatever their producer.

Both NVFP4 producers store the same three tensors per linear layer under different names, and
compressed-tensors stores the reciprocal of ModelOpt's global scale. A :class:`NamingScheme` captures
that difference; layer discovery, header checks and loading are shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import RepackError
from ..nvfp4 import BLOCK_SIZE, InputScale, NVFP4Weight, dequantize
from .checkpoint import Checkpoint
from .transforms import SourceTransforms, load_matrix
from .safetensors_io import TensorEntry, read_tensor


@dataclass(frozen=True)
class NamingScheme:
    """Tensor suffixes of one quantized linear, and how its stored global scale becomes the multiplier."""

    codes: str
    block_scales: str
    global_scale: str
    to_multiplier: Callable[[torch.Tensor], torch.Tensor]
    input_scale: str  # a W4A4 layer's stored activation global scale
    to_input_scale: Callable[[torch.Tensor], InputScale]  # stored float32 [] or [1] -> the pair vLLM computes
    fuse_input_scales: Callable[[list[InputScale]], InputScale]  # the one vLLM keeps for a fused module

    def names(self, prefix: str) -> tuple[str, str, str]:
        return (f"{prefix}.{self.codes}", f"{prefix}.{self.block_scales}", f"{prefix}.{self.global_scale}")


@dataclass(frozen=True)
class QuantizedLayer:
    """A quantized linear found in the source: where its tensors are and its logical shape."""

    prefix: str
    n: int
    k: int
    tensor_names: tuple[str, str, str]


@dataclass
class SourceModel:
    """A validated NVFP4 checkpoint: its format, its quantized layers and its passthrough tensors."""

    checkpoint: Checkpoint
    format: str
    quant_algo: str
    scheme: NamingScheme
    layers: dict[str, QuantizedLayer]
    passthrough: list[str]
    transforms: SourceTransforms = field(default_factory=SourceTransforms)

    @property
    def activation_scheme(self) -> str:
        """``W4A4`` when the producer quantized activations too (ModelOpt ``NVFP4``, compressed-tensors ``NVFP4``),
        else ``W4A16``."""
        return "W4A4" if self.quant_algo == "NVFP4" else "W4A16"

    def input_scale_name(self, prefix: str) -> str:
        return f"{prefix}.{self.scheme.input_scale}"

    def read_input_scale(self, prefix: str) -> InputScale:
        """A W4A4 layer's activation global scale (4 bytes, read at planning time like the weight global scales)."""
        name = self.input_scale_name(prefix)
        entry = self.checkpoint.tensors.get(name)
        if entry is None or entry.dtype != torch.float32 or entry.nbytes != 4:
            found = "is missing" if entry is None else f"is {entry.dtype_name} {list(entry.shape)}"
            raise RepackError(f"{name}: a W4A4 layer's input scale must be one F32, but it {found}; "
                              "pass --weight-only to serve activations in bf16")
        scale = self.scheme.to_input_scale(self.checkpoint.read(name))
        values = (float(scale.scale), float(scale.inverse))
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise RepackError(f"{name}: input scale must be finite and positive, got {values[0]}")
        return scale

    def load_layer(self, layer: QuantizedLayer, read: Callable[[TensorEntry], torch.Tensor] = read_tensor) -> NVFP4Weight:
        """Read one layer's tensors (with ``read``, e.g. one that also hashes) and return its validated canonical form."""
        codes, scales, global_scale = (read(self.checkpoint.entry(name)) for name in layer.tensor_names)
        return NVFP4Weight(
            codes=codes,
            block_scales=scales,
            multiplier=self.scheme.to_multiplier(global_scale.reshape(1)),
        ).validate(layer.prefix)

    def dense_weight(self, prefix: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight of the function layer ``prefix`` computes: dequantized, its online transforms
        folded in (float64 until the cast). A dense model holding these is the reference for this checkpoint:
        the plain dequantized weight is not, where a layer rotates its input or output at run time.

        An input transform ``x -> x @ blockdiag(T)`` before the GEMM folds in as ``W @ blockdiag(T)^T``; an
        output one ``y -> y @ blockdiag(T)`` after it as ``blockdiag(T)^T @ W`` (``T`` normalized, as applied).
        """
        weight = dequantize(self.load_layer(self.layers[prefix]), torch.float64)
        for t in self.transforms.layers.get(prefix, ()):
            matrix = load_matrix(self.checkpoint, t.matrix) / t.matrix.scale
            if t.location == "input":
                weight = (weight.unflatten(1, (-1, t.matrix.size)) @ matrix.T).flatten(1)
            else:
                weight = (matrix.T @ weight.unflatten(0, (-1, t.matrix.size))).flatten(0, 1)
        return weight.to(dtype)


def _layer_from_headers(checkpoint: Checkpoint, scheme: NamingScheme, prefix: str) -> QuantizedLayer:
    """Check a layer's dtypes and shapes from headers alone (no data read)."""
    names = scheme.names(prefix)
    missing = [n for n in names if n not in checkpoint.tensors]
    if missing:
        raise RepackError(f"{prefix}: quantized layer is missing tensor {missing[0]!r}")
    codes, scales, global_scale = (checkpoint.tensors[n] for n in names)
    if codes.dtype != torch.uint8 or len(codes.shape) != 2:
        raise RepackError(f"{names[0]}: packed weight must be 2-D U8, got {codes.dtype_name} {list(codes.shape)}")
    n, k = codes.shape[0], codes.shape[1] * 2
    if n == 0 or k % BLOCK_SIZE or k == 0:
        raise RepackError(f"{names[0]}: K={k} must be a positive multiple of {BLOCK_SIZE} (N={n})")
    if scales.dtype != torch.float8_e4m3fn:
        raise RepackError(f"{names[1]}: block scales must be F8_E4M3, got {scales.dtype_name}")
    if scales.shape != (n, k // BLOCK_SIZE):
        raise RepackError(
            f"{names[1]}: shape {list(scales.shape)} does not match weight {names[0]} "
            f"(expected [{n}, {k // BLOCK_SIZE}])"
        )
    if global_scale.dtype != torch.float32 or global_scale.nbytes != 4:
        raise RepackError(
            f"{names[2]}: global scale must be one F32, got {global_scale.dtype_name} {list(global_scale.shape)}"
        )
    return QuantizedLayer(prefix=prefix, n=n, k=k, tensor_names=names)


def collect_layers(
    checkpoint: Checkpoint, scheme: NamingScheme, is_quantized: Callable[[str], bool]
) -> tuple[dict[str, QuantizedLayer], list[str]]:
    """Quantized layers (prefixes whose codes tensor ``is_quantized``) and every other tensor name."""
    suffix = "." + scheme.codes
    prefixes = sorted(
        name[: -len(suffix)] for name in checkpoint.tensors if name.endswith(suffix) and is_quantized(name)
    )
    global_suffix = "." + scheme.global_scale
    known = set(prefixes)
    for name in checkpoint.tensors:
        if name.endswith(global_suffix) and name[: -len(global_suffix)] not in known:
            codes = checkpoint.tensors.get(name[: -len(global_suffix)] + suffix)
            if codes is not None:  # there, but not packed codes (an F32 ``weight`` beside ModelOpt's scales)
                raise RepackError(f"{codes.name}: packed NVFP4 weight must be U8 (two E2M1 codes a byte), got "
                                  f"{codes.dtype_name} {list(codes.shape)}, though the layer has NVFP4 scales ({name})")
            raise RepackError(f"{name}: global scale without a packed NVFP4 weight {name[: -len(global_suffix)]}{suffix}")
    layers = {p: _layer_from_headers(checkpoint, scheme, p) for p in prefixes}
    consumed = {name for layer in layers.values() for name in layer.tensor_names}
    passthrough = sorted(name for name in checkpoint.tensors if name not in consumed)
    if not layers:
        raise RepackError(f"{checkpoint.root}: no NVFP4-quantized linear layers found")
    return layers, passthrough
