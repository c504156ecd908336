"""Whose exception it is when the model's code has no file of its own (``exec``, ``python -c``, ``<stdin>``,
IPython's cells), a lazy module met by the training check, and a failed level as ``tune`` shows it."""

from __future__ import annotations

import pytest
import torch

from tf32lab import Workload, check

# a model typed at a prompt or built by exec: its frames' filename is a pseudo-file, not a path
SOURCE = """
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
