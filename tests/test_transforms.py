"""Online transforms (QuIP / SpinQuant): read, convert, run and verify the checkpoints llm-compressor writes.

References, independent of the code under test where it matters:
(a) the dequantized weights with the source's float64 matrices applied around each layer (float32 model);
(b) the checkpoint as compressed-tensors' own code runs it: transformers decompresses the weights,
    ``apply_transform_config`` attaches compressed-tensors' transform modules (online entries only: the
    weight-side ones are already in the weights) and the checkpoint's stored matrices are loaded into them.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from repack.formats.hashing import file_hexdigest, new_digest
from repack.bundle.reader import open_bundle
from repack.convert import convert
from repack.errors import RepackError
from repack.formats import read_source
from repack.formats.safetensors_io import tensor_bytes
from repack.formats.transforms import load_matrix
from repack.nvfp4 import dequantize
from repack.runtime import load_bundle, nvfp4_linear, patch_model
from repack.runtime.layer import PackedLinear
from repack.sample import SAMPLE_DIR
from repack.runtime.backends import fuses_input_transform, prepare_backend
from repack.runtime.transforms import WalshFactors, block_transform, rows_transform, walsh_factors
from repack.runtime.transforms import sylvester as runtime_sylvester
from repack.targets import TARGETS
from repack.verify import verify_bundle

from .conftest import PRODUCERS, REFUSED_FIXTURES, TRANSFORM_FIXTURES, require
from .vllm.variants import output_variant
from .test_runtime import BF16_REL_TOL, dequantized_llama, rel_error

MODEL_REL_TOL = 3e-2  # bf16 activations through a whole model (as test_runtime's whole-model test)
TOKENS = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))


def sylvester(size: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def blockdiag64(value: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``value @ blockdiag(matrix, ...)`` in float64, written out with torch.block_diag (not the runtime's reshape)."""
    blocks = value.shape[-1] // matrix.shape[0]
    return value.to(torch.float64) @ torch.block_diag(*[matrix] * blocks)


# --------------------------------------------------------------------------- the producers' checkpoints
def test_fixtures_cover_every_dimension():
    """QuIP v and v+u, hadamard and random-hadamard, blocks 16/32/64, SpinQuant R4 (block 16 and whole K),
    NVFP4A16 and NVFP4: each dimension the issue names is covered by at least one fixture."""
    algos, seen = set(), set()
    for fixture in TRANSFORM_FIXTURES:
        source = read_source(PRODUCERS / fixture)
        algos.add(source.quant_algo)
        seen |= {(t.matrix.scheme, t.matrix.type, t.location, t.matrix.size)
                 for transforms in source.transforms.layers.values() for t in transforms}
    assert algos == {"NVFP4", "NVFP4A16"}
    for kind in ("hadamard", "random-hadamard"):
        assert {size for (s, k, loc, size) in seen if (s, k, loc) == ("v", kind, "input")} >= {16, 32}
        assert any((s, k, loc) == ("u", kind, "output") for (s, k, loc, _) in seen)
        assert any((s, k) == ("R4", kind) for (s, k, _, _) in seen)
    assert {("v", "hadamard", "input", 64), ("R4", "random-hadamard", "input", 176)} <= seen


@functools.cache
def compressed_tensors_model(fixture: str):
    """The checkpoint run by compressed-tensors itself (weights decompressed, activations not quantized)."""
    require("compressed_tensors")
    import transformers
    from compressed_tensors.quantization import disable_quantization
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from compressed_tensors.transform.factory.base import TransformBase

    path = PRODUCERS / fixture
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
    model.apply(disable_quantization)  # weight-only serving: the bundle does not quantize activations
    model = model.float().eval()
    config = json.loads((path / "config.json").read_text())["quantization_config"]["transform_config"]
    for scheme in config["config_groups"].values():
        scheme["apply"] = [a for a in scheme["apply"] if a["location"] in ("input", "output")]
    apply_transform_config(model, TransformConfig.model_validate(config))
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    stored = {k: v for k, v in load_file(path / "model.safetensors").items() if k in params and (
        any(isinstance(m, TransformBase) for m in [model.get_submodule(k.rsplit(".", 1)[0])]))}
    with torch.no_grad():
        for name, value in stored.items():  # a shared matrix is one Parameter: loading it once serves all
            params[name].copy_(value)
    online = {name: m.weight.shape[0] for name, m in model.named_modules() if isinstance(m, TransformBase)}
    return model, online, set(stored)


def transformed_reference(fixture: str) -> nn.Module:
    """(a): float32 dequantized weights, the source's float64 matrices applied around each layer by hooks."""
    model = dequantized_llama(fixture).float()
    source = read_source(PRODUCERS / fixture)
    for prefix, transforms in source.transforms.layers.items():
        module = model.get_submodule(prefix)
        for t in transforms:
            matrix = load_matrix(source.checkpoint, t.matrix) / t.matrix.scale
            apply = functools.partial(lambda m, v: blockdiag64(v, m).to(v.dtype), matrix)
            if t.location == "input":
                module.register_forward_pre_hook(lambda mod, args, f=apply: (f(args[0]),))
            else:
                module.register_forward_hook(lambda mod, args, out, f=apply: f(out))
    return model


@functools.cache
def reference_logits(fixture: str, which: str) -> torch.Tensor:
    model = compressed_tensors_model(fixture)[0] if which == "compressed-tensors" else transformed_reference(fixture)
    with torch.no_grad():
        return model(TOKENS).logits.double()


@pytest.mark.parametrize("fixture", TRANSFORM_FIXTURES)
def test_sharing_is_resolved_as_compressed_tensors_does(fixture):
    """Per layer, the same online transforms (scheme, location, block) as compressed-tensors attaches; the one
    stored copy of each matrix is the one its tied modules load."""
    _, online, stored = compressed_tensors_model(fixture)
    source = read_source(PRODUCERS / fixture)
    ours = {f"{prefix}.{t.matrix.scheme}_{t.location}": t.matrix.size
            for prefix, ts in source.transforms.layers.items() for t in ts}
    assert ours == online
    assert {m.weight for m in source.transforms.matrices.values()} == stored
    assert not set(source.passthrough) & stored, "matrices move out of passthrough into the bundle's transforms"


@pytest.mark.parametrize("target", [t.name for t in TARGETS])
@pytest.mark.parametrize("fixture", TRANSFORM_FIXTURES)
def test_patched_model_matches_both_references(tmp_path, fixture, target):
    """Weight-only bundles (W4A4 checkpoints too: the references keep activations unquantized; W4A4 bundles of
    rotated checkpoints are checked by verify's fake-quant reference, test_w4a4_rotated_bundles_...)."""
    out = tmp_path / "bundle"
    # vLLM 0.33 serves sm100's rotated weight-only layers (QuTLASS on FlashInfer), 0.34 sm120's (Marlin: engines.py)
    convert(PRODUCERS / fixture, target, out, weight_only=True, vllm="0.34" if target == "sm120" else "0.33")
    manifest = open_bundle(out).manifest
    source = read_source(PRODUCERS / fixture)
    assert set(manifest.transforms) == set(source.transforms.matrices), "each distinct matrix stored once"
    assert {rec.tensor.dtype for rec in manifest.transforms.values()} == {"BF16"}, "the model's dtype"
    report = verify_bundle(out, seed=0)
    assert report.passed, [e for c in report.failures for e in c.errors]
    assert len(report.transforms) == len(manifest.transforms)
    patched = dequantized_llama(fixture).to(torch.bfloat16)
    patch_model(patched, out)
    with torch.no_grad():
        got = patched(TOKENS).logits.double()
    for which in ("float reference", "compressed-tensors"):
        ref = reference_logits(fixture, which)
        assert rel_error(got, ref) < MODEL_REL_TOL, (which, rel_error(got, ref))
    untransformed = dequantized_llama(fixture).float()
    with torch.no_grad():
        wrong = untransformed(TOKENS).logits.double()
    assert rel_error(wrong, reference_logits(fixture, "float reference")) > 0.2, "the transforms matter"


@pytest.mark.parametrize("fixture", ["ct_quip_vu_had32_nvfp4", "ct_spinquant_r1r2r4_rhad_nvfp4a16"])
def test_fused_bundle_runs_the_checkpoints_function(tmp_path, fixture):
    """--fuse: each fused module carries its partitions' one input (and output) transform; patch_model runs the
    fused bundle as the float reference computes (vLLM's state: tests/test_vllm_conformance.py)."""
    out = tmp_path / "bundle"
    convert(PRODUCERS / fixture, "sm120", out, fuse=True, weight_only=True, vllm="0.34")  # the reference's bf16 activations
    manifest = open_bundle(out).manifest
    source = read_source(PRODUCERS / fixture)
    for prefix, record in manifest.layers.items():
        own = {(t.location, t.matrix.name)
               for p in record.partitions for t in source.transforms.layers.get(p.source, ())}
        assert {(t.location, t.matrix) for t in record.transforms} == own, prefix
    assert verify_bundle(out, seed=0).passed
    patched = dequantized_llama(fixture).to(torch.bfloat16)
    patch_model(patched, out)
    with torch.no_grad():
        got = patched(TOKENS).logits.double()
    assert rel_error(got, reference_logits(fixture, "float reference")) < MODEL_REL_TOL


@pytest.mark.parametrize("weight_only", [True, False], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize("variant,parts", [("partial-output", [[0, 2]]), ("whole-n-output", [[0], [1, 2]])])
def test_output_transforms_per_partition_of_a_fused_module(tmp_path, monkeypatch, variant, parts, weight_only):
    """--fuse keeps per-partition output transforms as vLLM holds them (byte conformance: test_vllm_conformance):
    on q and v only, or whole-N, one matrix per partition size; the runtime rotates each partition's rows with its
    own matrix, which verify's float64 reference (the source's function) holds it to: skipping them fails."""
    source = output_variant(tmp_path / "source", variant)
    out = tmp_path / "bundle"
    convert(source, "sm120", out, fuse=True, weight_only=weight_only, vllm="0.34" if weight_only else "0.33")
    record = open_bundle(out).manifest.layers["model.layers.0.self_attn.qkv_proj"]
    assert [t.partitions for t in record.transforms if t.location == "output"] == parts
    seed = int(torch.randint(0, 2**31, ()))
    assert verify_bundle(out, seed=seed, numerics="all").passed, f"seed {seed}"
    monkeypatch.setattr(PackedLinear, "output_parts", property(lambda self: []))
    failed = {c.name for c in verify_bundle(out, seed=seed, numerics="all").layers if c.status == "fail"}
    assert failed == {f"model.layers.{i}.self_attn.qkv_proj" for i in (0, 1)}, f"seed {seed}"


def test_rows_transform_rotates_each_range_with_its_own_matrix():
    """Ranges given in any order, gaps left as they are; each range block-diagonal in its own matrix."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    value = torch.randn(3, 40, generator=gen, dtype=torch.float64)
    a, b = torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randn(4, 4, generator=gen, dtype=torch.float64)
    expected = value.clone()
    expected[:, :8], expected[:, 8:16] = value[:, :8] @ a, value[:, 8:16] @ a
    expected[:, 24:28], expected[:, 28:32] = value[:, 24:28] @ b, value[:, 28:32] @ b
    assert torch.allclose(rows_transform(value, [(24, 32, b), (0, 16, a)]), expected, rtol=1e-12, atol=1e-12)


def test_manifest_says_which_transforms_have_no_block_size(tmp_path):
    """``whole`` (no head_dim: it decides vLLM's QuTLASS route) is recorded, and verify holds it to the source."""
    out = tmp_path / "bundle"
    convert(PRODUCERS / "ct_spinquant_r1r2r4_rhad_nvfp4a16", "sm100", out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {name: rec["whole"] for name, rec in manifest["transforms"].items()} == {
        "model.layers.0.mlp.down_proj.R4_input.weight": True}
    manifest["transforms"]["model.layers.0.mlp.down_proj.R4_input.weight"]["whole"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    report = verify_bundle(out, seed=0)
    assert [c.name for c in report.transforms if c.status == "fail"] == ["model.layers.0.mlp.down_proj.R4_input.weight"]


def test_overlapping_output_transforms_are_refused(tmp_path):
    out = tmp_path / "bundle"
    convert(output_variant(tmp_path / "source", "whole-n-output"), "sm100", out, fuse=True, vllm="0.33")
    manifest = json.loads((out / "manifest.json").read_text())
    outputs = [t for t in manifest["layers"]["model.layers.0.self_attn.qkv_proj"]["transforms"]
               if t["location"] == "output"]
    outputs[1]["partitions"] = [0, 2]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RepackError, match="qkv_proj: its online transforms overlap"):
        open_bundle(out)


@pytest.mark.parametrize("fixture", TRANSFORM_FIXTURES)
def test_dense_weight_folds_the_online_transforms(fixture):
    """``SourceModel.dense_weight``, the docs' reference model for a checkpoint with online transforms: a dense
    model holding it computes what the hook-based float reference and compressed-tensors' own model compute."""
    source = read_source(PRODUCERS / fixture)
    model = dequantized_llama(fixture).float()
    state = model.state_dict()
    with torch.no_grad():
        for prefix in source.layers:
            state[f"{prefix}.weight"].copy_(source.dense_weight(prefix))
        got = model(TOKENS).logits.double()
    assert rel_error(got, reference_logits(fixture, "float reference")) < 1e-5
    assert rel_error(got, reference_logits(fixture, "compressed-tensors")) < MODEL_REL_TOL
    plain = read_source(SAMPLE_DIR)  # no online transforms: the dequantized weight as it is
    for prefix, layer in plain.layers.items():
        assert torch.equal(plain.dense_weight(prefix), dequantize(plain.load_layer(layer), torch.float32))


def test_stored_matrix_is_the_normalized_source_matrix(tmp_path):
    """Hadamard scale fusion: the bundle holds bf16(H / sqrt(b)), H read back with the real safetensors library."""
    fixture = "ct_quip_vu_had32_nvfp4"
    convert(PRODUCERS / fixture, "sm100", tmp_path / "b", vllm="0.33")
    bundle = load_file(tmp_path / "b" / "model.safetensors")
    source = load_file(PRODUCERS / fixture / "model.safetensors")
    v = "model.layers.0.self_attn.q_proj.v_input.weight"
    assert torch.equal(bundle[v], (source[v] / math.sqrt(32)).to(torch.bfloat16))
    u = "model.layers.0.self_attn.q_proj.u_output.weight"  # QuIP's u is applied inverted: the transpose
    assert torch.equal(bundle[u + ".T"], (source[u].t() / math.sqrt(32)).to(torch.bfloat16))
    assert torch.equal(source[v], sylvester(32)), "llm-compressor's deterministic hadamard is Sylvester's"


@pytest.mark.parametrize("fixture", sorted(REFUSED_FIXTURES))
def test_refused_producer_checkpoints(tmp_path, fixture):
    with pytest.raises(RepackError, match=REFUSED_FIXTURES[fixture]):
        convert(PRODUCERS / fixture, "sm100", tmp_path / "b")
    assert not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- dtypes (issue item 6)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fixture", ["ct_nvfp4a16", "ct_quip_vu_rhad16_nvfp4"])
def test_models_of_every_dtype_run_and_match(tmp_path, fixture, dtype):
    out = tmp_path / "bundle"
    convert(PRODUCERS / fixture, "sm120", out, weight_only=True, vllm="0.34")  # the reference's unquantized activations
    patched = dequantized_llama(fixture).to(dtype)
    patch_model(patched, out)
    with torch.no_grad():
        logits = patched(TOKENS).logits
    assert logits.dtype == dtype
    ref = transformed_reference(fixture)
    with torch.no_grad():
        expected = ref(TOKENS).logits.double()
    assert rel_error(logits, expected) < MODEL_REL_TOL


def test_op_returns_the_input_dtype(tmp_path):
    out = tmp_path / "bundle"
    convert(PRODUCERS / "ct_quip_vu_had32_nvfp4", "sm90", out)
    loaded = load_bundle(out)
    prefix = "model.layers.1.self_attn.q_proj"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        layer = loaded.layer(prefix, dtype=dtype)
        assert layer.input_transform.dtype == dtype
        x = torch.randn(3, 5, layer.k).to(dtype)
        y = nvfp4_linear(x, layer)
        assert y.dtype == dtype and y.shape == (3, 5, layer.n)


# --------------------------------------------------------------------------- synthetic checkpoints
def add_transforms(model, groups: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Give a synthetic compressed-tensors checkpoint a transform_config and transform tensors."""
    config = json.loads((model.path / "config.json").read_text())
    config["quantization_config"]["transform_config"] = {"config_groups": groups}
    (model.path / "config.json").write_text(json.dumps(config))
    path = model.path / "model.safetensors"
    save_file(load_file(path) | tensors, path, metadata={"format": "pt"})


def scheme(location="input", kind="hadamard", head_dim=16, targets=("Linear",), ignore=("lm_head",), **extra
           ) -> dict:
    return {"type": kind, "head_dim": head_dim, "apply": [
        {"targets": list(targets), "location": location, "inverse": extra.pop("inverse", False),
         "ignore": list(ignore)}], **extra}


FIRST = "model.layers.0.mlp.proj"


def test_randomized_hadamard_with_permutation_and_inverse(make_model, tmp_path):
    """compressed-tensors' randomize: T = H[perm][:, perm], transposed for an inverse entry, / sqrt(b)."""
    gen = torch.Generator().manual_seed(7)
    model = make_model(shapes=[(48, 80), (32, 64)], seed=7)
    signs = torch.diag(torch.randint(0, 2, (16,), generator=gen).double() * 2 - 1)
    h, perm = sylvester(16) @ signs, torch.randperm(16, generator=gen)
    add_transforms(model, {"v": scheme(randomize=True), "u": scheme("output", inverse=True, randomize=True)}, {
        f"{FIRST}.v_input.weight": h, f"{FIRST}.v_input.perm": perm,
        f"{FIRST}.u_output.weight": h.t().contiguous(), f"{FIRST}.u_output.perm": perm.flip(0)})
    out = tmp_path / "bundle"
    convert(model.path, "sm100", out)
    assert verify_bundle(out, seed=1).passed
    loaded = load_bundle(out)
    t_in = h[perm][:, perm] / 4
    t_out = h.t()[perm.flip(0)][:, perm.flip(0)].t() / 4
    for prefix, weight in model.layers.items():
        x = torch.randn(5, weight.k, generator=gen).to(torch.bfloat16)
        ref = blockdiag64(blockdiag64(x, t_in) @ dequantize(weight).t(), t_out)
        assert rel_error(loaded.layer(prefix)(x), ref) < BF16_REL_TOL, prefix


def test_synthetic_quip_checkpoint_is_what_the_producer_writes(tmp_path):
    """``vllm_gpu.add_input_hadamard`` (the rotated model of the GPU tests and the serving benchmark): the config
    group of llm-compressor's ``ct_quip_v_had16_nvfp4a16`` with another block, an input transform on every decoder
    linear, which ``dense_weight`` folds in as ``W @ blockdiag(H / sqrt(b))`` (float64, written out)."""
    from .vllm_gpu import TINY, add_input_hadamard, write_shaped_llama

    source = write_shaped_llama(tmp_path / "source", TINY, 1, 64, torch.Generator().manual_seed(3), 128)
    add_input_hadamard(source, 64)

    def group(folder):
        return json.loads((folder / "config.json").read_text())["quantization_config"]["transform_config"]

    assert group(source) == {"config_groups": {"v": group(PRODUCERS / "ct_quip_v_had16_nvfp4a16")["config_groups"]["v"]
                                                     | {"head_dim": 64}}}  # fmt: skip
    model = read_source(source)
    assert sorted(model.transforms.layers) == sorted(model.layers) and len(model.layers) == 7
    for prefix, layer in model.layers.items():
        want = blockdiag64(dequantize(model.load_layer(layer), torch.float64), sylvester(64) / 8)
        assert torch.allclose(model.dense_weight(prefix, torch.float64), want, rtol=1e-12, atol=1e-15), prefix


@pytest.mark.parametrize("groups, tensors, message", [
    ({"R3": scheme("q_attn")}, {}, "transform scheme 'R3': location 'q_attn' is not supported"),
    ({"R3": scheme("k_cache")}, {}, "transform scheme 'R3': location 'k_cache' is not supported"),
    ({"v": scheme(kind="fourier")}, {}, "type 'fourier' is not supported"),
    ({"v": scheme(requires_grad=True)}, {}, "learnable transforms"),
    ({"v": scheme(precision="torch.float64", extra_key=1)}, {}, "unknown key 'extra_key'"),
    ({"v": scheme()}, {}, f"matrix {FIRST}.v_input.weight of transform scheme 'v' is missing"),
    ({"v": scheme()}, {f"{FIRST}.v_input.weight": sylvester(16).index_put((torch.tensor([2]), torch.tensor([5])),
                                                                          torch.zeros(1, dtype=torch.float64))},
     "not orthogonal"),
    ({"v": scheme()}, {f"{FIRST}.v_input.weight": sylvester(16).index_fill(0, torch.tensor([3]), float("nan"))},
     "non-finite"),
    ({"v": scheme()}, {f"{FIRST}.v_input.weight": sylvester(32)}, r"must be a float \[16, 16\]"),
    ({"v": scheme(head_dim=32)}, {f"{FIRST}.v_input.weight": sylvester(32)}, "block size 32 does not divide K=80"),
    ({"v": scheme(targets=["lm_head"], ignore=())}, {}, "'lm_head', which is not an NVFP4-quantized layer"),
    ({"v": scheme(targets=["LlamaMLP"])}, {}, "target 'LlamaMLP' names no module"),
    ({"v": scheme(kind="random-matrix")}, {f"{FIRST}.v_input.weight": torch.rand(16, 16, dtype=torch.float64)},
     "condition number"),
])
def test_unsupported_or_broken_transforms_are_refused(make_model, tmp_path, groups, tensors, message):
    model = make_model(shapes=[(48, 80), (32, 64)])
    add_transforms(model, groups, tensors)
    with pytest.raises(RepackError, match=message):
        convert(model.path, "sm90", tmp_path / "b")
    assert not (tmp_path / "b").exists()


def paley(q: int) -> torch.Tensor:
    """A Hadamard matrix of order q + 1 (Paley's first construction, q a prime = 3 mod 4): not Sylvester's."""
    i = torch.arange(q)
    squares = set(((i * i) % q).tolist()) - {0}
    diff = (i[None, :] - i[:, None]) % q
    jacobsthal = torch.tensor([[0.0 if d == 0 else (1.0 if d in squares else -1.0) for d in row]
                               for row in diff.tolist()])
    core = torch.cat([torch.cat([torch.zeros(1, 1), torch.ones(1, q)], 1),
                      torch.cat([-torch.ones(q, 1), jacobsthal], 1)])
    return (torch.eye(q + 1) + core).double()


def test_matrix_is_cast_then_divided_as_vllm_does(make_model, tmp_path):
    """vLLM 0.33's HadamardTransform loads the +-1 matrix in the model dtype, then divides it in place by sqrt(b):
    a bundle stores those bytes. In bf16 and fp16 that is the rounded float64 quotient for every b <= 4096; in a
    float32 model not for every b, e.g. 24."""
    ones = torch.ones(1, dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float16):
        assert all(torch.equal((ones / math.sqrt(b)).to(dtype), ones.to(dtype).div_(math.sqrt(b)))
                   for b in range(1, 4097))
    model = make_model(shapes=[(48, 96)])
    h = paley(23)
    assert torch.equal(h @ h.t(), 24 * torch.eye(24, dtype=torch.float64))
    add_transforms(model, {"v": scheme(head_dim=24)}, {f"{FIRST}.v_input.weight": h})
    config = json.loads((model.path / "config.json").read_text())
    (model.path / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}))
    convert(model.path, "sm100", tmp_path / "b")
    stored = load_file(tmp_path / "b" / "model.safetensors")[f"{FIRST}.v_input.weight"]
    assert torch.equal(stored, h.float().div_(math.sqrt(24)))
    assert not torch.equal(stored, (h / math.sqrt(24)).float()), "24 is a size where the two differ"
    assert verify_bundle(tmp_path / "b", seed=0).passed


def test_weight_side_transforms_need_nothing_at_run_time(make_model, tmp_path):
    model = make_model(shapes=[(48, 80)])
    add_transforms(model, {"R1": scheme("weight_output"), "R2": scheme("weight_input", inverse=True)}, {})
    convert(model.path, "sm100", tmp_path / "b")
    assert open_bundle(tmp_path / "b").manifest.transforms == {}


# --------------------------------------------------------------------------- verify and compile
@pytest.fixture
def transformed_bundle(tmp_path):
    out = tmp_path / "bundle"
    convert(PRODUCERS / "ct_quip_vu_had32_nvfp4", "sm100", out, vllm="0.33")
    return out


def test_altered_matrix_fails_verify(transformed_bundle, capsys):
    from .test_verify import flip_tensor_byte, run_verify

    name = "model.layers.0.self_attn.q_proj.v_input.weight"
    flip_tensor_byte(transformed_bundle, name, offset=1, xor=0x80)  # flip one entry's sign
    code, text = run_verify(transformed_bundle, capsys)
    assert code == 1 and "blake3 digest differs" in text and name in text


def test_altered_matrix_fails_verify_with_a_consistent_manifest(transformed_bundle):
    """A tamperer who rehashes: exactness against the source and the float64 numerics still catch it."""
    name = "model.layers.0.self_attn.q_proj.v_input.weight"
    path = transformed_bundle / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = -tensors[name][0, 0]
    save_file(tensors, path, metadata={"format": "pt"})
    manifest = json.loads((transformed_bundle / "manifest.json").read_text())
    digest = new_digest(manifest["tensor_digest"])
    digest.update(tensor_bytes(tensors[name]))
    manifest["transforms"][name]["tensor"]["digest"] = digest.hexdigest()
    manifest["files"]["model.safetensors"] = file_hexdigest(path, manifest["file_digest"])
    (transformed_bundle / "manifest.json").write_text(json.dumps(manifest))
    report = verify_bundle(transformed_bundle, seed=0, numerics="all")
    assert [c.name for c in report.transforms if c.status == "fail"] == [name]
    users = {p for p, layer in manifest["layers"].items() if any(t["matrix"] == name for t in layer["transforms"])}
    failed = {c.name for c in report.layers if c.status == "fail"}
    assert failed == users and len(users) == 12
    assert all(any("relative error" in e for e in c.errors) for c in report.layers if c.name in users)


def test_dropped_layer_transform_fails_verify(transformed_bundle):
    prefix = "model.layers.1.mlp.down_proj"
    manifest = json.loads((transformed_bundle / "manifest.json").read_text())
    manifest["layers"][prefix]["transforms"] = []
    (transformed_bundle / "manifest.json").write_text(json.dumps(manifest))
    report = verify_bundle(transformed_bundle, seed=0)
    assert [c.name for c in report.failures] == [prefix]
    assert any("online transforms" in e for e in report.failures[0].errors)


def test_compiled_layer_with_transforms(transformed_bundle):
    loaded = load_bundle(transformed_bundle)
    layer = loaded.layer("model.layers.1.self_attn.o_proj")
    assert layer.input_transform is not None and layer.output_transform is not None
    compiled = torch.compile(lambda x: torch.relu(layer(x)) * 2, fullgraph=True)
    for m in (1, 9):
        x = torch.randn(m, layer.k).to(torch.bfloat16)
        assert torch.equal(compiled(x), torch.relu(layer(x)) * 2)


def test_block_transform_is_blockdiag():
    gen = torch.Generator().manual_seed(3)
    matrix = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 3, 40, generator=gen, dtype=torch.float64)
    assert torch.allclose(block_transform(x, matrix), blockdiag64(x, matrix))



def test_only_sm90_fuses_input_transforms_of_its_block_sizes(transformed_bundle):
    """Which input transforms go into a backend's kernels (the sm90 pre-pass: blocks 16 to 128) and which run as
    ``block_transform`` first; a backend that does not fuse refuses to be handed one."""
    eye = torch.eye
    assert [fuses_input_transform("triton", eye(b)) for b in (8, 16, 32, 64, 128, 176, 256)] == [
        False, True, True, True, True, False, False]  # fmt: skip
    assert not fuses_input_transform("triton", torch.ones(16, 32)) and not fuses_input_transform("triton", None)
    assert not any(fuses_input_transform(name, eye(16)) for name in ("reference", "flashinfer"))
    layer = load_bundle(transformed_bundle).layer("model.layers.1.self_attn.o_proj")
    assert layer.backend == "reference" and layer.fused_input_transform is None
    with pytest.raises(RepackError, match="does not fuse"):
        prepare_backend("reference", layer.weight, layer.weight_scale, layer.weight_global_scale, layer.n, layer.k,
                        layer.target, layer.input_transform)  # fmt: skip

# --------------------------------------------------------------------------- Walsh-Hadamard structure (sm90 kernels)
def reproduce(f: WalshFactors, dtype: torch.dtype) -> torch.Tensor:
    """``scale * diag(d1) @ H @ diag(d2)`` with this file's own Sylvester construction, in ``dtype``."""
    d1, d2 = torch.tensor(f.d1, dtype=torch.float64), torch.tensor(f.d2, dtype=torch.float64)
    return (f.scale * d1[:, None] * sylvester(f.block) * d2[None, :]).to(dtype)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_walsh_factors_of_compressed_tensors_matrices(block, dtype):
    """compressed-tensors' own matrices, normalized as a bundle stores them: ``hadamard`` is Sylvester's H (no
    signs); ``random-hadamard`` is diag(Q) @ H (d1 = Q up to one global sign, which goes into the scale) and its
    transpose (``inverse``) H @ diag(Q) (d2 = Q) — except at 32, where compressed-tensors starts from Sloane's known
    32 x 32 matrix, which is no Sylvester matrix up to signs: it is not detected (it keeps the pre-pass). The
    factors reproduce T bit for bit."""
    require("compressed_tensors")
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix, random_hadamard_matrix

    det = (deterministic_hadamard_matrix(block, torch.float64) / math.sqrt(block)).to(dtype)
    f = walsh_factors(det)
    assert f is not None and f.block == block and set(f.d1) == set(f.d2) == {1}
    assert f.scale == float(det[0, 0]) and torch.equal(reproduce(f, dtype), det)
    rnd = random_hadamard_matrix(block, torch.float64, gen=torch.Generator().manual_seed(block)) / math.sqrt(block)
    q = (rnd[:, 0] * math.sqrt(block)).round()  # Q itself: H's first column is all +1
    assert set(q.tolist()) == {1.0, -1.0}
    for t, inverse in ((rnd.to(dtype), False), (rnd.T.contiguous().to(dtype), True)):
        f = walsh_factors(t)
        if block == 32:
            assert f is None
            continue
        assert f is not None and torch.equal(reproduce(f, dtype), t)
        signs = torch.tensor(f.d2 if inverse else f.d1, dtype=torch.float64) * (1 if f.scale > 0 else -1)
        assert torch.equal(signs, q)  # scale * d1 = Q / sqrt(b) (or scale * d2, inverse)
        assert set(f.d1 if inverse else f.d2) == {1}
        assert WalshFactors.from_key(f.key()) == f


def test_walsh_factors_refuse_other_matrices():
    """A dense orthogonal T (compressed-tensors' ``random-matrix`` kind), a Hadamard matrix with one sign flipped or
    one entry scaled, a non-power-of-two order and a non-square matrix are no Walsh-Hadamard transforms."""
    gen = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=torch.float64))
    h = sylvester(32) / math.sqrt(32)
    flipped, scaled = h.clone(), h.clone()
    flipped[3, 5] = -flipped[3, 5]
    scaled[7, 1] *= 1.05
    for t in (q, flipped, scaled, torch.ones(12, 12), torch.ones(16, 32), torch.zeros(16, 16)):
        assert walsh_factors(t.to(torch.bfloat16)) is None
    assert torch.equal(runtime_sylvester(128), sylvester(128))


# --------------------------------------------------------------------------- inspect and the manifest
def test_inspect_shows_transforms(transformed_bundle, capsys):
    from repack.cli import main

    assert main(["inspect", str(PRODUCERS / "ct_quip_vu_had32_nvfp4"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {(t["scheme"], t["type"], t["location"], t["block_size"], len(t["layers"])) for t in info["transforms"]} == {
        ("u", "hadamard", "output", 32, 10), ("v", "hadamard", "input", 32, 12)}
    assert main(["inspect", str(transformed_bundle)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich wraps table cells at the test's terminal width
    assert "2 online-transform matrices, each stored once" in text
    assert "model.layers.0.self_attn.q_proj.u_output.weight.T (BF16 [32]^2, /5.65685)" in text
    assert text.count("QuTLASS") == 12, "the layers with v's input rotation of block 32, a W4A4 bundle"


def test_manifest_refuses_a_layer_transform_without_its_matrix(transformed_bundle):
    manifest = json.loads((transformed_bundle / "manifest.json").read_text())
    del manifest["transforms"]["model.layers.0.self_attn.q_proj.v_input.weight"]
    (transformed_bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RepackError, match="input transform names no matrix"):
        open_bundle(transformed_bundle)


def test_verify_against_a_source_without_those_transforms(transformed_bundle):
    """The wrong --source (one without those transforms) is refused by the source gate, in one line, never a crash."""
    with pytest.raises(RepackError, match="not the source the bundle was built from"):
        verify_bundle(transformed_bundle, source=PRODUCERS / "ct_nvfp4", seed=0)
