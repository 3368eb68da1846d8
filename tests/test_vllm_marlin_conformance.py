"""vLLM 0.33.0 as the oracle for Marlin: every tensor vLLM's own load leaves on every NVFP4 linear layer
(``MarlinNvFp4LinearKernel``) and FusedMoE module (``MarlinExperts``), per TP rank, byte for byte against our
bundles, with vLLM's ``auto`` choosing under an emulated sm80 (A100 .. L40S), sm75 (T4, fp16) or sm120 (a
weight-only checkpoint), and for weight-only MoE checkpoints on sm100 too (Marlin experts beside the cute-dsl W4A16
kernel's dense layers); vLLM's refusals are ours.

vLLM runs through tests/vllm/harness.py in its own virtualenv with one leaf replaced: the CUDA
``gptq_marlin_repack`` by the torch port of its index arithmetic in tests/vllm/ports.py (tests/test_marlin.py:
the port is our layout's repack; tests/test_gpu_marlin.py: our repack is the CUDA op, bit for bit, on the H200).
Everything else (kernel and MoE backend selection, scale permutation, the S0E5M3 conversion, global-scale folding,
padding, fusion, TP slicing) is vLLM's own code.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.convert import convert
from repack.errors import RepackError
from repack.formats import read_source
from repack.formats.moe import expert_groups
from repack.sample.synthetic import write_llama, write_qwen_moe
from repack.targets import marlin, moe_marlin
from repack.verify import verify_output

from .conftest import PRODUCERS, seeded_folder
from .test_vllm_conformance import (
    HERE,
    SYNTHETIC,
    SYNTHETIC_FORMATS,
    _assert_rank_identical,
    _assert_transforms_identical,
    _vllm_python,
)
from .test_vllm_moe_conformance import _assert_rank_state

DENSE = ["modelopt_w4a16_nvfp4", "modelopt_nvfp4", "ct_nvfp4a16", "ct_nvfp4"]
MOE = ["modelopt_moe_nvfp4", "ct_moe_nvfp4", "modelopt_moe_i48_nvfp4", "ct_moe_i48_nvfp4", "ct_qwen2_moe_nvfp4",
       "qwen2-biased"]
KEPT = {"weight_multiplier"}  # in the bundle for the inverse (the scale factor), not loaded into vLLM
# sm120 (both versions, tests below): vLLM's auto serves a weight-only checkpoint with Marlin (convert -t sm120's
# default), a W4A4 one with --linear-backend marlin (convert -t sm120 --weight-only); Hadamard-rotated ones too, whose
# blocks of 16..128 vLLM 0.33 gives QuTLASS's method (which refuses Marlin's kernel) and 0.34 its transform method
SM120_W4A16 = ["modelopt_w4a16_nvfp4", "ct_nvfp4a16", "odd-modelopt"]
SM120_W4A4 = ["modelopt_nvfp4", "ct_nvfp4", "odd-compressed-tensors"]
ROTATED_W4A16 = ["ct_quip_v_had16_nvfp4a16", "ct_quip_v_rhad32_nvfp4a16", "ct_spinquant_r1r2r4_rhad_nvfp4a16"]
ROTATED_W4A4 = ["ct_quip_vu_had32_nvfp4", "ct_spinquant_r1r2r4_had16_nvfp4"]
# Weight-only MoE checkpoints (issue 36): vLLM's auto serves their experts with Marlin on sm80, sm100 and sm120 alike.
# "wo-*": fresh synthetic ones, hidden 192 (Marlin pads I to 128 when H is not a multiple of 128), I 96 (48 per rank
# at TP 2), 3 experts (2 + 1 under --ep).
WEIGHT_ONLY_MOE = ["ct_moe_nvfp4a16", "modelopt_moe_w4a16_nvfp4", "wo-modelopt", "wo-compressed-tensors", "wo-biased"]
WEIGHT_ONLY_SHAPE = dict(hidden=192, experts=3, intermediate=96, layers=2, w4a4=False)
# Biased Qwen2-MoEs (random q/k/v biases; the producers' Qwen2-MoE has zero ones, which no permutation changes): a dense
# first layer, a shared expert, q/k/v N 288 that Marlin pads to 384 (per rank 192: one kv head, replicated); "wo-":
# weight-only (both vLLM versions, with the weight-only MoE cases), "qwen2-": W4A4 (Marlin MoE on sm80 / sm75)
BIASED = dict(heads=4, kv_heads=1, dense_layers=(0,))
WEIGHT_ONLY_ARCHS = ("sm80", "sm100", "sm120", "sm75")
# our target -> the harness's dense job (its "<job>-moe"): vLLM's auto for weight-only layers on that capability, what a
# user gets and the bundle's dense layout (sm100: the cute-dsl W4A16 kernel; sm120, sm80, sm75: Marlin); vLLM's auto MoE
WEIGHT_ONLY_JOBS = {"sm80": "sm80", "sm100": "sm100-auto", "sm120": "sm120-auto", "sm75": "sm75"}
# W4A4 checkpoints served weight-only (convert -t sm120 --weight-only: Marlin's W4A4 variant, Marlin MoE): vLLM with
# --linear-backend marlin --moe-backend marlin, the harness's sm120-marlin job (its auto MoE there is FlashInfer's)
W4A4_WEIGHT_ONLY = {("qwen2-biased", "sm120"): "sm120-marlin"}
WEIGHT_ONLY_PAIRS = [(n, a) for n in WEIGHT_ONLY_MOE for a in WEIGHT_ONLY_ARCHS] + list(W4A4_WEIGHT_ONLY)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    gen, root, _ = seeded_folder(tmp_path_factory, "vllm-marlin-ckpts")
    out = {name: PRODUCERS / name for name in DENSE + MOE + WEIGHT_ONLY_MOE[:2] + ROTATED_W4A16 + ROTATED_W4A4}
    for fmt in ("modelopt", "compressed-tensors"):
        out[f"wo-{fmt}"] = write_qwen_moe(root / f"wo-{fmt}", fmt, generator=gen, **WEIGHT_ONLY_SHAPE)
    out["wo-biased"] = write_qwen_moe(root / "wo-biased", "modelopt", generator=gen, shared_expert=96,
                                      **WEIGHT_ONLY_SHAPE, **BIASED)
    out["qwen2-biased"] = write_qwen_moe(root / "qwen2-biased", "compressed-tensors", generator=gen, hidden=192,
                                         experts=3, intermediate=128, layers=2, shared_expert=128, **BIASED)
    for shape, (hidden, heads, kv, inter) in SYNTHETIC.items():
        for fmt, w4a4 in SYNTHETIC_FORMATS.items():
            out[f"{shape}-{fmt}"] = write_llama(root / f"{shape}-{fmt}", fmt, hidden=hidden, heads=heads, kv_heads=kv,
                                                intermediate=inter, generator=gen, layers=2, w4a4=w4a4)
    hidden, heads, kv, inter = SYNTHETIC["tp"]  # and the other scheme of each format, for sm120 at TP 2 (the
    for fmt, w4a4 in SYNTHETIC_FORMATS.items():  # producers' per-rank K of 88 is refused, as vLLM refuses it)
        name = f"tp-{fmt}-{'a16' if w4a4 else 'w4a4'}"
        out[name] = write_llama(root / name, fmt, hidden=hidden, heads=heads, kv_heads=kv, intermediate=inter,
                                generator=gen, layers=2, w4a4=not w4a4)
    return out


SYNTHETIC_NAMES = [f"{s}-{f}" for s in SYNTHETIC for f in SYNTHETIC_FORMATS]
# (name, harness arch, our target, TP): sm80 and its fp16 sibling sm75 (sm120: SM120_CASES)
DENSE_CASES = ([(n, "sm80", "sm80", tp) for n in DENSE + SYNTHETIC_NAMES for tp in (1, 2)]
               + [(n, "sm75", "sm75", 1) for n in DENSE + SYNTHETIC_NAMES[:2]])
MOE_CASES = [(n, a, tp) for n in MOE for a in ("sm80", "sm75") for tp in (1, 2)]  # sm75: fp16 Marlin MoE
WEIGHT_ONLY_CASES = [(n, a, m) for n, a in WEIGHT_ONLY_PAIRS for m in ("tp1", "tp2", "ep")]


@pytest.fixture(scope="module")
def oracle(checkpoints, tmp_path_factory) -> dict:
    """vLLM's state per (kind, TP): dense jobs in one process per TP size, MoE jobs in their own."""
    python = _vllm_python()
    out = {}
    for kind, tp, jobs in (("dense", 1, [(n, a) for n, a, _, t in DENSE_CASES if t == 1]),
                           ("dense", 2, [(n, a) for n, a, _, t in DENSE_CASES if t == 2]),
                           ("moe", 1, [(n, f"{a}-moe") for n, a, t in MOE_CASES if t == 1]),
                           ("moe", 2, [(n, f"{a}-moe") for n, a, t in MOE_CASES if t == 2])):
        folder = tmp_path_factory.mktemp(f"vllm-marlin-{kind}-{tp}")
        args = [a for name, arch in jobs for a in ("--job", f"{name}-{arch}={checkpoints[name]}:{arch}")]
        subprocess.run([str(python), str(HERE / "harness.py"), "--tp", str(tp), "--out", str(folder), *args],
                       check=True, timeout=1500, stdout=subprocess.DEVNULL)
        out[kind, tp] = folder
    return out


def _served_bias(bundle, prefix: str) -> torch.Tensor | None:
    """The bias the plugin leaves on a Marlin layer (None: its sources have none): the bundle's passthrough biases of
    the layer's sources, each cut to this rank's rows (the manifest's partitions), joined, in the activation dtype,
    padded and permuted as ``prepare_fp4_layer_for_marlin`` does (:func:`marlin.permute_bias`)."""
    record = bundle.manifest.layers[prefix]
    names = [f"{p.source}.bias" for p in record.partitions]
    if not any(name in bundle.manifest.passthrough for name in names):
        return None
    rows = [bundle.read(name)[p.source_rows[0]:p.source_rows[1]] for name, p in zip(names, record.partitions)]
    dtype = marlin.DTYPES[bundle.target.dtype]
    return marlin.permute_bias(torch.cat(rows).to(dtype), marlin.geometry(record.n, record.k).n_padded)


def _marlin_held(bundle, prefix: str) -> dict[str, torch.Tensor]:
    """What vLLM holds on a Marlin layer, from the bundle: its layout's tensors, and a bias (:func:`_served_bias`)."""
    held = {part: bundle.read(f"{prefix}.{part}") for part in set(bundle.manifest.layers[prefix].tensors) - KEPT}
    bias = _served_bias(bundle, prefix)
    return held if bias is None else {**held, "bias": bias}


def _assert_marlin_rank_identical(bundle_dir, dumped, rank: int) -> int:
    """Every tensor vLLM holds on every NVFP4 linear layer (Marlin's three; a W4A4 checkpoint's activation scalars,
    which its method computes before the kernel's load), by name, dtype, shape, strides, offset and the bytes of its
    whole storage, is the bundle's tensor of that name; the kernel class is the manifest's; nothing else is held."""
    bundle = open_bundle(bundle_dir)
    theirs = load_file(dumped / f"rank-{rank}.safetensors")
    meta = json.loads((dumped / f"rank-{rank}.json").read_text())
    assert set(meta) == set(bundle.manifest.layers)
    for prefix, info in meta.items():
        record = bundle.manifest.layers[prefix]
        assert info["kernel"] == "MarlinNvFp4LinearKernel" == bundle.manifest.kernels[0], (prefix, info["kernel"])
        assert "weights_padding_cols" not in info, prefix  # Marlin pads activations inside its apply
        held = _marlin_held(bundle, prefix)
        assert set(info["tensors"]) == set(held), prefix
        assert (info["input_size_per_partition"], info["output_size_per_partition"]) == (record.k, record.n), prefix
        for part, view in info["tensors"].items():
            ours = held[part]
            got = (str(ours.dtype).replace("torch.", ""), list(ours.shape), list(ours.stride()), ours.storage_offset())
            assert got == (view["dtype"], view["shape"], view["stride"], view["offset"]), (prefix, part)
            assert torch.equal(ours.reshape(-1).view(torch.uint8), theirs[f"{prefix}.{part}"]), (prefix, part)
    return len(meta)


@pytest.mark.parametrize("name,arch,target,tp", DENSE_CASES, ids=[f"{n}-{a}-tp{t}" for n, a, _, t in DENSE_CASES])
def test_marlin_bundle_is_byte_identical_to_vllm_or_both_refuse(name, arch, target, tp, checkpoints, oracle,
                                                                tmp_path):
    dumped, out = oracle["dense", tp] / f"{name}-{arch}", tmp_path / "bundle"
    refused = dumped / "refused.txt"
    if tp == 2 and (name.startswith("ct_") or refused.exists()):
        # as for the other layouts: ct's per-rank K of 88 (vLLM builds shifted block scales), odd's 5 heads
        with pytest.raises(RepackError, match="--tp 2"):
            convert(checkpoints[name], target, out, tp=2)
        assert refused.exists() or name.startswith("ct_"), "we refuse what vLLM loads"
        return
    assert not refused.exists(), refused.read_text()[:2000]
    if tp == 1:
        convert(checkpoints[name], target, out, fuse=True)
        assert _assert_marlin_rank_identical(out, dumped, 0) == 8
    else:
        convert(checkpoints[name], target, out, tp=2)
        for rank in range(2):
            assert _assert_marlin_rank_identical(out / f"rank-{rank}", dumped, rank) == 8
    assert verify_output(out).passed


@pytest.mark.parametrize("name,arch,tp", MOE_CASES, ids=[f"{n}-{a}-tp{t}" for n, a, t in MOE_CASES])
def test_marlin_moe_bundle_holds_vllms_state_or_both_refuse(name, arch, tp, checkpoints, oracle, tmp_path, capsys):
    """``convert --fuse`` / ``--tp 2`` to sm80: every FusedMoE module of every rank (``MarlinExperts``: repacked
    experts, one scale factor per layer, folded global scales; compressed-tensors' loaded global scales kept) and
    every dense layer beside them, byte for byte; where vLLM refuses, one line and nothing written."""
    dumped, out = oracle["moe", tp] / f"{name}-{arch}-moe", tmp_path / "out"
    code = main(["convert", str(checkpoints[name]), "-t", arch, "--fuse", "--tp", str(tp), "-o", str(out)])
    err = capsys.readouterr().err
    source = read_source(checkpoints[name])
    group = next(iter(expert_groups(source).values()))
    if (group.intermediate // tp) % 16:  # per-rank 24: vLLM 0.33 cuts block scales misaligned; refused, as for dense
        assert code == 1 and "not a multiple of 16" in err and err.count("\n") == 1, err
        return
    if (dumped / "refused.txt").exists():
        assert code == 1 and err.startswith("Error: ") and err.count("\n") == 1, err
        assert not out.exists()
        return
    assert code == 0, err
    for rank in range(tp):
        folder = out / f"rank-{rank}" if tp > 1 else out
        bundle = open_bundle(folder)
        layout = moe_marlin.FP16 if arch == "sm75" else moe_marlin  # T4: fp16 activations, its own scale bytes
        assert bundle.manifest.layout_id.startswith("marlin-fp16-v1" if arch == "sm75" else "marlin-v1")
        held = {module: ({k: v for k, v in bundle.moe_tensors(module).items() if k not in moe_marlin.KEPT},
                         record.expert_map) for module, record in bundle.moe_layers().items()}
        assert all(r.layout_id == layout.LAYOUT_ID for r in bundle.moe_layers().values())
        _assert_rank_state(dumped, rank, layout, held, source, (rank, "cli"))
        assert _assert_marlin_rank_identical(folder, dumped, rank) == len(bundle.manifest.layers)
    assert verify_output(out).passed


@pytest.fixture(scope="module")
def oracle_weight_only(checkpoints, vllm_version, tmp_path_factory) -> dict[int, Path]:
    """vLLM ``vllm_version``'s state of the weight-only MoE jobs (``NAME-TARGET-moe[-ep]``), per TP size: the TP 2
    process loads the ``--ep`` jobs too (the harness sets expert parallelism per job)."""
    python, out = _vllm_python(vllm_version), {}
    for tp, modes in ((1, ("",)), (2, ("", "-ep"))):
        folder = tmp_path_factory.mktemp(f"vllm{vllm_version}-marlin-weight-only-tp{tp}")
        args = [a for name, target in WEIGHT_ONLY_PAIRS for ep in modes
                for job in [W4A4_WEIGHT_ONLY.get((name, target), WEIGHT_ONLY_JOBS[target])]
                for a in ("--job", f"{name}-{target}-moe{ep}={checkpoints[name]}:{job}-moe{ep}")]
        subprocess.run([str(python), str(HERE / "harness.py"), "--tp", str(tp), "--out", str(folder), *args],
                       check=True, timeout=1500, stdout=subprocess.DEVNULL)
        out[tp] = folder
    return out


@pytest.mark.parametrize("name,arch,mode", WEIGHT_ONLY_CASES, ids=[f"{n}-{a}-{m}" for n, a, m in WEIGHT_ONLY_CASES])
def test_weight_only_moe_bundle_holds_vllms_marlin_state(name, arch, mode, checkpoints, oracle_weight_only,
                                                         vllm_version, tmp_path, capsys):
    """Weight-only MoE checkpoints (llm-compressor NVFP4A16, ModelOpt W4A16_NVFP4, both formats synthetic) with
    ``convert -t <family> --fuse`` / ``--tp 2`` / ``--tp 2 --ep`` for vLLM ``vllm_version``: its auto picks MARLIN for
    the experts on sm80, sm100, sm120 and sm75 (fp16; no FP4 x FP4 MoE backend takes bf16 activations), and every
    FusedMoE module of every rank is the bundle's, byte for byte (compressed-tensors' loaded global scales kept; 0.34's
    bookkeeping checked as for the other MoE layouts); the dense layers beside them too, as vLLM's auto holds them in
    the same load (the bundle's layouts: Marlin's, sm100's the cute-dsl W4A16 kernel's). ``W4A4_WEIGHT_ONLY``: a W4A4
    checkpoint with ``--weight-only``, vLLM with Marlin forced for both (Marlin's W4A4 variant beside the experts; the
    q/k/v biases padded and permuted by the plugin, :func:`_served_bias`)."""
    tp, ep = (1, False) if mode == "tp1" else (2, mode == "ep")
    dumped, out = oracle_weight_only[tp] / f"{name}-{arch}-moe{'-ep' * ep}", tmp_path / "out"
    assert not (dumped / "refused.txt").exists(), (dumped / "refused.txt").read_text()[:2000]
    code = main(["convert", str(checkpoints[name]), "-t", arch, "--fuse", "--tp", str(tp), "--vllm", vllm_version,
                 "-o", str(out)] + ["--ep"] * ep + ["--weight-only"] * ((name, arch) in W4A4_WEIGHT_ONLY))
    assert code == 0, capsys.readouterr().err
    source = read_source(checkpoints[name])
    for rank in range(tp):
        folder = out / f"rank-{rank}" if tp > 1 else out
        bundle = open_bundle(folder)
        layout = moe_marlin.FP16 if arch == "sm75" else moe_marlin  # T4: fp16 activations, its own scale bytes
        assert bundle.manifest.scheme == source.activation_scheme and bundle.moe_layout is layout
        held = {module: ({k: v for k, v in bundle.moe_tensors(module).items() if k not in moe_marlin.KEPT},
                         record.expert_map) for module, record in bundle.moe_layers().items()}
        _assert_rank_state(dumped, rank, layout, held, source, (rank, arch, mode), vllm_version)
        dense = (_assert_rank_identical(folder, dumped, rank) if arch == "sm100"
                 else _assert_marlin_state(folder, dumped, rank, vllm_version))
        assert dense == len(bundle.manifest.layers) > 0
    assert verify_output(out).passed


# (name, harness arch, TP): sm120-auto, vLLM's auto (weight-only checkpoints); sm120-marlin, --linear-backend marlin
SM120_CASES = ([(n, "sm120-auto", 1) for n in SM120_W4A16 + ROTATED_W4A16]
               + [(n, "sm120-marlin", 1) for n in SM120_W4A4 + ROTATED_W4A4]
               + [(n, "sm120-auto", 2) for n in ("tp-modelopt", "tp-compressed-tensors-a16")]
               + [(n, "sm120-marlin", 2) for n in ("tp-modelopt-w4a4", "tp-compressed-tensors")])


@pytest.fixture(scope="module")
def oracle_sm120(checkpoints, vllm_version, tmp_path_factory) -> dict:
    """vLLM ``vllm_version``'s state of the sm120 jobs, per TP size."""
    python, out = _vllm_python(vllm_version), {}
    for tp in (1, 2):
        folder = tmp_path_factory.mktemp(f"vllm{vllm_version}-marlin-sm120-tp{tp}")
        args = [a for name, arch, t in SM120_CASES if t == tp
                for a in ("--job", f"{name}-{arch}={checkpoints[name]}:{arch}")]
        subprocess.run([str(python), str(HERE / "harness.py"), "--tp", str(tp), "--out", str(folder), *args],
                       check=True, timeout=1500, stdout=subprocess.DEVNULL)
        out[tp] = folder
    return out


def _assert_marlin_state(folder, dumped, rank: int, version: str) -> int:
    """vLLM 0.33: every tensor of every layer (:func:`_assert_marlin_rank_identical`); 0.34: the kernel-read ones (its
    bookkeeping beside them: test_vllm_conformance.py); both: the online transforms vLLM holds, the kernel Marlin's.
    Returns the number of layers."""
    bundle = open_bundle(folder)
    theirs = load_file(dumped / f"rank-{rank}.safetensors")
    _assert_transforms_identical(bundle, theirs)
    if version == "0.33":
        return _assert_marlin_rank_identical(folder, dumped, rank)
    meta = json.loads((dumped / f"rank-{rank}.json").read_text())
    assert set(meta) == set(bundle.manifest.layers)
    for prefix, info in meta.items():
        assert info["kernel"] == "MarlinNvFp4LinearKernel", info["kernel"]
        _assert_held_034(_marlin_held(bundle, prefix), info, theirs, prefix)
    return len(meta)


@pytest.mark.parametrize("name,arch,tp", SM120_CASES, ids=[f"{n}-{a}-tp{t}" for n, a, t in SM120_CASES])
def test_sm120_weight_only_bundle_is_vllms_marlin_state_or_both_refuse(name, arch, tp, checkpoints, oracle_sm120,
                                                                     vllm_version, tmp_path):
    """``convert -t sm120`` of a weight-only checkpoint (``--weight-only`` of a W4A4 one: Marlin's W4A4 variant) is
    what vLLM ``vllm_version`` holds on sm120 (its auto; --linear-backend marlin), fused and per TP rank, and verify
    passes; where vLLM refuses the checkpoint (0.33: QuTLASS's method on Marlin's kernel), ``--vllm`` that version is
    refused in one line naming the version that serves it, and the default bundle lists only the versions that do."""
    dumped, out = oracle_sm120[tp] / f"{name}-{arch}", tmp_path / "out"
    options = dict(weight_only=arch == "sm120-marlin", **(dict(tp=2) if tp == 2 else dict(fuse=True)))
    theirs = (dumped / "refused.txt").read_text() if (dumped / "refused.txt").exists() else ""
    if theirs:
        assert vllm_version == "0.33" and "QutlassNvFP4 transform requires a FlashInfer kernel" in theirs, theirs[:500]
        with pytest.raises(RepackError, match="--vllm 0.34"):
            convert(checkpoints[name], "sm120", out, vllm=vllm_version, **options)
        assert not out.exists()
        convert(checkpoints[name], "sm120", out, **options)  # the newest version serves it
        assert open_bundle(out).manifest.engines == {"vllm": ["0.34"]}
        return
    convert(checkpoints[name], "sm120", out, vllm=vllm_version, **options)
    folders = [out] if tp == 1 else [out / f"rank-{r}" for r in range(2)]
    for rank, folder in enumerate(folders):
        manifest = open_bundle(folder).manifest
        assert manifest.layout_id == ("marlin-v1-w4a4" if arch == "sm120-marlin" else "marlin-v1")
        assert manifest.kernels == ["MarlinNvFp4LinearKernel"] and vllm_version in manifest.engines["vllm"]
        assert _assert_marlin_state(folder, dumped, rank, vllm_version) == 8
    assert verify_output(out).passed


# vLLM 0.34: the same kernel-read tensors; it keeps more names beside them (compressed-tensors' weight_packed as an
# alias of weight, retired per-partition scales, the MoE methods' loaded scales), bookkeeping the plugin reproduces
V034_DENSE = [(n, a, t) for n in DENSE for a, t in (("sm80", "sm80"), ("sm75", "sm75"))]
V034_MOE_JOBS = [(n, "sm80") for n in MOE[:4]]  # weight-only experts: test_weight_only_moe_bundle_holds_vllms_marlin_state


@pytest.fixture(scope="module")
def oracle_034(checkpoints, tmp_path_factory) -> dict:
    python = _vllm_python("0.34")
    out = {}
    for kind, jobs in (("dense", [(n, a) for n, a, _ in V034_DENSE]),
                       ("moe", [(n, f"{a}-moe") for n, a in V034_MOE_JOBS])):
        folder = tmp_path_factory.mktemp(f"vllm034-marlin-{kind}")
        args = [a for name, arch in jobs for a in ("--job", f"{name}-{arch}={checkpoints[name]}:{arch}")]
        subprocess.run([str(python), str(HERE / "harness.py"), "--out", str(folder), *args], check=True, timeout=1500,
                       stdout=subprocess.DEVNULL)
        out[kind] = folder
    return out


def _assert_held_034(ours: dict[str, torch.Tensor], info: dict, theirs: dict, prefix: str) -> None:
    """Every tensor of the bundle's layer (or module) is held by vLLM 0.34 under its name, byte for byte (what else
    0.34 holds beside them is its bookkeeping, not checked here)."""
    for part, tensor in ours.items():
        view = info["tensors"][part]
        assert (str(tensor.dtype).replace("torch.", ""), list(tensor.shape)) == (view["dtype"], view["shape"]), part
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), theirs[f"{prefix}.{part}"].reshape(-1).view(
            torch.uint8)), (prefix, part)


@pytest.mark.parametrize("name,arch,target", V034_DENSE, ids=[f"{n}-{a}" for n, a, _ in V034_DENSE])
def test_marlin_bundle_holds_vllm_034s_kernel_tensors(name, arch, target, checkpoints, oracle_034, tmp_path):
    dumped = oracle_034["dense"] / f"{name}-{arch}"
    assert not (dumped / "refused.txt").exists(), (dumped / "refused.txt").read_text()[:2000]
    convert(checkpoints[name], target, tmp_path / "bundle", fuse=True, vllm="0.34")
    bundle = open_bundle(tmp_path / "bundle")
    theirs, meta = load_file(dumped / "rank-0.safetensors"), json.loads((dumped / "rank-0.json").read_text())
    assert set(meta) == set(bundle.manifest.layers)
    for prefix, info in meta.items():
        assert info["kernel"] == "MarlinNvFp4LinearKernel", info["kernel"]
        _assert_held_034(_marlin_held(bundle, prefix), info, theirs, prefix)


@pytest.mark.parametrize("name,arch", V034_MOE_JOBS, ids=[f"{n}-{a}" for n, a in V034_MOE_JOBS])
def test_marlin_moe_bundle_holds_vllm_034s_kernel_tensors(name, arch, checkpoints, oracle_034, tmp_path):
    """vLLM 0.34 serves W4A4 checkpoints' experts with Marlin on sm80: each FusedMoE module holds the bundle's tensors
    under their names, byte for byte."""
    dumped = oracle_034["moe"] / f"{name}-{arch}-moe"
    assert not (dumped / "refused.txt").exists(), (dumped / "refused.txt").read_text()[:2000]
    convert(checkpoints[name], arch, tmp_path / "bundle", fuse=True, vllm="0.34")
    bundle = open_bundle(tmp_path / "bundle")
    theirs = load_file(dumped / "moe-rank-0.safetensors")
    meta = json.loads((dumped / "moe-rank-0.json").read_text())
    assert sorted(meta) == sorted(bundle.moe_layers())
    for module, info in meta.items():
        assert (info["backend"], info["experts"]) == ("MARLIN", "MarlinExperts"), info
        held = {k: v for k, v in bundle.moe_tensors(module).items() if k not in moe_marlin.KEPT}
        _assert_held_034(held, info, theirs, module)
