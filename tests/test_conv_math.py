"""cuDNN's convolution math as its own knob (``conv="tf32"|"ieee"``), beside the level: check and tune name it, the
CLI takes ``--conv``, a bad value is one line (exit 2), and the flags are as before afterwards (the suite's conftest
checks every flag after each test, too)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import cli_runner
import tf32lab
from tf32lab import Workload, check
from tf32lab.control import flags
from tf32lab.control.scope import conv_math
from tf32lab.errors import Tf32LabError

MODEL = """
import torch
from tf32lab import Workload


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 4, 3))
    return Workload(model, 8.0 + torch.randn(2, 3, 16, 16), name="convs")
"""


def _convs() -> Workload:
    namespace: dict = {}
    exec(MODEL, namespace)
    return namespace["make"]()


def test_check_names_the_conv_math_and_puts_the_flag_back():
    before = flags.snapshot()
    ieee = check(_convs(), levels=("highest",), target="a100", conv="ieee", speed=False)
    tf32 = check(_convs(), levels=("highest",), target="a100", conv="tf32", speed=False)
    assert flags.snapshot() == before
    e_ieee, e_tf32 = (r.level("highest").outputs[0].normwise for r in (ieee, tf32))
    assert e_ieee < e_tf32 / 100  # at highest only the conv math differs: TF32 operands against IEEE
    assert any("cudnn.conv 'ieee'" in note for note in ieee.notes)
    # the level leaves cuDNN alone: without conv=, convolutions follow the process's flag (PyTorch's default tf32)
    default = check(_convs(), levels=("highest",), target="a100", speed=False)
    assert default.level("highest").outputs[0].normwise == e_tf32


def test_on_a_cpu_target_the_conv_note_does_not_say_the_convolutions_ran_at_cudnns_flag():
    """A CPU does not read cuDNN's flag: the note said "convolutions ran at cudnn.conv 'tf32'" beside the report's
    own line that they ran IEEE at every level."""
    before = flags.snapshot()
    report = check(_convs(), levels=("highest", "high"), target="cpu-amx", conv="tf32", speed=False)
    assert flags.snapshot() == before
    note = next(note for note in report.notes if "conv='tf32'" in note)
    assert "ran at cudnn.conv" not in note and "torch.backends.mkldnn.conv.fp32_precision" in note
    assert report.level("highest").outputs[0].normwise == report.level("high").outputs[0].normwise


class _Tagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = torch.nn.LSTM(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def test_a_model_without_convolutions_is_not_told_its_convolutions_ran_at_the_asked_math():
    torch.manual_seed(0)
    report = check(Workload(_Tagger(), torch.randn(5, 2, 4)), levels=("highest", "high"), conv="ieee", speed=False)
    (note,) = [note for note in report.notes if "conv=" in note]
    # the flag sets cuDNN's RNNs too: they ran at it, and the note says so, not that nothing did
    assert "ran at cudnn.conv" not in note and note.startswith("cuDNN's RNNs ran at cudnn.rnn 'ieee'"), note


def test_a_training_check_of_an_rnn_names_the_rnns_as_what_ran_at_the_asked_math():
    # an LSTM's training check with conv='ieee' (the math its note on RNNs that ran TF32 advises) said
    # "convolutions ran at cudnn.conv 'ieee' in every row (conv=)": it has none; its RNNs ran at it
    torch.manual_seed(0)
    batches = [(torch.randn(3, 2, 4), torch.randn(3, 2, 1)) for _ in range(2)]
    workload = tf32lab.TrainingWorkload(_Tagger(), batches, inputs=lambda b: b[0], steps=2,
                                        loss=lambda out, b: (out - b[1]).pow(2).mean())
    report = tf32lab.check_training(workload, levels=("highest", "high"), target="a100", conv="ieee", speed=False)
    (note,) = [note for note in report.notes if "conv=" in note]
    assert "convolutions ran" not in note and note.startswith("cuDNN's RNNs ran at cudnn.rnn 'ieee'"), note
    assert "torch.backends.cudnn.rnn.fp32_precision = 'ieee'" in note


def test_conv_math_is_scoped_and_restored_on_every_exit_path():
    before = flags.snapshot()
    with conv_math("ieee"):
        assert flags.read_cells()["cuda.conv"] == "ieee"
        with conv_math("tf32"):
            assert flags.read_cells()["cuda.conv"] == "tf32"
        assert flags.read_cells()["cuda.conv"] == "ieee"
    assert flags.snapshot() == before
    with pytest.raises(RuntimeError, match="boom"), conv_math("ieee"):
        raise RuntimeError("boom")
    assert flags.snapshot() == before
    with pytest.raises(Tf32LabError, match=r"unknown conv math 'fast'; accepted: 'tf32', 'ieee'"):
        conv_math("fast")
    with pytest.raises(Tf32LabError, match="unknown conv math"):
        check(_convs(), levels=("highest",), target="a100", conv="TF32x")
    assert flags.snapshot() == before


def test_tune_searches_the_conv_math_too():
    tuning = tf32lab.tune(_convs(), target="a100", tolerance=1e-4, conv=None)
    assert tuning.passed and tuning.conv == "ieee"  # TF32 convs miss 1e-4 on inputs riding an offset of 8
    assert tuning.conv_searched and "TF32 everywhere misses the tolerance" in tuning.advice()[-1]
    told = tf32lab.tune(_convs(), target="a100", tolerance=1e-4, conv="ieee")  # asked for: said so, and set
    assert told.conv == "ieee" and told.policy.conv == "ieee" and not told.conv_searched
    assert "as asked" in told.advice()[-1] and "misses" not in told.advice()[-1]
    loose = tf32lab.tune(_convs(), target="a100", tolerance=0.5)
    assert loose.conv == "tf32"  # the faster conv math passes: kept
    assert torch.backends.cudnn.conv.fp32_precision == "tf32" if flags.NEW_API else True


def _three_convs() -> Workload:
    """Three convolutions, all sped up by TF32 on an a100 (the speed model says so) except the 3-channel stem;
    at a tolerance of 1e-3 TF32 everywhere fails (1.5e-3), the stem alone at IEEE passes (8e-4)."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Conv2d(3, 64, 3, padding=1)
            self.b = torch.nn.Conv2d(64, 64, 3, padding=1)
            self.c = torch.nn.Conv2d(64, 4, 3)

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    return Workload(Net(), 8.0 + torch.randn(4, 3, 28, 28, generator=torch.Generator().manual_seed(1)), name="net")


def test_tune_gives_convolution_layers_back_to_tf32_where_they_pass():
    before = flags.snapshot()
    tuning = tf32lab.tune(_three_convs(), target="a100", tolerance=1e-3)
    assert flags.snapshot() == before
    assert tuning.passed and tuning.conv == "ieee" and tuning.level is None
    policy = tuning.policy
    assert policy.conv == "ieee" and {(r.pattern, r.level, r.conv) for r in policy.rules} == {
        ("b", None, "tf32"), ("c", None, "tf32")}
    tried = [c for c in tuning.candidates if c.why.startswith("cuDNN tf32")]
    assert tried and tried[-1].passed and tuning.speedup > 1.1
    assert "2 still pass at it ('b', 'c')" in tuning.reason
    advice = " ".join(tuning.advice())
    assert "runs 2 layer(s) at TF32" in advice and "cudnn.rnn.fp32_precision" in advice
    # the answer, checked on its own: it passes, and its pinned layers were rerun at their math (no NaN)
    report = check(_three_convs(), levels=("highest",), target="a100", conv="tf32", tolerance=1e-3, speed=False,
                   policy=policy)
    row = report.level("policy")
    assert row.passed and not report.level("highest").passed
    assert all(layer.introduced == layer.introduced for layer in row.layers)
    assert json.loads(tuning.to_json())["policy"]["rules"][0]["conv"] == "tf32"


def test_a_tune_that_needs_ieee_convolutions_writes_them_into_its_policy():
    # at 2e-4 no convolution passes at TF32: the answer is IEEE everywhere, and its policy says so itself (a file
    # applied elsewhere passes without the flag set by hand); every candidate of that search names it too
    tuning = tf32lab.tune(_three_convs(), target="a100", tolerance=2e-4)
    assert tuning.passed and tuning.conv == "ieee" and tuning.policy.conv == "ieee"
    assert all(c.policy.conv == "ieee" for c in tuning.candidates)
    report = check(_three_convs(), levels=("highest",), target="a100", conv="tf32", tolerance=2e-4, speed=False,
                   policy=tuning.policy)
    assert report.level("policy").passed and not report.level("highest").passed


def test_tune_searches_ieee_for_cudnn_rnns_too():
    # an LSTM alone: cuDNN's RNN follows the same flag (on a100, TF32 by default): IEEE is searched for it too
    torch.manual_seed(0)
    lstm = Workload(torch.nn.LSTM(64, 64, batch_first=True), 4.0 + torch.randn(2, 16, 64), name="lstm")
    tuning = tf32lab.tune(lstm, target="a100", tolerance=1e-5)
    assert tuning.passed and tuning.conv == "ieee" and tuning.policy.conv == "ieee"


def test_the_cli_takes_conv(tmp_path):
    (tmp_path / "convmodel.py").write_text(textwrap.dedent(MODEL))

    def run(*args):
        return cli_runner.run("check", "convmodel:make", "--levels", "highest", "--target", "a100", "--no-speed",
                              "--tolerance", "1e-4", *args, module="tf32lab.cli", timeout=300, cwd=tmp_path)

    ieee, tf32 = run("--conv", "ieee"), run("--conv", "tf32")
    assert ieee.returncode == 0, ieee.stderr
    assert tf32.returncode == 1, tf32.stdout
    bad = run("--conv", "fast")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--conv: bad conv math 'fast'; accepted: tf32, ieee" in bad.stderr.strip().splitlines()[-1]


def conv_training_workload() -> tf32lab.TrainingWorkload:
    """Two steps of a two-convolution net on inputs far from zero (where TF32's rounding shows)."""
    g = torch.Generator().manual_seed(2)
    data = [(8.0 + torch.randn(2, 3, 12, 12, generator=g), torch.randn(2, 4, 10, 10, generator=g))] * 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv2d(8, 4, 3))
    return tf32lab.TrainingWorkload(model, data, loss=lambda out, b: (out - b[1]).pow(2).mean(),
                                    inputs=lambda b: b[0], name="convs", steps=2)


def test_the_training_check_names_it_too():
    before = flags.snapshot()
    workload = conv_training_workload()
    ieee, tf32 = (tf32lab.check_training(workload, levels=("highest",), target="a100", speed=False, conv=conv)
                  for conv in ("ieee", "tf32"))
    assert flags.snapshot() == before
    first = [report.level("highest").gradients[0].normwise for report in (ieee, tf32)]
    assert first[0] < first[1] / 10
    assert any("cudnn.conv 'ieee'" in note for note in ieee.notes)


def test_conv_blocks_of_two_threads_closing_out_of_order_give_the_process_its_flag_back():
    import threading

    before = flags.snapshot()
    a, b = conv_math("ieee"), conv_math("tf32")
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with a:
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second():
        a_in.wait(10)
        with b:
            b_in.set()
            a_out.wait(10)  # a closes while b is open: b's math stays in force
            assert flags.read_cells()["cuda.conv"] == "tf32"

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert flags.snapshot() == before, before.diff(flags.snapshot())


def test_a_model_that_reads_cudnn_allow_tf32_runs_under_a_named_conv_math():
    class Reads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 3, 3)

        def forward(self, x):
            assert torch.backends.cudnn.allow_tf32 is False  # PyTorch raises if conv and RNN cells disagree
            return self.conv(x)

    assert check(Workload(Reads(), torch.randn(1, 2, 5, 5)), levels=("highest",), conv="ieee", speed=False)


def test_tune_searches_the_conv_math_of_convolutions_it_finds_no_module_for():
    """A TorchScript model's convolutions are ScriptModules, not ``torch.nn.Conv2d``, and a functional
    ``F.conv2d`` is no module at all: tune searched only under TF32 convolutions, found nothing passing, and said
    'no precision setting fixes that' where IEEE convolutions pass (as check's conclusion says)."""
    scripted = _convs()
    scripted = Workload(torch.jit.script(scripted.model), scripted.inputs, name="scripted")

    class Functional(torch.nn.Module):
        def __init__(self, convs: torch.nn.Sequential) -> None:
            super().__init__()
            self.w0, self.b0 = convs[0].weight, convs[0].bias
            self.w2, self.b2 = convs[2].weight, convs[2].bias

        def forward(self, x):
            return torch.nn.functional.conv2d(torch.relu(torch.nn.functional.conv2d(x, self.w0, self.b0, padding=1)),
                                              self.w2, self.b2)

    plain = _convs()
    functional = Workload(Functional(plain.model), plain.inputs, name="functional")
    before = flags.snapshot()
    for workload in (scripted, functional):
        tuning = tf32lab.tune(workload, target="a100", tolerance=1e-4)
        assert flags.snapshot() == before
        assert tuning.passed and tuning.conv == "ieee" and tuning.conv_searched, (workload.name, tuning.advice())
        assert tuning.policy.conv == "ieee"
        assert "no precision setting fixes that" not in " ".join(tuning.advice())
        # asked for, the math is written into the policy too: without it the policy fails where it is applied
        told = tf32lab.tune(workload, target="a100", tolerance=1e-4, conv="ieee")
        assert told.passed and told.conv == "ieee" and told.policy.conv == "ieee", (workload.name, told.advice())
        # a policy applies to an eager model only: a TorchScript one takes no hooks, and applying it is refused
        applies = "apply the policy, which sets it itself" in " ".join(told.advice())
        assert applies == (workload is functional), (workload.name, told.advice())
        if workload is scripted:
            with pytest.raises(Tf32LabError, match="is TorchScript, which takes no hooks"):
                told.policy.apply(workload.model)
