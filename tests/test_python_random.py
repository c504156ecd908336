"""No import and no report moves the caller's Python ``random`` stream (rich draws from it when first imported)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import importlib, pkgutil, random, sys
    import tf32lab

    random.seed(7)
    before = random.getstate()
    moved = []
    skip = ("tf32lab.integrations",)  # optional frameworks: their own imports are theirs
    for info in pkgutil.walk_packages(tf32lab.__path__, "tf32lab."):
        if info.name.startswith(skip) or info.name == "tf32lab.__main__":
            continue
        importlib.import_module(info.name)
        if random.getstate() != before:
            moved.append(info.name)
            random.setstate(before)
    import torch
    report = tf32lab.check(tf32lab.Workload(torch.nn.Linear(4, 2), torch.ones(3, 4)), levels=("high",))
    import io
    from rich.console import Console
    report.print(Console(file=io.StringIO())), report.to_html()
    if random.getstate() != before:
        moved.append("check and its text and HTML")
    print(moved)
""")


def test_importing_and_reporting_leave_python_random_as_it_was():
    # a fresh interpreter: the first import of rich is what drew a number
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
