"""compressed-tensors ``nvfp4-pack-quantized`` checkpoints (llm-compressor NVFP4A16 and NVFP4).

Per layer: ``P.weight_packed`` U8 [N, K/2], ``P.weight_scale`` F8_E4M3 [N, K/16],
``P.weight_global_scale`` F32 [1], the RECIPROCAL of the dequant multiplier (vLLM computes
``1 / weight_global_scale`` in float32; so do we). NVFP4 (W4A4) adds ``P.input_global_scale``, the RECIPROCAL of
the activations' dequant multiplier: vLLM keeps the largest of a fused module's as ``input_global_scale_inv`` and
computes ``input_global_scale = 1 / it`` in float32.
Online transforms (``transform_config``) are resolved per layer by :mod:`.transforms`; their matrices leave the
passthrough list (the bundle stores them normalized, once each).
"""

from __future__ import annotations

import torch

from ..errors import RepackError
from ..nvfp4 import InputScale
from .checkpoint import Checkpoint
from .transforms import read_transforms
from .source import NamingScheme, SourceModel, collect_layers

FORMAT = "compressed-tensors"
PACK_FORMAT = "nvfp4-pack-quantized"
SCHEME = NamingScheme(
    codes="weight_packed",
    block_scales="weight_scale",
    global_scale="weight_global_scale",
    to_multiplier=lambda stored: torch.reciprocal(stored.to(torch.float32)),
    input_scale="input_global_scale",
    to_input_scale=lambda stored: _input_scale(stored.reshape(()).to(torch.float32)),
    fuse_input_scales=lambda scales: _input_scale(max((s.inverse for s in scales), key=float)),
)


def _input_scale(inverse: torch.Tensor) -> InputScale:
    """CompressedTensorsW4A4Fp4: ``input_global_scale_inv = max(stored)``, ``input_global_scale = 1 / that``."""
    return InputScale((1.0 / inverse).to(torch.float32), inverse.clone())


def quantization_config(checkpoint: Checkpoint) -> dict | None:
    qc = checkpoint.config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        return qc
    return None


def _groups(qc: dict) -> list[dict]:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise RepackError("config.json: compressed-tensors quantization_config has no config_groups")
    if not all(isinstance(g, dict) for g in groups.values()):
        raise RepackError("config.json: config_groups entries must be objects")
    return list(groups.values())


def preset(qc: dict) -> str:
    """``NVFP4A16`` (weights only) or ``NVFP4`` (also activations), after checking the weight scheme."""
    groups = _groups(qc)
    formats = [g.get("format", qc.get("format")) for g in groups]  # any JSON value: compare, never hash
    if any(f != PACK_FORMAT for f in formats):
        shown = sorted({str(f)[:80] for f in formats})
        raise RepackError(f"config.json: compressed-tensors format {shown} is not {PACK_FORMAT!r}")
    for group in groups:
        weights = group.get("weights") or {}
        if not isinstance(weights, dict) or (
            (weights.get("num_bits"), weights.get("type"), weights.get("group_size")) != (4, "float", 16)
        ):
            raise RepackError(
                f"config.json: weight scheme {str(weights)[:200]} is not NVFP4 (4-bit float, group_size 16)"
            )
    return "NVFP4" if any(g.get("input_activations") for g in groups) else "NVFP4A16"


def read(checkpoint: Checkpoint, qc: dict) -> SourceModel:
    algo = preset(qc)
    layers, passthrough = collect_layers(checkpoint, SCHEME, lambda name: True)
    transforms = read_transforms(checkpoint, qc, layers)
    passthrough = [name for name in passthrough if name not in transforms.tensors]
    return SourceModel(checkpoint, FORMAT, algo, SCHEME, layers, passthrough, transforms)
