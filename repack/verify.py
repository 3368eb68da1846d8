"""verify: prove a bundle computes the same function as its source, in three independent steps.

1. Integrity: every file the manifest lists is present with its digest, every tensor with its dtype, shape
   and digest (BLAKE3 both; the algorithms the manifest names: sha256 / xxh3-128 in older formats), and
   each layer's tensors have the shapes its target's layout implies.
2. Exactness: each layer, decoded with the target's inverse, equals the source's codes, scales and
   multiplier bit for bit; passthrough tensors equal the source's bytes.
3. Numerics: the runtime GEMM on the chosen device, on fresh random bf16 activations, against a float64
   GEMM with weights dequantized from the source (from the bundle's own decode when no source exists).
   On CPU that GEMM is the reference backend, which reads the layout by its index formula
   (``runtime/formulas.py``), not with the inverse step 2 uses, so a transform and its inverse that are
   wrong together still fail here.

Online transforms: each stored matrix is checked for integrity and, with a source, for being bit for bit the
source's matrix normalized and cast as convert makes it; each layer must carry exactly the source's transforms;
numerics apply the source's own unfused float64 matrices (``x @ blockdiag(T) / sqrt(b)``) around the float64 GEMM.

Tolerance: relative L2 error ``||y - ref|| / ||ref||`` <= ``NUMERIC_TOLERANCE`` (1e-2). The output is
rounded to bf16 (8 significant bits, relative rounding error <= 2^-9 per element), plus float32
accumulation over K; 1e-2 leaves headroom for K in the tens of thousands while any wrong byte of
weight or scale, or a misplaced tile, gives errors of order 1.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from .bundle.layers import (
    ExpertPlan, OutputLayer, Piece, assemble, cut, expert_rescale_error, layer_transforms, rescale_error, whole_piece,
)
from .bundle.manifest import MANIFEST_NAME, OUTPUT_RECORD, LayerRecord, MoERecord, PartitionRecord, read_output_record
from .bundle.reader import Bundle, open_bundle
from .convert import rank_folder
from .errors import RepackError
from .formats import SourceModel, read_source
from .formats.checkpoint import contained_file
from .formats.hashing import file_hexdigest, new_digest
from .formats.moe import ExpertGroup, expert_groups, input_scale_scope, kept_scales
from .formats.safetensors_io import DTYPE_NAMES, DTYPES, TensorEntry, map_chunks, map_tensor, read_rows, tensor_bytes
from .formats.transforms import load_matrix, runtime_matrix
from .lane import one_torch_thread
from .nvfp4 import (BLOCK_SIZE, InputScale, NVFP4Weight, dequantize, dequantize_activations, dequantized_products,
                    quantize_activations)
from .runtime import backends, load_bundle
from .runtime.transforms import block_transform, rows_transform
from .targets import TARGETS, RuntimeLayer
from .targets.layout import is_aligned
from .targets.sglang import restated_differences
from .targets.w4a4 import LAYOUT_ID as W4A4_LAYOUT
from .targets.moe import MADE_FROM, moe_specs
from .verify_moe import (EXPERT_REL_ERROR, EXPERT_W4A4_REL_ERROR, engine_expert_findings, engine_expert_numerics,
                         expert_findings, expert_numerics, scalar_names)

NUMERIC_TOLERANCE = 1e-2
LAYERS_IN_FLIGHT = min(2, os.cpu_count() or 1)  # layers checked at once on the CPU (single-threaded torch each):
# the second core is otherwise idle once the file hashes end
PARALLEL_WEIGHT_BYTES = 128 << 20  # ... while their weights are at most this together: a layer's check holds about
# four copies of its weights (source, bundle, decode, temporaries), so two of the largest layers (Llama-405B's MLP:
# 436 MB each) would take gigabytes; one at a time then
BATCH_SIZES = (1, 7, 32)


CHECK_KINDS = ("integrity", "layout", "exactness", "numerics")  # what a failure is about, for the summary


@dataclass
class TensorCheck:
    name: str
    status: str = "ok"  # ok | fail | skipped
    errors: list[str] = field(default_factory=list)
    max_rel_error: float | None = None
    kinds: list[str] = field(default_factory=list)  # the CHECK_KINDS entry of each of ``errors``
    rescale_error: float | None = None  # a --rescale layer: its relative L2 departure from the unfused source
    numerics_experts: int | None = None  # a FusedMoE layer: how many of its experts' numerics ran

    def fail(self, message: str, kind: str = "integrity") -> None:
        self.status = "fail"
        self.errors.append(message)
        self.kinds.append(kind)


def failed(name: str, message: str, kind: str = "integrity") -> TensorCheck:
    """A check that failed with one ``message`` of ``kind``."""
    check = TensorCheck(name)
    check.fail(message, kind)
    return check


@dataclass
class VerifyReport:
    bundle: str
    target: str
    device: str
    backend: str
    source: str | None  # None: no source to compare against, so exactness was not checked
    seed: int
    tolerance: float
    files: list[TensorCheck]
    layers: list[TensorCheck]
    passthrough: list[TensorCheck]
    transforms: list[TensorCheck] = field(default_factory=list)
    numerics_layers: int = 0  # layers whose numerics were checked (all, or a sample: see numerics_sample)
    experts: int = 0  # routed experts the FusedMoE layers hold (exactness covers each)
    numerics_experts: int = 0  # ... of which numerics ran on (all, or a sample: see numerics_experts)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[TensorCheck]:
        return [c for c in self.files + self.layers + self.passthrough + self.transforms if c.status == "fail"]

    def summary(self) -> dict[str, list[str]]:
        """Every failure message, grouped by check kind (kinds without failures left out)."""
        grouped: dict[str, list[str]] = {}
        for check in self.failures:
            for kind, message in zip(check.kinds, check.errors):
                grouped.setdefault(kind, []).append(message)
        return {kind: grouped[kind] for kind in CHECK_KINDS if kind in grouped}

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed, "failures_by_kind": {k: len(v) for k, v in self.summary().items()}}


def _check_file(folder: Path, name: str, digest: str, algorithm: str) -> TensorCheck:
    check = TensorCheck(name)
    try:
        if file_hexdigest(contained_file(folder, name), algorithm) != digest:
            check.fail(f"{name}: {algorithm} digest differs from the manifest (file modified or truncated)")
    except RepackError as exc:
        check.fail(str(exc))
    return check


def _checked_entry(
    bundle: Bundle, name: str, check: TensorCheck, expected: tuple[str, list[int]] | None = None
) -> TensorEntry | None:
    """Header dtype/shape against the manifest (and the layout, if ``expected``); the tensor's entry when they
    match, else None with the failure recorded. A tensor whose file is missing is skipped: the file's own check
    reports that once, not once per tensor."""
    record = bundle.manifest.all_tensors[name]
    if not (bundle.root / record.file).exists():
        check.status = "skipped" if check.status == "ok" else check.status
        return None
    try:
        entry = bundle.entry(name)
    except RepackError as exc:
        check.fail(str(exc))
        return None
    if (entry.dtype_name, list(entry.shape)) != (record.dtype, record.shape):
        check.fail(f"{name}: file has {entry.dtype_name} {list(entry.shape)}, manifest says {record.dtype} {record.shape}")
        return None
    if expected is not None and (record.dtype, record.shape) != expected:
        check.fail(f"{name}: {record.dtype} {record.shape} is not the {bundle.target.name} layout {expected}", "layout")
        return None
    return entry


def _digest_matches(bundle: Bundle, name: str, chunks, check: TensorCheck) -> bool:
    """Whether the tensor's bytes (``chunks``) hash to the manifest's digest; the failure recorded if not."""
    digest = new_digest(bundle.manifest.tensor_digest)
    for chunk in chunks:
        digest.update(chunk)
    if digest.hexdigest() != bundle.manifest.all_tensors[name].digest:
        check.fail(f"{name}: {bundle.manifest.tensor_digest} digest differs from the manifest")
        return False
    return True


def _checked_tensor(
    bundle: Bundle, name: str, check: TensorCheck, expected: tuple[str, list[int]] | None = None
) -> torch.Tensor | None:
    """:func:`_checked_entry`, then the data, read once (mapped) and hashed in memory; the tensor when everything
    matches, else None with the failure recorded."""
    entry = _checked_entry(bundle, name, check, expected)
    if entry is None:
        return None
    tensor = map_tensor(entry)
    return tensor if _digest_matches(bundle, name, [tensor_bytes(tensor)], check) else None


def _checked_streamed(
    bundle: Bundle, name: str, check: TensorCheck, expected: tuple[str, list[int]] | None = None
) -> TensorEntry | None:
    """:func:`_checked_entry`, then the data hashed a mapped chunk at a time (memory holds one chunk, whatever the
    tensor's size: a FusedMoE layer's tensors are gigabytes); the entry, for reading parts of it, when it matches."""
    entry = _checked_entry(bundle, name, check, expected)
    return entry if entry is not None and _digest_matches(bundle, name, map_chunks(entry), check) else None


def _checked_runtime_layer(bundle: Bundle, prefix: str, check: TensorCheck) -> RuntimeLayer | None:
    """The layer's runtime tensors, each checked against the manifest and the target layout (open_bundle has
    already made sure the manifest lists exactly the layout's parts)."""
    record = bundle.manifest.layers[prefix]
    tensors = {
        part: _checked_tensor(bundle, f"{prefix}.{part}", check, (DTYPE_NAMES[spec.dtype], list(spec.shape)))
        for part, spec in bundle.target.layer_specs(record.n, record.k, len(record.partitions)).items()
    }
    if any(tensor is None for tensor in tensors.values()):
        return None
    return bundle.target.runtime_layer(tensors, record.n, record.k, record.weights_padding_cols)


WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes; compared as the widest words both allow (torch.equal is per element, so
    int64 words compare 5x faster than bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    width = next(w for w in WORDS if a.numel() % w == 0 and is_aligned(a, w) and is_aligned(b, w))
    return torch.equal(a.view(WORDS[width]), b.view(WORDS[width]))


def _check_exact(decoded: NVFP4Weight, original: NVFP4Weight, prefix: str, check: TensorCheck) -> None:
    for what, a, b in (("codes", decoded.codes, original.codes), ("block scales", decoded.block_scales,
                       original.block_scales), ("global scale", decoded.multiplier, original.multiplier)):
        if not _same_bits(a, b):
            check.fail(f"{prefix}: {what} differ from the source", "exactness")


def _reference_products(weight: NVFP4Weight, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``x @ dequant(weight).T`` in float64 for each ``x``, all of them through each block of weights in one GEMM
    (``dequantized_products``: memory stays at one block, whatever the layer's size)."""
    return list(dequantized_products(torch.cat(xs), weight).split([len(x) for x in xs]))


def w4a4_products(x: torch.Tensor, weight: NVFP4Weight | torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float64 ``x @ weight.T`` of bf16 ``x`` quantized as the W4A4 kernels quantize it (``quantize_activations``);
    ``weight`` dequantized a block at a time (``dequantized_products``), or already a float64 matrix.

    Not ``w4a4_reference``'s float64 definition of the quantizer: with calibrated scales (``input_scale =
    amax / 2688`` of a bf16 ``amax``) ``gs * amax / 6`` lands on exact e4m3 ties for many blocks, where the kernel's
    float32 arithmetic and the definition round apart by a whole scale step (a percent of a layer's output)."""
    activations = dequantize_activations(*quantize_activations(x, global_scale), global_scale)
    if isinstance(weight, NVFP4Weight):
        return dequantized_products(activations, weight)
    return activations @ weight.t()


def _block64(value: torch.Tensor, matrix: torch.Tensor | None) -> torch.Tensor:
    """The float64 reference's online transform: the runtime's own ``block_transform``, in float64 here."""
    return value if matrix is None else block_transform(value, matrix)


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    error = float((y - ref).norm() / ref.norm().clamp(min=1e-30))
    return error if error == error else float("inf")


def _judge(check: TensorCheck, worst: float, what: str) -> None:
    check.max_rel_error = worst
    if not worst <= NUMERIC_TOLERANCE:
        check.fail(f"{what}: relative error {worst:.3g} exceeds {NUMERIC_TOLERANCE:g}", "numerics")


def output_layer(prefix: str, record: LayerRecord) -> OutputLayer:
    """The manifest's record of which source slices make ``prefix``, as convert planned it."""
    pieces = tuple(Piece(p.source, tuple(p.source_rows), tuple(p.source_cols), p.scale_ratio)
                   for p in record.partitions)
    return OutputLayer(prefix, pieces)  # type: ignore[arg-type]


def _source_slices_problem(src: SourceModel, layer: OutputLayer) -> str | None:
    for piece in layer.pieces:
        found = src.layers.get(piece.source)
        if found is None:
            return f"{layer.prefix}: partition source {piece.source} is not a quantized layer of the source"
        if piece.rows[1] > found.n or piece.cols[1] > found.k or piece.cols[0] % BLOCK_SIZE:
            return f"{layer.prefix}: partition rows {list(piece.rows)} x cols {list(piece.cols)} are outside {piece.source}"
    return None
def _check_numerics(layer: torch.nn.Module, device: torch.device, prefix: str, reference: NVFP4Weight,
                    check: TensorCheck, gen: torch.Generator, one_call: bool,
                    input_matrix: torch.Tensor | None, output_parts: list[tuple[int, int, torch.Tensor]],
                    activation_scale: torch.Tensor | None = None) -> None:
    """``layer`` on random bf16 activations against a float64 GEMM with ``reference`` (the weight it is meant to
    hold: a rescaled layer's rescaled weight), with the layer's online transforms (float64 normalized matrices:
    ``input_matrix`` before it, ``output_parts`` on their output rows after it) applied around it.
    ``activation_scale``: a W4A4 layer's quantizer global scale (its ``input_global_scale_inv``, or QuTLASS's 6),
    with which the reference quantizes the (rotated, bf16) activations first, as the layer's FP4 x FP4 GEMM must
    (:func:`w4a4_products`)."""
    xs = [torch.randn(m, layer.k, generator=gen).to(torch.bfloat16) for m in BATCH_SIZES]
    if one_call:  # the reference backend has no M-dependent path: one decode of the layer serves every batch size
        ys = list(layer(torch.cat(xs).to(device)).to("cpu", torch.float64).split(BATCH_SIZES))
    else:
        ys = [layer(x.to(device)).to("cpu", torch.float64) for x in xs]
    worst = 0.0
    inputs = [_block64(x.to(torch.float64), input_matrix) for x in xs]
    if activation_scale is not None:
        # the kernels quantize bf16 activations rotated by the matrix as the server holds it, the source's rounded to
        # the model dtype: the float64 matrix would round apart from it at e2m1 boundaries, a whole code step each
        # (1-2% of a layer's output for blocks whose sqrt is not exact)
        held = input_matrix
        if held is not None:
            held = held.to(layer.input_transform.dtype).to(torch.float64)
        rotated = [_block64(x.to(torch.float64), held) for x in xs]
        products = [w4a4_products(r.to(torch.bfloat16), reference, activation_scale) for r in rotated]
    else:
        products = _reference_products(reference, inputs)
    refs = [rows_transform(r, output_parts) for r in products]
    for y, ref in zip(ys, refs):
        worst = max(worst, _relative_error(y, ref))
    _judge(check, worst, prefix)


def _check_transforms(bundle: Bundle, src: SourceModel | None) -> tuple[list[TensorCheck], dict[str, torch.Tensor]]:
    """Each stored matrix: integrity, then bit-exact against the source's, normalized and cast as convert does.
    Returns the checks and the float64 matrices numerics apply: the source's own, else the bundle's."""
    checks, reference = [], {}
    source_matrices = src.transforms.matrices if src is not None else {}
    for name, record in bundle.manifest.transforms.items():
        check = TensorCheck(name)
        checks.append(check)
        stored = _checked_tensor(bundle, name, check)
        if src is None:
            reference[name] = stored.to(torch.float64) if stored is not None else None
            continue
        matrix = source_matrices.get(name)
        if matrix is None:
            check.fail(f"{name}: not an online-transform matrix of the source")
            reference[name] = None
            continue
        recorded = (record.scheme, record.type, record.block_size, record.inverse, record.scale, record.whole)
        source = (matrix.scheme, matrix.type, matrix.size, matrix.inverse, matrix.scale, matrix.whole)
        if recorded != source:
            check.fail(f"{name}: manifest says {recorded}, the source's transform is {source}")
        reference[name] = load_matrix(src.checkpoint, matrix) / matrix.scale
        expected = runtime_matrix(src.checkpoint, matrix, DTYPES[record.tensor.dtype])
        if stored is not None and not _same_bits(stored, expected):
            check.fail(f"{name}: differs from the source's matrix normalized by {matrix.scale:g}")
    for name in sorted(set(source_matrices) - set(bundle.manifest.transforms)):
        checks.append(failed(name, f"{name}: source transform matrix missing from the bundle", "exactness"))
    return checks, reference


def _check_layer_transforms(bundle: Bundle, src: SourceModel, planned: OutputLayer, check: TensorCheck) -> None:
    have = [(t.location, t.matrix, t.block_size, t.partitions)
            for t in bundle.manifest.layers[planned.prefix].transforms]
    try:
        want = [(t.location, t.matrix.name, t.matrix.size, None if t.partitions is None else list(t.partitions))
                for t in layer_transforms(src.transforms, planned)]
    except RepackError as exc:
        check.fail(str(exc))
        return
    if have != want:
        check.fail(f"{planned.prefix}: online transforms {have} are not the source's {want}")


def numerics_sample(layers: dict[str, LayerRecord], gen: torch.Generator) -> set[str]:
    """The layers whose numerics a sampled verify runs: the first of each distinct [N, K] and one more at random.

    Exactness compares every layer's decode with the source bit for bit; numerics then shows that the runtime
    path computes the function for each layer geometry, which does not depend on the layer's values."""
    return _first_of_each({prefix: (record.n, record.k) for prefix, record in layers.items()}, gen)


def _first_of_each(shapes: dict[str, tuple[int, ...]], gen: torch.Generator) -> set[str]:
    """The first name of each distinct shape, and one more at random."""
    first: dict[tuple[int, ...], str] = {}
    for name, shape in shapes.items():
        first.setdefault(shape, name)
    names = list(shapes)
    return set(first.values()) | ({names[int(torch.randint(0, len(names), (), generator=gen))]} if names else set())


def resolve_source(bundle: Bundle, source: str | Path | None = None, revision: str | None = None) -> SourceModel | None:
    """The source to check against: ``source`` (a folder or Hub repo id), else the folder the manifest records
    if it still exists, else None."""
    if source is not None:
        return read_source(source, revision=revision)
    recorded = Path(bundle.manifest.source.path)
    return read_source(recorded) if (recorded / "config.json").exists() else None


def _given_source(bundle: Bundle, source: str | Path | SourceModel | None, no_source: bool) -> SourceModel | None:
    """The library's ``source`` / ``no_source`` arguments as the source to check against (see resolve_source)."""
    if no_source:
        return None
    return source if isinstance(source, SourceModel) else resolve_source(bundle, source)


def check_source_identity(bundle: Bundle, src: SourceModel, digests: dict[str, str]) -> None:
    """Refuse a source that is not the one the bundle was built from: ``digests`` (its files', by the manifest's
    ``file_digest``) must be the manifest's. Comparing with any other checkpoint would report every layer as wrong, or fail on shapes."""
    recorded = bundle.manifest.source.files
    if digests != recorded:
        differing = sorted(set(digests) ^ set(recorded)) or sorted(n for n in digests if digests[n] != recorded[n])
        raise RepackError(f"{src.checkpoint.root}: not the source the bundle was built from "
                          f"({differing[0]}: {bundle.manifest.file_digest} or file list differs from the manifest's)")


def _check_input_scale(src: SourceModel, planned: OutputLayer, decoded: InputScale, check: TensorCheck) -> InputScale:
    """A W4A4 layer's input scales are the ones vLLM keeps from the source's (the format's rule over the
    partitions); returns the source's, the numerics' reference."""
    expected = src.scheme.fuse_input_scales([src.read_input_scale(p.source) for p in planned.pieces])
    for what, a, b in (("input_global_scale", decoded.scale, expected.scale),
                       ("input_global_scale_inv", decoded.inverse, expected.inverse)):
        if not _same_bits(a, b):
            check.fail(f"{planned.prefix}: {what} differs from the source's", "exactness")
    return expected


def _check_layer(bundle: Bundle, loaded, prefix: str, src: SourceModel | None, numerics: bool,
                 gen: torch.Generator, matrices: dict[str, torch.Tensor | None], bad: set[str]) -> TensorCheck:
    """Integrity and layout of one layer's tensors, exactness against the source, numerics if asked."""
    record = bundle.manifest.layers[prefix]
    check = TensorCheck(prefix)
    runtime = _checked_runtime_layer(bundle, prefix, check)
    if runtime is None:
        return check
    decoded = bundle.target.from_runtime(runtime, record.n, record.k)
    reference = decoded
    if runtime.named is not None:  # another engine's tensors: each must follow from the layout's (targets/sglang.py)
        for name in restated_differences(bundle.target, runtime, record.n, record.k):
            check.fail(f"{prefix}.{name}: not what {bundle.target.engine} derives from the layer's codes, scales and "
                       "kept scalars", "exactness")
    held_scale = float(runtime.source_multiplier.reshape(()))
    if record.global_scale != held_scale:  # inspect shows the record's: it must be the tensor's
        check.fail(f"{prefix}: the manifest's global_scale {record.global_scale:.8g} is not the layer's "
                   f"weight_global_scale {held_scale:.8g}")
    input_scale = decoded.input_scale
    if input_scale is not None and not _same_bits(runtime.alpha, input_scale.scale * decoded.multiplier.reshape(())):
        check.fail(f"{prefix}: alpha is not input_global_scale * weight_global_scale", "exactness")
    if src is not None:
        planned = output_layer(prefix, record)
        layer = src.layers.get(prefix)
        problem = _source_slices_problem(src, planned)
        if problem is not None:
            check.fail(problem, "exactness")
            return check
        if layer is not None and planned.pieces == (whole_piece(layer),):
            # the whole source layer (no fusion, no rank), as the layout's kernel reads it (Marlin: flushed scales)
            reference = bundle.target.as_read(src.load_layer(layer, map_tensor))
            _check_exact(decoded, reference, prefix, check)
        else:
            reference = bundle.target.as_read(assemble(src, planned))  # with --rescale, rescaled
            _check_exact(decoded, reference, prefix, check)
            if any(p.scale_ratio != 1.0 for p in planned.pieces):
                _check_departure(src, planned, reference, record, check)
        _check_layer_transforms(bundle, src, planned, check)
        if input_scale is not None:
            input_scale = _check_input_scale(src, planned, input_scale, check)
    for t in record.transforms:  # whether or not numerics run on this layer
        if t.matrix in bad:
            check.fail(f"{prefix}: its {t.location} transform {t.matrix} failed its checks", "exactness")
    if any(matrices[t.matrix] is None for t in record.transforms):
        check.fail(f"{prefix}: an online-transform matrix failed its checks; numerics not run", "numerics")
    elif numerics:
        input_matrix = next((matrices[t.matrix] for t in record.transforms if t.location == "input"), None)
        output_parts = [(start, stop, matrices[t.matrix]) for t in record.transforms if t.location == "output"
                        for start, stop in record.output_rows(t)]
        # what the layer's activation quantizer multiplies by: QuTLASS's fixed scale where vLLM serves it so
        activation_scale = None if input_scale is None or bundle.target.layout_key != W4A4_LAYOUT else (
            bundle.vllm_qutlass(prefix).get("fused_global_scale", input_scale.inverse))  # Marlin: weight-only
        _check_numerics(loaded.layer(prefix, runtime=runtime), loaded.device, prefix, reference, check, gen,
                        loaded.backend == "reference", input_matrix, output_parts, activation_scale)
    return check


RESCALE_SLACK = 1e-6  # relative: the departure is recomputed as convert computed it (float64), up to summation order


def _check_departure(src: SourceModel, planned: OutputLayer, rescaled: NVFP4Weight, record: LayerRecord,
                     check: TensorCheck) -> None:
    """A --rescale layer departs from the unfused source by design (its block scales rounded to e4m3): that
    departure, on every rescaled layer (sampled numerics or not), is reported and may not exceed what convert
    recorded in the manifest (a manifest from before it was recorded: the numerics tolerance)."""
    _bound_departure(check, planned.prefix, rescale_error(src, planned, rescaled), record.rescale_error)


def _bound_departure(check: TensorCheck, name: str, departure: float, recorded: float | None) -> None:
    """Report a rescaled layer's departure from the source; fail it beyond what the manifest records (or, where it
    records nothing, the numerics tolerance)."""
    check.rescale_error = departure
    bound, what = ((recorded, "the manifest records") if recorded is not None else
                   (NUMERIC_TOLERANCE, "the numerics tolerance (the manifest records no rescale error)"))
    if not departure <= bound * (1 + RESCALE_SLACK):
        check.fail(f"{name}: rescaled weights depart from the source by {departure:.4g}, more than the {bound:.4g} "
                   f"{what}", "exactness")


def expert_plan(record: MoERecord, groups: dict[str, ExpertGroup]) -> tuple[ExpertPlan | None, str | None]:
    """The plan a FusedMoE record says convert followed, checked against the source's experts: ``(plan, None)``, or
    ``(None, why not)``."""
    group = groups.get(record.source)
    if group is None:
        return None, f"{record.module}: {record.source} is not a FusedMoE layer of the source"
    (first, last), (r0, r1) = record.experts, record.rows
    local = slice(first, last)
    members = {"gate": list(group.gate[local]), "up": list(group.up[local]), "down": list(group.down[local])}
    sizes = (record.num_experts, record.hidden, record.members)
    if sizes != (group.experts, group.hidden, members) or r1 > group.intermediate or r0 % BLOCK_SIZE:
        return None, (f"{record.module}: experts {record.experts} of {record.num_experts}, rows {record.rows}, hidden "
                      f"{record.hidden} or members do not match the source's {group.experts} experts of "
                      f"[{group.intermediate}, {group.hidden}]")
    plan = ExpertPlan(group, (r0, r1), (first, last), ep=record.expert_map is not None,
                      rescale=record.rescale_error is not None)
    if plan.ep and record.expert_map != plan.expert_map:
        return None, f"{record.module}: expert_map is not vLLM's for experts {record.experts} of {record.num_experts}"
    return plan, None


def _check_moe(bundle: Bundle, module: str, src: SourceModel | None, groups: dict[str, ExpertGroup],
               numerics: str, gen: torch.Generator) -> TensorCheck:
    """One FusedMoE layer: integrity and layout of its tensors (hashed a chunk at a time); the record's fields
    against the layout and the bundle's config; with the source, every expert exact (``expert_findings``: folded
    scalars and gate against up for every expert, codes, block scales and padding a chunk of experts at a time),
    then numerics (``expert_numerics``: computed as the FP4 x FP4 MoE GEMMs do against the float64 source) on the
    experts :func:`numerics_experts` picks for ``numerics`` (``all``, ``sample`` or ``odd``). Another engine's state
    (SGLang's): exactness tensor by tensor (``engine_expert_findings``), numerics through what its kernel reads
    (``engine_expert_numerics``)."""
    record = bundle.manifest.moe[module]
    layout = bundle.moe_layout
    check = TensorCheck(module)
    for problem in _moe_record_problems(bundle, record, layout):
        check.fail(problem)
    specs = moe_specs(layout, record.local_experts, record.hidden, record.intermediate, record.num_experts)
    entries = {name: _checked_streamed(bundle, f"{module}.{name}", check, (DTYPE_NAMES[spec.dtype], list(spec.shape)))
               for name, spec in specs.items()}
    if any(e is None for e in entries.values()) or src is None:
        return check
    plan, problem = expert_plan(record, groups)
    if plan is None:
        check.fail(problem, "exactness")
        return check
    if record.input_scales != input_scale_scope(src):
        check.fail(f"{module}: input_scales {record.input_scales!r} is not what vLLM loads for {src.format}", "exactness")
    w4a4 = not layout.WEIGHT_ONLY  # Marlin: weight-only experts
    if layout.NAMED:  # SGLang's state: exactness tensor by tensor, its kernel's scalars
        held = {name: bundle.read(f"{module}.{name}") for name in specs if name not in MADE_FROM}

        def weight_rows(name: str, first: int, last: int) -> torch.Tensor:
            return read_rows(entries[name], first, last)

        findings = engine_expert_findings(src, plan, held, weight_rows, layout)

        def measure(experts: list[int]) -> dict[str, float]:
            return engine_expert_numerics(src, plan, held, weight_rows, layout, experts, gen, tokens=16)
    else:
        for name in sorted(set(kept_scales(src, plan.group, plan.experts)) - set(bundle.manifest.passthrough)):
            check.fail(f"{name}: missing from the bundle (vLLM keeps it on {module} as loaded)", "exactness")
        scalars = {name: read_rows(entries[name], 0, record.local_experts) for name in scalar_names(layout)}

        def rows(name: str, first: int, last: int) -> torch.Tensor:  # the scalars in memory, the weights as needed
            return scalars[name][first:last] if name in scalars else read_rows(entries[name], first, last)

        findings = expert_findings(src, plan, rows, layout)

        def measure(experts: list[int]) -> dict[str, float]:
            return expert_numerics(src, plan, rows, layout, experts, gen, tokens=16, w4a4=w4a4)
    for problem in findings.problems:
        check.fail(problem, "exactness")
    if plan.rescale:  # --rescale: exactness and numerics were against the rescaled experts
        _bound_departure(check, module, expert_rescale_error(src, plan), record.rescale_error)
    experts = numerics_experts(record.local_experts, findings.odd, numerics, gen)
    check.numerics_experts = len(experts)
    if experts:
        errors = measure(experts)
        check.max_rel_error = max(errors.values())
        bound, kind = (EXPERT_W4A4_REL_ERROR, "FP4 x FP4") if w4a4 else (EXPERT_REL_ERROR, "weight-only")
        for name, error in errors.items():
            if not error <= bound:
                check.fail(f"{name}: relative error {error:.3g} of the {kind} expert exceeds {bound:g}", "numerics")
    return check


def numerics_experts(experts: int, odd: set[int], numerics: str, gen: torch.Generator) -> list[int]:
    """The local experts of one FusedMoE layer whose numerics run: ``all`` of them; a ``sample``: the first, one
    more drawn from ``gen`` and every ``odd`` one (scalars other than the source's, gate and up multipliers that
    differ); ``odd``: those alone (a layer outside the sample). Exactness covers every expert whatever this says."""
    if numerics == "all":
        return list(range(experts))
    drawn = {0, int(torch.randint(0, experts, (), generator=gen))} if numerics == "sample" else set()
    return sorted(drawn | odd)


def _moe_record_problems(bundle: Bundle, record: MoERecord, layout: ModuleType) -> list[str]:
    """The record's fields that describe what the layer holds (``inspect`` shows them), against the layout's and
    the bundle's config.json: a manifest edited after convert must not pass."""
    problems = []
    if (record.backend, record.kernels) != (layout.BACKEND, list(layout.KERNELS)):
        problems.append(f"{record.module}: backend {record.backend} / kernels {record.kernels} are not the "
                        f"{layout.LAYOUT_ID} layout's {layout.BACKEND} / {list(layout.KERNELS)}")
    top_k = bundle.config.get("num_experts_per_tok")
    top_k = top_k if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0 else None
    if record.top_k != top_k:
        problems.append(f"{record.module}: top_k {record.top_k} is not config.json's num_experts_per_tok {top_k}")
    return problems


def _check_passthrough(bundle: Bundle, name: str, src: SourceModel | None) -> TensorCheck:
    check = TensorCheck(name)
    tensor = _checked_tensor(bundle, name, check)
    if tensor is not None and src is not None:
        if name not in src.checkpoint.tensors:
            check.fail(f"{name}: not in the source", "exactness")
        elif not _same_bits(tensor, map_tensor(src.checkpoint.entry(name))):
            check.fail(f"{name}: differs from the source", "exactness")
    return check


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer ``index``'s activations: its own generator, so that a run's draws do not depend on which
    layer a thread checked first (``seed`` reproduces a run)."""
    return (seed * 1_000_003 + index) % 2**63


def manifest_seed(roots: list[Path]) -> int:
    """The activation seed when none is given: derived from the bundles' manifest bytes, so that the same bundle
    gets the same draws, the same sample and the same verdict on every run (a CI gate), and another bundle others."""
    digest = hashlib.sha256()
    for root in roots:
        digest.update((Path(root) / MANIFEST_NAME).read_bytes())
    return int.from_bytes(digest.digest()[:4], "little") % 2**31


def _collect(checking: deque[tuple[str, Future, int]], tick: Callable[[str], None]) -> TensorCheck:
    prefix, future, _ = checking.popleft()
    check = future.result()
    tick(prefix)
    return check


def verify_bundle(
    path: str | Path | Bundle,
    *,
    source: str | Path | SourceModel | None = None,
    no_source: bool = False,
    device: str = "cpu",
    seed: int | None = None,
    numerics: str = "auto",
    progress: Callable[[str], None] | None = None,
    source_hashes: dict[str, Future[str]] | None = None,
) -> VerifyReport:
    """Run all three checks; never raises for problems inside the bundle, reports them instead.

    ``source`` (default: the folder the manifest records, if it exists; none with ``no_source``) must be the
    checkpoint the bundle was built from, by its files' digests, or a RepackError is raised. ``numerics``: ``all`` layers, a
    ``sample`` (see :func:`numerics_sample`), or ``auto``: all on a GPU, a sample on the CPU, whose reference
    backend takes longer than every other check together. Files and the source are hashed on other threads
    meanwhile; ``source_hashes`` (the source files' digests by the manifest's ``file_digest``, being computed) lets
    several bundles of one source share one hashing of it."""
    bundle = path if isinstance(path, Bundle) else open_bundle(path)
    loaded = load_bundle(bundle, device)
    src = _given_source(bundle, source, no_source)
    if numerics not in ("auto", "all", "sample"):
        raise RepackError(f"numerics {numerics!r}: expected auto, all or sample")
    seed = seed if seed is not None else manifest_seed([bundle.root])
    gen = torch.Generator().manual_seed(seed)
    sampled = numerics == "sample" or (numerics == "auto" and loaded.backend == "reference")
    chosen = numerics_sample(bundle.manifest.layers, gen) if sampled else set(bundle.manifest.layers)
    moe = bundle.manifest.moe  # numerics need the source; every expert with all, else a sample (see _check_moe)
    moe_chosen = _first_of_each({m: (r.local_experts, r.hidden, r.intermediate) for m, r in moe.items()}, gen)

    def moe_numerics(module: str) -> str:
        return "all" if numerics == "all" else "sample" if module in moe_chosen else "odd"
    tick = progress or (lambda name: None)
    in_flight = LAYERS_IN_FLIGHT if loaded.device.type == "cpu" else 1  # one GPU stream: no gain from threads
    with ThreadPoolExecutor(max(2, os.cpu_count() or 1)) as pool, ThreadPoolExecutor(in_flight) as layers_pool, \
            one_torch_thread():
        algorithm = bundle.manifest.file_digest
        hashing = None if src is None else source_hashes if source_hashes is not None else hash_source(src, pool, algorithm)
        files = [pool.submit(_check_file, bundle.root, name, digest, algorithm)
                 for name, digest in sorted(bundle.manifest.files.items())]

        def check_identity(wait: bool) -> None:  # a wrong source stops verify as soon as its hash is known
            if hashing is not None and (wait or all(f.done() for f in hashing.values())):
                check_source_identity(bundle, src, {name: f.result() for name, f in hashing.items()})

        transform_checks, matrices = _check_transforms(bundle, src)
        bad = {c.name for c in transform_checks if c.status != "ok"}  # failed, or its file is missing
        checking: deque[tuple[str, Future, int]] = deque()  # (layer, its check, its weight bytes)
        layers, passthrough = [], []
        names = list(bundle.manifest.layers)
        # Layers are checked in parallel, those with numerics (the longest) first so that the rest fill the cores
        # around them rather than leaving one running alone at the end; reported in the manifest's order.
        for index in sorted(range(len(names)), key=lambda i: names[i] not in chosen):
            prefix = names[index]
            check_identity(wait=False)
            record = bundle.manifest.layers[prefix]
            weight_bytes = record.n * record.k // 2
            while checking and (len(checking) >= in_flight or
                                sum(b for _, _, b in checking) + weight_bytes > PARALLEL_WEIGHT_BYTES):
                layers.append(_collect(checking, tick))
            layer_gen = torch.Generator().manual_seed(layer_seed(seed, index))
            checking.append((prefix, layers_pool.submit(_check_layer, bundle, loaded, prefix, src, prefix in chosen,
                                                        layer_gen, matrices, bad), weight_bytes))
        while checking:
            layers.append(_collect(checking, tick))
        position = {prefix: index for index, prefix in enumerate(names)}
        layers.sort(key=lambda check: position[check.name])
        groups = expert_groups(src) if src is not None and bundle.manifest.moe else {}
        for module in bundle.manifest.moe:
            check_identity(wait=False)
            layers.append(_check_moe(bundle, module, src, groups, moe_numerics(module), gen))
            tick(module)
        for name in bundle.manifest.passthrough:
            passthrough.append(_check_passthrough(bundle, name, src))
            tick(name)
        check_identity(wait=True)
        report = VerifyReport(
            bundle=str(bundle.root), target=bundle.target.name, device=device, backend=loaded.backend,
            source=str(src.checkpoint.root) if src else None, seed=seed, tolerance=NUMERIC_TOLERANCE,
            files=[f.result() for f in files], layers=layers, passthrough=passthrough,
            numerics_layers=len(chosen) + sum(bool(c.numerics_experts) for c in layers if c.name in moe),
            experts=sum(r.local_experts for r in moe.values()),
            numerics_experts=sum(c.numerics_experts or 0 for c in layers if c.name in moe),
            transforms=transform_checks,
        )
    if src is not None and bundle.manifest.tp_size == 1:  # a rank holds part of the model: see verify_output
        covered = {p.source for record in bundle.manifest.layers.values() for p in record.partitions}
        covered |= {m for record in bundle.manifest.moe.values() for names in record.members.values() for m in names}
        for prefix in sorted(set(src.layers) - covered):
            report.layers.append(failed(prefix, f"{prefix}: source layer missing from the bundle", "exactness"))
        consumed = {src.input_scale_name(p) for p in covered} if bundle.target.scheme == "W4A4" else set()
        for name in sorted(set(src.passthrough) - set(bundle.manifest.passthrough) - consumed):  # W4A4: in layers
            report.passthrough.append(failed(name, f"{name}: source tensor missing from the bundle", "exactness"))
    return report


def hash_source(src: SourceModel, pool: ThreadPoolExecutor, algorithm: str) -> dict[str, Future[str]]:
    """The source's shard files' digests by ``algorithm``, each computed on ``pool``."""
    return {name: pool.submit(file_hexdigest, src.checkpoint.contained(name), algorithm)
            for name in src.checkpoint.shard_files}


def target_bundles(path: str | Path) -> list[Path]:
    """The ``<target>`` folders of a several-target ``convert`` output, in the targets' order (empty for
    anything else). Every folder named after a target counts, bundle or not: one that lost its manifest must fail
    verify, not drop out of it. A folder with a config.json is a model (or a bundle), whatever its subfolders."""
    root = Path(path)
    if (root / MANIFEST_NAME).is_file() or (root / "config.json").exists():
        return []
    return [root / t.name for t in TARGETS if (root / t.name).is_dir()]


def member_bundles(path: str | Path) -> list[Path]:
    """The bundles an output folder holds: a ``--tp`` output's ranks, a several-target output's targets, or the
    folder itself; an error when the output's record names bundles and none of them is there."""
    members = rank_bundles(path) or target_bundles(path)
    missing = [] if members else _missing_members(Path(path))
    if missing:
        raise RepackError(f"{path}: none of the bundles its convert recorded ({', '.join(missing)}) is there")
    return members or [Path(path)]


def rank_bundles(path: str | Path) -> list[Path]:
    """The ``rank-R`` bundles of a ``convert --tp`` output, in rank order (empty for anything else)."""
    root = Path(path)
    if (root / MANIFEST_NAME).is_file():
        return []
    ranks = sorted((p for p in root.glob("rank-*") if (p / MANIFEST_NAME).is_file()),
                   key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else -1)
    return ranks


def _prefixed(checks: list[TensorCheck], label: str) -> list[TensorCheck]:
    for check in checks:
        check.name = f"{label}/{check.name}"
        check.errors = [f"{label}: {e}" for e in check.errors]
    return checks


def _held_input_scale(ranks: list[Bundle], regions) -> torch.Tensor | None:
    """The ``input_global_scale_inv`` the W4A4 rank layers holding ``regions`` quantize with (each rank's own
    verify checks it against the source's), or None for weight-only bundles (W4A16, and Marlin's, which keep W4A4
    checkpoints' activation scales unused)."""
    r, prefix, _ = next(iter(regions))
    fp4 = ranks[r].target.layout_key == W4A4_LAYOUT
    return ranks[r].runtime_layer(prefix).input_global_scale_inv if fp4 else None


def _check_reassembled(ranks: list[Bundle], src: SourceModel, device: str, gen: torch.Generator,
                       numerics: str = "all") -> tuple[list[TensorCheck], int]:
    """Every source layer rebuilt from the ranks' outputs: column pieces placed at their rows, row-parallel
    partial sums added, each source element covered exactly once (replicated kv heads counted once); then, on the
    layers ``numerics`` picks as a bundle's own verify does (``all``; a ``sample``: each source layer shape once and
    one more; ``auto``: all on a GPU, a sample on the CPU), compared with the float64 GEMM of the source layer, whose
    --rescale regions hold the rescaled weights the ranks are meant to compute (each rank's departure from the
    source is bounded by its own check); W4A4: of the activations quantized with the input scale the ranks' layers
    hold, checked against the source's in each rank's own verify. Returns the checks and how many ran numerics."""
    loaded = [load_bundle(b, device) for b in ranks]
    pieces: dict[str, list[tuple[int, str, PartitionRecord]]] = {}
    for r, bundle in enumerate(ranks):
        for prefix, record in bundle.manifest.layers.items():
            for part in record.partitions:
                pieces.setdefault(part.source, []).append((r, prefix, part))
    groups = expert_groups(src) if any(b.manifest.moe for b in ranks) else {}
    checks = _check_moe_coverage(ranks, groups)
    experts = {m for group in groups.values() for m in group.members}  # each rank's MoE check covers their values
    dense = {name: (layer.n, layer.k) for name, layer in src.layers.items() if name not in experts}
    sampled = numerics == "sample" or (numerics == "auto" and torch.device(device).type == "cpu")
    chosen = _first_of_each(dense, gen) if sampled else set(dense)
    for name in dense:
        layer = src.layers[name]
        check = TensorCheck(f"reassembled/{name}")
        checks.append(check)
        regions = {(tuple(p.source_rows), tuple(p.source_cols)): (r, prefix, p) for r, prefix, p in pieces.get(name, [])}
        if not _tiles_once(list(regions), layer.n, layer.k):
            check.fail(f"{name}: the ranks do not cover the source layer exactly once", "exactness")
            continue
        if name not in chosen:
            continue
        weight = src.load_layer(layer)
        rescaled = {key: assemble(src, output_layer(key[1], ranks[key[0]].manifest.layers[key[1]]))
                    for r, prefix, part in regions.values() if part.scale_ratio != 1.0 for key in [(r, prefix)]}
        scale = _held_input_scale(ranks, regions.values())
        xs = [torch.randn(m, layer.k, generator=gen).to(torch.bfloat16) for m in BATCH_SIZES]
        x = torch.cat(xs)
        y = torch.zeros(len(x), layer.n, dtype=torch.float64)
        outputs: dict[tuple[int, str], torch.Tensor] = {}
        for (rows, cols), (r, prefix, part) in regions.items():
            key = (r, prefix)
            if key not in outputs:
                outputs[key] = _layer_outputs(loaded[r], prefix, [batch[:, cols[0]:cols[1]] for batch in xs])
            y[:, rows[0]:rows[1]] += outputs[key][:, part.rows[0]:part.rows[1]]
        inputs = x.to(torch.float64) if scale is None else dequantize_activations(
            *quantize_activations(x, scale), scale)  # W4A4: as the ranks' kernels quantize them
        ref = dequantized_products(inputs, weight)  # every batch through each block of weights at once
        for (rows, cols), (r, prefix, part) in regions.items():  # --rescale regions: what the ranks hold there
            if part.scale_ratio != 1.0:
                held = cut(rescaled[(r, prefix)], Piece(prefix, tuple(part.rows), (0, cols[1] - cols[0])))
                unscaled = cut(weight, Piece(name, rows, cols))
                part_inputs = inputs[:, cols[0]:cols[1]]
                ref[:, rows[0]:rows[1]] += (dequantized_products(part_inputs, held) -
                                            dequantized_products(part_inputs, unscaled))
        worst = max(_relative_error(a, b) for a, b in zip(y.split(BATCH_SIZES), ref.split(BATCH_SIZES)))
        _judge(check, worst, name)
    return checks, sum(c.max_rel_error is not None for c in checks)


def _layer_outputs(loaded, prefix: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """float64 outputs of the bundle's layer ``prefix`` for each batch of ``xs``, stacked: one call on the reference
    backend (no batch-size-dependent path: one decode of the layer serves every batch), one per batch elsewhere."""
    module = loaded.layer(prefix)
    if loaded.backend == "reference":
        return module(torch.cat(xs).to(loaded.device)).to("cpu", torch.float64)
    return torch.cat([module(x.to(loaded.device)).to("cpu", torch.float64) for x in xs])


def _tiles_once(regions: list[tuple[tuple[int, int], tuple[int, int]]], n: int, k: int) -> bool:
    """Whether the ``(rows, cols)`` rectangles cover ``[0, n) x [0, k)`` exactly once: inside it, pairwise
    disjoint, their areas summing to it (no ``[n, k]`` count held in memory: that was 235 MB for one MLP)."""
    inside = all(0 <= r0 < r1 <= n and 0 <= c0 < c1 <= k for (r0, r1), (c0, c1) in regions)
    disjoint = all(a[0][1] <= b[0][0] or b[0][1] <= a[0][0] or a[1][1] <= b[1][0] or b[1][1] <= a[1][0]
                   for i, a in enumerate(regions) for b in regions[i + 1:])
    return inside and disjoint and sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in regions) == n * k


def _check_moe_coverage(ranks: list[Bundle], groups: dict[str, ExpertGroup]) -> list[TensorCheck]:
    """Every expert's intermediate rows held by exactly one rank (TP: each rank a slice of every expert; --ep: whole
    experts on one rank each), per FusedMoE layer of the source."""
    checks = []
    for prefix, group in groups.items():
        check = TensorCheck(f"reassembled/{prefix}")
        checks.append(check)
        cover = torch.zeros(group.experts, group.intermediate, dtype=torch.int32)
        for bundle in ranks:
            for record in bundle.manifest.moe.values():
                if record.source == prefix and record.experts[1] <= group.experts:
                    cover[slice(*record.experts), slice(*record.rows)] += 1
        if not bool((cover == 1).all()):
            missing = int((cover == 0).any(dim=1).nonzero()[0]) if bool((cover == 0).any()) else None
            where = f" (expert {missing} is not all there)" if missing is not None else " (some held twice)"
            check.fail(f"{prefix}: the ranks do not hold each expert's rows exactly once{where}", "exactness")
    return checks


def verify_output(
    path: str | Path,
    *,
    source: str | Path | SourceModel | None = None,
    no_source: bool = False,
    device: str = "cpu",
    seed: int | None = None,
    numerics: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Verify a bundle; or every bundle of a several-target output; or every rank of a ``--tp`` output and the
    layers the ranks reassemble into. The bundles of one output share one hashing of the source."""
    ranks, members = rank_bundles(path), member_bundles(path)
    if members == [Path(path)]:
        return verify_bundle(path, source=source, no_source=no_source, device=device, seed=seed, numerics=numerics,
                             progress=progress)
    seed = seed if seed is not None else manifest_seed(members)
    bundles = [open_bundle(m) for m in members]
    _refuse_other_gpus(members, bundles, device)
    src = _given_source(bundles[0], source, no_source)
    with ThreadPoolExecutor(max(2, os.cpu_count() or 1)) as pool:
        algorithms = dict.fromkeys(b.manifest.file_digest for b in bundles)  # one, unless formats were mixed
        hashes = {a: hash_source(src, pool, a) for a in algorithms} if src is not None else {}
        reports = [verify_bundle(b, source=src, no_source=src is None, device=device, seed=seed + i, numerics=numerics,
                                 progress=progress, source_hashes=hashes.get(b.manifest.file_digest))
                   for i, b in enumerate(bundles)]
    merged = VerifyReport(
        bundle=str(path), target=", ".join(dict.fromkeys(r.target for r in reports)), device=device,
        backend=", ".join(dict.fromkeys(r.backend for r in reports)), source=reports[0].source,
        seed=seed, tolerance=NUMERIC_TOLERANCE, files=[], layers=[], passthrough=[],
        numerics_layers=sum(r.numerics_layers for r in reports), experts=sum(r.experts for r in reports),
        numerics_experts=sum(r.numerics_experts for r in reports),
    )
    for member, report in zip(members, reports):
        merged.files += _prefixed(report.files, member.name)
        merged.layers += _prefixed(report.layers, member.name)
        merged.passthrough += _prefixed(report.passthrough, member.name)
        merged.transforms += _prefixed(report.transforms, member.name)
    merged.files += _check_folder_names(members, bundles, ranked=bool(ranks))
    missing = _missing_members(Path(path))
    merged.files += [failed(name, f"{name}: missing; the convert that wrote {path} recorded it in {OUTPUT_RECORD}")
                     for name in missing]
    if not ranks or missing:  # a missing rank: the ranks cannot be reassembled
        return merged
    sizes = {(b.manifest.tp_size, b.manifest.tp_rank) for b in bundles}
    tp = bundles[0].manifest.tp_size
    if sizes != {(tp, r) for r in range(tp)}:
        merged.files.append(failed(str(path), f"{path}: rank folders are not ranks 0..{tp - 1} of one --tp {tp}"))
        return merged
    merged.files += _check_served_root(Path(path), bundles[0])
    if src is not None:
        reassembled, numerics_run = _check_reassembled(bundles, src, device, torch.Generator().manual_seed(seed),
                                                       numerics)
        merged.layers += reassembled
        merged.numerics_layers += numerics_run
    return merged


def _missing_members(root: Path) -> list[str]:
    """The bundles the output's record names (``OUTPUT_RECORD``) that are not there; none for an output without
    the record (written before it existed: then only what is there is verified)."""
    return [m for m in read_output_record(root) or [] if not (root / m / MANIFEST_NAME).is_file()]


def _refuse_other_gpus(members: list[Path], bundles: list[Bundle], device: str) -> None:
    """On a GPU, every bundle of a several-target output must be for that GPU: say which are not, before any work
    (one GPU runs one family's kernels; the CPU's reference backend runs them all)."""
    on = torch.device(device)
    others = [m for m, b in zip(members, bundles) if not backends.runs_on(b.target, on)]
    if others:
        have = "sm{}{}".format(*backends.device_capability(on))
        raise RepackError(f"{', '.join(map(str, others))}: not for this {have} GPU; verify each bundle for {have} "
                          f"with --device cuda and the others on the CPU")


def _check_folder_names(members: list[Path], bundles: list[Bundle], ranked: bool) -> list[TensorCheck]:
    """Each folder holds the bundle its name promises: ``rank-R`` rank R's, ``<target>`` that target's. What a
    deployment picks by folder name (vLLM rank R opens ``rank-R``) would otherwise load another rank's weights, or
    another GPU family's layout."""
    checks = []
    for member, bundle in zip(members, bundles):
        expected = rank_folder(bundle.manifest.tp_rank) if ranked else bundle.target.name
        if member.name != expected:
            checks.append(failed(member.name, f"{member.name}: holds the bundle of {expected} (by its manifest); "
                                              f"move it to {expected} or re-convert"))
    return checks


def _check_served_root(root: Path, rank0: Bundle) -> list[TensorCheck]:
    """The files at the top of a ``--tp`` output (what ``vllm serve OUT`` reads: config.json, tokenizer) are
    rank 0's, byte for byte, as its manifest hashes them."""
    checks = []
    for path in sorted(p for p in root.iterdir() if p.is_file() and p.name != OUTPUT_RECORD):
        recorded = rank0.manifest.files.get(path.name)
        if recorded is not None:
            checks.append(_check_file(root, path.name, recorded, rank0.manifest.file_digest))
        else:
            checks.append(failed(path.name, f"{path.name}: not a file of rank 0's bundle (a --tp output's top holds "
                                            "rank 0's config and side files only)"))
    if not (root / "config.json").is_file():
        missing = f"{root}: no config.json at the top, so 'vllm serve {root}' cannot start; re-convert it"
        checks.append(failed("config.json", missing))
    return checks
