"""Shared fixtures: fresh random NVFP4 checkpoints in either producer format, and each test's random seed."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tomllib
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from repack.nvfp4 import NVFP4Weight
from repack.sample.synthetic import random_nvfp4, write_checkpoint
from repack.targets.engines import engine_versions

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SEED_ENV = "NVFP4_TEST_SEED"
PRODUCERS = Path(__file__).parent / "data" / "producers"

# Producer fixtures with online transforms (llm-compressor QuIP / SpinQuant): these convert, run and verify...
TRANSFORM_FIXTURES = sorted(p.name for p in PRODUCERS.glob("ct_quip_*")) + sorted(
    p.name for p in PRODUCERS.glob("ct_spinquant_*"))
# ...except these, which convert refuses, with (part of) the reason it gives.
REFUSED_FIXTURES = {
    "ct_quip_vu_rmat16_nvfp4a16": "condition number",  # torch.rand matrices: bf16 cannot compute the function
    "ct_spinquant_r3_had16_nvfp4a16": "transform scheme 'R3': location 'q_attn' is not supported",
}
TRANSFORM_FIXTURES = [f for f in TRANSFORM_FIXTURES if f not in REFUSED_FIXTURES]
# MoE fixtures (Qwen3-MoE, DeepSeek-V3, Mixtral, and their bf16 bases): tests/test_moe.py and
# tests/test_vllm_moe_conformance.py; the dense tests, which compare against the Llama base_bf16, leave them out.
MOE_FIXTURES = sorted(p.name for pattern in ("*_moe_*", "*_deepseek_v3_*", "*_mixtral_*")
                      for p in PRODUCERS.glob(pattern))

# Curated layer shapes (N, K): multiples of 16 but not of 64, N = 16, and a large layer.
ODD_SHAPES = [(16, 16), (48, 80), (16, 1008), (200, 336), (176, 64)]
LAYER_SHAPES = ODD_SHAPES + [(128, 128), (1024, 4096)]


def require(module: str):
    """Import ``module``; in CI a missing conformance dependency fails instead of skipping."""
    if IN_CI:
        return __import__(module)
    return pytest.importorskip(module)


def seeded_folder(tmp_path_factory, name: str) -> tuple[torch.Generator, Path, int]:
    """A generator of a fresh random seed, a temporary folder ``name`` for a module's synthetic checkpoints, and the
    seed (printed, to reproduce a failure)."""
    seed = int(torch.randint(0, 2**31, ()))
    print(f"{name} seed {seed}")
    return torch.Generator().manual_seed(seed), tmp_path_factory.mktemp(name), seed


def assert_held_as(ours: torch.Tensor, view: dict, stored: torch.Tensor, what) -> None:
    """``ours`` is an engine's tensor as an oracle dumped it: ``view``'s dtype, shape, strides and offset, and
    ``stored``, the bytes of its whole storage."""
    got = (str(ours.dtype).replace("torch.", ""), list(ours.shape), list(ours.stride()), ours.storage_offset())
    assert got == (view["dtype"], view["shape"], view["stride"], view["offset"]), what
    assert torch.equal(ours.reshape(-1).view(torch.uint8), stored), what


def assert_plugin_entry_point(group: str, engine: str) -> None:
    """pyproject's ``group`` entry point ``nvfp4_repack`` is a callable register function, and importing it with
    the whole core (CLI, convert, verify, runtime, the targets) imports no ``engine``: only its plugin does, when run."""
    root = Path(__file__).resolve().parents[1]
    entry = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"][group]
    module, _, name = entry["nvfp4_repack"].partition(":")
    code = (f"import sys, repack.cli, repack.convert, repack.verify, repack.runtime, repack.targets.sglang, {module}; "
            f"assert callable({module}.{name}); assert {engine!r} not in sys.modules, 'imported {engine}'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})


def oracle_python(venv: Path, what: str, make_env: str) -> Path:
    """An engine oracle's interpreter in ``venv`` (``make_env`` builds it: the README's test command runs it before
    pytest); where it is missing, a skip naming ``make_env``, or in CI a failure."""
    python = venv / "bin" / "python"
    if not python.exists():
        message = f"{what} oracle env missing at {venv}: run {make_env}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return python


def seed_for(nodeid: str) -> int:
    """``NVFP4_TEST_SEED`` if set, else a hash of the test id: stable across runs, different per test."""
    return int(os.environ.get(SEED_ENV) or zlib.crc32(nodeid.encode()))


def pytest_report_header(config) -> str | None:
    """The vLLM this session can import, if any: every GPU result (tests/test_gpu_*.py) records the version it ran
    on (the CPU oracles name theirs in each test id)."""
    from .vllm_gpu import vllm_version

    version = vllm_version()
    return f"vLLM {version}" if version else None


VLLM_VERSIONS = [v.version for v in engine_versions("vllm")]  # one oracle venv each (tests/vllm/make_env.sh)


@pytest.fixture(scope="module", params=VLLM_VERSIONS, ids=[f"vllm{v}" for v in VLLM_VERSIONS])
def vllm_version(request) -> str:
    """Each supported vLLM version in turn: every test on a vLLM oracle runs against each version's own load."""
    return request.param


@pytest.fixture(autouse=True)
def random_seed(request) -> int:
    """Seed torch's and ``random``'s global generators for every test; a failing test's report prints the seed."""
    seed = seed_for(request.node.nodeid)
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seeds = [value for key, value in item.user_properties if key == "seed"]
    if report.failed and seeds:
        report.sections.append(("random seed", f"{SEED_ENV}={seeds[0]} reproduces this test's random inputs"))
    return report


@dataclass
class SyntheticModel:
    path: Path
    fmt: str
    w4a4: bool
    layers: dict[str, NVFP4Weight]
    plain: dict[str, torch.Tensor]


@pytest.fixture
def make_model(tmp_path: Path):
    """Factory: write a random NVFP4 checkpoint (a new draw from the test's seeded generator each call)."""
    counter = iter(range(1000))

    def make(
        fmt: str = "compressed-tensors",
        *,
        w4a4: bool = False,
        shapes: list[tuple[int, int]] | None = None,
        shards: int = 1,
        seed: int | None = None,
    ) -> SyntheticModel:
        gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ())))
        layers = {
            f"model.layers.{i}.mlp.proj": random_nvfp4(n, k, gen) for i, (n, k) in enumerate(shapes or ODD_SHAPES)
        }
        plain = {
            "model.embed_tokens.weight": torch.randn(32, 16, generator=gen).to(torch.bfloat16),
            "lm_head.weight": torch.randn(32, 16, generator=gen).to(torch.float16),
            "model.norm.weight": torch.randn(16, generator=gen),
        }
        root = tmp_path / f"model-{next(counter)}"
        write_checkpoint(root, layers, plain, fmt=fmt, w4a4=w4a4, shards=shards, ignore=["lm_head"],
                         config={"model_type": "llama"})
        (root / "tokenizer_config.json").write_text('{"model_max_length": 128}')
        (root / "recipe.yaml").write_text("quant_stage: {}\n")
        return SyntheticModel(root, fmt, w4a4, layers, plain)

    return make
