"""vLLM itself as the oracle, once per supported version (0.33.0, 0.34.0: the ``vllm_version`` fixture, one venv
each): every fused bundle layer, per tensor-parallel rank, byte-identical to
what vLLM's own DefaultModelLoader + process_weights_after_loading leaves on its layer, and vLLM's
refusals matched by ours: W4A16 bundles against the cute-dsl W4A16 kernel (sm100: ``--weight-only`` for W4A4
checkpoints; sm120: ``--linear-backend flashinfer_cutedsl``, weight-only checkpoints; sm120's default, Marlin:
tests/test_vllm_marlin_conformance.py); W4A4 bundles (the default for W4A4 checkpoints) against the kernel vLLM's
auto picks on sm100 / sm120.

vLLM runs in its own virtualenvs (tests/vllm/make_env.sh; FlashInfer 0.7.2.post1, the project's env has the
newest) through tests/vllm/harness.py, in one process per TP size (two on gloo for TP = 2),
loading every checkpoint in turn. In CI a missing vLLM env fails these tests instead of skipping them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from repack.bundle.reader import open_bundle
from repack.convert import convert
from repack.errors import RepackError
from repack.sample.synthetic import write_llama
from repack.verify import verify_output

from .conftest import PRODUCERS, REFUSED_FIXTURES, TRANSFORM_FIXTURES, assert_held_as, oracle_python, seeded_folder
from .vllm.variants import OUTPUT_VARIANTS, output_variant

HERE = Path(__file__).parent / "vllm"


def vllm_venv(version: str) -> Path:
    """The oracle venv of vLLM ``version``: make_env.sh's $NVFP4_REPACK_VLLM_VENV (0.33) or
    $NVFP4_REPACK_VLLM_VENV_0_34, else .venv-vllm / .venv-vllm-0.34 in the repository."""
    suffix = "" if version == "0.33" else "_" + version.replace(".", "_")
    default = Path(__file__).parent.parent / (".venv-vllm" if version == "0.33" else f".venv-vllm-{version}")
    return Path(os.environ.get(f"NVFP4_REPACK_VLLM_VENV{suffix}", default))


VENV = vllm_venv("0.33")
ARCHS = {"sm100": "sm100", "sm120": "sm120"}  # our target -> the FlashInfer layout the harness emulates
PRODUCER_FIXTURES = ["modelopt_w4a16_nvfp4", "modelopt_nvfp4", "ct_nvfp4a16", "ct_nvfp4"]
# (hidden, heads, kv_heads, intermediate): "odd" has K, N not multiples of 64, N = 16 (one kv head of 16),
# 5 heads (TP = 2 must be refused); "tp" splits over 2 ranks with the single kv head replicated.
SYNTHETIC = {"odd": (80, 5, 1, 48), "tp": (96, 6, 1, 96)}
SYNTHETIC_FORMATS = {"modelopt": False, "compressed-tensors": True}  # format -> W4A4 (one of each)
W4A4_FIXTURES = ["modelopt_nvfp4", "ct_nvfp4"]  # and the synthetic "<shape>-<format>-w4a4", W4A4 in both formats


# Online-transform checkpoints: the producer fixtures, and variants of one that vLLM cannot hold as they mean
# (TRANSFORM_VARIANTS). vLLM refuses every one of them at TP = 2.
TRANSFORM_BASE = "ct_quip_v_had16_nvfp4a16"
TRANSFORM_VARIANTS = ("partial-input", "split-input", "randomized", "orthogonal-matrix")
TRANSFORMED = TRANSFORM_FIXTURES + sorted(REFUSED_FIXTURES) + list(TRANSFORM_VARIANTS) + list(OUTPUT_VARIANTS)
# W4A4 ones, served W4A4 (vLLM's QuTLASS method where every input block is 16..128, else its transform method around
# the W4A4 kernel): the producers' (blocks 16 and 32), "whole-k-w4a4", whose R4 rotation has no block size, and the
# per-partition output transforms of tests/vllm/variants.py.
TRANSFORMED_W4A4 = [f for f in TRANSFORM_FIXTURES if f.endswith("_nvfp4")] + ["whole-k-w4a4", *OUTPUT_VARIANTS]
HUMMING = "HummingNvFP4HadamardLinearMethod"  # vLLM 0.34's method for Hadamard-rotated W4A4 layers (its own layout)
WHOLE_K_BASE, WHOLE_K_DONOR = "ct_spinquant_r1r2r4_had16_nvfp4", "ct_spinquant_r1r2r4_rhad_nvfp4a16"


def transform_variant(root: Path, variant: str, seed: int = 0) -> Path:
    """``TRANSFORM_BASE`` with its ``v`` rotation changed: ``partial-input`` leaves k_proj out (q and v, fused
    with it, keep theirs), ``split-input`` gives k_proj the same rotation through an apply entry of its own,
    ``randomized`` adds compressed-tensors' permutation, ``orthogonal-matrix`` makes it a
    random-matrix transform with a random orthogonal matrix (condition number 1: convert accepts it unfused)."""
    gen = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True)
    config = json.loads((PRODUCERS / TRANSFORM_BASE / "config.json").read_text())
    tensors = load_file(PRODUCERS / TRANSFORM_BASE / "model.safetensors")
    v = config["quantization_config"]["transform_config"]["config_groups"]["v"]
    stored = "model.layers.0.self_attn.q_proj.v_input"
    if variant in ("partial-input", "split-input"):
        v["apply"][0]["ignore"].append("re:.*k_proj$")
        if variant == "split-input":
            v["apply"].append(dict(v["apply"][0], targets=["re:.*k_proj$"], ignore=[]))
    elif variant == "randomized":
        v["randomize"] = True
        tensors[f"{stored}.perm"] = torch.randperm(16, generator=gen)
    else:
        v["type"] = "random-matrix"
        orthogonal = torch.linalg.qr(torch.randn(16, 16, generator=gen, dtype=torch.float64))[0]
        tensors[f"{stored}.weight"] = orthogonal.contiguous()
    (root / "config.json").write_text(json.dumps(config))
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return root


def whole_k_w4a4(root: Path) -> Path:
    """``WHOLE_K_BASE`` (W4A4, R4 input rotation of block 16 on down_proj) with R4 made a whole-K (no head_dim)
    random-hadamard rotation, the 176 x 176 matrix of ``WHOLE_K_DONOR``: a block vLLM's QuTLASS route does not take."""
    root.mkdir(parents=True)
    config = json.loads((PRODUCERS / WHOLE_K_BASE / "config.json").read_text())
    tensors = load_file(PRODUCERS / WHOLE_K_BASE / "model.safetensors")
    r4 = config["quantization_config"]["transform_config"]["config_groups"]["R4"]
    r4.update(type="random-hadamard", head_dim=None)
    name = "model.layers.0.mlp.down_proj.R4_input.weight"
    tensors[name] = load_file(PRODUCERS / WHOLE_K_DONOR / "model.safetensors")[name]
    (root / "config.json").write_text(json.dumps(config))
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return root


def _vllm_python(version: str = "0.33") -> Path:
    """The oracle's interpreter."""
    return oracle_python(vllm_venv(version), f"vLLM {version}", f"tests/vllm/make_env.sh {version}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    gen, root, seed = seeded_folder(tmp_path_factory, "vllm-ckpts")
    out = {name: PRODUCERS / name for name in PRODUCER_FIXTURES}
    for shape, (hidden, heads, kv, inter) in SYNTHETIC.items():
        for fmt, w4a4 in SYNTHETIC_FORMATS.items():
            name = f"{shape}-{fmt}"
            out[name] = write_llama(root / name, fmt, hidden=hidden, heads=heads, kv_heads=kv, intermediate=inter,
                                    generator=gen, layers=2, w4a4=w4a4)
            out[f"{name}-w4a4"] = write_llama(root / f"{name}-w4a4", fmt, hidden=hidden, heads=heads, kv_heads=kv,
                                              intermediate=inter, generator=gen, layers=2, w4a4=True)
    out.update({name: PRODUCERS / name for name in TRANSFORM_FIXTURES + sorted(REFUSED_FIXTURES)})
    out.update({name: transform_variant(root / name, name, seed) for name in TRANSFORM_VARIANTS})
    out["whole-k-w4a4"] = whole_k_w4a4(root / "whole-k-w4a4")
    out.update({name: output_variant(root / name, name) for name in OUTPUT_VARIANTS})
    return out


def harness_arch(arch: str) -> str:
    """Our target (``-w4a4``: the W4A4 jobs) -> the harness's arch."""
    base = arch.removesuffix("-w4a4")
    return ARCHS[base] + arch[len(base):]


def weight_only_checkpoint(name: str) -> bool:
    """Whether the job's checkpoint is weight-only (NVFP4A16, W4A16_NVFP4, the synthetic ModelOpt ones and the
    variants of the W4A16 ``TRANSFORM_BASE``)."""
    return "a16" in name or name.endswith("-modelopt") or name in TRANSFORM_VARIANTS


def _jobs(names: list[str]) -> list[tuple[str, str]]:
    """The cute-dsl W4A16 jobs: sm100's for every checkpoint (``--weight-only`` for W4A4 ones); sm120's for weight-only
    ones, which vLLM holds with ``--linear-backend flashinfer_cutedsl`` (its auto there is Marlin, and for a W4A4
    checkpoint that kernel holds its scalars too: tests/test_vllm_marlin_conformance.py)."""
    return [(name, arch) for name in names for arch in ARCHS if arch == "sm100" or weight_only_checkpoint(name)]


def cute_dsl(arch: str) -> dict:
    """convert's options for the cute-dsl W4A16 layout on ``arch``."""
    return dict(linear_backend="flashinfer_cutedsl") if arch == "sm120" else dict(weight_only=True)


TP1 = _jobs(PRODUCER_FIXTURES + [f"odd-{f}" for f in SYNTHETIC_FORMATS])
TP2 = _jobs([f"tp-{f}" for f in SYNTHETIC_FORMATS]) + [
    (name, "sm100") for name in PRODUCER_FIXTURES[::2] + [f"odd-{f}" for f in SYNTHETIC_FORMATS]]
TRANSFORMED_TP1 = _jobs(TRANSFORMED)
TRANSFORMED_TP2 = [(name, "sm100") for name in TRANSFORMED]
TRANSFORMED_W4A4_TP1 = [(name, f"{arch}-w4a4") for name in TRANSFORMED_W4A4 for arch in ARCHS]
W4A4_TP1 = [(name, f"{arch}-w4a4") for name in W4A4_FIXTURES + [f"odd-{f}-w4a4" for f in SYNTHETIC_FORMATS]
            for arch in ARCHS]
W4A4_TP2 = [(name, f"{arch}-w4a4")
            for name in W4A4_FIXTURES + [f"{s}-{f}-w4a4" for s in SYNTHETIC for f in SYNTHETIC_FORMATS] for arch in ARCHS]


@pytest.fixture(scope="module")
def oracle(checkpoints, vllm_version, tmp_path_factory) -> dict[int, Path]:
    """vLLM's load-time result for every job, per TP size: ``{tp: folder}``."""
    python = _vllm_python(vllm_version)
    out = {}
    for tp, jobs in ((1, TP1 + W4A4_TP1 + TRANSFORMED_TP1 + TRANSFORMED_W4A4_TP1),
                     (2, TP2 + W4A4_TP2 + TRANSFORMED_TP2)):
        folder = tmp_path_factory.mktemp(f"vllm{vllm_version}-tp{tp}")
        args = [arg for name, arch in jobs
                for arg in ("--job", f"{name}-{arch}={checkpoints[name]}:{harness_arch(arch)}")]
        subprocess.run([str(python), str(HERE / "harness.py"), "--tp", str(tp), "--out", str(folder), *args],
                       check=True, timeout=1500, stdout=subprocess.DEVNULL)
        out[tp] = folder
    return out


def _assert_transforms_identical(bundle, theirs: dict[str, torch.Tensor]) -> None:
    """The online-transform matrices vLLM holds, per fused layer and partition, are the bundle's, byte for byte."""
    held = {name: t for name, t in theirs.items() if ".partitions." in name}
    ours = {f"{prefix}.{name}": t for prefix in bundle.manifest.layers
            for name, t in bundle.vllm_transforms(prefix).items()}
    assert set(ours) == set(held)
    for name, t in ours.items():
        assert (t.dtype, t.shape) == (held[name].dtype, held[name].shape), name
        assert torch.equal(t.contiguous().view(torch.uint8), held[name].view(torch.uint8)), name


def _assert_rank_identical(bundle_dir: Path, dumped: Path, rank: int) -> int:
    bundle = open_bundle(bundle_dir)
    theirs = load_file(dumped / f"rank-{rank}.safetensors")
    meta = json.loads((dumped / f"rank-{rank}.json").read_text())
    assert set(meta) == set(bundle.manifest.layers)
    _assert_transforms_identical(bundle, theirs)
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


def _assert_tp1_bundle_matches(dumped: Path, source: Path, target: str, out: Path, compare, **options) -> None:
    """A TP 1 ``--fuse`` bundle's 8 fused layers against vLLM's dump (which must not be a refusal), then verify."""
    assert not (dumped / "refused.txt").exists(), (dumped / "refused.txt").read_text()
    convert(source, target, out, fuse=True, **options)
    assert compare(out, dumped, 0) == 8
    assert verify_output(out).passed


@pytest.mark.parametrize("name,arch", TP1, ids=[f"{n}-{a}" for n, a in TP1])
def test_fused_bundle_is_byte_identical_to_vllm(name, arch, checkpoints, oracle, tmp_path):
    # W4A4 checkpoints too: the W4A16 kernel
    _assert_tp1_bundle_matches(oracle[1] / f"{name}-{arch}", checkpoints[name], arch, tmp_path / "bundle",
                               _assert_rank_identical, **cute_dsl(arch))


@pytest.mark.parametrize("name,arch", TP2, ids=[f"{n}-{a}" for n, a in TP2])
def test_tp2_ranks_are_byte_identical_to_vllm_or_both_refuse(name, arch, checkpoints, oracle, tmp_path):
    dumped = oracle[2] / f"{name}-{arch}"
    out = tmp_path / "ranks"
    refused = (dumped / "refused.txt").exists()
    if name.startswith("ct_") or refused:
        # ct with a per-rank K of 88 (not a multiple of 16): vLLM 0.33 builds shifted block scales; we refuse.
        with pytest.raises(RepackError, match="--tp 2"):
            convert(checkpoints[name], arch, out, tp=2, **cute_dsl(arch))
        assert refused or name.startswith("ct_"), "we refuse what vLLM loads"
        return
    convert(checkpoints[name], arch, out, tp=2, **cute_dsl(arch))
    for rank in range(2):
        assert _assert_rank_identical(out / f"rank-{rank}", dumped, rank) == 8
    assert verify_output(out).passed


# Where vLLM refuses a transform checkpoint at TP = 1: (its error, ours). Every other one it loads.
VLLM_TRANSFORM_REFUSALS = {
    "ct_spinquant_r3_had16_nvfp4a16": ("There is no module or parameter named 'layers.0.self_attn.R3_q_attn'",
                                       "location 'q_attn' is not supported"),
    "partial-input": ("KeyError: 1", "vLLM requires the same input transform on every partition"),
    "split-input": ("ValueError: Must have same input", "on every partition, from one apply entry"),
    "randomized": ("'QKVParallelLinear' object has no attribute 'data'", "cannot load randomized transforms"),
}


def _refused(name: str, dumped: Path) -> str:
    refused = dumped / "refused.txt"
    return refused.read_text() if refused.exists() else ""


@pytest.mark.parametrize("name,arch", TRANSFORMED_TP1, ids=[f"{n}-{a}" for n, a in TRANSFORMED_TP1])
def test_fused_transform_bundle_holds_vllms_transforms_or_both_refuse(name, arch, checkpoints, oracle, vllm_version,
                                                                     tmp_path):
    """Per fused module and partition, the online-transform matrices vLLM holds after loading, by its names, byte
    for byte (with the layers' own tensors); where vLLM refuses to load the checkpoint, convert --fuse refuses."""
    dumped, out = oracle[1] / f"{name}-{arch}", tmp_path / "bundle"
    theirs = _refused(name, dumped)
    if name in VLLM_TRANSFORM_REFUSALS:
        vllm_says, we_say = VLLM_TRANSFORM_REFUSALS[name]
        assert vllm_says in theirs
        with pytest.raises(RepackError, match=we_say):
            convert(checkpoints[name], arch, out, fuse=True)
        return
    assert not theirs, theirs
    if name == "orthogonal-matrix":  # vLLM loads it, but divides it by sqrt(16): not the checkpoint's function
        stored = load_file(checkpoints[name] / "model.safetensors")["model.layers.0.self_attn.q_proj.v_input.weight"]
        held = load_file(dumped / "rank-0.safetensors")["model.layers.0.self_attn.qkv_proj.v_input.weight.partitions.0"]
        assert torch.equal(held, stored.to(torch.bfloat16) / 4) and not torch.equal(held, stored.to(torch.bfloat16))
        convert(checkpoints[name], arch, tmp_path / "unfused")  # well conditioned: it converts without --fuse
        with pytest.raises(RepackError, match="vLLM 0.33 divides random-matrix transforms by sqrt"):
            convert(checkpoints[name], arch, out, fuse=True)
        return
    if name in REFUSED_FIXTURES:  # vLLM loads it; convert refuses it whatever the layout (see test_transforms)
        with pytest.raises(RepackError, match=REFUSED_FIXTURES[name]):
            convert(checkpoints[name], arch, out, fuse=True)
        return
    w4a4_job = oracle[1] / f"{name}-{arch}-w4a4" / "methods.json"  # vLLM's choice for the checkpoint's own scheme
    if w4a4_job.exists() and HUMMING in json.loads(w4a4_job.read_text()):  # 0.34: Humming's, --weight-only or not
        with pytest.raises(RepackError, match="--vllm 0.33"):
            convert(checkpoints[name], arch, out, fuse=True, vllm=vllm_version, **cute_dsl(arch))
        return
    convert(checkpoints[name], arch, out, fuse=True, vllm=vllm_version, **cute_dsl(arch))  # W4A4: test_w4a4_transform_...
    assert _assert_rank_identical(out, dumped, 0) == 8
    assert open_bundle(out).manifest.transforms, "a transform bundle"
    assert verify_output(out).passed


@pytest.mark.parametrize("name", TRANSFORMED)
def test_tp2_transform_checkpoints_are_refused_as_vllm_refuses_them(name, checkpoints, oracle, tmp_path):
    """vLLM refuses every one (most for the TP itself, some for what it refuses at TP = 1 too, found first)."""
    theirs = _refused(name, oracle[2] / f"{name}-sm100")
    first = {"ct_spinquant_r3_had16_nvfp4a16": "no module or parameter named", "partial-input": "KeyError: 1",
             "split-input": "ValueError: Must have same input"}
    assert first.get(name, "Online transforms with tensor parallelism is not supported") in theirs, theirs[:300]
    ours = REFUSED_FIXTURES.get(name, "--tp 2: vLLM 0.33 does not support online transforms")
    with pytest.raises(RepackError, match=ours):
        convert(checkpoints[name], "sm100", tmp_path / "ranks", tp=2)
    assert not (tmp_path / "ranks").exists()


# What vLLM 0.34 keeps beside the kernel's tensors (bookkeeping, read by no kernel), per source format: the loaded
# ModelOpt global scales, retired; compressed-tensors' loaded name of the packed weight, the same Parameter as ``weight``.
RETIRED = {"0.34": {"modelopt": {"weight_scale_2", "input_scale"}}}
ALIASES = {"0.34": {"compressed-tensors": {"weight_packed": "weight"}}}
# 0.34 writes a smaller result into the loaded parameter's own storage: compressed-tensors' fused global scales are 0-d
# views into the loaded f32[partitions], compared by their value (the bytes after it: the loaded partitions' values)
LOADED_VIEWS = {"0.34": {"compressed-tensors": {"weight_global_scale", "input_global_scale"}}}


def _source_tensors(bundle) -> dict[str, torch.Tensor]:
    root = Path(bundle.manifest.source.path)
    return {k: v for f in sorted(root.glob("*.safetensors")) for k, v in load_file(f).items()}


def _assert_w4a4_rank_identical(bundle_dir: Path, dumped: Path, rank: int, version: str = "0.33") -> int:
    """Every tensor vLLM ``version`` holds on every fused NVFP4 layer, by name, class-free dtype, shape, strides,
    offset and value, is the bundle's tensor of that name, or, on a layer vLLM 0.33 serves through QuTLASS, what
    ``Bundle.vllm_qutlass`` derives from the bundle at load; its storage is the tensor's own (0.34: the loaded
    parameter's, :data:`LOADED_VIEWS`); 0.34's bookkeeping is exactly :data:`RETIRED` (the source's loaded values) and
    :data:`ALIASES`; the quantization method is QuTLASS's exactly where ``Bundle.runs_qutlass`` says so (0.33); the
    online transforms are the bundle's; the kernel class is the manifest's first (auto's); the padding vLLM derives
    (``weight.shape[1] - K/2``) is the manifest's."""
    bundle = open_bundle(bundle_dir)
    theirs = load_file(dumped / f"rank-{rank}.safetensors")
    meta = json.loads((dumped / f"rank-{rank}.json").read_text())
    assert set(meta) == set(bundle.manifest.layers)
    assert bundle.manifest.scheme == "W4A4"
    fmt = bundle.manifest.source.format
    retired, aliases = RETIRED.get(version, {}).get(fmt, set()), ALIASES.get(version, {}).get(fmt, {})
    source = _source_tensors(bundle) if retired else {}
    _assert_transforms_identical(bundle, theirs)
    for prefix, info in meta.items():
        record = bundle.manifest.layers[prefix]
        qutlass = bundle.vllm_qutlass(prefix) if version == "0.33" else {}
        route = {"QutlassNvFP4LinearMethod": "qutlass", "CompressedTensorsLinearTransformMethod": "transforms"}
        assert route.get(info["method"], "plain") == (
            "qutlass" if qutlass else "transforms" if record.transforms else "plain"), (prefix, info["method"])
        assert info["kernel"] == bundle.manifest.kernels[0], prefix
        # besides the layout's tensors vLLM holds a layer's bias (Qwen2's q/k/v), passthrough in the bundle
        views = {name: view for name, view in info["tensors"].items() if name != "bias"}
        assert set(views) == set(record.tensors) | set(qutlass) | retired | set(aliases), prefix
        assert {n for n, v in views.items() if v.get("retired")} == retired, prefix
        assert (info["input_size_per_partition"], info["output_size_per_partition"]) == (record.k, record.n), prefix
        assert views["weight"]["shape"][1] - record.k // 2 == record.weights_padding_cols, prefix
        for alias, name in aliases.items():  # one Parameter under both names, the kernel's its runtime name
            assert views[alias]["aliases"] == [name] and views[alias]["runtime_name"] == name, (prefix, alias)
            assert torch.equal(theirs[f"{prefix}.{alias}"], theirs[f"{prefix}.{name}"]), (prefix, alias)
        for name in retired:  # as loaded: the source's per-partition values
            loaded = torch.stack([source[f"{p.source}.{name}"].reshape(()).float() for p in record.partitions])
            assert torch.equal(theirs[f"{prefix}.{name}"], loaded.view(torch.uint8)), (prefix, name)
        for part in set(record.tensors) | set(qutlass):
            ours, view = (qutlass[part] if part in qutlass else bundle.read(f"{prefix}.{part}")), views[part]
            assert_held_as(ours, view, theirs[f"{prefix}.{part}"], (prefix, part))
            own = ours.numel() * ours.element_size()
            loaded = 4 * len(record.partitions) if part in LOADED_VIEWS.get(version, {}).get(fmt, ()) else own
            assert view["storage_nbytes"] == loaded, (prefix, part, view["storage_nbytes"])
    return len(meta)


@pytest.mark.parametrize("name,arch", W4A4_TP1, ids=[f"{n}-{a}" for n, a in W4A4_TP1])
def test_w4a4_bundle_is_byte_identical_to_vllm_auto(name, arch, checkpoints, oracle, vllm_version, tmp_path):
    # the W4A4 layout: the default for a W4A4 checkpoint
    _assert_tp1_bundle_matches(oracle[1] / f"{name}-{arch}", checkpoints[name], arch.removesuffix("-w4a4"),
                               tmp_path / "bundle", functools.partial(_assert_w4a4_rank_identical, version=vllm_version),
                               vllm=vllm_version)


@pytest.mark.parametrize("name,arch", W4A4_TP2, ids=[f"{n}-{a}" for n, a in W4A4_TP2])
def test_w4a4_tp2_ranks_are_byte_identical_to_vllm_or_both_refuse(name, arch, checkpoints, oracle, vllm_version,
                                                                  tmp_path):
    dumped = oracle[2] / f"{name}-{arch}"
    out = tmp_path / "ranks"
    if name.startswith("ct_") or (dumped / "refused.txt").exists():  # per-rank K of 88, as for W4A16 above
        with pytest.raises(RepackError, match="--tp 2"):
            convert(checkpoints[name], arch.removesuffix("-w4a4"), out, tp=2)
        assert (dumped / "refused.txt").exists() or name.startswith("ct_"), "we refuse what vLLM loads"
        return
    convert(checkpoints[name], arch.removesuffix("-w4a4"), out, tp=2, vllm=vllm_version)
    for rank in range(2):
        assert _assert_w4a4_rank_identical(out / f"rank-{rank}", dumped, rank, vllm_version) == 8
    assert verify_output(out).passed


@pytest.mark.parametrize("name,arch", TRANSFORMED_W4A4_TP1, ids=[f"{n}-{a}" for n, a in TRANSFORMED_W4A4_TP1])
def test_w4a4_transform_bundle_holds_vllms_state_or_is_refused_for_humming(name, arch, checkpoints, oracle,
                                                                           vllm_version, tmp_path):
    """W4A4 rotated checkpoints, emulated Blackwell. vLLM 0.33: its QutlassNvFP4LinearMethod state (W4A4 layout, its
    transforms, fused_alpha, fused_global_scale, hadamard_matrix) on layers whose input blocks are all 16..128, its
    transform method around the W4A4 kernel elsewhere (whole-K R4), byte for byte from convert --fuse. vLLM 0.34:
    where it picks Humming's Hadamard method for a layer (the harness records its choice: Humming's own load needs its
    CUDA ops), convert --vllm 0.34 refuses in one line naming --vllm 0.33; elsewhere its transform method, byte for
    byte."""
    dumped, out = oracle[1] / f"{name}-{arch}", tmp_path / "bundle"
    target = arch.removesuffix("-w4a4")
    if HUMMING in json.loads((dumped / "methods.json").read_text()):
        assert vllm_version == "0.34"
        with pytest.raises(RepackError, match="--vllm 0.33"):
            convert(checkpoints[name], target, out, fuse=True, vllm=vllm_version)
        assert not out.exists()
        return
    assert not _refused(name, dumped), _refused(name, dumped)
    convert(checkpoints[name], target, out, fuse=True, vllm=vllm_version)
    assert _assert_w4a4_rank_identical(out, dumped, 0, vllm_version) == 8
    bundle = open_bundle(out)
    assert vllm_version in bundle.manifest.engines["vllm"]
    methods = json.loads((dumped / "rank-0.json").read_text())
    qutlass = vllm_version == "0.33" and name != "whole-k-w4a4"
    assert any(v["method"] == "QutlassNvFP4LinearMethod" for v in methods.values()) == qutlass
    assert any(bundle.layer(p).transforms for p in bundle.manifest.layers)
    assert verify_output(out).passed
