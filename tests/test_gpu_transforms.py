"""Online transforms on this machine's GPU (sm90 Triton on an H200, FlashInfer on Blackwell): layers against
float64, a whole transformed model against its float reference, torch.compile and CUDA graph capture. On sm90
input transforms of 16 to 128 run fused into the kernels' activation pre-pass, the others (SpinQuant's R4 over
the whole K) as ``block_transform`` before them: both fixtures below have each kind.

Skips cleanly without CUDA, or on a GPU no target runs on.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from repack.convert import convert
from repack.formats import read_source
from repack.formats.transforms import load_matrix
from repack.nvfp4 import dequantize
from repack.runtime import load_bundle, patch_model

from .conftest import PRODUCERS
from .test_gpu_runtime import assert_graph_replays, gpu_target
from .test_runtime import BF16_REL_TOL, dequantized_llama, rel_error
from .test_transforms import MODEL_REL_TOL, TOKENS, blockdiag64, transformed_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_target() is None, reason="needs a GPU that a target runs on")]

FIXTURE = "ct_quip_vu_had32_nvfp4"  # input and output transforms, blocks of 32, layers without u
WHOLE_K = "ct_spinquant_r1r2r4_rhad_nvfp4a16"  # R4 only: a random-Hadamard input transform over all of down_proj's K
FUSED_ON_SM90 = {FIXTURE: {32}, WHOLE_K: set()}  # the input-transform block sizes the sm90 kernels apply themselves


@pytest.fixture(scope="module", params=[FIXTURE, WHOLE_K])
def gpu_bundle(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("transforms") / "bundle"
    convert(PRODUCERS / request.param, gpu_target().name, out, weight_only=True)  # bf16 activations, as the reference
    return load_bundle(out, "cuda"), read_source(PRODUCERS / request.param), request.param


def test_transformed_layers_match_float64(gpu_bundle):
    loaded, source, fixture = gpu_bundle
    assert loaded.backend == gpu_target().backend
    fused = set()
    for prefix, layer in source.layers.items():
        packed = loaded.layer(prefix)
        if packed.fused_input_transform is not None:
            fused.add(packed.input_transform.shape[0])
        weight = dequantize(source.load_layer(layer))
        matrices = {t.location: load_matrix(source.checkpoint, t.matrix) / t.matrix.scale
                    for t in source.transforms.layers.get(prefix, ())}
        for m in (1, 5, 16, 33):  # the decode kernel (after the pre-pass, with PDL), then the tensor-core kernel
            x = torch.randn(m, layer.k).to(torch.bfloat16)
            ref = x.double()
            ref = blockdiag64(ref, matrices["input"]) if "input" in matrices else ref
            ref = ref @ weight.t()
            ref = blockdiag64(ref, matrices["output"]) if "output" in matrices else ref
            y = packed(x.cuda()).cpu()
            assert rel_error(y, ref) < BF16_REL_TOL, (prefix, m)
    assert fused == (FUSED_ON_SM90[fixture] if loaded.backend == "triton" else set())


def test_transformed_layer_compiles_and_captures(tmp_path):
    out = tmp_path / "bundle"
    convert(PRODUCERS / FIXTURE, gpu_target().name, out, weight_only=True)
    layer = load_bundle(out, "cuda").layer("model.layers.1.self_attn.o_proj")
    assert layer.input_transform is not None and layer.output_transform is not None
    assert (layer.fused_input_transform is not None) == (layer.backend == "triton")
    assert bool(layer.input_walsh_key) == (layer.backend == "triton")  # hadamard: the decode kernel applies it itself
    block = nn.Sequential(layer, nn.ReLU()).cuda()
    compiled = torch.compile(block, fullgraph=True)
    for m in (1, 16, 40):  # the decode kernel (the transform inside it), then the tensor-core kernel
        x = torch.randn(m, layer.k, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(compiled(x), block(x))
        assert_graph_replays(compiled, x)


def test_transformed_model_on_gpu(gpu_bundle):
    loaded, _, fixture = gpu_bundle
    patched = dequantized_llama(fixture).to(torch.bfloat16).cuda()
    patch_model(patched, loaded, device="cuda")
    with torch.no_grad():
        got = patched(TOKENS.cuda()).logits.double().cpu()
        ref = transformed_reference(fixture)(TOKENS).logits.double()
    assert rel_error(got, ref) < MODEL_REL_TOL


@pytest.mark.parametrize("fixture", ["ct_quip_v_had16_nvfp4a16", FIXTURE, WHOLE_K])
def test_vllm_kernel_class_route_on_sm90(tmp_path, fixture):
    """What RepackSm90NvFp4LinearKernel.apply_weights runs for a fused sm90 transform bundle that vLLM serves
    (``nvfp4_matmul`` with the layer's input transform: in the kernels' pre-pass for blocks of 16-128, with the
    Walsh-Hadamard factors of a Sylvester matrix at M = 1; before them otherwise) = float64 (x T_in) W^T."""
    from repack.bundle.reader import open_bundle
    from repack.bundle.layers import source_function
    from repack.runtime.backends import fuses_input_transform, prepare_backend
    from repack.runtime.op import nvfp4_matmul
    from repack.runtime.transforms import walsh_factors
    from repack.verify import output_layer

    if gpu_target().name != "sm90":
        pytest.skip("the sm90 Triton kernels")
    convert(PRODUCERS / fixture, "sm90", tmp_path / "bundle", fuse=True)
    bundle, source = open_bundle(tmp_path / "bundle"), read_source(PRODUCERS / fixture)
    seen = set()
    for prefix, record in bundle.manifest.layers.items():
        inputs = [t for t in record.transforms if t.location == "input"]
        if not inputs:
            continue
        matrix = bundle.transform_matrix(inputs[0].matrix).cuda()
        fuse = fuses_input_transform("triton", matrix)
        walsh = walsh_factors(matrix) if fuse else None
        seen.add((fuse, walsh is not None))
        planned = output_layer(prefix, record)
        weight = source_function(source, planned)
        first = source.transforms.layers[planned.pieces[0].source][0].matrix
        exact = load_matrix(source.checkpoint, first) / first.scale
        tensors = [v.cuda() for v in bundle.runtime_layer(prefix).tensors().values()]  # weight, scale, global
        # eager calls take the prepared launch (bound with the fused transform), traced ones the op
        launch = prepare_backend("triton", *tensors, record.n, record.k, "sm90", matrix if fuse else None, walsh)
        for m, prepared in ((1, launch), (1, None), (5, launch), (33, None)):
            x = torch.randn(m, record.k).to(torch.bfloat16)
            y = nvfp4_matmul(x.cuda(), *tensors, record.n, record.k, "sm90", "triton", prepared=prepared,
                             input_transform=matrix, fuse_input=fuse, input_walsh=walsh.key() if walsh else "")
            assert rel_error(y.cpu(), blockdiag64(x.double(), exact) @ weight.t()) < BF16_REL_TOL, (prefix, m)
    assert seen == {"ct_quip_v_had16_nvfp4a16": {(True, True)}, FIXTURE: {(True, True)},
                    WHOLE_K: {(False, False)}}[fixture], seen
