"""What a row's copy of a ``LightningModule`` sees in place of the run's trainer, for :mod:`tf32lab.integrations.
lightning`'s check: its own optimizers (Lightning-like: ``toggle_model``, ``.optimizer``, each step counted as
Lightning's ``global_step`` counts it), schedulers, gradient clipping and manual optimization's ``backward``, and the
run's loggers with every write turned off. The run's own objects are never reached through a copy: a warm-up in
``training_step`` set the run's learning rate, and the rows wrote their losses into the run's logs.

Example (which of Lightning's later hooks a module has its own of: the check runs before them, and says so):

    >>> class Module(L.LightningModule):
    ...     def on_train_start(self):
    ...         pass
    >>> [hook for hook in LATER_HOOKS if overrides(Module(), hook)]
    ['on_train_start']
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from tf32lab.integrations import _loop

L = _loop.require("pytorch_lightning", "PyTorch Lightning", "lightning")

__all__ = ["BACKWARD_HOOKS", "LATER_HOOKS", "STEP", "STEP_HOOKS", "ModuleScheduled", "hooked_step", "manual",
           "outside_the_run", "overrides", "takes_index"]


STEP = "_tf32lab_step"  # where a row's copy keeps the check's step

# the module's hooks that change what a step computes, in Lightning's automatic optimization (its callbacks' own
# hooks are the run's, and are left out: they see the run, not the check's copies)
# the module's hooks that Lightning calls after the callbacks' on_train_start and before the first step
LATER_HOOKS = ("on_train_start", "on_train_epoch_start")
STEP_HOOKS = ("optimizer_step", "on_before_optimizer_step", "configure_gradient_clipping")
BACKWARD_HOOKS = ("on_before_zero_grad", "optimizer_zero_grad", "on_before_backward", "backward",
                   "on_after_backward")


def overrides(module: Any, hook: str) -> bool:
    """Whether the module's class has its own ``hook``, not LightningModule's."""
    return getattr(type(module), hook, None) is not getattr(L.LightningModule, hook)


class _RowOptimizer:
    """What a module's ``optimizer_step`` is given, and its ``self.optimizers()`` in manual optimization (Lightning's
    ``LightningOptimizer``), over a row's optimizer: ``step(closure)`` runs the closure (the step's loss, already
    backpropagated), then ``clipped()`` (the module's ``on_before_optimizer_step`` and, in automatic optimization,
    ``configure_gradient_clipping`` with the Trainer's ``gradient_clip_val``), then the row's optimizer step, as
    the Trainer's precision plugin does, then ``stepped()``; ``optimizer`` is the row's optimizer and
    ``toggle_model()`` toggles it on ``model`` (the row's copy), as Lightning's do."""

    def __init__(self, optimizer: torch.optim.Optimizer, clipped: Any, model: Any = None,
                 stepped: Optional[Callable[[], None]] = None) -> None:
        self.optimizer, self._clipped, self._model, self._stepped = optimizer, clipped, model, stepped

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        self._clipped()  # on_before_optimizer_step, then the clipping
        self.optimizer.step(**kwargs)
        if self._stepped is not None:
            self._stepped()
        return result

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        """``LightningOptimizer.toggle_model``: the row's copy's ``toggle_optimizer`` around the block
        (``sync_grad`` holds DDP's gradient sync, which a copy has none of)."""
        self._model.toggle_optimizer(self)
        try:
            yield
        finally:
            self._model.untoggle_optimizer(self)


class ModuleScheduled:
    """A row's scheduler stepped through the module's own ``lr_scheduler_step(scheduler, metric)`` (no metric: a
    monitored one is held), called as Lightning calls it after the optimizer step: ``self.global_step`` reads the
    step after it (the run's ``global_step`` has counted that optimizer step by then)."""

    def __init__(self, scheduler: Any, at: dict[str, Any]) -> None:
        self.scheduler, self._at = scheduler, at

    def step(self) -> None:
        model, step = self._at["model"], self._at["step"]
        model.__dict__[STEP] = self._at["step"] = step + 1
        try:
            model.lr_scheduler_step(self.scheduler, None)
        finally:
            model.__dict__[STEP] = self._at["step"] = step


def hooked_step(at: dict[str, Any], optimizer: torch.optim.Optimizer, trainer: Any, accumulate: int) -> None:
    """One optimizer of a row stepped through the module's ``optimizer_step(epoch, batch_idx, optimizer,
    closure)``, with its ``on_before_optimizer_step`` and then its ``configure_gradient_clipping`` (given the
    Trainer's own arguments) before the step (Lightning's order)."""
    model, step = at["model"], at["step"]

    def clipped() -> None:
        model.on_before_optimizer_step(optimizer)
        model.configure_gradient_clipping(optimizer, gradient_clip_val=trainer.gradient_clip_val,
                                          gradient_clip_algorithm=trainer.gradient_clip_algorithm)

    model.optimizer_step(trainer.current_epoch, (step + 1) * accumulate - 1, _RowOptimizer(optimizer, clipped),
                         lambda: at["loss"])


def outside_the_run(trainer: Any, at: dict[str, Any]) -> dict[str, Any]:
    """What a row's copy answers where its ``training_step`` reaches for its trainer: ``self.trainer`` the run's
    (a copy is attached to none: Lightning drops ``_trainer`` on every copy, and ``self.trainer`` would raise), read
    only, its ``global_step`` the check's as the copy's own is (:func:`_at_the_checks_step`); ``self.log`` and
    ``self.log_dict`` nothing, as on a module without a trainer (the run's logged metrics and their steps stay its
    own, from ``training_step`` and from the module's hooks alike)."""
    seen = _at_the_checks_step(trainer, at)

    def attached(self: Any) -> Any:
        return seen

    def unattached(self: Any, value: Any) -> None:
        self._trainer = value

    def unlogged(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def global_step(self: Any) -> int:
        return int(trainer.global_step) + self.__dict__.get(STEP, 0)

    def clip_gradients(self: Any, optimizer: Any, gradient_clip_val: Optional[float] = None,
                       gradient_clip_algorithm: Any = None) -> None:
        # LightningModule.clip_gradients's defaults: the Trainer's value and algorithm, the algorithm's name lowered
        if gradient_clip_val is None:
            gradient_clip_val = trainer.gradient_clip_val
        if gradient_clip_algorithm is None:
            gradient_clip_algorithm = trainer.gradient_clip_algorithm
        if gradient_clip_val:
            algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm"
            _loop.clip_gradients([p for g in optimizer.param_groups for p in g["params"]], float(gradient_clip_val),
                                 str(algorithm).lower())

    def optimizers(self: Any, use_pl_optimizer: bool = True) -> Any:
        made = at["row_of"](self)[0]  # the row's own (manual optimization binds its own in its step)
        return _one_or_all([_RowOptimizer(o, lambda: None, self) for o in made] if use_pl_optimizer else made)

    def lr_schedulers(self: Any) -> Any:
        made = at["row_of"](self)[1]
        return _one_or_all(made) if made else None

    def logger(self: Any) -> Any:
        return seen.logger

    def loggers(self: Any) -> list[Any]:
        return seen.loggers

    return {"trainer": property(attached, unattached), "log": unlogged, "log_dict": unlogged,
            "global_step": property(global_step), "clip_gradients": clip_gradients, "logger": property(logger),
            "loggers": property(loggers), "optimizers": optimizers, "lr_schedulers": lr_schedulers}


class _Unlogged:
    """The run's logger as a row's copy sees it (``self.logger``, ``self.trainer.logger``): what it is (its
    ``name``, ``version``, ``save_dir``, ``log_dir``) read from the run's, what writes (``log_metrics``,
    ``log_hyperparams``, ``log_graph``, ``save``, ``finalize``, and anything called on its ``experiment``: a
    TensorBoard ``add_scalar``, a W&B ``log``) does nothing, as the copy's ``self.log`` does: the run's logs and
    their steps stay its own."""

    _WRITES = frozenset(("log_metrics", "log_hyperparams", "log_graph", "save", "finalize", "after_save_checkpoint"))

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    @property
    def experiment(self) -> Any:
        return _Nothing()

    def __getattr__(self, name: str) -> Any:  # only what the class lacks: the run's logger's own reads
        if name.startswith("__") or name == "_logger":  # a copy's protocol (deepcopy, pickle): no recursion
            raise AttributeError(name)
        if name in _Unlogged._WRITES:
            return _Nothing()
        return getattr(self._logger, name)


class _Nothing:
    """What a row's copy writes its logs to: any call, attribute or item of it is itself, and does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> _Nothing:
        return self

    def __getattr__(self, name: str) -> _Nothing:
        if name.startswith("__"):  # a copy's protocol (deepcopy, pickle) is object's
            raise AttributeError(name)
        return self

    def __getitem__(self, key: Any) -> _Nothing:
        return self


def _at_the_checks_step(trainer: Any, at: dict[str, Any]) -> Any:
    """The run's trainer as a row's copy sees it: an instance of the run's Trainer class over a copy of its
    attributes (what is read is the run's; what a hook sets, ``self.trainer.should_stop = True`` where a row's loss
    diverged, stays in the check: the run's trainer would stop the run), whose ``global_step`` is the run's plus
    the check's step being trained (``at["step"]``), as the copy's ``self.global_step`` is. The run's trainer
    itself is not touched: its global step is its loops' progress, which the check never writes."""
    base = type(trainer)

    def global_step(self: Any) -> int:
        return int(trainer.global_step) + int(at.get("step", 0))

    def optimizers(self: Any) -> list[Any]:
        # the row's own, as the copy's self.optimizers() (a warm-up setting the lr sets the row's, not the run's)
        return at["row_of"](at["model"])[0] if "model" in at else trainer.optimizers

    viewed = type(base.__name__, (base,), {"global_step": property(global_step), "optimizers": property(optimizers),
                                           "__qualname__": base.__qualname__, "__module__": base.__module__})
    seen = object.__new__(viewed)
    object.__setattr__(seen, "__dict__", dict(trainer.__dict__))  # its objects (strategy, loops) the run's own
    seen.__dict__["_loggers"] = [_Unlogged(one) for one in trainer.loggers]  # but its loggers write nothing
    return seen


def takes_index(module: Any) -> bool:
    try:
        parameters = inspect.signature(module.training_step).parameters.values()
    except (TypeError, ValueError):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters) >= 2 or \
        any(p.kind == p.VAR_POSITIONAL for p in parameters)


@contextlib.contextmanager
def manual(model: Any, bundle: _loop.Steps, recorded: list[torch.Tensor], at: dict[str, Any]) -> Iterator[None]:
    """A row's copy in manual optimization: ``self.optimizers()``, ``self.lr_schedulers()``,
    ``self.manual_backward``, ``toggle_optimizer``/``untoggle_optimizer`` and ``clip_gradients`` bound to the row's
    own optimizers and schedulers (the copy has no trainer); ``manual_backward`` and the optimizers' ``step``
    call the module's own hooks around them as Lightning's do."""
    raw: list[Any] = list(bundle.optimizers)
    hooked = overrides(model, "on_before_optimizer_step")  # Lightning's optimizer calls it after the step's closure

    def stepped() -> None:  # Lightning's global_step counts each optimizer's step, at once (its optimizer's hook)
        bundle.steps += 1  # Steps.step does nothing in manual optimization: its count is these steps
        model.__dict__[STEP] = at["step"] = bundle.steps

    optimizers = [_RowOptimizer(o, (lambda o=o: model.on_before_optimizer_step(o)) if hooked else (lambda: None),
                                model, stepped) for o in raw]
    schedulers = [s for s, _ in bundle.schedulers]
    toggled: dict[torch.Tensor, bool] = {}

    def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # Lightning's manual_backward: the module's own on_before_backward, backward and on_after_backward
        recorded.append(loss)
        model.on_before_backward(loss)
        model.backward(loss, *args, **kwargs)
        model.on_after_backward()

    def toggle(optimizer: Any) -> None:
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    toggled.setdefault(p, p.requires_grad)
                    p.requires_grad = False
        for group in getattr(optimizer, "optimizer", optimizer).param_groups:
            for p in group["params"]:
                p.requires_grad = toggled[p]

    def untoggle(optimizer: Any) -> None:
        for p, state in toggled.items():
            p.requires_grad = state
        toggled.clear()

    def clip(optimizer: Any, gradient_clip_val: Optional[float] = None,
             gradient_clip_algorithm: Optional[str] = None) -> None:
        if gradient_clip_val:
            algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm"  # an enum too
            _loop.clip_gradients([p for g in optimizer.param_groups for p in g["params"]], float(gradient_clip_val),
                                 str(algorithm).lower())

    bound = {
        "optimizers": lambda use_pl_optimizer=True: _one_or_all(optimizers if use_pl_optimizer else raw),
        "lr_schedulers": lambda: None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers,
        "manual_backward": backward, "toggle_optimizer": toggle, "untoggle_optimizer": untoggle,
        "clip_gradients": clip,
    }
    for name, fn in bound.items():
        object.__setattr__(model, name, fn)
    try:
        yield
    finally:
        for name in bound:
            model.__dict__.pop(name, None)
        untoggle(None)


def _one_or_all(items: list[Any]) -> Any:
    """What ``LightningModule.optimizers()`` returns: the one optimizer, or the list of them."""
    return items[0] if len(items) == 1 else list(items)
