"""Writing a file whole or not at all: a temporary file beside it, flushed to disk, then renamed over it.

A full disk, a crash or Ctrl-C leaves the old file or none, never a truncated one, and the temporary file is
removed. Reports (``Report.to_json``, ``save_html``) and compile-cache artifacts are written so.

Example:

    >>> import tempfile, pathlib
    >>> from tf32lab.files import write_atomically
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> write_atomically(folder / "r.json", '{"ok": true}\\n').read_text()
    '{"ok": true}\\n'
    >>> sorted(p.name for p in folder.iterdir())
    ['r.json']
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Union

__all__ = ["write_atomically"]


def write_atomically(path: Union[str, Path], data: Union[str, bytes], *, private: bool = False) -> Path:
    """Write ``data`` to ``path`` whole or not at all; ``private``: readable by its owner only, from the start.

    Text is UTF-8; a character UTF-8 cannot hold (a lone surrogate from a model's output name) is written as its
    escape, ``\\udc80``.
    """
    path = Path(path)
    payload = data.encode("utf-8", "backslashreplace") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
