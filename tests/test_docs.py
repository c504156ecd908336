"""The examples in the docstrings and in README.md run and print what they say; the commands it shows exist."""

import ast
import doctest
import importlib
import os
import pkgutil
import re
import shlex
from pathlib import Path

import pytest

import cli_runner
import tf32lab

# every module of the package (a new one cannot be forgotten), but those with no public API to show: the command
# and the plugin (shown in README.md, run by their own tests), renderers of data types, the op rules, the exception
INTERNAL = {"tf32lab.__main__", "tf32lab.cli", "tf32lab.pytest_plugin", "tf32lab.report.doctor_text", "tf32lab.errors",
            "tf32lab.report.html", "tf32lab.report.text", "tf32lab.report.tune_html", "tf32lab.emulation.rules",
            "tf32lab.emulation.attention_rules", "tf32lab.emulation.registry"}
MODULES = ["tf32lab", *sorted(info.name for info in pkgutil.walk_packages(tf32lab.__path__, "tf32lab.")
                              if info.name not in INTERNAL)]


def _is_layer(module) -> bool:
    """A layer package (``tf32lab.control``, ...): its docstring says what the room holds; its modules have the API."""
    if module.__name__ == "tf32lab" or not hasattr(module, "__path__"):
        return False
    source = Path(module.__file__).read_text(encoding="utf-8")
    return all(isinstance(node, ast.Expr) for node in ast.parse(source).body)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    if _is_layer(module):
        assert module.__doc__ and not vars(module).get("__all__"), f"{name}: a layer package holds no code"
        return
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0


# -- README.md -------------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# Every ```python block runs; none is skipped. A block whose first line is "# NAME.py" is a file the reader writes.
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README, re.S | re.M)
SNIPPETS = [b for b in BLOCKS if not re.match(r"# \S+\.py\n", b)]
FILES = {b.split("\n", 1)[0][2:]: b for b in BLOCKS if re.match(r"# \S+\.py\n", b)}
# Commands shown as indented lines (4 spaces), e.g. "    tf32lab check mymodel.py:make --target a100".
COMMANDS = [line.split("  #")[0].strip() for line in re.findall(r"^    ((?:tf32lab|pytest) .*)$", README, re.M)]


def _cli(*args, cwd=None, timeout=300):
    return cli_runner.run(*args, cwd=cwd, timeout=timeout, env={**os.environ, "COLUMNS": "120", **_pythonpath()})


def _pythonpath():
    # The subprocess imports this checkout's tf32lab, whatever its working directory.
    return {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def _first_line(block):
    line = next(line for line in block.splitlines() if line and not line.startswith(("import", "from")))
    return line.split("#")[0].strip()[:40]


def test_the_readme_starts_with_the_two_commands():
    first = [line.split("#")[0].strip() for line in README.splitlines()[1:6] if line.strip()]
    assert first[:2] == ["make demo", "make test"]
    assert "FACTS" not in README and "../" not in README and "/work/" not in README


@pytest.mark.parametrize("block", SNIPPETS, ids=[_first_line(b) for b in SNIPPETS])
def test_readme_snippet_runs_as_written(block, tmp_path, monkeypatch, user_flags):
    monkeypatch.chdir(tmp_path)  # snippets write report.html, policy.json
    exec(compile(block, "README.md", "exec"), {"__name__": "readme"})


def test_readme_factory_file_runs_with_the_command_shown(tmp_path):
    (tmp_path / "mymodel.py").write_text(FILES["mymodel.py"])
    command = next(c for c in COMMANDS if c.startswith("tf32lab check mymodel.py:make"))
    done = _cli(*shlex.split(command)[1:], cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "PASSED | level 'high'" in done.stdout and (tmp_path / "report.html").stat().st_size > 0


def test_readme_test_file_passes_under_the_plugin_as_shown(tmp_path):
    (tmp_path / "test_numerics.py").write_text(FILES["test_numerics.py"])
    command = next(c for c in COMMANDS if c.startswith("pytest --tf32lab"))
    # `python -m pytest` in a process forked from the suite's CLI server (torch imported once)
    done = cli_runner.run("-p", "no:cacheprovider", *shlex.split(command)[1:], module="pytest", cwd=tmp_path,
                          timeout=300, env={**os.environ, **_pythonpath()})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout and "tf32lab: each test runs at precision 'high'" in done.stdout


def test_every_command_the_readme_shows_exists_with_its_options():
    shown = [c for c in COMMANDS if c.startswith("tf32lab ")] + re.findall(r"`(tf32lab [a-z][^`]*)`", README)
    assert len(shown) >= 6
    done = _cli("--help")
    assert done.returncode == 0
    listed = re.findall(r"^    ([a-z]+)\b", done.stdout, re.M)
    assert {"check", "tune", "speed", "policy", "doctor", "targets", "levels"} <= set(listed)
    for command in listed:  # every subcommand's own help answers
        assert _cli(command, "--help").returncode == 0, command
    helps: dict = {}
    for command in shown:
        words = shlex.split(command)[1:]
        path = [w for w in words[:2] if re.fullmatch(r"[a-z]+", w) and w != "SPEC"]
        if path[:1] != ["policy"]:
            path = path[:1]
        key = tuple(path)
        if key not in helps:
            done = _cli(*path, "--help")
            assert done.returncode == 0, f"{command!r}: {done.stderr}"
            helps[key] = done.stdout
        for option in (w.split("=")[0] for w in words if w.startswith("--")):
            assert option in helps[key], f"{command!r}: {option} is not an option of tf32lab {' '.join(path)}"


def _subparsers(parser):
    """``{"check": its parser, ..., "policy show": its parser}``: every command that runs, nested ones by their path."""
    import argparse
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = _subparsers(sub)
                found.update({f"{name} {k}": v for k, v in nested.items()} if nested else {name: sub})
    return found


def test_every_commands_heading_in_docs_cli_names_its_options():
    from tf32lab.cli import build_parser
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    headings = dict(re.findall(r"^## `tf32lab ((?:policy )?[a-z]+)\b([^`]*)`", text, re.M))
    commands = _subparsers(build_parser())
    assert set(commands) <= set(headings), f"docs/cli.md has no heading for {sorted(set(commands) - set(headings))}"
    for name, sub in commands.items():
        options = {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        shown = set(re.findall(r"--[a-z][a-z-]*", headings[name]))
        assert shown == options, f"docs/cli.md's heading of tf32lab {name}: {sorted(options - shown)} missing, " \
                                 f"{sorted(shown - options)} not options"
