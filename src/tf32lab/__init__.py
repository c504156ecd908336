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
import importlib.abc
import importlib.machinery
import sys
import warnings
from typing import Any

__version__ = "0.1.0"

# Imported on first use, so that ``import tf32lab`` (the CLI's ``--version``, a pytest plugin's registration)
# does not import torch.
_WHERE = {
    "check": "measure.check", "doctor": "machine.doctor", "emulate": "emulation.emulator",
    "Tf32LabError": "errors", "autoconfig": "machine.autoconfig", "save_compile_cache": "machine.autoconfig",
    "LEVELS": "know.levels", "Report": "report", "get_float32_matmul_precision": "control.scope",
    "precision": "control.scope", "set_float32_matmul_precision": "control.scope", "Policy": "control.policy",
    "explain": "control.policy", "predict": "speed.prediction", "bench": "speed.bench",
    "SpeedReport": "speed.prediction",
    "tune": "decide.tune", "Tuning": "decide.tune", "Workload": "workloads.workload",
    "TrainingWorkload": "workloads.training", "check_training": "measure.training",
    "TrainingReport": "report.training", "check_generation": "measure.generation",
    "GenerationReport": "report.generation",
}

# Short public paths (the flat layout's four, and ``tf32lab.distributed``) and the old internal ones. The public ones
# stay: the same module object under both names. The others were internal; they still import, with a
# DeprecationWarning (``tf32lab.speed``, now the package of counting, prediction and bench, forwards the old module's
# names itself).
PUBLIC_PATHS = {"distributed": "machine.distributed", "flags": "control.flags", "formats": "numbers.formats",
                "hardware": "machine.hardware",
                "targets": "know.targets"}
MOVED_PATHS = {
    "builtin": "workloads.builtin", "compare": "measure.check", "compile_cache": "machine.compile_cache",
    "counting": "speed.counting", "diagnosis": "machine.doctor", "diagnosis_text": "report.doctor_text",
    "emulator": "emulation.emulator", "families": "know.optable", "files": "numbers.files",
    "heuristics": "machine.autoconfig", "inductor": "machine.inductor", "levels": "know.levels",
    "metrics": "numbers.metrics",
    "modestack": "control.modestack", "optable": "know.optable", "origin": "numbers.origin", "peaks": "know.peaks",
    "policy": "control.policy", "probe": "machine.probe", "reference": "measure.reference",
    "rules": "emulation.rules", "samples": "workloads.samples", "scope": "control.scope", "specs": "workloads.specs",
    "spill": "measure.spill", "timing": "speed.bench", "trees": "numbers.trees",
    "tuning": "decide.tune", "workload": "workloads.workload",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import tf32lab.flags`` (and the moved internal paths) give the module where it lives now."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix, _, leaf = fullname.partition(".")
        if prefix != __name__ or "." in leaf or (leaf not in PUBLIC_PATHS and leaf not in MOVED_PATHS):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> Any:
        leaf = spec.name.partition(".")[2]
        new = PUBLIC_PATHS.get(leaf) or MOVED_PATHS[leaf]
        if leaf in MOVED_PATHS:
            # stacklevel 2: the importer's line (the warnings module passes over importlib's own frames)
            warnings.warn(f"{spec.name} is now {__name__}.{new}; the old path will be removed",
                          DeprecationWarning, stacklevel=2)
        module = importlib.import_module(f"{__name__}.{new}")
        self._spec = module.__spec__  # the import system is about to stamp the old name's spec on it
        return module

    def exec_module(self, module: Any) -> None:
        # It ran when imported under its own name; keep its own spec (``importlib.reload``, reprs).
        module.__spec__ = self._spec


# one finder, also after ``importlib.reload(tf32lab)`` (which makes a new class)
sys.meta_path[:] = [f for f in sys.meta_path if (type(f).__module__, type(f).__qualname__) != (__name__, "_OldPaths")]
sys.meta_path.append(_OldPaths())

__all__ = [
    "LEVELS",
    "GenerationReport",
    "Policy",
    "Report",
    "SpeedReport",
    "Tf32LabError",
    "TrainingReport",
    "TrainingWorkload",
    "Tuning",
    "Workload",
    "__version__",
    "autoconfig",
    "bench",
    "check",
    "check_generation",
    "check_training",
    "distributed",
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
    if name in PUBLIC_PATHS:
        value = importlib.import_module(f".{PUBLIC_PATHS[name]}", __name__)
    elif name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'tf32lab' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
