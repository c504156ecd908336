"""The ``TF32LAB_*`` environment variables: one table (``tf32lab.settings``), read through the real environment.

Each setting is set with ``monkeypatch.setenv`` and seen where it acts (autoconfig, check's spill, the pytest plugin,
a scope in a fresh process); the docs' list is the table's; no other module reads a ``TF32LAB_*`` variable itself.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
import torch

import cli_runner
import inner_pytest
import tf32lab
from tf32lab import settings
from tf32lab.control import flags
from tf32lab.errors import Tf32LabError
from tf32lab.machine.hardware import Hardware
from tf32lab.measure.spill import min_bytes_from_env
from tf32lab.workloads import builtin

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tf32lab"
JUNK = {"TF32LAB_DISABLE": "maybe", "TF32LAB_SCOPE_GUARD": "sometimes", "TF32LAB_SPILL_MIB": "lots",
        "TF32LAB_ACCUMULATION": "exact"}


# -- the table and the accessor ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(settings.SETTINGS))
def test_unset_empty_or_blank_is_the_default(monkeypatch, name):
    monkeypatch.delenv(name, raising=False)
    default = settings.SETTINGS[name].default
    assert settings.get(name) == default
    for blank in ("", "   "):
        monkeypatch.setenv(name, blank)
        assert settings.get(name) == default


@pytest.mark.parametrize("name, junk", list(JUNK.items()))
def test_a_value_not_understood_is_one_line_naming_the_variable_the_value_and_what_is_accepted(monkeypatch, name, junk):
    monkeypatch.setenv(name, f" {junk} ")
    with pytest.raises(Tf32LabError) as caught:
        settings.get(name)
    message = str(caught.value)
    assert message == f"{name}={' ' + junk + ' '!r} is not understood; accepted: {settings.SETTINGS[name].accepted}"
    assert "\n" not in message


def test_every_setting_but_the_plugins_free_text_refuses_junk():
    # TF32LAB_PYTEST is TARGET[:LEVEL], which only the plugin (above the targets) can check: tested below
    assert set(JUNK) == set(settings.SETTINGS) - {"TF32LAB_PYTEST"}


def test_the_accessor_reads_the_environment_at_each_call(monkeypatch):
    monkeypatch.setenv("TF32LAB_SPILL_MIB", "8")
    assert settings.get("TF32LAB_SPILL_MIB") == 8.0
    monkeypatch.setenv("TF32LAB_SPILL_MIB", "0.5")
    assert settings.get("TF32LAB_SPILL_MIB") == 0.5 and min_bytes_from_env() == 1 << 19


@pytest.mark.parametrize("raw, expected", [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                                           ("0", False), ("False", False), ("no", False), ("off", False)])
def test_the_kill_switch_reads_both_ways(monkeypatch, raw, expected):
    monkeypatch.setenv("TF32LAB_DISABLE", raw)
    assert settings.get("TF32LAB_DISABLE") is expected


def test_an_unknown_name_is_a_key_error():
    with pytest.raises(KeyError):
        settings.get("TF32LAB_NOPE")


# -- where each acts ---------------------------------------------------------------------------------------------
def test_disable_makes_autoconfig_change_nothing(monkeypatch, caplog):
    monkeypatch.setenv("TF32LAB_DISABLE", "1")
    before, threads = flags.snapshot(), torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="tf32lab.autoconfig"):
        decisions = tf32lab.autoconfig("high", threads=threads + 1)
    assert decisions.disabled and len(decisions) == 0
    assert flags.snapshot() == before and torch.get_num_threads() == threads
    assert "TF32LAB_DISABLE is on" in caplog.text


def test_disable_off_lets_autoconfig_work(monkeypatch):
    monkeypatch.setenv("TF32LAB_DISABLE", "off")
    threads = torch.get_num_threads()
    decisions = tf32lab.autoconfig(threads=threads + 1, hardware=Hardware.simulated("a100", cpus=threads + 1))
    try:
        assert not decisions.disabled and torch.get_num_threads() == threads + 1
    finally:
        decisions.undo()
    assert torch.get_num_threads() == threads


def test_a_kill_switch_that_cannot_be_read_is_an_error_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("TF32LAB_DISABLE", "y")
    before, threads = flags.snapshot(), torch.get_num_threads()
    with pytest.raises(Tf32LabError, match=r"^TF32LAB_DISABLE='y' is not understood; accepted: 1, true, yes, on"):
        tf32lab.autoconfig("high", threads=threads + 1)
    assert flags.snapshot() == before and torch.get_num_threads() == threads


def test_a_bad_spill_size_stops_check_before_it_runs_with_a_clear_error(monkeypatch):
    monkeypatch.setenv("TF32LAB_SPILL_MIB", "-1")
    with pytest.raises(Tf32LabError, match=r"^TF32LAB_SPILL_MIB='-1' is not understood; accepted: a finite number "
                                           r"of MiB >= 0 \(0: never write out\)$"):
        tf32lab.check(builtin.small(), levels=("high",))


def test_a_bad_scope_guard_is_said_by_the_first_scope_in_a_fresh_process(tmp_path):
    code = ("import tf32lab\ntry:\n    tf32lab.precision('high').__enter__()\n"
            "except tf32lab.Tf32LabError as exc:\n    print(exc)")
    # a process forked from the suite's CLI server, where no scope was ever entered (the guard is read at the first)
    (tmp_path / "first_scope.py").write_text(code)
    done = cli_runner.run(module="first_scope", cwd=tmp_path, timeout=120,
                          env={**os.environ, "TF32LAB_SCOPE_GUARD": "Never", "PYTHONPATH": str(ROOT / "src")})
    assert done.stdout.strip() == "TF32LAB_SCOPE_GUARD='Never' is not understood; accepted: 'auto', 'always'"


PLUGIN_SUITE = """
import tf32lab

def test_level(tf32lab_level):
    print("LEVEL", tf32lab_level)
"""


def test_a_blank_plugin_variable_is_unset_and_a_set_one_turns_the_plugin_on(pytester, monkeypatch):
    pytester.makepyfile(test_suite=PLUGIN_SUITE)
    monkeypatch.setenv("TF32LAB_PYTEST", "   ")
    result = inner_pytest.run(pytester, "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*LEVEL None*"])
    monkeypatch.setenv("TF32LAB_PYTEST", " A100:Medium ")
    result = inner_pytest.run(pytester, "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*precision 'medium' as a100 computes them*", "*LEVEL medium*"])


pytest_plugins = ["pytester"]


# -- one list, one reader ----------------------------------------------------------------------------------------
def test_the_docs_list_is_the_table():
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    listed = re.search(r"<!-- settings: generated by tf32lab.settings.markdown\(\) -->\n(.*?)<!-- end of settings -->",
                       text, re.S)
    assert listed is not None and listed.group(1) == settings.markdown(), \
        "docs/cli.md: paste tf32lab.settings.markdown() between the settings markers"


def test_every_variable_named_anywhere_is_in_the_table():
    texts = [p.read_text(encoding="utf-8") for p in [*SRC.rglob("*.py"), ROOT / "README.md", *ROOT.glob("docs/*.md")]]
    named = set(re.findall(r"\bTF32LAB_[A-Z0-9_]+", "\n".join(texts)))
    assert named == set(settings.SETTINGS), named ^ set(settings.SETTINGS)


def test_no_module_but_settings_reads_a_tf32lab_variable_itself():
    for path in SRC.rglob("*.py"):
        if path.name == "settings.py" and path.parent == SRC:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\benviron\s*(?:\.get\s*\(|\[)|getenv\s*\(", line):  # a read, not a word in a docstring
                assert "TF32LAB_" not in line and "ENV" not in line, f"{path.relative_to(ROOT)}:{number}: {line}"


def test_settings_imports_nothing_of_tf32lab_but_errors():
    source = (SRC / "settings.py").read_text(encoding="utf-8")
    assert set(re.findall(r"^\s*(?:from|import) (tf32lab\S*)", source, re.M)) == {"tf32lab.errors"}
