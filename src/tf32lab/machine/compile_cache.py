"""A ``torch.compile`` cache folder: inductor's caches kept there, and a Mega-Cache artifact saved and loaded.

**The folder must be trusted like code.** A Mega-Cache artifact holds pickles that inductor unpickles, and entries
that name the files they are written to. So before anything is loaded:

- the folder, the artifact and its note must belong to this user and be writable by nobody else;
- the artifact must be the one the note describes (same size and SHA-256), for this torch and GPU;
- it must parse, and every entry must land inside the folder: an absolute name, or one that climbs out with
  ``..``, refuses the whole artifact before a single entry is written.

Each refusal is a ``Tf32LabError`` naming what is wrong and how to fix it; a mismatched torch or GPU is not an
error but a decision not to load (``Decision.applied`` False, with the reason).

Example:

    >>> import tempfile
    >>> from tf32lab.machine import compile_cache
    >>> folder = compile_cache.folder(tempfile.mkdtemp())
    >>> compile_cache.check_trusted(folder)               # a fresh private folder: fine
    >>> compile_cache.read(folder).reason.startswith("no tf32lab-mega-cache.bin yet")
    True
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple, Optional, Union

import torch

from tf32lab.errors import Tf32LabError
from tf32lab.numbers.files import write_atomically, write_json

__all__ = ["ARTIFACT", "Loaded", "check_trusted", "folder", "load", "read", "save"]

log = logging.getLogger("tf32lab.autoconfig")

ARTIFACT = "tf32lab-mega-cache.bin"
NOTE = "tf32lab-mega-cache.json"  # what the artifact was saved with, its size and checksum

PathLike = Union[str, "os.PathLike[str]"]


def folder(value: Any) -> Path:
    """``value`` as an absolute folder path; a one-line ``Tf32LabError`` when it is not one."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise Tf32LabError(f"bad compile_cache {value!r}; accepted: None or a folder path")
    path = Path(value).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise Tf32LabError(f"bad compile_cache {str(value)!r}: it is a file; accepted: a folder path")
    return path


def check_trusted(path: Path) -> None:
    """Refuse a folder (or the artifact and note in it) that another user owns or may write."""
    for item in (path, path / ARTIFACT, path / NOTE):
        try:
            info = item.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode):
            raise Tf32LabError(f"compile_cache {item} is a symbolic link; a compile cache must be a plain folder "
                               "of this user's (its files are loaded like code)")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise Tf32LabError(f"compile_cache {item} belongs to another user (uid {info.st_uid}); a compile cache "
                               "is loaded like code: use a folder of your own")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise Tf32LabError(f"compile_cache {item} is writable by other users (mode "
                               f"{stat.S_IMODE(info.st_mode):o}); a compile cache is loaded like code: "
                               f"chmod go-w {item}")


def identity() -> dict[str, Any]:
    """What an artifact is tied to: this torch and, where there is one, this GPU."""
    found: dict[str, Any] = {"torch": torch.__version__}
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def _count(info: Any) -> int:
    artifacts = getattr(info, "artifacts", None) or {}
    return sum(len(v) for v in artifacts.values()) if isinstance(artifacts, dict) else 0


# PyTorch's Mega-Cache (one artifact for every compile cache) came with torch 2.7; before it only the folder helps.
MEGA_CACHE = hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")
_NO_MEGA_CACHE = (f"torch {torch.__version__} has no Mega-Cache (torch.compiler.save_cache_artifacts, torch 2.7 and "
                  "newer)")


def save(path: Path) -> Path:
    """Write this process's compile artifacts into ``path`` (atomically), with the note beside them."""
    if not MEGA_CACHE:
        raise Tf32LabError(f"nothing to save: {_NO_MEGA_CACHE}; the folder alone still keeps Inductor's own caches "
                           "(compile_cache=folder)")
    result = torch.compiler.save_cache_artifacts()
    if result is None:
        raise Tf32LabError("nothing to save: torch.compile has produced no cacheable artifacts in this process yet")
    data, info = result
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_trusted(path)
    artifact = path / ARTIFACT
    note = {**identity(), "artifacts": _count(info), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_atomically(artifact, data, private=True)
    write_json(path / NOTE, note, indent=1, private=True)
    log.info("saved %d compile artifacts (%d bytes) to %s", _count(info), len(data), artifact)
    return artifact


def _escapes(key: str) -> bool:
    """Whether an entry named ``key`` would be written outside the folder it is joined to."""
    if not key or "\x00" in key or os.path.isabs(key) or key.startswith(("/", "\\")):
        return True
    parts = PurePosixPath(key.replace("\\", "/")).parts
    return ".." in parts or (len(key) > 1 and key[1] == ":")  # a Windows drive


def _entries(data: bytes, artifact: Path) -> dict[str, list]:
    """The artifact's entries by type, parsed with PyTorch's own reader (no pickle is opened to parse)."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        raise Tf32LabError(f"cannot check {artifact}: this torch has no Mega-Cache reader "
                           "(torch.compiler._cache); not loaded") from None
    parsed = CacheArtifactManager.deserialize(data)
    if not parsed or not any(parsed.values()):
        raise Tf32LabError(f"{artifact} is corrupt: it holds no compile artifact PyTorch can read; delete it "
                           "(tf32lab.save_compile_cache writes a new one)")
    return parsed


class Loaded(NamedTuple):
    """What :func:`read` found and :func:`load` did: the artifact (None when there is none), why, and whether
    it was (or will be) loaded; ``entries`` are what :func:`load` writes."""

    artifact: Optional[str]
    reason: str
    applied: bool
    entries: Optional[dict] = None


def read(path: Path) -> Loaded:
    """Check the Mega-Cache artifact in ``path`` and parse it, writing nothing.

    Refuses, with a ``Tf32LabError``, an untrusted folder, a corrupt artifact, or one with an entry that would
    land outside the folder; an artifact of another torch or GPU is returned as not to be loaded.
    """
    check_trusted(path)  # also without an artifact: inductor reads its own cache entries (pickles) from here
    artifact = path / ARTIFACT
    if not artifact.exists():
        return Loaded(None, f"no {ARTIFACT} yet; tf32lab.save_compile_cache(folder) writes one after the first "
                            "compile", False)
    if not MEGA_CACHE:
        return Loaded(str(artifact), f"{_NO_MEGA_CACHE}: not loaded", False)
    try:
        note = json.loads((path / NOTE).read_text(encoding="utf-8"))
        if not isinstance(note, dict):
            raise ValueError("not an object")
    except (OSError, ValueError):
        note = {}
    here = identity()
    if {k: note.get(k) for k in here} != here:
        return Loaded(str(artifact), f"saved with {note or 'unknown versions'}, not this machine's {here}: not "
                                     "loaded (it would not match)", False)
    data = artifact.read_bytes()
    if "sha256" in note and (note.get("bytes") != len(data) or note["sha256"] != hashlib.sha256(data).hexdigest()):
        raise Tf32LabError(f"{artifact} is corrupt: its size or SHA-256 differs from the one {NOTE} recorded when "
                           "it was saved; delete both (tf32lab.save_compile_cache writes new ones)")
    entries = _entries(data, artifact)
    for kind, items in entries.items():
        for item in items:
            if _escapes(item.key):
                raise Tf32LabError(f"{artifact} is refused: its {kind} entry {item.key!r} would be written outside "
                                   f"{path}; nothing was loaded (only load artifacts you made, like code)")
    triton = os.environ.get("TRITON_CACHE_DIR")
    if triton and entries.get("inductor") and not Path(triton).absolute().is_relative_to(path):
        return Loaded(str(artifact), f"TRITON_CACHE_DIR={triton} is outside compile_cache: its Triton kernels "
                                     "would be written there; not loaded", False)
    return Loaded(str(artifact), "to be loaded", True, entries)


def load(found: Loaded) -> Loaded:
    """Write what :func:`read` found into the caches (``TORCHINDUCTOR_CACHE_DIR`` must be the folder by now)."""
    if not found.applied or found.entries is None:
        return found
    from torch.compiler._cache import CacheArtifactManager

    info = CacheArtifactManager.populate_caches(found.entries)
    return Loaded(found.artifact, f"Mega-Cache loaded: {_count(info)} artifacts for warm compiles", True)
