"""Source format readers: detect the producer, validate, and yield canonical layers."""

from __future__ import annotations

from pathlib import Path

from ..errors import RepackError
from . import compressed_tensors, modelopt
from .checkpoint import Checkpoint, open_checkpoint
from .source import QuantizedLayer, SourceModel


def read_source(model: str | Path, revision: str | None = None) -> SourceModel:
    """Open ``model`` (a folder, or a Hub repo id at ``revision``) as a validated :class:`SourceModel`
    (headers only, no weights read)."""
    checkpoint = open_checkpoint(model, revision)
    qc = compressed_tensors.quantization_config(checkpoint)  # config.json's own quant_method wins over a stray
    if qc is not None:  # hf_quant_config.json
        return compressed_tensors.read(checkpoint, qc)
    algo = modelopt.quant_algo(checkpoint)
    if algo is not None:
        return modelopt.read(checkpoint, algo)
    qc = checkpoint.config.get("quantization_config")
    method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else "none"
    raise RepackError(
        f"{checkpoint.root}: not an NVFP4 checkpoint (quantization method: {method}); "
        "expected ModelOpt NVFP4 or compressed-tensors nvfp4-pack-quantized"
    )


__all__ = ["Checkpoint", "QuantizedLayer", "SourceModel", "open_checkpoint", "read_source"]
