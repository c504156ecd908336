"""A TorchScript (traced or scripted) LSTM on a CPU under ``emulate()``: its ``aten::lstm`` reaches the emulator
whole only under inference mode; elsewhere PyTorch decomposes it below autograd into one
``aten::mkldnn_rnn_layer`` per layer and direction, which ran natively, counted as unhandled (no TF32 error at
all). Each is now emulated as that layer and direction of the LSTM, where no backward will read oneDNN's
workspace."""

from __future__ import annotations

import pytest
import torch

import tf32lab

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")


def _traced(bias: bool, bidirectional: bool, batch_first: bool):
    torch.manual_seed(0)
    model = torch.nn.LSTM(16, 32, 2, batch_first=batch_first, bidirectional=bidirectional, bias=bias)
    x = torch.randn(4, 10, 16) if batch_first else torch.randn(10, 4, 16)
    return model, torch.jit.trace(model, (x,)), x


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_a_traced_lstm_under_no_grad_is_emulated_as_under_inference_mode(bias, bidirectional, batch_first):
    _, traced, x = _traced(bias, bidirectional, batch_first)
    with torch.inference_mode(), tf32lab.emulate("a100") as whole:
        want = traced(x)
    with torch.no_grad(), tf32lab.emulate("a100") as layers:
        got = traced(x)
    layers_run = 2 * (2 if bidirectional else 1)
    assert dict(layers.coverage) == {("aten::mkldnn_rnn_layer", "tf32-rna"): layers_run} and not layers.unhandled
    assert dict(whole.coverage) == {("aten::lstm.input", "tf32-rna"): 1}
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    native = traced(x)
    assert not torch.equal(got[0], native[0])  # TF32's rounding is there


def test_a_traced_lstm_whose_backward_autograd_records_runs_natively_and_is_said():
    _, traced, x = _traced(True, False, True)
    with tf32lab.emulate("a100") as emu:
        out = traced(x)[0]
    out.sum().backward()  # oneDNN's own backward, its workspace its forward's
    assert dict(emu.unhandled) == {"aten::mkldnn_rnn_layer": 2} and not emu.coverage
    assert torch.equal(out.detach(), traced(x)[0].detach())


class _Regressor(torch.nn.Module):
    def __init__(self, rnn: torch.nn.Module) -> None:
        super().__init__()
        self.rnn, self.head = rnn, torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("traced", [False, True])
def test_a_training_check_says_a_torchscript_rnns_gemms_are_not_the_targets_rnn_math(traced):
    # a traced GRU trained under emulate() is broken into addmm and mm by PyTorch before the emulator sees it: its
    # GEMMs ran in the matmul's math (IEEE at highest), and highest's drift read float32's own (9e-8, not 2e-5)
    torch.manual_seed(0)
    x, y = torch.randn(16, 12, 8), torch.randn(16, 1)
    gru = torch.nn.GRU(8, 32, batch_first=True)
    model = _Regressor(torch.jit.trace(gru, (x,)) if traced else gru)
    w = tf32lab.TrainingWorkload(model, [(x, y)] * 2, inputs=lambda b: b[0],
                                 loss=lambda o, b: (o - b[1]).pow(2).mean())
    report = tf32lab.check_training(w, levels=("highest",), target="a100", speed=False)
    said = [n for n in report.notes if n.startswith("TorchScript with an RNN ('rnn')")]
    assert len(said) == (1 if traced else 0), report.notes


class _RunsGru(torch.nn.Module):
    """A scripted part with no forward of its own: its exported ``run`` calls the GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(8, 32, batch_first=True)

    @torch.jit.export
    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


class _CallsRun(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = torch.jit.script(_RunsGru()), torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.rnn.run(x)[:, -1])


def test_a_scripted_part_with_no_forward_whose_method_runs_an_rnn_is_said():
    # its graph is its methods': forward's alone (none here) found nothing
    torch.manual_seed(0)
    x, y = torch.randn(16, 12, 8), torch.randn(16, 1)
    w = tf32lab.TrainingWorkload(_CallsRun(), [(x, y)] * 2, inputs=lambda b: b[0],
                                 loss=lambda o, b: (o - b[1]).pow(2).mean())
    report = tf32lab.check_training(w, levels=("highest",), target="a100", speed=False)
    assert [n for n in report.notes if n.startswith("TorchScript with an RNN ('rnn')")], report.notes



def test_tune_train_says_so_too():
    torch.manual_seed(0)
    x, y = torch.randn(16, 12, 8), torch.randn(16, 1)
    model = _Regressor(torch.jit.trace(torch.nn.GRU(8, 32, batch_first=True), (x,)))
    w = tf32lab.TrainingWorkload(model, [(x, y)] * 2, inputs=lambda b: b[0],
                                 loss=lambda o, b: (o - b[1]).pow(2).mean())
    tuning = tf32lab.tune(w, target="a100", levels=("high", "highest"))
    assert [n for n in tuning.report.notes if n.startswith("TorchScript with an RNN ('rnn')")], tuning.report.notes
