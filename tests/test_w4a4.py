"""W4A4 bundles: the layout vLLM 0.33's FP4 x FP4 kernels hold, chosen by default for W4A4 checkpoints.

Byte conformance with vLLM's own load is in test_vllm_conformance.py (the vLLM env); here, on CPU in the project's
env: the layout's exact inverse and index-formula decoder, the layout choice (vLLM's auto; --weight-only keeps the
bundles made before W4A4 layouts existed, byte for byte), the fused modules' input scale rule read from the source
files, and W4A4 numerics (the reference backend against the float64 fake-quant reference; a backend that skips the
activation quantization fails verify).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from repack.bundle.reader import open_bundle
from repack.convert import convert
from repack.errors import RepackError
from repack.nvfp4 import InputScale, NVFP4Weight, dequantize, w4a4_reference
from repack.runtime.backends import reference
from repack.runtime import load_bundle
from repack.runtime.layer import PackedLinear
from repack.runtime.formulas import decode
from repack.sample.synthetic import random_nvfp4, write_llama
from repack.targets import resolve_target
from repack.targets import w4a4
from repack.verify import verify_bundle, verify_output, w4a4_products

from .conftest import ODD_SHAPES, PRODUCERS

# sha256 of the tensor files the tool wrote before W4A4 layouts (commit c05a646) from the W4A4 producer fixtures:
# --weight-only (and sm90, weight-only for every checkpoint, by default) must write them unchanged (config.json and
# the manifest carry the tool's version and format fields, which move on their own). sm120's weight-only kernel is
# Marlin (vLLM's auto there): --weight-only writes Marlin's W4A4 variant (test_sm120_weight_only_is_marlins_w4a4_variant).
BEFORE_W4A4 = {
    "ct_nvfp4-sm100-fuse": {
        "model.safetensors": "1722db3853737e559f216d6c7cef98088368d9b1bcd314d5b970f9af950fa3f7",
    },
    "ct_nvfp4-sm100-plain": {
        "model.safetensors": "54a3a3c80c3be1393eea9a341ea72f0ae13b6f66d95bee71e94a21f707211ee4",
    },
    "ct_nvfp4-sm90-plain": {
        "model.safetensors": "f6056d17647fea30eba483862f794545d0a4bdd01faf84f444f8935a7ea85e53",
    },
    "modelopt_nvfp4-sm100-fuse": {
        "model.safetensors": "1ed5bb719ebf6b89dfeade8277cb279a6c63210db5fd53860180e44eaa7053b4",
    },
    "modelopt_nvfp4-sm100-plain": {
        "model.safetensors": "a6883fca1c2d24682dce78e435c8b34f00a2ca76a3149d7f1ade390931c6f9d0",
    },
    "modelopt_nvfp4-sm90-plain": {
        "model.safetensors": "3d96b7f8e51c1ec8d9e9f546c2a43ac6186ff87db53c4512df9c2308a4791333",
    },
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("key", sorted(BEFORE_W4A4))
def test_weight_only_writes_the_bundles_of_before(key, tmp_path):
    name, target, mode = key.rsplit("-", 2)
    flags = [dict(weight_only=True)] + ([{}] if target == "sm90" else [])
    for i, flag in enumerate(flags):
        out = tmp_path / str(i)
        convert(PRODUCERS / name, target, out, fuse=mode == "fuse", **flag)
        assert {f: _sha256(out / f) for f in BEFORE_W4A4[key]} == BEFORE_W4A4[key], (key, flag)
        manifest = open_bundle(out).manifest
        assert (manifest.scheme, manifest.layout_id) == ("W4A16", resolve_target(target).layout_id)
        assert any(n.endswith(("input_scale", "input_global_scale")) for n in manifest.passthrough)


@pytest.mark.parametrize("name,target,layout,kernel", [
    ("modelopt_nvfp4", "sm100", w4a4.LAYOUT_ID, "FlashInferCuteDslNvFp4LinearKernel"),
    ("ct_nvfp4", "sm120", w4a4.LAYOUT_ID, "FlashInferCutlassNvFp4LinearKernel"),
    ("ct_nvfp4", "sm90", "sm90-triton-v2", "RepackSm90NvFp4LinearKernel"),
    ("modelopt_w4a16_nvfp4", "sm100", "sm100-cute-dsl-v1", "FlashInferCuteDslNvFp4W4A16LinearKernel"),
    ("ct_nvfp4a16", "sm120", "marlin-v1", "MarlinNvFp4LinearKernel"),  # vLLM's auto there: Marlin
    ("modelopt_w4a16_nvfp4", "sm120", "marlin-v1", "MarlinNvFp4LinearKernel"),
    # online transforms: QuTLASS (or vLLM's transform method) around FlashInfer's W4A4 GEMM, on the W4A4 layout
    ("ct_quip_vu_had32_nvfp4", "sm100", w4a4.LAYOUT_ID, "FlashInferCuteDslNvFp4LinearKernel"),
    ("ct_spinquant_r1r2r4_had16_nvfp4", "sm90", "sm90-triton-v2", "RepackSm90NvFp4LinearKernel"),
])
def test_default_layout_is_vllm_auto(name, target, layout, kernel, tmp_path):
    convert(PRODUCERS / name, target, tmp_path / "b", vllm="0.33")  # 0.34 refuses rotated W4A4 (test_engines.py)
    bundle = open_bundle(tmp_path / "b")
    assert (bundle.manifest.layout_id, bundle.manifest.kernels[0]) == (layout, kernel)
    assert bundle.target.layout_id == layout
    assert (bundle.manifest.scheme == "W4A4") == (layout == w4a4.LAYOUT_ID)
    if layout == w4a4.LAYOUT_ID:  # the input scales are in the layers, not passed through
        assert not any(n.endswith(("input_scale", "input_global_scale")) for n in bundle.manifest.passthrough)
    assert verify_output(tmp_path / "b").passed


def _random_w4a4(n: int, k: int, gen: torch.Generator) -> NVFP4Weight:
    weight = random_nvfp4(n, k, gen)
    scale = (torch.rand((), generator=gen) * 0.1 + 1e-3).to(torch.float32)
    return NVFP4Weight(weight.codes, weight.block_scales, weight.multiplier,
                       InputScale(scale, (1.0 / scale).to(torch.float32)))


@pytest.mark.parametrize("n,k", ODD_SHAPES)
def test_w4a4_layout_inverse_and_index_formula(n, k):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    weight = _random_w4a4(n, k, gen)
    runtime = w4a4.to_runtime(weight)
    specs = w4a4.runtime_specs(n, k)
    assert {p: (t.dtype, tuple(t.shape)) for p, t in runtime.tensors().items()} == {
        p: (s.dtype, s.shape) for p, s in specs.items()}
    assert runtime.weight.shape == ((n + 31) // 32 * 32, (k + 31) // 32 * 16)  # pad_nvfp4_weight_for_cutlass(32)
    back = w4a4.from_runtime(runtime, n, k)
    assert back.input_scale is not None and weight.input_scale is not None
    for a, b in ((back.codes, weight.codes), (back.block_scales, weight.block_scales),
                 (back.multiplier, weight.multiplier), (back.input_scale.scale, weight.input_scale.scale),
                 (back.input_scale.inverse, weight.input_scale.inverse)):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    assert torch.equal(runtime.alpha, weight.input_scale.scale * weight.multiplier.reshape(()))
    assert torch.equal(decode(runtime, n, k, w4a4.LAYOUT_ID, torch.float64), dequantize(weight))


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_fused_modules_keep_the_input_scale_vllm_keeps(fmt, tmp_path):
    """Read from the source files: ModelOpt keeps the largest input_scale (KNvfp4Dynamic: max), compressed-tensors
    the largest stored input_global_scale, i.e. the smallest scale (CompressedTensorsW4A4Fp4: max of the inverse)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    src = write_llama(tmp_path / "src", fmt, hidden=64, heads=4, kv_heads=2, intermediate=96, generator=gen,
                      w4a4=True)
    stored = load_file(src / "model.safetensors")
    convert(src, "sm100", tmp_path / "b", fuse=True)
    bundle = open_bundle(tmp_path / "b")
    suffix = "input_scale" if fmt == "modelopt" else "input_global_scale"
    for fused, members in bundle.manifest.fusion.items():
        owner = "model.layers.0."
        values = [stored[f"{owner}{m}.{suffix}"].reshape(()) for m in members]
        assert len({float(v) for v in values}) == len(values), "the fixture's partitions must differ"
        kept = max(values, key=float)
        scale, inverse = (kept, 1.0 / kept) if fmt == "modelopt" else (1.0 / kept, kept)
        assert torch.equal(bundle.read(f"{owner}{fused}.input_global_scale"), scale.to(torch.float32))
        assert torch.equal(bundle.read(f"{owner}{fused}.input_global_scale_inv"), inverse.to(torch.float32))


def test_missing_input_scale_is_refused_unless_weight_only(make_model, tmp_path):
    model = make_model("modelopt", w4a4=True, shapes=[(48, 80)])
    tensors = load_file(model.path / "model.safetensors")
    name = "model.layers.0.mlp.proj.input_scale"
    del tensors[name]
    save_file(tensors, model.path / "model.safetensors")
    with pytest.raises(RepackError, match=f"{name}: .*--weight-only"):
        convert(model.path, "sm100", tmp_path / "b")
    assert not (tmp_path / "b").exists()
    convert(model.path, "sm100", tmp_path / "b", weight_only=True)


EXACT_TOLERANCE = 1e-5  # float32 GEMM of exact FP4 operands against float64
# against the float64 definition: the kernel's float32 steps (and approximate reciprocals) move a code by one
# step where x * scale lies within a few ulps of an E2M1 boundary, and the output is bf16
REFERENCE_TOLERANCE = 1e-2


def _relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.to(torch.float64) - ref).norm() / ref.norm())


@pytest.mark.parametrize("n,k", ODD_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 33])
def test_reference_backend_computes_the_w4a4_gemm(n, k, m):
    """On fresh random bf16 activations: the float64 GEMM of the quantized activations (tight), the float64
    fake-quant reference (within a few flipped codes and bf16), and far from the unquantized GEMM."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    weight = _random_w4a4(n, k, gen)
    assert weight.input_scale is not None
    runtime = w4a4.to_runtime(weight)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10).to(torch.bfloat16)
    scales = reference.w4a4_scales(runtime.alpha, runtime.input_global_scale_inv)
    y = reference.linear(x.float(), runtime.weight, runtime.weight_scale, scales, n, k, w4a4.LAYOUT_ID)  # float32 out
    w64 = dequantize(weight)
    inverse = weight.input_scale.inverse
    exact = _relative(y, w4a4_products(x, w64, inverse))
    assert exact < EXACT_TOLERANCE, f"relative error {exact:.3g} (n={n}, k={k}, m={m})"
    error = _relative(y, w4a4_reference(x, w64, inverse))
    assert error < REFERENCE_TOLERANCE, f"relative error {error:.3g} (n={n}, k={k}, m={m})"
    assert _relative(y, x.to(torch.float64) @ w64.t()) > 3 * REFERENCE_TOLERANCE  # activations were quantized


def test_verify_fails_a_backend_that_skips_activation_quantization(monkeypatch, tmp_path):
    convert(PRODUCERS / "ct_nvfp4", "sm100", tmp_path / "b", fuse=True)
    assert verify_output(tmp_path / "b", numerics="all").passed
    monkeypatch.setattr(reference, "quantized_activations", lambda x, scale: x.to(torch.float32) * scale)
    report = verify_output(tmp_path / "b", numerics="all")
    assert not report.passed and set(report.summary()) == {"numerics"}


def test_cli_weight_only_flag_and_inspect(tmp_path, capsys):
    from repack.cli import main

    assert main(["convert", str(PRODUCERS / "modelopt_nvfp4"), "--target", "sm120", "-o", str(tmp_path / "a")]) == 0
    assert main(["convert", str(PRODUCERS / "modelopt_nvfp4"), "--target", "sm120", "-o", str(tmp_path / "b"),
                 "--weight-only"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "a")]) == 0
    assert "scheme W4A4; vLLM kernels: FlashInferCutlassNvFp4LinearKernel" in " ".join(capsys.readouterr().out.split())
    assert open_bundle(tmp_path / "b").manifest.layout_id == "marlin-v1-w4a4"  # vLLM's --linear-backend marlin


@pytest.mark.parametrize("name", ["modelopt_nvfp4", "ct_nvfp4"])
def test_sm120_weight_only_is_marlins_w4a4_variant(name, tmp_path):
    """sm120's weight-only kernel is Marlin's (vLLM's auto for a weight-only checkpoint there): a W4A4 checkpoint
    with --weight-only is what vLLM holds with --linear-backend marlin, sm80's W4A4 variant byte for byte (its
    activation scalars kept beside the Marlin bytes; tests/test_vllm_marlin_conformance.py checks vLLM's own load)."""
    convert(PRODUCERS / name, "sm120", tmp_path / "wo", fuse=True, weight_only=True)
    convert(PRODUCERS / name, "sm120", tmp_path / "marlin", fuse=True, linear_backend="marlin")
    convert(PRODUCERS / name, "sm80", tmp_path / "sm80", fuse=True)
    bundles = [open_bundle(tmp_path / f) for f in ("wo", "marlin", "sm80")]
    assert {(b.manifest.layout_id, b.manifest.scheme, b.manifest.kernels[0]) for b in bundles} == {
        ("marlin-v1-w4a4", "W4A4", "MarlinNvFp4LinearKernel")}
    files = [{f.name: _sha256(f) for f in (tmp_path / d).glob("*.safetensors")} for d in ("wo", "marlin", "sm80")]
    assert files[0] == files[1] == files[2]
    assert verify_output(tmp_path / "wo").passed


def test_linear_backend_picks_the_layout_vllm_holds_with_it(tmp_path, capsys):
    """convert --linear-backend: FlashInfer's cute-dsl W4A16 layout on sm120 (vLLM's --linear-backend
    flashinfer_cutedsl); a backend whose kernel holds no layout here, or with --weight-only, is refused in one line."""
    from repack.cli import main

    convert(PRODUCERS / "ct_nvfp4a16", "sm120", tmp_path / "cute", fuse=True, linear_backend="flashinfer_cutedsl")
    bundle = open_bundle(tmp_path / "cute")
    assert (bundle.manifest.layout_id, bundle.manifest.kernels) == ("sm120-cute-dsl-v1",
                                                                    ["FlashInferCuteDslNvFp4W4A16LinearKernel"])
    assert verify_output(tmp_path / "cute").passed
    refusals = [  # vLLM's cute-dsl W4A16 kernel holds a W4A4 checkpoint's scalars beside its bytes on sm120: not written
        (["modelopt_nvfp4", "-t", "sm120", "--linear-backend", "flashinfer_cutedsl"], "no layout written here", 1),
        (["ct_nvfp4a16", "-t", "sm100", "--linear-backend", "marlin"], "no layout written here", 1),
        # two flags that contradict each other: bad usage, refused before the checkpoint is read
        (["modelopt_nvfp4", "-t", "sm120", "--linear-backend", "marlin", "--weight-only"], "give one of the two", 2),
    ]
    for i, (args, words, exit_code) in enumerate(refusals):
        code = main(["convert", str(PRODUCERS / args[0]), *args[1:], "-o", str(tmp_path / str(i))])
        err = capsys.readouterr().err
        assert code == exit_code and words in err and err.count("\n") == 1, err
        assert not (tmp_path / str(i)).exists()


def _w4a4_gpu() -> bool:
    if not torch.cuda.is_available():
        return False
    capability = torch.cuda.get_device_capability()
    return any(capability in t.compute_capabilities and t.for_scheme("W4A4").scheme == "W4A4"
               for t in (resolve_target("sm100"), resolve_target("sm120")))


@pytest.mark.gpu
@pytest.mark.skipif(not _w4a4_gpu(), reason="needs an sm100 / sm120 GPU (FlashInfer's FP4 x FP4 GEMM)")
@pytest.mark.parametrize("n,k", ODD_SHAPES)
def test_flashinfer_w4a4_matches_the_reference_backend(n, k, tmp_path):
    """FlashInfer's fp4_quantize + mm_fp4 on the bundle's tensors against the reference backend (never run yet:
    written without a Blackwell GPU)."""
    from repack.runtime.backends import flashinfer

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    runtime = w4a4.to_runtime(_random_w4a4(n, k, gen))
    x = torch.randn(33, k, generator=gen).to(torch.bfloat16)
    scales = reference.w4a4_scales(runtime.alpha, runtime.input_global_scale_inv)
    expected = reference.linear(x, runtime.weight, runtime.weight_scale, scales, n, k, w4a4.LAYOUT_ID)
    got = flashinfer.linear(x.cuda(), runtime.weight.cuda(), runtime.weight_scale.cuda(), scales.cuda(), n, k,
                            w4a4.LAYOUT_ID)
    assert _relative(got.float().cpu(), expected.double()) < 1e-2


def test_qutlass_route_is_vllms_rule():
    """vLLM 0.33's is_qutlass_fp4_scheme: every input transform has a head_dim of 16, 32, 64 or 128."""
    assert all(w4a4.runs_qutlass([b]) for b in (16, 32, 64, 128))
    assert w4a4.runs_qutlass([16, 128])
    assert not any(w4a4.runs_qutlass(b) for b in ([], [8], [256], [None], [16, None]))
    alpha, scale = w4a4.qutlass_scales(torch.tensor(0.75))
    assert (alpha.dtype, alpha.shape, float(alpha)) == (torch.float32, (), 0.125)
    assert (scale.dtype, scale.shape, scale.tolist()) == (torch.float32, (1,), [6.0])


@pytest.mark.parametrize("fixture,qutlass", [("ct_quip_vu_rhad16_nvfp4", 8), ("ct_quip_vu_had32_nvfp4", 6),
                                             ("ct_spinquant_r1r2r4_had16_nvfp4", 2)])
def test_rotated_w4a4_bundle_quantizes_as_qutlass(fixture, qutlass, tmp_path, monkeypatch):
    """A W4A4 rotated checkpoint converts to the W4A4 layout; the layers vLLM serves through QuTLASS quantize their
    rotated activations with its global scale 6 (and ``fused_alpha``), which verify's fake-quant reference holds
    them to; a runtime that kept the checkpoint's activation scale there fails verify."""
    out = tmp_path / "b"
    convert(PRODUCERS / fixture, "sm100", out, fuse=True, vllm="0.33")
    bundle = open_bundle(out)
    assert bundle.manifest.layout_id == w4a4.LAYOUT_ID
    assert sum(bundle.runs_qutlass(p) for p in bundle.manifest.layers) == qutlass
    seed = int(torch.randint(0, 2**31, ()))
    assert verify_bundle(out, seed=seed, numerics="all").passed, f"seed {seed}"
    assert all(hasattr(load_bundle(out).layer(p), "fused_alpha") == bundle.runs_qutlass(p)
               for p in bundle.manifest.layers)
    checkpoint_scale = property(lambda self: reference.w4a4_scales(self.alpha, self.input_global_scale_inv))
    monkeypatch.setattr(PackedLinear, "gemm_scale", checkpoint_scale)
    report = verify_bundle(out, seed=seed, numerics="all")
    failed = {c.name for c in report.layers if c.status == "fail"}
    assert failed and failed <= {p for p in bundle.manifest.layers if bundle.runs_qutlass(p)}, f"seed {seed}"
