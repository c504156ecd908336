"""numba's kernels compiled ahead of their first call (`python -m tf32lab.numbers.compiled`), as `make test` does
beside pip's install: every kernel of every kernel module, into the cache the suite then loads, without torch."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tf32lab.numbers import compiled

# compiles (or loads) the kernels the accumulation tests compile: on their worker, not at once on both
pytestmark = pytest.mark.xdist_group("numba_accumulation")

NUMBERS = pathlib.Path(compiled.__file__).parent
SRC = NUMBERS.parent.parent


def test_every_kernel_module_is_compiled_ahead():
    found = sorted(p.stem for p in NUMBERS.glob("*_kernels.py"))
    assert found == sorted(compiled.KERNEL_MODULES)


def test_the_script_compiles_every_kernel_into_the_cache_without_torch():
    pytest.importorskip("numba")
    kernels = sum(len(re.findall(r"^@one_signature\(", (NUMBERS / f"{name}.py").read_text(), re.MULTILINE))
                  for name in compiled.KERNEL_MODULES)
    script = ("import runpy, sys; runpy.run_module('tf32lab.numbers.compiled', run_name='__main__'); "
              "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=_env(), cwd=SRC.parent)
    assert done.returncode == 0, done.stderr
    # each kernel compiled, or loaded from the cache a run before wrote; in a process that never imported torch
    assert done.stdout.splitlines() == [f"tf32lab: {kernels} compiled kernels in numba's cache", "False"]
    for name in compiled.KERNEL_MODULES:
        source = (NUMBERS / f"{name}.py").read_text()
        for kernel in re.findall(r"^@one_signature\((?:.|\n)*?^def (\w+)", source, re.MULTILINE):
            assert list((NUMBERS / "__pycache__").glob(f"{name}.{kernel}-*.nbi")), f"{name}.{kernel} not cached"


def test_the_modules_examples_compile_no_kernel(monkeypatch):
    # tests/test_docs.py runs these examples on any worker, outside this file's group: an example that compiled
    # every kernel took 30 s of CPU there on a cold cache, beside the group's worker compiling the same kernels
    import doctest

    pytest.importorskip("numba")
    for name in compiled.KERNEL_MODULES:  # imported first: their kernels registered in the list put aside below
        compiled.kernels(name)
    compiles: list[str] = []
    monkeypatch.setattr(compiled, "_COMPILES", [lambda: compiles.append("compiled")])
    result = doctest.testmod(compiled, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
    assert compiles == []


def test_the_script_without_numba_says_so_and_fails():
    # an image built with `python -m tf32lab.numbers.compiled` and no `fast` extra: "0 compiled kernels" and exit
    # 0 read as success
    script = ("import sys; sys.modules['numba'] = None; import runpy; "
              "runpy.run_module('tf32lab.numbers.compiled', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=_env(),
                          cwd=SRC.parent)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == "" and "numba is not installed" in done.stderr and "tf32lab[fast]" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def _env() -> dict[str, str]:
    """This process's environment with ``src`` first on the path, and numba's cache beside the kernels' sources
    (where ``make test`` compiles them), whatever cache folder the environment names."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PYTHONPATH"] = str(SRC)
    return env


def test_a_kernel_of_another_module_is_not_compiled_ahead():
    # one_signature's own example, a caller's kernel: compile_all compiles tf32lab's kernels, not every one made
    numba = pytest.importorskip("numba")
    before = list(compiled._COMPILES)

    @compiled.one_signature(numba.types.float64)
    @numba.njit
    def same(x):
        return x

    assert len(compiled._COMPILES) == len(before)
