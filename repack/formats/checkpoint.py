"""A Hugging Face-style checkpoint folder, treated as untrusted: config, shards, tensor index.

Resolution of a model reference (a folder, or a Hub repo id) to a local folder is one function
(``resolve_model_dir``). Nothing here executes checkpoint code: JSON and safetensors only, never pickle,
never ``trust_remote_code``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import RepackError
from .hub import Origin, cache_repo_folder, is_repo_id, snapshot
from .safetensors_io import TensorEntry, read_header, read_tensor

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
BUNDLE_CONFIG_KEY = "nvfp4_repack"  # config.json key that marks a bundle (written by convert)
BUNDLE_MANIFEST = "manifest.json"
MAX_JSON_BYTES = 256 << 20  # config, index and quantization JSON: megabytes at most for any real model


def load_json(path: Path) -> dict:
    """A JSON object from ``path``, or a RepackError naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise RepackError(f"{path.name}: {size} bytes exceeds the {MAX_JSON_BYTES}-byte limit for JSON files")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise RepackError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also huge int literals
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise RepackError(f"{path.name}: invalid JSON ({reason})") from None
    if not isinstance(data, dict):
        raise RepackError(f"{path.name}: expected a JSON object, got {type(data).__name__}")
    return data


def contained_file(root: Path, relative: str, boundary: Path | None = None) -> Path:
    """``root/relative``, refusing paths (or symlinks) that escape ``boundary`` (default ``root``)."""
    path = root / relative
    resolved_root = (boundary or root).resolve()
    try:
        resolved = path.resolve(strict=True)
    except FileNotFoundError:
        raise RepackError(f"{relative}: file not found in {root}") from None
    except (OSError, RuntimeError) as exc:
        raise RepackError(f"{relative}: cannot resolve ({exc})") from None
    if not resolved.is_relative_to(resolved_root):
        raise RepackError(f"{relative}: points outside the model folder ({resolved}); refusing to read it")
    if not resolved.is_file():
        raise RepackError(f"{relative}: not a regular file")
    return path


def resolve_model_dir(model: str | Path, revision: str | None = None) -> tuple[Path, Origin]:
    """The local folder holding ``model``'s files, and where it came from.

    A folder that exists always wins; otherwise an ``org/name`` string is a Hub repo id (at ``revision``)."""
    if not Path(model).expanduser().exists() and isinstance(model, str) and is_repo_id(model):
        return snapshot(model, revision)
    if revision is not None:
        raise RepackError(f"{model}: a revision applies to Hub repo ids, not to a local folder")
    path = local_dir(model)
    return path, Origin(boundary=cache_repo_folder(path) or path)


def local_dir(path: str | Path) -> Path:
    """``path`` as an existing local folder."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise RepackError(f"{path}: no such file or directory")
    if not folder.is_dir():
        raise RepackError(f"{path}: not a directory (expected a model folder with config.json)")
    return folder


@dataclass
class Checkpoint:
    """The files of a model folder and the location of every tensor in it."""

    root: Path
    config: dict
    shard_files: list[str]
    tensors: dict[str, TensorEntry] = field(repr=False)
    origin: Origin | None = None

    def __post_init__(self) -> None:
        self.origin = self.origin or Origin(boundary=self.root)

    def contained(self, name: str) -> Path:
        """The folder's file ``name``, refused if it resolves outside the folder (or the Hub repo's cache)."""
        assert self.origin is not None
        return contained_file(self.root, name, self.origin.boundary)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise RepackError(f"tensor {name!r} not found in {self.root}") from None

    def read(self, name: str) -> torch.Tensor:
        return read_tensor(self.entry(name))

    def side_files(self) -> list[str]:
        """Top-level files that are neither weights nor config.json (tokenizer, generation config, recipes...).

        A ``manifest.json`` is not one: the bundle writes its own under that name."""
        skip = {"config.json", INDEX_NAME, BUNDLE_MANIFEST, *self.shard_files}
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.name not in skip and not p.name.endswith(".safetensors") and not p.name.endswith(PICKLE_SUFFIXES)
            and (p.is_file() or p.is_symlink())
        )


def _weight_map(root: Path, boundary: Path) -> dict | None:
    """The index's tensor -> shard map, or None for a folder without an index."""
    if not (root / INDEX_NAME).exists() and not (root / INDEX_NAME).is_symlink():
        return None
    index = load_json(contained_file(root, INDEX_NAME, boundary))
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise RepackError(f"{INDEX_NAME}: missing or empty 'weight_map'")
    return weight_map


def _shard_names(root: Path, weight_map: dict | None) -> list[str]:
    if weight_map is not None:
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise RepackError(f"{INDEX_NAME}: 'weight_map' must map tensor names to shard file names")
        names = sorted(set(weight_map.values()))
        for name in names:
            if "/" in name or "\\" in name or "\x00" in name or name in ("", ".", ".."):
                raise RepackError(f"{INDEX_NAME}: shard name {name!r} is not a plain file name")
            if not (root / name).exists() and not (root / name).is_symlink():
                raise RepackError(f"{INDEX_NAME}: names shard {name!r}, which is missing")
        return names
    names = sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors"))
    if not names:
        pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise RepackError(
                f"{root}: only pickle weights ({pickles[0]}); they are never unpickled, convert to safetensors first"
            )
        raise RepackError(f"{root}: no .safetensors weights found")
    return names


def _refuse_bundle(root: Path, config: dict) -> None:
    """A bundle's tensors are already in a runtime layout: reading them as a source would double-transform.

    A bundle is a folder whose config.json has the marker key (whatever its value) or whose manifest.json is one.
    """
    marker = config.get(BUNDLE_CONFIG_KEY)
    is_bundle = BUNDLE_CONFIG_KEY in config
    manifest = root / BUNDLE_MANIFEST
    if not is_bundle and manifest.is_file():
        try:
            is_bundle = manifest.stat().st_size <= MAX_JSON_BYTES and b'"nvfp4-repack-bundle"' in manifest.read_bytes()
        except OSError:
            is_bundle = False
    if is_bundle:
        target = marker.get("target") if isinstance(marker, dict) else None
        kind = f" for {target}" if isinstance(target, str) else ""
        raise RepackError(
            f"{root}: is an nvfp4-repack bundle{kind}, not a source checkpoint; convert or verify against its source"
        )


def open_checkpoint(model: str | Path, revision: str | None = None) -> Checkpoint:
    """Open and validate a model folder (or Hub repo id): config.json, shard list, every shard's header."""
    root, origin = resolve_model_dir(model, revision)
    config_path = root / "config.json"
    if not config_path.exists():
        raise RepackError(f"{root}: no config.json (not a Hugging Face model folder)")
    config = load_json(contained_file(root, "config.json", origin.boundary))
    _refuse_bundle(root, config)
    weight_map = _weight_map(root, origin.boundary)
    shard_files = _shard_names(root, weight_map)
    tensors: dict[str, TensorEntry] = {}
    for shard in shard_files:
        for name, entry in read_header(contained_file(root, shard, origin.boundary)).items():
            if name in tensors:
                raise RepackError(f"tensor {name!r} appears in both {tensors[name].file.name} and {shard}")
            tensors[name] = entry
    if not tensors:
        raise RepackError(f"{root}: the weight files hold no tensors")
    for name, shard in (weight_map or {}).items():
        if name not in tensors:  # an incomplete download: converting would silently drop the tensor
            raise RepackError(
                f"{INDEX_NAME}: names tensor {name!r} in {str(shard)!r}, but no weight file holds it "
                "(incomplete download?)"
            )
    return Checkpoint(root=root, config=config, shard_files=shard_files, tensors=tensors, origin=origin)
