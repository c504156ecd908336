"""The Python versions pyproject.toml promises. Only the machine's Python (3.11) runs the suite; the older ones
are checked without an interpreter: vermin finds the oldest version each construct and standard-library name needs
(annotations included), and ruff lints for ruff's target version (pyproject.toml)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _declared_minimum() -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    return re.search(r'requires-python = ">=(\d+\.\d+)"', text).group(1)


def test_the_code_needs_no_python_newer_than_requires_python_says():
    minimum = _declared_minimum()
    vermin = "import sys, vermin; sys.exit(vermin.main())"
    done = subprocess.run(
        [sys.executable, "-c", vermin, "--no-tips", "--eval-annotations", f"--target={minimum}-", "--violations",
         "src/tf32lab", "scripts", "benchmarks", "examples", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"Minimum required versions: {minimum}" in done.stdout


def test_ruff_lints_for_the_same_python():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    target = re.search(r'target-version = "py(\d)(\d+)"', text)
    assert f"{target.group(1)}.{target.group(2)}" == _declared_minimum()
