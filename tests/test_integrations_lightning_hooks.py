"""`Tf32Check` follows the LightningModule's own hooks around the optimizer step as the Trainer does:
`on_before_zero_grad`, `optimizer_zero_grad`, `on_before_backward`, `backward`, `on_after_backward`,
`on_before_optimizer_step` (beside `optimizer_step` and `configure_gradient_clipping`), and its copies read
`self.trainer.global_step` as `self.global_step`: the check's step."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("pytorch_lightning")
from tf32lab.integrations.lightning import Tf32Check  # noqa: E402


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


class Plain(L.LightningModule):
    """No dropout, plain SGD; the run's own losses, each batch's, kept on the module (the check's copies keep
    theirs on their own copies of the list)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.seen: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = (self(batch[0]) - batch[1]).pow(2).mean()
        self.seen.append(float(loss))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HalvesGrads(Plain):
    """Its gradients scaled, and their norm logged, in on_before_optimizer_step (a common place for both)."""

    def on_before_optimizer_step(self, optimizer):
        norm = torch.stack([p.grad.norm() for p in self.parameters()]).norm()
        self.log("grad_norm", norm)
        for p in self.parameters():
            p.grad.mul_(0.5)


class AccumulatesByHand(Plain):
    """Its own gradient accumulation: optimizer_zero_grad zeroes (to zeros, not None) every fourth batch only."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if batch_idx % 4 == 0:
            optimizer.zero_grad(set_to_none=False)


class _ClampsAfterBackward:
    """Each backward's gradients clamped in on_after_backward (under accumulation: each micro-batch's sum so far)."""

    def on_after_backward(self):
        for p in self.parameters():
            p.grad.clamp_(-0.02, 0.02)


class _ScalesItsBackward:
    """Its own backward, which doubles the loss it is given."""

    def backward(self, loss, *args, **kwargs):
        (2.0 * loss).backward(*args, **kwargs)


class ClampsAfterBackward(_ClampsAfterBackward, Plain):
    def on_after_backward(self):
        self.log("clamped", 1.0)
        super().on_after_backward()


class ScalesItsBackward(_ScalesItsBackward, Plain):
    pass


class WarmsUpByTheTrainer(Plain):
    """A learning-rate warm-up read from self.trainer.global_step (as many modules read it)."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 4)
        optimizer.step(closure=optimizer_closure)


def fit(tmp_path, module_class, callbacks=(), **options):
    """A seeded `Trainer.fit` over unshuffled batches of 8; the module, the trainer and the run's metrics rows."""
    torch.manual_seed(0)
    module = module_class()
    logger = L.loggers.CSVLogger(tmp_path, name="run")
    options = {"max_epochs": 1, "enable_progress_bar": False, "enable_checkpointing": False,
               "enable_model_summary": False, "log_every_n_steps": 1, **options}
    trainer = L.Trainer(callbacks=list(callbacks), default_root_dir=tmp_path, logger=logger, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and CPUs
        trainer.fit(module, DataLoader(data(), batch_size=8))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return module, trainer, rows


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("module_class", [HalvesGrads, AccumulatesByHand, ClampsAfterBackward, ScalesItsBackward,
                                          WarmsUpByTheTrainer])
def test_the_check_trains_as_the_modules_own_hooks_do(tmp_path, module_class, accumulate):
    # the check's float64 losses are the run's own (float32) at the same steps: each optimizer step's loss the mean
    # of its micro-batches' losses, as the run computed them before the step
    steps = 6 // accumulate
    check = Tf32Check(steps=steps, levels=("highest",))
    module, _, _ = fit(tmp_path, module_class, [check], accumulate_grad_batches=accumulate)
    run = [sum(module.seen[k * accumulate:(k + 1) * accumulate]) / accumulate for k in range(steps)]
    assert check.report.passed
    assert check.report.reference_losses == pytest.approx(run, rel=1e-4)


def test_without_its_hook_the_modules_training_is_another(tmp_path):
    # the hooks matter here: the same batches, trained without them, give other losses than the tests above compare
    plain, _, _ = fit(tmp_path / "a", Plain)
    for module_class in (HalvesGrads, AccumulatesByHand, ClampsAfterBackward, ScalesItsBackward,
                         WarmsUpByTheTrainer):
        hooked, _, _ = fit(tmp_path / module_class.__name__, module_class)
        assert hooked.seen[0] == plain.seen[0] and hooked.seen[5] != pytest.approx(plain.seen[5], rel=1e-3)


calls: list[str] = []  # every hook call, the run's and the check's copies', in order


class Records(Plain):
    """Each of its hooks noted in `calls` (and logged, which the check's copies must neither fail on nor pass to
    the run's loggers)."""

    def _noted(self, name):
        calls.append(name)
        self.log(f"hook/{name}", float(len(calls)))

    def training_step(self, batch, batch_idx):
        self._noted("training_step")
        return super().training_step(batch, batch_idx)

    def on_before_zero_grad(self, optimizer):
        self._noted("on_before_zero_grad")

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self._noted("optimizer_zero_grad")
        optimizer.zero_grad()

    def on_before_backward(self, loss):
        self._noted("on_before_backward")

    def backward(self, loss, *args, **kwargs):
        self._noted("backward")
        super().backward(loss, *args, **kwargs)

    def on_after_backward(self):
        self._noted("on_after_backward")

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        self._noted("optimizer_step")
        optimizer.step(closure=optimizer_closure)

    def on_before_optimizer_step(self, optimizer):
        self._noted("on_before_optimizer_step")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self._noted("configure_gradient_clipping")


class Marked(Tf32Check):
    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        calls.append("-- the check ends")


def test_the_modules_hooks_are_called_in_the_runs_order(tmp_path):
    # one optimizer step of two accumulated micro-batches, in the run and in the check's last row
    calls.clear()
    fit(tmp_path, Records, [Marked(steps=1, levels=("highest",))], accumulate_grad_batches=2, max_steps=1)
    end = calls.index("-- the check ends")
    check, run = calls[:end], calls[end + 1:]
    last = len(check) - check[::-1].index("configure_gradient_clipping")
    row = check[last - len(run):last]
    # the check enters optimizer_step after the step's training_steps ran (the closure it is given returns their
    # loss): code before its optimizer.step(closure) runs later in the step, the update the same
    assert run.count("optimizer_step") == row.count("optimizer_step") == 1
    assert [c for c in row if c != "optimizer_step"] == [c for c in run if c != "optimizer_step"]
    assert run == ["training_step", "on_before_zero_grad", "optimizer_zero_grad", "on_before_backward", "backward",
                   "on_after_backward", "optimizer_step", "training_step", "on_before_backward", "backward",
                   "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping"]


def test_the_hooks_logs_stay_out_of_the_run_and_the_run_is_untouched(tmp_path):
    calls.clear()
    plain, plain_trainer, plain_rows = fit(tmp_path / "a", Records, accumulate_grad_batches=2)
    calls.clear()
    check = Tf32Check(steps=2, levels=("highest", "high"))
    checked, trainer, rows = fit(tmp_path / "b", Records, [check], accumulate_grad_batches=2)
    assert check.report.passed
    assert all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(), checked.state_dict().values()))
    assert trainer.global_step == plain_trainer.global_step == 4
    # the hooks' own logs are the run's alone (their values count every call, the check's copies' included)
    strip = lambda rows: [{k: v for k, v in r.items() if v and not k.startswith(("hook/", "tf32lab/"))}  # noqa: E731
                          for r in rows]
    assert [r for r in strip(rows) if r.keys() - {"step", "epoch"}] == \
        [r for r in strip(plain_rows) if r.keys() - {"step", "epoch"}]
    logged = {k for r in rows for k, v in r.items() if v and k.startswith("hook/")}
    assert logged == {k for r in plain_rows for k, v in r.items() if v and k.startswith("hook/")}


steps_seen: list[tuple[int, int]] = []


class ReadsBothSteps(Plain):
    def training_step(self, batch, batch_idx):
        steps_seen.append((self.global_step, self.trainer.global_step))
        return super().training_step(batch, batch_idx)


def test_self_trainer_global_step_is_the_checks_step_as_self_global_step_is(tmp_path):
    steps_seen.clear()
    check = Tf32Check(steps=3, levels=("highest",))
    _, trainer, _ = fit(tmp_path, ReadsBothSteps, [check], max_steps=3)
    in_check = steps_seen[:-3]  # the run's own three steps come last
    assert {a for a, _ in in_check} == {0, 1, 2}
    assert all(a == b for a, b in in_check)
    assert steps_seen[-3:] == [(0, 0), (1, 1), (2, 2)] and trainer.global_step == 3


class StopsOnANonFiniteLoss(Plain):
    """A divergence guard: a non-finite loss stops the run (`self.trainer.should_stop`). Its loss has a term that
    is infinite where a matmul rounds its input to TF32 (1 + 2^-12 becomes 1), and tiny where it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("one", torch.ones(1, 1))

    def training_step(self, batch, batch_idx):
        gap = (torch.full((1, 1), 1 + 2.0 ** -12, dtype=self.one.dtype) @ self.one - 1).squeeze()
        return super().training_step(batch, batch_idx) + 1e-30 / gap

    def on_before_backward(self, loss):
        if not torch.isfinite(loss):
            self.trainer.should_stop = True


def test_a_hook_that_stops_a_diverging_row_stops_the_check_not_the_run(tmp_path):
    # `high` diverges (an infinite loss) and its copy's guard sets should_stop: on the check's trainer, not the run's
    check = Tf32Check(steps=2, levels=("highest", "high"))
    _, trainer, _ = fit(tmp_path, StopsOnANonFiniteLoss, [check], max_steps=4)
    high = check.report.level("high")
    assert check.report.level("highest").passed and high.failure == "the loss is inf"
    assert trainer.global_step == 4 and not trainer.should_stop


class Manual(Plain):
    """Manual optimization: Lightning's manual_backward calls on_before_backward, backward and on_after_backward,
    and the optimizer's step on_before_optimizer_step, as automatic optimization does."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = (self(batch[0]) - batch[1]).pow(2).mean()
        self.seen.append(float(loss))
        self.manual_backward(loss)
        optimizer.step()
        return loss


class ManualClampsAfterBackward(_ClampsAfterBackward, Manual):
    pass


class ManualScalesItsBackward(_ScalesItsBackward, Manual):
    pass


class ManualHalvesGrads(Manual):
    def on_before_optimizer_step(self, optimizer):
        for p in self.parameters():
            p.grad.mul_(0.5)


@pytest.mark.parametrize("module_class", [ManualClampsAfterBackward, ManualScalesItsBackward, ManualHalvesGrads])
def test_manual_optimization_trains_as_the_modules_own_hooks_do(tmp_path, module_class):
    check = Tf32Check(steps=6, levels=("highest",))
    module, _, _ = fit(tmp_path, module_class, [check])
    assert check.report.passed
    assert check.report.reference_losses == pytest.approx(module.seen[:6], rel=1e-4)
