"""The runtime op on this machine's GPU, whatever target it is: compile, CUDA graphs, whole model, verify.

Skips cleanly without CUDA, or on a GPU no target runs on. On an H200 this exercises the sm90 Triton
backend through the custom op; on Blackwell, FlashInfer's cute-dsl kernels.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from repack.cli import main
from repack.convert import convert
from repack.formats import read_source
from repack.nvfp4 import dequantize
from repack.runtime import load_bundle, patch_model
from repack.runtime.layer import FusedLinear
from repack.targets import target_for_capability

from .conftest import ODD_SHAPES, PRODUCERS
from .test_runtime import BF16_REL_TOL, dequantized_llama, rel_error


def gpu_target():
    if not torch.cuda.is_available():
        return None
    return target_for_capability(*torch.cuda.get_device_capability())


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_target() is None, reason="needs a GPU that a target runs on")]


@pytest.fixture
def gpu_bundle(make_model, tmp_path):
    model = make_model("compressed-tensors", shapes=ODD_SHAPES + [(4096, 4096)])
    out = tmp_path / "bundle"
    convert(model.path, gpu_target().name, out)
    return load_bundle(out, "cuda"), model


def test_layers_match_float64(gpu_bundle):
    loaded, model = gpu_bundle
    assert loaded.backend == gpu_target().backend
    for prefix, weight in model.layers.items():
        for m in (1, 5, 33):
            x = torch.randn(m, weight.k).to(torch.bfloat16)
            y = loaded.layer(prefix)(x.cuda()).cpu()
            assert rel_error(y, x.double() @ dequantize(weight).t()) < BF16_REL_TOL, (prefix, m)


def test_eager_layer_reuses_its_launch_and_takes_any_input(gpu_bundle):
    """The eager path keeps one direct launch per layer and M for 16-byte aligned activations: a second input at the
    same M reuses it, a view starting 2 bytes into its storage takes the generic path, and leading dimensions fold
    into M; every result against float64."""
    loaded, model = gpu_bundle
    prefix, weight = list(model.layers.items())[-1]
    layer = loaded.layer(prefix)
    gen = torch.Generator().manual_seed(23)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    storage = rand(3 * weight.k + 1)
    unaligned = storage.cuda()[1:].view(3, weight.k)
    assert unaligned.data_ptr() % 16 != 0
    cases = [(x, x.cuda()) for x in (rand(1, weight.k), rand(1, weight.k), rand(2, 3, weight.k))]
    cases.append((storage[1:].view(3, weight.k), unaligned))
    w64 = dequantize(weight)
    for x, on_gpu in cases:
        y = layer(on_gpu).cpu()
        assert y.shape == (*x.shape[:-1], weight.n)
        assert rel_error(y, x.double() @ w64.t()) < BF16_REL_TOL, list(x.shape)


def test_compile_and_cuda_graph(gpu_bundle):
    loaded, model = gpu_bundle
    prefix, weight = list(model.layers.items())[-1]
    block = nn.Sequential(loaded.layer(prefix), nn.ReLU()).cuda()
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(16, weight.k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(compiled(x), block(x))
    assert_graph_replays(block, x)


def assert_graph_replays(fn, x: torch.Tensor) -> None:
    """``fn`` captured in a CUDA graph and replayed on fresh input gives what ``fn`` gives eagerly."""
    static_x = x.clone()
    for _ in range(2):  # warm up before capture, as CUDA graphs require
        fn(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fn(static_x)
    fresh = torch.randn_like(x)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, fn(fresh))


@pytest.mark.parametrize("fuse", [True, False])
def test_whole_model_on_gpu(tmp_path, fuse):
    """The producer's tiny Llama against float64-dequantized weights, q/k/v and gate/up fused at load where the
    target stacks them (sm90) or not: eager, and compiled (fullgraph, the fused layers' state traced)."""
    fixture = "ct_nvfp4a16"
    out = tmp_path / "bundle"
    convert(PRODUCERS / fixture, gpu_target().name, out)
    reference = dequantized_llama(fixture).double().cuda()
    patched = dequantized_llama(fixture).to(torch.bfloat16).cuda()
    patch_model(patched, out, device="cuda", fuse=fuse)
    fused = [m for m in patched.modules() if isinstance(m, FusedLinear)]
    assert bool(fused) == (fuse and gpu_target().stack_rows is not None)
    tokens = torch.randint(0, reference.config.vocab_size, (2, 11), device="cuda")
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        ref = reference(tokens).logits
        for got in (patched(tokens).logits, compiled(tokens).logits):
            assert float((got.double() - ref).norm() / ref.norm()) < 3e-2
    assert all(m._output is None for m in fused)


def test_cli_verify_on_cuda(tmp_path, capsys):
    out = tmp_path / "bundle"
    convert(PRODUCERS / "modelopt_nvfp4_sharded", gpu_target().name, out)
    assert main(["verify", str(out), "--device", "cuda", "--source", str(PRODUCERS / "modelopt_nvfp4_sharded")]) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and f"{gpu_target().backend} backend on cuda" in text
    assert read_source(PRODUCERS / "modelopt_nvfp4_sharded").layers
