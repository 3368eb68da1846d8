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
    layer_bytes = bench_convert.make_layers_model(model, gigabytes=0.25, n=1024, k=14336)  # ~30 layers of 8 MB
    checkpoint_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    result = bench_convert.measure(model, target, tmp_path / "out")
    growth = (result["peak_kb"] - result["baseline_kb"]) * 1024
    assert checkpoint_bytes > 25 * layer_bytes
    # In flight: two layers transforming at once (each its source, output and scratch), the transform and write
    # queues (16 MB each beyond one tensor), the output digests: measured 7.5-10.5 layers' worth, 6.6-8.9 before
    # layers transformed in parallel; 12 of the checkpoint's 30.
    assert growth < 12 * layer_bytes, f"peak RSS grew {growth / 1e6:.0f} MB for {checkpoint_bytes / 1e6:.0f} MB"


def test_verify_peak_rss_is_a_few_layers_even_for_long_rows(tmp_path, monkeypatch):
    """verify (sm90: the heaviest inverse) of 4 layers of K = 57344 grows by a few of them: the float64 reference
    and the CPU backend dequantize a fixed number of weights at a time, not a fixed number of rows (512 rows of
    this K in float64 were 235 MB, and verify grew by 20 layers' worth)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # live data (see above)
    model = tmp_path / "model"
    layer_bytes = bench_convert.make_layers_model(model, gigabytes=4 * 33e-3, n=1024, k=57344)
    bench_convert.measure(model, "sm90", tmp_path / "out")
    result = bench_convert.measure(model, "verify:sm90", tmp_path / "out")
    growth = (result["peak_kb"] - result["baseline_kb"]) * 1024
    assert growth < 12 * layer_bytes, f"peak RSS grew {growth / 1e6:.0f} MB, {growth / layer_bytes:.1f} layers"


def test_verify_of_an_moe_bundle_grows_by_less_than_one_fused_moe_layer(tmp_path, monkeypatch):
    """Regression (issue 39): verify mapped each FusedMoE layer's bundle tensors whole (3.3 GB for the 4.2 GB
    DeepSeek-R1-shaped benchmark; here it grew by 624 MB, 1.4 layers' worth); it now hashes them a chunk at a time
    and compares a few experts at a time, a fixed amount whatever the layer's expert count."""
    import torch

    from repack.cli import main
    from repack.sample.synthetic import write_qwen_moe

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # live data (see above)
    model = write_qwen_moe(tmp_path / "model", "modelopt", hidden=2048, experts=128, intermediate=1024, heads=4,
                           head_dim=64, generator=torch.Generator().manual_seed(0))
    assert main(["convert", str(model), "-t", "sm100", "--fuse", "--no-fsync", "-o", str(tmp_path / "out")]) == 0
    layer_bytes = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))  # about the one MoE layer
    result = bench_convert.measure(model, "verify:sm100", tmp_path / "out")
    growth = (result["peak_kb"] - result["baseline_kb"]) * 1024
    assert growth < 0.6 * layer_bytes, f"peak RSS grew {growth / 1e6:.0f} MB for a {layer_bytes / 1e6:.0f} MB layer"
