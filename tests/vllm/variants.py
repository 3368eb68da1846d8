"""Rotated checkpoints the producers cannot make, as edits of a producer fixture's transform_config: output
transforms that vLLM 0.33 holds per partition of a fused module. Shared by tests/test_vllm_conformance.py (the
project's env) and tests/vllm/plugin_checks.py (vLLM's)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from repack.runtime.transforms import sylvester

PRODUCERS = Path(__file__).resolve().parents[1] / "data" / "producers"
OUTPUT_BASE = "ct_quip_vu_had32_nvfp4"  # W4A4; QuIP u: output rotation of block 32 on q/k/v, o and down_proj
OUTPUT_VARIANTS = ("partial-output", "whole-n-output")


def output_variant(root: Path, variant: str) -> Path:
    """``OUTPUT_BASE`` with its ``u`` output rotation changed: ``partial-output`` leaves k_proj out (q and v, fused
    with it, keep theirs: vLLM gives qkv_proj's output transform partitions 0 and 2); ``whole-n-output`` drops its
    block size, so each layer rotates its whole N: one Sylvester matrix per size, 64 (q, o, down) and 32 (k, v),
    stored under the first module of each size as compressed-tensors saves them (vLLM: one per partition size)."""
    root.mkdir(parents=True)
    config = json.loads((PRODUCERS / OUTPUT_BASE / "config.json").read_text())
    tensors = load_file(PRODUCERS / OUTPUT_BASE / "model.safetensors")
    u = config["quantization_config"]["transform_config"]["config_groups"]["u"]
    if variant == "partial-output":
        u["apply"][1]["ignore"].append("re:.*k_proj$")
    else:
        u["head_dim"] = None
        for module, size in (("q_proj", 64), ("k_proj", 32)):
            tensors[f"model.layers.0.self_attn.{module}.u_output.weight"] = sylvester(size)
    (root / "config.json").write_text(json.dumps(config))
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return root
