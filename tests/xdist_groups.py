"""Which tests pytest-xdist's ``--dist loadgroup`` failed to group: it marks a test of ``xdist_group("name")`` by
appending ``@name`` to its id (``@a_b`` for two groups, sorted and joined), and pytest 9.2's structured ids drop
that suffix, spreading each group over the workers without a word (pytest-dev/pytest-xdist#1386)."""

from __future__ import annotations

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
