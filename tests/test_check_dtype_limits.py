"""A mask made with the dtype's own limit (``-torch.finfo(t.dtype).max``, x-transformers' ``max_neg_value``;
``torch.finfo(dtype).min``, Hugging Face's masks): float64's in the reference, which reads every dtype as float64,
float32's in the rows. Held where both hold their dtype's limit, as a NaN or Inf both hold is: an output holding
it failed every level, `highest` too, at normwise 1.0 (called float32's amplified rounding), and a layer returning
it, or -inf, had no error at all (NaN: ‖r‖² overflowed), left out of the layers table."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import tf32lab
from tf32lab.numbers import metrics

F32, F64 = torch.finfo(torch.float32).max, torch.finfo(torch.float64).max


class Scores(torch.nn.Module):
    """Causal attention scores masked as x-transformers' ``Attend`` masks them, or with -inf."""

    def __init__(self, fill: str) -> None:
        super().__init__()
        self.q, self.k, self.fill = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        future = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
        return s.masked_fill(future, -torch.finfo(s.dtype).max if self.fill == "limit" else -math.inf)


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.limit, self.inf, self.v = Scores("limit"), Scores("inf"), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.limit(x)
        return (s.softmax(-1) + self.inf(x).softmax(-1)) @ self.v(x), s


def test_the_dtypes_limit_in_both_is_held_as_inf_is():
    r = torch.randn(4, 6, dtype=torch.float64)
    y = r.float()
    r[:, 3:], y[:, 3:] = -F64, -F32
    found = metrics.compare("scores", y, r)
    assert found.passed and found.normwise < 1e-6, found
    assert "its dtype's largest" in found.note, found.note
    y[0, 4] = 0.0  # a value where the reference holds the limit: not held
    assert not metrics.compare("scores", y, r).passed


def test_a_check_of_scores_masked_with_the_dtypes_limit_holds_the_mask():
    torch.manual_seed(0)
    model = Attention()
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(2, 24, 32), name="masked"),
                           introduced="all", levels=("highest", "high"), speed=False)
    highest, high = report.level("highest"), report.level("high")
    assert highest.passed and high.passed, report.verdicts()
    scores = {o.name: o for o in high.outputs}["1"]
    assert 1e-5 < scores.normwise < 1e-2 and "dtype's largest" in scores.note, scores
    for name in ("limit", "inf"):  # each layer's error is the finite rest's, as an output's is
        at = {lv.level: next(e for e in lv.layers if e.name == name) for lv in report.levels}
        assert 0 < at["highest"].introduced < 1e-6 and 1e-5 < at["high"].introduced < 1e-2, (name, at)
        assert 0 < at["highest"].accumulated < 1e-6 and 1e-5 < at["high"].accumulated < 1e-2, (name, at)


def test_a_nan_where_the_reference_holds_a_value_is_an_error_without_bound_not_an_unmeasured_layer():
    # float32 overflows into inf - inf where float64 does not: the layer after it was "nan" (not measured, shown
    # as "-"), where the output it feeds failed at inf
    from tf32lab.measure.norms import scratch, tree_normwise

    r = torch.zeros(8, dtype=torch.float64)
    y = torch.ones(8)
    y[3] = math.nan
    assert tree_normwise(y, r + 1.0, {"output": 8.0}, scratch(r.device)) == (math.inf, None)
    both = r.clone()
    both[3] = math.nan  # the same NaN on both sides is held, as before
    assert tree_normwise(y, both + 1.0, {"output": 7.0}, scratch(r.device)) == (0.0, None)

    class Blows(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            big = torch.exp(self.lin(x) * 88.0)
            return self.out(torch.tanh(big - big))

    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(Blows(), torch.randn(4, 16), name="blows"), levels=("highest",),
                           speed=False)
    out = next(e for e in report.levels[0].layers if e.name == "out")
    assert out.accumulated == math.inf and not report.levels[0].passed


def test_a_layer_whose_reference_squares_overflow_float64_has_an_error_without_bound_not_nan():
    # a float64 value float32 cannot hold, past 1.3e154 (exp(600 x)): the row holds inf there, and its difference's
    # square and the reference's ‖r‖² both overflow float64; Inf / Inf was NaN, the layer left out as not measured
    from tf32lab.measure.norms import reference_norm2, scratch, tree_normwise

    r = torch.tensor([1e170, 1.0, 2.0], dtype=torch.float64)
    y = torch.tensor([math.inf, 1.0, 2.0])
    assert tree_normwise(y, r, {"output": reference_norm2(r)}, scratch(r.device)) == (math.inf, None)

    class Exp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # its own product: a layer of the table
            return torch.exp((x @ self.w) * 600.0)

    class Grows(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.exp, self.out = Exp(), torch.nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.exp(x) * 1e-300))

    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(Grows(), torch.randn(4, 16), name="grows"), levels=("highest",),
                           speed=False)
    exp = next((e for e in report.levels[0].layers if e.name == "exp"), None)
    assert exp is not None and exp.introduced == math.inf, report.levels[0].layers


def test_an_output_that_requires_grad_is_compared_without_a_warning():
    # a physics-informed net's input gradient, made with create_graph=True: the output requires grad, and reading
    # its extremes for the dtype's limit warned the user "Converting a tensor with requires_grad=True to a scalar"
    class Gradient(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                x = x.clone().requires_grad_(True)
                return torch.autograd.grad(self.net(x).sum(), x, create_graph=True)[0]

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = tf32lab.check(tf32lab.Workload(Gradient(), torch.rand(16, 2)), levels=("highest",))
    assert report.passed


class Floored(torch.nn.Module):
    """A log kept finite by the dtype's own resolution (``torch.finfo(x.dtype).eps``; torch.distributions'
    ``clamp_probs`` and ``probs_to_logits`` do it) over a ReLU's exact zeros."""

    def __init__(self, attribute: str) -> None:
        super().__init__()
        self.linear, self.attribute = torch.nn.Linear(32, 32), attribute

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.linear(x))
        floor = getattr(torch.finfo(h.dtype), self.attribute)
        logits = torch.distributions.Categorical(probs=h / h.sum(-1, keepdim=True)).logits
        return torch.log(h + floor), logits


@pytest.mark.parametrize("attribute", ["eps", "tiny", "smallest_normal", "resolution"])
def test_the_dtypes_resolution_read_in_the_reference_is_the_rows_float32s(attribute):
    # the reference read float64's eps (log 2.2e-16 = -36 where the rows have log 1.2e-7 = -16 at every zero): every
    # level failed at normwise 0.56, `highest` too, said to be float32 rounding amplified by the computation
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(Floored(attribute), torch.randn(16, 32)), levels=("highest", "high"))
    highest = report.level("highest")
    assert highest.passed and all(o.normwise < 1e-5 for o in highest.outputs), highest.outputs
    assert not any("amplifies float32 rounding itself" in line for line in report.conclusion())
    assert torch.finfo is torch.finfo(torch.float32).__class__ and torch.finfo(torch.float64).eps < 1e-15


def test_a_training_reference_reads_the_rows_resolution_too():
    # torch.distributions' clamp_probs in the loss path: float64's eps put float64's loss 18.2 where float32's is
    # 8.5, float32 "drifted" by 0.54, and `high` passed within 3x of that drift where it diverges by 6e-2
    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.cat([torch.relu(self.linear(x)), torch.ones(len(x), 1)], -1)
            return torch.distributions.Categorical(probs=h / h.sum(-1, keepdim=True)).logits[:, :8]

    torch.manual_seed(0)
    data = [(torch.randn(64, 32), torch.randint(0, 8, (64,))) for _ in range(3)]
    workload = tf32lab.TrainingWorkload(Classifier(), data, inputs=lambda b: b[0],
                                        loss=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]),
                                        optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    report = tf32lab.check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    assert report.floor.drift < 1e-5 and report.level("highest").passed
    assert not report.level("high").passed


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_compiled_model_reads_the_rows_resolution_and_dynamo_keeps_pytorchs_finfo():
    # the compiled forward reads the dtype's eps in the reference as the eager one does; and TorchDynamo's cache of
    # the classes whose calls it folds, were its first use inside the reference run, holds PyTorch's finfo
    user_defined = pytest.importorskip("torch._dynamo.variables.user_defined")
    folds = getattr(user_defined.UserDefinedClassVariable, "_constant_fold_classes", None)
    if folds is None:
        pytest.skip("this torch's TorchDynamo keeps no such cache")
    torch.manual_seed(0)
    model = torch.compile(Floored("eps"), backend="eager")
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(16, 32)), levels=("highest",))
    assert report.passed and torch.finfo in folds()


def test_torch_finfo_stays_a_type_while_a_reference_runs():
    # torch.finfo is swapped while the float64 reference runs: isinstance against it, on the run's thread or
    # another, still answers as PyTorch's own (a function in its place raised TypeError)
    seen = []

    class Checks(torch.nn.Module):
        def forward(self, x):
            info = torch.finfo(x.dtype)
            seen.append((isinstance(info, torch.finfo), isinstance(torch.finfo(torch.float16), torch.finfo),
                         isinstance(1.0, torch.finfo)))
            return x * info.eps

    tf32lab.check(tf32lab.Workload(Checks(), torch.randn(3)), levels=("high",), speed=False)
    assert seen and all(s == (True, True, False) for s in seen), seen
    assert isinstance(torch.finfo(torch.float32), torch.finfo)
