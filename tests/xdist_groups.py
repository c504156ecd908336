"""Which tests pytest-xdist's ``--dist loadgroup`` failed to group: it marks a test of ``xdist_group("name")`` by
appending ``@name`` to its id (``@a_b`` for two groups, sorted and joined), and pytest 9.2's structured ids drop
that suffix, spreading each group over the workers without a word (pytest-dev/pytest-xdist#1386).

A plugin of its own (the suite's conftest imports its hook), so that a pytest can run it without the suite's
imports (torch, tf32lab)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import pytest


def suffix(marks: Iterable[pytest.Mark]) -> str:
    """The suffix pytest-xdist 3.8 appends for these ``xdist_group`` marks ("" for none), as it builds it."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
    return "@" + "_".join(sorted(names)) if names else ""


def ungrouped(tests: Iterable[tuple[str, Iterable[pytest.Mark]]]) -> list[str]:
    """The ids, of (id, its xdist_group marks) pairs, that lack the suffix their marks call for; a "@" elsewhere
    in an id (a parameter's) is no suffix."""
    lost = []
    for nodeid, marks in tests:
        end = suffix(marks)
        if end and not nodeid.endswith(end):
            lost.append(nodeid)
    return lost


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest-xdist marks a grouped test by appending "@group" to its id; pytest 9.2 ignores that (its ids are
    # structured), and the groups are then spread over the workers without a word (pytest-dev/pytest-xdist#1386).
    # Only a worker of `--dist loadgroup` has the option set; the suffix checked is the one xdist builds, so a "@"
    # in a parameter's id does not hide a lost group.
    if not getattr(config.option, "loadgroup", False):
        return
    lost = ungrouped((item.nodeid, item.iter_markers("xdist_group")) for item in items)
    if lost:
        warnings.warn(pytest.PytestWarning(
            f"--dist loadgroup: {len(lost)} tests marked xdist_group (e.g. {lost[0]}) are not grouped by this "
            f"pytest {pytest.__version__} and pytest-xdist: constraints.txt keeps pytest below 9.2"), stacklevel=1)
