"""The Makefile's set-up, run by GNU make itself with a stand-in interpreter that records what it is asked to do:
every install is one pip run, and no two of them run at once into the same venv, even under ``make -j``; numba's
kernels are compiled beside the suite's install."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a stand-in for python3 and the venv's python: `-m venv DIR` makes DIR/bin/python (itself); anything else is
# logged as a start and an end, half a second apart, so that two runs at once overlap in the log
STAND_IN = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0
fi
echo "start $*" >> "$LOG"
sleep 0.5
echo "end $*" >> "$LOG"
"""


def _project(tmp_path: Path, stand_in: str) -> Path:
    """The Makefile in an empty project, with ``stand_in`` for python3; returns the stand-in's path."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "constraints.txt").write_text("")
    python = tmp_path / "python3"
    python.write_text(stand_in)
    python.chmod(0o755)
    return python


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_the_two_installs_never_run_at_once_and_the_suites_is_one_pip_run(tmp_path):
    python = _project(tmp_path, STAND_IN)
    log = tmp_path / "log"
    done = subprocess.run(["make", "-j2", f"PYTHON={python}", ".venv/.installed-demo", ".venv/.installed"],
                          cwd=tmp_path, env={**os.environ, "LOG": str(log)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = log.read_text().splitlines()
    running = 0
    for line in lines:  # each install's start followed by its own end: never two installs at once
        if " install " in line:
            running += 1 if line.startswith("start") else -1
            assert running in (0, 1), lines
    # numba's kernels are compiled beside the suite's install, after numba's own install has ended
    kernels = "-m tf32lab.numbers.compiled"
    assert lines.index(f"start {kernels}") > next(i for i, line in enumerate(lines)
                                                  if line.startswith("end") and line.endswith("numba numpy")), lines
    assert lines.index(f"start {kernels}") < next(i for i, line in enumerate(lines)
                                                  if line.startswith("end") and ".[demo,serving,test]" in line), lines
    installs = [line for line in lines if line.startswith("start") and " install " in line and "-e" in line]
    assert any(".[demo,serving,test]" in line for line in installs), lines
    assert all((tmp_path / ".venv" / name).exists() for name in (".installed-demo", ".installed"))


# the stand-in, failing where $FAIL is in what it is asked to run (its end logged all the same)
FAILING = STAND_IN.replace('echo "end $*" >> "$LOG"\n', 'echo "end $*" >> "$LOG"\n'
                           'case "$*" in *"$FAIL"*) exit 3 ;; esac\n')


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.parametrize("fail", ["demo,serving,test", "numba numpy", "tf32lab.numbers.compiled"])
def test_only_the_suites_own_install_failing_fails_it(tmp_path, fail):
    # numba's install and the kernels' compile are best effort; pip's install of the suite's extras is not: its
    # failure is make's, with no stamp to say the venv is ready
    python = _project(tmp_path, FAILING)
    done = subprocess.run(["make", f"PYTHON={python}", ".venv/.installed"], cwd=tmp_path,
                          env={**os.environ, "LOG": str(tmp_path / "log"), "FAIL": fail}, capture_output=True,
                          text=True, timeout=60)
    suites = fail == "demo,serving,test"
    assert (done.returncode != 0) == suites, done.stdout + done.stderr
    assert (tmp_path / ".venv" / ".installed").exists() != suites
    assert ("not compiled ahead" in done.stdout) == (fail == "tf32lab.numbers.compiled"), done.stdout
