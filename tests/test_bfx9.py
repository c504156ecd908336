"""The ``bfx9`` level (cuBLAS's float32 from nine bf16 products, pytorch#195301): accepted wherever a level is,
emulated as the bfx9 math, refused natively where this torch cannot set it, refused on targets without it, and shown
by doctor. The suite's conftest checks that every flag is as before after each test."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import cli_runner
import inner_pytest
import tf32lab
from tf32lab import Policy, TrainingWorkload, Workload, check, check_training, predict
from tf32lab.control import flags
from tf32lab.errors import Tf32LabError
from tf32lab.know import targets
from tf32lab.know.levels import ALL_LEVELS, check_level, level_cells, level_of
from tf32lab.machine import doctor as diagnosis
from tf32lab.machine.hardware import Hardware

pytest_plugins = ["pytester"]

NATIVE = flags.native_refusal("bfx9")  # None on a torch with pytorch#195301


def _operands():
    g = torch.Generator().manual_seed(3)
    return torch.randn(48, 96, generator=g), torch.randn(96, 40, generator=g)


def test_the_level_is_one_of_all_and_writes_its_cells():
    assert ALL_LEVELS == ("highest", "bfx9", "high", "medium")  # most accurate first
    assert level_cells("bfx9") == {"cuda.matmul": "bfx9", "mkldnn.matmul": "ieee"}
    assert check_level(" BFX9 ", loose=True) == "bfx9"
    assert level_of("bfx9", "ieee") == "bfx9" and level_of("bfx9", "none") == "bfx9"
    assert level_of("fp8x4", "ieee") == "unknown"  # a newer torch's value: never a level, never highest
    b200 = targets.get("b200")
    assert b200.maths_at("bfx9", {})["matmul"] == "bfx9"
    assert targets.get("cpu-amx").maths_at("bfx9", {})["matmul"] == "ieee"  # oneDNN has no bfx9: IEEE
    for name in ("a100", "h100"):
        with pytest.raises(Tf32LabError, match=rf"needs compute capability 10.0.*'{name}'"):
            targets.get(name).maths_at("bfx9", {})


def test_emulated_bfx9_equals_the_nine_product_math():
    from emulation_reference import bilinear, bound  # tests/: the float64 sum of the parts' products

    a, b = _operands()
    with tf32lab.emulate("b200"), tf32lab.precision("bfx9"):
        assert tf32lab.get_float32_matmul_precision() == "bfx9"
        got = a @ b
    with tf32lab.emulate("b200", math="bfx9"):
        forced = a @ b
    with tf32lab.emulate("b200"), tf32lab.precision("high"):
        tf32 = a @ b
    assert torch.equal(got, forced)
    expected = bilinear(lambda x, y: x @ y, a, b, "bfx9")
    assert ((got.double() - expected).abs() <= bound(lambda x, y: x @ y, a, b, a.shape[1])).all()
    exact = a.double() @ b.double()
    assert (got.double() - exact).abs().max() < (tf32.double() - exact).abs().max() / 50  # float32's accuracy


@pytest.mark.skipif(NATIVE is None, reason="this torch sets cuda.matmul = 'bfx9' natively")
def test_writing_it_natively_is_refused_in_one_line_naming_the_torch():
    before = flags.snapshot()
    with pytest.raises(Tf32LabError) as caught, tf32lab.precision("bfx9"):
        pass
    message = str(caught.value)
    assert "\n" not in message and torch.__version__ in message and "emulate" in message
    with pytest.raises(Tf32LabError, match="not one of PyTorch's levels"):
        tf32lab.set_float32_matmul_precision("bfx9")  # PyTorch's setter takes its three only
    assert flags.snapshot() == before
    assert tf32lab.get_float32_matmul_precision() == "highest"


def test_emulating_it_on_a_gpu_without_it_is_refused():
    a, b = _operands()
    with pytest.raises(Tf32LabError, match=r"'a100' \(sm80\) PyTorch raises"), tf32lab.emulate("a100"), \
            tf32lab.precision("bfx9"):
        a @ b


def _covariance() -> Workload:
    from tf32lab.workloads.builtin import covariance

    # a mean of 30 against a spread of ~1: TF32 breaks the Gram term alone. The mean's outer product (K = 1) takes
    # no TF32 on an H200, which the b200 target assumes too; at the built-in mean of 10 `high` passes there
    return covariance(rows=512, cols=16, offset=30.0)


def test_check_predict_tune_and_policy_take_it():
    workload = _covariance()
    report = check(workload, levels=("highest", "bfx9", "high"), target="b200")
    errors = {lv.level: lv.outputs[0].normwise for lv in report.levels}
    assert errors["bfx9"] < 10 * errors["highest"] < errors["high"]  # float32-accurate, TF32 is not
    with pytest.raises(Tf32LabError, match=r"needs compute capability 10\.0"):
        check(workload, levels=("bfx9",), target="a100")
    speeds = {lv.level: lv for lv in predict(workload, "b200", ("highest", "bfx9")).levels}
    assert speeds["bfx9"].seconds <= speeds["highest"].seconds
    policy = Policy.from_dict({"schema_version": 1, "default": "bfx9", "rules": []})
    assert policy.default == "bfx9"
    row = check(workload, levels=("highest",), target="b200", policy=policy)
    assert row.policy_row is not None and row.policy_row.passed
    for done in (report, row):  # the JSON of a bfx9 row, and of a bfx9 policy, is the documented report
        jsonschema.Draft202012Validator(tf32lab.report.schema()).validate(json.loads(done.to_json()))
    tuning = tf32lab.tune(workload, target="b200", levels=("bfx9", "highest"), tolerance=1e-3)
    assert tuning.policy.default == "bfx9"  # the fastest within tolerance


def test_where_bfx9_is_the_fastest_level_within_tolerance_the_conclusion_says_so_and_how_to_enable_it():
    # high fails the covariance (2e-2 against 1e-2) while bfx9 keeps float32's accuracy (3e-4): the answer is bfx9,
    # enabled the way PyTorch takes it (its set_float32_matmul_precision knows only its three levels)
    report = check(_covariance(), levels=("highest", "bfx9", "high"), target="b200")
    assert report.level("bfx9").passed and not report.level("high").passed
    said = report.conclusion()
    assert said[0].startswith("`bfx9` is safe for this workload on b200"), said
    assert 'tf32lab.precision("bfx9")' in said[0] and 'fp32_precision = "bfx9"' in said[0], said
    assert not any("Keep `highest`" in line or 'set_float32_matmul_precision("bfx9")' in line for line in said)
    assert any(line.startswith("Not `high`: at `high` the output 'output' is off by") for line in said), said


def test_the_training_check_takes_it():
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(2)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    workload = TrainingWorkload(model, data, loss=lambda out, b: (out - b[1]).pow(2).mean(), inputs=lambda b: b[0],
                                name="tiny", steps=2)
    report = check_training(workload, levels=("highest", "bfx9"), target="b200", speed=False)
    assert report.level("bfx9").passed


def test_the_cli_and_the_pytest_option_take_it(tmp_path):
    done = cli_runner.run("check", "tf32lab.workloads.builtin:covariance", "--levels", "highest,bfx9", "--target",
                          "b200", "--json", "-", module="tf32lab.cli", timeout=300)
    assert done.returncode == 0, done.stderr
    assert [lv["level"] for lv in json.loads(done.stdout)["levels"]] == ["highest", "bfx9"]
    bad = cli_runner.run("check", "tf32lab.workloads.builtin:covariance", "--levels", "bfx9", "--target", "a100",
                         module="tf32lab.cli", timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "needs compute capability" in bad.stderr
    from tf32lab.pytest_plugin import _parse

    target, level = _parse("b200:bfx9")
    assert target.name == "b200" and level == "bfx9"
    with pytest.raises(pytest.UsageError, match="needs compute capability"):
        _parse("a100:bfx9")
    if NATIVE is not None:
        with pytest.raises(pytest.UsageError, match=torch.__version__.replace("+", r"\+")):
            _parse("native:bfx9")


def test_doctor_shows_it():
    b200 = diagnosis.doctor(Hardware.simulated("b200"))
    a100 = diagnosis.doctor(Hardware.simulated("a100"))
    assert b200.levels["bfx9"]["matmul"] == "bfx9" and "bfx9" not in a100.levels
    assert b200.native_levels == {"bfx9": NATIVE}
    data = b200.to_dict()
    jsonschema.Draft202012Validator(diagnosis.schema()).validate(data)
    assert data["native_levels"]["bfx9"] == NATIVE


def test_a_suite_runs_at_it_under_the_plugin(pytester: pytest.Pytester):
    pytester.makepyfile(test_suite="""
import torch, tf32lab
from tf32lab.testing import assert_close, unit_roundoff

def test_at_bfx9():
    assert tf32lab.get_float32_matmul_precision() == "bfx9"
    a, b = torch.randn(8, 64), torch.randn(64, 8)
    assert unit_roundoff() == (2.0**-24, "bfx9")
    assert_close(a @ b, a.double() @ b.double(), operands=(a, b))
""")
    result = inner_pytest.run(pytester, "--tf32lab", "b200:bfx9")
    result.assert_outcomes(passed=1)
    bad = inner_pytest.run(pytester, "--tf32lab", "h100:bfx9")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR


def test_a_bfx9_scope_left_open_after_its_emulate_block_is_one_clear_error_and_no_flag_changed():
    before = flags.snapshot()
    emu = tf32lab.emulate("b200")
    emu.__enter__()
    scope = tf32lab.precision("bfx9")
    scope.__enter__()
    with pytest.raises(Tf32LabError, match=r"precision\('bfx9'\) outside emulate\(\): torch .* cannot set"):
        emu.__exit__(None, None, None)  # interleaved contexts: the block ends first, the scope stays open
    scope.__exit__(None, None, None)
    assert flags.snapshot() == before, before.diff(flags.snapshot())
    with tf32lab.emulate("b200"), tf32lab.precision("bfx9"):  # nothing left behind
        assert tf32lab.get_float32_matmul_precision() == "bfx9"


@pytest.mark.skipif(flags.native_refusal("bfx9") is None, reason="a torch that sets bfx9 natively")
def test_bfx9_on_the_native_target_is_refused_before_anything_runs_and_says_which_target_has_it():
    calls = []

    class Counted(torch.nn.Linear):
        def forward(self, x):
            calls.append(1)
            return super().forward(x)

    workload = Workload(Counted(8, 4), torch.randn(2, 8))
    for run in (lambda: check(workload, levels=("highest", "bfx9"), target="native"),
                lambda: check_training(TrainingWorkload(Counted(8, 4), [torch.randn(2, 8)], loss=lambda o, b: o.sum(),
                                                        inputs=lambda b: b), levels=("bfx9",), target="native")):
        with pytest.raises(Tf32LabError, match=r"level 'bfx9' on target 'native' .* \(target 'b200'\)"):
            run()
    assert calls == []
