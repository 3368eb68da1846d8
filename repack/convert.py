"""read -> plan -> transform -> write: a source checkpoint becomes runtime-layout bundles, in one pass.

The pass reads each source unit (a quantized layer, or a passthrough tensor in bounded chunks) once and
hands it to every output bundle; each output transforms it for its own plan on a pool of threads shared by all
outputs (one per core: a layer's transform is single-threaded torch, so two layers transform at once on two
cores) and queues the bytes, in order, on its writer thread (its *lane*). Reading runs on the calling thread,
hashing and writing on the outputs' threads and the source files' threads: blake3, file I/O and large torch ops
release the GIL, so this uses every core. The source files' digests come from the same reads (``formats.hashing``):
one read of the source. Each output is all-or-nothing on its own (see ``bundle.writer``); a resume keeps the
shards a journal in the staging folder records (see ``bundle.resume``).
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import BUNDLE_FORMAT_VERSION, __version__
from .bundle.layers import (
    ExpertPlan, LayerPlan, OutputLayer, assemble, assemble_experts, expert_input_scales, expert_rescale_error,
    expert_pieces, expert_tensor_reader, largest_expert_scales, layer_transforms, plan_layers, rescale_error,
    whole_piece,
)
from .bundle.manifest import (
    MANIFEST_NAME, LayerRecord, LayerTransformRecord, Manifest, MoERecord, PartitionRecord, SourceRecord,
    TensorRecord, TransformRecord, read_output_record,
)
from .bundle.plan import INDEX_NAME, BundlePlan, PlannedTensor, parse_size, plan_bundle
from .bundle.resume import Journal, Resumable, find_resumable, source_identity
from .bundle.writer import (
    ShardWriter, check_destination, clash_with_input, folder_bytes, recover_interrupted, remove_stale, staged_folder,
    write_json, write_output_record,
)
from .errors import Interrupted, RepackError
from .formats import SourceModel, read_source
from .formats.checkpoint import BUNDLE_CONFIG_KEY
from .formats.hashing import HashingReader, file_hexdigest
from .formats.hub import hub_sha256
from .formats.moe import expert_groups, input_scale_scope, read_input_scales
from .formats.safetensors_io import DTYPE_NAMES, DTYPES, tensor_bytes
from .formats.transforms import runtime_matrix
from .lane import Lane, one_torch_thread
from .nvfp4 import NVFP4Weight
from .targets import FAMILIES, Target, resolve_families, resolve_target, several_families
from .targets.families import AUTO, LINEAR_BACKENDS, MARLIN
from .targets.engines import (ENGINE_NAMES, HADAMARD_W4A4, QUTLASS_MARLIN, VERSION_FLAGS, EngineVersion,
                              bundle_engines, engine_versions, newest, resolve_version, serves)
from .targets.moe import MADE_FROM, ExpertStack, moe_layout
from .targets.sglang import check_sglang_moe_architecture
from .targets.w4a4 import runs_humming, runs_qutlass

Progress = Callable[[int, str], None]  # (bytes just written, what) -> None
Notice = Callable[[str], None]  # one line for the user (the CLI prints it on stderr)


@dataclass(frozen=True)
class ConvertSummary:
    out: Path
    target: str
    layers: int
    passthrough: int
    bytes_in: int
    bytes_out: int
    seconds: float
    kept_shards: int = 0  # shards a resume kept from an interrupted convert
    bundles: list[str] = field(default_factory=list)  # the bundle folders written (OUT, or OUT/rank-R)
    rescaled: dict[str, float] = field(default_factory=dict)  # layer -> relative L2 error --rescale added (worst over ranks)
    moe_layers: int = 0  # FusedMoE layers written (per bundle)


@dataclass(frozen=True)
class OutputBundle:
    """One bundle a pass writes: where it goes and what it holds (its plan names the target layout)."""

    out: Path
    plan: BundlePlan
    folder: str = ""  # inside ``out``: rank-R of a --tp conversion, or <target> of several, staged (and installed) together
    rescale_errors: dict[str, float] = field(default_factory=dict)  # layer -> relative L2 error --rescale added
    engines: dict[str, list[str]] = field(default_factory=dict)  # the manifest's engine versions (targets/engines.py)

    @property
    def rank(self) -> bool:
        """One rank of a --tp conversion: its ranks are kept or dropped together (--resume does not cover them)."""
        return self.plan.layers.tp_size > 1

    @property
    def path(self) -> Path:
        return self.out / self.folder if self.folder else self.out


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


@dataclass
class _Writing:
    """An output bundle during the pass: its staging folder, open shards, and what is known for its manifest."""

    output: OutputBundle
    staging: Path
    journal: Journal
    transforms: ThreadPoolExecutor  # to_runtime, shared by every output of the pass (layers transform in parallel)
    fsync: bool
    transformer: Lane = field(default_factory=Lane)  # in order: a layer's transform's result, queued on ``lane``
    lane: Lane = field(default_factory=Lane)  # hashing and writing
    writers: dict[str, ShardWriter] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    global_scales: dict[str, float] = field(default_factory=dict)
    remaining: dict[str, int] = field(default_factory=dict)  # shard -> tensors not yet queued
    syncer: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))  # shards' fsync, in order
    syncs: list[Future] = field(default_factory=list)

    def __post_init__(self) -> None:
        for file, tensors in self.output.plan.shards.items():
            if file in self.journal.kept:
                kept = self.journal.kept[file]
                self.files[file] = kept.digest
                self.digests.update(kept.tensors)
                self.global_scales.update(kept.global_scales)
            else:
                self.remaining[file] = len(tensors)

    def needs(self, unit: str) -> bool:
        return any(self.output.plan.file_of[t.name] in self.remaining for t in self.output.plan.units[unit])

    def take_layer(self, layer: OutputLayer, weight: NVFP4Weight) -> None:
        """Start ``weight``'s transform on the shared pool and queue its writes behind what this bundle queued
        before: the next layer's transform runs while this one's waits for the lane, so at most one layer more
        than ``transformer``'s bound is in flight."""
        nbytes = weight.codes.nbytes + weight.block_scales.nbytes
        if self.output.plan.target.scheme == "W4A4":
            weight = replace(weight, input_scale=layer.input_scale, partition_scales=layer.partition_scales)
        transformed = self.transforms.submit(self.output.plan.target.to_runtime, weight)
        self.transformer.submit(nbytes, self._queue_layer, layer, transformed)

    def take_chunk(self, tensor: PlannedTensor, chunk: bytes | memoryview, last: bool) -> None:
        """Queue passthrough bytes, behind the layers already queued (the shards' order)."""
        if self.output.plan.file_of[tensor.name] in self.remaining:
            self.transformer.submit(len(chunk), self._queue_write, tensor, chunk, last)

    def take_experts(self, tensors: list[PlannedTensor], stack: ExpertStack, last: bool) -> None:
        """Some experts' rows of a FusedMoE layer's ``tensors`` (consecutive in the shard: one, or the scalars) as
        :meth:`take_layer` takes a dense layer: the layout's transform on the shared pool, the bytes queued behind
        what this bundle queued before. ``last``: the tensors' last experts."""
        experts = tensors[0].experts
        nbytes = sum(t.nbytes for t in tensors) * stack.experts // (experts.experts[1] - experts.experts[0])
        transformed = self.transforms.submit(moe_layout(self.output.plan.target).to_runtime, stack,
                                             experts.prefix, [t.part for t in tensors])
        self.transformer.submit(nbytes, self._queue_experts, tensors, transformed, last)

    def take_codes(self, tensor: PlannedTensor, pieces: list[tuple[torch.Tensor, ...]], last: bool) -> None:
        """Some experts' rows of a FusedMoE layer's codes tensor (``w13_weight`` or ``w2_weight``) from their source
        pieces (:func:`expert_pieces`), as :meth:`take_experts` takes a stack: the layout copies the pieces once into
        its order (``codes_from_pieces``; no stack first), on the shared pool."""
        plan = tensor.experts
        nbytes = tensor.nbytes * len(pieces) // (plan.experts[1] - plan.experts[0])
        layout = moe_layout(self.output.plan.target)
        which = tensor.part.partition("_")[0]
        transformed = self.transforms.submit(lambda: {tensor.part: layout.codes_from_pieces(
            which, pieces, plan.group.hidden, plan.intermediate)})
        self.transformer.submit(nbytes, self._queue_experts, [tensor], transformed, last)

    def _queue_experts(self, tensors: list[PlannedTensor], transformed: Future, last: bool) -> None:
        values = transformed.result()
        for tensor in tensors:
            value = values[tensor.part]
            if DTYPE_NAMES[value.dtype] != tensor.dtype_name or tuple(value.shape[1:]) != tensor.shape[1:]:
                raise AssertionError(f"{tensor.name}: target produced {value.dtype} {list(value.shape)}, planned otherwise")
            self._queue_write(tensor, tensor_bytes(value), last=last)

    def _queue_layer(self, layer: OutputLayer, transformed: Future) -> None:
        runtime = transformed.result()
        self.global_scales[layer.prefix] = float(runtime.source_multiplier)
        values = runtime.bundle_tensors()
        for tensor in self.output.plan.units[layer.prefix]:
            value = values[tensor.part]
            if DTYPE_NAMES[value.dtype] != tensor.dtype_name or tuple(value.shape) != tensor.shape:
                raise AssertionError(f"{tensor.name}: target produced {value.dtype} {list(value.shape)}, planned otherwise")
            self._queue_write(tensor, tensor_bytes(value), last=True)

    def _queue_write(self, tensor: PlannedTensor, chunk: bytes | memoryview, last: bool) -> None:
        file = self.output.plan.file_of[tensor.name]
        self.lane.submit(len(chunk), self._write, file, tensor, chunk)
        if last:
            self.remaining[file] -= 1
            if self.remaining[file] == 0:
                self.lane.submit(0, self._close, file)

    def _write(self, file: str, tensor: PlannedTensor, chunk: bytes | memoryview) -> None:
        if file not in self.writers:
            self.writers[file] = ShardWriter(self.staging / file, self.output.plan.shards[file], self.fsync)
        self.writers[file].write(tensor, chunk)

    def _close(self, file: str) -> None:
        writer = self.writers.pop(file)
        self.files[file] = writer.finish()
        self.digests.update(writer.tensor_digests)
        prefixes = {t.layer.prefix for t in self.output.plan.shards[file] if t.layer is not None}
        scales = {p: self.global_scales[p] for p in prefixes}
        self.syncs.append(self.syncer.submit(self._sync, writer, file, scales))

    def _sync(self, writer: ShardWriter, file: str, scales: dict[str, float]) -> None:
        writer.sync()  # only a shard on disk may enter the journal
        self.journal.record(file, self.files[file], writer.tensor_digests, scales)

    def drain(self) -> None:
        """Wait for every queued transform and write, and every shard's fsync."""
        self.transformer.drain()
        self.lane.drain()
        for future in self.syncs:
            future.result()

    def close(self) -> None:
        self.transformer.close()
        self.lane.close()
        self.syncer.shutdown(wait=True, cancel_futures=True)
        for writer in self.writers.values():
            writer.abandon()


def _manifest(source: SourceModel, writing: _Writing, source_files: dict[str, str]) -> Manifest:
    plan = writing.output.plan
    records: dict[str, TensorRecord] = {}
    for file, tensors in plan.shards.items():
        for t in tensors:
            records[t.name] = TensorRecord(file=file, dtype=t.dtype_name, shape=list(t.shape),
                                           digest=writing.digests[t.name])
    layers = {}
    for prefix, layer in plan.layers.layers.items():
        geometry = plan.target.geometry(layer.n, layer.k)
        layers[prefix] = LayerRecord(
            n=layer.n,
            k=layer.k,
            padded_shape=geometry.padded_shape,
            weights_padding_cols=geometry.weights_padding_cols,
            global_scale=writing.global_scales[prefix],
            tensors={t.part: records.pop(t.name) for t in plan.units[prefix]},
            transforms=[LayerTransformRecord(t.location, t.matrix.name, t.matrix.size,
                                             None if t.partitions is None else list(t.partitions))
                        for t in layer_transforms(source.transforms, layer)],
            partitions=_partitions(layer),
            rescale_error=writing.output.rescale_errors.get(prefix),
        )
    moe = {module: _moe_record(source, plan.target, experts, {t.part: records.pop(t.name) for t in plan.units[module]},
                               writing.output.rescale_errors.get(module))
           for module, experts in plan.layers.experts.items()}
    transforms = {
        name: TransformRecord(scheme=m.scheme, type=m.type, block_size=m.size, inverse=m.inverse, scale=m.scale,
                              source_tensors=[t for t in (m.weight, m.perm) if t], tensor=records.pop(name),
                              whole=m.whole)
        for name, m in source.transforms.matrices.items()
    }
    origin = source.checkpoint.origin
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
            files=source_files,
            repo_id=origin.repo_id,
            revision=origin.commit,
            hub_sha256=hub_sha256(source.checkpoint.root, list(source_files)) if origin.repo_id else {},
        ),
        layers=layers,
        passthrough=records,
        files=dict(writing.files),
        transforms=transforms,
        tp_size=plan.layers.tp_size,
        tp_rank=plan.layers.tp_rank,
        fusion=plan.layers.fusion,
        scheme=plan.target.scheme,
        kernels=list(plan.target.kernels),
        moe=moe,
        engines=writing.output.engines,
    )


def _moe_record(source: SourceModel, target: Target, plan: ExpertPlan, tensors: dict[str, TensorRecord],
                rescale_error: float | None) -> MoERecord:
    layout, local = moe_layout(target), slice(*plan.experts)
    top_k = source.checkpoint.config.get("num_experts_per_tok")
    return MoERecord(
        module=plan.module, source=plan.prefix, layout_id=layout.LAYOUT_ID, backend=layout.BACKEND,
        kernels=list(layout.KERNELS), num_experts=plan.group.experts, local_experts=plan.experts[1] - plan.experts[0],
        experts=list(plan.experts), rows=list(plan.rows),
        hidden=plan.group.hidden, intermediate=plan.intermediate,
        members={"gate": list(plan.group.gate[local]), "up": list(plan.group.up[local]),
                 "down": list(plan.group.down[local])},
        input_scales=input_scale_scope(source), tensors=tensors,
        expert_map=plan.expert_map if plan.ep else None,
        top_k=top_k if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0 else None,
        rescale_error=rescale_error,
    )


def _kept(writings: list[_Writing]) -> list[tuple[Path, Path | None, int, int]]:
    """Per destination: ``(out, staging folder kept for --resume, shards kept, shards planned)``; a --tp
    conversion's ranks are one destination with nothing kept (its staging is removed: --resume does not cover it)."""
    kept: dict[Path, tuple[Path, Path | None, int, int]] = {}
    for w in writings:
        out, done, total = w.output.out, len(w.journal.kept_now()), len(w.output.plan.shards)
        if w.output.rank:
            kept[out] = (out, None, 0, total + (kept[out][3] if out in kept else 0))
        else:
            kept[w.output.path] = (w.output.path, w.staging, done, total)
    return list(kept.values())


def rank_folder(rank: int) -> str:
    """Where rank ``rank`` of a ``--tp`` conversion lives inside OUT."""
    return f"rank-{rank}"


def _finish(source: SourceModel, writing: _Writing, source_files: dict[str, str]) -> None:
    """Index, side files, config and manifest of a bundle whose shards are all written."""
    plan, staging = writing.output.plan, writing.staging
    if plan.is_sharded:
        weight_map = {t.name: file for file, tensors in plan.shards.items() for t in tensors}
        writing.files[INDEX_NAME] = write_json(
            staging / INDEX_NAME, {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
        )
    for name in source.checkpoint.side_files():
        shutil.copyfile(source.checkpoint.contained(name), staging / name)
        writing.files[name] = file_hexdigest(staging / name)
    writing.files["config.json"] = write_json(staging / "config.json", bundle_config(source.checkpoint.config, plan.target, plan.layers))
    writing.journal.discard()
    (staging / MANIFEST_NAME).write_text(_manifest(source, writing, source_files).to_json())


def _serve_from_root(source: SourceModel, rank0: Path) -> None:
    """Copy rank 0's config.json and side files (tokenizer, generation config) to the top of a ``--tp`` output,
    byte for byte, so that ``vllm serve OUT --tensor-parallel-size N`` finds a model folder there (vLLM reads the
    config and tokenizer from the folder it is given; each rank's loader then opens ``OUT/rank-R``). rank 0's
    manifest hashes them; ``verify`` checks the copies against it."""
    for name in ["config.json", *source.checkpoint.side_files()]:
        shutil.copyfile(rank0 / name, rank0.parent / name)


def _pass(source: SourceModel, reader: HashingReader, outputs: list[_Writing], report: Progress) -> None:
    """Read every unit some output still needs, once, and hand it to each of them (``reader`` hashes the source
    files on the way; units no output needs are left to its final hashing)."""
    for unit in sorted({unit for w in outputs for unit in w.output.plan.units}):  # every plan's unit_order, merged
        takers = [w for w in outputs if unit in w.output.plan.units and w.needs(unit)]
        if not takers:
            continue
        if unit in takers[0].output.plan.layers.experts:
            _pass_experts(source, reader, unit, takers, report)
            continue
        if unit in takers[0].output.plan.layers.layers:  # an output layer: a source layer, or pieces of some
            loaded: dict[str, NVFP4Weight] = {}  # each source layer read once, shared by every bundle's pieces

            def load(prefix: str) -> NVFP4Weight:
                if prefix not in loaded:
                    loaded[prefix] = source.load_layer(source.layers[prefix], reader.read)
                return loaded[prefix]

            for writing in takers:
                layer = writing.output.plan.layers.layers[unit]
                whole = layer.prefix in source.layers and layer.pieces == (whole_piece(source.layers[layer.prefix]),)
                writing.take_layer(layer, load(layer.prefix) if whole else assemble(source, layer, load))
            report(sum(source.checkpoint.tensors[n].nbytes for p in loaded for n in source.layers[p].tensor_names), unit)
            continue
        if unit in source.transforms.matrices:  # an online-transform matrix, normalized and cast per output
            for writing in takers:
                tensor = writing.output.plan.units[unit][0]
                matrix = runtime_matrix(source.checkpoint, tensor.matrix, DTYPES[tensor.dtype_name])
                writing.take_chunk(tensor, tensor_bytes(matrix), last=True)
            report(0, unit)
            continue
        entry = source.checkpoint.entry(unit)
        done = 0
        for chunk in reader.chunks(entry) if entry.nbytes else [b""]:
            done += len(chunk)
            for writing in takers:
                writing.take_chunk(writing.output.plan.units[unit][0], chunk, last=done == entry.nbytes)
            report(len(chunk), unit)


MARLIN_SCALE_CHUNK = 32  # experts whose block scales Marlin's largest-scale pass reads at once
MOE_CHUNK_BYTES = 16 << 20  # a bundle's bytes of one layout tensor transformed at once: below glibc's 32 MB, above
# which it maps each block afresh (every page then faulted and zeroed by the kernel)
MOE_PASS_BYTES = 32 << 20  # all bundles' bytes of one chunk: what a --tp pass holds in flight grows with the ranks


def moe_chunk_experts(per_expert: int, share: float, bundles: int) -> int:
    """Experts per chunk of a layout tensor made from ``per_expert`` source bytes of each expert, of which each of
    ``bundles`` bundles holds ``share`` (1 / TP of each expert's rows, or whole experts): about ``MOE_CHUNK_BYTES``
    per bundle, fewer when many bundles share the pass (--tp 8: 4 MB each; with 16 MB each its peak RSS was 1.7-1.9
    GB against 0.65-0.8 GB, docs/benchmarks.md)."""
    return max(1, int(min(MOE_CHUNK_BYTES, MOE_PASS_BYTES / bundles) / (per_expert * share)))


def _pass_experts(source: SourceModel, reader: HashingReader, module: str, takers: list[_Writing],
                  report: Progress) -> None:
    """One FusedMoE layer for every bundle that needs it (a --tp output's ranks: each source expert read once for
    all of them). Tensor by tensor, in the shards' order, each a chunk of experts at a time (every layout tensor
    is expert by expert), so memory holds one chunk of experts whatever the layer's size: each layout tensor is
    made from one source tensor of each expert layer (codes or block scales), which its chunks alone read, so
    every source tensor is read once; the small scalar tensors come from the experts' 4-byte scales at once."""
    plans = [w.output.plan.layers.experts[module] for w in takers]
    group = plans[0].group
    scales = [expert_input_scales(source, plan) for plan in plans]
    layout = moe_layout(takers[0].output.plan.target)
    largest = [largest_expert_scales(source, plan, layout, MARLIN_SCALE_CHUNK) for plan in plans]  # Marlin's factor
    tensors = takers[0].output.plan.units[module]  # one layout: the same parts, in the same order, in every bundle
    weights = [i for i, t in enumerate(tensors) if t.part in MADE_FROM]  # the layouts list them before the scalars
    scalars = [i for i, t in enumerate(tensors) if t.part not in MADE_FROM]
    share = max((p.rows[1] - p.rows[0]) / group.intermediate for p in plans)  # of each expert, in one bundle
    fetch = expert_tensor_reader(source, reader.read)
    done = 0
    for index in weights:
        field = MADE_FROM[tensors[index].part]
        projections = (group.gate, group.up) if field.startswith("w13") else (group.down,)
        which = 0 if field.endswith("codes") else 1
        per_expert = sum(source.checkpoint.tensors[source.layers[names[0]].tensor_names[which]].nbytes
                         for names in projections)
        step = moe_chunk_experts(per_expert, share, len(takers))
        for start in range(0, group.experts, step):
            read = functools.cache(fetch)  # the chunk's source tensors, each read once for every bundle
            for writing, plan, scale, top in zip(takers, plans, scales, largest):
                first, last = max(start, plan.experts[0]), min(start + step, plan.experts[1])
                if first >= last:
                    continue
                tensor = writing.output.plan.units[module][index]
                if which == 0:  # codes: copied once, by the layout, from the source's views
                    pieces = expert_pieces(plan, read, (first, last), field.partition("_")[0], "codes")
                    writing.take_codes(tensor, pieces, last == plan.experts[1])
                else:
                    stack = replace(assemble_experts(source, plan, read, (first, last), (field,), scale),
                                    largest_scales=top)
                    writing.take_experts([tensor], stack, last == plan.experts[1])
            chunk = per_expert * (min(start + step, group.experts) - start)
            report(chunk, module)
            done += chunk
    for writing, plan, scale, top in zip(takers, plans, scales, largest):
        stack = replace(assemble_experts(source, plan, fields=("multipliers",), input_scales=scale), largest_scales=top)
        writing.take_experts([writing.output.plan.units[module][i] for i in scalars], stack, True)
    layers = [source.layers[names[e]] for names in (group.gate, group.up, group.down) for e in range(group.experts)]
    report(sum(source.checkpoint.tensors[n].nbytes for layer in layers for n in layer.tensor_names) - done, module)


def convert_bundles(
    source: SourceModel,
    outputs: Sequence[OutputBundle],
    *,
    overwrite: bool = False,
    resume: bool = False,
    fsync: bool = True,
    progress: Progress | None = None,
    notify: Notice | None = None,
) -> list[ConvertSummary]:
    """Write every bundle of ``outputs`` in one pass over ``source``; each destination is all-or-nothing on its
    own (the ``folder``s of one ``out``, a --tp conversion's ranks or several targets, are staged and installed
    together, with the output's record of them).

    ``resume``: reuse the staging folder an interrupted convert to the same destination left, keeping the
    shards its journals record (when the source and plan are the same and each file still hashes as
    recorded); everything else is written again, so the result is byte-identical to an uninterrupted run.
    ``fsync`` False: publish without waiting for the disk (see ``bundle/writer.py`` for what that gives up).
    What interrupted converts to the destinations left (hidden staging folders) is removed, but for the one a
    resume continues; ``notify`` is told, in one line.
    """
    started = time.perf_counter()
    report = progress or (lambda nbytes, what: None)
    groups: dict[Path, list[OutputBundle]] = {}
    for output in outputs:
        groups.setdefault(output.out, []).append(output)
    for out, group in groups.items():
        recover_interrupted(out)  # a replace killed between its two renames left OUT missing
        check_destination(out, overwrite, protected=[source.checkpoint.root])
        if resume and any(output.rank for output in group):
            raise RepackError(f"{out}: --resume is not supported for tensor-parallel (--tp) conversions")
    identity = source_identity(source.checkpoint)
    reused = {out: find_resumable(out, {o.folder: o.plan for o in group}, identity) if resume else None
              for out, group in groups.items()}
    remove_leftovers({out: resumable and resumable.folder for out, resumable in reused.items()},
                     "--resume found no finished shard of this run's plan and source in them" if resume else
                     "a run with --resume would have continued from them", notify)
    with ExitStack() as stack:
        reader = HashingReader(source.checkpoint)
        stack.callback(reader.close)
        transforms = ThreadPoolExecutor(min(os.cpu_count() or 1, 2 * len(outputs)))  # each output has <= 2 in flight
        stack.callback(transforms.shutdown, wait=True, cancel_futures=True)
        writings: list[_Writing] = []
        roots: dict[Path, Path] = {}
        try:
            for out, group in groups.items():
                reuse = reused[out]
                roots[out] = root = stack.enter_context(staged_folder(
                    out, overwrite, reuse=reuse and reuse.folder, keep_interrupted=not group[0].rank, fsync=fsync))
                if reuse is not None and group[0].folder:
                    _drop_members(root, group, reuse, notify)
                for output in group:
                    staging = root / output.folder
                    staging.mkdir(exist_ok=True)
                    journal = ((reuse and reuse.journals.get(output.folder))
                               or Journal.start(staging, output.plan, identity))
                    writings.append(_Writing(output, staging, journal, transforms, fsync))
                    stack.callback(writings[-1].close)
            with one_torch_thread():
                _pass(source, reader, writings, report)
            for writing in writings:
                writing.drain()
            source_files = reader.digests()
            for writing in writings:
                _finish(source, writing, source_files)
            for out, group in groups.items():
                if group[0].folder:  # several bundles in one output: --tp ranks, or targets
                    if group[0].rank:
                        _serve_from_root(source, roots[out] / rank_folder(0))
                    write_output_record(roots[out], [output.folder for output in group])
        except KeyboardInterrupt:  # finish the writes already queued (bounded by LANE_BYTES), keep them for a resume
            for writing in writings:
                writing.drain()
                writing.close()
                writing.journal.save()
            raise Interrupted(_kept(writings)) from None
    bytes_in = sum(e.nbytes for e in source.checkpoint.tensors.values())
    seconds = time.perf_counter() - started
    return [
        ConvertSummary(out=w.output.out if w.output.rank else w.output.path, target=w.output.plan.target.name, layers=len(w.output.plan.layers.layers),
                       moe_layers=len(w.output.plan.layers.experts),
                       passthrough=sum(bool(t.source_name) for parts in w.output.plan.units.values() for t in parts),
                       bytes_in=bytes_in, bytes_out=w.output.plan.total_bytes,
                       seconds=seconds, kept_shards=len(w.journal.kept),
                       bundles=[str(w.output.path)])
        for w in writings
    ]


def remove_leftovers(outs: dict[Path, Path | None], why: str, notify: Notice | None) -> None:
    """Remove the hidden folders interrupted converts to each ``out`` left (but the one a resume continues, its
    value), and say so in one line, with ``why``."""
    removed = {out: remove_stale(out, keep) for out, keep in outs.items()}
    names = [str(out) for out, (folders, _) in removed.items() if folders]
    if names and notify is not None:
        folders, nbytes = (sum(r[i] for r in removed.values()) for i in (0, 1))
        notify(f"{', '.join(names)}: removed {folders} hidden folder(s) that interrupted converts left "
               f"({nbytes / 1e6:.1f} MB); {why}")


def _drop_members(root: Path, group: list[OutputBundle], reuse: Resumable, notify: Notice | None) -> None:
    """In the staging folder of several targets that a resume continues: remove the bundle folders of targets this
    run does not write (saying so in one line) and empty those whose journal does not match (written afresh)."""
    wanted = {output.folder for output in group}
    others = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name not in wanted)
    nbytes = sum(folder_bytes(p) for p in others)
    for folder in others + [root / f for f in sorted(wanted - set(reuse.journals)) if (root / f).is_dir()]:
        shutil.rmtree(folder)
    if others and notify is not None:
        names = ", ".join(p.name for p in others)
        notify(f"{group[0].out}: removed what the interrupted convert left for {names} ({nbytes / 1e6:.1f} MB); "
               f"this run does not write {names}")


def resolve_targets(names: str | Sequence[str]) -> list[Target]:
    """Targets by name or alias, ``all`` for every family; each family once, in the order given."""
    return [resolve_target(family.name) for family in resolve_families(names)]


def convert(
    model: str | Path,
    target_name: str | Sequence[str],
    out: str | Path,
    *,
    revision: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
    fsync: bool = True,
    max_shard_size: int | str = "5GB",
    fuse: bool = False,
    tp: int = 1,
    rescale: bool = False,
    weight_only: bool = False,
    ep: bool = False,
    vllm: str | None = None,
    engine: str = "vllm",
    linear_backend: str = AUTO,
    progress: Progress | None = None,
    on_plan: Callable[[SourceModel, list[OutputBundle]], None] | None = None,
    notify: Notice | None = None,
) -> ConvertSummary | list[ConvertSummary]:
    """Convert ``model`` (a folder, or a Hub repo id at ``revision``) into bundles; all-or-nothing per bundle.

    One target family (a name, or names that are aliases of one family): ``out`` is the bundle, and one summary
    is returned. Several families (``all`` for every one): one pass writes ``out/<target>`` for each, and a list
    of summaries is returned; a new ``out`` is staged whole (it appears with every bundle, or not at all), an
    existing one gets each bundle beside those it holds.

    ``fsync`` False: bundles are published without waiting for the disk: faster where the disk is slow, for
    CI jobs that rerun a failed step; a kill still leaves each bundle whole or absent, a machine crash may not.
    ``fuse``: vLLM's fused modules (qkv_proj, gate_up_proj); ``tp > 1``: one bundle per tensor-parallel rank in
    ``out/rank-R`` (one summary for them all); ``rescale``: fold unequal partition scales into block scales.
    These take one target, and no ``resume`` with ``tp > 1``. An MoE model's FusedMoE layers are written in the
    MoE layout vLLM's ``auto`` serves the family with (docs/moe.md); ``ep`` (with ``tp > 1``): placed as vLLM's
    ``--enable-expert-parallel`` places them, whole experts per rank. Missing parent folders of ``out`` are created
    (and removed again if the convert fails). An output of several bundles (targets, or ranks) records their
    names in ``out/<OUTPUT_RECORD>``, so that verify fails when one goes missing. ``notify``: one-line notices
    (what interrupted converts left and this one removed).

    The layout follows vLLM's ``auto``: a W4A4 checkpoint gets each family's W4A4 layout where it has one (sm100,
    sm120; sm90 is weight-only for every checkpoint), a weight-only
    one the W4A16 layout. ``weight_only``: the layout of the family's weight-only kernel for every checkpoint
    (activations stay bf16): the W4A16 layout (as before W4A4 layouts existed), Marlin's W4A4 variant where Marlin is
    that kernel (sm120, sm80, sm75). ``linear_backend``: the layout of the kernel vLLM's ``--linear-backend`` of that
    name picks (``flashinfer_cutedsl`` on sm120: FlashInfer's cute-dsl W4A16 layout), refused where none is written.
    ``vllm``: the vLLM version the bundle is for (``0.33``, ``0.34``; None: the newest
    supported); the manifest lists every supported version whose state after loading is the bundle's
    (targets/engines.py), and a bundle the named version cannot serve is refused before anything is written.

    ``engine``: the serving engine whose post-load state the bundles hold: ``vllm``, or ``sglang`` (SGLang 0.5.23:
    its fused modules, always, under its names and scalars; docs/sglang.md).
    """
    version, fuse = check_options(target_name, max_shard_size=max_shard_size, fuse=fuse, tp=tp, ep=ep, resume=resume,
                                  rescale=rescale, weight_only=weight_only, linear_backend=linear_backend,
                                  engine=engine, vllm=vllm)
    targets = resolve_targets(target_name)
    single = not several_families(target_name)
    out = Path(out)
    source = read_source(model, revision=revision)
    if not single:
        _check_root(out, protected=source.checkpoint.root)
    created = _make_folders(out.parent)
    try:
        return _convert(source, targets, out, single, overwrite=overwrite, resume=resume, fsync=fsync,
                        max_shard_size=max_shard_size, fuse=fuse, tp=tp, rescale=rescale, weight_only=weight_only,
                        ep=ep, engine=version, linear_backend=linear_backend, progress=progress, on_plan=on_plan,
                        notify=notify)
    except BaseException:
        _remove_if_empty(created)
        raise


def check_options(target_name: str | Sequence[str], *, max_shard_size: int | str = "5GB", fuse: bool = False, tp: int = 1,
                  ep: bool = False, resume: bool = False, rescale: bool = False, weight_only: bool = False,
                  linear_backend: str = AUTO, engine: str = "vllm", vllm: str | None = None) -> tuple[EngineVersion, bool]:
    """:func:`convert`'s option values and combinations, refused in one line before anything is read (the CLI reports
    them as bad usage, exit code 2). Returns the engine version the bundles are for, and whether they are fused (an
    engine that holds its fused modules only, SGLang, always: ``EngineVersion.fused``)."""
    if engine not in ENGINE_NAMES:
        raise RepackError(f"--engine {engine}: expected one of {', '.join(ENGINE_NAMES)}")
    refused = newest(engine).options  # what the engine's bundles cannot take
    _check_linear_backend(linear_backend, weight_only=weight_only, refusal=refused.get("--linear-backend"))
    if vllm is not None and VERSION_FLAGS.get(engine) != "--vllm":
        raise RepackError(f"--vllm {vllm} names a vLLM version; an --engine {engine} bundle is for {engine}")
    if rescale and "--rescale" in refused:
        raise RepackError(refused["--rescale"])
    version = resolve_version(engine, vllm)
    fuse = fuse or version.fused
    if tp < 1:
        raise RepackError(f"--tp {tp}: expected a positive number of ranks")
    parse_size(max_shard_size)  # a bad shard size fails before any work
    if (fuse or tp > 1) and several_families(target_name):
        what = (f"--engine {engine} (its bundles are fused, as the engine holds them) takes" if version.fused else
                "--fuse/--tp take")
        raise RepackError(f"{what} one target family; convert each target in a run of its own")
    if resume and tp > 1:
        raise RepackError("--resume is not supported with --tp (a --tp convert keeps nothing when interrupted); "
                          "run the command again without --resume")
    if ep and tp == 1:
        raise RepackError("--ep places whole experts on tensor-parallel ranks: give --tp N with N > 1")
    return version, fuse


def _convert(source: SourceModel, targets: list[Target], out: Path, single: bool, *,
             overwrite: bool, resume: bool, fsync: bool, max_shard_size: int | str, fuse: bool, tp: int,
             rescale: bool, weight_only: bool, ep: bool, engine: EngineVersion, linear_backend: str,
             progress: Progress | None, on_plan: Callable | None,
             notify: Notice | None) -> ConvertSummary | list[ConvertSummary]:
    """:func:`convert` once ``out``'s parent exists. Several targets into a new ``out`` are staged together, as a
    --tp conversion's ranks are (``out`` appears whole, or a hidden staging folder is left); into an existing
    ``out`` (it holds earlier bundles), each is staged and installed inside it on its own."""
    written = {t.name for t in targets}
    inside = not single and (out.exists() or out.is_symlink())
    if inside:  # what interrupted runs left: the targets this one does not write, a staging of OUT while it was new
        remove_leftovers({out / f.name: None for f in FAMILIES if f.name not in written},
                         "this run does not write that target", notify)
        remove_leftovers({out: None}, f"a run with --resume would have continued from them while {out} did not exist",
                         notify)
    targets = [engine_target(t, engine, source, weight_only, linear_backend) for t in targets]
    input_scales = any(t.scheme == "W4A4" for t in targets)
    if fuse or tp > 1:
        moe = moe_layout(targets[0]) if expert_groups(source) else None  # its refusal (sm90) before the plan's
        if moe is not None and ep and engine.even_experts:
            _check_even_experts(source, tp)
        layer_plans = plan_layers(source, fuse=fuse, tp=tp, rescale=rescale, input_scales=input_scales, ep=ep,
                                  partition_scales=engine.stored_scales and input_scales,
                                  expert_scales=engine.stored_scales,
                                  **({} if moe is None else {"moe_rank_alignment": moe.TP_ALIGNMENT,
                                                             "moe_gate_up": moe.GATE_UP_REFUSAL}))
        plans = [plan_bundle(source, targets[0], layers, max_shard_size) for layers in layer_plans]
        outputs = [OutputBundle(out, p, rank_folder(p.layers.tp_rank) if tp > 1 else "") for p in plans]
    else:
        _refuse_unfused_moe(source, targets)
        layers = plan_layers(source, input_scales=input_scales)[0]
        outputs = [OutputBundle(out / t.name if inside else out, plan_bundle(source, t, layers, max_shard_size),
                                "" if single or inside else t.name) for t in targets]
    outputs = [replace(output, engines=bundle_engines(engine, _layout_ids(output.plan), _features(source, output.plan)))
               for output in outputs]  # a version's refusal before anything is written
    if on_plan is not None:
        on_plan(source, outputs)
    outputs = [replace(output, rescale_errors=_rescale_errors(source, output.plan)) for output in outputs]
    rescaled: dict[str, float] = {}
    for output in outputs:
        for prefix, error in output.rescale_errors.items():
            rescaled[prefix] = max(rescaled.get(prefix, 0.0), error)
    summaries = convert_bundles(source, outputs, overwrite=overwrite, resume=resume, fsync=fsync, progress=progress,
                                notify=notify)
    if inside:  # the record names the earlier bundles still there too
        recorded = read_output_record(out) or []
        write_output_record(out, [f.name for f in FAMILIES if f.name in written or (
            f.name in recorded and (out / f.name / MANIFEST_NAME).is_file())], fsync)
    if not single:
        return summaries
    first = summaries[0]
    return replace(first, bytes_out=sum(s.bytes_out for s in summaries), rescaled=rescaled,
                   bundles=[b for s in summaries for b in s.bundles])


def _check_linear_backend(linear_backend: str, *, weight_only: bool, refusal: str | None = None) -> None:
    """One-line refusals of a --linear-backend convert does not know or cannot combine (``refusal``: the engine's, whose
    bundles cannot take one)."""
    if linear_backend != AUTO and linear_backend not in LINEAR_BACKENDS:
        raise RepackError(f"--linear-backend {linear_backend}: expected one of {', '.join((AUTO, *LINEAR_BACKENDS))}")
    if linear_backend != AUTO and weight_only:
        raise RepackError(f"--linear-backend {linear_backend} --weight-only: --weight-only picks the family's "
                          "weight-only kernel itself; give one of the two")
    if linear_backend != AUTO and refusal is not None:
        raise RepackError(refusal)


def engine_target(family: Target, engine: EngineVersion, source: SourceModel, weight_only: bool = False,
                  linear_backend: str = AUTO) -> Target:
    """``family``'s layout of ``engine``'s state for ``source`` (:meth:`Target.for_engine`: vLLM's ``auto``, or the
    layout of the kernel its ``linear_backend`` picks; ``weight_only``: as the engine serves it weight-only), or a
    one-line refusal of what the engine's row refuses (online transforms, its MoE checks) or no layout holds."""
    if source.transforms.layers and engine.transforms is not None:
        raise RepackError(engine.transforms)
    target = family.for_engine(engine.engine, source.format, served_scheme(source), weight_only, linear_backend)
    if target is None and linear_backend != AUTO:
        written = sorted({b for t in family.layouts if t.engine == "vllm" and t.scheme == served_scheme(source)
                          for b, kernels in LINEAR_BACKENDS.items() if set(kernels) & set(t.kernels)})
        hopper = linear_backend == "marlin" and max(family.compute_capabilities) < (10, 0)  # sm90: the GPU tests' case
        marlin = ("; for vLLM's Marlin there, convert with -t sm80 (Marlin's bytes, which the plugin serves on any GPU "
                  "from sm80: docs/marlin.md)" if hopper else "")
        raise RepackError(f"--linear-backend {linear_backend} -t {family.name}: vLLM's kernel for a "
                          f"{served_scheme(source)} checkpoint there holds no layout written here; --linear-backend "
                          f"{' or '.join([AUTO, *written])}{marlin}")
    if target is None:
        raise RepackError(f"--engine {engine.engine} -t {family.name}: SGLang 0.5.23 serves no NVFP4 checkpoint there "
                          "(its FP4 Marlin needs compute capability 8.0); -t sm80, sm90, sm100 or sm120")
    if engine.moe_checks and expert_groups(source):
        layout = moe_layout(target)  # the layout's own refusal first (FP4 Marlin's experts are not written for SGLang)
        check_sglang_moe_architecture(source.checkpoint.config, expert_groups(source), layout.BACKEND)
        _check_sglang_moe_input_scales(source)
    return target


def _check_even_experts(source: SourceModel, tp: int) -> None:
    """SGLang 0.5.23's expert parallelism (``--ep-size`` = ``--tp``) gives each rank ``E / tp`` consecutive experts and
    asserts the division: a one-line refusal where it does not hold."""
    for prefix, group in expert_groups(source).items():
        if group.experts % tp:
            raise RepackError(f"--ep --tp {tp}: {prefix} has {group.experts} experts; SGLang 0.5.23 places the same "
                              f"number on every rank (--ep-size {tp}), so they must be a multiple of {tp}")


def _check_sglang_moe_input_scales(source: SourceModel) -> None:
    """SGLang 0.5.23's FusedMoE loader writes a ModelOpt expert's w1 and w3 ``input_scale`` each into both halves of
    its ``w13_input_scale`` (``_load_single_value``: the one read last stays), so the two must agree (they do where
    the producer calibrated them on their one input); a one-line refusal naming the first that does not."""
    if source.format != "modelopt" or source.activation_scheme != "W4A4":  # W4A16_NVFP4: none stored
        return
    for group in expert_groups(source).values():
        gate, up = (read_input_scales(source, names) for names in (group.gate, group.up))
        differ = (gate != up).nonzero()
        if len(differ):
            e = int(differ[0])
            raise RepackError(f"{group.gate[e]}: input_scale {float(gate[e]):.6g} is not {group.up[e]}'s "
                              f"{float(up[e]):.6g}; SGLang 0.5.23 loads one of them into both halves of "
                              "w13_input_scale (the one it reads last), so its state would depend on its load order")


def _layout_ids(plan: BundlePlan) -> list[str]:
    """The layouts a bundle holds: its dense layers' and its FusedMoE layers'."""
    return [plan.target.layout_id] + ([moe_layout(plan.target).LAYOUT_ID] if plan.layers.experts else [])


def _features(source: SourceModel, plan: BundlePlan) -> list[str]:
    """What of a bundle an engine version may not serve (targets/engines.py), on Blackwell (capability 10.0 and up),
    where vLLM picks a layer's transform method from the checkpoint's scheme and the layer's kernel: a W4A4 checkpoint's
    layer that vLLM 0.34 serves through Humming's Hadamard kernel (whatever the bundle's layout, but Marlin's: vLLM's
    --linear-backend marlin keeps Humming out); a layer Marlin serves that vLLM 0.33 gives QuTLASS's method."""
    if min(plan.target.compute_capabilities) < (10, 0):
        return []
    marlin = plan.target.kernels == MARLIN
    found: set[str] = set()
    for layer in plan.layers.layers.values():
        placed = layer_transforms(source.transforms, layer)
        inputs = [(t.matrix.type, None if t.matrix.whole else t.matrix.size) for t in placed if t.location == "input"]
        if marlin and runs_qutlass([block for _, block in inputs]):
            found.add(QUTLASS_MARLIN)
        outputs = sum(t.location == "output" for t in placed)
        if not marlin and source.activation_scheme == "W4A4" and runs_humming(inputs, outputs):
            found.add(HADAMARD_W4A4)
    return sorted(found)


def vllm_versions(source: SourceModel, family: str) -> list[str] | None:
    """The vLLM versions whose state ``convert`` writes for ``source`` on ``family`` by default (fused where the model
    has experts): every supported version, but where one serves a layer otherwise (targets/engines.py), so that
    ``inspect`` says before a convert refuses it; None where the default convert refuses the plan itself (it says
    why)."""
    try:
        target = engine_target(resolve_target(family), newest("vllm"), source)
        layers = plan_layers(source, fuse=bool(expert_groups(source)), input_scales=target.scheme == "W4A4")[0]
        if layers.experts:
            moe_layout(target)
        plan = plan_bundle(source, target, layers)
    except RepackError:
        return None
    return [v.version for v in engine_versions("vllm") if serves(v, _layout_ids(plan), _features(source, plan))]


def _refuse_unfused_moe(source: SourceModel, targets: list[Target]) -> None:
    """An MoE checkpoint converts into vLLM's FusedMoE layers only (``fuse`` / ``tp``): unfused, each expert would be
    three dense layers of its own, which no engine serves. A family without an MoE layout (sm90) is named first."""
    groups = expert_groups(source)
    if not groups:
        return
    for target in targets:
        moe_layout(target)
    raise RepackError(f"{source.checkpoint.root}: an NVFP4 MoE model ({len(groups)} FusedMoE layers): convert it with "
                      "--fuse or --tp N, which write vLLM's FusedMoE layers; unfused, each expert's gate/up/down would be "
                      "dense layers of their own, which no engine serves")


def served_scheme(source: SourceModel) -> str:
    """The checkpoint's activation scheme, which vLLM's scheme (and so its kernel choice) follows: a W4A4 one with
    online transforms too, which vLLM serves through QuTLASS or its transform method around the W4A4 kernel."""
    return source.activation_scheme


def _rescale_errors(source: SourceModel, plan: BundlePlan) -> dict[str, float]:
    """The relative L2 error ``--rescale`` adds to each rescaled layer of ``plan``, as the layout's kernel reads the
    rescaled weights (Marlin: scales flushed): recorded in its manifest, where verify bounds the layer's actual
    departure from the source by it."""
    dense = {prefix: rescale_error(source, layer, plan.target.as_read(assemble(source, layer)))
             for prefix, layer in plan.layers.layers.items() if any(piece.scale_ratio != 1.0 for piece in layer.pieces)}
    return dense | {module: expert_rescale_error(source, experts) for module, experts in plan.layers.experts.items()
                    if experts.rescale}


def _check_root(out: Path, protected: Path) -> None:
    """The folder that holds one bundle per target: never a bundle itself, nor the input."""
    if (out / MANIFEST_NAME).is_file():
        raise RepackError(f"{out}: is a bundle; several targets are written to <out>/<target>, choose another output")
    clash = clash_with_input(out, protected)
    if clash:
        raise RepackError(clash)
    if out.exists() and not out.is_dir():
        raise RepackError(f"{out}: exists and is not a folder")


def _make_folders(folder: Path) -> list[Path]:
    """``folder`` and its missing parents created, as ``mkdir -p`` does; returns those created, outermost first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists() and not p.is_symlink()][::-1]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RepackError(f"{folder}: cannot create the output folder ({exc.strerror or exc})") from None
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    """Undo :func:`_make_folders` after a failure, innermost first, as far as the folders are empty (a Ctrl-C's
    staging folder, kept for a resume, keeps its parents)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return
