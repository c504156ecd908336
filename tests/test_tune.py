"""`tune`: it decides (one sensitive layer pinned, sensitive computations kept at highest, a loose tolerance taking
the fastest level), every candidate verified; the CLI's exit codes and files; the page in a real browser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import cli_runner
import tf32lab
from browser import visit
from tf32lab.control import flags
from tf32lab.errors import Tf32LabError
from tf32lab.workloads import builtin, specs

NET = f"{Path(__file__).resolve().parents[1] / 'examples' / 'tune' / 'model.py'}:make"


@pytest.fixture
def net():
    return specs.load(NET)


def test_exactly_the_sensitive_layer_is_pinned_and_most_of_the_speed_kept(net):
    before = flags.snapshot()
    tuning = tf32lab.tune(net, target="a100")
    assert flags.snapshot() == before
    assert tuning.passed and tuning.pinned == ("sens.lin",)
    assert tuning.policy.default == "high" and ("sens.lin", "highest") in tuning.policy.rules
    all_high = tuning.report.level("high").speedup
    assert tuning.speedup >= 0.9 * all_high, (tuning.speedup, all_high)
    assert all(o.passed for o in tuning.outputs)
    # never a policy that was not verified: the chosen one is among the candidates that passed end to end
    assert any(c.policy == tuning.policy and c.passed for c in tuning.candidates)
    # and what it found holds when applied for real, under emulation
    with tf32lab.emulate("a100"), tuning.policy.applied(net.model), torch.inference_mode():
        out = net.run()
    with tf32lab.precision("highest"), torch.inference_mode():
        exact = net.run()
    with tf32lab.emulate("a100"), tf32lab.precision("high"), torch.inference_mode():
        tf32 = net.run()
    assert (out - exact).norm() / exact.norm() < 1e-2 < (tf32 - exact).norm() / exact.norm()
    # its cost: a few runs beyond the check of the uniform levels
    assert tuning.seconds <= 3 * tuning.check_seconds + 2.0
    assert tuning.runs <= 8


@pytest.mark.parametrize("make", [builtin.covariance, builtin.rotation_round_trip])
def test_sensitive_computations_stay_at_highest(make):
    tuning = tf32lab.tune(make(), target="a100")
    assert tuning.passed and tuning.level == "highest" and tuning.pinned == ()
    assert "Keep `highest`" in tuning.advice()[0]


def test_a_loose_tolerance_takes_the_fastest_uniform_level_with_nothing_pinned(net):
    tuning = tf32lab.tune(net, target="a100", tolerance=100.0)
    assert tuning.level == "high" and tuning.pinned == () and tuning.policy == tf32lab.Policy(default="high")
    assert len(tuning.candidates) == 2  # the uniform levels only: nothing to search


def test_when_not_even_highest_passes_the_result_says_so(net):
    tuning = tf32lab.tune(net, target="a100", tolerance=0.0)
    assert not tuning.passed and tuning.policy is None
    assert "Not even `highest` is within tolerance" in tuning.advice()[0]


def test_tune_refuses_what_it_cannot_do(net):
    with pytest.raises(Tf32LabError, match="no speed model for target 'cpu-amx'"):
        tf32lab.tune(net, target="cpu-amx")
    with pytest.raises(Tf32LabError, match="unknown target 'b900'"):
        tf32lab.tune(net, target="b900")
    with pytest.raises(Tf32LabError, match=r"takes a tf32lab\.Workload"):
        tf32lab.tune(net.model)


@pytest.mark.slow
def test_minilm_is_tuned_to_high_everywhere():
    tuning = tf32lab.tune(builtin.minilm(), target="a100")
    assert tuning.passed and tuning.level == "high" and tuning.pinned == ()


# -- the command line and the page -------------------------------------------------------------------------
def cli(*args, cwd):
    return cli_runner.run("tune", *args, module="tf32lab.cli", timeout=300, cwd=cwd)


def test_tune_writes_the_policy_its_json_and_its_page(tmp_path):
    done = cli(NET, "--out", "policy.json", "--json", "t.json", "--html", "t.html", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Apply it with `tf32lab.Policy.load(\"policy.json\").apply(model)`" in done.stdout
    policy = tf32lab.Policy.load(tmp_path / "policy.json")
    assert ("sens.lin", "highest") in policy.rules
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["pinned"] == ["sens.lin"] and data["candidates"][0]["why"] == "uniform highest"
    seen = visit(tmp_path / "t.html", tmp_path / "t.png")
    assert not seen.console_errors and not seen.requests and seen.svg_count >= 1
    assert "(chosen)" in seen.text and "sens.lin" in seen.text and "The uniform levels it started from" in seen.text


def test_tune_exit_codes(tmp_path):
    failing = cli(NET, "--tolerance", "0", "--out", "p.json", cwd=tmp_path)
    assert failing.returncode == 1 and "Not even `highest`" in failing.stdout
    assert not (tmp_path / "p.json").exists()
    for args, message in ((["--target", "cpu"], "no speed model for target 'cpu'"),
                          (["--out", "/no/such/dir/p.json"], "--out /no/such/dir/p.json: no folder")):
        bad = cli(NET, *args, cwd=tmp_path)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr


def test_check_points_to_tune_when_a_level_fails(tmp_path):
    done = cli_runner.run("check", "tf32lab.workloads.builtin:covariance", "--levels", "highest,high",
                          module="tf32lab.cli", timeout=300, cwd=tmp_path)
    assert done.returncode == 1
    assert "next: tf32lab tune tf32lab.workloads.builtin:covariance --target a100 --out policy.json" in done.stdout


def test_check_points_to_tune_naming_the_level_medium_computes_as(tmp_path):
    # on an A100 `medium` is `high` (measured once): the layers are kept at a safer level than `high`, not `medium`
    done = cli_runner.run("check", "tf32lab.workloads.builtin:covariance", "--no-speed", module="tf32lab.cli",
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 1
    assert "(which layers to keep at a safer level than 'high')" in " ".join(done.stdout.split()), done.stdout


def test_the_advice_names_the_policy_file_really_written(tmp_path):
    (tmp_path / "out").mkdir()
    done = cli(NET, "--out", "out/tuned.toml", "--html", "t.html", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert 'Apply it with `tf32lab.Policy.load("out/tuned.toml").apply(model)`' in done.stdout
    assert "policy.json" not in done.stdout and "policy.json" not in (tmp_path / "t.html").read_text()
    assert tf32lab.Policy.load(tmp_path / "out" / "tuned.toml").rules


def test_without_out_the_advice_invents_no_file_name(net):
    advice = " ".join(tf32lab.tune(net, target="a100").advice())
    assert "policy.json" not in advice and "tuning.policy.save(FILE)" in advice


def test_layers_a_level_does_not_change_on_the_target_are_never_pinned(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(NET.rpartition(":")[0]).parent))
    from model import Net

    class ConvFront(Net):
        """The tune example behind a convolution: cuDNN keeps it TF32 at `highest` on a100, as at `high`."""

        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return super().forward(self.conv(x.view(-1, 8, 8, 8)).flatten(1))

    torch.manual_seed(0)
    tuning = tf32lab.tune(tf32lab.Workload(ConvFront(), torch.randn(1024, 512)), target="a100")
    assert tuning.report.level("high").maths["conv"] == tuning.report.level("highest").maths["conv"]
    assert tuning.passed and tuning.pinned == ("sens.lin",)
    assert not any("conv" in c.pinned for c in tuning.candidates), [c.pinned for c in tuning.candidates]


def test_a_model_that_raises_at_its_first_op_in_float32_is_named_not_said_to_run_no_ops():
    # float64 inputs beside float32 weights: the float64 reference ran, every float32 level raised at the first
    # product, and tune said "workload 'Linear' ran no ops: nothing to tune"
    workload = tf32lab.Workload(torch.nn.Linear(8, 2), torch.randn(4, 8, dtype=torch.float64), name="lin")
    with pytest.raises(tf32lab.Tf32LabError) as raised:
        tf32lab.tune(workload, target="a100")
    said = str(raised.value)
    assert "ran no ops" not in said
    assert said.startswith("workload 'lin' raised at `highest` before its first op: RuntimeError: mat1 and mat2 ")
    assert "its inputs hold float64 tensors ('input')" in said


def test_keeping_highest_says_why_a_level_that_passes_too_is_not_taken():
    # README's mymodel.py: `high` passed at 1.00x, and the reason read "`highest` everywhere is within tolerance.
    # Its worst output is at 0.000 of the tolerance.", saying neither why `high` was left nor how small the error is
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    tuning = tf32lab.tune(tf32lab.Workload(model, torch.randn(64, 128)), target="a100")
    assert tuning.policy.default == "highest"
    assert "(`high` passes too, predicted 1.00x: no faster)" in tuning.reason
    assert "0.000 of the tolerance" not in tuning.reason and "e-05 of the tolerance" in tuning.reason


def test_a_compiled_model_is_tuned_eagerly_and_its_own_calls_still_compile(counted_graphs):
    # check ran a compiled model eagerly, tune did not: Dynamo traced it into the float64 reference's modes, and
    # tune refused it ("raised at the float64 reference ... InternalTorchDynamoError")
    counting, graphs = counted_graphs
    torch.manual_seed(0)
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
                             backend=counting)
    x = torch.randn(4, 8)
    tuning = tf32lab.tune(tf32lab.Workload(compiled, x, name="compiled"), tolerance=1e-2)
    assert tuning.passed and tuning.report.level("highest").error is None
    assert graphs == {"compiled": 0, "ran": 0}  # the runs were eager
    compiled(x)
    assert graphs == {"compiled": 1, "ran": 1}


def test_the_terminal_summary_says_the_runs_notes_as_check_prints_them():
    # the notes were in the JSON and the page alone: a search run under a conv math, or a workload that changed a
    # flag, said nothing of it on the terminal
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 8, 9), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(448, 1))
    tuning = tf32lab.tune(tf32lab.Workload(model, torch.randn(4, 2, 64)), target="a100", conv="ieee")
    assert tuning.report.notes and all(note in tuning.lines(width=200) for note in tuning.report.notes)


def test_the_training_mode_note_tune_prints_names_tune_not_check():
    # the note on modules that compute otherwise in training mode points to the command that measures a training
    # step: for tune's user, tune --train, not check --train
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
    lines = tf32lab.tune(tf32lab.Workload(model, torch.randn(4, 8)), target="a100", levels=("high",)).lines(width=200)
    said = [line for line in lines if "in training mode compute otherwise in eval mode" in line]
    assert said and "tune --train" in said[0] and "check" not in said[0], said


def test_a_conv_math_given_for_a_model_without_convolutions_is_said_to_have_set_the_flag_alone():
    # as check says it: --conv set cuDNN's flag, and no convolution ran (tune said they ran at it)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    tuning = tf32lab.tune(tf32lab.Workload(model, torch.randn(4, 8)), target="a100", levels=("high",), conv="ieee")
    assert any("the model ran no convolution" in n for n in tuning.report.notes), tuning.report.notes
    assert not any("convolutions ran at cudnn.conv" in n for n in tuning.report.notes), tuning.report.notes
