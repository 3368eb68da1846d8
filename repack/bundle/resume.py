"""The resume journal: which shards of an interrupted convert are complete, so a resume can keep them.

A convert writes ``.nvfp4-repack-resume.json`` into its staging folder each time a shard is complete and on
disk, replacing it atomically: after a kill it names only finished shards. It records the plan's fingerprint
(every shard's tensors, dtypes and shapes, the layout and the digests' algorithms) and the source's identity, and
for each shard its file digest, tensor digests and layers' global scales, which is all the manifest needs of it. A resume keeps a
shard only if the plan and the source are the same and the file still hashes as recorded; anything else is
written again. The journal is deleted before the bundle is installed, so it is never part of a bundle.

The source's identity is each shard file's size, modification time and header (hashed): convert computes the
files' digests from its one read of the source, so a full hash is known only at the end, too late for a
journal that must survive a kill. A file rewritten in place with its size, time and header kept would go
unnoticed; anything else (another download, a re-quantized model, an edited file) starts afresh.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..formats.checkpoint import Checkpoint
from ..formats.hashing import FILE_DIGEST, TENSOR_DIGEST, bytes_hexdigest, file_hexdigest
from .plan import BundlePlan
from .writer import staging_folders

JOURNAL_NAME = ".nvfp4-repack-resume.json"
JOURNAL_KIND = "nvfp4-repack-resume"


@dataclass(frozen=True)
class KeptShard:
    digest: str  # the file's, FILE_DIGEST
    tensors: dict[str, str]
    global_scales: dict[str, float]


def plan_fingerprint(plan: BundlePlan) -> str:
    """Digest of everything the plan fixes about the bytes and their record: tool version, layout, every shard's
    header, and the algorithms of the digests the journal keeps (a journal of other algorithms is never used)."""
    shape = {file: [[t.name, t.dtype_name, list(t.shape)] for t in tensors] for file, tensors in plan.shards.items()}
    text = json.dumps([__version__, plan.target.layout_id, shape, FILE_DIGEST, TENSOR_DIGEST], sort_keys=True)
    return bytes_hexdigest(text.encode())


@dataclass
class Journal:
    """The journal of one staging folder. ``kept``: shards a resume keeps; ``record`` adds finished ones."""

    folder: Path
    fingerprint: str
    source: dict[str, list]
    kept: dict[str, KeptShard] = field(default_factory=dict)
    _done: dict[str, KeptShard] = field(default_factory=dict)

    @classmethod
    def start(cls, folder: Path, plan: BundlePlan, source: dict[str, list]) -> "Journal":
        return cls(folder, plan_fingerprint(plan), source)

    def kept_now(self) -> dict[str, KeptShard]:
        """Shards complete on disk: those kept by the resume plus those finished since."""
        return {**self.kept, **self._done}

    def record(self, file: str, digest: str, tensors: dict[str, str], global_scales: dict[str, float]) -> None:
        """Note a shard as complete (it is already fsynced) and rewrite the journal."""
        self._done[file] = KeptShard(digest, dict(tensors), dict(global_scales))
        self.save()

    def save(self) -> None:
        """Rewrite the journal atomically (a kill leaves the old one or the new one)."""
        if not self.kept_now():
            return
        data = {
            "kind": JOURNAL_KIND,
            "plan": self.fingerprint,
            "source": self.source,
            "shards": {name: vars(shard) for name, shard in self.kept_now().items()},
        }
        temporary = self.folder / f"{JOURNAL_NAME}.tmp"
        with open(temporary, "w") as handle:
            json.dump(data, handle)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.replace(self.folder / JOURNAL_NAME)

    def discard(self) -> None:
        (self.folder / JOURNAL_NAME).unlink(missing_ok=True)
        (self.folder / f"{JOURNAL_NAME}.tmp").unlink(missing_ok=True)


def _read(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / JOURNAL_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("kind") == JOURNAL_KIND else None


def _kept_shards(folder: Path, data: dict, plan: BundlePlan) -> dict[str, KeptShard]:
    """The journal's shards whose files still hash as recorded (a malformed entry is simply not kept)."""
    kept = {}
    shards = data.get("shards")
    for file, entry in (shards if isinstance(shards, dict) else {}).items():
        try:
            shard = KeptShard(str(entry["digest"]), dict(entry["tensors"]), dict(entry["global_scales"]))
        except (KeyError, TypeError, ValueError):
            continue
        names = {t.name for t in plan.shards.get(file, [])}
        path = folder / file
        if names and set(shard.tensors) == names and path.is_file() and not path.is_symlink():
            if file_hexdigest(path) == shard.digest:
                kept[file] = shard
    return kept


def source_identity(checkpoint: Checkpoint) -> dict[str, list]:
    """``{shard file: [size, modification time (ns), digest of its header]}``: what a resume compares."""
    identity = {}
    for name in checkpoint.shard_files:
        path = checkpoint.contained(name)
        with open(path, "rb") as handle:
            head = handle.read(8)
            head += handle.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
        stat = path.stat()
        identity[name] = [stat.st_size, stat.st_mtime_ns, bytes_hexdigest(head)]
    return identity


@dataclass(frozen=True)
class Resumable:
    """The staging folder a resume continues, and the journal of each of its bundles that matches this run's plan
    (by folder inside it: "" for a one-bundle output, ``<target>`` for one of several targets)."""

    folder: Path
    journals: dict[str, Journal]


def find_resumable(out: Path, plans: dict[str, BundlePlan], source: dict[str, list]) -> Resumable | None:
    """The newest staging folder of ``out`` where some bundle of ``plans`` (by its folder inside it) has a journal
    that matches its plan and the source, with the shards each can keep; None when there is none (the convert then
    starts afresh)."""
    for folder in staging_folders(out):
        journals = {}
        for member, plan in plans.items():
            fingerprint = plan_fingerprint(plan)
            data = _read(folder / member)
            if data is not None and data.get("plan") == fingerprint and data.get("source") == source:
                journals[member] = Journal(folder / member, fingerprint, source,
                                           kept=_kept_shards(folder / member, data, plan))
        if journals:
            return Resumable(folder, journals)
    return None
