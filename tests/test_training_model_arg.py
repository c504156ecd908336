"""A loss or inputs function that needs the model: given the row's copy as an argument (``loss(output, batch,
model)``, ``inputs(batch, model)``), and, where one closes over the original model instead, a float64 failure that
says so and what to write (gpytorch's tutorial: ``mll = ExactMarginalLogLikelihood(likelihood, model)``)."""

from __future__ import annotations

import functools

import pytest
import torch

from tf32lab import TrainingWorkload, check_training
from tf32lab.errors import Tf32LabError
from tf32lab.workloads.training import takes_model

gpytorch = pytest.importorskip("gpytorch")


class GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean = gpytorch.means.ConstantMean()
        self.covar = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean(x), self.covar(x))


def gp_fit(loss_of_copy: bool) -> TrainingWorkload:
    """gpytorch's regression tutorial on 20 points, 3 steps of Adam: its loss closes over ``mll`` (the original
    model's), or, with ``loss_of_copy``, builds it from the model it is given."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(20, 2, generator=g)
    y = torch.sin(6 * x.sum(-1)) + 0.01 * torch.randn(20, generator=g)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = GP(x, y, likelihood)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    if loss_of_copy:
        def loss(output, batch, model):
            return -gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)(output, batch[1])
    else:
        def loss(output, batch):
            return -mll(output, batch[1])
    return TrainingWorkload(model, [(x, y)] * 3, loss=loss, inputs=lambda b: b[0],
                            optimizer=lambda params: torch.optim.Adam(params, lr=0.1), name="gp")


def test_a_loss_closing_over_the_original_gp_says_what_to_write():
    with pytest.raises(Tf32LabError) as raised:
        check_training(gp_fit(loss_of_copy=False), levels=("highest", "high"), speed=False)
    message = str(raised.value)
    assert "fails in float64" in message and "\n" not in message
    assert "the loss uses the workload's own model through 'mll' (an ExactMarginalLogLikelihood)" in message
    assert "loss=lambda output, batch, model: ..." in message
    assert "ExactMarginalLogLikelihood(model.likelihood, model)" in message


def test_a_loss_given_the_rows_copy_trains_the_gp_in_every_row():
    workload = gp_fit(loss_of_copy=True)
    before = {n: p.detach().clone() for n, p in workload.model.named_parameters()}
    report = check_training(workload, levels=("highest", "high"), speed=False)
    assert report.level("highest").failure is None and report.level("high").failure is None
    # the copies trained their own noise: the float64 reference's loss moved, step by step
    losses = report.reference_losses
    assert len(losses) == 3 and losses[2] < losses[0]
    # and the caller's model is untouched: no gradient, no step
    for name, p in workload.model.named_parameters():
        assert p.grad is None and torch.equal(p.detach(), before[name]), name


def linear_workload(**kwargs) -> TrainingWorkload:
    torch.manual_seed(0)
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(3)]
    return TrainingWorkload(torch.nn.Linear(8, 1), data, **kwargs)


def mse(out, batch):
    return (out - batch[1]).pow(2).mean()


def test_inputs_given_the_model_get_the_rows_copy():
    seen = []

    def inputs(batch, model):
        seen.append(next(model.parameters()).dtype)
        return batch[0].to(next(model.parameters()).dtype)

    workload = linear_workload(loss=mse, inputs=inputs)
    report = check_training(workload, levels=("highest",), speed=False)
    assert report.level("highest").failure is None
    assert torch.float64 in seen and torch.float32 in seen
    assert all(p.grad is None for p in workload.model.parameters())


def test_weight_decay_on_the_original_is_named_and_on_the_copy_runs():
    model_holder = {}

    def closing(out, batch):
        return mse(out, batch) + 1e-3 * model_holder["model"].weight.pow(2).sum()

    workload = linear_workload(loss=closing, inputs=lambda b: b[0])
    model_holder["model"] = workload.model
    assert "through 'model_holder' (a dict)" in (workload.reaching_model() or "")
    with pytest.raises(Tf32LabError, match="through 'model_holder'"):
        check_training(workload, levels=("highest",), speed=False)

    given = linear_workload(loss=lambda out, batch, model: mse(out, batch) + 1e-3 * model.weight.pow(2).sum(),
                            inputs=lambda b: b[0])
    assert given.reaching_model() is None
    assert check_training(given, levels=("highest",), speed=False).level("highest").failure is None


def test_reaching_model_follows_partials_bound_methods_and_held_objects():
    workload = linear_workload(loss=mse, inputs=lambda b: b[0])
    model = workload.model

    class Penalty:
        def __init__(self):
            self.owner = {"net": model}

        def __call__(self, out, batch):
            return mse(out, batch)

        def method(self, out, batch):
            return mse(out, batch)

    def with_model(out, batch, net):
        return mse(out, batch)

    for loss in (functools.partial(with_model, net=model), Penalty(), Penalty().method):
        workload.loss = loss
        assert workload.reaching_model() is not None, loss
    workload.loss = mse
    assert workload.reaching_model() is None


@pytest.mark.parametrize("fn, given, expected", [
    (lambda out, batch: 0, 2, False),
    (lambda out, batch, model: 0, 2, True),
    (lambda out, batch, reduction="mean": 0, 2, False),   # a third parameter with a default is not the model
    (lambda out, batch, model=None: 0, 2, True),           # unless it is named model
    (lambda *args: 0, 2, False),
    (torch.nn.MSELoss(), 2, False),
    (lambda batch: 0, 1, False),
    (lambda batch, model: 0, 1, True),
])
def test_which_functions_take_the_model(fn, given, expected):
    assert takes_model(fn, given) is expected
