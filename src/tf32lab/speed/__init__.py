"""speed: what each level buys. ``counting`` counts a run's work per op, ``prediction`` turns it into seconds on a
target GPU (``predict``), ``bench`` times the levels on the hardware at hand.

``tf32lab.speed`` was a module before the layer packages; its names still import from here, with a
DeprecationWarning (``tf32lab.predict`` and ``tf32lab.SpeedReport`` are the public ones).

    >>> import warnings, tf32lab
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     from tf32lab.speed import predict
    >>> predict is tf32lab.predict, caught[0].category.__name__
    (True, 'DeprecationWarning')
"""

from typing import Any

_OLD_NAMES = ("LayerSpeed", "LevelSpeed", "SpeedReport", "gemm_seconds", "level_maths", "op_seconds", "predict",
              "predict_counts", "seconds_at")


def __getattr__(name: str) -> Any:
    if name not in _OLD_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"{__name__}.{name} is now {__name__}.prediction.{name}; the old path will be removed",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(f"{__name__}.prediction"), name)
