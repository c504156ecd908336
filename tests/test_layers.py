"""Imports point down the layers only, and no module needs itself back through others (no circle, also between
modules of one layer): every ``import`` of tf32lab in the source, lazy ones inside functions and those under
``if TYPE_CHECKING:`` included (read from the syntax tree, nothing imported).

Low to high: errors and settings (leaf modules), numbers, know, report, control, emulation, machine, workloads,
speed, measure, decide, then the faces (cli, pytest_plugin, testing, __main__), the integrations (a framework's
training loop adapted to a workload: nothing of tf32lab imports them) and the package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tf32lab"
ORDER = ["errors", "settings", "numbers", "know", "report", "control", "emulation", "machine", "workloads", "speed",
         "measure", "decide", "faces", "integrations"]
RANK = {**{name: rank for rank, name in enumerate(ORDER)}, "settings": 0}  # the two leaves are one floor
FACES = {"cli", "pytest_plugin", "testing", "__main__"}


def _layer(module: str):
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package itself: the public face, above everything
    return "faces" if parts[1] in FACES else parts[1] if parts[1] in RANK else None


def _imports(path: Path, src: Path = SRC) -> list[tuple[int, str]]:
    """``(line, module)`` of each tf32lab import in ``path`` (a package ``src``'s file), wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tf32lab"):
            names = [_module_of(f"{node.module}.{a.name}", src) for a in node.names]
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


def _module_of(name: str, src: Path = SRC) -> str:
    """``tf32lab.control.flags`` for ``from tf32lab.control import flags``: the module, where a name is one."""
    path = src.parent.joinpath(*name.split("."))
    return name if path.with_suffix(".py").exists() or (path / "__init__.py").exists() else name.rpartition(".")[0]


def _modules(src: Path = SRC) -> dict[str, Path]:
    return {".".join(["tf32lab", *p.relative_to(src).with_suffix("").parts]).removesuffix(".__init__"): p
            for p in src.rglob("*.py")}


def _circle(src: Path = SRC) -> list[str]:
    """The first import circle found among the modules under ``src`` (``[a, b, a]``), or ``[]``: every import
    counts, at import time, inside a function or under ``TYPE_CHECKING`` (a circle there is one a type checker
    walks, and the sign of two modules that are one idea or of a type that belongs lower)."""
    modules = _modules(src)
    edges = {m: sorted({n for _, n in _imports(p, src)} & modules.keys() - {m}) for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str]:
        state[module] = 1
        for other in edges[module]:
            if state.get(other) == 1:  # the circle: from ``other``'s place on the path back to it
                walked = [*path, module]
                return [*walked[walked.index(other):], other]
            if other not in state and (found := visit(other, [*path, module])):
                return found
        state[module] = 2
        return []

    for module in sorted(modules):
        if module not in state and (found := visit(module, [])):
            return found
    return []


def test_nothing_imports_upward():
    bad = _upward()
    assert not bad, "\n".join(f"{m}:{line} imports {n}, a layer above it" for m, n, line in sorted(bad))


def test_the_renderers_and_the_conclusion_import_nothing_above_report():
    # the circles that were: doctor -> doctor_text -> Diagnosis, tune -> tune_html -> Tuning, conclusion -> speed
    for name in ("doctor_text", "tune_html", "conclusion", "html", "text", "__init__"):
        for line, imported in _imports(SRC / "report" / f"{name}.py"):
            assert _layer(imported) in ("errors", "settings", "numbers", "know", "report"), (name, line, imported)


def test_no_import_circles():
    # a renderer names its room's data class (report.text's Report) rather than importing it, even for type checking
    circle = _circle()
    assert not circle, "import circle: " + " -> ".join(circle)


def test_a_circle_among_report_modules_is_found(tmp_path):
    # the check itself can fail: a data module that renders itself lazily, and a renderer that imports it back only
    # for type checking (as report/training.py and report/training_render.py once did), is a circle
    report = tmp_path / "tf32lab" / "report"
    report.mkdir(parents=True)
    for name in ("tf32lab/__init__.py", "tf32lab/report/__init__.py", "tf32lab/report/wording.py"):
        (tmp_path / name).write_text("")
    (report / "training.py").write_text(
        "from tf32lab.report.wording import *\n\n\ndef html(report):\n"
        "    from tf32lab.report.training_render import render\n\n    return render(report)\n")
    (report / "training_render.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from tf32lab.report.training import Report\n")
    assert _circle(tmp_path / "tf32lab") == ["tf32lab.report.training", "tf32lab.report.training_render",
                                             "tf32lab.report.training"]
    (report / "training_render.py").write_text("Report = object\n")
    assert _circle(tmp_path / "tf32lab") == []


def test_the_layers_are_the_folders():
    # every module lives in a layer (or is a face, a leaf or the package): a new folder must be placed in ORDER
    for module in _modules():
        assert module == "tf32lab" or _layer(module) is not None, f"{module}: in no layer of ORDER"


def test_every_module_over_700_lines_is_argued_in_the_design():
    # a module is one idea; one past 700 lines says why in docs/design.md ("Modules over 700 lines"), or splits
    design = (SRC.parents[1] / "docs" / "design.md").read_text(encoding="utf-8")
    section = design.split("### Modules over 700 lines", 1)[1].split("\n## ", 1)[0]
    long = {str(path.relative_to(SRC)): len(path.read_text(encoding="utf-8").splitlines())
            for path in SRC.rglob("*.py")}
    unargued = {name: lines for name, lines in long.items() if lines > 700 and f"**`{name}` (" not in section}
    assert not unargued, f"modules over 700 lines not argued in docs/design.md: {unargued}"
