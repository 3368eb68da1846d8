"""ModelOpt NVFP4 / W4A16_NVFP4 checkpoints (``quant_method: modelopt``).

Per layer: ``P.weight`` U8 [N, K/2], ``P.weight_scale`` F8_E4M3 [N, K/16], ``P.weight_scale_2`` F32
(the dequant multiplier itself). W4A4 checkpoints add ``P.input_scale``, the activations' dequant multiplier:
vLLM keeps it as ``input_global_scale`` (the largest of a fused module's) and computes ``1 / it`` in float32.
"""

from __future__ import annotations

import torch

from ..errors import RepackError
from ..nvfp4 import InputScale
from .checkpoint import Checkpoint, load_json
from .source import NamingScheme, SourceModel, collect_layers

FORMAT = "modelopt"
SUPPORTED_ALGOS = ("NVFP4", "W4A16_NVFP4")
SCHEME = NamingScheme(
    codes="weight",
    block_scales="weight_scale",
    global_scale="weight_scale_2",
    to_multiplier=lambda stored: stored.to(torch.float32),
    input_scale="input_scale",
    to_input_scale=lambda stored: _input_scale(stored.reshape(()).to(torch.float32)),
    fuse_input_scales=lambda scales: _input_scale(max((s.scale for s in scales), key=float)),
)


def _input_scale(scale: torch.Tensor) -> InputScale:
    """KNvfp4Dynamic.process: ``input_global_scale = max(input_scale)``, its inverse ``1 / that`` in float32."""
    return InputScale(scale.clone(), (1.0 / scale).to(torch.float32))


def quant_algo(checkpoint: Checkpoint) -> str | None:
    """The ModelOpt algo named by hf_quant_config.json or config.json, or None if not ModelOpt."""
    qc = checkpoint.config.get("quantization_config")
    if (checkpoint.root / "hf_quant_config.json").exists():
        hf = load_json(checkpoint.contained("hf_quant_config.json"))
        quant = hf.get("quantization")
        if not isinstance(quant, dict):
            raise RepackError("hf_quant_config.json: missing 'quantization' object")
        return str(quant.get("quant_algo"))
    if isinstance(qc, dict) and qc.get("quant_method") == "modelopt":
        return str(qc.get("quant_algo"))
    return None


def read(checkpoint: Checkpoint, algo: str) -> SourceModel:
    if algo not in SUPPORTED_ALGOS:
        raise RepackError(f"ModelOpt quant_algo {algo!r} is not supported (supported: {', '.join(SUPPORTED_ALGOS)})")
    layers, passthrough = collect_layers(
        checkpoint, SCHEME, lambda name: checkpoint.tensors[name].dtype == torch.uint8
    )
    return SourceModel(checkpoint, FORMAT, algo, SCHEME, layers, passthrough)
