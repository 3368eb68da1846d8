"""``convert --fuse [--tp N] [--ep]`` on NVFP4 MoE checkpoints: the FusedMoE layers' manifest records, the bundle
reader's MoE API, verify on MoE bundles (a corrupted expert, swapped experts, swapped w1/w3 halves caught from the
command line), inspect, and the refusals. Byte conformance with vLLM's own load: tests/test_vllm_moe_conformance.py
(``-k cli``)."""

from __future__ import annotations

import json

import pytest
import torch

from repack.bundle.layers import assemble_experts, plan_experts
from repack.bundle.reader import open_bundle
from repack.cli import main
from repack.formats import read_source
from repack.targets import moe_cutlass, moe_trtllm

from .conftest import PRODUCERS

LAYOUTS = {"sm100": moe_trtllm, "sm120": moe_cutlass}


@pytest.mark.parametrize("target", LAYOUTS)
@pytest.mark.parametrize("name,tp,ep", [("ct_moe_nvfp4", 1, False), ("modelopt_moe_nvfp4", 2, False),
                                        ("ct_moe_nvfp4", 2, True)])
def test_convert_writes_each_fused_moe_layer_under_vllms_module_with_its_record(tmp_path, name, tp, ep, target):
    """Every rank's FusedMoE tensors, read through ``Bundle.moe_tensors``, are the layout of that rank's experts cut
    from the source (independently planned here), and the record says which experts, rows and layout."""
    out = tmp_path / "out"
    args = ["convert", str(PRODUCERS / name), "-t", target, "--fuse", "-o", str(out), "--tp", str(tp)]
    assert main(args + (["--ep"] if ep else [])) == 0
    source = read_source(PRODUCERS / name)
    layout = LAYOUTS[target]
    for rank in range(tp):
        bundle = open_bundle(out / f"rank-{rank}" if tp > 1 else out)
        assert bundle.manifest.bundle_format_version == 5 and bundle.moe_layout is layout
        plans = plan_experts(source, tp, rank, ep)
        records = bundle.moe_layers()
        assert list(records) == [f"model.layers.{i}.mlp.experts.routed_experts" for i in range(2)]
        for module, record in records.items():
            plan = plans[record.source]
            first, last = plan.experts
            assert (record.layout_id, record.backend, record.kernel) == (layout.LAYOUT_ID, layout.BACKEND, layout.KERNEL)
            assert (record.num_experts, record.experts, record.rows, record.hidden, record.intermediate, record.top_k) \
                == (4, [first, last], list(plan.rows), 64, 128 // (1 if ep else tp), 2)
            assert record.members["down"] == [f"{record.source}.{e}.down_proj" for e in range(first, last)]
            assert record.input_scales == ("all" if name.startswith("modelopt") else "local")
            assert record.expert_map == ([e - first if first <= e < last else -1 for e in range(4)] if ep else None)
            held = bundle.moe_tensors(module)
            expected = layout.to_runtime(assemble_experts(source, plan), plan.prefix)
            assert set(held) == set(expected) == set(layout.TENSORS)
            for part, tensor in expected.items():
                assert torch.equal(held[part].view(torch.uint8), tensor.view(torch.uint8)), (rank, module, part)
        # the experts' activation scales are folded into the records' tensors: no longer passthrough
        assert not [n for n in bundle.manifest.passthrough if ".experts." in n]
        assert not [p for p in bundle.manifest.layers if ".experts." in p]
