"""Imports point down the layers only: every ``import`` of tf32lab in the source, lazy ones inside functions and
those under ``if TYPE_CHECKING:`` included (read from the syntax tree, nothing imported).

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


def _imports(path: Path, typing: bool = True) -> list[tuple[int, str]]:
    """``(line, module)`` of each tf32lab import in ``path``; ``typing=False``: those under ``if TYPE_CHECKING:`` left
    out (they never run)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = set()
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(inner) for inner in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tf32lab"):
            names = [_module_of(f"{node.module}.{a.name}") for a in node.names]
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


def _module_of(name: str) -> str:
    """``tf32lab.control.flags`` for ``from tf32lab.control import flags``: the module, where a name is one."""
    path = SRC.parent.joinpath(*name.split("."))
    return name if path.with_suffix(".py").exists() or (path / "__init__.py").exists() else name.rpartition(".")[0]


def _modules() -> dict[str, Path]:
    return {".".join(["tf32lab", *p.relative_to(SRC).with_suffix("").parts]).removesuffix(".__init__"): p
            for p in SRC.rglob("*.py")}


def test_nothing_imports_upward():
    bad = _upward()
    assert not bad, "\n".join(f"{m}:{line} imports {n}, a layer above it" for m, n, line in sorted(bad))


def test_the_renderers_and_the_conclusion_import_nothing_above_report():
    # the circles that were: doctor -> doctor_text -> Diagnosis, tune -> tune_html -> Tuning, conclusion -> speed
    for name in ("doctor_text", "tune_html", "conclusion", "html", "text", "__init__"):
        for line, imported in _imports(SRC / "report" / f"{name}.py"):
            assert _layer(imported) in ("errors", "settings", "numbers", "know", "report"), (name, line, imported)


def test_no_import_circles():
    # imports that run (at import time or inside a function): a module never needs itself back through others;
    # a renderer may name its own room's data class under TYPE_CHECKING (report.text -> report), which never runs
    modules = _modules()
    edges = {m: {n for _, n in _imports(p, typing=False) if n in modules and n != m} for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(edges[module]):
            assert state.get(other) != 1, "import circle: " + " -> ".join([*path, module, other])
            if other not in state:
                visit(other, [*path, module])
        state[module] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module, [])


def test_the_layers_are_the_folders():
    # every module lives in a layer (or is a face, a leaf or the package): a new folder must be placed in ORDER
    for module in _modules():
        assert module == "tf32lab" or _layer(module) is not None, f"{module}: in no layer of ORDER"
