"""The LightningModules of tests/test_integrations_lightning.py, in a module of their own: each subclasses Lightning's,
so defining them imports Lightning (about 3 CPU seconds), which the test file's collection on every pytest-xdist
worker should not pay; the test file imports this module where a test first reads it (tests/lazy_import.py)."""

from __future__ import annotations

from typing import ClassVar

import pytorch_lightning as L
import torch
from torch.utils.data import DataLoader

from drifting_models import offset_forward, offset_layers


class Regression(L.LightningModule):
    """A small MLP regression with a step scheduler; it logs its loss every step."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self(x) - y).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2),
                                                         "interval": "step"}}


class Offset(L.LightningModule):
    """TF32 breaks its training (tests/test_training.py's `Offset`): the gradient of `lin` is a difference of two
    large, TF32-rounded products."""

    def __init__(self) -> None:
        super().__init__()
        offset_layers(self)

    forward = offset_forward

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self(x) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class TwoOptimizers(Regression):
    """Manual optimization: the two layers stepped by two optimizers, the second one's scheduler stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        for optimizer in (first, second):
            with self.toggled_optimizer(optimizer):
                loss = (self(x) - y).pow(2).mean()
                optimizer.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(optimizer, gradient_clip_val=0.5)
                optimizer.step()
        self.lr_schedulers().step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        first = torch.optim.SGD(self.net[0].parameters(), lr=1e-2, momentum=0.9)
        second = torch.optim.Adam(self.net[3].parameters(), lr=1e-2)
        return [first, second], [torch.optim.lr_scheduler.StepLR(second, 1, gamma=0.5)]


class ReadsItsTrainer(Regression):
    """A training_step that reads `self.trainer`, `self.global_step` and `self.current_epoch`, as many do."""

    def training_step(self, batch, batch_idx):
        scale = 1.0 + 0.0 * (self.trainer.num_training_batches + self.global_step + self.current_epoch)
        return super().training_step(batch, batch_idx) * scale


class TwoLoaders(Regression):
    """Trained on two dataloaders at once: Lightning gives each step a dict of their batches."""

    def training_step(self, batch, batch_idx):
        return sum((self(x) - y).pow(2).mean() for x, y in batch.values())


class SkipsSome(Regression):
    """Skips a batch now and then (`training_step` returns None), as Lightning allows."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 4 == 1 else super().training_step(batch, batch_idx)


class Plain(L.LightningModule):
    """No dropout, plain SGD: the check's float64 losses follow the run's own logged ones closely."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = (self(batch[0]) - batch[1]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WarmsUp(Plain):
    """A learning-rate warm-up in its own optimizer_step, read from self.global_step (a common override)."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (self.global_step + 1) / 4)
        optimizer.step(closure=optimizer_closure)


class ClipsItself(Plain):
    """Its own clipping, whatever the Trainer's gradient_clip_val (configure_gradient_clipping)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=1e-3, gradient_clip_algorithm="value")


class ClipsAsTheTrainerSays(Plain):
    """Its own configure_gradient_clipping, clipping by the Trainer's gradient_clip_val (``clip_gradients``'s
    default) after the first step."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.global_step > 0:
            self.clip_gradients(optimizer)


class ClipsItselfInCapitals(ClipsItself):
    """The algorithm named as Lightning takes it too, in any case ("Value")."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=1e-3, gradient_clip_algorithm="Value")


class ClipsByValueByHand(Plain):
    """Manual optimization clipping by value, the algorithm given as Lightning's enum."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = (self(batch[0]) - batch[1]).pow(2).mean()
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1e-3,
                            gradient_clip_algorithm=L.utilities.enums.GradClipAlgorithmType.VALUE)
        optimizer.step()
        self.log("train_loss", loss)


class RaisesMidRun(Regression):
    def training_step(self, batch, batch_idx):
        if batch_idx == 6:  # the check reads batches 0 and 1 only
            raise RuntimeError("the run's own error")
        return super().training_step(batch, batch_idx)


class MakesItsLoader(Plain):
    """Its train_dataloader makes the loader of ``rows``, with workers and its own seeded generator, after the fit
    starts."""

    def __init__(self, rows) -> None:
        super().__init__()
        self.rows = rows

    def train_dataloader(self):
        return DataLoader(self.rows, batch_size=8, shuffle=True, num_workers=1,
                          generator=torch.Generator().manual_seed(5))


class StepsItsScheduleEvery(Plain):
    """A step-interval scheduler stepped every ``frequency`` batches (Lightning counts batches, not optimizer steps),
    the learning rate cut hard at each step of it."""

    frequency = 1

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.3)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": self.frequency}}


class SchedulesItsOwnWay(StepsItsScheduleEvery):
    """Its own lr_scheduler_step: the scheduler stepped after every other optimizer step only (read from
    self.global_step, the run's step after the optimizer's)."""

    def lr_scheduler_step(self, scheduler, metric):
        if self.global_step % 2 == 0:
            scheduler.step()


class SkipsItsSecond(Plain):
    """Skips its second batch (`training_step` returns None): Lightning steps no parameter there."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


class Counted(Regression):
    """Regression counting, at each of its training steps, the optimizers alive (the run's, and the check's of
    each row it has trained)."""

    alive: ClassVar[list[int]] = []

    def training_step(self, batch, batch_idx):
        import gc

        gc.collect()  # what is reachable, not what a cycle keeps until the collector's next pass
        # by type: isinstance() on a weakref.proxy whose object is gone (one a test before this one left) raises
        Counted.alive.append(sum(issubclass(type(o), torch.optim.Optimizer) for o in gc.get_objects()))
        return super().training_step(batch, batch_idx)


class FreezesAtTrainStart(Plain):
    """Freezes its first layer in its own on_train_start, which Lightning calls after the callbacks'."""

    def on_train_start(self):
        self.net[0].requires_grad_(False)


class TwoManual(Plain):
    """Manual optimization of its two layers by two optimizers (the base of the two below)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


class UsesItsLightningOptimizers(TwoManual):
    """Uses what `self.optimizers()` gives beyond a torch optimizer: `toggle_model()` and `.optimizer`."""

    def training_step(self, batch, batch_idx):
        loss = (self(batch[0]) - batch[1]).pow(2).mean()
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            with optimizer.toggle_model():
                for group in optimizer.optimizer.param_groups:
                    group["lr"] = 0.05
                optimizer.step()
                optimizer.zero_grad()
        self.log("train_loss", loss)
        return loss


class ScalesByItsGlobalStep(TwoManual):
    """Reads `self.global_step`, which Lightning counts each optimizer's step in manual optimization: two a batch."""

    def training_step(self, batch, batch_idx):
        loss = (self(batch[0]) - batch[1]).pow(2).mean() * (1.0 + self.global_step)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()
        self.log("train_loss", loss)
        return loss


class LogsThroughItsLogger(Plain):
    """Writes to its logger itself (`self.logger`, and the experiment of `self.trainer.logger`), as a training_step
    logging an image or a histogram does."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.logger.log_metrics({"direct": float(loss)}, step=self.global_step)
        self.trainer.logger.experiment.log_metrics({"through": float(loss)}, self.global_step)
        return loss


class WarmsUpInItsStep(Plain):
    """A learning-rate warm-up set in training_step through self.optimizers(), in automatic optimization."""

    def training_step(self, batch, batch_idx):
        for group in self.optimizers().param_groups:
            group["lr"] = 0.1 * min(1.0, (self.global_step + 1) / 4)
        return super().training_step(batch, batch_idx)


class WarmsUpThroughItsTrainer(Plain):
    """The same warm-up set in training_step through self.trainer.optimizers."""

    def training_step(self, batch, batch_idx):
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = 0.1 * min(1.0, (self.global_step + 1) / 4)
        return super().training_step(batch, batch_idx)


class Recurrent(L.LightningModule):
    """A small LSTM over its 8 features as a sequence of 8 steps: a cuDNN RNN, whose float32 math cuDNN's flag
    sets, not the level."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(1, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, _ = self.rnn(x.unsqueeze(-1))
        return (self.head(out[:, -1]) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)



class StepsAHeadOutside(Regression):
    """Its loss reaches a head it does not hold (in a list: no submodule of it), which its optimizer steps."""

    def __init__(self) -> None:
        super().__init__()
        self.outside = [torch.nn.Linear(1, 1)]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.outside[0](self(x)) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD([*self.parameters(), *self.outside[0].parameters()], lr=1e-2)
