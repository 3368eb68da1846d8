"""Serving engines and their versions as planning data: which layouts each version holds byte for byte after its own
post-load (so which versions one bundle serves), and what a version cannot serve from a bundle.

Torch-free, like :mod:`.families` (``nvfp4-repack targets`` reads it). A version row is one engine release series
(``vllm`` ``0.34``: the running release's ``major.minor``), checked against the release named in ``release`` by the
conformance oracle of that version (tests/vllm/). A bundle's manifest lists, per engine, the versions whose rows hold
all of its layouts and refuse none of its features (``engines``: ``{"vllm": ["0.33", "0.34"]}``); another engine
(SGLang) adds its rows here under its own key. Differences in bookkeeping only (names, retired parameters, views)
are not layout differences: the plugin reproduces each version's own (docs/serving.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import RepackError

# A bundle feature a version may not serve (found by the plan; the reason names what to do instead):
HADAMARD_W4A4 = "hadamard-w4a4"  # a W4A4 layer whose only online transforms are Hadamard input rotations of one
# block of 16..128 (targets/w4a4.py runs_humming): vLLM 0.33 runs QuTLASS on it, 0.34 Humming's Hadamard kernel

QUTLASS_MARLIN = "qutlass-marlin"  # a layer Marlin serves (sm120's weight-only layouts) whose every online input
# transform has a block of 16..128 (targets/w4a4.py runs_qutlass): on sm100 and up vLLM 0.33 gives it QuTLASS's method,
# which refuses a kernel other than FlashInfer's; 0.34 gives it its transform method around Marlin

# Every layout this project writes, by id: vLLM 0.33 and 0.34 hold each of them identically (every kernel-read
# tensor equal in name, dtype, shape, stride and value; tests/test_vllm_conformance.py checks both versions).
VLLM_LAYOUTS = ("sm100-cute-dsl-v1", "sm120-cute-dsl-v1", "sm90-triton-v2", "w4a4-cutlass-v1",
                "moe-flashinfer-trtllm-v1", "moe-flashinfer-cutlass-v1")


@dataclass(frozen=True)
class EngineVersion:
    """One release series of a serving engine.

    Attributes:
        engine: the engine's key in a manifest's ``engines`` (``vllm``).
        version: the release series (``0.34``): a running ``0.34.x`` is this version.
        release: the release its conformance oracle runs (``0.34.0``).
        layouts: the layout ids it holds byte for byte after its own post-load.
        refuses: bundle feature -> why this version cannot serve it from a bundle, and what to run instead.
        fused: whether it holds its fused modules only (q/k/v, gate/up; SGLang): its bundles are fused, as --fuse's.
        stored_scales: whether its layouts keep each partition's and expert's stored global scales as loaded (the plan
            reads them: SGLang), rather than the fused layer's one multiplier (vLLM).
        even_experts: whether its expert parallelism places ``E / N`` experts on each of N ranks and asserts the
            division (SGLang's ``--ep-size``; vLLM's places the remainder too).
        options: convert option -> why this engine's bundles cannot take it (a one-line refusal).
        transforms: why its bundles cannot hold a checkpoint's online transforms (a one-line refusal; None: they can).
        moe_checks: whether convert holds an MoE checkpoint to the engine's own MoE refusals before planning (SGLang's:
            architectures whose load is checked, shared-expert fusion, gate and up input scales; targets/sglang.py).
    """

    engine: str
    version: str
    release: str
    layouts: tuple[str, ...]
    refuses: Mapping[str, str] = field(default_factory=dict)
    fused: bool = False
    stored_scales: bool = False
    even_experts: bool = False
    options: Mapping[str, str] = field(default_factory=dict)
    transforms: str | None = None
    moe_checks: bool = False

    @property
    def label(self) -> str:
        return f"{self.engine} {self.version}"


# Marlin's (targets/marlin.py, moe_marlin.py): every kernel-read tensor checked against each version's own load
# (tests/test_vllm_marlin_conformance.py; 0.34 keeps more bookkeeping names beside them, as for the other layouts)
MARLIN_LAYOUTS = ("marlin-v1", "marlin-v1-w4a4", "marlin-fp16-v1", "marlin-fp16-v1-w4a4", "moe-marlin-v1",
                  "moe-marlin-fp16-v1")

VLLM_033 = EngineVersion("vllm", "0.33", "0.33.0", VLLM_LAYOUTS + MARLIN_LAYOUTS, {
    QUTLASS_MARLIN: "vLLM 0.33 serves this checkpoint's Hadamard-rotated layers (input blocks of 16..128) on sm100 / "
                    "sm120 through QuTLASS's method, which refuses Marlin's kernel (its own load of the source fails "
                    "so): convert with --vllm 0.34 and serve with vLLM 0.34",
})
VLLM_034 = EngineVersion("vllm", "0.34", "0.34.0", VLLM_LAYOUTS + MARLIN_LAYOUTS, {
    HADAMARD_W4A4: "vLLM 0.34 serves this W4A4 checkpoint's Hadamard-rotated layers on sm100 / sm120 through "
                   "Humming's Hadamard kernel (--weight-only on sm100 too: it follows the checkpoint's scheme), whose "
                   "layout Humming's CUDA ops make at load and nvfp4-repack does not write: convert with --vllm 0.33 "
                   "and serve with vLLM 0.33",
})

# SGLang's dense W4A4 state per source format (targets/sglang.py: w4a4's bytes under SGLang's names and scalars),
# checked against SGLang 0.5.23's own load by tests/sglang/; its auto dense FP4 backend on each family
# (initialize_fp4_gemm_config), and the --fp4-gemm-backend values that hold the same bytes (pad + swizzle;
# flashinfer_trtllm shuffles them, marlin repacks them)
SGLANG_LAYOUTS = {"modelopt": "sglang-modelopt-w4a4-v1", "compressed-tensors": "sglang-ct-w4a4-v1"}
SGLANG_DENSE_BACKENDS = {"sm100": "flashinfer_cutedsl", "sm120": "flashinfer_cutlass"}
SGLANG_SAME_STATE_BACKENDS = ("flashinfer_cutedsl", "flashinfer_cutlass", "flashinfer_cudnn")
# SGLang's weight-only state (targets/sglang.py: Marlin's and FlashInfer's bf16 x fp4 layouts under its names), per
# (source format, the checkpoint's activation scheme): FP4 Marlin for ModelOpt W4A16_NVFP4 on every GPU and for every
# checkpoint where its auto backend is Marlin (sm80-sm90: W4A4 checkpoints served weight-only); compressed-tensors
# NVFP4A16 on sm100 takes FlashInfer's bf16 x fp4 GEMM (prepare_bf16_fp4_weights, cute-dsl), elsewhere Marlin
SGLANG_MARLIN_LAYOUTS = {("modelopt", "W4A16"): "sglang-modelopt-marlin-v1",
                         ("compressed-tensors", "W4A16"): "sglang-ct-marlin-v1",
                         ("modelopt", "W4A4"): "sglang-modelopt-w4a4-marlin-v1",
                         ("compressed-tensors", "W4A4"): "sglang-ct-w4a4-marlin-v1"}
SGLANG_BF16_FP4_LAYOUT = "sglang-ct-w4a16-cutedsl-v1"
SGLANG_MARLIN_FAMILIES = ("sm90", "sm80")  # auto dense backend marlin: compute capability 8.0 to 9.x
SGLANG_WEIGHT_ONLY_FAMILIES = ("sm100", "sm120", *SGLANG_MARLIN_FAMILIES)  # sm75: SGLang's FP4 Marlin needs sm80
# SGLang's NVFP4 MoE state per (source format, family), checked against its own load by tests/sglang/: the layout id
# and the MoE runner backend (``--moe-runner-backend``) it is for. ModelOpt on sm100: FlashInfer TRT-LLM-gen, what
# SGLang's resolution picks for Qwen3-MoE there (arg_groups/model_overrides/qwen3_moe.py); on sm120 FlashInfer CUTLASS,
# which its auto takes only with --quantization modelopt_fp4 (else it leaves "auto", whose TRT-LLM-gen runner reads
# tensors that load never makes: serve with --moe-runner-backend flashinfer_cutlass). compressed-tensors on both:
# auto, whose CompressedTensorsW4A4Nvfp4MoE holds the CUTLASS state (swizzled scales, [up; gate]).
SGLANG_MOE_LAYOUTS = {("modelopt", "sm100"): "sglang-modelopt-moe-trtllm-v1",
                      ("modelopt", "sm120"): "sglang-modelopt-moe-cutlass-v1",
                      ("compressed-tensors", "sm100"): "sglang-ct-moe-cutlass-v1",
                      ("compressed-tensors", "sm120"): "sglang-ct-moe-cutlass-v1"}
SGLANG_MOE_BACKENDS = {("modelopt", "sm100"): "flashinfer_trtllm", ("modelopt", "sm120"): "flashinfer_cutlass",
                       ("compressed-tensors", "sm100"): "auto", ("compressed-tensors", "sm120"): "auto"}
# the MoE architectures whose SGLang load is checked (Mixtral: SGLang loads ModelOpt's experts as dense layers,
# QuantMixtralForCausalLM, and drops compressed-tensors' gate/up/down_proj experts unloaded). Qwen2-MoE: its shared
# expert a dense NVFP4 MLP beside the FusedMoE (never fused into it: models/qwen2_moe.py passes no
# support_shared_expert_fusion), and no model override, so ModelOpt on sm100 is served with --moe-runner-backend
# flashinfer_trtllm (its auto there leaves "auto", as on sm120). DeepSeek-V3: dense first layers and its shared
# experts dense NVFP4 MLPs, where SGLang does not fuse the shared expert into the FusedMoE (SGLANG_FUSED_SHARED_EXPERT)
SGLANG_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM")
# (n_routed_experts, n_shared_experts) for which SGLang 0.5.23 fuses an architecture's shared expert into the FusedMoE
# as one more expert (deepseek_v2.py shared_experts_fusion_disable_reason: DeepSeek-V3 / R1's 256 and 1, on CUDA from
# sm80, unless its MoE runner backend or --ep-size turns fusion off): a FusedMoE state not written
SGLANG_FUSED_SHARED_EXPERT = {"DeepseekV3ForCausalLM": (256, 1)}
# MoE runner backends an architecture's SGLang load is not checked on (the producers' DeepSeek-V3 has hidden size 64,
# which SGLang's TRT-LLM-gen refuses)
SGLANG_MOE_UNCHECKED_BACKENDS = {"DeepseekV3ForCausalLM": ("flashinfer_trtllm",)}
# the MoE architectures SGLang 0.5.23 builds with a FusedMoE on every decoder layer, reading neither mlp_only_layers
# nor decoder_sparse_step (qwen2_moe.py stage_facts: "all layers are sparse"): a checkpoint layer with a dense MLP
# gets experts that nothing loads, its dense MLP's weights dropped
SGLANG_ALL_LAYERS_MOE = ("Qwen2MoeForCausalLM",)
# SGLang's FP4 Marlin MoE state per source format (targets/sglang_marlin_moe.py: moe_marlin's bytes, SGLang's names):
# ModelOpt's auto MoE backend on sm80-sm9x (NVFP4 and W4A16_NVFP4), compressed-tensors NVFP4A16 on every GPU and its
# W4A4 checkpoints below sm100 (CompressedTensorsW4A16Nvfp4MoE)
SGLANG_MARLIN_MOE_LAYOUTS = {"modelopt": "sglang-modelopt-moe-marlin-v1", "compressed-tensors": "sglang-ct-moe-marlin-v1"}
SGLANG_0523 = EngineVersion("sglang", "0.5.23", "0.5.23", (
    *SGLANG_MARLIN_MOE_LAYOUTS.values(),
    *SGLANG_LAYOUTS.values(), *SGLANG_MARLIN_LAYOUTS.values(), SGLANG_BF16_FP4_LAYOUT,
    *dict.fromkeys(SGLANG_MOE_LAYOUTS.values())), fused=True, stored_scales=True, even_experts=True, options={
    "--rescale": "--engine sglang --rescale: SGLang keeps each partition's weight_scale_2 as loaded, so a rescaled "
                 "bundle would not be its state; convert without --rescale",
    "--linear-backend": "--linear-backend names a vLLM kernel; an --engine sglang bundle holds SGLang's choice"},
    transforms="--engine sglang: online transforms are not written for SGLang; convert without --engine for vLLM, "
               "which serves them (docs/transforms-serving.md)", moe_checks=True)

ENGINES: tuple[EngineVersion, ...] = (VLLM_033, VLLM_034, SGLANG_0523)  # per engine, oldest first
ENGINE_NAMES = tuple(dict.fromkeys(v.engine for v in ENGINES))  # vllm, sglang


def engine_versions(engine: str) -> list[EngineVersion]:
    """The supported versions of ``engine``, oldest first."""
    return [v for v in ENGINES if v.engine == engine]


def newest(engine: str) -> EngineVersion:
    return engine_versions(engine)[-1]


def resolve_version(engine: str, version: str | None) -> EngineVersion:
    """The row of ``engine`` ``version`` (``0.34``, a release ``0.34.0``, either as a tag: ``v0.34``; None: the
    newest), or a one-line refusal listing the supported ones."""
    if version is None:
        return newest(engine)
    number = version.strip()
    number = number[1:] if number[:1] in ("v", "V") else number  # as a tag (v0.34)
    wanted = ".".join(number.split(".")[:2])
    found = next((v for v in engine_versions(engine) if v.version == wanted), None)
    if found is None:
        supported = ", ".join(v.version for v in engine_versions(engine))
        raise RepackError(f"{engine} {version} is not supported; supported versions: {supported}")
    return found


def serves(row: EngineVersion, layout_ids: Iterable[str], features: Iterable[str]) -> bool:
    """Whether ``row`` holds every layout of a bundle and refuses none of its features."""
    return set(layout_ids) <= set(row.layouts) and not set(features) & set(row.refuses)


def bundle_engines(chosen: EngineVersion, layout_ids: Iterable[str], features: Iterable[str]) -> dict[str, list[str]]:
    """A bundle's manifest ``engines``: the versions of ``chosen``'s engine whose state is the bundle's, or a one-line
    refusal when ``chosen`` itself cannot serve it (naming why and what to run instead)."""
    layouts, wanted = list(layout_ids), list(features)
    refused = [f for f in wanted if f in chosen.refuses]
    if refused:
        raise RepackError(chosen.refuses[refused[0]])
    missing = sorted(set(layouts) - set(chosen.layouts))
    if missing:
        raise RepackError(f"{chosen.label} does not hold layout {', '.join(missing)}")
    return {chosen.engine: [v.version for v in engine_versions(chosen.engine) if serves(v, layouts, wanted)]}


def running_row(engine: str, running: str) -> EngineVersion | None:
    """The row of the running release ``running`` (vLLM ``0.34.0``, ``0.34.1.dev3``: series ``0.34``; SGLang
    ``0.5.23``, ``0.5.23.post1``: ``0.5.23``, a row as precise as its ``version``), if supported."""
    parts = running.split(".")
    return next((v for v in engine_versions(engine) if v.version == ".".join(parts[:v.version.count(".") + 1])), None)


DISPLAY_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
VERSION_FLAGS = {"vllm": "--vllm"}  # convert's flag that picks the engine's version (SGLang has one version)


def check_running(engine: str, listed: list[str], running: str, where: object) -> None:
    """A bundle whose manifest lists ``listed`` versions of ``engine`` is served by the running release only if it is
    one of them (another version's state may differ): else a one-line refusal naming what to run instead."""
    row = running_row(engine, running)
    if row is not None and row.version in listed:
        return
    name = DISPLAY_NAMES[engine]
    supported = ", ".join(v.version for v in engine_versions(engine))
    flag = VERSION_FLAGS.get(engine, f"--engine {engine} of an nvfp4-repack for")
    running_is = (f"{running} is running" if row is not None else
                  f"{running} is running, which nvfp4-repack does not support ({name} {supported})")
    fix = f", or re-convert it with {flag} {row.version}" if row is not None else ""
    raise RepackError(f"{where}: the bundle is for {name} {', '.join(listed) or 'none'}, but {name} {running_is}; "
                      f"serve it with {name} {' or '.join(listed) or supported}{fix}")
