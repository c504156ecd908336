"""The terminal report: layer names as wide as the terminal allows, cut from the left only when they must be."""

from __future__ import annotations

import io

import torch
from rich.console import Console

import tf32lab


def _deep_model() -> torch.nn.Module:
    # names like a transformer's: encoder.layer.0.attention.self_attention_block.output_projection.dense
    leaf = torch.nn.Sequential()
    leaf.add_module("dense", torch.nn.Linear(32, 32))
    block = torch.nn.Sequential()
    block.add_module("output_projection", leaf)
    attention = torch.nn.Sequential()
    attention.add_module("self_attention_block", block)
    layer = torch.nn.Sequential()
    layer.add_module("attention", attention)
    stack = torch.nn.Sequential()
    stack.add_module("0", layer)
    encoder = torch.nn.Sequential()
    encoder.add_module("layer", stack)
    model = torch.nn.Sequential()
    model.add_module("encoder", encoder)
    return model


def _printed(report: tf32lab.Report, width: int) -> str:
    out = io.StringIO()
    report.print(Console(file=out, width=width, highlight=False))
    return out.getvalue()


def test_layer_names_fill_the_terminal_and_are_cut_from_the_left_only_when_needed():
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_deep_model(), torch.randn(8, 32), name="deep"),
                           levels=("highest", "high"), target="a100")
    full = "encoder.layer.0.attention.self_attention_block.output_projection.dense"
    assert full in _printed(report, 160)
    narrow = _printed(report, 80)
    assert full not in narrow and "…" in narrow and "output_projection.dense" in narrow
    assert max(len(line) for line in narrow.splitlines() if "│" in line) <= 80


def test_a_reports_repr_is_one_line_with_each_rows_verdict():
    # a dataclass's own repr printed every output's and layer's errors: thousands of lines in a notebook
    torch.manual_seed(0)
    workload = tf32lab.Workload(_deep_model(), torch.randn(8, 32), name="deep")
    failing = tf32lab.check(workload, levels=("highest", "high"), tolerance=1e-5)
    assert repr(failing) == "<Report 'deep' on a100: FAILED (highest passed, high FAILED)>"
    data = [(torch.ones(4, 3), torch.zeros(4, 1))] * 2
    training = tf32lab.check_training(
        tf32lab.TrainingWorkload(torch.nn.Linear(3, 1), data, inputs=lambda b: b[0], name="fit",
                                 loss=lambda o, b: (o - b[1]).pow(2).mean()), levels=("high",), target="h100")
    assert repr(training) == "<TrainingReport 'fit' on h100: PASSED (high passed)>"
