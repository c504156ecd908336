"""Whose exception it is when the model's code has no file of its own (``exec``, ``python -c``, ``<stdin>``,
IPython's cells), a lazy module met by the training check, and a failed level as ``tune`` shows it."""

from __future__ import annotations

import json

import pytest
import torch

from tf32lab import TrainingWorkload, Workload, check, check_training, tune

# a model typed at a prompt or built by exec: its frames' filename is a pseudo-file, not a path
SOURCE = """
import sys

import torch
import tf32lab


class Raises(torch.nn.Module):
    def __init__(self, raised):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.raised = raised

    def forward(self, x):
        y = self.lin(x)
        if tf32lab.get_float32_matmul_precision() != "highest":
            if self.raised is None:
                sys.exit(0)
            raise self.raised
        return y
"""


def typed_model(filename: str, raised=None) -> Workload:
    space: dict = {"__name__": "typed"}
    exec(compile(SOURCE, filename, "exec"), space)
    torch.manual_seed(0)
    return Workload(space["Raises"](raised), torch.randn(16, 8), name="typed")


@pytest.mark.parametrize("filename", ["<string>", "<stdin>", "<ipython-input-3-0f1e2d>", "<console>"])
@pytest.mark.parametrize("raised, error", [
    (None, "SystemExit: sys.exit(0) was called"),
    (RuntimeError("diverged"), "RuntimeError: diverged"),
    (ValueError("bad shape"), "ValueError: bad shape"),
], ids=["exit", "runtime", "value"])
def test_a_model_without_a_file_of_its_own_fails_its_level_not_tf32lab(filename, raised, error):
    report = check(typed_model(filename, raised), levels=("highest", "high"), speed=False)
    assert report.level("highest").passed
    assert report.level("high").error == error


def test_check_training_makes_a_lazy_module_with_buffers_once_and_leaves_the_model_unmade():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.LazyBatchNorm1d(), torch.nn.Linear(8, 4))
    data = [(torch.randn(16, 20), torch.randn(16, 4)) for _ in range(2)]
    workload = TrainingWorkload(model, data, loss=lambda out, batch: (out - batch[1]).pow(2).mean(),
                                inputs=lambda batch: batch[0], name="lazy")
    report = check_training(workload, levels=("highest", "high"), speed=False)
    assert [row.failure for row in report.levels] == [None, None]
    assert any("lazy module(s) '1' made once" in note for note in report.notes)
    # the caller's model is never run nor made: its lazy statistics are still unmade
    assert isinstance(model[1].running_mean, torch.nn.parameter.UninitializedBuffer)


def test_tune_names_what_the_model_raised_at_a_level_in_its_text_json_and_html():
    torch.manual_seed(0)
    tuning = tune(typed_model("models.py", SystemExit(0)), target="a100")
    high = next(c for c in tuning.candidates if "high" in c.why and "highest" not in c.why)
    assert high.error == "SystemExit: sys.exit(0) was called" and not high.passed
    row = next(line for line in tuning.lines(width=200) if "raised SystemExit: sys.exit(0) was called" in line)
    assert "FAILED" in row and "inf" not in row
    data = json.loads(tuning.to_json())
    assert {c["error"] for c in data["candidates"] if not c["passed"]} == {"SystemExit: sys.exit(0) was called"}
    assert all(c["error"] is None for c in data["candidates"] if c["passed"])
    assert "raised SystemExit: sys.exit(0) was called" in tuning.to_html()


def _counting() -> bool:
    """Whether tf32lab's speed count of a training step is running (its dispatch mode is on the stack)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(type(mode).__module__ == "tf32lab.speed.counting" for mode in _get_current_dispatch_mode_stack())


@pytest.mark.parametrize("raised, named", [(SystemExit(0), "SystemExit"), (ValueError("no count"), "ValueError")],
                         ids=["exit", "exception"])
def test_check_training_whose_speed_count_raises_drops_the_speed_as_for_any_exception(raised, named):
    # the count runs after every row: an exit there is no row's failure and, like any exception, no bad input
    torch.manual_seed(0)
    data = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(2)]

    def loss(out, batch):
        if _counting():
            raise raised
        return (out - batch[1]).pow(2).mean()

    workload = TrainingWorkload(torch.nn.Linear(8, 4), data, loss=loss, inputs=lambda b: b[0], name="counted")
    report = check_training(workload, levels=("highest", "high"), target="a100")
    assert all(row.failure is None and row.speedup is None for row in report.levels)
    assert any(note.startswith(f"no speed predicted: counting one training step raised {named}")
               for note in report.notes), report.notes
