"""The built-in sample checkpoint (a tiny NVFP4 Llama, ~100 KB), so the tool runs with no download."""

from pathlib import Path

SAMPLE_DIR = Path(__file__).parent / "tiny-llama-nvfp4"
