"""The Makefile's installs: on a fresh machine one pip run when the tests are asked for, never two pip runs into one
venv at once (`make -j2 demo lint`), and the demo's own install where only the demo is asked for. A logging stand-in
for python (and the tools in the venv) records what make runs, so nothing is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FAKE = """#!/bin/sh
echo "$(basename "$0") $*" >> {log}
case "$*" in *"-m venv"*) mkdir -p .venv;; esac
sleep 0.2
"""

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _make(tmp_path: Path, *goals: str, jobs: int = 2) -> list[str]:
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        if not (tmp_path / name).exists():  # copied once: a newer pyproject.toml would ask for the installs again
            shutil.copy(ROOT / name, tmp_path / name)
    bin_ = tmp_path / "fake"
    bin_.mkdir(exist_ok=True)
    log = tmp_path / "log"
    log.write_text("")
    for tool in ("python", "ruff", "tf32lab"):
        (bin_ / tool).write_text(FAKE.format(log=log))
        (bin_ / tool).chmod(0o755)
    subprocess.run(["make", "-s", f"-j{jobs}", f"PYTHON={bin_ / 'python'}", f"BIN={bin_}", *goals], cwd=tmp_path,
                   capture_output=True, text=True, timeout=60)
    return log.read_text().splitlines()


def _installs(lines: list[str]) -> list[str]:
    return [line.split(" -e ")[-1] for line in lines if " -e " in line]


@pytest.mark.parametrize("goals", [("demo", "lint"), ("lint", "demo")])
def test_demo_and_the_tests_asked_together_install_once(tmp_path, goals):
    lines = _make(tmp_path, *goals)
    assert _installs(lines) == [".[demo,serving,test]"], lines
    assert sum("-m venv" in line for line in lines) == 1, lines


def test_the_demo_alone_installs_its_extra_only(tmp_path):
    lines = _make(tmp_path, "demo")
    assert _installs(lines) == [".[demo]"], lines
    then = _make(tmp_path, "lint")  # the tests after the demo: the extras added to the venv the demo made
    assert _installs(then) == [".[demo,serving,test]"] and not any("-m venv" in line for line in then), then
    assert _installs(_make(tmp_path, "demo", "lint")) == []  # both up to date
