"""The training check's report written by the callbacks into the run's log folder, as ``tf32lab-training.json``
and ``.html``: rendered in the hook, written and synced to disk in a thread while the run trains on
(:class:`Written`).

Example (a run with no log folder gets no files):

    >>> Written(None, folder=None).wait()
    []
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Optional

from tf32lab.numbers.files import json_text, sync_folder, write_atomically
from tf32lab.report.training import TrainingReport

__all__ = ["Written"]


class Written:
    """The report as ``tf32lab-training.json`` and ``.html`` in ``folder`` (none: not written): rendered in the
    caller's thread (from one ``to_dict``: about 2 ms; the first page of a process about 33 ms more, as jinja2
    compiles its template), then written and synced to disk in a thread while the run trains. Rendering is Python
    that holds the GIL: in the thread, it held it against the run's own steps, which a small model's loop (Python
    between short ops, each letting go of the GIL and waiting to take it back) paid for with more than the rendering's
    own time (an MLP's ten steps: 0.9-1.8 ms of CPU and 0.2-3.9 ms of wall clock more than rendering first). The
    writes wait on the disk without the GIL (tens of milliseconds of syncing on a slow disk), and the run trains on
    meanwhile. Rendering draws from no random stream, so the run's draws are as they would be. Each file is written
    whole or not at all, synced with its folder. The folder is made here, so that one that cannot be made fails
    before the run trains on; an error of the rendering or writing (a full disk) is warned of by :meth:`wait`, which
    the callbacks call when training ends or raises: by then the run's work is done, and neither it nor the run's
    own exception is lost to a report file (the report stays on the callback); a page that cannot be rendered leaves
    the JSON written."""

    def __init__(self, report: Optional[TrainingReport], folder: Optional[str]) -> None:
        self.paths: list[Path] = []
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if not folder:
            return
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        from tf32lab.report.training_render import html

        self.paths = [path / "tf32lab-training.json", path / "tf32lab-training.html"]
        texts: list[str] = []
        try:
            data = report.to_dict()  # made once, for both texts; finite already (write_json's walk, not again)
            texts.append(json_text(data))
            texts.append(html(report, data))
        except Exception as exc:  # told by wait(), in the run's own thread; the JSON made before it is written
            self._error = exc
        if not texts:
            return

        # Thread.start() waits until the thread has started: a thread that went on at once held the GIL until the
        # switch interval made it let go (5 ms) before start() returned. It waits, without the GIL, until start()
        # has returned.
        go = threading.Event()

        def write() -> None:
            go.wait()
            try:
                # both renamed, then their folder flushed once (a flush is a journal commit: milliseconds); flushed
                # too where the page failed, so that the JSON renamed before it is on disk as if written alone
                try:
                    for where, text in zip(self.paths, texts):
                        write_atomically(where, text, sync_folder=False)
                finally:
                    sync_folder(path)
            except Exception as exc:  # told by wait(), in the run's own thread
                self._error = self._error or exc

        # not a daemon: a run that ends without waiting (an error in its loop) still gets whole files
        self._thread = threading.Thread(target=write, name="tf32lab-report-writer")
        try:
            self._thread.start()
        finally:  # an interrupt in start() comes after the thread has started: it must not wait for ever
            go.set()

    def wait(self) -> list[Path]:
        """The paths written, once both files are on disk; none, with a warning naming the error, when the
        writing failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            warnings.warn(f"tf32lab: the training check's report could not be written to "
                          f"{self.paths[0].parent}: {error} (the callback's .report holds it)", stacklevel=2)
            self.paths = []
        return self.paths
