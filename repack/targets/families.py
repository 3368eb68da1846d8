"""The capability table's rows: each target family's names, SMs, runtime backend and layout id.

Torch-free on purpose: ``nvfp4-repack targets``, ``--help`` and the argument checks read it without loading a
tensor library. Each layout module (``sm100.py``, ...) joins its family's row to its transform functions in a
:class:`~repack.targets.base.Target`, so the facts here are stated once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import RepackError

FLASHINFER_CHECKED = ("0.7.2.post1", "0.7.4")  # 0.7.4: the project env; 0.7.2.post1: the vLLM oracle env
W4A4_LAYOUT_ID = "w4a4-cutlass-v1"  # the one layout vLLM 0.33's W4A4 kernels share (targets/w4a4.py)
# ... and those kernels: each runs swizzle_blockscale and pad_nvfp4_weight_for_cutlass(alignment=32), nothing else
W4A4_KERNELS = ("FlashInferCuteDslNvFp4LinearKernel", "FlashInferCutlassNvFp4LinearKernel",
                "FlashInferCudnnNvFp4LinearKernel", "CutlassNvFp4LinearKernel")
W4A16_CUTE_DSL = ("FlashInferCuteDslNvFp4W4A16LinearKernel",)
MARLIN = ("MarlinNvFp4LinearKernel",)  # weight-only on every GPU from sm75 without FP4 MMA (targets/marlin.py)
# vLLM's --linear-backend values and the NVFP4 kernels each admits (``_LINEAR_BACKEND_KERNEL_MAP``): convert's
# --linear-backend picks the family's layout those kernels hold, as vLLM's flag picks its kernel
LINEAR_BACKENDS: dict[str, tuple[str, ...]] = {
    "flashinfer_cutedsl": ("FlashInferCuteDslNvFp4LinearKernel", *W4A16_CUTE_DSL),
    "flashinfer_cutlass": ("FlashInferCutlassNvFp4LinearKernel",),
    "flashinfer_cudnn": ("FlashInferCudnnNvFp4LinearKernel",),
    "cutlass": ("CutlassNvFp4LinearKernel",),
    "marlin": MARLIN,
}
AUTO = "auto"  # vLLM's own choice (its default --linear-backend)
SM120_CUTE_DSL = "sm120-cute-dsl-v1"  # sm120's layout of FlashInfer's cute-dsl W4A16 kernel (--linear-backend flashinfer_cutedsl)
# Layouts a family writes only when told vLLM's --linear-backend: (family, backend, checkpoint scheme, layout id)
BACKEND_LAYOUTS = (("sm120", "flashinfer_cutedsl", "W4A16", SM120_CUTE_DSL),)


def linear_backend(kernel: str) -> str:
    """The --linear-backend value that admits vLLM kernel class ``kernel``."""
    return next(name for name, kernels in LINEAR_BACKENDS.items() if kernel in kernels)


def _auto_first(auto: str, *absent: str) -> tuple[str, ...]:
    """:data:`W4A4_KERNELS` with the one vLLM's ``auto`` picks on the family first, less those that do not run there."""
    return (auto, *(k for k in W4A4_KERNELS if k != auto and k not in absent))


@dataclass(frozen=True)
class Family:
    """A target family: the GPUs one runtime layout serves.

    Attributes:
        name: canonical name (``sm100``).
        aliases: other accepted names (``sm103``, ``sm107``).
        layout_id: versioned id of the byte layout, recorded in manifests.
        compute_capabilities: ``(major, minor)`` pairs whose kernels consume this layout.
        backend: runtime backend used on those GPUs.
        description: the GPUs, for people.
        flashinfer_versions: FlashInfer releases whose preparation this layout was checked against.
        kernels: the vLLM 0.33 kernel classes that read this (weight-only) layout after their load.
        w4a4_kernels: the vLLM kernels of the family's W4A4 layout, auto's first (empty: weight-only always).
        dtype: the activation dtype vLLM runs there (Marlin's bytes depend on it: fp16 on sm75, no bf16 there).
        w4a4_layout_id: the id of the family's W4A4 layout (Marlin's: its weight-only bytes, and the activation
            scalars vLLM keeps beside them for a W4A4 checkpoint it serves weight-only).
    """

    name: str
    aliases: tuple[str, ...]
    layout_id: str
    compute_capabilities: tuple[tuple[int, int], ...]
    backend: str
    description: str
    flashinfer_versions: tuple[str, ...]
    kernels: tuple[str, ...]
    w4a4_kernels: tuple[str, ...]
    dtype: str = field(default="bfloat16", kw_only=True)
    w4a4_layout_id: str = field(default=W4A4_LAYOUT_ID, kw_only=True)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def scheme_layouts(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """Per activation scheme the family serves: its layout id and vLLM kernels (W4A4 checkpoints get the W4A4
        layout where the family has one: vLLM's auto)."""
        layouts = {"W4A16": (self.layout_id, self.kernels)}
        if self.w4a4_kernels:
            layouts["W4A4"] = (self.w4a4_layout_id, self.w4a4_kernels)
        return layouts


SM100 = Family("sm100", ("sm103", "sm107"), "sm100-cute-dsl-v1", ((10, 0), (10, 3), (10, 7)), "flashinfer",
               "B200, GB200, B300", FLASHINFER_CHECKED, W4A16_CUTE_DSL, _auto_first("FlashInferCuteDslNvFp4LinearKernel"))
# Weight-only checkpoints: Marlin, vLLM's auto there (the cute-dsl W4A16 kernel only on sm100 / sm103): sm80's bytes
# (targets/sm120.py); W4A4 ones: the FP4 x FP4 layout, Marlin's W4A4 variant with --weight-only
SM120 = Family("sm120", ("sm121",), "marlin-v1", ((12, 0), (12, 1)), "flashinfer",
               "RTX 50xx, RTX PRO 6000, GB10 (weight-only: Marlin)", FLASHINFER_CHECKED, MARLIN,
               _auto_first("FlashInferCutlassNvFp4LinearKernel", "FlashInferCuteDslNvFp4LinearKernel"))  # sm10x only
# Hopper has no FP4 tensor cores: weight-only for every checkpoint, with the plugin's own kernel class
SM90 = Family("sm90", ("sm90a",), "sm90-triton-v2", ((9, 0),), "triton", "H100, H200", (),
              ("RepackSm90NvFp4LinearKernel",), ())

# No FP4 tensor cores: vLLM serves every NVFP4 checkpoint weight-only with Marlin (Humming outranks it on sm90 only).
# One bundle for sm80-sm89: the same bytes (bf16 activations); sm75 (T4) runs fp16, which changes the scales' bytes.
SM80 = Family("sm80", ("sm86", "sm87", "sm89", "a100", "a30", "a10", "a40", "a16", "a2", "l4", "l40", "l40s",
                       "rtx30", "rtx40"),
              "marlin-v1", ((8, 0), (8, 6), (8, 7), (8, 9)), "reference",
              "A100, A30, A10, A40, L4, L40S, RTX 30xx, RTX 40xx (Marlin)", (), MARLIN, MARLIN,
              w4a4_layout_id="marlin-v1-w4a4")
SM75 = Family("sm75", ("t4", "rtx20"), "marlin-fp16-v1", ((7, 5),), "reference", "T4, RTX 20xx (Marlin, fp16)", (),
              MARLIN, MARLIN, dtype="float16", w4a4_layout_id="marlin-fp16-v1-w4a4")

FAMILIES: tuple[Family, ...] = (SM100, SM120, SM90, SM80, SM75)

# Per family and checkpoint activation scheme, the NVFP4 MoE layout vLLM's auto holds (``select_nvfp4_moe_backend``):
# FP4 x FP4 experts get FlashInfer's MoE on Blackwell and Marlin on sm80; weight-only ones (NVFP4A16 /
# W4A16_NVFP4, or --weight-only) Marlin on all three (no FP4 x FP4 backend takes bf16 activations); sm75 both in
# fp16 Marlin. sm90 (Humming's MoE) has none: targets/moe.py refuses it in one line.
MARLIN_MOE_LAYOUT_ID = "moe-marlin-v1"
MOE_LAYOUTS: dict[str, dict[str, str]] = {
    "sm100": {"W4A4": "moe-flashinfer-trtllm-v1", "W4A16": MARLIN_MOE_LAYOUT_ID},
    "sm120": {"W4A4": "moe-flashinfer-cutlass-v1", "W4A16": MARLIN_MOE_LAYOUT_ID},
    "sm80": {"W4A4": MARLIN_MOE_LAYOUT_ID, "W4A16": MARLIN_MOE_LAYOUT_ID},
    "sm75": {"W4A4": "moe-marlin-fp16-v1", "W4A16": "moe-marlin-fp16-v1"},  # fp16 Marlin (T4)
}
ALL = "all"  # the target name that asks for every family

# GPU names accepted as --target (beside the families' names and aliases), compared without case, spaces, "-" or
# "_" and without a leading "nvidia" / "geforce" / "tesla": name -> family. Names that stand for GPUs of two families
# are left out ("RTX 6000": Quadro RTX 6000 is sm75, RTX 6000 Ada sm89, RTX PRO 6000 sm120), so the user picks.
GPU_NAMES: dict[str, str] = {
    **dict.fromkeys(("b100", "b200", "gb200", "b300", "gb300"), "sm100"),
    **dict.fromkeys(("rtx50", "rtxpro6000", "rtxpro5000", "rtxpro4000", "gb10", "dgxspark"), "sm120"),
    **dict.fromkeys(("h100", "h200", "h800", "h20", "gh200"), "sm90"),
    **dict.fromkeys(("quadrortx8000", "quadrortx6000", "quadrortx5000", "quadrortx4000", "rtx8000"), "sm75"),
    **dict.fromkeys(("a800", "a10g", "l20", "a6000", "a5000", "a4000", "rtxa6000", "rtxa5000", "rtxa4000",
                     "rtx6000ada", "rtx5000ada", "rtx4500ada", "rtx4000ada"), "sm80"),
}
# GeForce RTX 2050..5090 (and Ti / Super / D): their series, an alias above (rtx20, rtx30, rtx40) or sm120 (50xx);
# the last two digits 50-90 keep out the Quadro RTX 4000 / 5000 (sm75)
RTX_SERIES = re.compile(r"rtx(20|30|40|50)[5-9]0(ti|super|d)*")
RTX_SERIES_FAMILY = {"20": "sm75", "30": "sm80", "40": "sm80", "50": "sm120"}
# names of GPUs of two families: refused, naming them (the user picks)
AMBIGUOUS_GPUS = {
    "rtx6000": "Quadro RTX 6000 is sm75, RTX 6000 Ada sm80 (sm89), RTX PRO 6000 sm120",
    "rtx5000": "Quadro RTX 5000 is sm75, RTX 5000 Ada sm80 (sm89), RTX PRO 5000 sm120",
    "rtx4000": "Quadro RTX 4000 is sm75, RTX 4000 Ada sm80 (sm89), RTX PRO 4000 sm120",
}


def gpu_family(name: str) -> str | None:
    """The family name of GPU ``name``, if it is one of :data:`GPU_NAMES`, a GeForce RTX model number or, so written,
    a family's name or alias (``RTX 4090``, ``Tesla T4``); as ``nvidia-smi`` names it, the longest of its leading
    words that is one (``NVIDIA A100-SXM4-80GB``: a100, ``NVIDIA H100 80GB HBM3``: h100)."""
    words = [w for w in re.split(r"[\s_-]+", name.lower()) if w]
    for end in range(len(words), 0, -1):
        key = re.sub(r"^(nvidia|geforce|tesla)+", "", "".join(words[:end]))
        series = RTX_SERIES.fullmatch(key)
        found = RTX_SERIES_FAMILY[series.group(1)] if series else GPU_NAMES.get(key, key)
        if any(found in f.names for f in FAMILIES):
            return found
    return None


def resolve_family(name: str) -> Family:
    """The family called ``name`` (one of its aliases, or a GPU name: :func:`gpu_family`), case-insensitive."""
    wanted = name.strip().lower()
    for family_name in (wanted, gpu_family(wanted)):
        for family in FAMILIES:
            if family_name in family.names:
                return family
    valid = ", ".join(n for f in FAMILIES for n in f.names)
    ambiguous = AMBIGUOUS_GPUS.get(re.sub(r"^nvidia", "", re.sub(r"[\s_-]", "", wanted)))
    if ambiguous:
        raise RepackError(f"target {name!r} names GPUs of several families ({ambiguous}): give the family")
    raise RepackError(f"unknown target {name!r}; valid targets: {valid}, or a GPU name (A100, H100, B200, "
                      "RTX 4090, ...: `nvfp4-repack targets`)")


def family_for_capability(major: int, minor: int) -> Family | None:
    """The family whose kernels run on compute capability ``major.minor``, if any."""
    return next((f for f in FAMILIES if (major, minor) in f.compute_capabilities), None)


def resolve_families(names: str | Sequence[str]) -> list[Family]:
    """Families by name or alias, ``all`` for every family; each once, in the order given (aliases of one
    family, ``sm100`` and ``sm103``, are that family once)."""
    wanted: list[Family] = []
    for name in [names] if isinstance(names, str) else names:
        for family in FAMILIES if name.strip().lower() == ALL else [resolve_family(name)]:
            if family not in wanted:
                wanted.append(family)
    if not wanted:
        raise RepackError("no target given")
    return wanted


def several_families(names: str | Sequence[str]) -> bool:
    """Whether ``names`` ask for one bundle per family (``out/<target>`` each): ``all``, or two families or more."""
    listed = [names] if isinstance(names, str) else list(names)
    return any(n.strip().lower() == ALL for n in listed) or len(resolve_families(listed)) > 1
