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
import importlib
import threading
from collections.abc import Iterator
from typing import Any, Optional

__all__ = ["quiet_loading"]

# one quiet spell for every thread loading at once: the first in saves the settings, the last out puts them back
# (each thread restoring what it saw would leave the second's view, the quiet one, in place)
_lock = threading.Lock()
_inside = 0
_saved: Optional[tuple[bool, int, dict[str, bool]]] = None


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No weight-loading progress bar, load report or config warning on stderr inside (tf32lab's own lines only);
    transformers' settings, and huggingface_hub's progress-bar settings (which transformers' switch rewrites:
    every group's), restored on every exit."""
    global _inside, _saved
    from transformers.utils import logging

    with _lock:
        if not _inside:
            _saved = (logging.is_progress_bar_enabled(), logging.get_verbosity(), dict(_hub_bars().progress_bar_states))
            logging.disable_progress_bar()
            logging.set_verbosity_error()
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if not _inside and _saved is not None:
                bar, verbosity, states = _saved
                logging.set_verbosity(verbosity)
                if bar:
                    logging.enable_progress_bar()
                _hub_bars().progress_bar_states.clear()
                _hub_bars().progress_bar_states.update(states)


def _hub_bars() -> Any:
    """huggingface_hub's progress-bar module (the package exports a class of the same name)."""
    return importlib.import_module("huggingface_hub.utils.tqdm")
