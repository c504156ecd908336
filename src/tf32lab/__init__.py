"""tf32lab: see, control and choose how float32 matrix math runs on tensor cores (TF32, bf16).

Example:

    >>> import tf32lab
    >>> with tf32lab.precision("high"):   # scoped, thread- and task-local, exact on exit
    ...     tf32lab.get_float32_matmul_precision()
    'high'
    >>> tf32lab.get_float32_matmul_precision()
    'highest'
"""

from . import flags, formats, hardware, targets
from .compare import check
from .diagnosis import doctor
from .emulator import emulate
from .errors import Tf32LabError
from .heuristics import autoconfig, save_compile_cache
from .levels import LEVELS
from .report import Report
from .scope import get_float32_matmul_precision, precision, set_float32_matmul_precision
from .workload import Workload

__version__ = "0.1.0"

__all__ = [
    "LEVELS",
    "Report",
    "Tf32LabError",
    "Workload",
    "__version__",
    "autoconfig",
    "check",
    "doctor",
    "emulate",
    "flags",
    "formats",
    "get_float32_matmul_precision",
    "hardware",
    "precision",
    "save_compile_cache",
    "set_float32_matmul_precision",
    "targets",
]
