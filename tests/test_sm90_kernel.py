"""sm90 Triton W4A16 kernel (GPU, Hopper only): against a float64 reference, every output written, graph replay."""

from __future__ import annotations

import pytest
import torch

from repack.nvfp4 import NVFP4Weight, dequantize
from repack.sample.synthetic import random_nvfp4
from repack.runtime.transforms import sylvester, walsh_factors
from repack.targets import RuntimeLayer, sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a Hopper (sm90) GPU",
    ),
]

REL_TOL = 1e-2  # bf16 output rounding is ~2**-9 relative; the dense path also rounds weights to bf16 once
ODD_SHAPES = [(16, 16), (48, 80), (208, 1040), (1040, 272)]  # multiples of 16, not of 64
BENCH_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (10240, 8192), (57344, 8192), (8192, 28672)]
MS = [1, 3, 16, 64, 128, 200, 1024]


def backend():
    from repack.runtime.backends import triton_sm90

    return triton_sm90


def random_weight(n: int, k: int, seed: int) -> NVFP4Weight:
    return random_nvfp4(n, k, torch.Generator().manual_seed(seed), allow_zero_scales=False)


def runtime_on_gpu(weight: NVFP4Weight) -> dict[str, torch.Tensor]:
    return {name: t.cuda() for name, t in sm90.to_runtime(weight).tensors().items()}


def random_runtime(n: int, k: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Large aligned layers: random words are a valid layout (every bit pattern is a code); float64 reference weights."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    specs = sm90.runtime_specs(n, k)
    words = torch.randint(-(2**31), 2**31, specs["weight"].shape, dtype=torch.int32, device="cuda", generator=gen)
    scale_bytes = torch.randint(1, 0x7F, specs["weight_scale"].shape, dtype=torch.uint8, device="cuda", generator=gen)
    tensors = {
        "weight": words,
        "weight_scale": scale_bytes.view(torch.float8_e4m3fn),
        "weight_global_scale": torch.tensor([3e-4], dtype=torch.float32, device="cuda"),
    }
    layer = RuntimeLayer(**tensors, weights_padding_cols=0)
    return tensors, sm90.dequantize_runtime(layer, n, k)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def poison_allocator(numel: int) -> None:
    """Leave a NaN-filled bf16 block of ``numel`` in the caching allocator so the next ``empty`` reuses it."""
    block = torch.full((numel,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del block


def check(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (x.shape[0], w64.shape[0])
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = rel_err(y, x.double() @ w64.T)
    assert err < REL_TOL, f"relative error {err:.3e}"


@pytest.mark.parametrize("n,k", ODD_SHAPES)
@pytest.mark.parametrize("m", MS)
def test_linear_odd_shapes(n: int, k: int, m: int) -> None:
    weight = random_weight(n, k, seed=n + 31 * k + m)
    tensors = runtime_on_gpu(weight)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    poison_allocator(m * n)
    y = backend().linear(x, **tensors, n=n, k=k)
    check(y, x, dequantize(weight).cuda())


@pytest.mark.parametrize("n,k", BENCH_SHAPES)
def test_linear_bench_shapes(n: int, k: int) -> None:
    tensors, w64 = random_runtime(n, k, seed=n ^ k)
    for m in MS:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        poison_allocator(m * n)
        check(backend().linear(x, **tensors, n=n, k=k), x, w64)


# (bm, warpgroups, stages, programs per SM)
TC_CONFIGS = [(32, 1, 4, 2), (64, 1, 4, 2), (128, 2, 4, 1), (256, 2, 3, 1), (64, 2, 2, 1), (16, 1, 3, 1),
              (32, 1, 4, 4), (64, 1, 3, 3), (8, 1, 4, 4), (16, 1, 4, 4), (16, 1, 4, 5), (128, 1, 3, 2)]  # fmt: skip


@pytest.mark.parametrize("m", [1, 5, 17, 64, 100, 300])
@pytest.mark.parametrize("split_k", [1, 2, 3, 7])
@pytest.mark.parametrize("config", TC_CONFIGS)
def test_tensor_core_every_config_and_split_writes_all(m: int, split_k: int, config: tuple) -> None:
    """208 x 1040: N not a multiple of the 64/128-row tile, K of 64 (20 chunks, padded to 1280); M below, at and
    above the activation tile; 7 splits of 10 steps run as 5 of 2."""
    n, k = 208, 1040
    weight = random_weight(n, k, seed=m * 13 + split_k + sum(config))
    tensors = runtime_on_gpu(weight)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = backend()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = b.tc_linear(x, **tensors, n=n, k=k, config=b.TcConfig(*config), split_k=split_k, out=out)
    assert y.data_ptr() == out.data_ptr()
    check(y, x, dequantize(weight).cuda())


def test_tensor_core_cached_launch_is_the_kernel_triton_picks(monkeypatch) -> None:
    """The tensor-core kernel goes through ``Launcher`` (keyed on its TMA descriptors too): every call's compiled
    kernel is the one Triton's own ``warmup`` picks for those arguments, and the output is bit for bit that of
    Triton's generic launch (Ms that Triton specialises differently: 1, multiples of 16 and not)."""
    from repack.runtime.backends.triton_sm90 import tensor_core

    b, launcher = backend(), tensor_core._launch_tc
    calls = []
    monkeypatch.setattr(tensor_core, "_launch_tc",
                        lambda grid, args, kwargs: calls.append((grid, args, kwargs)) or launcher(grid, args, kwargs))
    outputs = []
    for n, k in ((208, 1040), (4096, 4096)):
        tensors = runtime_on_gpu(random_weight(n, k, seed=n + k))
        for m in (1, 16, 17, 32, 100, 256):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            for split_k in (1, 3):
                config = b.tc_config_for(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
                outputs.append((x, tensors, n, k, config, split_k,
                                b.tc_linear(x, **tensors, n=n, k=k, config=config, split_k=split_k)))
    assert len(calls) == len(outputs)
    for grid, args, kwargs in calls:
        assert launcher.compiled_for(grid, args, kwargs)[0] is tensor_core._tc_kernel.warmup(*args, grid=grid, **kwargs)
    monkeypatch.setattr(tensor_core, "_launch_tc",
                        lambda grid, args, kwargs: tensor_core._tc_kernel[grid](*args, **kwargs))
    for x, tensors, n, k, config, split_k, y in outputs:
        generic = b.tc_linear(x, **tensors, n=n, k=k, config=config, split_k=split_k)
        assert torch.equal(y.view(torch.int16), generic.view(torch.int16))


def test_launcher_skips_tritons_generic_path_unless_a_hook_is_set(monkeypatch) -> None:
    """Once compiled, a ``Launcher`` launch does not enter Triton's ``JITFunction.run`` (its generic launch: about
    100 us of CPU per call); with a launch hook set (a profiler's), it does, so that the hook sees the launch."""
    from triton import knobs

    from repack.runtime.backends.triton_sm90 import tensor_core

    b = backend()
    n, k, m = 208, 1040, 32  # the tensor-core kernel and its k-slot pass
    tensors = runtime_on_gpu(random_weight(n, k, seed=7))
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    y = b.linear(x, **tensors, n=n, k=k)  # compiles both kernels
    entered = []
    for kernel in (tensor_core._tc_kernel, tensor_core._kslot_kernel):
        monkeypatch.setattr(kernel, "run", lambda *a, real=kernel.run, **kw: entered.append(real) or real(*a, **kw))
    assert torch.equal(b.linear(x, **tensors, n=n, k=k), y) and entered == []

    def hook(*args, **kwargs) -> None:
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert torch.equal(b.linear(x, **tensors, n=n, k=k), y)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(entered) == 2


# (N, K, transform block or 0): narrow (64-row tiles, K split) and wide layers, K not a multiple of 256 (1040)
PREPARED_LAYERS = [(208, 1040, 0), (4096, 4096, 0), (14336, 4096, 0), (1040, 2112, 64)]


def test_prepared_tensor_core_launch_is_the_generic_call(monkeypatch) -> None:
    """``Prepared`` at the tensor-core kernel's sizes (``TcLaunch``: one workspace per stream shared by all layers,
    both launches through the C launcher, TMA maps encoded once) returns bit for bit what ``run`` returns, over a
    chain of layers at Ms with and without K splits (each layer's pass rewriting the workspace the previous kernel
    read), on a second stream, and never enters Triton's generic launch; under CUDA-graph capture it takes
    ``tc_linear`` and replays bit for bit. The decode kernel's ``GemvLaunch`` takes the C launcher too."""
    from repack.runtime.backends.triton_sm90 import dispatch, tensor_core

    layers = []
    for n, k, block in PREPARED_LAYERS:
        tensors = runtime_on_gpu(random_weight(n, k, seed=n + k))
        t = random_orthogonal(block, seed=block) if block else None
        layers.append((tensors, n, k, t, dispatch.Prepared(**tensors, n=n, k=k, transform=t, prepared_tc=True),
                       dispatch.Prepared(**tensors, n=n, k=k, transform=t, prepared_tc=False)))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (17, 32, 100, 256, 300):
        xs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _, _, k, _, _, _ in layers]
        expected = [generic(x) for x, (*_, generic) in zip(xs, layers)]
        stream = torch.cuda.Stream()
        for s in (torch.cuda.current_stream(), stream):  # build each launch (it may compile or warm Triton up)
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                [fast(x) for x, (*_, fast, _) in zip(xs, layers)]
            torch.cuda.current_stream().wait_stream(s)
        entered = []
        for kernel in (tensor_core._tc_kernel, tensor_core._kslot_kernel, tensor_core._transform_kernel):
            monkeypatch.setattr(kernel, "run", lambda *a, real=kernel.run, **kw: entered.append(real) or real(*a, **kw))
        for _ in range(2):
            poison_allocator(m * 14336)
            got = [fast(x) for x, (*_, fast, _) in zip(xs, layers)]
            for y, e in zip(got, expected):
                assert torch.equal(y.view(torch.int16), e.view(torch.int16))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = [fast(x) for x, (*_, fast, _) in zip(xs, layers)]
        torch.cuda.current_stream().wait_stream(stream)
        for y, e in zip(got, expected):
            assert torch.equal(y.view(torch.int16), e.view(torch.int16))
        assert entered == []
        monkeypatch.undo()
        for _, n, k, _, fast, _ in layers:
            launch = fast.launches[m]
            assert isinstance(launch, tensor_core.TcLaunch) and launch.config == backend().tc_config_for(m, n, k, sms)
            assert launch.prepass.direct and launch.kernel.direct, "Triton's launcher was not recognised"
    tensors, n, k, t, fast, generic = layers[1]
    x = torch.randn(64, k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(assert_graph_replays_eager(fast, x), generic(x))
    gemv = dispatch.Prepared(**tensors, n=n, k=k)
    x = torch.randn(4, k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(gemv(x), backend().linear(x, **tensors, n=n, k=k)) and gemv.launches[4].launch.direct


def test_tensor_core_rejects_a_single_stage() -> None:
    """The loader refills a slot only after the consumers released it, one step later: one slot would deadlock."""
    tensors = runtime_on_gpu(random_weight(64, 256, seed=5))
    x = torch.randn(32, 256, dtype=torch.bfloat16, device="cuda")
    b = backend()
    with pytest.raises(ValueError, match="at least 2 pipeline stages"):
        b.tc_linear(x, **tensors, n=64, k=256, config=b.TcConfig(64, 1, 1, 2))


def test_kslot_activations_matches_the_reference_and_zeroes_counters() -> None:
    b = backend()
    for m, k in ((1, 4096), (37, 336), (300, 2064)):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        counters = torch.full((1500,), 7, dtype=torch.int32, device="cuda")
        kp = sm90.padded_shape(16, k)[1]
        assert torch.equal(b.kslot_activations(x, kp, counters), b.kslot_order(x, kp))
        assert not counters.any()


@pytest.mark.parametrize("n,k", [(208, 1040), (272, 2048)])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize(
    "config",
    [(1, 1, 4, 0), (1, 2, 8, 0), (1, 4, 4, 96), (1, 2, 4, 96), (2, 2, 4, 128), (4, 1, 4, 0), (1, 8, 4, 168),
     (1, 4, 8, 64), (1, 2, 8, 80)],
)  # fmt: skip
def test_gemv_every_split_and_m_writes_all(n: int, k: int, m: int, config: tuple) -> None:
    """Decode kernel: M on both sides of the 8-row n-tile; K not a multiple of 64 nor of the step (208 x 1040, 17
    chunks) and both (272 x 2048, 32 chunks: the unmasked ``EVEN`` specialisation)."""
    weight = random_weight(n, k, seed=m * 7 + sum(config) + k)
    tensors = runtime_on_gpu(weight)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = backend()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = b.gemv_linear(x, **tensors, n=n, k=k, config=b.GemvConfig(*config), out=out)
    assert y.data_ptr() == out.data_ptr()
    check(y, x, dequantize(weight).cuda())


def test_dequantize_matches_reference() -> None:
    n, k = 1040, 4096
    weight = random_weight(n, k, seed=11)
    tensors = runtime_on_gpu(weight)
    w = backend().dequantize(**tensors, n=n, k=k)
    assert w.dtype == torch.bfloat16 and tuple(w.shape) == (n, k)
    # one bf16 rounding of e2m1 * scale * multiplier (the float32 product may round once before it)
    torch.testing.assert_close(w.double(), dequantize(weight).cuda(), rtol=2**-8, atol=0)


def assert_graph_replays_eager(call, x: torch.Tensor) -> torch.Tensor:
    """``call(x)`` captured in a CUDA graph (after a warm-up on a side stream) rewrites its eager result bit for bit
    on every replay; returns that result."""
    eager = call(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(x)
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    return eager


@pytest.mark.parametrize("m", [1, 16, 64, 1024])
def test_cuda_graph_replay_matches_eager(m: int) -> None:
    n, k = 4096, 4096
    tensors, _ = random_runtime(n, k, seed=m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = backend()
    assert_graph_replays_eager(lambda v: b.linear(v, **tensors, n=n, k=k), x)


def assert_pdl_chain(layer, weights: list[NVFP4Weight], x: torch.Tensor, transform: torch.Tensor | None = None) -> None:
    """``layer(x, tensors, pdl)`` over three layers, each reading the previous one's output, a torch kernel writing
    the activations after the first, in one CUDA graph: each GEMM kernel launches with PDL while the pre-pass before
    it runs, so a read of activations (or a write of outputs or counters) before its dependency wait would show.
    Bitwise equal to the same chain in plain stream order, and within bf16 bounds of float64 (``transform``: each
    layer's input transform)."""
    layers = [runtime_on_gpu(w) for w in weights]

    def chain(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
        for i, tensors in enumerate(layers):
            x = layer(x, tensors, pdl)
            if i == 0:
                x = x.mul_(0.5)
        return x

    expected = chain(x, pdl=False)
    chain(x)  # compile the PDL launch outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)
    ref = x.double()
    for i, w in enumerate(weights):
        ref = blockdiag64(ref, transform) if transform is not None else ref
        ref = ref @ dequantize(w).cuda().T * (0.5 if i == 0 else 1.0)
    assert rel_err(captured, ref) < 3 * REL_TOL


@pytest.mark.parametrize("m", [1, 9, 40, 300])
def test_pdl_chain_reads_each_previous_kernels_output(m: int) -> None:
    """Three tensor-core layers (``assert_pdl_chain``): each launches with PDL while its k-slot pass runs."""
    b = backend()
    n = k = 1040
    config = b.tc_config_for(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    weights = [random_weight(n, k, seed=41 + i) for i in range(3)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    assert_pdl_chain(lambda v, tensors, pdl: b.tc_linear(v, **tensors, n=n, k=k, config=config, pdl=pdl), weights, x)


def test_rejects_wrong_operands() -> None:
    n, k = 48, 80
    tensors = runtime_on_gpu(random_weight(n, k, seed=2))
    x = torch.randn(3, k, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="bf16"):
        backend().linear(x, **tensors, n=n, k=k)


def random_orthogonal(b: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A dense random orthogonal ``[b, b]`` (no Hadamard structure for the kernels to lean on), rounded to ``dtype``."""
    q, _ = torch.linalg.qr(torch.randn(b, b, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    return q.to(dtype).contiguous().cuda()  # QR's Q is column-major


def blockdiag64(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ blockdiag(matrix, ...)`` in float64 via torch.block_diag (not the kernels' or the runtime's reshape)."""
    return x.double() @ torch.block_diag(*[matrix.double()] * (x.shape[1] // matrix.shape[0]))


# (N, K): narrow (the decode kernel to M = 16), K not a multiple of 64 (1040) or of 256 (2112); wide (the
# tensor-core kernel from M = 9)
TRANSFORM_SHAPES = [(208, 1040, 16), (1040, 2112, 64), (4096, 2048, 16), (4096, 2048, 32), (8192, 2048, 128),
                    (1040, 4096, 128)]  # fmt: skip


@pytest.mark.parametrize("n,k,block", TRANSFORM_SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16, 33, 128])
def test_fused_input_transform_matches_float64(n: int, k: int, block: int, m: int) -> None:
    """``linear(x, transform=T)`` = ``(x @ blockdiag(T)) @ W^T`` for a dense random orthogonal T on every path
    (the pre-pass then the PDL decode kernel, or the tensor-core kernel's k-slot pass), every output written."""
    tensors, w64 = random_runtime(n, k, seed=n + k + block + m)
    t = random_orthogonal(block, seed=block + m, dtype=torch.float32 if m == 5 else torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    poison_allocator(m * n)
    y = backend().linear(x, **tensors, n=n, k=k, transform=t)
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = rel_err(y, blockdiag64(x, t.to(torch.bfloat16)) @ w64.T)  # the kernels round T to bf16
    assert err < REL_TOL, f"relative error {err:.3e}"


def test_prepass_transform_and_kslot_order() -> None:
    """The pre-pass alone: ``x @ blockdiag(T)`` within bf16 rounding of float64 (each block size, K not a multiple
    of 256), and the k-slot variant exactly its k-slot permutation, zeroing the counters too."""
    b = backend()
    for m, k, block in ((1, 4096, 16), (37, 336, 16), (300, 2112, 64), (8, 1152, 128), (3, 2048, 32)):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        t = random_orthogonal(block, seed=m + k)
        got = b.transformed_activations(x, t)
        assert rel_err(got, blockdiag64(x, t)) < 4e-3
        counters = torch.full((700,), 7, dtype=torch.int32, device="cuda")
        kp = sm90.padded_shape(16, k)[1]
        assert torch.equal(b.kslot_activations(x, kp, counters, t), b.kslot_order(got, kp))
        assert not counters.any()


@pytest.mark.parametrize("m", [1, 8, 16])
def test_pdl_decode_chain_reads_each_previous_kernels_output(m: int) -> None:
    """Three transformed decode-kernel layers (``assert_pdl_chain``): each launches with PDL while its transform
    pre-pass runs, loading its first weights meanwhile."""
    b = backend()
    n = k = 2048
    config = b.gemv_config_for(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    weights = [random_weight(n, k, seed=61 + i) for i in range(3)]
    t = random_orthogonal(64, seed=m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")

    def layer(v: torch.Tensor, tensors: dict[str, torch.Tensor], pdl: bool) -> torch.Tensor:
        return b.gemv_linear(b.transformed_activations(v, t), **tensors, n=n, k=k, config=config, pdl=pdl)

    assert_pdl_chain(layer, weights, x, t)


def test_rejects_a_transform_it_does_not_fuse() -> None:
    n, k = 48, 96
    tensors = runtime_on_gpu(random_weight(n, k, seed=3))
    x = torch.randn(2, k, dtype=torch.bfloat16, device="cuda")
    for bad in (torch.eye(8, device="cuda"), torch.eye(96, device="cuda"), torch.eye(64, device="cuda"),
                torch.eye(32, device="cpu")):  # fmt: skip
        with pytest.raises(ValueError, match="transform"):
            backend().linear(x, **tensors, n=n, k=k, transform=bad)


def walsh_matrix(block: int, kind: str, seed: int) -> torch.Tensor:
    """A Hadamard-type T in bf16: Sylvester's H / sqrt(b) (``hadamard``), with random signs on its rows
    (``random-hadamard``: diag(Q) H, compressed-tensors' construction) or on its columns (``inverse``: its T^T)."""
    h = sylvester(block) / block**0.5
    signs = torch.randint(0, 2, (block,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    t = {"hadamard": h, "random-hadamard": signs[:, None] * h, "inverse": h * signs[None, :]}[kind]
    return t.to(torch.bfloat16).cuda()


# (block, K): K an odd multiple of the block, not of 256 (the layout pads K to 256, the kernel masks it)
WALSH_SHAPES = [(16, 1040), (32, 1056), (64, 1088), (128, 1152), (128, 4224)]


@pytest.mark.parametrize("block,k", WALSH_SHAPES)
@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard", "inverse"])
def test_walsh_in_the_decode_kernel_matches_float64(block: int, k: int, kind: str) -> None:
    """``gemv_linear(x, walsh=walsh_factors(T))`` = ``(x @ blockdiag(T)) @ W^T`` in float64 for M = 1 .. 8 (its
    limit: one n-tile) and an odd N, every output written (the last block of K ends inside a 64-column chunk for
    blocks of 16 and 32: what lies past it must not leak in), with the 8- and the 4-warp split.
    Tolerance: REL_TOL, as for the pre-pass; the kernel rounds x @ H to bf16 once (before the scale, which it
    applies with the output's) where the pre-pass rounds x @ T, one bf16 rounding apart (2**-9 relative)."""
    b = backend()
    n = 1037
    t = walsh_matrix(block, kind, seed=block)  # one kernel per block and kind: the shapes share it
    walsh = walsh_factors(t)
    assert walsh is not None and walsh.block == block
    weight = random_weight(n, k, seed=block + k)
    tensors, w64 = runtime_on_gpu(weight), dequantize(weight).cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, config in [(m, b.gemv_config_for(m, n, k, sms)) for m in (1, 2, 5, 8)] + [(3, b.GemvConfig(1, 4, 4, 96))]:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        poison_allocator(m * k + 4096)
        x = x.clone()  # into the NaN block the allocator reuses: what follows x is NaN
        poison_allocator(m * n)
        y = b.gemv_linear(x, **tensors, n=n, k=k, config=config, walsh=walsh)
        assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite output"
        err = rel_err(y, blockdiag64(x, t) @ w64.T)
        assert err < REL_TOL, f"M={m} {config}: relative error {err:.3e}"


@pytest.mark.parametrize("m", [1, 2, 8])
def test_walsh_dispatch_and_capture(m: int, monkeypatch) -> None:
    """``linear`` and ``prepare`` with Walsh factors run the transform inside the decode kernel at M = 1 (the
    pre-pass never runs) and in the pre-pass above (``walsh_in_kernel``, from the H200 measurements), within bf16
    bounds of float64 and replaying in a CUDA graph bit for bit; a dense T with the same shape takes the pre-pass;
    the in-kernel transform refuses more than 8 rows."""
    b = backend()
    n, k = 2048, 2048  # narrow: the decode kernel to M = 16
    t = walsh_matrix(64, "random-hadamard", seed=m)
    walsh = walsh_factors(t)
    tensors, w64 = random_runtime(n, k, seed=m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    ref = blockdiag64(x, t) @ w64.T
    from repack.runtime.backends.triton_sm90 import dispatch

    prepasses = []
    prepass = dispatch.transformed_activations
    monkeypatch.setattr(dispatch, "transformed_activations", lambda *a: prepasses.append(1) or prepass(*a))
    prepared = b.prepare(**tensors, n=n, k=k, transform=t, walsh=walsh)
    for call in (lambda v: b.linear(v, **tensors, n=n, k=k, transform=t, walsh=walsh), prepared):
        assert rel_err(assert_graph_replays_eager(call, x), ref) < REL_TOL
    assert bool(prepasses) == (m > 1)
    prepasses.clear()
    b.linear(x, **tensors, n=n, k=k, transform=random_orthogonal(64, seed=m))
    assert prepasses
    with pytest.raises(ValueError, match="M <= 8"):
        b.gemv_linear(torch.randn(9, k, dtype=torch.bfloat16, device="cuda"), **tensors, n=n, k=k,
                      config=b.gemv_config_for(9, n, k, 132), walsh=walsh)  # fmt: skip
