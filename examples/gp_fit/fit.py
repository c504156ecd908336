"""An exact Gaussian-process regression whose hyperparameters are fitted by Adam on the marginal likelihood
(gpytorch), checked as a training workload: under TF32 the kernel matrix loses positive definiteness as the
fitted noise shrinks, and the Cholesky factorization fails (gpytorch's NotPSDError) at a step where float32 goes on.

    tf32lab check examples/gp_fit/fit.py:workload --train --levels highest,high
    .venv/bin/python examples/gp_fit/fit.py [--steps 60]

gpytorch is in the test extra (``pip install 'tf32lab[test]'``), or ``pip install gpytorch``.
"""

from __future__ import annotations

import argparse

import gpytorch
import torch

import tf32lab


class ExactGP(gpytorch.models.ExactGP):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, likelihood: gpytorch.likelihoods.Likelihood) -> None:
        super().__init__(x, y, likelihood)
        self.mean = gpytorch.means.ConstantMean()
        self.covar = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean(x), self.covar(x))


class Fit(torch.nn.Module):
    """The GP and its likelihood in one module whose forward is the loss (the negative marginal log likelihood):
    every copy the training check makes then computes its own loss, from its own hyperparameters."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__()
        self.likelihood = gpytorch.likelihoods.GaussianLikelihood()
        self.gp = ExactGP(x, y, self.likelihood)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(self.likelihood, self.gp)
        return -mll(self.gp(x), y)


def data(points: int = 100, dims: int = 2, noise: float = 0.01, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth function of ``dims`` inputs in [0, 1), sampled at ``points`` points with Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(points, dims, generator=g)
    y = torch.sin(6 * x.sum(-1)) + noise * torch.randn(points, generator=g)
    return x, y


def workload(steps: int = 60, points: int = 100, dims: int = 2, noise: float = 0.01) -> tf32lab.TrainingWorkload:
    """The fit as a training workload: the same full batch every step, Adam at lr 0.1 (gpytorch's tutorials')."""
    x, y = data(points, dims, noise)
    torch.manual_seed(0)
    return tf32lab.TrainingWorkload(Fit(x, y), [(x, y)] * steps, loss=lambda loss, batch: loss,
                                    optimizer=lambda params: torch.optim.Adam(params, lr=0.1), name="gp-fit")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    report = tf32lab.check_training(workload(args.steps), levels=("highest", "high"), target="a100")
    report.print()
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
