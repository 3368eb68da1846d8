"""Streaming safetensors writer and the all-or-nothing output folder.

Each shard's header is known from the plan, so tensors are written one at a time as they are produced:
memory holds one layer, never a shard or the model.

Guarantee: a crash or ``kill -9`` at any moment leaves OUT either absent (a new OUT) or whole: the old
bundle or the new one, never a mix, never missing both. Output goes to a hidden staging folder beside OUT
(``.OUT.partial-XXXX``), is fsynced, and only then takes OUT's name:

* a new OUT: one ``rename`` (``renameat2(RENAME_NOREPLACE)`` on Linux, so an OUT that appeared meanwhile
  is never replaced);
* ``--overwrite``: on Linux one ``renameat2(RENAME_EXCHANGE)`` swaps staging and OUT atomically, then the
  old bundle (now under the staging name) is deleted. Where the exchange is unavailable (other systems,
  file systems without it) OUT is first renamed to ``.OUT.old-XXXX`` and staging renamed to OUT; a kill
  between those two renames leaves OUT missing for a moment, and :func:`recover_interrupted` (run by every
  ``convert`` to that OUT) renames the old bundle back.

A kill (or Ctrl-C, which keeps the finished shards for ``--resume``) can leave hidden ``.OUT.partial-*`` /
``.OUT.old-*`` folders behind; they are never OUT. The next convert to OUT removes them (:func:`remove_stale`),
except the one a ``--resume`` continues from, and those a running convert holds: a staging folder is locked
(``flock``) by the process writing it, and a lock ends with its process, however it ends.

Without fsync (``convert --no-fsync``, for CI jobs that rerun a failed step) a killed process still leaves OUT
whole or absent, since the page cache outlives it; only a crash of the machine can then publish a bundle whose
data never reached the disk, which verify's hashes detect.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..errors import Interrupted, OutputExists, RepackError
from ..formats.hashing import FILE_DIGEST, TENSOR_DIGEST, bytes_hexdigest, new_digest
from .manifest import OUTPUT_KIND, OUTPUT_RECORD
from .plan import PlannedTensor


def safetensors_header(tensors: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus JSON header, space-padded to 8-byte alignment as safetensors does."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": tensor.dtype_name,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


WRITEBACK_BYTES = 32 << 20  # written bytes after which the disk is asked to start writing them
WRITE_PIECE = 256 << 10  # bytes hashed twice and written while in the core's cache (ShardWriter)


def _start_writeback() -> Callable[[int, int, int], object] | None:
    """Linux ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``: start writing a range to disk, without
    waiting. None elsewhere (then the final fsync writes everything)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, nbytes: function(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE


START_WRITEBACK = _start_writeback()


class ShardWriter:
    """One shard written front to back as its tensors arrive, in the plan's order.

    The file's digest and each tensor's are computed on the bytes on their way to the file, so nothing is read
    back: each ``WRITE_PIECE`` of a chunk is hashed for its tensor, hashed for its file and written, one after the
    other on the calling thread, while the piece is in that core's cache. Only the first of the three reads it from
    memory: the kernel's copy into the page cache then costs a third of what it costs from memory, and hashing on
    other threads (each reading from memory) cost 0.4-0.5 CPU seconds more per 4 GB (docs/benchmarks.md); a
    bundle's writes run on a thread of its own anyway (convert's lanes). ``write`` may be called several times per
    tensor (chunks); a tensor ends when the next one starts or at :meth:`close`, and must then hold exactly
    its planned bytes. Every ``WRITEBACK_BYTES`` the kernel is asked to start writing the file to disk, so
    that the fsync before the bundle is published finds little left to write, instead of all of it (neither
    without ``fsync``).
    """

    def __init__(self, path: Path, tensors: list[PlannedTensor], fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync
        self.tensor_digests: dict[str, str] = {}
        self._order = iter(tensors)
        self._current: PlannedTensor | None = None
        self._digest = new_digest(TENSOR_DIGEST)
        self._written = 0
        self._handle = open(path, "wb", buffering=0)
        self._file_digest = new_digest(FILE_DIGEST)
        self._synced = 0  # bytes handed to START_WRITEBACK
        self._offset = 0
        self._put(memoryview(safetensors_header(tensors, {"format": "pt"})))

    def _put(self, piece: memoryview) -> None:
        self._file_digest.update(piece)
        view = piece
        while view:  # a raw write may take fewer bytes than asked
            view = view[self._handle.write(view) :]
        self._offset += len(piece)
        if self.fsync and START_WRITEBACK is not None and self._offset - self._synced >= WRITEBACK_BYTES:
            START_WRITEBACK(self._handle.fileno(), self._synced, self._offset - self._synced)
            self._synced = self._offset

    def write(self, tensor: PlannedTensor, chunk: bytes | memoryview) -> None:
        if tensor is not self._current:
            self._end_tensor()
            self._current = next(self._order, None)
            if self._current is not tensor:
                raise AssertionError(f"{tensor.name}: written out of the planned order of {self.path.name}")
            self._digest, self._written = new_digest(TENSOR_DIGEST), 0
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), WRITE_PIECE):
            piece = view[start : start + WRITE_PIECE]
            self._digest.update(piece)
            self._put(piece)
        self._written += len(view)

    def _end_tensor(self) -> None:
        if self._current is None:
            return
        if self._written != self._current.nbytes:
            raise RepackError(
                f"{self._current.name}: produced {self._written} bytes, planned {self._current.nbytes} (internal error)"
            )
        self.tensor_digests[self._current.name] = self._digest.hexdigest()

    def finish(self) -> str:
        """Check every planned tensor was written; the file's digest. :meth:`sync` then makes it durable."""
        self._end_tensor()
        missing = next(self._order, None)
        if missing is not None:
            raise AssertionError(f"{missing.name}: planned in {self.path.name} but never written")
        return self._file_digest.hexdigest()

    def sync(self) -> None:
        """fsync and close: apart from :meth:`finish`, so that the next shard is written while this one syncs."""
        if self.fsync:
            os.fsync(self._handle.fileno())
        self._handle.close()

    def abandon(self) -> None:
        self._handle.close()


def write_json(path: Path, data: object) -> str:
    """Write JSON and return the digest (``FILE_DIGEST``) of the bytes written."""
    text = (json.dumps(data, indent=2, sort_keys=False) + "\n").encode()
    path.write_bytes(text)
    return bytes_hexdigest(text)


def write_output_record(folder: Path, members: list[str], fsync: bool = False) -> None:
    """Name the bundle folders of a several-bundle output (``OUTPUT_RECORD``), replacing any earlier record
    atomically."""
    temporary = folder / f".{OUTPUT_RECORD}.tmp"
    write_json(temporary, {"kind": OUTPUT_KIND, "members": members})
    if fsync:
        _fsync(temporary)
    temporary.replace(folder / OUTPUT_RECORD)
    if fsync:
        _fsync(folder)


def holds_bundles(folder: Path) -> bool:
    """A bundle, or the ``rank-R`` bundles of a tensor-parallel conversion."""
    return (folder / "manifest.json").is_file() or any((p / "manifest.json").is_file() for p in folder.glob("rank-*"))


def clash_with_input(out: Path, source: Path) -> str | None:
    """Why ``out`` may not be written from the input folder ``source`` (None: it may): it would replace it (the same
    folder, or one that holds it), or it lies inside it, where a bundle would become part of its own source."""
    resolved, keep = out.expanduser().resolve(), source.expanduser().resolve()
    if resolved == keep or keep.is_relative_to(resolved):
        return f"{out}: the output folder would replace the input {source}; choose another output"
    if resolved.is_relative_to(keep):
        return f"{out}: the output folder is inside the input {source}; write it elsewhere (-o)"
    return None


def check_destination(out: Path, overwrite: bool, protected: Iterable[Path] = ()) -> None:
    """Refuse to replace an existing ``out`` unless ``overwrite`` and it is a bundle (or an empty folder), and
    never replace an input folder nor write inside one. Only a refusal that ``overwrite`` would lift is an
    :class:`OutputExists`."""
    for path in protected:
        clash = clash_with_input(out, path)
        if clash:
            raise RepackError(clash)
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise RepackError(f"{out}: exists and is not a folder; refusing to replace it")
        if not holds_bundles(out) and any(out.iterdir()):
            raise RepackError(f"{out}: exists and is not an nvfp4-repack bundle; only a bundle may be replaced")
        if not overwrite:
            raise OutputExists(f"{out}: already exists")
    if not out.parent.is_dir():
        raise RepackError(f"{out.parent}: output's parent folder does not exist")


RENAME_NOREPLACE = 1  # linux/fs.h
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2``: True once done, False where it is unavailable (then the caller falls back)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28, musl >= 1.2.3
    except (OSError, AttributeError):
        return False
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync directories
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    """Flush every file of ``folder`` (and of its rank folders) and the folders, so the rename publishes
    complete data."""
    for path in folder.iterdir():
        if path.is_symlink():
            continue
        if path.is_file():
            _fsync(path)
        elif path.is_dir():
            _sync_tree(path)
    _fsync(folder)


def _hidden_folders(out: Path, kind: str) -> list[Path]:
    """OUT's hidden ``.OUT.<kind>-XXXXXXXX`` folders (exactly that form: ``.a.partial-*`` would also match the
    staging folders of an OUT named ``a.partial-b``)."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.{kind}-[0-9a-f]{{8}}")
    return sorted(p for p in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*")
                  if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def _retired_folders(out: Path) -> list[Path]:
    return _hidden_folders(out, "old")


def recover_interrupted(out: Path) -> Path | None:
    """Undo a replace that was killed between its two renames (the fallback path): if OUT is missing and
    a retired complete bundle ``.OUT.old-XXXX`` exists, rename it back to OUT. Returns what was restored."""
    if out.exists() or out.is_symlink() or not out.parent.is_dir():
        return None
    candidates = [p for p in _retired_folders(out) if holds_bundles(p)]
    if not candidates:
        return None
    newest = max(candidates, key=lambda p: p.stat().st_mtime)
    newest.rename(out)
    return out


def _install(staging: Path, out: Path) -> None:
    """``staging`` becomes OUT, which must not exist."""
    try:
        if _renameat2(staging, out, RENAME_NOREPLACE):
            return
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            raise RepackError(f"{out}: appeared while converting; left untouched") from None
        raise
    if out.exists() or out.is_symlink():
        raise RepackError(f"{out}: appeared while converting; left untouched")
    staging.rename(out)


def _replace(staging: Path, out: Path) -> None:
    """``staging`` becomes OUT, whose old content is deleted; atomic where the kernel can exchange."""
    if _renameat2(staging, out, RENAME_EXCHANGE):
        return  # staging now holds the old bundle; the caller deletes it
    retired = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    out.rename(retired)
    try:
        staging.rename(out)  # a kill before this line: recover_interrupted() restores ``retired``
    except BaseException:
        retired.rename(out)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def staging_folders(out: Path) -> list[Path]:
    """The hidden staging folders an interrupted convert to ``out`` left, newest first (none in use)."""
    found = [p for p in _hidden_folders(out, "partial") if not in_use(p)]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _lock(folder: Path) -> int | None:
    """An open descriptor holding an exclusive ``flock`` on ``folder`` (until closed, or its process ends); None
    when another process holds it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def in_use(folder: Path) -> bool:
    """Whether a running convert holds ``folder`` (its staging folder)."""
    try:
        fd = _lock(folder)
    except OSError:  # vanished meanwhile
        return False
    if fd is not None:
        os.close(fd)
    return fd is None


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (what removing it frees)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def remove_stale(out: Path, keep: Path | None = None) -> tuple[int, int]:
    """Delete what interrupted converts to ``out`` left beside it: staging folders no process holds (but ``keep``,
    the one a resume continues) and, once OUT is there, retired old bundles. Returns (folders, bytes) removed."""
    folders = [p for p in staging_folders(out) if p != keep]
    if out.exists():
        folders += _retired_folders(out)
    removed = nbytes = 0
    for folder in folders:
        fd = _lock(folder)  # held while deleting: a convert starting meanwhile cannot resume from it
        if fd is None:
            continue
        try:
            nbytes += folder_bytes(folder)
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
        finally:
            os.close(fd)
    return removed, nbytes


@contextlib.contextmanager
def staged_folder(
    out: Path, overwrite: bool, reuse: Path | None = None, keep_interrupted: bool = True, fsync: bool = True
) -> Iterator[Path]:
    """Yield a temporary folder beside ``out`` (``reuse``: one an interrupted convert left); on success it
    atomically becomes ``out``, on failure it is removed. Ctrl-C keeps it (unless not ``keep_interrupted``), so
    that a resume can use what it holds: like a kill, that leaves only a hidden folder, never a partial OUT. See
    the module docstring for what a kill at any point leaves behind, and what ``fsync`` False gives up."""
    staging = reuse or out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(exist_ok=reuse is not None)
        lock = _lock(staging)  # marks it in use: no other convert removes or resumes it
    except OSError as exc:
        raise RepackError(f"{out.parent}: cannot create the output folder ({exc.strerror or exc})") from None
    if lock is None:
        raise RepackError(f"{out}: another convert is writing to it (staging folder {staging.name}); wait for it")
    keep = False
    try:
        yield staging
        if fsync:
            _sync_tree(staging)
        if overwrite and (out.exists() or out.is_symlink()):
            _replace(staging, out)
        else:
            _install(staging, out)
        if fsync:
            _fsync(out.parent)
    except (KeyboardInterrupt, Interrupted):
        keep = keep_interrupted
        raise
    except OSError as exc:  # disk full, permissions, a file vanishing: the user's environment, not a bug
        where = f" ({exc.filename})" if exc.filename else ""
        raise RepackError(f"{out}: conversion failed, nothing written: {exc.strerror or exc}{where}") from None
    finally:
        if staging.exists() and not keep:
            shutil.rmtree(staging, ignore_errors=True)
        os.close(lock)
