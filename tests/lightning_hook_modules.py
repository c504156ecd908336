"""The LightningModules of tests/test_integrations_lightning_hooks.py, in a module of their own: each subclasses
Lightning's, so defining them imports Lightning (about 3 CPU seconds), which the test file's collection on every
pytest-xdist worker should not pay; the test file imports this module where a test first reads it
(tests/lazy_import.py)."""

from __future__ import annotations

import pytorch_lightning as L
import torch

from tf32lab.integrations.lightning import Tf32Check


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


steps_seen: list[tuple[int, int]] = []


class ReadsBothSteps(Plain):
    def training_step(self, batch, batch_idx):
        steps_seen.append((self.global_step, self.trainer.global_step))
        return super().training_step(batch, batch_idx)


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
