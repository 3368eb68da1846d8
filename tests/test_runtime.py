"""Runtime: the custom op against float64 references, the FlashInfer call contract, compile, whole models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from repack.convert import convert
from repack.errors import RepackError
from repack.formats import read_source
from repack.nvfp4 import dequantize
from repack.runtime import load_bundle, nvfp4_linear, patch_model
from repack.targets import FAMILIES, TARGETS, resolve_family, resolve_target
from repack.targets.layout import vllm_geometry
from repack.verify import w4a4_products

from .conftest import ODD_SHAPES, PRODUCERS

BF16_REL_TOL = 1e-2  # bf16 output rounding (2^-9 per element) plus float32 accumulation


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.fixture(params=[t.name for t in TARGETS if t.backend == "flashinfer"])
def bundle_and_source(request, make_model, tmp_path):
    model = make_model("modelopt", shapes=ODD_SHAPES)
    out = tmp_path / "bundle"
    convert(model.path, request.param, out)
    return out, model


@pytest.mark.parametrize("leading", [(1,), (7,), (2, 3), (4, 1, 5)])
def test_reference_backend_matches_float64(bundle_and_source, leading):
    out, model = bundle_and_source
    loaded = load_bundle(out, "cpu")
    assert loaded.backend == "reference"
    for prefix, weight in model.layers.items():
        layer = loaded.layer(prefix)
        x = torch.randn(*leading, weight.k).to(torch.bfloat16)
        bias = torch.randn(weight.n).to(torch.bfloat16)
        y = nvfp4_linear(x, layer, bias)
        assert y.shape == (*leading, weight.n) and y.dtype == torch.bfloat16
        ref = x.double() @ dequantize(weight).t() + bias.double()
        assert rel_error(y, ref) < BF16_REL_TOL, (prefix, leading)


def test_eager_calls_follow_buffers_replaced_after_the_first_call(bundle_and_source):
    """Eager calls bind the layer's tensors to its backend once; a device or dtype move (``Module._apply``, which
    ``.to()`` and ``.cuda()`` run) replaces the buffers, and the next call must read the new ones: doubling the
    replaced multiplier (exact in every format) doubles the output exactly."""
    out, model = bundle_and_source
    prefix, weight = next(iter(model.layers.items()))
    layer = load_bundle(out, "cpu").layer(prefix)
    x = torch.randn(3, weight.k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    before = layer(x)
    layer._apply(torch.clone)
    layer.weight_global_scale.mul_(2.0)
    assert torch.equal(layer(x), before * 2)


def test_fake_implementation_and_opcheck(bundle_and_source):
    out, model = bundle_and_source
    loaded = load_bundle(out, "cpu")
    prefix, weight = next(iter(model.layers.items()))
    layer = loaded.layer(prefix)
    x = torch.randn(5, weight.k).to(torch.bfloat16)
    args = (x, layer.weight, layer.weight_scale, layer.weight_global_scale, layer.n, layer.k, layer.target, "reference")
    # test_schema perturbs inputs arithmetically, which float8 scales do not support; the rest applies.
    torch.library.opcheck(torch.ops.nvfp4_repack.linear.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    meta = [torch.empty(9, weight.k, dtype=torch.bfloat16, device="meta")] + [a.to("meta") for a in args[1:4]]
    out = torch.ops.nvfp4_repack.linear(*meta, *args[4:])
    assert out.device.type == "meta" and out.shape == (9, weight.n) and out.dtype == torch.bfloat16


def test_torch_compile_fullgraph(bundle_and_source):
    out, model = bundle_and_source
    loaded = load_bundle(out, "cpu")
    prefix, weight = next(iter(model.layers.items()))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = loaded.layer(prefix)

        def forward(self, x):
            return torch.relu(self.proj(x * 2.0)) + 1.0

    block = Block()
    compiled = torch.compile(block, fullgraph=True)
    for m in (3, 8):  # a second shape exercises the fake implementation's shape math again
        x = torch.randn(m, weight.k).to(torch.bfloat16)
        assert torch.equal(compiled(x), block(x))


def fake_mm_bf16_fp4(calls: list, target_name: str):
    """Stands in for flashinfer.gemm.mm_bf16_fp4: checks the documented contract, computes its semantics."""
    target = resolve_target(target_name)

    def mm(a, b, b_descale, alpha=None, *, backend, out_dtype=None, out=None, block_size=16, enable_pdl=True):
        assert backend == "cute-dsl" and block_size == 16
        assert a.dim() == 2 and a.dtype == torch.bfloat16 and a.is_contiguous()
        k_padded = a.shape[1]
        assert k_padded % 64 == 0, "activations padded to the weight's 64-aligned K"
        assert alpha.dtype == torch.float32 and alpha.shape == (1,)
        for t in (a, b):
            assert t.data_ptr() % 32 == 0
        if target_name == "sm100":
            assert b.dtype == torch.uint8 and b.shape[1] * 2 == k_padded
            assert b_descale.dim() == 6, "sm100 takes the 6-D MMA view of the 128x4 buffer"
            n_padded = b.shape[0]
            scales = b_descale.permute(5, 2, 4, 0, 1, 3).contiguous().reshape(-1)  # storage order
        else:
            assert b.dtype == torch.int32 and b.shape == (k_padded // 16, b.shape[1])
            assert b_descale.dtype == torch.uint8
            n_padded = b.shape[1] // 2
            scales = b_descale
        calls.append((a.shape, n_padded))
        from repack.runtime.formulas import decode
        from repack.targets import RuntimeLayer

        weight = decode(RuntimeLayer(b, scales, alpha, 0), n_padded, k_padded, target.name, torch.float64)
        return (a.double() @ weight.t()).to(torch.bfloat16)

    return mm


def test_flashinfer_call_contract(bundle_and_source, monkeypatch):
    """Arguments, dtypes, shapes, alignment, activation padding and output slicing, with the kernel substituted."""
    import flashinfer.gemm

    out, model = bundle_and_source
    loaded = load_bundle(out, "cpu", backend="flashinfer")
    calls: list = []
    monkeypatch.setattr(flashinfer.gemm, "mm_bf16_fp4", fake_mm_bf16_fp4(calls, loaded.bundle.target.name))
    for prefix, weight in model.layers.items():
        layer = loaded.layer(prefix)
        x = torch.randn(2, 3, weight.k).to(torch.bfloat16)
        y = layer(x)
        shape = vllm_geometry(weight.n, weight.k)
        assert calls[-1] == ((6, shape.k_padded), shape.n_padded)
        assert y.shape == (2, 3, weight.n)
        assert rel_error(y, x.double() @ dequantize(weight).t()) < BF16_REL_TOL


def test_bundle_refuses_the_wrong_gpu(bundle_and_source, monkeypatch):
    out, _ = bundle_and_source
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    other = {"sm100": (12, 0), "sm120": (10, 0)}[load_bundle(out).bundle.target.name]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: other)
    with pytest.raises(RepackError, match="but the device is sm"):
        load_bundle(out, "cuda")


def blackwell_target():
    """The FlashInfer target of this machine's GPU, from the capability table; None without one."""
    if not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability()
    return next((t for t in TARGETS if resolve_family(t.name).backend == "flashinfer"
                 and capability in t.compute_capabilities), None)


@pytest.mark.gpu
@pytest.mark.skipif(blackwell_target() is None, reason="needs a Blackwell GPU (sm100/103/107, sm120/121)")
def test_flashinfer_kernel_on_blackwell(make_model, tmp_path):
    target = blackwell_target()
    model = make_model("compressed-tensors", shapes=ODD_SHAPES + [(4096, 4096)])
    # sm120's weight-only default is Marlin's (no GPU backend here): its cute-dsl layout runs FlashInfer's kernel
    convert(model.path, target.name, tmp_path / "b", linear_backend="flashinfer_cutedsl")
    loaded = load_bundle(tmp_path / "b", "cuda")
    for prefix, weight in model.layers.items():
        x = torch.randn(16, weight.k).to(torch.bfloat16)
        y = loaded.layer(prefix)(x.cuda()).cpu()
        assert rel_error(y, x.double() @ dequantize(weight).t()) < BF16_REL_TOL


def dequantized_llama(fixture: str):
    """The producer's model with every quantized linear replaced by its float32 dequantized weight."""
    import transformers

    source = read_source(PRODUCERS / fixture)
    config = transformers.AutoConfig.from_pretrained(PRODUCERS / fixture)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name in source.passthrough:
            if name in state:
                state[name].copy_(source.checkpoint.read(name))
        for prefix, layer in source.layers.items():
            state[f"{prefix}.weight"].copy_(dequantize(source.load_layer(layer), torch.float32))
    return model


@pytest.mark.parametrize("target", [f.name for f in FAMILIES if f.backend == "flashinfer"])
@pytest.mark.parametrize("fixture", ["ct_nvfp4a16", "modelopt_nvfp4"])
def test_whole_model_logits(tmp_path, target, fixture):
    reference = dequantized_llama(fixture).float()
    out = tmp_path / "bundle"
    convert(PRODUCERS / fixture, target, out, weight_only=True)  # bf16 activations: W4A4 below
    patched = dequantized_llama(fixture).to(torch.bfloat16)
    for module in patched.modules():  # make sure nothing is left from the dequantized weights
        if isinstance(module, nn.Linear) and module is not patched.lm_head:
            module.weight.data.fill_(float("nan"))
    unused = patch_model(patched, out)
    assert all(name.endswith(("input_scale", "input_global_scale")) for name in unused)
    tokens = torch.randint(0, reference.config.vocab_size, (2, 11))
    with torch.no_grad():
        ref = reference(tokens).logits.double()
        got = patched(tokens).logits.double()
    assert torch.isfinite(got).all()
    assert float((got - ref).norm() / ref.norm()) < 3e-2  # bf16 activations through a whole model



@pytest.mark.parametrize("target", [f.name for f in FAMILIES if f.backend == "flashinfer"])
@pytest.mark.parametrize("fixture", ["modelopt_nvfp4", "ct_nvfp4"])
def test_patched_w4a4_layers_quantize_their_activations(tmp_path, target, fixture):
    """A W4A4 bundle (the default) through patch_model: each layer of the model, on fresh bf16 activations, is the
    float64 GEMM of those activations quantized with the source's input scale as the kernels do (a whole model's
    logits are no test: one bf16 rounding moves an activation across an FP4 step, compounding layer after layer)."""
    source = read_source(PRODUCERS / fixture)
    convert(PRODUCERS / fixture, target, tmp_path / "bundle")
    patched = dequantized_llama(fixture).to(torch.bfloat16)
    assert patch_model(patched, tmp_path / "bundle") == []  # the input scales are the layers' own, not passthrough
    for prefix, layer in source.layers.items():
        x = (torch.randn(9, layer.k) * torch.rand(9, 1) * 4).to(torch.bfloat16)
        weight = dequantize(source.load_layer(layer))
        expected = w4a4_products(x, weight, source.read_input_scale(prefix).inverse)
        with torch.no_grad():
            got = patched.get_submodule(prefix)(x).double()
        error, apart = (float((got - r).norm() / r.norm()) for r in (expected, x.double() @ weight.t()))
        assert error < 1e-2 < apart, f"{prefix}: {error:.3g} from the W4A4 reference, {apart:.3g} from bf16 x"
