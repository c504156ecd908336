"""A model, loss or batches function that calls ``sys.exit()`` (or raises another BaseException) during a run:
never a command or a call that ends with 0 and no verdict. A run at a level fails its row, naming the exit; the
float64 reference is bad input (exit 2, one line); anywhere else, one ``Tf32LabError``. Ctrl-C still stops."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import cli_runner
import tf32lab
from tf32lab import TrainingWorkload, Workload, check, check_training, tune
from tf32lab.control import flags
from tf32lab.errors import Tf32LabError
from tf32lab.speed.bench import bench

# The models below exit by a rule each run can see: the dtype they compute in (float64 only at the reference)
# or the level in force (tf32lab's scope: ``high`` inside check's emulated run of that level).


class Stop(BaseException):
    """A BaseException of the user's own, neither an Exception nor an exit."""


class Exits(torch.nn.Module):
    """A linear layer that ends the program (``sys.exit(0)``) when ``when(output)`` holds."""

    def __init__(self, when, raised=None):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.when, self.raised = when, raised

    def forward(self, x):
        y = self.lin(x)
        if self.when(y):
            if self.raised is not None:
                raise self.raised
            sys.exit(0)
        return y


def reduced(_):
    return tf32lab.get_float32_matmul_precision() != "highest"


def in_float64(y):
    return y.dtype == torch.float64


def forward(when, raised=None) -> Workload:
    torch.manual_seed(0)
    return Workload(Exits(when, raised), torch.randn(16, 8), name="exits")


def training(when) -> TrainingWorkload:
    torch.manual_seed(0)
    data = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(2)]

    def loss(out, batch):
        if when(out):
            sys.exit(0)
        return (out - batch[1]).pow(2).mean()

    return TrainingWorkload(torch.nn.Linear(8, 4), data, loss=loss, inputs=lambda b: b[0], name="exits")


# -- the API ----------------------------------------------------------------------------------------------------
def test_check_fails_the_level_that_exits_and_names_the_exit():
    before = flags.snapshot()
    report = check(forward(reduced), levels=("highest", "high"), speed=False)
    assert not report
    assert report.level("highest").passed
    assert report.level("high").error == "SystemExit: sys.exit(0) was called"
    assert flags.snapshot() == before


def test_any_base_exception_of_the_model_fails_its_level_by_name():
    report = check(forward(reduced, Stop("halt")), levels=("highest", "high"), speed=False)
    assert not report and report.level("highest").passed
    assert report.level("high").error == "Stop: halt"


class ExitsLinear(torch.nn.Linear):
    """A layer that runs its own matmul and exits below highest: rerun alone at each level too (check's
    introduced error, the training check's backward per module)."""

    def forward(self, x):
        if reduced(x):
            sys.exit(0)
        return super().forward(x)


def test_a_layer_that_exits_when_rerun_alone_fails_only_its_level():
    torch.manual_seed(0)
    report = check(Workload(ExitsLinear(8, 4), torch.randn(16, 8)), levels=("highest", "high"), speed=False)
    assert report.level("highest").passed
    assert report.level("high").error == "SystemExit: sys.exit(0) was called"


def test_a_module_that_exits_when_its_backward_is_rerun_fails_only_its_level():
    torch.manual_seed(0)
    data = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(2)]
    workload = TrainingWorkload(ExitsLinear(8, 4), data, loss=lambda out, b: (out - b[1]).pow(2).mean(),
                                inputs=lambda b: b[0])
    report = check_training(workload, levels=("highest", "high"), speed=False)
    assert report.level("highest").passed
    assert report.level("high").failure == "SystemExit: sys.exit(0) was called"


def test_check_of_a_model_that_exits_at_the_float64_reference_is_bad_input():
    with pytest.raises(Tf32LabError, match=r"float64 reference, before any level ran: SystemExit: sys\.exit\(0\)"):
        check(forward(in_float64), levels=("high",), speed=False)


def test_an_exit_outside_every_run_is_one_error_not_an_exit():
    workload = forward(lambda y: False)
    workload.metric = lambda out, ref: sys.exit(0)
    with pytest.raises(Tf32LabError, match=r"workload 'exits' called sys\.exit\(0\) during check"):
        check(workload, levels=("high",), speed=False)


def test_ctrl_c_still_stops_a_check_and_every_flag_is_put_back():
    before = flags.snapshot()
    with pytest.raises(KeyboardInterrupt):
        check(forward(reduced, KeyboardInterrupt()), levels=("highest", "high"), speed=False)
    assert flags.snapshot() == before


def test_check_training_fails_the_level_whose_loss_exits():
    report = check_training(training(lambda out: reduced(out) and out.dtype == torch.float32),
                            levels=("highest", "high"), speed=False)
    assert not report
    assert report.level("highest").passed
    high = report.level("high")
    assert high.failure == "SystemExit: sys.exit(0) was called" and high.failed_step == 1


def test_check_training_of_a_loss_that_exits_in_float64_is_bad_input():
    with pytest.raises(Tf32LabError, match=r"fails in float64, before any level ran: step 1: SystemExit"):
        check_training(training(in_float64), levels=("high",), speed=False)


def test_check_training_whose_every_float32_row_exits_has_a_verdict_with_speed_counted_too():
    # the speed model counts a float32 step outside every row: the rows' failures stand, no exit escapes
    report = check_training(training(lambda out: out.dtype == torch.float32), levels=("highest", "high"),
                            target="a100")
    assert not report
    assert all(row.failure == "SystemExit: sys.exit(0) was called" for row in report.levels)


def test_tune_of_a_model_that_exits_below_highest_answers_highest():
    tuning = tune(forward(reduced), target="a100")
    assert tuning.level == "highest"
    assert "SystemExit: sys.exit(0)" in (tuning.report.level("high").error or "")


def test_tune_of_a_training_whose_loss_exits_below_highest_answers_highest():
    tuning = tune(training(lambda out: reduced(out) and out.dtype == torch.float32), target="a100")
    assert tuning.level == "highest"
    assert any("SystemExit" in (row.failure or "") for row in tuning.report.levels)


@pytest.mark.parametrize("run", [lambda w: tf32lab.predict(w, "a100"), lambda w: bench(w, rounds=1, min_seconds=0)],
                         ids=["predict", "bench"])
def test_predict_and_bench_of_a_model_that_exits_raise_one_error(run):
    with pytest.raises(Tf32LabError, match=r"sys\.exit\(0\)"):
        run(forward(lambda y: True))


# -- the command line -------------------------------------------------------------------------------------------
MODELS = textwrap.dedent("""
    import sys
    import torch
    import tf32lab


    class Exits(torch.nn.Module):
        def __init__(self, when):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)
            self.when = when

        def forward(self, x):
            y = self.lin(x)
            if self.when(y):
                sys.exit(0)
            return y


    def reduced(_):
        return tf32lab.get_float32_matmul_precision() != "highest"


    def reference(y):
        return y.dtype == torch.float64


    def at_high():
        torch.manual_seed(0)
        return Exits(reduced), torch.randn(16, 8)


    def at_reference():
        torch.manual_seed(0)
        return Exits(reference), torch.randn(16, 8)


    def _training(when):
        torch.manual_seed(0)
        data = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(2)]

        def loss(out, batch):
            if when(out):
                sys.exit(0)
            return (out - batch[1]).pow(2).mean()

        return tf32lab.TrainingWorkload(torch.nn.Linear(8, 4), data, loss=loss, inputs=lambda b: b[0])


    def always():
        torch.manual_seed(0)
        return Exits(lambda y: True), torch.randn(16, 8)


    def train_at_high():
        return _training(lambda out: reduced(out) and out.dtype == torch.float32)


    def train_at_reference():
        return _training(reference)
""")


def _cli(tmp_path, *args):
    (tmp_path / "exits.py").write_text(MODELS)
    return cli_runner.run(*args, module="tf32lab.cli", timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("args", [
    ["check", "exits.py:at_high", "--levels", "highest,high", "--no-speed"],
    ["check", "exits.py:train_at_high", "--train", "--levels", "highest,high", "--no-speed"],
], ids=["check", "check --train"])
def test_cli_a_level_that_exits_is_failed_with_exit_1(tmp_path, args):
    done = _cli(tmp_path, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED | level 'high'")]
    assert failed and "SystemExit: sys.exit(0) was called" in failed[0], done.stdout
    assert any(line.startswith("PASSED | level 'highest'") for line in done.stdout.splitlines()), done.stdout


@pytest.mark.parametrize("args, message", [
    (["check", "exits.py:at_reference"], "raised at the float64 reference, before any level ran: SystemExit"),
    (["tune", "exits.py:at_reference"], "raised at the float64 reference, before any level ran: SystemExit"),
    (["check", "exits.py:train_at_reference", "--train"], "fails in float64, before any level ran: step 1: SystemExit"),
    (["tune", "exits.py:train_at_reference", "--train"], "fails in float64, before any level ran: step 1: SystemExit"),
    (["speed", "exits.py:always"], "called sys.exit(0) during predict"),
], ids=["check", "tune", "check --train", "tune --train", "speed"])
def test_cli_an_exit_at_the_reference_is_exit_2_in_one_line(tmp_path, args, message):
    done = _cli(tmp_path, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert message in done.stderr, done.stderr
