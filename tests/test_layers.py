"""Imports point down the layers only: every ``import`` of tf32lab in the source, lazy ones inside functions and
those under ``if TYPE_CHECKING:`` included (read from the syntax tree, nothing imported).

Low to high: errors and settings (leaf modules), numbers, know, report, control, emulation, machine, workloads,
speed, measure, decide, then the faces (cli, pytest_plugin, testing, __main__) and the package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tf32lab"
ORDER = ["errors", "settings", "numbers", "know", "report", "control", "emulation", "machine", "workloads", "speed",
         "measure", "decide", "faces"]
RANK = {**{name: rank for rank, name in enumerate(ORDER)}, "settings": 0}  # the two leaves are one floor
FACES = {"cli", "pytest_plugin", "testing", "__main__"}
# Upward imports that are known and someone's to remove (speed/ still takes pieces of measure/check.py): this list
# only shrinks, and the last test fails when an entry is no longer true, so that it is removed here too.
KNOWN = {("tf32lab.speed.bench", "tf32lab.measure.check"), ("tf32lab.speed.predict", "tf32lab.measure.check")}


def _layer(module: str):
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package itself: the public face, above everything
    return "faces" if parts[1] in FACES else parts[1] if parts[1] in RANK else None


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tf32lab"):
            names = [f"tf32lab.{a.name}" for a in node.names] if node.module == "tf32lab" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("tf32lab")]
        else:
            continue
        found += [(node.lineno, name) for name in names]
    return found


def _upward() -> set[tuple[str, str, int]]:
    bad = set()
    for path in SRC.rglob("*.py"):
        module = ".".join(["tf32lab", *path.relative_to(SRC).with_suffix("").parts]).removesuffix(".__init__")
        own = _layer(module)
        if own is None:
            continue
        for line, name in _imports(path):
            other = _layer(name)
            if other is not None and RANK[other] > RANK[own]:
                bad.add((module, name, line))
    return bad


def test_nothing_imports_upward():
    bad = {(m, n, line) for m, n, line in _upward() if (m, n) not in KNOWN}
    assert not bad, "\n".join(f"{m}:{line} imports {n}, a layer above it" for m, n, line in sorted(bad))


def test_the_renderers_and_the_conclusion_import_nothing_above_report():
    # the circles that were: doctor -> doctor_text -> Diagnosis, tune -> tune_html -> Tuning, conclusion -> speed
    for name in ("doctor_text", "tune_html", "conclusion", "html", "text", "__init__"):
        for line, imported in _imports(SRC / "report" / f"{name}.py"):
            assert _layer(imported) in ("errors", "settings", "numbers", "know", "report"), (name, line, imported)


def test_the_known_upward_imports_are_still_there():
    assert {(m, n) for m, n, _ in _upward()} >= KNOWN, "one was removed: take it off KNOWN"
