"""Writing a file whole or not at all, and never through a link someone else planted; JSON that any parser reads.

Every file tf32lab writes (a policy, a report as JSON or HTML, a compile-cache artifact) goes through
:func:`write_atomically`, and every JSON text it makes (a file, ``--json -``, a ``to_json()`` string) through
:func:`write_json`: non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"`` (:func:`finite`), as a
bare ``NaN`` is not JSON (strict parsers, ``jq``, browsers' ``JSON.parse`` refuse it). :func:`write_atomically`
guarantees:

- **Whole or not at all.** The content goes to a temporary file in the target's own folder, is flushed to disk
  (``fsync``), then renamed over the target (``os.replace``, atomic on POSIX), and the folder is flushed where the
  system allows it. A full disk, a crash or Ctrl-C leaves the old file or none, never a truncated one; the temporary
  file is removed on every failure. Nothing is opened, let alone truncated, at the target's path before the content
  is ready.
- **No writing through links.** The temporary file gets a fresh random name and is created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW``: a file or a symbolic link already at that name (planted by another user in a
  shared folder, or left by a concurrent save) is never opened; another name is drawn instead. A symbolic link *at
  the target's path* is replaced by the new file, as ``rename(2)`` does; the file it pointed to is left alone.
- **Concurrent saves of one path** (threads or processes) never share a temporary file: each one's rename is atomic
  and the last one wins, whole.
- **Modes.** A target that exists keeps its permission bits (a ``0600`` policy stays ``0600``) and, where this
  process may (root), its owner and group. A new file gets what the system gives a new file (the
  umask, a folder's default ACL) when it is created; ``private=True`` makes it owner-only (``0600``) whatever
  the umask. Over an existing target the temporary file is owner-only until it takes the target's bits.
- **Streams are written, never replaced.** ``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N`` (any path whose links
  lead into ``/proc`` or ``/dev/fd``), a character device such as ``/dev/null`` and a named pipe are opened and
  written in place, appending: renaming over ``/dev/stdout`` would replace the system's link with a regular file,
  and a shell's ``> out.txt`` would never see the content. Nothing is created there; such a write is not atomic.
- **Refused targets**: a folder (``EISDIR``), a socket or a block device (``EINVAL``), an existing file that this
  user may not write (``EACCES``; like ``open(path, "w")``, not like ``mv``). A file with other hard links loses
  them: the new content is a new file.

Errors are ``OSError`` naming the target (not the temporary file) and the system's reason; the ``tf32lab``
command turns each into one line and exit code 2. :func:`check_writable` answers, before a long run, whether the
write would start at all (folder, target kind, a real probe file for a read-only file system).

Example:

    >>> import tempfile, pathlib
    >>> from tf32lab.numbers.files import write_atomically
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> write_atomically(folder / "r.json", '{"ok": true}\\n').read_text()
    '{"ok": true}\\n'
    >>> sorted(p.name for p in folder.iterdir())
    ['r.json']
    >>> write_atomically(folder, "x")
    Traceback (most recent call last):
    IsADirectoryError: [Errno 21] is a folder; give a file name: '...'
    >>> from tf32lab.numbers.files import write_json
    >>> print(write_json(folder / "n.json", {"error": float("nan"), "sizes": (1, 2.5)}), end="")
    {
      "error": "nan",
      "sizes": [
        1,
        2.5
      ]
    }
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import stat
import sys
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["check_writable", "finite", "is_stream", "json_text", "same_file", "sync_folder", "write_atomically",
           "write_json"]

PathLike = Union[str, "os.PathLike[str]"]

# O_EXCL already refuses a symbolic link at the name (POSIX: "even if it is a link"); O_NOFOLLOW says so twice.
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(
    os, "O_BINARY", 0)
_TRIES = 100  # names drawn before giving up; 48 random bits each, so a clash is a planted file or a bug
_NAME_BYTES = 200  # of the target's name kept in the temporary one: the whole name stays under NAME_MAX (255)


def write_atomically(path: PathLike, data: Union[str, bytes], *, private: bool = False,
                     sync_folder: bool = True) -> Path:
    """Write ``data`` to ``path`` whole or not at all (see the module's guarantees); ``private``: owner-only.
    ``sync_folder=False`` leaves the folder's flush (the rename's) to the caller: several files written into one
    folder, then :func:`sync_folder` once, are each as safely on disk as one written alone (each folder flush is a
    journal commit, milliseconds of waiting on the disk).

    Text is UTF-8; a character UTF-8 cannot hold (a lone surrogate from a model's output name) is written as its
    escape, ``\\udc80``. Raises ``OSError`` naming ``path`` (ENOSPC, EACCES, EROFS, ENOENT for a missing folder,
    EISDIR, ...).
    """
    path = Path(path)
    payload = data.encode("utf-8", "backslashreplace") if isinstance(data, str) else data
    if is_stream(path):
        _write_stream(path, payload)
        return path
    old = _target(path)
    # An existing target's bits are set before the rename; a new file takes the system's default at creation.
    fd, tmp = _temporary(path, 0o600 if private or old is not None else 0o666)
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                if old is not None:
                    _keep_mode(f.fileno(), old, private)
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise _about(path, exc) from exc
    if sync_folder:
        _sync_folder(path.parent)
    return path


def sync_folder(folder: PathLike) -> None:
    """Flush ``folder``'s entries (the renames of :func:`write_atomically` with ``sync_folder=False``) to disk,
    where the system lets a folder be opened (not on Windows)."""
    _sync_folder(Path(folder))


def finite(data: Any) -> Any:
    """``data`` with every non-finite float, at any depth of dicts, lists and tuples, as the string ``"nan"``,
    ``"inf"`` or ``"-inf"`` (tuples become lists, as JSON has them); the rest is left as it is.

    >>> finite({"max_rel": float("inf"), "levels": [0.5, float("-inf"), (float("nan"),)]})
    {'max_rel': 'inf', 'levels': [0.5, '-inf', ['nan']]}
    """
    if isinstance(data, float) and not math.isfinite(data):
        return "nan" if math.isnan(data) else ("inf" if data > 0 else "-inf")
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    return data


def write_json(path: Optional[PathLike], data: Any, *, indent: int = 2, private: bool = False) -> str:
    """``data`` as JSON text (:func:`finite` first, so never a bare ``NaN``; one newline at the end); written to
    ``path`` too when one is given, whole or not at all (:func:`write_atomically`, ``private`` as there).

    The one way tf32lab makes JSON, so that every file and every ``to_json()`` string loads with a strict parser.
    Raises ``TypeError`` for what JSON cannot hold (a tensor, a set), before anything is written.

    >>> text = write_json(None, {"normwise": float("nan")})
    >>> text
    '{\\n  "normwise": "nan"\\n}\\n'
    """
    text = json_text(finite(data), indent=indent)
    if path is not None:
        write_atomically(path, text, private=private)
    return text


def json_text(data: Any, *, indent: int = 2) -> str:
    """:func:`write_json`'s text of ``data`` that is :func:`finite` already (a report's ``to_dict()``): the same
    text without walking the data a second time (a training report's walk is a quarter of its JSON's making).
    Raises ``ValueError`` for a non-finite float left in it, never writing a bare ``NaN``.

    >>> json_text(finite({"x": float("nan")})) == write_json(None, {"x": float("nan")})
    True
    """
    return json.dumps(data, indent=indent, allow_nan=False) + "\n"


def check_writable(path: PathLike) -> Path:
    """Raise the ``OSError`` that :func:`write_atomically` would meet at its start, before minutes of work do.

    Checks the folder (exists, is a folder), the target (not a folder, not a device or pipe, writable when it
    exists), and creates and removes a probe file beside it, the way the real write will (a read-only or full
    file system, a name too long). The target itself is not touched.
    """
    path = Path(path)
    if is_stream(path):
        if not os.access(path, os.W_OK):
            raise OSError(errno.EACCES, "not writable (Permission denied)", str(path))
        return path
    _target(path)
    try:
        fd, probe = _temporary(path, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(exc.errno, f"not writable: {exc.strerror or exc}", str(path)) from exc
    return path


def is_stream(path: PathLike) -> bool:
    """Whether ``path`` is written in place rather than replaced: its links lead into ``/proc`` or ``/dev/fd`` (an
    open file of a process, as ``/dev/stdout`` does), or it is a character device or a named pipe."""
    if _hops(path)[-1].startswith(("/proc/", "/dev/fd/")):
        return True
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISCHR(info.st_mode) or stat.S_ISFIFO(info.st_mode)


def _hops(path: PathLike) -> list[str]:
    """``path`` and the links it leads through, up to the first one into ``/proc`` or ``/dev/fd``."""
    hops = [os.fspath(path)]
    for _ in range(40):  # the kernel's own limit on links followed
        if hops[-1].startswith(("/proc/", "/dev/fd/")):
            break
        try:
            hops.append(os.path.join(os.path.dirname(hops[-1]), os.readlink(hops[-1])))
        except OSError:  # not a link, or nothing there
            break
    return hops


_OWN_FD = re.compile(rf"^/(?:proc/(?:self|thread-self|{os.getpid()})/fd|dev/fd)/(\d+)$")


def _write_stream(path: Path, payload: bytes) -> None:
    """Append ``payload``; to this process's own descriptor itself when the path names one (``/dev/stdout``), after
    Python's buffers for it are flushed, so that what was printed before stays before and nothing is overwritten."""
    own = _OWN_FD.match(_hops(path)[-1])
    try:
        if own is not None:
            fd = int(own.group(1))
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(AttributeError, ValueError, OSError):
                    if stream is not None and stream.fileno() == fd:
                        stream.flush()
            _write_all(fd, payload)
            return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
        try:
            _write_all(fd, payload)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _about(path, exc) from exc


def _write_all(fd: int, payload: bytes) -> None:
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view):]


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether two paths name one file: the same path spelled differently, through a symbolic link, or (when both
    exist) a hard link of it."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _target(path: Path) -> Optional[os.stat_result]:
    """The existing target's status (through a symbolic link), None when there is none; raise when it cannot be
    replaced by a file."""
    folder = path.parent
    try:
        if not folder.is_dir():
            if folder.exists():
                raise NotADirectoryError(errno.ENOTDIR, f"no folder {str(folder)!r} (it is a file)", str(path))
            raise FileNotFoundError(errno.ENOENT, f"no folder {str(folder)!r}", str(path))
        try:
            info = os.stat(path)
        except FileNotFoundError:  # no target, or a dangling link: either becomes a new file
            return None
    except OSError as exc:  # a name too long, a folder that cannot be searched
        raise _about(path, exc) from exc
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a folder; give a file name", str(path))
    if not stat.S_ISREG(info.st_mode):
        raise OSError(errno.EINVAL, "is not a regular file (a socket or a block device); give a file name", str(path))
    if not os.access(path, os.W_OK):
        raise PermissionError(errno.EACCES, "not writable (Permission denied)", str(path))
    return info


def _temporary(path: Path, mode: int) -> tuple[int, Path]:
    """A new file in ``path``'s folder, opened for writing, that no one else has: a random name, created
    exclusively, never through a link."""
    stem = path.name if len(os.fsencode(path.name)) <= _NAME_BYTES else path.name[:_NAME_BYTES // 4]
    for _ in range(_TRIES):
        tmp = path.with_name(f".{stem}.{secrets.token_hex(6)}.tmp")
        try:
            return _open_new(tmp, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside it after {_TRIES} tries", str(path))


def _open_new(tmp: Path, mode: int) -> int:
    """Create ``tmp``; raise ``FileExistsError`` when anything, a symbolic link included, is already there."""
    return os.open(tmp, _NEW, mode)


def _keep_mode(fd: int, old: os.stat_result, private: bool) -> None:
    """Give the new file the old one's permission bits (owner-only bits for a private file), and its owner and group
    where this process may (root rewriting a user's file)."""
    bits = stat.S_IMODE(old.st_mode)
    if private:
        bits &= 0o700
    if hasattr(os, "fchown") and (old.st_uid, old.st_gid) != (os.getuid(), os.getgid()):
        with contextlib.suppress(OSError):  # only root may give a file away: others keep it as their own
            os.fchown(fd, old.st_uid, old.st_gid)
    if hasattr(os, "fchmod"):  # after fchown, which clears set-ID bits
        os.fchmod(fd, bits)


def _sync_folder(folder: Path) -> None:
    """Flush the rename itself to disk where the system lets a folder be opened (not on Windows)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _about(path: Path, exc: OSError) -> OSError:
    """The same error, naming the target rather than a temporary file (``OSError`` picks the subclass)."""
    if exc.filename == str(path) or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), str(path))
