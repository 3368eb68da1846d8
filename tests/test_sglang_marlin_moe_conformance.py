"""SGLang 0.5.23 as the oracle for its FP4 Marlin MoE: every ``convert --engine sglang`` FusedMoE layer (and the dense
layers beside it) that SGLang serves through FP4 Marlin holds, per TP rank, exactly what SGLang's own ``get_model``
leaves on its module (every tensor by name, dtype, shape, strides, offset and storage bytes): ModelOpt NVFP4 and
W4A16_NVFP4 on an emulated sm90 / sm80 (its auto MoE runner backend there), compressed-tensors NVFP4A16 on sm80-sm120
and its W4A4 checkpoints on sm90 / sm80 (served weight-only); Qwen2-MoE (its dense shared expert beside the experts)
on sm90, and NVFP4A16 on sm100 (the shared expert FlashInfer's bf16 x fp4). SGLang's refusals are ours.

Not stored, compared by dtype and shape: FP4 Marlin's scratch ``workspace`` (sized by the GPU, SGLang's own function
makes it) and ModelOpt's ``w*_blockscale_swizzled``, which its ``create_weights`` swizzles from the still
uninitialized scale parameters and its Marlin path never writes or reads (their bytes are whatever memory held).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from repack.convert import convert
from repack.errors import RepackError
from repack.sample.synthetic import write_qwen_moe

from .conftest import PRODUCERS, seeded_folder
from .test_sglang_conformance import oracle_dumps, run_harness
from .test_sglang_moe_conformance import (
    DEEPSEEK,
    _refused,
    assert_converts_to_sglangs_state_or_both_refuse,
    assert_verify_names_what_is_not_sglangs,
    deepseek_v3,
    moe_modules,
)

UNSTORED = ("workspace", "w13_blockscale_swizzled", "w2_blockscale_swizzled")
# name -> (format, W4A4?, the shared expert's intermediate size: Qwen2-MoE, else Qwen3-MoE): the synthetic checkpoints
# (hidden 128, intermediate 128)
SYNTHETIC = {"mo": ("modelopt", True, 0), "mo16": ("modelopt", False, 0), "ct": ("compressed-tensors", True, 0),
             "ct16": ("compressed-tensors", False, 0), "q2mo": ("modelopt", True, 96),
             "q2ct16": ("compressed-tensors", False, 96)}
JOBS = ([(n, a) for n in ("mo", "mo16", "ct", "ct16") for a in ("sm90", "sm80")]
        + [("ct16", "sm120"), ("ct16", "sm100"), ("q2mo", "sm90"), ("q2ct16", "sm100")])
EP = ("mo", "mo16", "ct", "ct16", "q2mo")  # on sm90 with --ep
PRODUCER_JOBS = [("modelopt_moe_nvfp4", "sm90"), ("ct_moe_nvfp4", "sm80"), ("modelopt_moe_w4a16_nvfp4", "sm90"),
                 ("ct_moe_nvfp4a16", "sm120"), ("modelopt_moe_i48_nvfp4", "sm90"), ("ct_moe_i48_nvfp4", "sm90"),
                 ("ds-modelopt", "sm90"), ("ds-compressed-tensors", "sm90")]  # DeepSeek-V3 (DEEPSEEK)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    gen, root, _ = seeded_folder(tmp_path_factory, "sglang-marlin-moe-ckpts")
    out = {name: write_qwen_moe(root / name, fmt, generator=gen, layers=2, hidden=128, experts=4, intermediate=128,
                                w4a4=w4a4, shared_input_scales=True, shared_expert=shared)
           for name, (fmt, w4a4, shared) in SYNTHETIC.items()}
    out |= {name: deepseek_v3(fixture, root / name) for name, fixture in DEEPSEEK.items()}
    return out | {name: PRODUCERS / name for name, _ in PRODUCER_JOBS if name not in out}


@pytest.fixture(scope="module")
def oracle(checkpoints, tmp_path_factory) -> dict[int, Path]:
    return oracle_dumps(tmp_path_factory, "sglang-marlin-moe",
                        [f"{n}-{a}={checkpoints[n]}:{a}" for n, a in JOBS + PRODUCER_JOBS])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name,arch", JOBS + PRODUCER_JOBS, ids=[f"{n}-{a}" for n, a in JOBS + PRODUCER_JOBS])
def test_marlin_moe_bundle_is_byte_identical_to_sglang(name, arch, tp, checkpoints, oracle, tmp_path):
    assert_converts_to_sglangs_state_or_both_refuse(checkpoints[name], arch, oracle[tp] / f"{name}-{arch}",
                                                    tmp_path / "bundle", tp, moe_modules(name), unstored=UNSTORED)


def test_sglang_serves_these_moe_layers_with_fp4_marlin(oracle):
    """The jobs above are SGLang's FP4 Marlin MoE (not another backend's state that happens to match)."""
    for name, arch in JOBS:
        for layer in json.loads((oracle[1] / f"{name}-{arch}" / "rank-0.json").read_text()).values():
            if layer.get("moe"):
                assert layer["tensors"]["w13_weight_scale_2"]["dtype"] == "bfloat16" and "workspace" in layer["tensors"]


@pytest.mark.parametrize("fmt,arch", [("modelopt", "sm100"), ("modelopt", "sm120")])
def test_weight_only_modelopt_moe_on_blackwell_is_refused_in_one_line(fmt, arch, tmp_path):
    gen = torch.Generator().manual_seed(0)
    ckpt = write_qwen_moe(tmp_path / "ckpt", fmt, hidden=128, experts=2, intermediate=128, generator=gen, w4a4=False)
    with pytest.raises(RepackError, match="served weight-only are not written for SGLang there") as e:
        convert(ckpt, arch, tmp_path / "out", engine="sglang")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def plugin_oracle(checkpoints, oracle, tmp_path_factory) -> dict[int, Path]:
    """SGLang's state after loading each served job's bundle with --load-format nvfp4_repack, per TP size."""
    bundles = tmp_path_factory.mktemp("sglang-marlin-moe-bundles")
    out = {}
    for tp in (1, 2):
        jobs = []
        for name, arch in JOBS + PRODUCER_JOBS:
            if _refused(oracle[tp] / f"{name}-{arch}") is None:
                folder = bundles / f"{name}-{arch}-{tp}"
                convert(checkpoints[name], arch, folder, tp=tp, engine="sglang")
                jobs.append(f"{name}-{arch}={folder}:{arch}-plugin")
        out[tp] = tmp_path_factory.mktemp(f"sglang-marlin-moe-plugin-{tp}")
        run_harness(tp, out[tp], jobs)
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name,arch", JOBS + PRODUCER_JOBS, ids=[f"{n}-{a}" for n, a in JOBS + PRODUCER_JOBS])
def test_plugin_loads_sglangs_own_marlin_moe_state_or_both_refuse(name, arch, tp, checkpoints, oracle, plugin_oracle,
                                                                  tmp_path):
    """The same layers, tensors (name, dtype, shape, strides, offset, aliases) and non-tensor state; the bytes of
    every tensor but ModelOpt's uninitialized ``w*_blockscale_swizzled`` placeholders (module docstring). Where
    SGLang refuses the source there is no bundle: ours refuses too, in one line."""
    theirs = oracle[tp] / f"{name}-{arch}"
    if _refused(theirs) is not None:
        assert_converts_to_sglangs_state_or_both_refuse(checkpoints[name], arch, theirs, tmp_path / "bundle", tp,
                                                        moe_modules(name))
        return
    ours = plugin_oracle[tp] / f"{name}-{arch}"
    for rank in range(tp):
        assert not (ours / "refused.txt").exists(), (ours / "refused.txt").read_text()[-2000:]
        assert json.loads((ours / f"rank-{rank}.json").read_text()) == json.loads(
            (theirs / f"rank-{rank}.json").read_text())
        got, want = (load_file(folder / f"rank-{rank}.safetensors") for folder in (ours, theirs))
        assert set(got) == set(want)
        for key, tensor in want.items():
            if key.rpartition(".")[2] not in UNSTORED[1:]:
                assert torch.equal(got[key], tensor), key


@pytest.fixture(scope="module")
def ep_oracle(checkpoints, tmp_path_factory) -> Path:
    """SGLang's load of the synthetic checkpoints on sm90 with expert parallelism (``--ep-size 2``, TP 2)."""
    out = tmp_path_factory.mktemp("sglang-marlin-moe-ep")
    run_harness(2, out, [f"{name}-sm90={checkpoints[name]}:sm90+ep" for name in EP])
    return out


@pytest.mark.parametrize("name", EP)
def test_marlin_moe_ep_ranks_are_byte_identical_to_sglang(name, checkpoints, ep_oracle, tmp_path):
    """``convert --tp 2 --ep``: each rank's experts whole, ModelOpt's input scales every expert's."""
    dumped = ep_oracle / f"{name}-sm90"
    assert _refused(dumped) is None, _refused(dumped)[:2000]
    assert_converts_to_sglangs_state_or_both_refuse(checkpoints[name], "sm90", dumped, tmp_path / "bundle", 2,
                                                    moe_modules(name), ep=True, unstored=UNSTORED)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_verify_fails_a_marlin_moe_tensor_that_is_not_sglangs(fmt, tmp_path):
    """verify's exactness restates SGLang's Marlin MoE tensors from the source: a global scale SGLang computes
    otherwise, or an expert's codes (through the inverse and the index formulas), is named."""
    assert_verify_names_what_is_not_sglangs(fmt, "sm90", "w2_weight_scale_2", tmp_path)
