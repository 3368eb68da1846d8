"""Open a bundle: its manifest, its target, and lazy access to every tensor it holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from ..errors import RepackError
from ..formats.checkpoint import contained_file, load_json, local_dir
from ..formats.safetensors_io import DTYPE_NAMES, DTYPES, TensorEntry, read_header, read_tensor
from ..formats.scope import quantized_linear
from ..nvfp4 import BLOCK_SIZE
from ..targets import RuntimeLayer, Target, resolve_target
from ..targets.moe import moe_layout, moe_specs
from ..targets.w4a4 import LAYOUT_ID as W4A4_LAYOUT_ID
from ..targets.w4a4 import qutlass_scales, runs_qutlass
from .manifest import MANIFEST_NAME, LayerRecord, Manifest, MoERecord, read_manifest


@dataclass
class Bundle:
    """A bundle folder whose manifest parsed; tensors are read on demand."""

    root: Path
    manifest: Manifest
    target: Target
    config: dict
    _headers: dict[str, dict[str, TensorEntry]] = field(default_factory=dict, repr=False)

    def entry(self, name: str) -> TensorEntry:
        """Where tensor ``name`` is, per the manifest, checked against the shard's own header."""
        record = self.manifest.all_tensors.get(name)
        if record is None:
            raise RepackError(f"{self.root}: the manifest lists no tensor {name!r}")
        if record.file not in self._headers:
            self._headers[record.file] = read_header(contained_file(self.root, record.file))
        entry = self._headers[record.file].get(name)
        if entry is None:
            raise RepackError(f"{record.file}: tensor {name!r} is missing")
        return entry

    def read(self, name: str) -> torch.Tensor:
        return read_tensor(self.entry(name))

    def runtime_layer(self, prefix: str) -> RuntimeLayer:
        """One layer's runtime tensors, as the target's kernels consume them."""
        record = self.layer(prefix)
        tensors = {part: self.read(f"{prefix}.{part}") for part in record.tensors}
        for part, spec in self.target.layer_specs(record.n, record.k, len(record.partitions)).items():
            if (tensors[part].dtype, tuple(tensors[part].shape)) != (spec.dtype, spec.shape):
                raise RepackError(
                    f"{prefix}.{part}: {tensors[part].dtype} {list(tensors[part].shape)} is not the {self.target.name} "
                    f"layout's {spec.dtype} {list(spec.shape)} for N={record.n}, K={record.k}; run verify"
                )
        return self.target.runtime_layer(tensors, record.n, record.k, record.weights_padding_cols)

    def transform_matrix(self, name: str) -> torch.Tensor:
        """An online-transform matrix ``T`` (normalization fused in), as the runtime multiplies by it."""
        tensor = self.read(name)
        record = self.manifest.transforms[name].tensor
        if (DTYPE_NAMES[tensor.dtype], list(tensor.shape)) != (record.dtype, record.shape):
            raise RepackError(f"{name}: {tensor.dtype} {list(tensor.shape)} is not the manifest's {record.dtype} "
                              f"{record.shape}; run verify")
        return tensor

    def vllm_transforms(self, prefix: str) -> dict[str, torch.Tensor]:
        """Layer ``prefix``'s online-transform matrices as vLLM 0.33 holds them after loading, by its names relative
        to the layer: ``<scheme>_<location>.weight.partitions.<i>`` for each partition ``i`` (vLLM gives every
        partition of a fused module its own handle on one shared tensor), the matrix as the checkpoint stores it
        (vLLM transposes an inverse one at run time) divided by ``sqrt(block)``."""
        out = {}
        layer = self.layer(prefix)
        for t in layer.transforms:
            record = self.manifest.transforms[t.matrix]
            matrix = self.transform_matrix(t.matrix)
            for i in range(len(layer.partitions)) if t.partitions is None else t.partitions:
                out[f"{record.scheme}_{t.location}.weight.partitions.{i}"] = matrix.t() if record.inverse else matrix
        return out

    def runs_qutlass(self, prefix: str) -> bool:
        """Whether vLLM serves layer ``prefix`` through QuTLASS (``targets/w4a4.py``): a W4A4 layer (its layout
        exists on sm100 and sm120 only, both past vLLM's capability 100) whose online input transforms all have a
        block QuTLASS fuses."""
        blocks = [None if self.manifest.transforms[t.matrix].whole else t.block_size
                  for t in self.layer(prefix).transforms if t.location == "input"]
        return self.target.layout_id == W4A4_LAYOUT_ID and runs_qutlass(blocks)  # QuTLASS: sm100 / sm120 only

    def vllm_qutlass(self, prefix: str) -> dict[str, torch.Tensor]:
        """What QutlassNvFP4LinearMethod adds to layer ``prefix`` after loading, by vLLM's names (empty where vLLM
        does not run it): ``fused_alpha``, ``fused_global_scale`` and ``hadamard_matrix`` (its input transform's
        first partition, the tensor itself)."""
        if not self.runs_qutlass(prefix):
            return {}
        alpha, scale = qutlass_scales(self.read(f"{prefix}.weight_global_scale"))
        scheme = next(self.manifest.transforms[t.matrix].scheme for t in self.layer(prefix).transforms
                      if t.location == "input")
        matrix = self.vllm_transforms(prefix)[f"{scheme}_input.weight.partitions.0"].contiguous()
        return {"fused_alpha": alpha, "fused_global_scale": scale, "hadamard_matrix": matrix}

    def quantized_linear(self) -> Callable[[str], bool] | None:
        """Whether the source's quantization covers a model's linear module, by name (see ``formats.scope``), from
        the config.json and hf_quant_config.json the bundle keeps."""
        hf = self.root / "hf_quant_config.json"
        return quantized_linear(self.config, load_json(contained_file(self.root, hf.name)) if hf.is_file() else None)

    def moe_layers(self) -> dict[str, MoERecord]:
        """The bundle's FusedMoE layers by vLLM's module name (``model.layers.0.mlp.experts.routed_experts``); empty
        for a dense bundle. See docs/format.md for the record's fields."""
        return self.manifest.moe

    @property
    def moe_layout(self) -> ModuleType:
        """The MoE layout module (``targets.moe_trtllm`` / ``targets.moe_cutlass``) of the bundle's family: its
        ``BACKEND``, ``KERNELS``, ``TENSORS``, ``from_runtime`` and ``decode_expert``."""
        return moe_layout(self.target)

    def moe_tensors(self, module: str) -> dict[str, torch.Tensor]:
        """Every tensor vLLM's FusedMoE ``module`` holds after its load, by vLLM's parameter names (``w13_weight``,
        ``w13_weight_scale``, ..., ``g1_scale_c`` on sm100), each checked against the layout's dtype and shape
        (their digests are verify's)."""
        record = self.manifest.moe.get(module)
        if record is None:
            raise RepackError(f"{self.root}: no FusedMoE layer {module!r} in this bundle")
        specs = moe_specs(self.moe_layout, record.local_experts, record.hidden, record.intermediate, record.num_experts)
        tensors = {name: self.read(f"{module}.{name}") for name in record.tensors}
        for name, spec in specs.items():
            if (tensors[name].dtype, tuple(tensors[name].shape)) != (spec.dtype, spec.shape):
                raise RepackError(f"{module}.{name}: {tensors[name].dtype} {list(tensors[name].shape)} is not the "
                                  f"{record.layout_id} layout's {spec.dtype} {list(spec.shape)}; run verify")
        return tensors

    def layer(self, prefix: str) -> LayerRecord:
        try:
            return self.manifest.layers[prefix]
        except KeyError:
            raise RepackError(f"{self.root}: no quantized layer {prefix!r} in this bundle") from None


def is_bundle(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def open_bundle(path: str | Path) -> Bundle:
    """Open and validate a bundle's manifest and config (tensor data is checked by ``verify``)."""
    root = local_dir(path)
    manifest = read_manifest(root)
    family = resolve_target(manifest.target)
    target = family.with_layout(manifest.layout_id)
    if target is None:
        known = ", ".join(t.layout_id for t in family.layouts)
        raise RepackError(
            f"{MANIFEST_NAME}: layout {manifest.layout_id!r} is not a layout of target {family.name} "
            f"({known}); re-convert the source with this version"
        )
    for prefix, record in manifest.layers.items():
        _check_layer_record(prefix, record, target)
        _check_layer_transforms(prefix, record, manifest)
    for record in manifest.moe.values():
        _check_moe_record(record, target)
    config = load_json(contained_file(root, "config.json"))
    return Bundle(root=root, manifest=manifest, target=target, config=config)


def _check_layer_record(prefix: str, record: LayerRecord, target: Target) -> None:
    """A layer's geometry and tensor names must be what convert writes for ``target``: runtime code trusts them
    (``weights_padding_cols`` sizes the activation padding, the part names become RuntimeLayer fields)."""
    if record.n == 0 or record.k == 0 or record.k % BLOCK_SIZE:
        raise RepackError(f"{MANIFEST_NAME}: {prefix}: N={record.n}, K={record.k} is not an NVFP4 layer shape")
    geometry = target.geometry(record.n, record.k)
    if (record.padded_shape, record.weights_padding_cols) != (geometry.padded_shape, geometry.weights_padding_cols):
        raise RepackError(
            f"{MANIFEST_NAME}: {prefix}: padded_shape {record.padded_shape} / weights_padding_cols "
            f"{record.weights_padding_cols} do not follow from N={record.n}, K={record.k}"
        )
    edge = 0
    for part in record.partitions:
        if part.rows[0] != edge or part.source_cols[1] - part.source_cols[0] != record.k:
            raise RepackError(f"{MANIFEST_NAME}: {prefix}: partitions do not tile its N={record.n} x K={record.k}")
        edge = part.rows[1]
    if edge != record.n:
        raise RepackError(f"{MANIFEST_NAME}: {prefix}: partitions do not tile its N={record.n} x K={record.k}")
    parts = sorted(target.layer_specs(record.n, record.k, len(record.partitions)))
    if sorted(record.tensors) != parts:
        raise RepackError(
            f"{MANIFEST_NAME}: {prefix}: tensors {sorted(record.tensors)} are not the {target.name} layout's {parts}"
        )


def _check_layer_transforms(prefix: str, record: LayerRecord, manifest: Manifest) -> None:
    """At most one input transform, on the whole layer; output transforms on the whole layer (one) or on disjoint
    sets of its partitions; each a square float matrix whose block divides K, or the rows it rotates: the runtime
    reshapes activations by it."""
    inputs = [t for t in record.transforms if t.location == "input"]
    outputs = [t for t in record.transforms if t.location == "output"]
    parts = [i for t in outputs for i in t.partitions or ()]
    if len(inputs) > 1 or any(t.partitions is not None for t in inputs) or (
            len(outputs) > 1 and any(t.partitions is None for t in outputs)) or len(set(parts)) != len(parts) or any(
            i >= len(record.partitions) for i in parts):
        raise RepackError(f"{MANIFEST_NAME}: {prefix}: its online transforms overlap or name partitions it does not "
                          f"have")
    for t in record.transforms:
        sizes = [record.k] if t.location == "input" else [stop - start for start, stop in record.output_rows(t)]
        tensor = manifest.transforms[t.matrix].tensor
        if t.block_size == 0 or any(d % t.block_size for d in sizes) or tensor.shape != [
                t.block_size, t.block_size] or not DTYPES[tensor.dtype].is_floating_point:
            raise RepackError(f"{MANIFEST_NAME}: {prefix}: {t.location} transform {t.matrix!r} is not a float "
                              f"[{t.block_size}, {t.block_size}] matrix whose block divides {sizes[0]}")


def _check_moe_record(record: MoERecord, target: Target) -> None:
    """A FusedMoE record names its family's MoE layout and exactly that layout's tensors: the plugin hands them to
    vLLM's kernel by these names."""
    layout, family = moe_layout(target), target.name
    if record.layout_id != layout.LAYOUT_ID:
        raise RepackError(f"{MANIFEST_NAME}: {record.module}: MoE layout {record.layout_id!r} is not {family}'s "
                          f"({layout.LAYOUT_ID}); re-convert the source with this version")
    if record.hidden == 0 or record.hidden % BLOCK_SIZE or record.intermediate != record.rows[1] - record.rows[0] or (
            record.intermediate % BLOCK_SIZE):
        raise RepackError(f"{MANIFEST_NAME}: {record.module}: hidden {record.hidden} / intermediate "
                          f"{record.intermediate} (rows {record.rows}) is not an NVFP4 MoE layer shape")
    expected = sorted(layout.runtime_specs(record.local_experts, record.hidden, record.intermediate))  # SGLang's: by shape
    if sorted(record.tensors) != expected:
        raise RepackError(f"{MANIFEST_NAME}: {record.module}: tensors {sorted(record.tensors)} are not the "
                          f"{layout.LAYOUT_ID} layout's {expected}")


def rank_dir(path: Path, tp_rank: int) -> Path:
    """This rank's bundle folder: ``path/rank-R`` when ``path`` holds a ``--tp`` conversion, its sibling
    ``rank-R`` when ``path`` is one of the ranks (engines read config.json from the folder they are given), else
    ``path`` itself."""
    for root in (path, path.parent) if path.name.startswith("rank-") else (path,):
        ranked = root / f"rank-{tp_rank}"
        if (ranked / MANIFEST_NAME).is_file():
            return ranked
    return path
