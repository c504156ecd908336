"""Compile the bytecode of what the test suite imports, once, on every CPU, before the suite runs (`make test`'s
set-up runs it after pip's install).

pip installs with ``--no-compile`` (the Makefile says why), so each module is compiled by the first process that
imports it. The suite starts about 450 interpreters and forks (its workers, CLI runs, pytest runs, torchrun
ranks), and on a fresh clone those that start at once compile the same modules at once; each of its two workers
also rewrote the assertions of every test module as it collected them. Measured on an idle 2-core machine, a
fresh clone's suite took 50 s of wall clock more than its second run, and its workers' collection 12 s against
3.5 s; importing what it needs here, in two processes side by side, and collecting the suite once takes about
27 s. What the lists miss is compiled on first import, as before; what they name and a later version of a package
lacks is skipped. A failure here fails nothing: the set-up goes on (exit code 0 whatever was imported).

    PYTHONDONTWRITEBYTECODE= .venv/bin/python scripts/compile_imports.py
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLLECT = "--collect"  # in a group: the suite's test modules collected there (_collect)

# Each group is imported by one process, the two at once, about as long each. The first imports torch first, and
# what needs it; the second what needs no torch, then collects the suite, whose modules import torch: by then the
# first has compiled most of torch's modules, which the second then reads.
GROUPS: tuple[tuple[str, ...], ...] = (
    ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.fsdp", "torch.distributed.tensor",
     "torch.distributed.tensor.parallel", "torch.distributed.run", "torch.distributions", "torch.testing",
     "numba", "pytorch_lightning", "torchmetrics", "gpytorch", "tf32lab.cli", "tf32lab.measure.check",
     "tf32lab.measure.training", "tf32lab.decide.tune", "tf32lab.report.html", "tf32lab.report.training_render",
     "tf32lab.integrations.lightning", "tf32lab.numbers.compiled", "transformers", "transformers.modeling_utils",
     "transformers.trainer", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
     "transformers.models.t5.modeling_t5", "sentence_transformers", "accelerate",
     "tf32lab.integrations.transformers"),
    ("numpy", "scipy.optimize", "scipy.sparse", "scipy.stats", "scipy.signal", "scipy.linalg", "scipy.integrate",
     "sympy", "networkx", "hypothesis", "hypothesis.strategies", "playwright.sync_api", "jsonschema", "uvicorn",
     "starlette.applications", "vermin", "rich.console", "jinja2", "pytest", "_pytest.pytester", "xdist.plugin",
     "xdist.dsession", "execnet", "sklearn", COLLECT),
)


def _import(names: list[str]) -> int:
    import importlib
    import warnings

    warnings.simplefilter("ignore")
    for name in names:
        if name == COLLECT:
            _collect()
            continue
        # not installed, or not importable here: compiled when (if) the suite imports it
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    return 0


def _collect() -> None:
    """The suite's test modules collected, as each pytest worker collects them first: their assertions rewritten
    into bytecode (pytest's own cache, beside them), and what they import at the top compiled."""
    import pytest

    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.suppress(Exception):
        pytest.main(["--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", str(ROOT / "tests")])


def main() -> int:
    if len(sys.argv) > 1:
        return _import(sys.argv[1:])
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # the point is to write them
    children = [subprocess.Popen([sys.executable, __file__, *group], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for group in GROUPS]
    took = []
    for child in children:
        child.wait()
        took.append(f"{time.perf_counter() - start:.1f}")
    print(f"compile_imports: the suite's imports compiled in {time.perf_counter() - start:.1f} s (the processes "
          f"ended after {', '.join(took)} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
