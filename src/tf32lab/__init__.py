"""tf32lab: see, control and choose how float32 matrix math runs on tensor cores (TF32, bf16).

Example:

    >>> import tf32lab
    >>> with tf32lab.precision("high"):   # scoped, thread- and task-local, exact on exit
    ...     tf32lab.get_float32_matmul_precision()
    'high'
    >>> tf32lab.get_float32_matmul_precision()
    'highest'
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Imported on first use, so that ``import tf32lab`` (the CLI's ``--version``, a pytest plugin's registration)
# does not import torch.
_WHERE = {
    "check": "compare", "doctor": "diagnosis", "emulate": "emulator", "Tf32LabError": "errors",
    "autoconfig": "heuristics", "save_compile_cache": "heuristics", "LEVELS": "levels", "Report": "report",
    "get_float32_matmul_precision": "scope", "precision": "scope", "set_float32_matmul_precision": "scope",
    "Policy": "policy", "explain": "policy", "predict": "speed", "bench": "timing", "SpeedReport": "speed",
    "tune": "tuning", "Tuning": "tuning",
    "Workload": "workload",
}
_SUBMODULES = ("flags", "formats", "hardware", "targets")

__all__ = [
    "LEVELS",
    "Policy",
    "Report",
    "SpeedReport",
    "Tf32LabError",
    "Tuning",
    "Workload",
    "__version__",
    "autoconfig",
    "bench",
    "check",
    "doctor",
    "emulate",
    "explain",
    "flags",
    "formats",
    "get_float32_matmul_precision",
    "hardware",
    "precision",
    "predict",
    "save_compile_cache",
    "set_float32_matmul_precision",
    "targets",
    "tune",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'tf32lab' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
