"""Models load with tf32lab's own lines only: transformers' weight-loading progress bar (transformers 5 draws one,
"Loading weights", on stderr for every model), its load report and config warnings silenced while loading.

Example:

    >>> from transformers.utils import logging
    >>> from tf32lab.workloads.quiet import quiet_loading
    >>> before = logging.is_progress_bar_enabled(), logging.get_verbosity()
    >>> with quiet_loading():
    ...     logging.is_progress_bar_enabled()
    False
    >>> (logging.is_progress_bar_enabled(), logging.get_verbosity()) == before   # restored
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["quiet_loading"]


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No weight-loading progress bar, load report or config warning on stderr inside (tf32lab's own lines only);
    transformers' settings restored on every exit."""
    from transformers.utils import logging

    bar, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()
