"""verify: prove a bundle computes the same function as its source, in three independent steps.

1. Integrity: every file and tensor the manifest lists is present, with its dtype, shape and sha256, and
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .bundle.layers import OutputLayer, Piece, assemble, source_function
from .bundle.manifest import MANIFEST_NAME, LayerRecord, PartitionRecord
from .bundle.reader import Bundle, open_bundle
from .errors import RepackError
from .formats import SourceModel, read_source
from .formats.checkpoint import contained_file
from .formats.safetensors_io import DTYPE_NAMES, DTYPES, file_sha256, read_tensor, tensor_bytes
from .formats.transforms import load_matrix, runtime_matrix
from .nvfp4 import BLOCK_SIZE, NVFP4Weight, dequantize
from .runtime import load_bundle
from .targets import RuntimeLayer

NUMERIC_TOLERANCE = 1e-2
BATCH_SIZES = (1, 7, 32)


@dataclass
class TensorCheck:
    name: str
    status: str = "ok"  # ok | fail | skipped
    errors: list[str] = field(default_factory=list)
    max_rel_error: float | None = None

    def fail(self, message: str) -> None:
        self.status = "fail"
        self.errors.append(message)


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

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[TensorCheck]:
        return [c for c in self.files + self.layers + self.passthrough + self.transforms if c.status == "fail"]

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _check_files(bundle: Bundle) -> list[TensorCheck]:
    checks = []
    for name, sha in sorted(bundle.manifest.files.items()):
        check = TensorCheck(name)
        try:
            if file_sha256(contained_file(bundle.root, name)) != sha:
                check.fail(f"{name}: sha256 differs from the manifest (file modified or truncated)")
        except RepackError as exc:
            check.fail(str(exc))
        checks.append(check)
    return checks


def _checked_tensor(
    bundle: Bundle, name: str, check: TensorCheck, expected: tuple[str, list[int]] | None = None
) -> torch.Tensor | None:
    """Header dtype/shape against the manifest (and the layout, if ``expected``), then the data, read once and
    hashed in memory; the tensor when everything matches, else None with the failure recorded."""
    record = bundle.manifest.all_tensors[name]
    try:
        entry = bundle.entry(name)
    except RepackError as exc:
        check.fail(str(exc))
        return None
    if (entry.dtype_name, list(entry.shape)) != (record.dtype, record.shape):
        check.fail(f"{name}: file has {entry.dtype_name} {list(entry.shape)}, manifest says {record.dtype} {record.shape}")
        return None
    if expected is not None and (record.dtype, record.shape) != expected:
        check.fail(f"{name}: {record.dtype} {record.shape} is not the {bundle.target.name} layout {expected}")
        return None
    tensor = read_tensor(entry)
    if hashlib.sha256(tensor_bytes(tensor)).hexdigest() != record.sha256:
        check.fail(f"{name}: sha256 differs from the manifest")
        return None
    return tensor


def _checked_runtime_layer(bundle: Bundle, prefix: str, check: TensorCheck) -> RuntimeLayer | None:
    """The layer's runtime tensors, each checked against the manifest and the target layout (open_bundle has
    already made sure the manifest lists exactly the layout's parts)."""
    record = bundle.manifest.layers[prefix]
    tensors = {
        part: _checked_tensor(bundle, f"{prefix}.{part}", check, (DTYPE_NAMES[spec.dtype], list(spec.shape)))
        for part, spec in bundle.target.runtime_specs(record.n, record.k).items()
    }
    if check.status == "fail":
        return None
    return RuntimeLayer(weights_padding_cols=record.weights_padding_cols, **tensors)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                              b.contiguous().reshape(-1).view(torch.uint8))


def _check_exact(decoded: NVFP4Weight, original: NVFP4Weight, prefix: str, check: TensorCheck) -> None:
    for what, a, b in (("codes", decoded.codes, original.codes), ("block scales", decoded.block_scales,
                       original.block_scales), ("global scale", decoded.multiplier, original.multiplier)):
        if not _same_bits(a, b):
            check.fail(f"{prefix}: {what} differ from the source")


def _block64(value: torch.Tensor, matrix: torch.Tensor | None) -> torch.Tensor:
    return value if matrix is None else (value.unflatten(-1, (-1, matrix.shape[0])) @ matrix).flatten(-2)


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    error = float((y - ref).norm() / ref.norm().clamp(min=1e-30))
    return error if error == error else float("inf")


def _judge(check: TensorCheck, worst: float, what: str) -> None:
    check.max_rel_error = worst
    if not worst <= NUMERIC_TOLERANCE:
        check.fail(f"{what}: relative error {worst:.3g} exceeds {NUMERIC_TOLERANCE:g}")


def _check_numerics(layer: torch.nn.Module, device: torch.device, prefix: str, weight: torch.Tensor,
                    check: TensorCheck, gen: torch.Generator, transforms: dict[str, torch.Tensor]) -> None:
    """``layer`` on random bf16 activations against a float64 GEMM with ``weight`` (float64 ``[n, k]``), with the
    layer's online ``transforms`` (location -> float64 normalized matrix) applied around it."""
    worst = 0.0
    for m in BATCH_SIZES:
        x = torch.randn(m, layer.k, generator=gen).to(torch.bfloat16)
        y = layer(x.to(device)).to("cpu", torch.float64)
        ref = _block64(_block64(x.to(torch.float64), transforms.get("input")) @ weight.t(), transforms.get("output"))
        worst = max(worst, _relative_error(y, ref))
    _judge(check, worst, prefix)


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
        recorded = (record.scheme, record.type, record.block_size, record.inverse, record.scale)
        if recorded != (matrix.scheme, matrix.type, matrix.size, matrix.inverse, matrix.scale):
            check.fail(f"{name}: manifest says {recorded}, the source's transform is "
                       f"{(matrix.scheme, matrix.type, matrix.size, matrix.inverse, matrix.scale)}")
        reference[name] = load_matrix(src.checkpoint, matrix) / matrix.scale
        expected = runtime_matrix(src.checkpoint, matrix, DTYPES[record.tensor.dtype])
        if stored is not None and not _same_bits(stored, expected):
            check.fail(f"{name}: differs from the source's matrix normalized by {matrix.scale:g}")
    for name in sorted(set(source_matrices) - set(bundle.manifest.transforms)):
        checks.append(TensorCheck(name, "fail", [f"{name}: source transform matrix missing from the bundle"]))
    return checks, reference


def _check_layer_transforms(bundle: Bundle, src: SourceModel, prefix: str, check: TensorCheck) -> None:
    have = [(t.location, t.matrix, t.block_size) for t in bundle.manifest.layers[prefix].transforms]
    want = [(t.location, t.matrix.name, t.matrix.size) for t in src.transforms.layers.get(prefix, ())]
    if have != want:
        check.fail(f"{prefix}: online transforms {have} are not the source's {want}")


def _source_for(bundle: Bundle, source: str | Path | None) -> SourceModel | None:
    if source is not None:
        return read_source(source)
    recorded = Path(bundle.manifest.source.path)
    return read_source(recorded) if (recorded / "config.json").exists() else None


def verify_bundle(
    path: str | Path | Bundle,
    *,
    source: str | Path | None = None,
    device: str = "cpu",
    seed: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Run all three checks; never raises for problems inside the bundle, reports them instead."""
    bundle = path if isinstance(path, Bundle) else open_bundle(path)
    loaded = load_bundle(bundle, device)
    src = _source_for(bundle, source)
    seed = seed if seed is not None else int(torch.randint(0, 2**31, ()))
    gen = torch.Generator().manual_seed(seed)
    report = VerifyReport(
        bundle=str(bundle.root), target=bundle.target.name, device=device, backend=loaded.backend,
        source=str(src.checkpoint.root) if src else None, seed=seed, tolerance=NUMERIC_TOLERANCE,
        files=_check_files(bundle), layers=[], passthrough=[],
    )
    report.transforms, matrices = _check_transforms(bundle, src)
    tick = progress or (lambda name: None)
    for prefix, record in bundle.manifest.layers.items():
        check = TensorCheck(prefix)
        report.layers.append(check)
        runtime = _checked_runtime_layer(bundle, prefix, check)
        if runtime is None:
            tick(prefix)
            continue
        decoded = bundle.target.from_runtime(runtime, record.n, record.k)
        function = dequantize(decoded, torch.float64)
        if src is not None:
            planned = output_layer(prefix, record)
            problem = _source_slices_problem(src, planned)
            if problem is not None:
                check.fail(problem)
            else:
                _check_exact(decoded, assemble(src, planned), prefix, check)
                _check_layer_transforms(bundle, src, prefix, check)
                function = source_function(src, planned)
        transforms = {t.location: matrices[t.matrix] for t in record.transforms}
        if any(m is None for m in transforms.values()):
            check.fail(f"{prefix}: an online-transform matrix failed its checks; numerics not run")
        else:
            _check_numerics(loaded.layer(prefix, runtime=runtime), loaded.device, prefix, function, check, gen,
                            transforms)
        tick(prefix)
    for name in bundle.manifest.passthrough:
        check = TensorCheck(name)
        report.passthrough.append(check)
        tensor = _checked_tensor(bundle, name, check)
        if tensor is not None and src is not None:
            if name not in src.checkpoint.tensors:
                check.fail(f"{name}: not in the source")
            elif not _same_bits(tensor, src.checkpoint.read(name)):
                check.fail(f"{name}: differs from the source")
        tick(name)
    if src is not None and bundle.manifest.tp_size == 1:
        covered = {p.source for record in bundle.manifest.layers.values() for p in record.partitions}
        for prefix in sorted(set(src.layers) - covered):
            report.layers.append(TensorCheck(prefix, "fail", [f"{prefix}: source layer missing from the bundle"]))
        for name in sorted(set(src.passthrough) - set(bundle.manifest.passthrough)):
            report.passthrough.append(TensorCheck(name, "fail", [f"{name}: source tensor missing from the bundle"]))
    return report


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


def _check_reassembled(ranks: list[Bundle], src: SourceModel, device: str, gen: torch.Generator) -> list[TensorCheck]:
    """Every source layer rebuilt from the ranks' outputs: column pieces placed at their rows, row-parallel
    partial sums added, each source element covered exactly once (replicated kv heads counted once); then
    compared with the float64 GEMM of the source layer."""
    loaded = [load_bundle(b, device) for b in ranks]
    pieces: dict[str, list[tuple[int, str, PartitionRecord]]] = {}
    for r, bundle in enumerate(ranks):
        for prefix, record in bundle.manifest.layers.items():
            for part in record.partitions:
                pieces.setdefault(part.source, []).append((r, prefix, part))
    checks = []
    for name, layer in src.layers.items():
        check = TensorCheck(f"reassembled/{name}")
        checks.append(check)
        regions = {(tuple(p.source_rows), tuple(p.source_cols)): (r, prefix, p) for r, prefix, p in pieces.get(name, [])}
        cover = torch.zeros(layer.n, layer.k, dtype=torch.int32)
        for (rows, cols) in regions:
            cover[rows[0]:rows[1], cols[0]:cols[1]] += 1
        if not bool((cover == 1).all()):
            check.fail(f"{name}: the ranks do not cover the source layer exactly once")
            continue
        weight = dequantize(src.load_layer(layer), torch.float64)
        worst = 0.0
        for m in BATCH_SIZES:
            x = torch.randn(m, layer.k, generator=gen).to(torch.bfloat16)
            y = torch.zeros(m, layer.n, dtype=torch.float64)
            outputs: dict[tuple[int, str], torch.Tensor] = {}
            for (rows, cols), (r, prefix, part) in regions.items():
                key = (r, prefix)
                if key not in outputs:
                    module = loaded[r].layer(prefix)
                    outputs[key] = module(x[:, cols[0]:cols[1]].to(loaded[r].device)).to("cpu", torch.float64)
                y[:, rows[0]:rows[1]] += outputs[key][:, part.rows[0]:part.rows[1]]
            worst = max(worst, _relative_error(y, x.to(torch.float64) @ weight.t()))
        _judge(check, worst, name)
    return checks


def verify_output(
    path: str | Path,
    *,
    source: str | Path | None = None,
    device: str = "cpu",
    seed: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Verify a bundle, or every rank of a ``--tp`` output and the layers the ranks reassemble into."""
    ranks = rank_bundles(path)
    if not ranks:
        return verify_bundle(path, source=source, device=device, seed=seed, progress=progress)
    seed = seed if seed is not None else int(torch.randint(0, 2**31, ()))
    bundles = [open_bundle(r) for r in ranks]
    sizes = {(b.manifest.tp_size, b.manifest.tp_rank) for b in bundles}
    reports = [verify_bundle(b, source=source, device=device, seed=seed + i, progress=progress)
               for i, b in enumerate(bundles)]
    first = reports[0]
    merged = VerifyReport(
        bundle=str(path), target=first.target, device=device, backend=first.backend, source=first.source,
        seed=seed, tolerance=NUMERIC_TOLERANCE, files=[], layers=[], passthrough=[],
    )
    for rank, report in zip(ranks, reports):
        merged.files += _prefixed(report.files, rank.name)
        merged.layers += _prefixed(report.layers, rank.name)
        merged.passthrough += _prefixed(report.passthrough, rank.name)
    tp = bundles[0].manifest.tp_size
    if sizes != {(tp, r) for r in range(tp)}:
        merged.files.append(TensorCheck(str(path), "fail", [f"{path}: rank folders are not ranks 0..{tp - 1} of one --tp {tp}"]))
        return merged
    src = _source_for(bundles[0], source)
    if src is not None:
        merged.layers += _check_reassembled(bundles, src, device, torch.Generator().manual_seed(seed))
    return merged
