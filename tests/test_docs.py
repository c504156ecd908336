"""The examples in the docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = [
    "tf32lab", "tf32lab.formats", "tf32lab.flags", "tf32lab.levels", "tf32lab.families", "tf32lab.scope",
    "tf32lab.targets", "tf32lab.emulator", "tf32lab.samples", "tf32lab.trees", "tf32lab.workload", "tf32lab.builtin",
    "tf32lab.metrics", "tf32lab.compare", "tf32lab.report", "tf32lab.hardware", "tf32lab.heuristics",
    "tf32lab.diagnosis", "tf32lab.specs", "tf32lab.optable", "tf32lab.modestack", "tf32lab.compile_cache",
    "tf32lab.reference", "tf32lab.report.conclusion", "tf32lab.files", "tf32lab.policy", "tf32lab.counting",
    "tf32lab.speed", "tf32lab.timing", "tf32lab.peaks", "tf32lab.tuning", "tf32lab.testing",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
