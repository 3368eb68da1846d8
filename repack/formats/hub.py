"""Hugging Face Hub repo ids as model references, resolved through huggingface_hub and its cache.

Only the files a conversion reads are fetched (JSON, safetensors, tokenizer and recipe files; no other
weight formats, no code). huggingface_hub does the rest the usual way: its cache folder, ``HF_HUB_OFFLINE``, the token from
``HF_TOKEN`` or the saved login. A cached snapshot's files are symlinks into the repo's own ``blobs/`` folder,
so the containment boundary for reading is the repo's cache folder, not the snapshot folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import RepackError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.yaml", "*.yml", "*.jinja", "*.tiktoken", "*.md",
                  "LICENSE*"]


@dataclass(frozen=True)
class Origin:
    """Where a model folder came from: ``boundary`` is the folder no file may resolve outside of."""

    boundary: Path
    repo_id: str | None = None
    commit: str | None = None


def cache_repo_folder(folder: Path) -> Path | None:
    """The repo folder (``models--org--name``) when ``folder`` is a snapshot inside a Hugging Face cache, so that
    a snapshot given as a path reads its blobs just like the repo id would."""
    repo = folder.resolve().parent.parent
    if folder.resolve().parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo
    return None


def hub_sha256(snapshot_folder: Path, names: list[str]) -> dict[str, str]:
    """The Hub's own sha256 of each of ``names`` (LFS files), from the cache, not recomputed: huggingface_hub names
    each blob after the file's ETag, which for an LFS file is its sha256 (the ``lfs.sha256`` of the Hub's file
    metadata). Files stored in git (a 40-digit sha1 ETag) or cached as copies rather than links are left out."""
    found = {}
    for name in names:
        link = snapshot_folder / name
        if link.is_symlink() and SHA256_HEX.fullmatch(link.resolve().name):
            found[name] = link.resolve().name
    return found


def is_repo_id(model: str) -> bool:
    return bool(REPO_ID.fullmatch(model)) and ".." not in model


def snapshot(repo_id: str, revision: str | None = None) -> tuple[Path, Origin]:
    """The local snapshot folder of ``repo_id`` at ``revision`` (default branch), downloading what is missing."""
    import huggingface_hub
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        folder = Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        raise RepackError(f"{at}: gated repository; accept its terms on the Hub and log in (HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise RepackError(f"{at}: no such Hub repository (or it is private: log in, HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise RepackError(f"{at}: no such revision in the Hub repository") from None
    except IncompleteSnapshotError:
        raise RepackError(f"{at}: the cached snapshot is incomplete and the Hub cannot be reached") from None
    except LocalEntryNotFoundError:
        raise RepackError(f"{at}: not in the local Hugging Face cache and the Hub cannot be reached "
                          "(offline mode or no network)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise RepackError(f"{at}: cannot download from the Hub ({reason})") from None
    repo_folder = folder.resolve().parent.parent  # <cache>/models--org--name/snapshots/<commit>
    return folder, Origin(boundary=repo_folder, repo_id=repo_id, commit=folder.name)
