"""The SGLang plugin's packaging (its entry point is the register function, and nothing but the plugin imports SGLang)
and its refusals (its state, and the refusals inside SGLang's load: tests/test_sglang_conformance.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from repack.errors import RepackError

from .conftest import PRODUCERS, assert_plugin_entry_point


def test_entry_point_is_the_register_function_and_the_core_never_imports_sglang():
    assert_plugin_entry_point("sglang.srt.plugins", "sglang")


# The plugin's refusals, before SGLang builds a model (repack/sglang_plugin/refusals.py imports no SGLang): each of
# them, one line, naming what to run. The oracle (tests/test_sglang_conformance.py) checks three of them inside
# SGLang's own load; the GPU family, the --fp4-gemm-backend and the SGLang version are checked here only (audit: the
# plugin served a bundle under any SGLang version, and its family and backend refusals had no test).
SERVED = {"capability": (10, 0), "backend": "flashinfer_cutlass", "version": "0.5.23"}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> Path:
    from repack.convert import convert

    root = tmp_path_factory.mktemp("sglang-refusals")
    convert(PRODUCERS / "ct_nvfp4", "sm100", root / "sglang", engine="sglang")
    convert(PRODUCERS / "ct_nvfp4", "sm100", root / "vllm", fuse=True)
    return root


def _open(bundles: Path, name: str = "sglang", tp: tuple[int, int] = (1, 0), **running):
    from repack.sglang_plugin.refusals import open_rank_bundle

    given = {**SERVED, **running}
    return open_rank_bundle(bundles / name, *tp, given["capability"], given["backend"], given["version"])


@pytest.mark.parametrize("running", [{}, {"version": "0.5.23.post1"}, {"capability": (10, 3)}, {"capability": None},
                                     {"backend": "flashinfer_cudnn"}])
def test_the_plugin_opens_a_bundle_it_serves(bundles, running):
    assert _open(bundles, **running).manifest.engines == {"sglang": ["0.5.23"]}


@pytest.mark.parametrize("name,tp,running,says", [
    ("vllm", (1, 0), {}, "the bundle holds vllm's state (w4a4-cutlass-v1), not SGLang's; re-convert with --engine sglang"),
    ("sglang", (1, 0), {"version": "0.5.24"},
     "the bundle is for SGLang 0.5.23, but SGLang 0.5.24 is running, which nvfp4-repack does not support (SGLang "
     "0.5.23); serve it with SGLang 0.5.23"),
    ("sglang", (1, 0), {"version": "0.5.3"}, "but SGLang 0.5.3 is running"),
    ("sglang", (2, 1), {}, "the bundle is rank 0 of tensor-parallel size 1, but SGLang runs rank 1 of --tp 2"),
    ("sglang", (1, 0), {"capability": (9, 0)},
     "the bundle is for sm100 but this GPU is sm90; convert the source with --target sm90 --engine sglang"),
    ("sglang", (1, 0), {"backend": "marlin"},
     "--fp4-gemm-backend marlin holds other bytes than the bundle's (flashinfer_cutedsl); serve it with "
     "--fp4-gemm-backend flashinfer_cutedsl"),
    ("missing", (1, 0), {}, "is not an nvfp4-repack bundle (no manifest.json); convert it first with"),
])
def test_the_plugin_refuses_in_one_line(bundles, name, tp, running, says):
    with pytest.raises(RepackError) as refused:
        _open(bundles, name, tp, **running)
    assert says in str(refused.value) and "\n" not in str(refused.value), refused.value
