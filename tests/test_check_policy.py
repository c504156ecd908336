"""`check(workload, policy=...)`, `tf32lab check --policy` and `tf32lab policy show`: the policy as one more row."""

from __future__ import annotations

import json
import textwrap

import jsonschema
import pytest
import torch

import cli_runner
import tf32lab
from tf32lab import Policy
from tf32lab.errors import Tf32LabError
from tf32lab.report import schema
from tf32lab.workloads import specs

MODEL = textwrap.dedent("""
    import torch, tf32lab

    class ValueModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
            self.v_head = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

        def forward(self, x):
            return self.v_head(self.body(x))

    def make():
        torch.manual_seed(0)
        return tf32lab.Workload(ValueModel(), torch.randn(64, 32), name="value-model")
""")


@pytest.fixture
def workload(tmp_path):
    (tmp_path / "valuemodel.py").write_text(MODEL)
    return specs.load(f"{tmp_path / 'valuemodel.py'}:make")


def test_the_policy_row_pins_the_heads_introduced_error_to_float32(workload):
    policy = Policy("high", [("v_head", "highest")])
    report = tf32lab.check(workload, levels=("highest", "high"), policy=policy)
    assert [lv.level for lv in report.levels] == ["highest", "high", "policy"]
    row, high, top = report.level("policy"), report.level("high"), report.level("highest")
    assert row.policy == dict(policy.to_dict(), base="high")
    assert row.maths["matmul"] == "mixed"
    introduced = {e.name: e.introduced for e in row.layers}
    for name in ("v_head.0", "v_head.2"):  # at highest, as at the level highest
        assert introduced[name] == {e.name: e.introduced for e in top.layers}[name] < 1e-6
    for name in ("body.0", "body.2"):  # at high, as at the level high
        assert introduced[name] == {e.name: e.introduced for e in high.layers}[name] > 1e-5
    jsonschema.validate(report.to_dict(), schema())
    assert any("The policy (`high` by default, 'v_head' → `highest`) is within tolerance" in line
               for line in report.conclusion())


def test_a_policy_level_not_among_the_levels_is_measured_for_its_layers(workload):
    # the head at medium: check reruns each layer at medium too, though only highest is a row
    report = tf32lab.check(workload, levels=("highest",), target="cpu-amx", policy=Policy(None, [("v_head", "medium")]))
    row = report.level("policy")
    assert row.policy["base"] == "highest" and row.policy["default"] is None
    introduced = {e.name: e.introduced for e in row.layers}
    assert introduced["v_head.0"] > 1e-4 > 1e-6 > introduced["body.0"]  # bf16 in the head only
    assert all(m == "ieee" for k, m in report.level("highest").maths.items() if k == "matmul")


def test_a_policy_with_a_rule_that_matches_nothing_is_refused_before_the_model_runs(workload):
    with pytest.raises(Tf32LabError, match="rule 1 'v_haed' matches no module of ValueModel"):
        tf32lab.check(workload, policy=Policy("high", [("v_haed", "highest")]))
    with pytest.raises(Tf32LabError, match=r"takes a tf32lab\.Policy"):
        tf32lab.check(workload, policy={"default": "high"})


def test_the_policy_is_off_the_model_after_check(workload):
    tf32lab.check(workload, levels=("high",), policy=Policy("high", [("v_head", "highest")]))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in workload.model.modules())
    Policy("highest").apply(workload.model).remove()  # no policy left applied


# -- the command line ----------------------------------------------------------------------------------------
def cli(*args, cwd):
    return cli_runner.run(*args, module="tf32lab.cli", timeout=300, cwd=cwd)


def test_check_with_a_policy_file_adds_the_row_in_every_format(tmp_path):
    (tmp_path / "valuemodel.py").write_text(MODEL)
    Policy("high", [("v_head", "highest")]).save(tmp_path / "policy.toml")
    done = cli("check", "valuemodel:make", "--levels", "high", "--policy", "policy.toml", "--json", "r.json",
               "--html", "r.html", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "PASSED | level 'policy' | output 'output' | normwise" in done.stdout
    assert "The policy (`high` by default, 'v_head' → `highest`) is within tolerance" in done.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["levels"][-1]["policy"]["rules"] == [{"pattern": "v_head", "level": "highest"}]
    assert "v_head" in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("text, message", [
    ('{"schema_version": 1, "default": "fast"}', "policy default: unknown level 'fast'"),
    ('{"schema_version": 1, "rules": [{"pattern": "v_haed", "level": "highest"}]}',
     "rule 1 'v_haed' matches no module of ValueModel"),
    ("{", "not JSON"),
])
def test_check_with_a_bad_policy_file_exits_2_with_one_line(tmp_path, text, message):
    (tmp_path / "valuemodel.py").write_text(MODEL)
    (tmp_path / "p.json").write_text(text)
    done = cli("check", "valuemodel:make", "--policy", "p.json", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_policy_show_prints_each_modules_level_and_the_rule_that_gave_it(tmp_path):
    (tmp_path / "valuemodel.py").write_text(MODEL)
    Policy("high", [("v_head.2", "medium"), ("v_head", "highest")]).save(tmp_path / "p.json")
    done = cli("policy", "show", "p.json", "--model", "valuemodel:make", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # the module tree in order, each module by its own name indented under its parent
    rows = [[line.split("│")[1][1:].rstrip(), *(c.strip() for c in line.split("│")[2:5])]
            for line in done.stdout.splitlines() if line.startswith("│")]
    assert rows == [
        ["(model) *", "ValueModel", "high", "default"],
        ["  body", "Sequential", "high", ""],
        ["    0", "Linear", "high", ""],
        ["    1", "Tanh", "high", ""],
        ["    2", "Linear", "high", ""],
        ["  v_head *", "Sequential", "highest", "rule 2"],
        ["    0", "Linear", "highest", ""],
        ["    1", "Tanh", "highest", ""],
        ["    2 *", "Linear", "medium", "rule 1"],
    ]
    assert "rule 1: v_head.2 -> medium" in done.stdout and "rule 2: v_head -> highest" in done.stdout
    plain = cli("policy", "show", "p.json", cwd=tmp_path)
    assert plain.returncode == 0 and "v_head.2" in plain.stdout and "high by default" in plain.stdout
    Policy("high", [("v_haed", "highest")]).save(tmp_path / "typo.json")
    typo = cli("policy", "show", "typo.json", "--model", "valuemodel:make", cwd=tmp_path)
    assert typo.returncode == 1 and "rule 1 'v_haed' matches no module" in typo.stderr


def test_policy_show_bad_input_exits_2(tmp_path):
    done = cli("policy", "show", "missing.json", cwd=tmp_path)
    assert done.returncode == 2 and "cannot read it" in done.stderr and "Traceback" not in done.stderr


def test_a_model_run_in_float64_is_untouched_by_a_policy():
    # a policy changes float32 matmuls only: float64 math is the same at every level
    model = torch.nn.Linear(8, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with Policy("medium").applied(model):
        assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))


TUNE_NET = textwrap.dedent("""
    import sys
    sys.path.insert(0, {examples!r})
    from model import make
""")


@pytest.fixture
def sensitive(tmp_path):
    """The tune example (one small layer TF32 breaks) as ``net.py:make``, and a policy that pins that layer."""
    from pathlib import Path

    examples = str(Path(__file__).resolve().parents[1] / "examples" / "tune")
    (tmp_path / "net.py").write_text(TUNE_NET.format(examples=examples))
    (tmp_path / "pinned").mkdir()
    Policy("high", [("sens.lin", "highest")]).save(tmp_path / "pinned" / "tuned.json")
    Policy("high").save(tmp_path / "uniform.json")
    return tmp_path


def test_check_policy_exits_by_the_policys_verdict_with_one_recommendation(sensitive):
    done = cli("check", "net.py:make", "--levels", "highest,high", "--policy", "pinned/tuned.json",
               "--no-speed", cwd=sensitive)
    assert done.returncode == 0, done.stdout + done.stderr  # high everywhere fails: context, not the verdict
    assert "FAILED | level 'high'" in done.stdout and "PASSED | level 'policy'" in done.stdout
    said = " ".join(done.stdout.split())  # the conclusion wrapped at the console's width
    assert 'Apply it with `tf32lab.Policy.load("pinned/tuned.json").apply(model)`' in said
    assert "policy.json" not in done.stdout
    assert "Keep `highest`" not in done.stdout and "next: tf32lab tune" not in done.stdout
    failing = cli("check", "net.py:make", "--levels", "highest,high", "--policy", "uniform.json", "--no-speed",
                  cwd=sensitive)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "FAILED | level 'policy'" in failing.stdout
    assert "The policy (`high` by default) fails" in " ".join(failing.stdout.split())
    assert "Apply it" not in failing.stdout


def test_the_api_verdict_with_a_policy_is_the_policys(sensitive, monkeypatch):
    monkeypatch.syspath_prepend(str(sensitive))
    net = specs.load(f"{sensitive / 'net.py'}:make")
    report = tf32lab.check(net, levels=("high",), policy=Policy("high", [("sens.lin", "highest")]), speed=False)
    assert not report.level("high").passed and report.level("policy").passed and bool(report)
    assert report.to_dict()["passed"] is True
    assert any("Apply it with `policy.apply(model)`" in line for line in report.conclusion())
    assert any("For comparison, without the policy: at `high`" in line for line in report.conclusion())


def test_a_policy_slower_than_highest_is_called_slower_not_0_8x_faster():
    """Convolutions pinned to IEEE float32 where `highest` runs them in TF32 (cuDNN's default): the policy is slower
    than `highest`, which the conclusion called "predicted 0.83x faster than `highest`"."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(1, 64, 63), torch.nn.ReLU(), torch.nn.Conv1d(64, 64, 31),
                                torch.nn.Flatten(), torch.nn.LazyLinear(16))
    workload = tf32lab.Workload(model, torch.randn(64, 1, 512), name="convs")
    report = tf32lab.check(workload, levels=("highest",), policy=Policy("high", [("0", None, "ieee"),
                                                                                  ("2", None, "ieee")]))
    row = report.level("policy")
    assert row.passed and row.speedup < 0.95, row.speedup
    sentence = next(line for line in report.conclusion() if line.startswith("The policy ("))
    assert "faster" not in sentence and f"{1 / row.speedup:.2f}x slower than `highest`" in sentence, sentence


def test_a_speedup_that_rounds_to_one_is_not_called_slower_or_faster():
    # 0.996x read "1.00x slower than `highest`": a slowdown of nothing
    from tf32lab.report.conclusion import _than_highest

    assert _than_highest(0.996) == _than_highest(1.004) == "about as fast as `highest`"
    assert _than_highest(0.99) == "1.01x slower than `highest`" and _than_highest(1.01) == "1.01x faster than `highest`"
