"""manifest.json: what a bundle is, where it came from, the digest of every file and of every tensor.

Format 4 hashes files and tensors with BLAKE3, named by ``file_digest`` and ``tensor_digest``; format 3 hashed
files with sha256 and tensors with xxh3-128, formats 1 and 2 both with sha256. Every format is still read and
verified, each with its own algorithms.

Parsing is strict (bundles travel between machines and CI pipelines): wrong types, unknown versions or
missing fields are one-line errors, never KeyErrors.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from .. import BUNDLE_FORMAT_VERSION
from ..errors import RepackError
from ..formats.checkpoint import load_json
from ..formats.hashing import DIGESTS, FILE_DIGEST, TENSOR_DIGEST
from ..formats.safetensors_io import DTYPES, short_repr

MANIFEST_NAME = "manifest.json"
BUNDLE_KIND = "nvfp4-repack-bundle"
FILE_DIGESTS = ("blake3", "sha256")  # of files: cryptographic only (a source's identity rests on them)
# An output of several bundles (OUT/<target>, or OUT/rank-R of --tp) names them in this file at its top: what a
# convert wrote, so that verify fails on one that went missing.
OUTPUT_RECORD = "nvfp4-repack-output.json"
OUTPUT_KIND = "nvfp4-repack-output"
# A bundle written before format 6 lists no engine versions: vLLM 0.33 is the one its state was checked against
LEGACY_ENGINES = {"vllm": ["0.33"]}


def legacy_engines() -> dict[str, list[str]]:
    return {engine: list(versions) for engine, versions in LEGACY_ENGINES.items()}
# Per-tensor digests name the damaged tensor; every byte is also covered by the files' digests. Neither stops
# someone who rewrites the manifest too: only verify's comparison with the source does.


@dataclass(frozen=True)
class TensorRecord:
    file: str
    dtype: str
    shape: list[int]
    digest: str  # hex, of the manifest's tensor_digest algorithm


@dataclass(frozen=True)
class LayerTransformRecord:
    """An online transform of one layer: ``location`` input (before the GEMM) or output (after), which matrix;
    ``partitions``: the indices of the (fused) layer's partitions whose rows it rotates, each on its own, where it
    does not apply to every partition alike (an output transform on some partitions of a fused module, or whole-N
    ones, one matrix per partition size); ``None``: the whole layer."""

    location: str
    matrix: str
    block_size: int
    partitions: list[int] | None = None


@dataclass(frozen=True)
class TransformRecord:
    """One stored online-transform matrix ``T`` (normalization fused in) and what it was made from."""

    scheme: str
    type: str
    block_size: int
    source_tensors: list[str]  # the source's matrix (and permutation) tensors
    inverse: bool  # applied transposed
    scale: float  # the source matrix was divided by this
    tensor: TensorRecord
    whole: bool = False  # the scheme has no head_dim: its block is the whole K (or N) of the layers it rotates


@dataclass(frozen=True)
class PartitionRecord:
    """Rows ``[rows)`` of the layer came from rows ``[source_rows)`` x columns ``[source_cols)`` of source layer
    ``source``, block scales multiplied by ``scale_ratio`` (1.0 unless converted with ``--rescale``)."""

    source: str
    rows: list[int]
    source_rows: list[int]
    source_cols: list[int]
    scale_ratio: float


@dataclass(frozen=True)
class LayerRecord:
    n: int
    k: int
    padded_shape: list[int]
    weights_padding_cols: int
    global_scale: float
    tensors: dict[str, TensorRecord]
    partitions: list[PartitionRecord]
    transforms: list[LayerTransformRecord] = field(default_factory=list)
    # relative L2 error --rescale added to the weights against the unfused source (None: nothing rescaled, or a
    # bundle written before it was recorded); verify fails a layer whose actual departure exceeds it
    rescale_error: float | None = None

    def output_rows(self, transform: LayerTransformRecord) -> list[tuple[int, int]]:
        """The output rows ``[start, stop)`` an output transform rotates, each range as a block-diagonal of its own:
        the whole layer, or its ``partitions``' rows."""
        if transform.partitions is None:
            return [(0, self.n)]
        return [(self.partitions[i].rows[0], self.partitions[i].rows[1]) for i in transform.partitions]


@dataclass(frozen=True)
class MoERecord:
    """One FusedMoE layer of a bundle: the tensors vLLM's module ``module`` holds after its own load, in MoE layout
    ``layout_id`` (read by vLLM's ``backend`` with one of its experts classes ``kernels``), for the experts ``[experts)`` of ``num_experts`` and rows
    ``[rows)`` of each one's intermediate size (vLLM's TP split; all of it under expert parallelism).

    Attributes:
        module (`str`): vLLM's module, ``model.layers.0.mlp.experts.routed_experts``; its tensors are
            ``<module>.<name>`` with vLLM's parameter names (``w13_weight``, ...).
        source (`str`): the source's experts, ``<source>.<e>.{gate,up,down}_proj``.
        expert_map (`list[int]`, *optional*): under expert parallelism (``--ep``) vLLM's ``_expert_map``, global
            expert -> local index, -1 for the other ranks' experts; ``None`` without it.
        hidden (`int`), intermediate (`int`): the experts' sizes in this bundle (intermediate: this rank's), unpadded.
        top_k (`int`, *optional*): experts per token (config.json's ``num_experts_per_tok``), if the config says.
        members (`dict[str, list[str]]`): ``gate``, ``up``, ``down``: the held experts' source layers, in order.
        input_scales (`str`): whose activation scales the one input scale the layer holds is the largest of:
            ``all`` experts' (ModelOpt) or the rank's ``local`` ones (compressed-tensors; the same without --ep);
            ``none``: weight-only experts (a W4A16 checkpoint), which have no input scales.
    """

    module: str
    source: str
    layout_id: str
    backend: str
    kernels: list[str]  # vLLM's experts classes that hold this layout (auto's choice depends on the routing)
    num_experts: int
    local_experts: int  # experts[1] - experts[0]: the [E] of every tensor
    experts: list[int]
    rows: list[int]
    hidden: int
    intermediate: int
    members: dict[str, list[str]]
    input_scales: str
    tensors: dict[str, TensorRecord]
    expert_map: list[int] | None = None
    top_k: int | None = None
    # --rescale: the largest relative L2 error it added to one of the held experts' gate/up weights (their gate and
    # up multipliers differed; None: nothing rescaled)
    rescale_error: float | None = None


@dataclass(frozen=True)
class SourceRecord:
    """Where the bundle came from: the folder read, its shard files' digests (the manifest's ``file_digest``), and for
    a Hub model its repo id, resolved commit and the Hub's own sha256 of each shard file (its LFS metadata, as
    the download recorded it: provenance, not recomputed)."""

    path: str
    format: str
    quant_algo: str
    files: dict[str, str]
    repo_id: str | None = None
    revision: str | None = None
    hub_sha256: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    bundle_format_version: int
    tool_version: str
    target: str
    layout_id: str
    flashinfer_versions: list[str]
    source: SourceRecord
    layers: dict[str, LayerRecord]
    passthrough: dict[str, TensorRecord]
    files: dict[str, str] = field(default_factory=dict)
    transforms: dict[str, TransformRecord] = field(default_factory=dict)
    tp_size: int = 1
    tp_rank: int = 0
    fusion: dict[str, list[str]] = field(default_factory=dict)
    file_digest: str = FILE_DIGEST  # of ``files`` and ``source.files``
    tensor_digest: str = TENSOR_DIGEST
    kind: str = BUNDLE_KIND
    scheme: str = "W4A16"  # W4A4: the kernels quantize activations with each layer's input_global_scale_inv
    kernels: list[str] = field(default_factory=list)  # the vLLM 0.33 kernel classes that read this layout, auto's first
    moe: dict[str, MoERecord] = field(default_factory=dict)  # vLLM's FusedMoE module -> its record (format 5)
    # engine -> the versions whose state after loading the bundle is (format 6; older bundles: vLLM 0.33, the one
    # version checked when they were written); rows in repack/targets/engines.py
    engines: dict[str, list[str]] = field(default_factory=legacy_engines)

    @cached_property
    def all_tensors(self) -> dict[str, TensorRecord]:
        """Every tensor of the bundle by its name in the safetensors files (built once: looked up per tensor)."""
        out = {f"{prefix}.{part}": rec for prefix, layer in self.layers.items() for part, rec in layer.tensors.items()}
        out.update({f"{module}.{name}": rec for module, moe in self.moe.items() for name, rec in moe.tensors.items()})
        out.update(self.passthrough)
        out.update({name: rec.tensor for name, rec in self.transforms.items()})
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def _fail(what: str) -> RepackError:
    return RepackError(f"{MANIFEST_NAME}: {what}")


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise _fail(f"missing '{key}' in {where}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(f"'{key}' in {where} has the wrong type ({type(value).__name__})")
    return value


def _int(obj: Any, key: str, where: str) -> int:
    value = _get(obj, key, int, where)
    if value < 0:
        raise _fail(f"'{key}' in {where} is negative")
    return value


def _optional_str(obj: dict, key: str, where: str) -> str | None:
    return None if obj.get(key) is None else _get(obj, key, str, where)


def _plain_file_name(name: str) -> bool:
    """A file directly inside the bundle folder: no separators, no parent references, no NUL."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\x00")


def _hex(value: str, algorithm: str, where: str) -> str:
    digits = DIGESTS[algorithm][1]
    if not re.fullmatch(f"[0-9a-f]{{{digits}}}", value):
        raise _fail(f"{where} must be {digits} lowercase hex digits, got {short_repr(value)}")
    return value


def _str_map(obj: Any, where: str) -> dict[str, str]:
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in obj.items()):
        raise _fail(f"{where} must map names to strings")
    return dict(obj)


def _file_hashes(obj: Any, where: str, algorithm: str) -> dict[str, str]:
    """``{file name: digest}`` where every name is a plain file name (inside the bundle, or the source's folder)."""
    files = _str_map(obj, where)
    for name, digest in files.items():
        if not _plain_file_name(name):
            raise _fail(f"{where}: {short_repr(name)} is not a plain file name")
        _hex(digest, algorithm, f"{algorithm} of {where}[{short_repr(name)}]")
    return files


def _tensor(obj: Any, where: str, algorithm: str) -> TensorRecord:
    shape = _get(obj, "shape", list, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _fail(f"shape of {where} must be non-negative integers")
    file = _get(obj, "file", str, where)
    if not _plain_file_name(file):
        raise _fail(f"file of {where} must be a plain file name in the bundle, got {short_repr(file)}")
    dtype = _get(obj, "dtype", str, where)
    if dtype not in DTYPES:
        raise _fail(f"dtype of {where} is not a safetensors dtype: {short_repr(dtype)}")
    key = "sha256" if algorithm == "sha256" else "digest"
    digest = _hex(_get(obj, key, str, where), algorithm, f"{key} of {where}")
    return TensorRecord(file=file, dtype=dtype, shape=list(shape), digest=digest)


def _pair(obj: Any, key: str, where: str) -> list[int]:
    value = _get(obj, key, list, where)
    if len(value) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise _fail(f"{key} of {where} must be two non-negative integers")
    return list(value)


def _finite(obj: Any, key: str, where: str) -> float:
    value = _get(obj, key, (int, float), where)
    try:
        value = float(value)  # a huge JSON integer overflows here rather than in math.isfinite
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise _fail(f"{key} of {where} must be a finite number")
    return value


def _partition(obj: Any, where: str) -> PartitionRecord:
    rows, source_rows, source_cols = (_pair(obj, key, where) for key in ("rows", "source_rows", "source_cols"))
    if rows[1] - rows[0] != source_rows[1] - source_rows[0] or rows[0] > rows[1] or source_cols[0] > source_cols[1]:
        raise _fail(f"{where}: rows {rows} do not match source_rows {source_rows}")
    return PartitionRecord(_get(obj, "source", str, where), rows, source_rows, source_cols,
                           _finite(obj, "scale_ratio", where))


def _layer(obj: Any, where: str, algorithm: str) -> LayerRecord:
    padded = _pair(obj, "padded_shape", where)
    scale = _finite(obj, "global_scale", where)
    tensors = _get(obj, "tensors", dict, where)
    n, k = _int(obj, "n", where), _int(obj, "k", where)
    if isinstance(obj, dict) and "partitions" not in obj and algorithm == "sha256":
        # formats 1 and 2 written before fusion / tensor parallelism: the layer is all of its source layer
        partitions = [PartitionRecord(where, [0, n], [0, n], [0, k], 1.0)]
    else:
        partitions = [_partition(p, f"{where} partition {i}")
                      for i, p in enumerate(_get(obj, "partitions", list, where))]
    return LayerRecord(
        n=n,
        k=k,
        padded_shape=list(padded),
        weights_padding_cols=_int(obj, "weights_padding_cols", where),
        global_scale=scale,
        tensors={part: _tensor(rec, f"{where}.{part}", algorithm) for part, rec in tensors.items()},
        partitions=partitions,
        transforms=[_layer_transform(t, f"{where}.transforms") for t in _get(obj, "transforms", list, where)],
        rescale_error=None if obj.get("rescale_error") is None else _finite(obj, "rescale_error", where),
    )


def _layer_transform(obj: Any, where: str) -> LayerTransformRecord:
    location = _get(obj, "location", str, where)
    if location not in ("input", "output"):
        raise _fail(f"location of {where} must be input or output, got {short_repr(location)}")
    partitions = obj.get("partitions")
    if partitions is not None and not (isinstance(partitions, list) and partitions and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in partitions)):
        raise _fail(f"partitions of {where} must be null or a non-empty list of partition indices")
    return LayerTransformRecord(location=location, matrix=_get(obj, "matrix", str, where),
                                block_size=_int(obj, "block_size", where), partitions=partitions)


def _transform(obj: Any, where: str, algorithm: str) -> TransformRecord:
    sources = _get(obj, "source_tensors", list, where)
    if not all(isinstance(s, str) for s in sources):
        raise _fail(f"source_tensors of {where} must be strings")
    scale = _finite(obj, "scale", where)
    if not scale > 0:
        raise _fail(f"scale of {where} must be positive")
    return TransformRecord(
        scheme=_get(obj, "scheme", str, where), type=_get(obj, "type", str, where),
        block_size=_int(obj, "block_size", where), source_tensors=list(sources),
        inverse=_get(obj, "inverse", bool, where), scale=float(scale),
        tensor=_tensor(_get(obj, "tensor", dict, where), f"{where}.tensor", algorithm),
        whole=_get(obj, "whole", bool, where) if "whole" in obj else False,
    )


def _names(obj: Any, where: str) -> list[str]:
    if not isinstance(obj, list) or not all(isinstance(n, str) for n in obj):
        raise _fail(f"{where} must be a list of names")
    return list(obj)


def _moe(obj: Any, module: str, algorithm: str) -> MoERecord:
    where = f"moe {module}"
    num_experts = _int(obj, "num_experts", where)
    experts, rows = _pair(obj, "experts", where), _pair(obj, "rows", where)
    local = _int(obj, "local_experts", where)
    if not experts[0] < experts[1] <= num_experts or local != experts[1] - experts[0] or not rows[0] < rows[1]:
        raise _fail(f"{where}: experts {experts} ({local} local) of {num_experts} or rows {rows} are not ranges")
    members = _get(obj, "members", dict, where)
    if sorted(members) != ["down", "gate", "up"]:
        raise _fail(f"{where}: members must list gate, up and down")
    members = {proj: _names(names, f"{where} members.{proj}") for proj, names in members.items()}
    if any(len(names) != experts[1] - experts[0] for names in members.values()):
        raise _fail(f"{where}: members must name each held expert's source layers")
    expert_map = obj.get("expert_map")
    if expert_map is not None and (not isinstance(expert_map, list) or len(expert_map) != num_experts or not all(
            isinstance(i, int) and not isinstance(i, bool) and -1 <= i < num_experts for i in expert_map)):
        raise _fail(f"{where}: expert_map must give each of the {num_experts} experts a local index or -1")
    top_k = obj.get("top_k")
    input_scales = _get(obj, "input_scales", str, where)
    if input_scales not in ("all", "local", "none"):
        raise _fail(f"{where}: input_scales must be all, local or none, got {short_repr(input_scales)}")
    return MoERecord(
        module=module, source=_get(obj, "source", str, where), layout_id=_get(obj, "layout_id", str, where),
        backend=_get(obj, "backend", str, where), kernels=_kernels(_get(obj, "kernels", list, where)), num_experts=num_experts,
        local_experts=local, experts=experts, rows=rows, hidden=_int(obj, "hidden", where), intermediate=_int(obj, "intermediate", where),
        members=members, input_scales=input_scales,
        tensors={name: _tensor(rec, f"{module}.{name}", algorithm)
                 for name, rec in _get(obj, "tensors", dict, where).items()},
        expert_map=None if expert_map is None else list(expert_map),
        top_k=None if top_k is None else _int(obj, "top_k", where),
        rescale_error=None if obj.get("rescale_error") is None else _finite(obj, "rescale_error", where),
    )


def _fusion(obj: dict) -> dict[str, list[str]]:
    if not all(isinstance(v, list) and all(isinstance(m, str) for m in v) for v in obj.values()):
        raise _fail("fusion must map fused module names to lists of source module names")
    return {k: list(v) for k, v in obj.items()}


def _kernels(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise _fail("kernels must be a list of kernel class names")
    return list(value)


def _engines(value: Any) -> dict[str, list[str]]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v) for k, v in value.items()):
        raise _fail("engines must map engine names to lists of version strings")
    return {k: list(v) for k, v in value.items()}


def parse_manifest(data: Any) -> Manifest:
    """Validate a decoded manifest.json."""
    if not isinstance(data, dict):
        raise _fail("expected a JSON object")
    if data.get("kind") != BUNDLE_KIND:
        raise _fail(f"not an nvfp4-repack bundle manifest (kind={data.get('kind')!r})")
    version = _int(data, "bundle_format_version", "manifest")
    if not 1 <= version <= BUNDLE_FORMAT_VERSION:
        raise _fail(f"bundle format version {version} is not supported (this tool reads 1 to {BUNDLE_FORMAT_VERSION})")
    algorithm = "sha256" if version < 3 else _get(data, "tensor_digest", str, "manifest")
    if algorithm not in DIGESTS:
        raise _fail(f"tensor_digest {short_repr(algorithm)} is not one of {', '.join(DIGESTS)}")
    file_digest = "sha256" if version < 4 else _get(data, "file_digest", str, "manifest")
    if file_digest not in FILE_DIGESTS:
        raise _fail(f"file_digest {short_repr(file_digest)} is not one of {', '.join(FILE_DIGESTS)}")
    # formats 1 and 2 written before fusion / tensor parallelism have no tp_size, tp_rank or fusion
    legacy_tp = True if version < 3 and "tp_size" not in data else None
    source = _get(data, "source", dict, "manifest")
    versions = _get(data, "flashinfer_versions", list, "manifest")
    if not all(isinstance(v, str) for v in versions):
        raise _fail("flashinfer_versions must be a list of strings")
    manifest = Manifest(
        bundle_format_version=version,
        tool_version=_get(data, "tool_version", str, "manifest"),
        target=_get(data, "target", str, "manifest"),
        layout_id=_get(data, "layout_id", str, "manifest"),
        flashinfer_versions=list(versions),
        source=SourceRecord(
            path=_get(source, "path", str, "source"),
            format=_get(source, "format", str, "source"),
            quant_algo=_get(source, "quant_algo", str, "source"),
            files=_file_hashes(_get(source, "files", dict, "source"), "source.files", file_digest),
            repo_id=_optional_str(source, "repo_id", "source"),
            revision=_optional_str(source, "revision", "source"),
            hub_sha256=_file_hashes(source.get("hub_sha256", {}), "source.hub_sha256", "sha256"),
        ),
        layers={p: _layer(rec, p, algorithm) for p, rec in _get(data, "layers", dict, "manifest").items()},
        passthrough={n: _tensor(rec, n, algorithm) for n, rec in _get(data, "passthrough", dict, "manifest").items()},
        files=_file_hashes(_get(data, "files", dict, "manifest"), "files", file_digest),
        transforms={n: _transform(rec, n, algorithm) for n, rec in _get(data, "transforms", dict, "manifest").items()},
        tp_size=_int(data, "tp_size", "manifest") if legacy_tp is None else 1,
        tp_rank=_int(data, "tp_rank", "manifest") if legacy_tp is None else 0,
        fusion=_fusion(_get(data, "fusion", dict, "manifest")) if legacy_tp is None else {},
        file_digest=file_digest,
        tensor_digest=algorithm,
        scheme=_optional_str(data, "scheme", "manifest") or "W4A16",  # bundles written before W4A4 layouts
        kernels=_kernels(data.get("kernels", [])),
        moe={m: _moe(rec, m, algorithm) for m, rec in _get(data, "moe", dict, "manifest").items()} if version >= 5 else {},
        engines=_engines(_get(data, "engines", dict, "manifest")) if version >= 6 else legacy_engines(),
    )
    if manifest.scheme not in ("W4A16", "W4A4"):
        raise _fail(f"scheme must be W4A16 or W4A4, got {short_repr(manifest.scheme)}")
    if not 0 <= manifest.tp_rank < manifest.tp_size:
        raise _fail(f"tp_rank {manifest.tp_rank} is not a rank of tp_size {manifest.tp_size}")
    seen: set[str] = set()
    for prefix, layer in manifest.layers.items():
        for name in [f"{prefix}.{part}" for part in layer.tensors]:
            if name in seen:
                raise _fail(f"tensor {short_repr(name)} is listed twice")
            seen.add(name)
    for name in [*manifest.passthrough, *manifest.transforms,
                 *(f"{m}.{n}" for m, record in manifest.moe.items() for n in record.tensors)]:
        if name in seen:
            raise _fail(f"tensor {short_repr(name)} is listed twice")
        seen.add(name)
    for prefix, layer in manifest.layers.items():
        for t in layer.transforms:
            record = manifest.transforms.get(t.matrix)
            if record is None or record.block_size != t.block_size:
                raise _fail(f"{short_repr(prefix)}: {t.location} transform names no matrix {short_repr(t.matrix)} "
                            f"of block size {t.block_size}")
    return manifest


def read_manifest(bundle_dir: Path) -> Manifest:
    path = bundle_dir / MANIFEST_NAME
    if not path.is_file():
        raise RepackError(f"{bundle_dir}: no {MANIFEST_NAME} (not an nvfp4-repack bundle)")
    return parse_manifest(load_json(path))


def read_output_record(folder: Path) -> list[str] | None:
    """The bundle folders the convert that wrote ``folder`` recorded (see ``OUTPUT_RECORD``); None for an output
    without the record (a single bundle, or written before the record existed)."""
    path = folder / OUTPUT_RECORD
    if not path.is_file():
        return None
    data = load_json(path)
    members = data.get("members")
    if data.get("kind") != OUTPUT_KIND or not isinstance(members, list) or not all(
            isinstance(m, str) and _plain_file_name(m) for m in members):
        raise RepackError(f"{path}: not an nvfp4-repack output record (kind {OUTPUT_KIND!r}, members: folder names)")
    return members
