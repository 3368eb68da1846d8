"""compressed-tensors online transforms (``transform_config``): which rotation each quantized layer applies at run time.

A transform scheme (QuIP ``u``/``v``, SpinQuant ``R1``..``R4``) has a ``type``, a block size (``head_dim``; none means
the whole K or N) and ``apply`` entries (``targets``, ``ignore``, ``location``, ``inverse``). ``weight_input`` and
``weight_output`` were fused into the weights before quantization: nothing is left to do. ``input`` and ``output``
are ONLINE: the layer computes ``x -> x @ blockdiag(T)`` before its GEMM, or ``y -> y @ blockdiag(T)`` after it
(compressed-tensors' ``apply_transform_weight``), with, per compressed-tensors 0.19's factories:

* ``hadamard`` / ``random-hadamard``: ``T = P(W)`` (``W[perm][:, perm]`` when the scheme is randomized), transposed
  when ``inverse``, divided by ``sqrt(b)``: ``W`` is stored unnormalized (entries +-1);
* ``random-matrix``: ``T = W`` as stored (an ``inverse`` entry stores the inverse matrix itself), no normalization;
  accepted only when well conditioned (``MAX_CONDITION``).

Sharing, as compressed-tensors creates and saves it: a scheme builds one matrix per block size (random-matrix: one
more for its inverse) and ties it into every module that uses it; ``save_pretrained`` keeps one copy, under the
first module's name (``<module>.<scheme>_<location>.weight``, plus ``.perm``). So a layer uses its own stored
matrix if there is one, else the one stored matrix of its (scheme, block size, inverse) group.

Everything else (attention-side ``q_attn``/``k_cache``, unknown types or keys, learnable transforms, an online
transform on a module that is not a quantized layer, or on a target this reader cannot resolve) is refused with a
one-line error: a bundle that silently dropped a rotation would compute a different function.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from ..errors import RepackError
from .checkpoint import Checkpoint
from .safetensors_io import short_repr

ONLINE = ("input", "output")
OFFLINE = ("weight_input", "weight_output")
HADAMARD_TYPES = ("hadamard", "random-hadamard")
TYPES = (*HADAMARD_TYPES, "random-matrix")
LINEAR_CLASSES = ("Linear", "LinearBase")
SCHEME_KEYS = {"type", "apply", "randomize", "requires_grad", "head_dim", "precision"}
ARGS_KEYS = {"targets", "location", "inverse", "ignore"}
# Hadamard types: max |W W^T - b I| / b. The stored entries are +-1 (exact in any float dtype), so any real
# checkpoint meets this with room; a flipped or scaled entry misses it by ~1/b.
ORTHOGONALITY_TOL = 1e-6
# random-matrix need not be orthogonal, but the runtime rounds x @ T to bf16 and the weights hold T^-1: the
# rounding error (2^-9 per element) is amplified by up to the condition number of T. Above 4 a bundle can miss
# verify's 1e-2 tolerance (llm-compressor's torch.rand matrices have condition numbers in the thousands and give
# 30-50% logit errors in bf16, in its own runtime as in ours), so such checkpoints are refused.
MAX_CONDITION = 4.0
MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class SourceMatrix:
    """One online matrix as the source defines it: where it is stored and how it becomes ``T``."""

    scheme: str
    type: str
    size: int
    weight: str  # tensor name
    perm: str | None  # tensor name of the randomized permutation, if any
    inverse: bool  # Hadamard types: T is the transpose
    whole: bool = False  # no head_dim: the block is the layer's whole K (or N); vLLM's QuTLASS route needs a head_dim

    @property
    def scale(self) -> float:
        """The normalization compressed-tensors divides by at run time (``sqrt(b)`` for Hadamard types)."""
        return math.sqrt(self.size) if self.type in HADAMARD_TYPES else 1.0

    @property
    def name(self) -> str:
        """The matrix's tensor name in a bundle: the stored weight's, ``.T`` when applied transposed."""
        return self.weight + (".T" if self.inverse and self.type in HADAMARD_TYPES else "")


@dataclass(frozen=True)
class LayerTransform:
    location: str  # "input" or "output"
    matrix: SourceMatrix
    entry: int = 0  # which ``apply`` entry of its scheme: vLLM fuses partitions only under one and the same entry


@dataclass
class SourceTransforms:
    """Per quantized layer its online transforms (input first), and the tensors they were read from."""

    layers: dict[str, tuple[LayerTransform, ...]] = field(default_factory=dict)
    tensors: set[str] = field(default_factory=set)

    @property
    def matrices(self) -> dict[str, SourceMatrix]:
        """Every distinct online matrix by its bundle name."""
        return {t.matrix.name: t.matrix for ts in self.layers.values() for t in ts}


def _fail(scheme: str, what: str) -> RepackError:
    return RepackError(f"config.json: transform scheme {short_repr(scheme)}: {what}")


def transform_config(checkpoint: Checkpoint, qc: dict) -> dict:
    """The ``config_groups`` of the checkpoint's transform_config (``{}`` when it has none)."""
    config = qc.get("transform_config") or checkpoint.config.get("transform_config") or {}
    if not isinstance(config, dict) or set(config) - {"config_groups"}:
        raise RepackError("config.json: transform_config must be an object with only 'config_groups'")
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise RepackError("config.json: transform_config.config_groups must map scheme names to objects")
    return groups


def _string_list(value: object, scheme: str, what: str) -> list[str]:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(scheme, f"{what} must be a string or a list of strings")
    return value


def _check_scheme(name: str, scheme: dict) -> list[dict]:
    """The scheme's ``apply`` entries, after refusing everything this tool does not implement."""
    unknown = set(scheme) - SCHEME_KEYS
    if unknown:
        raise _fail(name, f"unknown key {short_repr(sorted(unknown)[0])}")
    if scheme.get("type") not in TYPES:
        raise _fail(name, f"type {short_repr(scheme.get('type'))} is not supported (supported: {', '.join(TYPES)})")
    if scheme.get("requires_grad"):
        raise _fail(name, "learnable transforms (requires_grad) are not supported")
    head_dim = scheme.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0):
        raise _fail(name, f"head_dim must be a positive integer or null, got {short_repr(head_dim)}")
    apply = scheme.get("apply", [])
    if not isinstance(apply, list) or not all(isinstance(a, dict) for a in apply):
        raise _fail(name, "apply must be a list of objects")
    for args in apply:
        if set(args) - ARGS_KEYS:
            raise _fail(name, f"unknown apply key {short_repr(sorted(set(args) - ARGS_KEYS)[0])}")
        location = args.get("location")
        if location not in ONLINE + OFFLINE:
            raise _fail(name, f"location {short_repr(location)} is not supported (only input, output, weight_input, "
                              "weight_output); refusing rather than dropping it")
        if not isinstance(args.get("inverse", False), bool):
            raise _fail(name, "inverse must be true or false")
    return apply


def matches_module(name: str, patterns: list[str], linear: set[str], where: str) -> bool:
    """compressed-tensors' ``is_match``: exact name, ``re:`` regex (``re.match``), or the class ``Linear``."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                if re.match(pattern[3:], name):
                    return True
            except re.error as exc:
                raise RepackError(f"config.json: {where}: bad regex {short_repr(pattern)} ({exc})") from None
        elif pattern == name or (pattern in LINEAR_CLASSES and name in linear):
            return True
    return False


def _modules(checkpoint: Checkpoint, transform_tensors: set[str]) -> set[str]:
    """Every module that holds a weight (quantized or not), by name; transform modules are not targets."""
    return {n.rsplit(".", 1)[0] for n in checkpoint.tensors
            if n.endswith((".weight", ".weight_packed")) and n not in transform_tensors}


def _online_targets(name: str, args: dict, modules: set[str], linear: set[str], layers: dict) -> list[str]:
    """The quantized layers an online ``apply`` entry covers; an error for any other module it names."""
    targets = _string_list(args.get("targets", []), name, "targets")
    ignore = _string_list(args.get("ignore", []), name, "ignore")
    for target in targets:
        if not target.startswith("re:") and target not in LINEAR_CLASSES and target not in modules:
            raise _fail(name, f"{args['location']} target {short_repr(target)} names no module of the checkpoint "
                              "(class targets other than Linear cannot be resolved from the files)")
    where = f"transform scheme {short_repr(name)}"
    hits = sorted(m for m in modules
                  if matches_module(m, targets, linear, where) and not matches_module(m, ignore, linear, where))
    for module in hits:
        if module not in layers:
            raise _fail(name, f"online {args['location']} transform on {short_repr(module)}, which is not an "
                              "NVFP4-quantized layer (only quantized layers can carry online transforms)")
    return hits


def _block_size(scheme: dict, name: str, location: str, layer) -> int:
    dim, what = (layer.k, "K") if location == "input" else (layer.n, "N")
    size = scheme.get("head_dim") or dim
    if dim % size:
        raise RepackError(f"{layer.prefix}: transform scheme {short_repr(name)} block size {size} does not divide "
                          f"{what}={dim} ({location} transform)")
    return size


def read_transforms(checkpoint: Checkpoint, qc: dict, layers: dict) -> SourceTransforms:
    """Resolve every online transform of every quantized layer; each distinct matrix is loaded and validated."""
    groups = transform_config(checkpoint, qc)
    if not groups:
        return SourceTransforms()
    stored = _stored_transform_tensors(checkpoint, groups)
    modules = _modules(checkpoint, stored)
    ignored = qc.get("ignore") or []
    if not isinstance(ignored, list) or not all(isinstance(i, str) for i in ignored):
        raise RepackError("config.json: quantization_config.ignore must be a list of strings")
    # the Linear modules: quantized ones, and those the quantization scheme (which targets Linear) left out
    linear = set(layers) | {m for m in modules if matches_module(m, ignored, set(), "quantization_config.ignore")}
    found: dict[str, list[LayerTransform]] = {}
    for name, scheme in groups.items():
        uses = [
            (prefix, args["location"], _block_size(scheme, name, args["location"], layers[prefix]),
             bool(args.get("inverse", False)), entry)
            for entry, args in enumerate(_check_scheme(name, scheme)) if args["location"] in ONLINE
            for prefix in _online_targets(name, args, modules, linear, layers)
        ]
        for (prefix, *_), transform in zip(uses, _shared_matrices(checkpoint, name, scheme, uses)):
            found.setdefault(prefix, []).append(transform)
    result = SourceTransforms()
    for prefix, transforms in sorted(found.items()):
        locations = [t.location for t in transforms]
        twice = [loc for loc in ONLINE if locations.count(loc) > 1]
        if twice:
            raise RepackError(f"{prefix}: more than one online {twice[0]} transform; composing them is not supported")
        result.layers[prefix] = tuple(sorted(transforms, key=lambda t: ONLINE.index(t.location)))
    for matrix in result.matrices.values():
        check_matrix(matrix, load_matrix(checkpoint, matrix))
    result.tensors = stored
    return result


def _shared_matrices(checkpoint: Checkpoint, name: str, scheme: dict, uses: list[tuple[str, str, int, bool, int]]
                     ) -> list[LayerTransform]:
    """Each use's matrix: its own stored one, else the one stored matrix of its (block size, inverse) group
    (random-matrix keeps a second matrix for its inverse; Hadamard types transpose the one they have)."""
    kind = scheme["type"]

    def group(size: int, inverse: bool) -> tuple[int, bool]:
        return size, inverse and kind == "random-matrix"

    stored: dict[tuple[int, bool], list[str]] = {}
    for prefix, location, size, inverse, _ in uses:
        if f"{prefix}.{name}_{location}.weight" in checkpoint.tensors:
            stored.setdefault(group(size, inverse), []).append(f"{prefix}.{name}_{location}")
    out = []
    for prefix, location, size, inverse, entry in uses:
        own, candidates = f"{prefix}.{name}_{location}", stored.get(group(size, inverse), [])
        if own not in candidates and len(candidates) != 1:
            what = "is missing" if not candidates else f"is ambiguous ({len(candidates)} stored candidates)"
            raise RepackError(f"{prefix}: matrix {own}.weight of transform scheme {short_repr(name)} {what}")
        base = own if own in candidates else candidates[0]
        perm = f"{base}.perm" if scheme.get("randomize") else None
        out.append(LayerTransform(location, SourceMatrix(name, kind, size, f"{base}.weight", perm,
                                                         inverse and kind in HADAMARD_TYPES,
                                                         not scheme.get("head_dim")), entry))
    return out


def _stored_transform_tensors(checkpoint: Checkpoint, groups: dict) -> set[str]:
    """Every ``<module>.<scheme>_<location>.weight|perm`` tensor: an online one is consumed into the bundle's
    matrices; any other would be a transform module the model has no place for."""
    suffixes = tuple(f".{s}_{loc}.{part}" for s in groups for loc in ONLINE for part in ("weight", "perm"))
    return {n for n in checkpoint.tensors if n.endswith(suffixes)}


def load_matrix(checkpoint: Checkpoint, matrix: SourceMatrix) -> torch.Tensor:
    """``T`` unnormalized, float64, exactly as compressed-tensors derives it from the stored tensors."""
    entry = checkpoint.entry(matrix.weight)
    if not entry.dtype.is_floating_point or entry.shape != (matrix.size, matrix.size):
        raise RepackError(f"{matrix.weight}: transform matrix must be a float [{matrix.size}, {matrix.size}] "
                          f"(block size of scheme {short_repr(matrix.scheme)}), got {entry.dtype_name} "
                          f"{list(entry.shape)}")
    value = checkpoint.read(matrix.weight).to(torch.float64)
    if matrix.perm is not None:
        perm = checkpoint.read(matrix.perm)
        if perm.dtype.is_floating_point or perm.shape != (matrix.size,) or not torch.equal(
                perm.sort().values.long(), torch.arange(matrix.size)):
            raise RepackError(f"{matrix.perm}: must be a permutation of 0..{matrix.size - 1}")
        value = value[perm.long()][:, perm.long()]
    return value.t() if matrix.inverse else value


def check_matrix(matrix: SourceMatrix, value: torch.Tensor) -> None:
    """Finite; Hadamard types orthogonal up to ``sqrt(b)``, random-matrix safely invertible."""
    if not torch.isfinite(value).all():
        raise RepackError(f"{matrix.weight}: transform matrix has non-finite entries")
    if matrix.type in HADAMARD_TYPES:
        error = float((value @ value.t() - matrix.size * torch.eye(matrix.size, dtype=value.dtype)).abs().max())
        if error > ORTHOGONALITY_TOL * matrix.size:
            raise RepackError(f"{matrix.weight}: {matrix.type} matrix is not orthogonal (max |W W^T - b I| / b = "
                              f"{error / matrix.size:.3g} > {ORTHOGONALITY_TOL:g})")
    else:
        condition = float(torch.linalg.cond(value))
        if not condition <= MAX_CONDITION:
            raise RepackError(f"{matrix.weight}: random-matrix transform has condition number {condition:.3g} > "
                              f"{MAX_CONDITION:g}: a bf16 GEMM after it cannot reproduce the checkpoint's function")


def model_dtype(config: dict) -> torch.dtype:
    """The dtype a server holds the model (and so the transform matrices) in: config.json's, else bfloat16."""
    name = config.get("dtype") or config.get("torch_dtype")
    return MODEL_DTYPES.get(name, torch.bfloat16) if isinstance(name, str) else torch.bfloat16


def runtime_matrix(checkpoint: Checkpoint, matrix: SourceMatrix, dtype: torch.dtype) -> torch.Tensor:
    """``T`` with the normalization fused in, in ``dtype``: what the runtime multiplies by. Cast first, then divided
    in ``dtype``, as vLLM's ``HadamardTransform`` does, so that a bundle holds vLLM's bytes (for +-1 entries the
    same as the rounded float64 quotient in bfloat16 and float16; in float32 not for every block size)."""
    return load_matrix(checkpoint, matrix).to(dtype).div_(matrix.scale).contiguous()
