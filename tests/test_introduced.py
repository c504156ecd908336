"""``check(introduced=...)``: where each layer is rerun for the error it introduces. By default a level that passes
reports its layers' accumulated errors only, and a level that fails has its layers rerun by a second float64 pass:
the same errors, bit for bit, as a check that reruns every level in the reference's one pass."""

from __future__ import annotations

import gc
import io
import json
import math

import jsonschema
import pytest
import rich.console
import torch

import cli_runner
import tf32lab
from tf32lab.report import schema
from tf32lab.report.html import layer_chart


class _Noisy(torch.nn.Module):
    """Draws noise inside a layer-free step between two layers: the second pass must draw what the first drew."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.01 * torch.randn_like(x)


def _workload() -> tf32lab.Workload:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), _Noisy(), torch.nn.Tanh(), torch.nn.Linear(128, 32),
                                torch.nn.Linear(32, 8))
    return tf32lab.Workload(model, torch.randn(16, 64), name="mlp")


def _layers(row) -> list[tuple]:
    return [(e.name, e.kind, e.calls, e.introduced, e.accumulated, e.diverged, e.order) for e in row.layers]


def test_only_a_failing_level_is_rerun_and_its_layers_errors_are_those_of_a_check_rerunning_every_level(reruns):
    # 1e-5: float32 `highest` passes (~1e-7), TF32 fails (~1e-4)
    found = tf32lab.check(_workload(), levels=("highest", "high"), tolerance=1e-5, speed=False)
    highest, high = found.levels
    assert highest.passed and not high.passed
    # each layer once, at `high`, none at `highest`; the first, fed the model's own inputs, is its row's own call
    assert sorted(reruns) == ["3", "4"]
    assert not highest.reruns and all(math.isnan(e.introduced) and 0 < e.accumulated < 1e-5
                                      for e in highest.layers)
    assert high.reruns and all(1e-6 < e.introduced < 1e-2 for e in high.layers)
    reruns.clear()
    every = tf32lab.check(_workload(), levels=("highest", "high"), tolerance=1e-5, speed=False, introduced="all")
    assert sorted(reruns) == ["3", "3", "4", "4"]
    assert _layers(high) == _layers(every.level("high"))  # ranked alike, each number the same
    assert {e.name: e.accumulated for e in highest.layers} == \
        {e.name: e.accumulated for e in every.level("highest").layers}
    assert found.conclusion() == every.conclusion()
    said = [n for n in found.notes if n.startswith("the layers were not rerun at `highest`, which passed")]
    assert len(said) == 1 and 'introduced="all"' in said[0]
    assert not [n for n in every.notes if "were not rerun" in n]


def test_a_check_where_every_level_passes_reruns_no_layer_and_says_what_it_measured(reruns):
    report = tf32lab.check(_workload(), levels=("highest", "high"), speed=False)
    assert report.passed and reruns == []
    assert all(not row.reruns for row in report.levels)
    console = rich.console.Console(width=200, record=True, file=io.StringIO())
    report.print(console)
    text = " ".join(console.export_text().split())  # the title wraps at the table's width
    assert "Layers, most error accumulated first (3 of 3) ┏" in text  # the title ends there: accumulated only
    data = report.to_dict()
    jsonschema.validate(data, schema())
    assert [row["reruns"] for row in data["levels"]] == [False, False]
    assert all(layer["introduced"] == "nan" for row in data["levels"] for layer in row["layers"])
    # the page draws no bar where nothing was rerun, only each layer's accumulated error
    chart = layer_chart(report)
    assert all(bar["w"] == 0.0 and bar["cx"] > 0 for row in chart["rows"] for bar in row["bars"])
    assert "introduced not measured" in chart["rows"][0]["bars"][0]["title"]
    # with no bar to say whose it is, each dot takes its level's colour, as the page's legend gives it
    assert [bar["dot"] for bar in chart["rows"][0]["bars"]] == ["#4c78a8", "#f58518"]
    assert 'r="2.5" fill="#f58518"' in report.to_html()


def test_the_note_names_every_level_not_rerun_those_computed_alike_included():
    # on an A100 `medium` computes as `high`: measured once, and not rerun at either
    report = tf32lab.check(_workload(), speed=False)
    assert [row.level for row in report.levels] == ["highest", "high", "medium"]
    assert report.level("medium").same_as == "high" and not report.level("medium").reruns
    assert any(n.startswith("the layers were not rerun at `highest`, `high`, `medium`, which passed")
               for n in report.notes), report.notes


def test_a_policy_reruns_every_level_at_once(reruns):
    policy = tf32lab.Policy(default="high", rules=[("4", "highest")])
    report = tf32lab.check(_workload(), levels=("highest", "high"), speed=False, policy=policy)
    assert all(row.reruns for row in report.levels)
    assert sorted(reruns) == ["3", "3", "4", "4"]


@pytest.mark.parametrize("bad", ["some", "", None, 1])
def test_a_bad_introduced_is_one_clear_error(bad):
    before = tf32lab.flags.snapshot()
    with pytest.raises(tf32lab.Tf32LabError, match=r"^introduced must be 'failing' or 'all', not "):
        tf32lab.check(_workload(), levels=("high",), introduced=bad)
    assert tf32lab.flags.snapshot() == before


@pytest.mark.parametrize(("args", "message"), [
    (["--introduced", "every"], "argument --introduced: invalid choice: 'every' (choose from 'failing', 'all')"),
    (["--introduced", "all", "--train"], "--introduced all goes with a check of the forward"),
    # the training check measures each module's backward at every level: not "no layer's introduced error"
    (["--introduced", "all", "--train"], "--train measures each module's own backward error at every level"),
    (["--introduced", "failing", "--generate", "2"], "--generate measures no layer's error"),
])
def test_cli_introduced_bad_input_exits_2_in_one_line(args, message):
    done = cli_runner.run("check", "builtin", *args, module="tf32lab.cli", timeout=300)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_cli_introduced_all_reruns_every_level():
    done = cli_runner.run("check", "tf32lab.workloads.builtin:covariance", "--levels", "highest,high",
                          "--introduced", "all", "--no-speed", "--json", "-", module="tf32lab.cli", timeout=300)
    assert done.returncode == 1, done.stderr
    rows = json.loads(done.stdout)["levels"]
    assert [row["reruns"] for row in rows] == [True, True]
    assert all(isinstance(layer["introduced"], float) for row in rows for layer in row["layers"])


def test_an_emulated_op_on_meta_tensors_passes_through_uncounted():
    # DTensor infers an op's sharding on meta tensors the first time it meets it: not an op the model computes
    x, w = torch.empty(4, 8, device="meta"), torch.empty(3, 8, device="meta")
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        out = torch.addmm(torch.empty(3, device="meta"), x, w.t())
        linear = torch.nn.functional.linear(x, w)
    assert out.device.type == "meta" and out.shape == (4, 3) and linear.shape == (4, 3)
    assert not emu.coverage and not emu.unhandled


def test_the_second_pass_holds_none_of_the_first_pass_kept_outputs():
    # the layers' float64 outputs the first pass kept, alive where the second begins: both passes' at once. The
    # collector off: a reference cycle that only it frees counts as held (it runs at a time of its own choosing)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Linear(48, 48), torch.nn.Linear(48, 8))
    alive: list[int] = []

    def at_a_float64_pass(module, args):
        if args[0].dtype == torch.float64:
            alive.append(sum(1 for o in gc.get_objects() if type(o) is torch.Tensor
                             and o.dtype == torch.float64 and o.shape == (4, 48)))

    model[0].register_forward_pre_hook(at_a_float64_pass)
    enabled = gc.isenabled()
    gc.disable()
    try:
        report = tf32lab.check(tf32lab.Workload(model, torch.randn(4, 16), name="mlp"), levels=("high",),
                               tolerance=1e-7, speed=False)
    finally:
        if enabled:
            gc.enable()
    assert not report.passed and report.level("high").reruns
    assert alive == [0, 0]  # the first pass, and the second, each beginning with no layer's output kept


class _SecondFloat64CallRaises(torch.nn.Module):
    """Runs once in float64, then raises: a model that does not run the same way twice (an iterator it drains)."""

    def __init__(self, calls: list[int]) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.calls = lambda: calls  # held outside the model's state, which is put back before each run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            self.calls().append(1)
            if len(self.calls()) > 1:
                raise ValueError("drained")
        return self.b(torch.tanh(self.a(x)))


def test_a_model_that_raises_in_the_second_pass_keeps_its_rows_and_is_told_why_no_layer_has_an_introduced_error():
    # the rows ran and were measured: the report stands, the second pass's error in its notes (it was lost whole,
    # or said to have come "before any level ran")
    torch.manual_seed(0)
    model, x = _SecondFloat64CallRaises([]), torch.randn(8, 16)
    before, given = tf32lab.flags.snapshot(), x.clone()
    report = tf32lab.check(tf32lab.Workload(model, x, name="once"), levels=("high",), tolerance=1e-7, speed=False)
    high = report.level("high")
    assert not high.passed and high.error is None and not high.reruns
    assert all(math.isnan(e.introduced) and 0 < e.accumulated < 1e-2 for e in high.layers)
    assert "each layer's introduced error at `high` is not measured: workload 'once' raised at the float64 " \
           "reference, run again after the rows, for the introduced errors at 'high', which failed (check(" \
           "introduced=\"all\") measures them in the first): ValueError: drained" in report.notes
    assert not [n for n in report.notes if "were not rerun" in n]  # it failed: not among the levels that passed
    assert tf32lab.flags.snapshot() == before and torch.equal(x, given) and model.training


_UNSEEDED = torch.Generator()  # a generator no run seeds: each run draws other noise


class _OwnNoise(torch.nn.Module):
    """Fed the model's input, nothing nested: its introduced error is its accumulated one in the row."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.w)
        return y + 1e-3 * torch.randn(y.shape, generator=_UNSEEDED).to(y.dtype)


def test_a_layer_fed_the_models_input_introduces_what_it_accumulated_in_the_row_reported_not_in_its_rerun():
    # `highest` fails and is run once more (unstable: the noise differs): that second run's errors are not reported,
    # and the layer's introduced error, read from the row, was read from it
    torch.manual_seed(0)
    _UNSEEDED.manual_seed(0)
    model = torch.nn.Sequential(_OwnNoise(), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 16), name="noisy"), levels=("highest",),
                           tolerance=1e-7, speed=False)
    row = report.level("highest")
    assert row.unstable and row.reruns
    layer = next(e for e in row.layers if e.name == "0")
    assert layer.introduced == layer.accumulated


class _Gram(torch.nn.Module):
    """Its matmuls its own, fed the model's input: its one layer's introduced error is its accumulated one."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        return h.T @ h


def test_where_no_layer_call_would_be_rerun_a_failing_level_takes_no_second_float64_pass(reruns):
    float64_runs: list[int] = []

    def make() -> tf32lab.Workload:
        torch.manual_seed(0)
        model = _Gram()
        model.register_forward_pre_hook(lambda m, args: float64_runs.append(1) if args[0].dtype == torch.float64
                                        else None)
        return tf32lab.Workload(model, torch.randn(64, 32), name="gram")

    found = tf32lab.check(make(), levels=("highest", "high"), tolerance=1e-5, speed=False)
    assert len(float64_runs) == 1 and reruns == []  # the reference's one pass
    every = tf32lab.check(make(), levels=("highest", "high"), tolerance=1e-5, speed=False, introduced="all")
    assert not found.level("high").passed and found.level("high").reruns
    assert _layers(found.level("high")) == _layers(every.level("high"))
    assert found.level("high").layers[0].introduced == found.level("high").layers[0].accumulated > 0


def test_where_highest_fails_too_the_conclusion_does_not_say_keep_it():
    # covariance at a tolerance float32 itself misses: "Keep `highest`" and then "Even `highest` fails" contradicted
    from tf32lab.workloads import builtin

    report = tf32lab.check(builtin.covariance(), levels=("highest", "high"), tolerance=1e-6, speed=False)
    assert not report.level("highest").passed and not report.level("high").passed
    first, *rest = report.conclusion()
    assert first.startswith("No level passes: at `high` the output 'output' is off by")
    assert any(line.startswith("Even `highest` fails") for line in rest)
    assert not any("Keep `highest`" in line for line in report.conclusion())


class _ScalesItsInput(torch.nn.Module):
    """A layer that writes into its own input: it cannot be rerun fed what it had, so its introduced error is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(1.5)
        return x @ self.w


@pytest.mark.parametrize("introduced", ["failing", "all"])
def test_a_layer_whose_introduced_error_is_not_measured_comes_last_in_a_failing_levels_ranking(introduced):
    # its NaN ranked first: layers[0] and top_layers(), "those that introduce the most error", named the one layer
    # whose introduced error is not known, as the text table (which ranks it last) did not
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), _ScalesItsInput(), torch.nn.Linear(32, 8))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 32), name="scales"), levels=("high",),
                           tolerance=1e-6, speed=False, introduced=introduced)
    high = report.level("high")
    assert not high.passed and high.reruns
    assert sorted(e.name for e in high.layers[:2]) == ["0", "3"] and high.layers[2].name == "2"
    assert high.layers[0].introduced > high.layers[1].introduced > 0 and math.isnan(high.layers[2].introduced)
    assert "not fed" in high.layers[2].diverged
    assert [e.name for e in high.top_layers(2)] == [e.name for e in high.layers[:2]]


def test_a_layer_rerun_adds_nothing_to_the_outputs_transformers_captures_by_hooks():
    # transformers 5 gathers a model's attentions with forward hooks on its attention modules, each appending the
    # call's output to the forward's collection: every rerun of an attention (a layer) in the float64 pass appended
    # its own, and the reference had 'attentions.2' (missing here, the reference has it) and its 'attentions.1' was
    # another call's: every level failed
    transformers = pytest.importorskip("transformers")

    def make() -> tf32lab.Workload:
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                         bos_token_id=0, eos_token_id=0, attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(config).eval()
        return tf32lab.Workload(model, {"input_ids": torch.randint(0, 100, (2, 12)), "output_attentions": True},
                                name="gpt2")

    every = tf32lab.check(make(), levels=("highest", "high"), introduced="all", speed=False)
    found = tf32lab.check(make(), levels=("highest", "high"), tolerance=1e-6, speed=False)
    for report in (every, found):
        highest = report.level("highest")
        attentions = sorted(o.name for o in highest.outputs if o.name.startswith("attentions"))
        assert attentions == ["attentions.0", "attentions.1"], highest.outputs
        assert highest.passed and all(o.normwise < 1e-6 for o in highest.outputs), highest.outputs
    assert not found.level("high").passed and found.level("high").reruns
    assert [o.normwise for o in every.level("high").outputs] == [o.normwise for o in found.level("high").outputs]


class _ShiftedIn(torch.nn.Module):
    """Its middle layer's input shifted by a forward pre-hook of the model's own."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)
        self.b.register_forward_pre_hook(lambda module, args: (args[0] + 1,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("introduced", ["failing", "all"])
def test_a_layers_forward_pre_hook_is_applied_once_in_its_rerun(introduced):
    # the rerun was fed the inputs as the hook had made them, and the hook ran again: b computed b(x + 2) against
    # the reference's b(x + 1), its introduced error 0.8 at every level (its accumulated 1e-7 at `highest`), and
    # it was the layer said to introduce the most error
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_ShiftedIn(), torch.randn(8, 32), name="shifted"),
                           levels=("highest", "high"), tolerance=1e-9, speed=False, introduced=introduced)
    for row in report.levels:
        b = next(e for e in row.layers if e.name == "b")
        assert not row.passed and row.reruns and b.diverged is None
        assert 0 < b.introduced < (1e-6 if row.level == "highest" else 1e-2), (row.level, b)


def test_a_layer_not_fed_is_not_said_to_follow_control_flow_that_depends_on_the_data():
    # its reruns cannot be fed what its call had: nothing of the model's control flow, yet the conclusion said the
    # layer "could not be matched with the reference at every call (...): control flow that depends on the data"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), _ScalesItsInput(), torch.nn.Linear(32, 8))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 32), name="scales"), levels=("high",),
                           tolerance=1e-6, speed=False)
    layer = next(e for e in report.level("high").layers if e.name == "2")
    assert "not fed: it changes its own inputs in place" in layer.diverged
    assert not [line for line in report.conclusion() if "control flow" in line], report.conclusion()


class _DoublesItsPart(torch.nn.Module):
    """A layer (its own product) around a layer whose output a forward hook of the model's doubles."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32) / 6)
        self.part = torch.nn.Linear(32, 32)
        self.part.register_forward_hook(lambda module, args, output: output * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(x @ self.w)


def test_a_nested_layer_answers_its_rerun_parent_with_its_output_as_its_hooks_left_it_not_hooked_again():
    # the nested layer answered with its reference output, taken after its forward hook, and the hook ran on the
    # answer again: the parent's introduced error was 1.0 at every level, and it was the layer named as the worst
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), _DoublesItsPart(), torch.nn.Linear(32, 8))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 32), name="doubles"), levels=("highest", "high"),
                           tolerance=1e-9, speed=False)
    for row in report.levels:
        parent = next(e for e in row.layers if e.name == "2")
        assert row.reruns and parent.diverged is None
        assert 0 < parent.introduced < (1e-6 if row.level == "highest" else 1e-2), (row.level, parent)

class _Exact(torch.nn.Module):
    """An identity product of values float32 holds exactly: no error at `highest`, and at `high` the low bits go."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(4))

    def forward(self, x):
        return self.lin(x) * 2


@pytest.mark.parametrize("introduced", ["failing", "all"])
def test_a_layer_without_error_has_an_accumulated_error_of_zero_not_nan(introduced):
    # the largest error over a layer's calls started from 0 and kept only a larger one: an exact layer's stayed
    # unset, NaN, which the chart and the table give as not measured ("accumulated nan")
    report = tf32lab.check(tf32lab.Workload(_Exact(), torch.full((2, 4), 1 + 2 ** -12)), levels=("highest", "high"),
                           tolerance=1e-6, introduced=introduced)
    exact, lossy = report.level("highest").layers[0], report.level("high").layers[0]
    assert exact.name == "lin" and exact.accumulated == 0.0, exact
    assert lossy.accumulated > 1e-4 and lossy.introduced > 1e-4, lossy
