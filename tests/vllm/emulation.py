"""vLLM's (0.33.0, 0.34.0) NVFP4 activation emulation as an oracle, on CPU (run in the vLLM virtualenv, imports nothing
from the project).

    python emulation.py IN.safetensors OUT.safetensors

For every case ``C`` in IN (``C.x`` bf16/fp16 [M, K], ``C.gs`` float32 [1], ``C.codes`` uint8 [M, K/2] and
``C.scales`` float8_e4m3fn [M, K/16] from the project) writes ``C.fp4`` and ``C.scale``, the E2M1 values and
block scales of ``ref_nvfp4_quant(x, gs, 16)`` (float32), and ``C.decoded``, ``dequantize_to_dtype`` of the
project's codes and scales with a global scale of 1 (linear scale layout): vLLM's reading of our bytes.
"""

from __future__ import annotations

import os
import sys

os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # CpuPlatform, fixed before the first vllm import
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
import vllm  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (  # noqa: E402
    dequantize_to_dtype,
    ref_nvfp4_quant,
)

assert vllm.__version__ in ("0.33.0", "0.34.0"), vllm.__version__  # one oracle venv per version

cases = load_file(sys.argv[1])
out = {}
for name in sorted({key.rsplit(".", 1)[0] for key in cases}):
    x, gs = cases[f"{name}.x"], cases[f"{name}.gs"]
    fp4, scale = ref_nvfp4_quant(x, gs, 16)
    out[f"{name}.fp4"], out[f"{name}.scale"] = fp4.contiguous(), scale.contiguous()
    out[f"{name}.decoded"] = dequantize_to_dtype(
        cases[f"{name}.codes"], cases[f"{name}.scales"], torch.ones(1), torch.float32, 16, swizzle=False
    ).contiguous()
save_file(out, sys.argv[2])
