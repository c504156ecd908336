"""check(): it measures (sensitive workloads fail, well-conditioned ones pass), it ranks the layer that introduces
the error first, and it leaves every setting as it was."""

from __future__ import annotations

import dataclasses
import json
import math

import jsonschema
import pytest
import torch
from torch import nn

import tf32lab
from tf32lab import Tf32LabError, Workload
from tf32lab.control import flags
from tf32lab.numbers.metrics import DEFAULT_TOLERANCE
from tf32lab.report import schema
from tf32lab.workloads import builtin

# the module-scoped fixtures below are built once: the whole file runs on one xdist worker
pytestmark = pytest.mark.xdist_group("test_check")


@pytest.fixture(scope="module")
def small_report():
    return tf32lab.check(builtin.small())


@pytest.mark.parametrize("make", [builtin.rotation_round_trip, builtin.covariance], ids=["rotation", "covariance"])
def test_sensitive_workloads_exceed_the_default_tolerance_at_high(make):
    report = tf32lab.check(make(), levels=("highest", "high"))
    assert report.level("highest").passed
    high = report.level("high")
    assert not high.passed and not report
    assert high.outputs[0].normwise > 2 * DEFAULT_TOLERANCE  # clearly, not by a hair
    assert report.level("highest").outputs[0].normwise < DEFAULT_TOLERANCE / 100


def test_the_builtin_model_passes_and_measures_a_real_effect(small_report):
    assert small_report, small_report.verdicts()
    highest, high = small_report.level("highest"), small_report.level("high")
    text_highest = next(o for o in highest.outputs if o.name == "text_logits")
    text_high = next(o for o in high.outputs if o.name == "text_logits")
    assert text_high.normwise > 100 * text_highest.normwise  # TF32 is visible, IEEE is float32 noise
    assert text_high.top1 is not None and 0.0 <= text_high.top1 <= 1.0
    image_highest = next(o for o in highest.outputs if o.name == "image_logits")
    assert image_highest.normwise > 1e-5  # convs run TF32 even at highest on an A100
    assert sum(highest.coverage.values()) > 0 and not highest.unhandled


def test_levels_the_target_computes_alike_are_measured_once(small_report):
    medium = small_report.level("medium")
    assert medium.same_as == "high"  # cuBLAS has no bf16 path: medium is TF32 on CUDA
    assert medium.outputs == small_report.level("high").outputs
    amx = tf32lab.check(builtin.small(), levels=("high", "medium"), target="cpu-amx")
    assert amx.level("medium").same_as is None
    assert amx.level("medium").maths["matmul"].startswith("bf16")
    assert amx.level("medium").outputs[0].normwise > amx.level("high").outputs[0].normwise


class _Sensitive(nn.Module):
    """A well-behaved MLP beside one linear with K = 65536 on inputs far from zero, whose weights cancel."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(512, 512)
        self.sensitive = nn.Linear(65536, 16)
        with torch.no_grad():
            self.sensitive.weight -= self.sensitive.weight.mean(dim=1, keepdim=True)
        self.head = nn.Sequential(nn.Linear(528, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.first(z), self.sensitive(x)], dim=-1))


def test_the_layer_ranking_names_the_sensitive_layer_first():
    torch.manual_seed(0)
    model = _Sensitive()
    inputs = (torch.randn(8, 512), 1000.0 + torch.randn(8, 65536))
    report = tf32lab.check(Workload(model, inputs), levels=("high",))
    layers = report.level("high").layers
    assert layers[0].name == "sensitive"
    assert {layer.name for layer in layers} == {"first", "sensitive", "head.0", "head.2"}
    by_name = {layer.name: layer for layer in layers}
    assert by_name["sensitive"].introduced > 100 * by_name["first"].introduced
    # what the head shows at its output comes from upstream: accumulated, not introduced there
    assert by_name["head.2"].accumulated > 10 * by_name["head.2"].introduced
    assert by_name["sensitive"].kind == "Linear" and by_name["sensitive"].calls == 1


class _CancelsInItsForward(nn.Module):
    """The error arises in the module's own forward (a difference of two large products), after its only layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.lin(x + 1000.0) - self.lin(torch.full_like(x, 1000.0))


def test_an_error_that_grows_between_layers_is_not_blamed_on_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), _CancelsInItsForward())
    report = tf32lab.check(Workload(model, torch.randn(8, 16)), levels=("highest", "high"), target="a100",
                           speed=False)
    text = " ".join(report.conclusion())
    assert not report.passed and "no layer introduces that much" in text and "cannot tell" in text
    assert "the most error is" not in text
    worst = report.level("high").layers[0]
    assert report.level("high").worst.normwise > 100 * worst.introduced


def _settings(model: nn.Module) -> tuple:
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    return flags.snapshot(), [m.training for m in model.modules()], hooks, torch.is_grad_enabled()


class _FailsInFloat32(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.5)

    reference_raises = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dropout(self.linear(x))
        if y.dtype == torch.float32 or self.reference_raises:  # the reference (float64) passes; every level raises
            raise RuntimeError("boom")
        return y


@pytest.mark.parametrize("target", ["a100", "native"])
def test_settings_are_identical_after_a_model_raises(target):
    model = _FailsInFloat32().train()
    original = flags.snapshot()
    torch.backends.cuda.matmul.allow_tf32 = True  # a non-default global, which must survive (either API)
    try:
        before = _settings(model)
        report = tf32lab.check(Workload(model, torch.randn(4, 8)), target=target)  # a finding, not a crash
        assert not report and [lv.error for lv in report.levels] == ["RuntimeError: boom"] * 3
        assert _settings(model) == before
        assert model.training and model.dropout.training
        model.reference_raises = True
        with pytest.raises(Tf32LabError, match=r"raised at the float64 reference.*RuntimeError: boom"):
            tf32lab.check(Workload(model, torch.randn(4, 8)), target=target)
        assert _settings(model) == before
    finally:
        flags.restore(original)


def test_settings_are_identical_after_a_check(small_report):
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1)).train()
    before = _settings(model)
    report = tf32lab.check(Workload(model, torch.randn(4, 16)))
    assert _settings(model) == before
    assert report.levels[0].outputs[0].normwise < 1e-6  # eval mode while checking: dropout off


def test_native_runs_this_machines_own_modes():
    report = tf32lab.check(builtin.covariance(), target="native", levels=("highest", "high"))
    assert report.target == "native"
    assert all(not lv.coverage and not lv.maths and lv.same_as is None for lv in report.levels)
    assert report.level("highest").passed
    # no speed model for this machine: a level that passes is safe, and whether it is faster is timed, not told
    advice = report.conclusion()[0]
    assert "is safe for this workload on this machine" in advice and "--target native --measure" in advice, advice
    # the workload's own spec: `tf32lab speed --target native --measure` alone times the default demo workload
    assert "`tf32lab speed SPEC --target native --measure`" in advice, advice


def test_tolerances_per_output_and_errors():
    w = builtin.small()
    report = tf32lab.check(w, levels=("high",), tolerance={"text_logits": 1e-6, "default": 1.0})
    verdicts = {o.name: o.passed for o in report.level("high").outputs}
    assert verdicts == {"text_logits": False, "image_logits": True}
    assert any(line.startswith("FAILED | level 'high' | output 'text_logits'") for line in report.verdicts())
    with pytest.warns(UserWarning, match="logitz"):
        tf32lab.check(w, levels=("high",), tolerance={"logitz": 1.0})
    for bad in (-1.0, float("nan"), "x", True):
        with pytest.raises(Tf32LabError, match="bad tolerance"):
            tf32lab.check(w, tolerance=bad)
    with pytest.raises(Tf32LabError, match="unknown level 'fast'"):
        tf32lab.check(w, levels=("high", "fast"))
    for bad in (5, {"high": 1}, b"high"):  # a TypeError's traceback for 5; a mapping's keys taken as its levels
        with pytest.raises(Tf32LabError, match=r"^levels must be a level's name or a collection of them"):
            tf32lab.check(w, levels=bad)
    with pytest.raises(Tf32LabError, match=r"unknown target 'b900'.*'native'"):
        tf32lab.check(w, target="b900")
    with pytest.raises(Tf32LabError, match="unknown reference"):
        tf32lab.check(w, reference="float32")
    with pytest.raises(Tf32LabError, match=r"takes a tf32lab\.Workload"):
        tf32lab.check(nn.Linear(2, 2))


def test_the_workload_metric_is_reported_and_its_failure_named():
    def worst_cosine(out, ref):
        return float(1 - torch.nn.functional.cosine_similarity(out.double(), ref, dim=-1).min())

    w = Workload(nn.Linear(256, 32), torch.randn(16, 256), metric=worst_cosine)
    report = tf32lab.check(w, levels=("highest", "high"))
    assert 0 <= report.level("highest").metric < report.level("high").metric < 1e-3

    w.metric = lambda out, ref: 1 / 0
    with pytest.raises(Tf32LabError, match="metric raised ZeroDivisionError"):
        tf32lab.check(w, levels=("high",))


def test_inputs_as_tensor_tuple_and_dict_with_nested_outputs():
    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 8), nn.Linear(32, 8)

        def forward(self, x, *, scale=None):
            return {"first": self.a(x) * scale, "rest": (self.b(x), None, torch.argmax(x, -1))}

    report = tf32lab.check(Workload(Keyword(), {"x": torch.randn(4, 32), "scale": torch.tensor(2.0)}),
                           levels=("high",))
    outputs = {o.name: o for o in report.level("high").outputs}
    assert list(outputs) == ["first", "rest.0", "rest.2"]  # None has nothing to compare
    assert outputs["rest.2"].exact and outputs["rest.2"].passed  # integers: compared exactly


def test_json_follows_the_schema_and_round_trips(small_report, tmp_path):
    path = tmp_path / "report.json"
    text = small_report.to_json(path)
    data = json.loads(path.read_text())
    assert data == json.loads(text)
    jsonschema.validate(data, schema())
    assert data["schema_version"] == 3 and data["passed"] is True
    assert data["levels"][2]["same_as"] == "high"
    assert sum(data["levels"][1]["outputs"][0]["histogram"]) == 32 * 10


def test_non_finite_errors_fail_and_serialise_as_strings():
    class Overflow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            y = self.linear(x)
            return y * 1e300 if y.dtype == torch.float64 else y * torch.tensor(float("inf"))

    report = tf32lab.check(Workload(Overflow(), torch.randn(2, 4)), levels=("high",))
    assert not report
    data = report.to_dict()
    jsonschema.validate(data, schema())
    assert data["levels"][0]["outputs"][0]["normwise"] in ("inf", "nan")
    assert math.isnan(report.levels[0].outputs[0].normwise) or math.isinf(report.levels[0].outputs[0].normwise)


@pytest.mark.slow
def test_minilm_passes_at_every_level_with_every_linear_emulated():
    report = tf32lab.check(builtin.minilm())
    assert report, report.verdicts()
    high = report.level("high")
    assert not high.unhandled
    assert sum(n for op, n in high.coverage.items() if op.startswith("aten::linear tf32")) == 37
    assert 1e-5 < high.outputs[0].normwise < DEFAULT_TOLERANCE / 5
    # every level passes: no layer is rerun (check(introduced="failing")), each layer's accumulated error is measured
    assert len(high.layers) >= 37 and not high.reruns and all(math.isnan(e.introduced) for e in high.layers)
    assert all(0 < e.accumulated < DEFAULT_TOLERANCE for e in high.layers)


class _Routed(nn.Module):
    """Two experts and a hard router whose two scores nearly tie (the rows differ by 1e-3): TF32's rounding of the
    scores sends some tokens to the other expert. ``own``: the routing is this module's own code around its
    ``router`` layer (a mixture-of-experts block); else its caller's, between two layers."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        w = torch.randn(1, 32, generator=g)
        self.router = nn.Linear(32, 2, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.cat([w, w + 1e-3 * torch.randn(1, 32, generator=g)]))
        self.experts = nn.Parameter(torch.randn(2, 32, 32, generator=g) / 32 ** 0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        choice = self.router(h).argmax(-1)
        y = torch.einsum("ni,eio->neo", h, self.experts)
        return y.gather(1, choice[:, None, None].expand(-1, 1, y.shape[-1])).squeeze(1)


class _RoutedByItsCaller(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.pre, self.moe, self.head = nn.Linear(32, 32), _Routed(g), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.pre(x))
        choice = self.moe.router(h).argmax(-1)  # the routing in this module's own code, between its layers
        y = torch.einsum("ni,eio->neo", h, self.moe.experts)
        return self.head(y.gather(1, choice[:, None, None].expand(-1, 1, y.shape[-1])).squeeze(1))


@pytest.mark.parametrize("where", ["in the block", "in the caller"])
def test_an_error_that_jumps_where_tf32_flips_a_routing_choice_is_placed_there(where):
    # seed 2: every token's two scores differ by at least 2.2e-4 in float64, so float32 itself routes none
    # otherwise on any CPU, and TF32 routes about a third of them otherwise
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    if where == "in the block":
        model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), _Routed(g), nn.Linear(32, 8))
    else:
        model = _RoutedByItsCaller(g)
    report = tf32lab.check(Workload(model, torch.randn(64, 32, generator=g)), levels=("highest", "high"),
                           target="a100", speed=False)
    assert report.level("highest").passed and not report.level("high").passed
    text = " ".join(report.conclusion())
    assert "no layer introduces that much" in text and "choices the float64 reference made (aten::argmax) came out" \
        " otherwise at `high`" in text, text
    if where == "in the block":  # the block is a layer (its einsum): the error grows inside it, after its router
        assert "at the output of '2' " in text and "inside '2' amplifies" in text, text
    else:  # the caller's code between its two layers
        assert "at the output of 'head' " in text and "in the code of '(model)' between 'moe.router' and it" in text
    # the order of the calls is in the report: the router ends before the layer that reads its choice
    order = {e.name: e.order for e in report.level("high").layers}
    assert order[("2" if where == "in the block" else "head")] > order[("2.router" if where == "in the block"
                                                                        else "moe.router")]


class _Cancel(nn.Module):
    """The input rides on a large offset that the product then takes away again (examples/tune's model)."""

    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n, bias=False)

    def forward(self, x):
        return self.lin(x + 1000.0) - self.lin(torch.full_like(x, 1000.0))


def test_an_error_that_jumps_in_a_model_without_choices_names_a_cancellation_too():
    # no choice op anywhere: a hint at a router's top-k alone sends the reader after something the model lacks
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), _Cancel(32), nn.Linear(32, 8))
    report = tf32lab.check(Workload(model, torch.randn(64, 32)), levels=("highest", "high"), target="a100",
                           speed=False)
    assert report.level("highest").passed and not report.level("high").passed
    assert report.level("high").choices is None
    text = " ".join(report.conclusion())
    assert "no layer introduces that much" in text and "amplifies small differences" in text, text
    assert "a cancellation (the difference of two nearly equal values)" in text, text
    assert "what feeds the choice" not in text, text


def test_the_choices_tf32_flips_are_counted_against_the_references():
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), _Routed(g), nn.Linear(32, 8))
    report = tf32lab.check(Workload(model, torch.randn(64, 32, generator=g)), levels=("highest", "high"),
                           target="a100", speed=False)
    highest, high = report.level("highest").choices, report.level("high").choices
    assert (highest.changed, highest.made, highest.comparable) == (0, 64, True)  # float32 routes every token alike
    assert 0 < high.changed < 64 and high.ops == ("aten::argmax",) and high.comparable
    text = " ".join(report.conclusion())
    assert f"{high.changed} of the 64 choices the float64 reference made (aten::argmax) came out otherwise" in text
    from tf32lab.report.text import notes  # the lines under the tables, in the terminal and the HTML page

    said = [line for line in notes(report) if line.startswith("choices: ")]
    assert said == ["choices: all 64 choices the float64 reference made (indices of top-k, argmax, sort) came out "
                    "alike at `highest`",
                    f"choices: {high.changed} of the 64 choices the float64 reference made (aten::argmax) came out "
                    f"otherwise at `high`"]
    assert f"{high.changed} of the 64 choices the float64 reference made (aten::argmax) came out otherwise" in \
        report.to_html()
    data = report.to_dict()
    assert data["levels"][1]["choices"] == {"changed": high.changed, "made": 64, "ops": ["aten::argmax"],
                                            "comparable": True}
    # a report without them (the reference's indices over budget, or a report of an older version): the jump alone
    blind = dataclasses.replace(report, levels=tuple(dataclasses.replace(lv, choices=None) for lv in report.levels))
    assert "such as a choice TF32 flips (an expert router's top-k, an argmax)" in " ".join(blind.conclusion())
    # a model that makes no choice pays nothing and reports none
    plain = tf32lab.check(Workload(nn.Linear(4, 4), torch.randn(2, 4)), levels=("high",), speed=False)
    assert plain.level("high").choices is None


def test_a_layer_whose_introduced_error_is_not_measured_still_counts_before_the_next():
    from tf32lab.report import LayerError, LevelResult
    from tf32lab.report.conclusion import _jump

    def level(*layers: LayerError) -> LevelResult:
        return LevelResult("high", {}, (), layers, None, {}, {}, 0.0)

    # 'router' could not be rerun alone (its introduced error NaN), yet its output carries 1e-2 end to end: the
    # layer after it, which carries as much, is no jump
    a = LayerError("a", "Linear", 1, 1e-4, 1e-4, None, 0)
    router = LayerError("router", "Router", 1, math.nan, 1e-2, "raised when run alone", 1)
    b = LayerError("b", "Linear", 1, 1e-4, 1.2e-2, None, 2)
    assert _jump(level(a, router, b)) is None
    # where it carries little, the next layer's jump is set against the layer just before it, 'router'
    quiet = dataclasses.replace(router, accumulated=1e-4)
    found = _jump(level(a, quiet, b))
    assert found is not None and found[0] is b and found[3] is quiet


def test_a_level_whose_choice_ops_part_from_the_references_says_so():
    from tf32lab.measure.choices import Choices
    from tf32lab.report import LevelResult
    from tf32lab.report.conclusion import _flipped

    level = LevelResult("high", {}, (), (), None, {}, {}, 0.0, choices=Choices(0, 64, (), False))
    # every index compared came out alike, but the row ran other choice ops (one more argmax: a loop that ran on)
    assert "`high` made other choice ops than the float64 reference after 64 indices alike" in (_flipped(level) or "")
    assert _flipped(dataclasses.replace(level, choices=Choices(0, 64, (), True))) is None
