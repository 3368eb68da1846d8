"""SGLang 0.5.23 itself as the oracle for NVFP4 MoE: every ``convert --engine sglang`` FusedMoE layer (and the
model's dense layers beside it), per tensor-parallel rank, holds exactly what SGLang's own ``get_model`` leaves on its
module on an emulated sm100 / sm120 (every tensor by its name, dtype, shape, strides, offset and the bytes of its
storage; the names SGLang binds to one storage), for the MoE runner backend each bundle is for
(``targets/engines.py``: ModelOpt FlashInfer TRT-LLM-gen on sm100, its ``auto`` for Qwen3-MoE there; ModelOpt FlashInfer
CUTLASS on sm120, ``--moe-runner-backend flashinfer_cutlass``; compressed-tensors ``auto``, its CUTLASS state, on
both); SGLang's refusals are ours, and its plugin loads each bundle into that state.

Checkpoints: the producers' Qwen3-MoE fixtures (hidden 64: refused by SGLang's TRT-LLM-gen; intermediate 128 and 48)
and synthetic ones (hidden 128, intermediate 96: TRT-LLM-gen pads it to 128 at TP 1 and to 64 per rank at TP 2, where
SGLang cuts the rows 64 + 32; CUTLASS refuses ModelOpt's 2I = 192; hidden 256 with five experts; gate and up
multipliers apart), in both formats, each expert's gate and up input scales equal as the producers calibrate them;
a synthetic Qwen2-MoE (a dense NVFP4 shared expert beside each FusedMoE, its bf16 ``shared_expert_gate``, q/k/v
biases; ModelOpt on sm100 run with ``--moe-runner-backend flashinfer_trtllm``, SGLang's auto there being "auto" for
it); the producers' Qwen2-MoE, whose dense first layer SGLang builds as MoE, refused. SGLang runs in its venv through
tests/sglang/harness.py. DeepSeek-V3: the producers' fixtures (a dense first layer, a shared expert; bf16 MLA) with the
``rope_scaling`` and ``moe_layer_freq`` real DeepSeek-V3 configs have (:func:`deepseek_v3`), on SGLang's CUTLASS MoE
(its TRT-LLM-gen refuses their hidden size 64, and ours is refused as not checked).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Collection
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from repack.bundle.reader import open_bundle
from repack.convert import convert
from repack.errors import RepackError
from repack.formats import read_source
from repack.formats.moe import expert_groups
from repack.sample.synthetic import write_qwen_moe
from repack.targets.engines import SGLANG_MOE_BACKENDS
from repack.targets.moe import MADE_FROM, moe_layout
from repack.targets.sglang import check_sglang_moe_architecture
from repack.verify import expert_plan, verify_output
from repack.verify_moe import engine_expert_findings

from .conftest import PRODUCERS, assert_held_as, seeded_folder
from .test_sglang_conformance import SCRATCH, assert_same_state, assert_stored_as, run_harness

ARCHS = ("sm100", "sm120")
PRODUCER_FIXTURES = ["modelopt_moe_nvfp4", "ct_moe_nvfp4", "modelopt_moe_i48_nvfp4", "ct_moe_i48_nvfp4"]
# "apart": gate and up multipliers that differ, which only ModelOpt's TRT-LLM-gen state holds (g1_alphas_up,
# g1_scale_c); SGLang's CUTLASS paths scale both halves with gate's (we refuse those)
SYNTHETIC = {"h128": dict(hidden=128, experts=3, intermediate=96), "h256": dict(hidden=256, experts=5, intermediate=256),
             "apart": dict(hidden=128, experts=4, intermediate=128, shared_scales=False),
             "qwen2": dict(hidden=128, experts=4, intermediate=128, shared_expert=96)}  # Qwen2-MoE: + a shared expert
FORMATS = ("modelopt", "compressed-tensors")
DEEPSEEK = {"ds-modelopt": "modelopt_deepseek_v3_nvfp4", "ds-compressed-tensors": "ct_deepseek_v3_nvfp4"}
NAMES = PRODUCER_FIXTURES + [f"{shape}-{fmt}" for shape in SYNTHETIC for fmt in FORMATS] + list(DEEPSEEK)
JOBS = [(name, arch) for name in NAMES for arch in ARCHS if (name, arch) != ("ds-modelopt", "sm100")]
# what real DeepSeek-V3 configs hold and the producers' tiny ones (transformers 5) do not: SGLang's deepseek_v2.py
# reads moe_layer_freq, and its CPU RoPE (the harness's) takes only DeepSeek's YaRN
DEEPSEEK_CONFIG = {"moe_layer_freq": 1, "rope_scaling": {
    "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 1.0}}


def deepseek_v3(fixture: str, out: Path) -> Path:
    """The producers' DeepSeek-V3 ``fixture`` copied to ``out`` with :data:`DEEPSEEK_CONFIG` in its config.json."""
    shutil.copytree(PRODUCERS / fixture, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **DEEPSEEK_CONFIG}, indent=2))
    return out


def moe_modules(name: str) -> int:
    """How many FusedMoE layers checkpoint ``name`` has (DeepSeek-V3's first layer is dense)."""
    return 1 if name.startswith("ds-") else 2


def _format(name: str) -> str:
    return "compressed-tensors" if name.startswith("ct_") or name.endswith("compressed-tensors") else "modelopt"


def _spec(name: str, arch: str) -> str:
    """The harness's ARCH[@MOE_BACKEND]: SGLang run with the MoE runner backend the bundle is for (auto: none; its auto
    picks TRT-LLM-gen on sm100 for Qwen3-MoE only)."""
    backend = SGLANG_MOE_BACKENDS[(_format(name), arch)]
    picked = (arch, backend) == ("sm100", "flashinfer_trtllm") and not name.startswith("qwen2")
    return arch if backend == "auto" or picked else f"{arch}@{backend}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    gen, root, _ = seeded_folder(tmp_path_factory, "sglang-moe-ckpts")
    out = {name: PRODUCERS / name for name in (*PRODUCER_FIXTURES, "ct_qwen2_moe_nvfp4")}
    out.update({name: deepseek_v3(fixture, root / name) for name, fixture in DEEPSEEK.items()})
    for shape, kwargs in SYNTHETIC.items():
        for fmt in FORMATS:
            out[f"{shape}-{fmt}"] = write_qwen_moe(root / f"{shape}-{fmt}", fmt, generator=gen, layers=2,
                                                   shared_input_scales=True, **kwargs)
    return out


# jobs beside the bundles' own: SGLang's plain auto for ModelOpt on sm120 and for Qwen2-MoE on sm100 (what the
# bundle's backend avoids); the producers' Qwen2-MoE (a dense first layer, refused)
AUTO_JOBS = {"modelopt_moe_nvfp4-sm120auto": ("modelopt_moe_nvfp4", "sm120"),
             "qwen2-modelopt-sm100auto": ("qwen2-modelopt", "sm100"),
             "ct_qwen2_moe_nvfp4-sm100": ("ct_qwen2_moe_nvfp4", "sm100"),
             "ds-modelopt-sm100": ("ds-modelopt", "sm100@flashinfer_trtllm")}


@pytest.fixture(scope="module")
def oracle(checkpoints, tmp_path_factory) -> dict[int, Path]:
    """SGLang's load-time result for every job, per TP size: ``{tp: folder}``."""
    out = {}
    for key, tp, ep in ((1, 1, ""), (2, 2, ""), ("ep", 2, "+ep")):
        out[key] = tmp_path_factory.mktemp(f"sglang-moe-{key}")
        jobs = [f"{name}-{arch}={checkpoints[name]}:{_spec(name, arch)}{ep}" for name, arch in JOBS]
        if key == 1:
            jobs += [f"{job}={checkpoints[name]}:{arch}" for job, (name, arch) in AUTO_JOBS.items()]
        run_harness(tp, out[key], jobs)
    return out


def _storage_groups(names: dict[str, str]) -> set[frozenset[str]]:
    """``name -> the name it is stored under`` as the sets of names that share one storage."""
    groups: dict[str, set[str]] = {}
    for name, held in names.items():
        groups.setdefault(held, set()).add(name)
    return {frozenset(g) for g in groups.values()}


# a dense layer's bf16 tensors that are no NVFP4 state (Qwen2-MoE's qkv bias): the bundle passes the checkpoint's
# through and SGLang's own loader fuses them (the plugin tests compare them with SGLang's load of the source)
PASSTHROUGH = {"bias"}


def bundle_name(held: Collection[str], stored: str, info: dict) -> str:
    """The name under which a bundle layer holding ``held`` stores the storage SGLang dumped as ``stored``: one of the
    names SGLang binds to it (DeepSeek-V3's dense MLPs bind ``weight`` to compressed-tensors' ``weight_packed``)."""
    names = [stored, *(n for n, view in info["tensors"].items() if view.get("alias") == stored)]
    return next((n for n in names if n in held), stored)


def assert_rank_identical(bundle_dir: Path, dumped: Path, rank: int, unstored: tuple[str, ...] = ()) -> int:
    """Every tensor SGLang holds on every FusedMoE module and NVFP4 linear layer is the bundle's (by name, dtype, shape,
    strides, offset, the bytes of its whole storage, and which names share a storage); the module's backend, method
    and local experts are the manifest's. ``unstored``: FusedMoE tensors the bundle does not hold (FP4 Marlin's
    scratch, placeholders no kernel reads), whose names alone are SGLang's; the dense layers' scratch (``SCRATCH``)
    and bf16 passthrough tensors (``PASSTHROUGH``) likewise. Returns the number of FusedMoE modules."""
    bundle = open_bundle(bundle_dir)
    theirs = load_file(dumped / f"rank-{rank}.safetensors")
    meta = json.loads((dumped / f"rank-{rank}.json").read_text())
    moe = {prefix: info for prefix, info in meta.items() if info.get("moe")}
    assert set(moe) == set(bundle.manifest.moe)
    assert set(meta) - set(moe) == set(bundle.manifest.layers)
    layout = moe_layout(bundle.target)
    for prefix, info in moe.items():
        record = bundle.manifest.moe[prefix]
        assert (info["backend"], [info["method"]]) == (record.backend, record.kernels), prefix
        assert info["num_local_experts"] == record.local_experts, prefix
        aliases = layout.aliases(record.hidden, record.intermediate)
        assert set(record.tensors) == set(info["tensors"]) - set(aliases) - set(unstored), prefix
        held = {name: view.get("alias", name) for name, view in info["tensors"].items()}
        assert _storage_groups(held) == _storage_groups({n: aliases.get(n, n) for n in info["tensors"]}), prefix
        for name, view in info["tensors"].items():
            if name not in unstored:
                ours = bundle.read(f"{prefix}.{aliases.get(name, name)}")
                assert_held_as(ours, view, theirs[f"{prefix}.{held[name]}"], (prefix, name))
    for prefix, info in meta.items():
        if prefix not in moe:
            for name, view in info["tensors"].items():
                if name in PASSTHROUGH or name in SCRATCH:
                    continue
                stored = view.get("alias", name)
                ours = bundle.read(f"{prefix}.{bundle_name(bundle.manifest.layers[prefix].tensors, stored, info)}")
                assert_stored_as(ours, view, theirs[f"{prefix}.{stored}"], (prefix, name))  # sm100's 6-D view: the buffer
    return len(moe)


def assert_converts_to_sglangs_state_or_both_refuse(checkpoint: Path, arch: str, dumped: Path, out: Path, tp: int,
                                                    modules: int, ep: bool = False, says: str | None = None,
                                                    ours_only: str = "", unstored: tuple[str, ...] = ()) -> None:
    """Where SGLang refused ``dumped``'s job, ``convert --engine sglang`` refuses too (in one line matching ``says``,
    writing nothing); else every rank of its bundle holds SGLang's state (``modules`` FusedMoE modules,
    :func:`assert_rank_identical`) and verify passes. ``ours_only``: the words of our refusal of a job SGLang loads
    (into a state that would mis-scale)."""
    options = dict(tp=tp, ep=ep, engine="sglang")
    assert not (ours_only and _refused(dumped)), "SGLang refuses it too"
    if ours_only or _refused(dumped) is not None:
        with pytest.raises(RepackError, match=ours_only or says) as ours:
            convert(checkpoint, arch, out, **options)
        assert "\n" not in str(ours.value) and not out.exists()
        assert ours_only or raised_by_sglang(_refused(dumped)), _refused(dumped)[-2000:]
        return
    convert(checkpoint, arch, out, **options)
    for rank in range(tp):
        assert assert_rank_identical(out / f"rank-{rank}" if tp > 1 else out, dumped, rank, unstored) == modules
    assert verify_output(out).passed


def _gate_up_refused(name: str, arch: str) -> bool:
    """Our refusal of differing gate / up multipliers where SGLang mis-scales up (it loads them)."""
    return name.startswith("apart") and (_format(name), arch) != ("modelopt", "sm100")


def _ours_only(name: str, arch: str) -> str:
    """The words of our refusal of differing gate / up multipliers where SGLang loads them (``""`` elsewhere)."""
    return "scales both halves with gate_proj's and would mis-scale up_proj" if _gate_up_refused(name, arch) else ""


def _refused(folder: Path) -> str | None:
    path = folder / "refused.txt"
    return path.read_text() if path.exists() else None


def raised_by_sglang(refused: str) -> bool:
    """Whether a harness's ``refused.txt`` (the exception, then its traceback) is an error SGLang's load raised, not a
    harness failure: its last frame in SGLang's or FlashInfer's package, or in tests/vllm/ports.py, the torch port of
    the CUDA op SGLang called there (whose checks are the op's: ``gptq_marlin_repack``'s N a multiple of 64)."""
    frames = re.findall(r'^  File "([^"]+)"', refused, re.MULTILINE)
    return bool(frames) and (frames[-1].endswith("/tests/vllm/ports.py") or any(
        f"/site-packages/{package}/" in frames[-1] for package in ("sglang", "flashinfer")))


def assert_job_converts_or_both_refuse(name: str, arch: str, key, checkpoints: dict, oracle: dict, out: Path) -> None:
    """Job ``name-arch`` of the oracle's ``key`` (TP 1, 2 or ``ep``): :func:`assert_converts_to_sglangs_state_or_both_refuse`;
    at TP 2 a per-rank intermediate of 24 (``i48``: not whole scale blocks) refused naming ``--tp 2``, as for vLLM."""
    tp, ep = (1, False) if key == 1 else (2, key == "ep")
    if key == 2 and "i48" in name:
        with pytest.raises(RepackError, match="--tp 2") as ours:
            convert(checkpoints[name], arch, out, tp=tp, engine="sglang")
        assert "\n" not in str(ours.value) and not out.exists()
        return
    assert_converts_to_sglangs_state_or_both_refuse(checkpoints[name], arch, oracle[key] / f"{name}-{arch}", out, tp,
                                                    moe_modules(name), ep=ep, ours_only=_ours_only(name, arch),
                                                    says=None if ep else "SGLang 0.5.23's FlashInfer")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name,arch", JOBS, ids=[f"{n}-{a}" for n, a in JOBS])
def test_moe_bundle_is_byte_identical_to_sglang_or_both_refuse(name, arch, tp, checkpoints, oracle, tmp_path):
    assert_job_converts_or_both_refuse(name, arch, tp, checkpoints, oracle, tmp_path / "bundle")


@pytest.mark.parametrize("name,arch", JOBS, ids=[f"{n}-{a}" for n, a in JOBS])
def test_ep_ranks_are_byte_identical_to_sglang_or_both_refuse(name, arch, checkpoints, oracle, tmp_path):
    """Expert parallelism (SGLang ``--ep-size 2`` = ``--tp 2``; ``convert --tp 2 --ep``): each rank's experts whole;
    ModelOpt's input scales every expert's, compressed-tensors' the rank's; SGLang's refusals (experts not a
    multiple of the ranks, its backends' shapes) are ours."""
    assert_job_converts_or_both_refuse(name, arch, "ep", checkpoints, oracle, tmp_path / "bundle")


def test_sglang_refuses_what_we_refuse(oracle):
    """The refusals the tests above match are SGLang's own (not a harness failure): its TRT-LLM-gen on a hidden size of
    64, its CUTLASS path on ModelOpt's 2I = 192, its expert parallelism on 3 experts over 2 ranks."""
    trtllm, cutlass = (_refused(oracle[1] / job) for job in ("modelopt_moe_nvfp4-sm100", "h128-modelopt-sm120"))
    assert trtllm is not None and "get_shuffle_matrix_sf_a_row_indices" in trtllm and "M % 128 == 0" in trtllm
    assert cutlass is not None and "The intermediate size required padding" in cutlass
    ep = _refused(oracle["ep"] / "h128-compressed-tensors-sm100")
    assert ep is not None and "_num_global_routed % storage_ep_size == 0" in ep


@pytest.mark.parametrize("job", ["modelopt_moe_nvfp4-sm120auto", "qwen2-modelopt-sm100auto"])
def test_sglang_auto_leaves_a_state_its_runner_does_not_read(job, oracle):
    """Why the ModelOpt sm120 bundle is for --moe-runner-backend flashinfer_cutlass and a Qwen2-MoE sm100 one for
    flashinfer_trtllm: SGLang's auto (without --quantization modelopt_fp4 on sm120; on sm100 for a model with no
    override) leaves the runner backend "auto", whose create_moe_runner takes TRT-LLM-gen (sm100-only kernels) and
    whose load makes no g1_scale_c for it."""
    info = json.loads((oracle[1] / job / "rank-0.json").read_text())
    moe = [layer for layer in info.values() if layer.get("moe")]
    assert moe and all(layer["backend"] == "auto" and "g1_scale_c" not in layer["tensors"] for layer in moe)


def test_qwen2_moe_with_a_dense_layer_is_refused_as_sglang_builds_it_as_moe(oracle, tmp_path):
    """SGLang 0.5.23's Qwen2-MoE reads no mlp_only_layers: the producers' fixture (layer 0 dense) gets a FusedMoE and a
    shared expert in layer 0, and the checkpoint's dense MLP there is held nowhere. Refused for both producers."""
    meta = json.loads((oracle[1] / "ct_qwen2_moe_nvfp4-sm100" / "rank-0.json").read_text())
    assert meta["model.layers.0.mlp.experts"]["moe"] and "model.layers.0.mlp.shared_expert.gate_up_proj" in meta
    assert "model.layers.0.mlp.gate_proj" in read_source(PRODUCERS / "ct_qwen2_moe_nvfp4").layers
    assert not any(prefix.startswith("model.layers.0.mlp.gate_up_proj") for prefix in meta)
    for fixture in ("ct_qwen2_moe_nvfp4", "modelopt_qwen2_moe_nvfp4"):
        with pytest.raises(RepackError, match="layer 0 has a dense MLP .* builds every .* layer as MoE") as refused:
            convert(PRODUCERS / fixture, "sm100", tmp_path / "out", engine="sglang")
        assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()


def test_deepseek_v3_where_sglang_is_not_checked_is_refused_in_one_line(oracle, checkpoints, tmp_path):
    """ModelOpt DeepSeek-V3 on sm100 (TRT-LLM-gen): SGLang refuses the producers' fixture (hidden size 64), so nothing
    of that backend's DeepSeek-V3 load is checked here; refused whatever the hidden size."""
    assert "M % 128 == 0" in _refused(oracle[1] / "ds-modelopt-sm100")
    with pytest.raises(RepackError, match="on SGLang's flashinfer_trtllm MoE are not checked against its load") as e:
        convert(checkpoints["ds-modelopt"], "sm100", tmp_path / "out", engine="sglang")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_deepseek_v3_whose_shared_expert_sglang_fuses_is_refused_in_one_line():
    """SGLang 0.5.23 fuses a DeepSeek-V3 / R1 shared expert into the FusedMoE as expert 257 (256 routed experts, one
    shared; read from deepseek_v2.py: its CPU load, the harness's, never fuses): that state is not written."""
    config = {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256, "n_shared_experts": 1}
    with pytest.raises(RepackError, match="fuses the shared expert .* 256 routed experts") as e:
        check_sglang_moe_architecture(config, ["model.layers.3.mlp.experts"], "flashinfer_cutlass")
    assert "\n" not in str(e.value)
    check_sglang_moe_architecture({**config, "n_routed_experts": 4}, ["model.layers.3.mlp.experts"], "flashinfer_cutlass")


@pytest.mark.parametrize("fixture,says", [
    ("modelopt_mixtral_nvfp4", "QuantMixtralForCausalLM"),
    ("ct_mixtral_nvfp4", "not at all"),
])
def test_moe_architectures_not_written_for_sglang_are_refused_in_one_line(fixture, says, tmp_path):
    with pytest.raises(RepackError, match=says) as refused:
        convert(PRODUCERS / fixture, "sm100", tmp_path / "out", engine="sglang")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


# The plugin: each bundle (TP 1 and 2) loaded by SGLang through --load-format nvfp4_repack (with the MoE runner backend
# it is for), against SGLang's own load of the source; and its refusal of another MoE runner backend.
def _served(oracle: dict, name: str, arch: str, key) -> bool:
    return (_refused(oracle[key] / f"{name}-{arch}") is None and not (key == 2 and "i48" in name)
            and not _gate_up_refused(name, arch))


@pytest.fixture(scope="module")
def plugin_oracle(checkpoints, oracle, tmp_path_factory) -> dict[int, Path]:
    """SGLang's state after loading each served job's bundle with --load-format nvfp4_repack, per TP size (and, at
    TP 1, the ModelOpt sm120 bundle under SGLang's plain auto, ``backend-mismatch``): ``{tp: folder}``."""
    bundles = tmp_path_factory.mktemp("sglang-moe-bundles")
    out = {}
    for key, tp, ep in ((1, 1, ""), (2, 2, ""), ("ep", 2, "+ep")):
        jobs = []
        for name, arch in JOBS:
            if _served(oracle, name, arch, key):
                folder = bundles / f"{name}-{arch}-{key}"
                convert(checkpoints[name], arch, folder, tp=tp, ep=bool(ep), engine="sglang")
                arch_plugin = _spec(name, arch).replace(arch, f"{arch}-plugin", 1)
                jobs.append(f"{name}-{arch}={folder}:{arch_plugin}{ep}")
        if key == 1:
            jobs.append(f"backend-mismatch={bundles / 'modelopt_moe_nvfp4-sm120-1'}:sm120-plugin")
            jobs.append(f"qwen2-backend-mismatch={bundles / 'qwen2-modelopt-sm100-1'}:sm100-plugin")
        if key == "ep":  # a --tp bundle (rows split) under SGLang's expert parallelism
            jobs.append(f"ep-mismatch={bundles / 'ct_moe_nvfp4-sm100-2'}:sm100-plugin+ep")
        out[key] = tmp_path_factory.mktemp(f"sglang-moe-plugin-{key}")
        run_harness(tp, out[key], jobs)
    return out


@pytest.mark.parametrize("key", [1, 2, "ep"])
@pytest.mark.parametrize("name,arch", JOBS, ids=[f"{n}-{a}" for n, a in JOBS])
def test_plugin_loads_sglangs_own_moe_state_or_both_refuse(name, arch, key, checkpoints, oracle, plugin_oracle,
                                                           tmp_path):
    """The plugin's load of each bundle is SGLang's load of the source; where there is no bundle, both refuse (ours
    in one line, SGLang's error its own) or ours names the state SGLang would mis-scale (:func:`_ours_only`)."""
    if not _served(oracle, name, arch, key):
        assert_job_converts_or_both_refuse(name, arch, key, checkpoints, oracle, tmp_path / "bundle")
        return
    for rank in range(1 if key == 1 else 2):
        assert_same_state(plugin_oracle[key] / f"{name}-{arch}", oracle[key] / f"{name}-{arch}", rank)


@pytest.mark.parametrize("key,job,says", [(1, "backend-mismatch", "serve it with --moe-runner-backend flashinfer_cutlass"),
                                          (1, "qwen2-backend-mismatch", "serve it with --moe-runner-backend flashinfer_trtllm"),
                                          ("ep", "ep-mismatch", "serve it without --ep-size")])
def test_plugin_refuses_another_moe_placement_in_one_line(key, job, says, plugin_oracle):
    first = (plugin_oracle[key] / job / "refused.txt").read_text().splitlines()[0]
    assert first.startswith("RepackError: ") and says in first, first


def test_modelopt_gate_and_up_input_scales_that_differ_are_refused_for_sglang(tmp_path):
    """SGLang's FusedMoE loader writes each of a ModelOpt expert's w1 / w3 input_scale into both halves of its
    w13_input_scale (the last read stays): a state that depends on its load order is not written."""
    gen = torch.Generator().manual_seed(0)
    ckpt = write_qwen_moe(tmp_path / "ckpt", "modelopt", hidden=128, experts=2, intermediate=64, generator=gen)
    with pytest.raises(RepackError, match=r"experts.0.gate_proj: input_scale .* is not .*up_proj's .* both halves") as e:
        convert(ckpt, "sm100", tmp_path / "out", engine="sglang")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt,arch", [("modelopt", "sm100"), ("modelopt", "sm120"), ("compressed-tensors", "sm100")])
def test_verify_fails_an_sglang_moe_tensor_that_is_not_sglangs(fmt, arch, tmp_path):
    """verify's exactness restates every SGLang MoE tensor from the source: a scalar SGLang computes otherwise, or an
    expert's codes (through the layout's inverse and, for the first and last expert, its index formulas), is named."""
    assert_verify_names_what_is_not_sglangs(fmt, arch, "g1_alphas" if fmt == "modelopt" else "w13_input_scale_quant",
                                            tmp_path)


def assert_verify_names_what_is_not_sglangs(fmt: str, arch: str, scalar: str, tmp_path: Path) -> None:
    """An SGLang MoE bundle's first layer passes verify's per-expert exactness; the same with ``scalar`` doubled, or
    one code byte of expert 1's down_proj flipped, fails it, naming the tensor or the expert."""
    gen = torch.Generator().manual_seed(1)
    ckpt = write_qwen_moe(tmp_path / "ckpt", fmt, hidden=128, experts=2, intermediate=128, generator=gen,
                          shared_input_scales=True)
    convert(ckpt, arch, tmp_path / "out", engine="sglang")
    bundle, source = open_bundle(tmp_path / "out"), read_source(ckpt)
    module = "model.layers.0.mlp.experts"
    record, layout = bundle.manifest.moe[module], bundle.moe_layout
    plan, _ = expert_plan(record, expert_groups(source))
    held = {n: bundle.read(f"{module}.{n}") for n in record.tensors if n not in MADE_FROM}
    weights = {n: bundle.read(f"{module}.{n}") for n in record.tensors if n in MADE_FROM}

    def rows(name, first, last):
        return weights[name][first:last]

    assert engine_expert_findings(source, plan, held, rows, layout).problems == []
    wrong = {**held, scalar: held[scalar] * 2}
    assert engine_expert_findings(source, plan, wrong, rows, layout).problems == [
        f"{module}: {scalar} is not what SGLang computes from the source's scales"]
    weights["w2_weight"] = weights["w2_weight"].clone()
    weights["w2_weight"][1, 0, 0] ^= 0x11
    problems = engine_expert_findings(source, plan, held, rows, layout).problems
    assert problems == [f"{module}.1.down_proj: codes differ", f"{module}.1.down_proj: codes or block scales read by "
                        f"the {record.layout_id} index formulas differ from the source's"], problems
