"""SGLang 0.5.23 itself as the oracle: every ``convert --engine sglang`` bundle layer, per tensor-parallel rank, holds
exactly what SGLang's own model loader + ``process_weights_after_loading`` leaves on its layer (every tensor by its
name, dtype, shape, strides, offset and bytes; the aliases it makes), for the dense W4A4 backend SGLang's ``auto``
picks on an emulated sm100 / sm120; SGLang's refusals are ours.

SGLang runs in its own virtualenv (tests/sglang/make_env.sh) through tests/sglang/harness.py, one process per TP size
(two on gloo for TP = 2). In CI a missing SGLang env fails these tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from repack.bundle.reader import open_bundle
from repack.convert import convert
from repack.errors import RepackError
from repack.sample.synthetic import write_llama
from repack.targets.base import restated_differences
from repack.targets.engines import SGLANG_0523
from repack.targets.sglang import ATTRIBUTES, DENSE_BACKENDS
from repack.verify import verify_output

from .conftest import PRODUCERS, assert_held_as, oracle_python, seeded_folder

HERE = Path(__file__).parent / "sglang"
VENV = Path(os.environ.get("NVFP4_REPACK_SGLANG_VENV", Path(__file__).parent.parent / ".venv-sglang"))
ARCHS = tuple(DENSE_BACKENDS)
FIXTURES = ["modelopt_nvfp4", "ct_nvfp4"]
# (hidden, heads, kv_heads, intermediate): "odd" has K, N not multiples of 32 or 128 (N = 16: one kv head of 16),
# 5 heads (TP = 2 refused); "tp" splits over 2 ranks with the single kv head replicated.
SYNTHETIC = {"odd": (80, 5, 1, 48), "tp": (96, 6, 1, 96)}
FORMATS = ("modelopt", "compressed-tensors")
NAMES = FIXTURES + [f"{shape}-{fmt}" for shape in SYNTHETIC for fmt in FORMATS]
JOBS = [(name, arch) for name in NAMES for arch in ARCHS]


def _sglang_python() -> Path:
    return oracle_python(VENV, "SGLang 0.5.23", "tests/sglang/make_env.sh")


def run_harness(tp: int, out: Path, jobs: list[str]) -> None:
    """SGLang's harness (tests/sglang/harness.py, in its venv) on ``jobs`` (``NAME=CKPT:ARCH``) at ``tp``, into ``out``."""
    subprocess.run([str(_sglang_python()), str(HERE / "harness.py"), "--tp", str(tp), "--out", str(out),
                    *[arg for job in jobs for arg in ("--job", job)]],
                   check=True, timeout=1500, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def oracle_dumps(tmp_path_factory, label: str, jobs: list[str]) -> dict[int, Path]:
    """SGLang's load of every job at TP 1 and 2: ``{tp: folder}`` (``folder/NAME``: the harness's dump)."""
    out = {}
    for tp in (1, 2):
        out[tp] = tmp_path_factory.mktemp(f"{label}-tp{tp}")
        run_harness(tp, out[tp], jobs)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    gen, root, _ = seeded_folder(tmp_path_factory, "sglang-ckpts")
    out = {name: PRODUCERS / name for name in FIXTURES}
    for shape, (hidden, heads, kv, inter) in SYNTHETIC.items():
        for fmt in FORMATS:
            out[f"{shape}-{fmt}"] = write_llama(root / f"{shape}-{fmt}", fmt, hidden=hidden, heads=heads, kv_heads=kv,
                                                intermediate=inter, generator=gen, layers=2, w4a4=True)
    return out


@pytest.fixture(scope="module")
def oracle(checkpoints, tmp_path_factory) -> dict[int, Path]:
    """SGLang's load-time result for every job, per TP size: ``{tp: folder}``."""
    return oracle_dumps(tmp_path_factory, "sglang", [f"{name}-{arch}={checkpoints[name]}:{arch}" for name, arch in JOBS])


SCRATCH = ("workspace",)  # FP4 Marlin's scratch, sized by the GPU: SGLang's own function makes it (the plugin too)


def _contiguous(view: dict) -> bool:
    strides, step = [], 1
    for size in reversed(view["shape"]):
        strides.insert(0, step)
        step *= size
    return view["stride"] == strides


def assert_stored_as(ours: torch.Tensor, view: dict, stored: torch.Tensor, what) -> None:
    """:func:`assert_held_as`; for a strided view SGLang's kernel preparation makes of a buffer (FlashInfer's 6-D view
    of the swizzled scales), the buffer: dtype and every byte of the storage (the plugin makes the view again, and
    its state test compares it)."""
    if _contiguous(view):
        assert_held_as(ours, view, stored, what)
    else:
        assert str(ours.dtype).replace("torch.", "") == view["dtype"] and ours.is_contiguous(), what
        assert torch.equal(ours.reshape(-1).view(torch.uint8), stored), what


def assert_rank_identical(bundle_dir: Path, dumped: Path, rank: int) -> int:
    """Every tensor SGLang holds on every NVFP4 linear layer, by name, dtype, shape, strides, offset and the bytes of
    its whole storage, is the bundle's tensor of that name (an alias SGLang makes, the tensor it aliases); its
    backend (FP4 Marlin's: marlin) is the manifest's kernel; its padding and partition sizes are the manifest's."""
    bundle = open_bundle(bundle_dir)
    theirs = load_file(dumped / f"rank-{rank}.safetensors")
    meta = json.loads((dumped / f"rank-{rank}.json").read_text())
    assert set(meta) == set(bundle.manifest.layers)
    layout = bundle.manifest.layout_id
    assert layout in SGLANG_0523.layouts
    for prefix, info in meta.items():
        record = bundle.manifest.layers[prefix]
        assert info["backend"] == bundle.manifest.kernels[0], prefix
        assert (info["input_size_per_partition"], info["output_size_per_partition"]) == (record.k, record.n), prefix
        padding = ATTRIBUTES.get(layout, {}).get("weights_padding_cols", record.weights_padding_cols)
        assert info.get("weights_padding_cols", padding) == padding, prefix
        held = {name: view for name, view in info["tensors"].items() if name not in SCRATCH}
        assert set(record.tensors) == {name for name, view in held.items() if "alias" not in view}, prefix
        for name, view in held.items():
            source = view.get("alias", name)
            assert_stored_as(bundle.read(f"{prefix}.{source}"), view, theirs[f"{prefix}.{source}"], (prefix, name))
    return len(meta)


def assert_converts_to_sglangs_state(checkpoint: Path, arch: str, dumped: Path, out: Path, tp: int = 1,
                                     **options) -> None:
    """``convert --engine sglang`` of ``checkpoint`` for ``arch`` at ``tp`` (with ``options``): every rank holds
    SGLang's state of ``dumped`` (8 layers), and verify against the source passes."""
    assert not (dumped / "refused.txt").exists(), (dumped / "refused.txt").read_text()[:2000]
    convert(checkpoint, arch, out, tp=tp, engine="sglang", **options)
    for rank in range(tp):
        assert assert_rank_identical(out / f"rank-{rank}" if tp > 1 else out, dumped, rank) == 8
    assert verify_output(out, source=checkpoint).passed


@pytest.mark.parametrize("name,arch", JOBS, ids=[f"{n}-{a}" for n, a in JOBS])
def test_bundle_is_byte_identical_to_sglang(name, arch, checkpoints, oracle, tmp_path):
    assert_converts_to_sglangs_state(checkpoints[name], arch, oracle[1] / f"{name}-{arch}", tmp_path / "bundle")


def assert_tp2_refused_as_sglang_refuses(checkpoint: Path, arch: str, dumped: Path, out: Path) -> None:
    """``convert --tp 2`` refuses in one line naming ``--tp 2`` and writes nothing, where SGLang refused the job or
    loads it mis-scaled (ct_nvfp4's down_proj, per-rank K of 88: SGLang loads it as vLLM does, with 88 // 16 = 5 block
    scales per rank, 10 of the 11 blocks, the second rank's shifted by half a block)."""
    with pytest.raises(RepackError, match="--tp 2") as ours:
        convert(checkpoint, arch, out, tp=2, engine="sglang")
    assert "\n" not in str(ours.value) and not out.exists()
    if not (dumped / "refused.txt").exists():
        down = json.loads((dumped / "rank-1.json").read_text())["model.layers.0.mlp.down_proj"]
        assert down["input_size_per_partition"] == 88 and down["tensors"]["weight_scale"]["shape"][1] == 8


@pytest.mark.parametrize("name,arch", JOBS, ids=[f"{n}-{a}" for n, a in JOBS])
def test_tp2_ranks_are_byte_identical_to_sglang_or_both_refuse(name, arch, checkpoints, oracle, tmp_path):
    dumped, out = oracle[2] / f"{name}-{arch}", tmp_path / "ranks"
    if not _served(oracle, name, arch, 2):
        assert_tp2_refused_as_sglang_refuses(checkpoints[name], arch, dumped, out)
        return
    assert_converts_to_sglangs_state(checkpoints[name], arch, dumped, out, tp=2)


# The plugin: each bundle (TP 1 and 2) loaded by SGLang through --load-format nvfp4_repack, against SGLang's own load
# of the source; and its refusals. PLUGIN_REFUSALS: job -> (the bundle to convert: checkpoint, tp, engine), the TP SGLang
# runs, what the refusal says.
PLUGIN_REFUSALS = {
    "vllm-bundle": (("modelopt_nvfp4", 1, "vllm"), 1, "holds vllm's state"),
    "tp-mismatch": (("modelopt_nvfp4", 1, "sglang"), 2, "tensor-parallel size 1"),
    "no-bundle": (None, 1, "is not an nvfp4-repack bundle"),
}


def _served(oracle: dict[int, Path], name: str, arch: str, tp: int) -> bool:
    """Whether SGLang loads the job at ``tp`` and we convert it (ct_nvfp4 at TP 2, loaded wrong, is refused)."""
    return not (oracle[tp] / f"{name}-{arch}" / "refused.txt").exists() and (tp, name) != (2, "ct_nvfp4")


@pytest.fixture(scope="module")
def plugin_oracle(checkpoints, oracle, tmp_path_factory) -> dict[int, Path]:
    """SGLang's state after loading each job's bundle with --load-format nvfp4_repack, per TP size (and the refusal
    jobs): ``{tp: folder}``."""
    bundles = tmp_path_factory.mktemp("sglang-bundles")
    jobs: dict[int, list[str]] = {1: [], 2: []}
    for tp in (1, 2):
        for name, arch in JOBS:
            if _served(oracle, name, arch, tp):
                convert(checkpoints[name], arch, bundles / f"{name}-{arch}-tp{tp}", tp=tp, engine="sglang")
                jobs[tp].append(f"{name}-{arch}={bundles / f'{name}-{arch}-tp{tp}'}:{arch}-plugin")
    for job, (made, tp, _) in PLUGIN_REFUSALS.items():
        folder = bundles / job
        if made is None:
            folder = checkpoints["modelopt_nvfp4"]
        else:
            name, bundle_tp, engine = made
            convert(checkpoints[name], "sm100", folder, tp=bundle_tp, fuse=True, engine=engine)
        jobs[tp].append(f"{job}={folder}:sm100-plugin")
    out = {}
    for tp, listed in jobs.items():
        out[tp] = tmp_path_factory.mktemp(f"sglang-plugin-tp{tp}")
        run_harness(tp, out[tp], listed)
    return out


def assert_same_state(ours: Path, theirs: Path, rank: int) -> None:
    """Two harness dumps hold the same layers, tensors (name, dtype, shape, strides, offset, aliases, bytes) and
    non-tensor state."""
    assert not (ours / "refused.txt").exists(), (ours / "refused.txt").read_text()[:2000]
    assert json.loads((ours / f"rank-{rank}.json").read_text()) == json.loads((theirs / f"rank-{rank}.json").read_text())
    got, want = (load_file(folder / f"rank-{rank}.safetensors") for folder in (ours, theirs))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("name,arch", JOBS, ids=[f"{n}-{a}" for n, a in JOBS])
@pytest.mark.parametrize("tp", [1, 2])
def test_plugin_loads_sglangs_own_state_or_both_refuse(name, arch, tp, checkpoints, oracle, plugin_oracle, tmp_path):
    """The plugin's load of each bundle is SGLang's load of the source; where there is no bundle (refused at
    ``--tp 2``), our refusal is SGLang's (or names the mis-scaled state it loads)."""
    if not _served(oracle, name, arch, tp):
        assert tp == 2, "refused at TP 1"
        assert_tp2_refused_as_sglang_refuses(checkpoints[name], arch, oracle[2] / f"{name}-{arch}", tmp_path / "ranks")
        return
    for rank in range(tp):
        assert_same_state(plugin_oracle[tp] / f"{name}-{arch}", oracle[tp] / f"{name}-{arch}", rank)


@pytest.mark.parametrize("job", sorted(PLUGIN_REFUSALS))
def test_plugin_refuses_in_one_line(job, plugin_oracle):
    _, tp, says = PLUGIN_REFUSALS[job]
    refused = (plugin_oracle[tp] / job / "refused.txt").read_text()
    assert says in refused.splitlines()[0] and refused.startswith("RepackError: "), refused[:500]


@pytest.mark.parametrize("fixture,options,says", [
    ("modelopt_nvfp4", {"rescale": True}, "--rescale"),
    ("ct_quip_vu_had32_nvfp4", {}, "online transforms"),
])
def test_what_sglang_bundles_do_not_hold_is_refused_in_one_line(fixture, options, says, tmp_path):
    with pytest.raises(RepackError, match=says) as refused:
        convert(PRODUCERS / fixture, "sm100", tmp_path / "out", engine="sglang", **options)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fixture", FIXTURES)
def test_verify_fails_an_sglang_scalar_that_does_not_follow_from_the_layer(fixture, tmp_path):
    """verify's exactness restates each SGLang layer from its codes, scales and kept scalars: a derived tensor that
    differs (alpha, input_scale_inv, ModelOpt's unswizzled weight_scale) is named."""
    convert(PRODUCERS / fixture, "sm100", tmp_path / "out", engine="sglang")
    bundle = open_bundle(tmp_path / "out")
    prefix = "model.layers.0.mlp.down_proj"  # K/16 = 11: ModelOpt keeps its loaded scales beside the swizzled ones
    record = bundle.manifest.layers[prefix]
    runtime = bundle.runtime_layer(prefix)
    assert restated_differences(bundle.target, runtime, record.n, record.k) == []
    wrong = {"alpha": runtime.named["alpha"] * 2}
    if fixture.startswith("modelopt"):
        scales = runtime.named["weight_scale"].clone()
        scales.view(torch.uint8)[0, 0] ^= 1
        wrong |= {"input_scale_inv": runtime.named["input_scale_inv"] * 2, "weight_scale": scales}
    bad = replace(runtime, named={**runtime.named, **wrong})
    assert restated_differences(bundle.target, bad, record.n, record.k) == sorted(wrong)
