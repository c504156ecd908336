"""The HTML report in a real browser (headless Chromium): it renders offline, without console errors, with its
plots, and every name from the model shows as text."""

from __future__ import annotations

import re

import torch
from torch import nn

import tf32lab
from browser import visit
from tf32lab import Workload
from tf32lab.workloads import builtin

XSS = "<script>alert(1)</script>"
XSS_OUTPUT = "<img src=x onerror=alert(2)>"


class _Hostile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module(XSS, nn.Linear(64, 64))
        self.add_module("plain", nn.Linear(64, 8))

    def forward(self, x):
        hidden = getattr(self, XSS)(x)
        return {XSS_OUTPUT: self.plain(hidden), "logits": hidden}


def test_report_opens_in_chromium_with_its_plots(tmp_path):
    report = tf32lab.check(builtin.small())
    page = report.save_html(tmp_path / "report.html")
    seen = visit(page, tmp_path / "report.png")
    assert seen.console_errors == [] and seen.dialogs == []
    assert seen.requests == []  # self-contained: nothing fetched
    assert seen.svg_count >= 3  # the layer chart and one distribution per output
    assert "Error per layer" in seen.text and "text.encoder.layers.0.self_attn" in seen.text
    assert (tmp_path / "report.png").stat().st_size > 20_000


def test_names_from_the_model_are_text_not_markup(tmp_path):
    report = tf32lab.check(Workload(_Hostile(), torch.randn(4, 64), name=f"hostile {XSS}"), levels=("high",))
    html = report.to_html()
    assert XSS not in html and XSS_OUTPUT not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    seen = visit(report.save_html(tmp_path / "hostile.html"), tmp_path / "hostile.png")
    assert seen.dialogs == [] and seen.console_errors == [] and seen.requests == []
    assert XSS in seen.text and XSS_OUTPUT in seen.text  # shown to the reader, as text
    conclusion = re.search(r'<div class="conclusion">(.*?)</div>', html, re.S).group(1)
    assert "`" not in conclusion and "<code>" in conclusion  # the advice's code set as code, not in backticks
    fragment = report._repr_html_()  # Jupyter
    assert "<html" not in fragment and "&lt;script&gt;" in fragment and XSS not in fragment


def test_the_tune_page_fits_its_axis_to_the_search_and_does_not_call_it_failed():
    import math
    from pathlib import Path

    from tf32lab.report.tune_html import scatter
    from tf32lab.workloads import specs

    net = specs.load(f"{Path(__file__).resolve().parents[1] / 'examples' / 'tune' / 'model.py'}:make")
    tuning = tf32lab.tune(net, target="a100")
    assert tuning.passed and not tuning.report.level("high").passed  # found, though a uniform level fails
    ratios = [c.worst_ratio for c in tuning.candidates if math.isfinite(c.worst_ratio) and c.worst_ratio > 0]
    lo, hi = scatter(tuning)["decades"]
    assert lo == min(-1, math.floor(math.log10(min(ratios)))) and hi == max(1, math.ceil(math.log10(max(ratios))))
    labels = [t["label"] for t in scatter(tuning)["yticks"]]
    assert "1e-4" not in labels or min(ratios) < 1e-3
    page = tuning.to_html()
    assert "FOUND" in page and 'class="failed">FAILED</span></h1>' not in page
    # its code spans as code, no raw markdown
    assert "the uniform levels the search started from (<code>highest</code> passes, <code>high</code> fails" in page


def test_the_training_report_opens_in_chromium_with_its_charts(tmp_path):
    from test_training import kernel_workload

    report = tf32lab.check_training(kernel_workload(name=f"kernel {XSS}"), levels=("highest", "high"))
    seen = visit(report.save_html(tmp_path / "training.html"), tmp_path / "training.png")
    assert seen.console_errors == [] and seen.dialogs == [] and seen.requests == []
    assert seen.svg_count == 1  # the loss paths (the model has no module with parameters but itself)
    assert "fails at step 3 on a100: LinAlgError" in seen.text and XSS in seen.text
    assert "Loss path: deviation from float64 per step" in seen.text


def test_the_layer_chart_calls_a_given_tolerance_the_tolerance_not_the_default():
    torch.manual_seed(0)
    workload = Workload(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)), torch.randn(8, 32))
    given = " ".join(tf32lab.check(workload, levels=("high",), tolerance=2.5e-4, speed=False).to_html().split())
    assert "The red line is the tolerance 2.5e-04: an output past it fails." in given
    assert "default tolerance" not in given  # the header says "tolerance 2.5e-04" too
    default = " ".join(tf32lab.check(workload, levels=("high",), speed=False).to_html().split())
    assert "The red line is the default tolerance 1e-02: an output past it fails." in default
