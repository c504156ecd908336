"""The training check's report written by the callbacks into the run's log folder, as ``tf32lab-training.json``
and ``.html``, in a thread while the run trains on (:class:`Written`).

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
    """The report as ``tf32lab-training.json`` and ``.html`` in ``folder`` (none: not written), made and written in
    a thread while the run trains: the report object is the callback's at once, and the run's first steps go on
    while its texts are rendered (from one ``to_dict``: about 1.5 ms, the first page of a process 80 ms more, as
    jinja2 compiles its template) and synced to disk. Rendering draws from no random stream, so the run's draw as
    they would. Each file is written whole or not at all, synced with its folder (tens of milliseconds of waiting
    on the disk). The folder is made here, so that one that cannot be made fails before the run trains on; an
    error of the rendering or writing (a full disk) is warned of by :meth:`wait`, which the callbacks call when
    training ends or raises: by then the run's work is done, and neither it nor the run's own exception is lost to
    a report file (the report stays on the callback)."""

    def __init__(self, report: Optional[TrainingReport], folder: Optional[str]) -> None:
        self.paths: list[Path] = []
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if not folder:
            return
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        from tf32lab.report.training_render import html  # imported here, not in the thread: as to_html() does

        self.paths = [path / "tf32lab-training.json", path / "tf32lab-training.html"]

        # Thread.start() waits until the thread has started: a thread that went on to render in Python held the
        # GIL until the switch interval made it let go (5 ms: 4-5% of a small model's check) before start()
        # returned. It waits, without the GIL, until start() has returned.
        go = threading.Event()

        def write() -> None:
            go.wait()
            try:
                data = report.to_dict()  # made once, for both texts; finite already (write_json's walk, not again)
                # both renamed, then their folder flushed once (a flush is a journal commit: milliseconds); flushed
                # too where the page failed, so that the JSON renamed before it is on disk as if written alone
                try:
                    write_atomically(self.paths[0], json_text(data), sync_folder=False)
                    write_atomically(self.paths[1], html(report, data), sync_folder=False)
                finally:
                    sync_folder(path)
            except Exception as exc:  # told by wait(), in the run's own thread
                self._error = exc

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
