"""read -> plan -> transform -> write: a source checkpoint becomes a runtime-layout bundle for one target."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from . import BUNDLE_FORMAT_VERSION, __version__
from .bundle.layers import LayerPlan, OutputLayer, assemble, plan_layers, rescale_error
from .bundle.manifest import (
    MANIFEST_NAME, LayerRecord, LayerTransformRecord, Manifest, PartitionRecord, SourceRecord, TensorRecord,
    TransformRecord,
)
from .bundle.plan import INDEX_NAME, BundlePlan, PlannedTensor, parse_size, plan_bundle
from .bundle.writer import check_destination, recover_interrupted, staged_folder, write_json, write_shard
from .formats import SourceModel, read_source
from .formats.checkpoint import BUNDLE_CONFIG_KEY, contained_file
from .formats.safetensors_io import DTYPE_NAMES, DTYPES, file_sha256, iter_raw_chunks, tensor_bytes
from .formats.transforms import runtime_matrix
from .targets import RuntimeLayer, Target, resolve_target

Progress = Callable[[int, str], None]  # (bytes just written, what) -> None


@dataclass(frozen=True)
class ConvertSummary:
    out: Path
    target: str
    layers: int
    passthrough: int
    bytes_in: int
    bytes_out: int
    seconds: float
    bundles: list[str]
    rescaled: dict[str, float]  # layer -> relative L2 error --rescale added (worst over ranks)


class _LayerCache:
    """Converts each layer once even though its parts are written one after another."""

    def __init__(self, source: SourceModel, target: Target) -> None:
        self.source, self.target = source, target
        self.prefix: str | None = None
        self.runtime: RuntimeLayer | None = None
        self.global_scales: dict[str, float] = {}

    def get(self, layer: OutputLayer) -> RuntimeLayer:
        if self.prefix != layer.prefix:
            self.runtime = None  # free the previous layer before building the next
            self.runtime = self.target.to_runtime(assemble(self.source, layer))
            self.prefix = layer.prefix
            self.global_scales[layer.prefix] = float(self.runtime.weight_global_scale)
        assert self.runtime is not None
        return self.runtime


def _chunk_source(source: SourceModel, cache: _LayerCache, progress: Progress) -> Callable[[PlannedTensor], Iterable]:
    def chunks(tensor: PlannedTensor) -> Iterable:
        if tensor.matrix is not None:
            progress(tensor.nbytes, tensor.name)
            yield tensor_bytes(runtime_matrix(source.checkpoint, tensor.matrix, DTYPES[tensor.dtype_name]))
            return
        if tensor.layer is None:
            for chunk in iter_raw_chunks(source.checkpoint.entry(tensor.source_name)):
                progress(len(chunk), tensor.name)
                yield chunk
            return
        value = cache.get(tensor.layer).tensors()[tensor.part]
        if DTYPE_NAMES[value.dtype] != tensor.dtype_name or tuple(value.shape) != tensor.shape:
            raise AssertionError(f"{tensor.name}: target produced {value.dtype} {list(value.shape)}, planned otherwise")
        progress(tensor.nbytes, tensor.name)
        yield tensor_bytes(value)

    return chunks


def bundle_config(config: dict, target: Target, layers: LayerPlan) -> dict:
    """The source config.json, quantization_config kept, plus a marker naming the target layout and rank."""
    marked = dict(config)
    marked[BUNDLE_CONFIG_KEY] = {
        "bundle_format_version": BUNDLE_FORMAT_VERSION,
        "target": target.name,
        "layout_id": target.layout_id,
        "tool_version": __version__,
        "tp_size": layers.tp_size,
        "tp_rank": layers.tp_rank,
        "fused": bool(layers.fusion),
    }
    return marked


def _partitions(layer: OutputLayer) -> list[PartitionRecord]:
    records, edge = [], 0
    for piece in layer.pieces:
        height = piece.rows[1] - piece.rows[0]
        records.append(PartitionRecord(piece.source, [edge, edge + height], list(piece.rows), list(piece.cols),
                                       piece.scale_ratio))
        edge += height
    return records


def _manifest(
    source: SourceModel, plan: BundlePlan, cache: _LayerCache, digests: dict[str, str], files: dict[str, str]
) -> Manifest:
    records: dict[str, TensorRecord] = {}
    for file, tensors in plan.shards.items():
        for t in tensors:
            records[t.name] = TensorRecord(file=file, dtype=t.dtype_name, shape=list(t.shape), sha256=digests[t.name])
    layers = {}
    for prefix, layer in plan.layers.layers.items():
        parts = plan.target.runtime_specs(layer.n, layer.k)
        geometry = plan.target.geometry(layer.n, layer.k)
        layers[prefix] = LayerRecord(
            n=layer.n,
            k=layer.k,
            padded_shape=geometry.padded_shape,
            weights_padding_cols=geometry.weights_padding_cols,
            global_scale=cache.global_scales[prefix],
            tensors={part: records.pop(f"{prefix}.{part}") for part in parts},
            transforms=[LayerTransformRecord(t.location, t.matrix.name, t.matrix.size)
                        for t in source.transforms.layers.get(prefix, ())],
            partitions=_partitions(layer),
        )
    transforms = {
        name: TransformRecord(scheme=m.scheme, type=m.type, block_size=m.size, inverse=m.inverse, scale=m.scale,
                              source_tensors=[t for t in (m.weight, m.perm) if t], tensor=records.pop(name))
        for name, m in source.transforms.matrices.items()
    }
    return Manifest(
        bundle_format_version=BUNDLE_FORMAT_VERSION,
        tool_version=__version__,
        target=plan.target.name,
        layout_id=plan.target.layout_id,
        flashinfer_versions=list(plan.target.flashinfer_versions),
        source=SourceRecord(
            path=str(source.checkpoint.root.resolve()),
            format=source.format,
            quant_algo=source.quant_algo,
            files={name: file_sha256(source.checkpoint.root / name) for name in source.checkpoint.shard_files},
        ),
        layers=layers,
        passthrough=records,
        files=files,
        transforms=transforms,
        tp_size=plan.layers.tp_size,
        tp_rank=plan.layers.tp_rank,
        fusion=plan.layers.fusion,
    )


def _write_bundle(folder: Path, source: SourceModel, plan: BundlePlan, progress: Progress) -> None:
    """Write one bundle (shards, index, side files, config, manifest) into the empty ``folder``."""
    cache = _LayerCache(source, plan.target)
    chunks = _chunk_source(source, cache, progress)
    digests: dict[str, str] = {}
    files: dict[str, str] = {}
    for file, tensors in plan.shards.items():
        tensor_digests, files[file] = write_shard(folder / file, tensors, chunks)
        digests.update(tensor_digests)
    if plan.is_sharded:
        weight_map = {t.name: file for file, tensors in plan.shards.items() for t in tensors}
        files[INDEX_NAME] = write_json(
            folder / INDEX_NAME, {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
        )
    for name in source.checkpoint.side_files():
        shutil.copyfile(contained_file(source.checkpoint.root, name), folder / name)
        files[name] = file_sha256(folder / name)
    config = bundle_config(source.checkpoint.config, plan.target, plan.layers)
    files["config.json"] = write_json(folder / "config.json", config)
    manifest = _manifest(source, plan, cache, digests, files)
    (folder / MANIFEST_NAME).write_text(manifest.to_json())


def rank_folder(rank: int) -> str:
    """Where rank ``rank`` of a ``--tp`` conversion lives inside OUT."""
    return f"rank-{rank}"


def convert(
    model: str | Path,
    target_name: str,
    out: str | Path,
    *,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    fuse: bool = False,
    tp: int = 1,
    rescale: bool = False,
    progress: Progress | None = None,
    on_plan: Callable[[SourceModel, list[BundlePlan]], None] | None = None,
) -> ConvertSummary:
    """Convert ``model`` into a bundle for ``target_name`` at ``out`` (``tp > 1``: one bundle per rank in
    ``out/rank-R``); all-or-nothing."""
    started = time.perf_counter()
    target = resolve_target(target_name)
    parse_size(max_shard_size)  # a bad --max-shard-size fails before any work
    out = Path(out)
    source = read_source(model)
    recover_interrupted(out)  # a replace killed between its two renames (non-Linux fallback) left OUT missing
    check_destination(out, overwrite, protected=[source.checkpoint.root])
    plans = [plan_bundle(source, target, layers, max_shard_size)
             for layers in plan_layers(source, fuse=fuse, tp=tp, rescale=rescale)]
    folders = [rank_folder(p.layers.tp_rank) if tp > 1 else "" for p in plans]
    if on_plan is not None:
        on_plan(source, plans)
    rescaled: dict[str, float] = {}
    for plan in plans:
        for prefix, layer in plan.layers.layers.items():
            if any(piece.scale_ratio != 1.0 for piece in layer.pieces):
                rescaled[prefix] = max(rescaled.get(prefix, 0.0), rescale_error(source, layer))
    report = progress or (lambda nbytes, what: None)
    with staged_folder(out, overwrite) as staging:
        for plan, folder in zip(plans, folders):
            (staging / folder).mkdir(exist_ok=True)
            _write_bundle(staging / folder, source, plan, report)
    bytes_in = sum(e.nbytes for e in source.checkpoint.tensors.values())
    return ConvertSummary(
        out=out,
        target=target.name,
        layers=len(plans[0].layers.layers),
        passthrough=len(source.passthrough),
        bytes_in=bytes_in,
        bytes_out=sum(p.total_bytes for p in plans),
        seconds=time.perf_counter() - started,
        bundles=[str(out / f) if f else str(out) for f in folders],
        rescaled=rescaled,
    )
