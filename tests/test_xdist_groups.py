"""The suite's warning when `--dist loadgroup` loses the xdist_group marks (pytest-dev/pytest-xdist#1386), and the
suite run without pytest-xdist at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cli_runner
import xdist_groups

A, B = pytest.mark.xdist_group("a").mark, pytest.mark.xdist_group(name="b").mark


def test_a_grouped_id_is_not_reported():
    assert xdist_groups.ungrouped([("t.py::f@a", [A]), ("t.py::g", []), ("t.py::h@a_b", [B, A])]) == []


def test_a_lost_group_is_reported_though_a_parameter_has_an_at_sign():
    assert xdist_groups.ungrouped([("t.py::f[user@host]", [A]), ("t.py::g", [A])]) == ["t.py::f[user@host]", "t.py::g"]


def test_a_test_of_two_groups_needs_both_in_its_suffix():
    assert xdist_groups.ungrouped([("t.py::f@a", [A, B])]) == ["t.py::f@a"]
    assert xdist_groups.suffix([B, A, A]) == "@a_b"
    assert xdist_groups.suffix([pytest.mark.xdist_group.mark]) == "@default"


GROUPED = """
import pytest

@pytest.mark.xdist_group("a")
@pytest.mark.parametrize("x", ["user@host"])
def test_f(x):
    pass

@pytest.mark.xdist_group("a")
@pytest.mark.xdist_group("b")
def test_two():
    pass
"""

# pytest 9.2's structured ids, as far as pytest-xdist's grouping sees them: the "@group" suffix it appended is gone
AS_PYTEST_9_2 = """
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            item._nodeid = item._nodeid.rsplit("@", 1)[0]
"""


def test_the_suite_registers_the_warning(pytestconfig):
    found = pytestconfig.pluginmanager.hook.pytest_collection_modifyitems.get_hookimpls()
    assert xdist_groups.pytest_collection_modifyitems in [impl.function for impl in found]


@pytest.mark.parametrize("lost", [False, True])
def test_the_suites_warning_counts_each_lost_group(tmp_path, lost):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "as_pytest_9_2.py").write_text(AS_PYTEST_9_2)
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    # the suite's hook as a plugin, registered after the stand-in for pytest 9.2 so that its check runs after; the
    # rest of the suite's set-up (torch, tf32lab, hypothesis) is not this test's
    plugins = ["-p", "as_pytest_9_2"] if lost else []
    run = subprocess.run([sys.executable, "-m", "pytest", *plugins, "-p", "xdist_groups", "-p", "no:hypothesispytest",
                          "-n", "1", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q", "test_grouped.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout + run.stderr
    if lost:  # test_f's parameter has a "@" of its own, and is lost all the same
        assert "--dist loadgroup: 2 tests marked xdist_group" in run.stdout, run.stdout
    else:
        assert "--dist loadgroup" not in run.stdout, run.stdout


def test_the_suite_runs_without_pytest_xdist():
    root = Path(__file__).parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    # forked from the suite's CLI server (torch imported, as the suite's conftest imports it), as `python -m pytest`
    run = cli_runner.run("-p", "no:xdist", "-p", "no:cacheprovider", "-q", "tests/test_xdist_groups.py", "-k",
                         "suffix or reported", module="pytest", cwd=root, env=env, timeout=300)
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout + run.stderr
