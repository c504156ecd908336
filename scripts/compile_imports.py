"""Compile the bytecode of what the test suite imports, once, on every CPU, before the suite runs (`make test`'s
set-up runs it after pip's install).

pip installs with ``--no-compile`` (the Makefile says why), so each module is compiled by the first process that
imports it. The suite starts about 450 interpreters and forks (its workers, CLI runs, pytest runs, torchrun
ranks); on a fresh clone those that start at once compile the same modules at once. Measured on an idle 2-core
machine: the suite's first run took 75 CPU seconds (40 s of wall clock) more than its second, while importing
what it needs in two processes side by side, here, takes about a quarter of that. What this list misses is
compiled on first import, as before; what it names and a later version of a package lacks is skipped. A failure
here fails nothing: the set-up goes on (exit code 0 whatever was imported).

    PYTHONDONTWRITEBYTECODE= .venv/bin/python scripts/compile_imports.py
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

# Each group is imported by one process, all at once. The first imports torch first; the second imports what needs
# no torch first, so that torch's modules are mostly compiled by the first alone before the second reaches them.
GROUPS: tuple[tuple[str, ...], ...] = (
    ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.fsdp", "torch.distributed.tensor",
     "torch.distributed.tensor.parallel", "torch.distributed.run", "torch.distributions", "torch.testing",
     "numba", "pytorch_lightning", "torchmetrics", "gpytorch", "tf32lab.cli", "tf32lab.measure.check",
     "tf32lab.measure.training", "tf32lab.decide.tune", "tf32lab.report.html", "tf32lab.report.training_render",
     "tf32lab.integrations.lightning", "tf32lab.numbers.compiled"),
    ("numpy", "scipy.optimize", "scipy.sparse", "scipy.stats", "scipy.signal", "scipy.linalg", "scipy.integrate",
     "sympy", "networkx", "hypothesis", "hypothesis.strategies", "playwright.sync_api", "jsonschema", "uvicorn",
     "starlette.applications", "vermin", "rich.console", "jinja2", "pytest", "_pytest.pytester", "xdist.plugin",
     "xdist.dsession", "execnet", "sklearn",
     "transformers", "transformers.modeling_utils", "transformers.trainer", "transformers.models.llama.modeling_llama",
     "transformers.models.gpt2.modeling_gpt2", "transformers.models.t5.modeling_t5", "sentence_transformers",
     "accelerate",
     "tf32lab.integrations.transformers"),
)


def _import(names: list[str]) -> int:
    import importlib
    import warnings

    warnings.simplefilter("ignore")
    for name in names:
        # not installed, or not importable here: compiled when (if) the suite imports it
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    return 0


def main() -> int:
    if len(sys.argv) > 1:
        return _import(sys.argv[1:])
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # the point is to write them
    children = [subprocess.Popen([sys.executable, __file__, *group], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for group in GROUPS]
    for child in children:
        child.wait()
    print(f"compile_imports: the suite's imports compiled in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
