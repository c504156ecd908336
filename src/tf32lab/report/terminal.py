"""rich, imported once without moving the caller's random numbers.

``rich.style`` draws ``random.getrandbits(24)`` from Python's global stream when it is first imported (the start
of an id counter), so a user who seeded ``random`` would draw other numbers after their first report. The
``report`` package imports this module first, and so does every module that imports rich outside it.

Example:

    >>> import random
    >>> random.seed(1); before = random.getstate()
    >>> from tf32lab.report import terminal
    >>> random.getstate() == before
    True
"""

from __future__ import annotations

import random

_state = random.getstate()
try:
    import rich.style  # noqa: F401
finally:
    random.setstate(_state)
    del _state
