"""vLLM 0.33.0 itself as the oracle: every fused bundle layer, per tensor-parallel rank, byte-identical to
what vLLM's own DefaultModelLoader + process_weights_after_loading leaves on its layer, and vLLM's
refusals matched by ours: W4A16 bundles (``--weight-only`` for W4A4 checkpoints) against the cute-dsl W4A16
kernel; W4A4 bundles (the default for W4A4 checkpoints) against the kernel vLLM's auto picks on sm100 / sm120.

vLLM runs in its own virtualenv (tests/vllm/make_env.sh; it pins FlashInfer 0.7.2.post1, the project's
env has the newest) through tests/vllm/harness.py, in one process per TP size (two on gloo for TP = 2),
loading every checkpoint in turn. In CI a missing vLLM env fails these tests instead of skipping them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from repack.bundle.reader import open_bundle
from repack.convert import convert
from repack.errors import RepackError
from repack.sample.synthetic import write_llama
from repack.verify import verify_output

from .conftest import IN_CI, PRODUCERS

HERE = Path(__file__).parent / "vllm"
VENV = Path(os.environ.get("NVFP4_REPACK_VLLM_VENV", Path(__file__).parent.parent / ".venv-vllm"))
ARCHS = {"sm100": "sm100", "sm120": "sm120"}  # our target -> the FlashInfer layout the harness emulates
PRODUCER_FIXTURES = ["modelopt_w4a16_nvfp4", "modelopt_nvfp4", "ct_nvfp4a16", "ct_nvfp4"]
# (hidden, heads, kv_heads, intermediate): "odd" has K, N not multiples of 64, N = 16 (one kv head of 16),
# 5 heads (TP = 2 must be refused); "tp" splits over 2 ranks with the single kv head replicated.
SYNTHETIC = {"odd": (80, 5, 1, 48), "tp": (96, 6, 1, 96)}
SYNTHETIC_FORMATS = {"modelopt": False, "compressed-tensors": True}  # format -> W4A4 (one of each)
W4A4_FIXTURES = ["modelopt_nvfp4", "ct_nvfp4"]  # and the synthetic "<shape>-<format>-w4a4", W4A4 in both formats


def _vllm_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        message = f"vLLM oracle env missing at {VENV}: run tests/vllm/make_env.sh"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    seed = int(torch.randint(0, 2**31, ()))
    print(f"synthetic checkpoint seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    root = tmp_path_factory.mktemp("vllm-ckpts")
    out = {name: PRODUCERS / name for name in PRODUCER_FIXTURES}
    for shape, (hidden, heads, kv, inter) in SYNTHETIC.items():
        for fmt, w4a4 in SYNTHETIC_FORMATS.items():
            name = f"{shape}-{fmt}"
            out[name] = write_llama(root / name, fmt, hidden=hidden, heads=heads, kv_heads=kv, intermediate=inter,
                                    generator=gen, layers=2, w4a4=w4a4)
            out[f"{name}-w4a4"] = write_llama(root / f"{name}-w4a4", fmt, hidden=hidden, heads=heads, kv_heads=kv,
                                              intermediate=inter, generator=gen, layers=2, w4a4=True)
    return out


def harness_arch(arch: str) -> str:
    """Our target (``-w4a4``: the W4A4 jobs) -> the harness's arch."""
    base = arch.removesuffix("-w4a4")
    return ARCHS[base] + arch[len(base):]


def _jobs(names: list[str]) -> list[tuple[str, str]]:
    return [(name, arch) for name in names for arch in ARCHS]


TP1 = _jobs(PRODUCER_FIXTURES + [f"odd-{f}" for f in SYNTHETIC_FORMATS])
TP2 = _jobs([f"tp-{f}" for f in SYNTHETIC_FORMATS]) + [
    (name, "sm100") for name in PRODUCER_FIXTURES[::2] + [f"odd-{f}" for f in SYNTHETIC_FORMATS]]
W4A4_TP1 = [(name, f"{arch}-w4a4") for name in W4A4_FIXTURES + [f"odd-{f}-w4a4" for f in SYNTHETIC_FORMATS]
            for arch in ARCHS]
W4A4_TP2 = [(name, f"{arch}-w4a4")
            for name in W4A4_FIXTURES + [f"{s}-{f}-w4a4" for s in SYNTHETIC for f in SYNTHETIC_FORMATS] for arch in ARCHS]


@pytest.fixture(scope="module")
def oracle(checkpoints, tmp_path_factory) -> dict[int, Path]:
    """vLLM's load-time result for every job, per TP size: ``{tp: folder}``."""
    python = _vllm_python()
    subprocess.run(["bash", str(HERE / "make_env.sh")], check=True, env={**os.environ, "NVFP4_REPACK_VLLM_VENV": str(VENV)})
    out = {}
    for tp, jobs in ((1, TP1 + W4A4_TP1), (2, TP2 + W4A4_TP2)):
        folder = tmp_path_factory.mktemp(f"vllm-tp{tp}")
        args = [arg for name, arch in jobs
                for arg in ("--job", f"{name}-{arch}={checkpoints[name]}:{harness_arch(arch)}")]
        subprocess.run([str(python), str(HERE / "harness.py"), "--tp", str(tp), "--out", str(folder), *args],
                       check=True, timeout=1500, stdout=subprocess.DEVNULL)
        out[tp] = folder
    return out


def _assert_rank_identical(bundle_dir: Path, dumped: Path, rank: int) -> int:
    bundle = open_bundle(bundle_dir)
    theirs = load_file(dumped / f"rank-{rank}.safetensors")
    meta = json.loads((dumped / f"rank-{rank}.json").read_text())
    assert set(meta) == set(bundle.manifest.layers)
    for prefix, info in meta.items():
        record = bundle.manifest.layers[prefix]
        assert record.weights_padding_cols == info["weights_padding_cols"], prefix
        for part in ("weight", "weight_global_scale"):
            ours, ref = bundle.read(f"{prefix}.{part}"), theirs[f"{prefix}.{part}"]
            assert (ours.dtype, ours.shape) == (ref.dtype, ref.shape), (prefix, part)
            assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)), (prefix, part)
        scale = bundle.read(f"{prefix}.weight_scale")
        assert str(scale.dtype).replace("torch.", "") == info["weight_scale_dtype"], prefix
        shape, stride, offset = info["weight_scale_view"]
        if len(shape) == 2:  # sm120: vLLM's tensor is a plain contiguous one
            assert list(scale.shape) == shape == info["weight_scale_shape"], prefix
        else:  # sm100: vLLM keeps a 6-D view over the 2-D swizzled buffer; compare the buffers, rebuild the view
            assert scale.numel() == math.prod(info["weight_scale_shape"]), prefix
            scale.as_strided(shape, stride, offset)  # fits our buffer exactly as it fits vLLM's
        assert torch.equal(scale.reshape(-1).view(torch.uint8), theirs[f"{prefix}.weight_scale"].reshape(-1)), prefix
    return len(meta)


@pytest.mark.parametrize("name,arch", TP1, ids=[f"{n}-{a}" for n, a in TP1])
def test_fused_bundle_is_byte_identical_to_vllm(name, arch, checkpoints, oracle, tmp_path):
    dumped = oracle[1] / f"{name}-{arch}"
    assert not (dumped / "refused.txt").exists(), (dumped / "refused.txt").read_text()
    out = tmp_path / "bundle"
    convert(checkpoints[name], arch, out, fuse=True, weight_only=True)  # W4A4 checkpoints too: the W4A16 kernel
    assert _assert_rank_identical(out, dumped, 0) == 8
    assert verify_output(out).passed


@pytest.mark.parametrize("name,arch", TP2, ids=[f"{n}-{a}" for n, a in TP2])
def test_tp2_ranks_are_byte_identical_to_vllm_or_both_refuse(name, arch, checkpoints, oracle, tmp_path):
    dumped = oracle[2] / f"{name}-{arch}"
    out = tmp_path / "ranks"
    refused = (dumped / "refused.txt").exists()
    if name.startswith("ct_") or refused:
        # ct with a per-rank K of 88 (not a multiple of 16): vLLM 0.33 builds shifted block scales; we refuse.
        with pytest.raises(RepackError, match="--tp 2"):
            convert(checkpoints[name], arch, out, tp=2, weight_only=True)
        assert refused or name.startswith("ct_"), "we refuse what vLLM loads"
        return
    convert(checkpoints[name], arch, out, tp=2, weight_only=True)
    for rank in range(2):
        assert _assert_rank_identical(out / f"rank-{rank}", dumped, rank) == 8
    assert verify_output(out).passed


def _assert_w4a4_rank_identical(bundle_dir: Path, dumped: Path, rank: int) -> int:
    """Every tensor vLLM holds on every fused NVFP4 layer, by name, class-free dtype, shape, strides, offset and
    the bytes of its whole storage, is the bundle's tensor of that name; the kernel class is the manifest's
    first (auto's); the padding vLLM derives (``weight.shape[1] - K/2``) is the manifest's."""
    bundle = open_bundle(bundle_dir)
    theirs = load_file(dumped / f"rank-{rank}.safetensors")
    meta = json.loads((dumped / f"rank-{rank}.json").read_text())
    assert set(meta) == set(bundle.manifest.layers)
    assert bundle.manifest.scheme == "W4A4"
    for prefix, info in meta.items():
        record = bundle.manifest.layers[prefix]
        assert info["kernel"] == bundle.manifest.kernels[0], prefix
        assert set(info["tensors"]) == set(record.tensors), prefix
        assert (info["input_size_per_partition"], info["output_size_per_partition"]) == (record.k, record.n), prefix
        assert info["tensors"]["weight"]["shape"][1] - record.k // 2 == record.weights_padding_cols, prefix
        for part, view in info["tensors"].items():
            ours = bundle.read(f"{prefix}.{part}")
            got = (str(ours.dtype).replace("torch.", ""), list(ours.shape), list(ours.stride()), ours.storage_offset())
            assert got == (view["dtype"], view["shape"], view["stride"], view["offset"]), (prefix, part)
            assert torch.equal(ours.reshape(-1).view(torch.uint8), theirs[f"{prefix}.{part}"]), (prefix, part)
    return len(meta)


@pytest.mark.parametrize("name,arch", W4A4_TP1, ids=[f"{n}-{a}" for n, a in W4A4_TP1])
def test_w4a4_bundle_is_byte_identical_to_vllm_auto(name, arch, checkpoints, oracle, tmp_path):
    dumped = oracle[1] / f"{name}-{arch}"
    assert not (dumped / "refused.txt").exists(), (dumped / "refused.txt").read_text()
    out = tmp_path / "bundle"
    convert(checkpoints[name], arch.removesuffix("-w4a4"), out, fuse=True)  # the default for a W4A4 checkpoint
    assert _assert_w4a4_rank_identical(out, dumped, 0) == 8
    assert verify_output(out).passed


@pytest.mark.parametrize("name,arch", W4A4_TP2, ids=[f"{n}-{a}" for n, a in W4A4_TP2])
def test_w4a4_tp2_ranks_are_byte_identical_to_vllm_or_both_refuse(name, arch, checkpoints, oracle, tmp_path):
    dumped = oracle[2] / f"{name}-{arch}"
    out = tmp_path / "ranks"
    if name.startswith("ct_") or (dumped / "refused.txt").exists():  # per-rank K of 88, as for W4A16 above
        with pytest.raises(RepackError, match="--tp 2"):
            convert(checkpoints[name], arch.removesuffix("-w4a4"), out, tp=2)
        assert (dumped / "refused.txt").exists() or name.startswith("ct_"), "we refuse what vLLM loads"
        return
    convert(checkpoints[name], arch.removesuffix("-w4a4"), out, tp=2)
    for rank in range(2):
        assert _assert_w4a4_rank_identical(out / f"rank-{rank}", dumped, rank) == 8
    assert verify_output(out).passed
