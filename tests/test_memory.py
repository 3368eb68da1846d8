"""Converting never holds the whole model: peak RSS grows by a few layers, not by the checkpoint's size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from repack.targets import TARGETS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_convert.py"
spec = importlib.util.spec_from_file_location("bench_convert", SCRIPT)
bench_convert = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_convert)


@pytest.mark.parametrize("target", [t.name for t in TARGETS])
def test_peak_rss_is_bounded_by_a_few_layers(tmp_path, target, monkeypatch):
    # Live data only: glibc's malloc otherwise keeps freed blocks (up to its 32 MB mmap threshold) for reuse, a
    # cache bounded by the thread count and block size, not by the model, which would blur what this checks.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    model = tmp_path / "model"
    layer_bytes = bench_convert.make_model(model, gigabytes=0.25, n=1024, k=14336)  # ~30 layers of 8 MB
    checkpoint_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    result = bench_convert.measure(model, target, tmp_path / "out")
    growth = (result["peak_kb"] - result["baseline_kb"]) * 1024
    assert checkpoint_bytes > 25 * layer_bytes
    assert growth < 10 * layer_bytes, f"peak RSS grew {growth / 1e6:.0f} MB for {checkpoint_bytes / 1e6:.0f} MB"


def test_verify_peak_rss_does_not_grow_with_the_model(tmp_path, monkeypatch):
    """verify of 16 and of 32 layers (sm90, whose inverse is the heaviest) peaks alike: layers are checked and
    released a bounded few at a time, numerics dequantize a block at a time."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # live data (see above)
    growth = []
    for layers in (16, 32):
        model = tmp_path / f"model-{layers}"
        layer_bytes = bench_convert.make_model(model, gigabytes=layers * 8.3e-3, n=1024, k=14336)
        bench_convert.measure(model, "sm90", tmp_path / f"out-{layers}")
        result = bench_convert.measure(model, "verify:sm90", tmp_path / f"out-{layers}")
        growth.append((result["peak_kb"] - result["baseline_kb"]) * 1024)
    assert growth[1] < growth[0] + 2 * layer_bytes, f"peak RSS grew {growth[0] / 1e6:.0f} -> {growth[1] / 1e6:.0f} MB"
    assert growth[1] < 16 * layer_bytes, f"verify of 32 layers grew {growth[1] / 1e6:.0f} MB"
