"""What every target family provides: the runtime tensors of one layer, and the target's description."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from ..nvfp4 import NVFP4Weight
from .families import AUTO, LINEAR_BACKENDS, W4A4_LAYOUT_ID, Family


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of one runtime tensor, known before any data is read (for shard planning)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class LayerGeometry:
    """The padded ``[n_padded, k_padded]`` a target's kernel sees, and the K padding of activations in bytes."""

    n_padded: int
    k_padded: int
    weights_padding_cols: int

    @property
    def padded_shape(self) -> list[int]:
        return [self.n_padded, self.k_padded]


@dataclass(frozen=True)
class RuntimeLayer:
    """One layer as a serving engine holds it after its load-time processing.

    ``weight``/``weight_scale``/``weight_global_scale`` are vLLM's parameter names; ``weights_padding_cols``
    is the K padding in bytes (activations get ``2 *`` that many zero columns at run time).
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor
    weights_padding_cols: int
    input_global_scale: torch.Tensor | None = None  # W4A4 layouts: float32 [] each, as vLLM computes them
    input_global_scale_inv: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    weight_multiplier: torch.Tensor | None = None  # Marlin: the source multiplier, kept beside vLLM's state
    named: dict[str, torch.Tensor] | None = None  # another engine's tensors of this layer, by its names (SGLang)

    @property
    def source_multiplier(self) -> torch.Tensor:
        """The source's global scale multiplier (what the manifest records): ``weight_global_scale``, except where
        the layout holds it folded (Marlin) and keeps the source's as ``weight_multiplier``."""
        return self.weight_global_scale if self.weight_multiplier is None else self.weight_multiplier

    def bundle_tensors(self) -> dict[str, torch.Tensor]:
        """What a bundle stores for the layer: its tensors by the names its engine holds them under (``named``, else
        vLLM's: :meth:`tensors`)."""
        return dict(self.named) if self.named is not None else self.tensors()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layout's tensors by vLLM's names (what the runtime's backends read)."""
        out = {
            "weight": self.weight,
            "weight_scale": self.weight_scale,
            "weight_global_scale": self.weight_global_scale,
        }
        for name in OPTIONAL:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


W4A4_SCALARS = ("input_global_scale", "input_global_scale_inv", "alpha")
OPTIONAL = (*W4A4_SCALARS, "weight_multiplier")  # held by some layouts only


@dataclass(frozen=True)
class Target(Family):
    """A target family's row of the capability table (:class:`~.families.Family`) with its layout's functions.

    Attributes:
        to_runtime: canonical weight -> runtime layer.
        from_runtime: ``(runtime layer, n, k)`` -> canonical weight, the exact inverse.
        runtime_specs: ``(n, k)`` -> dtype and shape of each runtime tensor.
        geometry: ``(n, k)`` -> padded shape and activation padding, recorded in manifests.
        stack_rows: ``(runtime layers, their n, k)`` -> the runtime layer of their weights stacked along N (one
            multiplier, the layers'), made by copying where the layout allows it, else ``None``; lets the runtime
            fuse q/k/v and gate/up at load (``patch_model``) without running ``to_runtime`` again. ``None``: never.
        scheme: ``W4A16`` (activations stay bf16) or ``W4A4`` (activations quantized to NVFP4 by the kernel).
        variants: the family's other layouts (its W4A4 one), each a Target of the same family: a target family has
            one layout per activation scheme (and, later, layer kind) and engine; :meth:`for_scheme` picks one.
        engine: the serving engine whose post-load state the layout's tensors are (``vllm``, ``sglang``).
        source_format: the checkpoint format whose parameter names and scalars the engine keeps (None: any).
        partition_specs: ``(n, k, partitions)`` -> the tensor specs, for an engine that keeps a scalar per partition
            of a fused layer (else ``runtime_specs``).
        from_named: ``(tensors by the engine's names, n, k)`` -> the RuntimeLayer of the layout's math (else the
            names are RuntimeLayer's fields).
        read_as: a weight -> the weight as the layout's kernel reads it, where that differs (Marlin flushes the
            smallest block scales to 0): what ``from_runtime`` returns. ``None``: the weight itself.
        runtime_layout: the :attr:`layout_key` of the layout whose tensors ``from_named`` gives the runtime, for an
            engine's layout over another family's bytes (SGLang's FP4 Marlin on any family: ``sm80``'s).
        moe_layout: this layout -> the MoE layout its bundles' FusedMoE layers take, or a one-line refusal, for an
            engine that picks its own (SGLang's); None: vLLM's ``auto`` (``families.MOE_LAYOUTS``, :func:`.moe_layout`).
    """

    to_runtime: Callable[[NVFP4Weight], RuntimeLayer]
    from_runtime: Callable[[RuntimeLayer, int, int], NVFP4Weight]
    runtime_specs: Callable[[int, int], dict[str, TensorSpec]]
    geometry: Callable[[int, int], LayerGeometry]
    stack_rows: Callable[[list[RuntimeLayer], list[int], int], RuntimeLayer | None] | None = None
    scheme: str = "W4A16"
    variants: tuple["Target", ...] = ()
    engine: str = "vllm"
    source_format: str | None = None
    partition_specs: Callable[[int, int, int], dict[str, TensorSpec]] | None = None
    from_named: Callable[[dict[str, torch.Tensor], int, int], RuntimeLayer] | None = None
    read_as: Callable[[NVFP4Weight], NVFP4Weight] | None = None
    runtime_layout: str | None = None
    moe_layout: Callable[["Target"], object] | None = None

    @classmethod
    def of(cls, family: Family, **layout: object) -> Target:
        """``family``'s row joined to its layout's functions (``to_runtime=...``, ...)."""
        return cls(**{f.name: getattr(family, f.name) for f in fields(Family)}, **layout)  # type: ignore[arg-type]

    @property
    def layouts(self) -> tuple["Target", ...]:
        return (self, *self.variants)

    @property
    def layout_key(self) -> str:
        """How the runtime (backends, index formulas) names this layout: the layout id for the FP4 x FP4 one, which
        the families share (another engine's W4A4 layouts too: its names over the same bytes); else its own id."""
        if self.runtime_layout is not None:
            return self.runtime_layout
        return W4A4_LAYOUT_ID if self.layout_id == W4A4_LAYOUT_ID or self.engine != "vllm" else self.layout_id

    def as_read(self, weight: NVFP4Weight) -> NVFP4Weight:
        """``weight`` as this layout's kernel reads it: what :attr:`from_runtime` of :attr:`to_runtime` returns."""
        return weight if self.read_as is None else self.read_as(weight)

    def for_scheme(self, scheme: str, weight_only: bool = False, linear_backend: str = AUTO) -> "Target | None":
        """The family's layout vLLM holds for a checkpoint of ``scheme``. Its ``auto``: the W4A4 layout for a W4A4
        checkpoint where the family has one (sm100, sm120; Marlin's W4A4 variant on sm80 / sm75), else the weight-only
        layout (sm90: no FP4 MMA). ``weight_only``: the layout of the family's weight-only kernels for ``scheme``
        (Marlin keeps a W4A4 checkpoint's activation scalars: its W4A4 variant), else its W4A16 layout (sm100).
        ``linear_backend`` (vLLM's flag): the layout of that backend's kernels for ``scheme``; None if none is written."""
        layouts = [t for t in self.layouts if t.engine == "vllm" and t.scheme == scheme]
        if linear_backend != AUTO:
            admitted = set(LINEAR_BACKENDS[linear_backend])
            return next((t for t in layouts if admitted & set(t.kernels)), None)
        kernels = self.w4a4_kernels if scheme == "W4A4" and not weight_only else self.kernels
        return next((t for t in layouts if t.kernels == kernels), self)

    def for_engine(self, engine: str, source_format: str, scheme: str = "W4A4", weight_only: bool = False,
                   linear_backend: str = AUTO) -> "Target | None":
        """The family's layout of ``engine``'s state for a ``scheme`` checkpoint of ``source_format``, if it has one:
        the engine's auto (its FP4 x FP4 layout where it has one, else its weight-only one), or with ``weight_only``
        one whose kernel keeps activations in bf16 (vLLM's: the family's own layouts, :meth:`for_scheme`, which
        ``linear_backend`` may pick among)."""
        if engine == "vllm":
            return self.for_scheme(scheme, weight_only, linear_backend)
        found = [t for t in self.layouts if t.engine == engine and t.source_format in (None, source_format)
                 and t.scheme == scheme and not (weight_only and t.layout_key == W4A4_LAYOUT_ID)]
        return min(found, key=lambda t: t.layout_key != W4A4_LAYOUT_ID, default=None)

    def layer_specs(self, n: int, k: int, partitions: int = 1) -> dict[str, TensorSpec]:
        """dtype and shape of each tensor of an ``[n, k]`` layer of ``partitions`` fused partitions."""
        return self.runtime_specs(n, k) if self.partition_specs is None else self.partition_specs(n, k, partitions)

    def runtime_layer(self, tensors: dict[str, torch.Tensor], n: int, k: int, weights_padding_cols: int) -> RuntimeLayer:
        """A layer's tensors by this layout's names -> its RuntimeLayer."""
        if self.from_named is not None:
            return self.from_named(tensors, n, k)
        return RuntimeLayer(weights_padding_cols=weights_padding_cols, **tensors)

    def with_layout(self, layout_id: str) -> "Target | None":
        """The family's layout ``layout_id``, if it has one."""
        return next((t for t in self.layouts if t.layout_id == layout_id), None)


def restated_differences(target: Target, layer: RuntimeLayer, n: int, k: int) -> list[str]:
    """The names of a layer's tensors held by another engine's names (``layer.named``: SGLang's) that ``target``'s
    :attr:`~Target.to_runtime` does not give back from the layer's codes, scales and kept scalars (a derived scalar
    such as SGLang's ``alpha``, or ModelOpt's unswizzled ``weight_scale``, that does not follow from the rest): what
    verify's exactness fails."""
    again = target.to_runtime(target.from_runtime(layer, n, k)).named or {}
    held = layer.named or {}
    return sorted(name for name in set(held) | set(again) if name not in held or name not in again
                  or held[name].shape != again[name].shape or held[name].dtype != again[name].dtype
                  or not torch.equal(held[name].reshape(-1).view(torch.uint8), again[name].reshape(-1).view(torch.uint8)))
