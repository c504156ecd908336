"""``torch.backends.cudnn.enabled = False``: a GPU then runs convolutions and RNNs outside cuDNN, as cuBLAS GEMMs
under the matmul flag (a depthwise convolution in PyTorch's own kernel), so the level sets their math. The emulator
computes them so, and a check's report says so instead of naming cuDNN's flag."""

from __future__ import annotations

import json

import jsonschema
import torch
import torch.nn.functional as F
from torch import nn

import tf32lab
from depthwise_stack import DepthwiseStack
from emulation_reference import randn
from tf32lab.decide.conv_maths import conv_matters
from tf32lab.know.targets import get
from tf32lab.numbers import formats
from tf32lab.report import schema


def _conv_at(level: str, conv: nn.Module, x: torch.Tensor, enabled: bool):
    with torch.backends.cudnn.flags(enabled=enabled), tf32lab.precision(level), \
            tf32lab.emulate("a100") as emu, torch.no_grad():
        out = conv(x)
    return out, {math for (op, math) in emu.coverage if "convolution" in op}


def test_a_convolution_without_cudnn_runs_at_the_levels_math():
    torch.manual_seed(0)
    conv, x = nn.Conv2d(4, 6, 3), randn(2, 4, 9, 9, seed=1)
    native = conv(x).detach()
    tf32 = F.conv2d(formats.round_tf32(x), formats.round_tf32(conv.weight.detach()), conv.bias.detach())
    highest, maths = _conv_at("highest", conv, x, enabled=False)
    assert torch.equal(highest, native) and maths == {"ieee"}  # cuBLAS at `highest`: IEEE
    high, maths = _conv_at("high", conv, x, enabled=False)
    assert torch.equal(high, tf32) and maths == {"tf32-rna"}
    with_cudnn, maths = _conv_at("highest", conv, x, enabled=True)  # cuDNN's flag: TF32 at every level
    assert torch.equal(with_cudnn, tf32) and maths == {"tf32-rna"}
    assert torch.backends.cudnn.enabled


def test_a_channels_last_depthwise_convolution_without_cudnn_runs_in_its_own_kernel():
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 5, padding=2, groups=8).to(memory_format=torch.channels_last)
    x = randn(2, 8, 12, 12, seed=2).contiguous(memory_format=torch.channels_last)
    _, on = _conv_at("high", conv, x, enabled=True)  # channels-last: cuDNN takes it, at its flag
    _, off = _conv_at("high", conv, x, enabled=False)
    assert on == {"tf32-rna"} and off == {"ieee"}


def test_an_lstm_without_cudnn_runs_at_the_levels_math():
    torch.manual_seed(0)
    lstm, x = nn.LSTM(6, 8), randn(5, 2, 6, seed=3)
    maths = {}
    for enabled in (True, False):
        with torch.backends.cudnn.flags(enabled=enabled), tf32lab.precision("highest"), \
                tf32lab.emulate("a100") as emu, torch.no_grad():
            lstm(x)
        maths[enabled] = {math for _, math in emu.coverage}
    assert maths == {True: {"tf32-rna"}, False: {"ieee"}}


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def test_a_check_without_cudnn_says_the_level_sets_the_convolutions_math():
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Convs().eval(), torch.randn(8, 16, 24, 24), name="convs")
    with torch.backends.cudnn.flags(enabled=False):
        report = tf32lab.check(workload, levels=("highest", "high"))
    assert torch.backends.cudnn.enabled  # the user's setting, as it was
    (conv,) = report.cudnn
    assert conv.flag == "off" and conv.maths == {"highest": "ieee", "high": "tf32-rna"}
    said = next(line for line in report.conclusion() if line.startswith("Convolutions ran"))
    assert said.startswith("Convolutions ran IEEE float32 at `highest`, TF32 at `high`: cuDNN is off "
                           "(`torch.backends.cudnn.enabled = False`)"), said
    assert "--conv ieee" not in said and "cuDNN's own flag" not in " ".join(report.conclusion())
    # the speed model times them as a GPU runs them without cuDNN (speed.unfolded_conv): an im2col and a GEMM per
    # sample, far slower than cuDNN's one kernel for the batch; at this size the launches leave TF32 nothing to gain
    with_cudnn = tf32lab.check(workload, levels=("highest", "high"))
    assert report.speed.level("highest").seconds > 3 * with_cudnn.speed.level("highest").seconds
    assert report.level("high").speedup < 1.05
    page = report.to_html()
    assert "<h3>Convolutions and RNNs: cuDNN is off, so the level sets their math</h3>" in page
    assert "<code>torch.backends.cudnn.enabled = False</code>" in page
    jsonschema.validate(json.loads(report.to_json()), schema())


def test_a_tune_does_not_weigh_the_conv_flag_where_cudnn_is_off():
    conv = nn.Conv1d(2, 2, 3)
    assert conv_matters(conv, get("a100"))
    with torch.backends.cudnn.flags(enabled=False):
        assert not conv_matters(conv, get("a100"))


def test_conv_asked_for_where_cudnn_is_off_is_not_said_to_have_set_the_convolutions():
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Convs().eval(), torch.randn(4, 16, 12, 12), name="convs")
    with torch.backends.cudnn.flags(enabled=False):
        report = tf32lab.check(workload, levels=("highest", "high"), conv="ieee", speed=False)
    assert report.cudnn[0].maths == {"highest": "ieee", "high": "tf32-rna"}  # the level's, not conv='ieee'
    (note,) = [n for n in report.notes if "conv=" in n or "cudnn.conv" in n]
    assert "ran at cudnn.conv" not in note and "cuDNN is off" in note, note


def test_a_prediction_under_a_conv_math_where_cudnn_is_off_gives_that_flag_no_gain():
    from tf32lab.speed.prediction import predict

    torch.manual_seed(0)
    workload = tf32lab.Workload(_Convs().eval(), torch.randn(8, 16, 48, 48), name="convs")
    with torch.backends.cudnn.flags(enabled=False):
        speed = predict(workload, "a100", ("highest", "high"), conv="tf32")
    (note,) = [n for n in speed.notes if "cudnn.conv" in n or "conv=" in n]
    assert "likely" not in note and "cuDNN is off" in note, note


def test_depthwise_convolutions_where_cudnn_is_off_are_not_counted_as_set_by_the_level():
    torch.manual_seed(0)
    workload = tf32lab.Workload(DepthwiseStack().eval(), torch.randn(8, 16, 96, 96), name="depthwise")
    with torch.backends.cudnn.flags(enabled=False):
        report = tf32lab.check(workload, levels=("highest", "high"))
    (conv,) = report.cudnn
    assert conv.flag == "off" and conv.maths == {"highest": "ieee", "high": "ieee"}
    advice = report.conclusion()[0]
    share = report.speed.level("highest").shares["conv"]
    assert f"convolutions, {share:.0%} (IEEE float32 at every level), run in PyTorch's own depthwise kernels, " \
           "which no level changes" in advice, advice
    said = next(line for line in report.conclusion() if line.startswith("Convolutions ran"))
    assert "the level sets their math" not in said and "depthwise" in said, said


class _TurnsCudnnOff(nn.Module):
    """A model that turns cuDNN off in its forward (for determinism) and leaves it so."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(4, 8, 3), nn.Linear(8, 2)

    def forward(self, x):
        torch.backends.cudnn.enabled = False
        return self.head(self.conv(x).mean((2, 3)))


def test_a_workload_that_turns_cudnn_off_has_it_put_back_and_said():
    torch.manual_seed(0)
    try:
        report = tf32lab.check(tf32lab.Workload(_TurnsCudnnOff().eval(), torch.randn(2, 4, 8, 8), name="m"),
                               levels=("highest", "high"), speed=False)
        assert torch.backends.cudnn.enabled  # put back, as every precision flag is
        assert any("cudnn.enabled" in note for note in report.notes), report.notes
        # its rows ran with cuDNN off, at the level's math: the family says so, not that cuDNN's flag set them
        (conv,) = report.cudnn
        assert conv.flag == "off" and conv.maths == {"highest": "ieee", "high": "tf32-rna"}, conv
    finally:
        torch.backends.cudnn.enabled = True


def test_the_page_of_depthwise_convolutions_without_cudnn_does_not_say_the_level_sets_them():
    torch.manual_seed(0)
    workload = tf32lab.Workload(DepthwiseStack().eval(), torch.randn(2, 16, 12, 12), name="depthwise")
    with torch.backends.cudnn.flags(enabled=False):
        page = tf32lab.check(workload, levels=("highest", "high"), speed=False).to_html()
    assert "the level sets their math</h3>" not in page
    assert "<h3>Convolutions and RNNs: cuDNN is off, and the convolutions are depthwise: PyTorch's own kernels run " \
           "them in IEEE float32 at every level</h3>" in page
