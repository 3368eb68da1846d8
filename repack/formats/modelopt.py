"""ModelOpt NVFP4 / W4A16_NVFP4 checkpoints (``quant_method: modelopt``).

Per layer: ``P.weight`` U8 [N, K/2], ``P.weight_scale`` F8_E4M3 [N, K/16], ``P.weight_scale_2`` F32
(the dequant multiplier itself). W4A4 checkpoints add ``P.input_scale``, which passes through: the bundle
serves weight-only, as vLLM does with such checkpoints.
"""

from __future__ import annotations

import torch

from ..errors import RepackError
from .checkpoint import Checkpoint, load_json
from .source import NamingScheme, SourceModel, collect_layers

FORMAT = "modelopt"
SUPPORTED_ALGOS = ("NVFP4", "W4A16_NVFP4")
SCHEME = NamingScheme(
    codes="weight",
    block_scales="weight_scale",
    global_scale="weight_scale_2",
    to_multiplier=lambda stored: stored.to(torch.float32),
)


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
