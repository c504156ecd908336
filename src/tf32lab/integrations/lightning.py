"""``Tf32Check``: the training check as a PyTorch Lightning callback.

When training starts (``on_train_start``: the optimizers, schedulers and dataloader made), it trains copies of the
run's own ``LightningModule`` for ``steps`` optimizer steps at each level, as ``target`` computes it, against
float64 and float32's own drift (:func:`tf32lab.check_training`): its ``training_step`` as the loss, the optimizers
and schedulers its ``configure_optimizers`` gave, the Trainer's gradient accumulation and clipping, the module's own
hooks around the optimizer step in the Trainer's order (``optimizer_zero_grad``, ``on_after_backward``,
``on_before_optimizer_step``, ...), and the first batches of its train dataloader. The run itself is untouched:
its module, optimizers and schedulers are never stepped (copies are), the batches are read again from a fresh pass
(the random streams, PyTorch's, NumPy's and Python's, and the dataloader's own generators put back), and nothing is
logged at a step of its own. A run with the callback ends with the same weights, bit for bit, as a run without it.

The report is kept on the callback (``cb.report``), written as ``tf32lab-training.json`` and ``.html`` into the
trainer's log dir, its verdicts logged (``logging``, ``tf32lab.integrations``) and its headline numbers given to
the trainer's loggers (``tf32lab/passed``, ``tf32lab/high/drift``, ...). A failed check warns
(``on_fail="warn"``, the default) or stops the run before its first step (``on_fail="raise"``).

Under DDP the check runs on global rank 0, on its shard of the data; the other ranks wait for it and every rank
gets its verdict (and raises together). Lightning's mixed precision (``16-mixed``, ``bf16-mixed``) runs matmuls in
16-bit under autocast, which the float32 matmul precision does not reach: the check trains in float32 and a note
says so.

Example (not run here: it needs PyTorch Lightning)::

    import pytorch_lightning as L
    from tf32lab.integrations.lightning import Tf32Check

    check = Tf32Check(target="a100", steps=20, levels=("highest", "high"))
    trainer = L.Trainer(callbacks=[check], max_epochs=3)
    trainer.fit(model, datamodule)
    check.report.passed   # the verdict; check.report.level("high").drift, ...

The callback is made once, its arguments checked at once:

    >>> Tf32Check(target="h100", steps=5).levels
    ('highest', 'high', 'medium')
    >>> Tf32Check(on_fail="stop")
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: on_fail must be 'raise' or 'warn', not 'stop'
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional, Union

import torch

from tf32lab.control.policy import Policy
from tf32lab.errors import Tf32LabError
from tf32lab.integrations import _loop
from tf32lab.integrations import lightning_rows as rows
from tf32lab.integrations.batches import first_batches, grouped, interleaved, loader_generators, loaders, within
from tf32lab.integrations.written import Written
from tf32lab.know.targets import Target
from tf32lab.measure.training import random_state_kept
from tf32lab.report.training import TrainingReport

L = _loop.require("pytorch_lightning", "PyTorch Lightning", "lightning")

__all__ = ["Tf32Check"]

_MIXED = {"16-mixed": "float16", "bf16-mixed": "bfloat16", "16-true": "float16", "bf16-true": "bfloat16",
          "16": "float16", "bf16": "bfloat16", "transformer-engine": "FP8"}


class Tf32Check(L.Callback):
    """Check, before the first step, what each precision level does to this run's training (see the module).

    Args:
        target: the GPU whose math is emulated (``"a100"``, ``"h100"``, ...), or ``"native"``.
        steps: optimizer steps to train (each ``accumulate_grad_batches`` batches).
        levels: the precision levels (default all three).
        tolerance: the loss's largest relative deviation from float64's (default 1e-2).
        on_fail: ``"warn"`` (log and warn, train on) or ``"raise"`` (``Tf32LabError`` before the first step).
        conv: cuDNN's float32 math for the convolutions and RNNs in every row, ``"tf32"`` or ``"ieee"`` (no level
            sets it; None: as this process's flag holds it, the run's own math), as ``check_training(conv=)``.
        policy: a :class:`~tf32lab.Policy` (the pin a failed check advises) trained as one more row, ``"policy"``,
            whose verdict is the report's and the callback's, as ``check_training(policy=)``.

    After ``fit``, :attr:`report` holds the :class:`~tf32lab.report.training.TrainingReport` (None on ranks but 0
    under DDP) and :attr:`passed` the verdict (on every rank).
    """

    def __init__(self, target: Union[str, Target] = "a100", steps: int = 20, levels: Optional[Iterable[str]] = None,
                 tolerance: Optional[float] = None, on_fail: str = "warn", conv: Optional[str] = None,
                 policy: Optional[Policy] = None) -> None:
        super().__init__()
        (self.target, self.steps, self.levels, self.tolerance, self.on_fail, self.conv,
         self.policy) = _loop.Options.checked(target, steps, levels, tolerance, on_fail, conv, policy)
        self.report: Optional[TrainingReport] = None
        self.passed: Optional[bool] = None
        self._writing: Optional[Written] = None
        self._drawn: Optional[torch.Tensor] = None
        self._before: Optional[torch.Tensor] = None
        self._generators: list[tuple[torch.Generator, torch.Tensor]] = []
        self._checked = _loop.Checked()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # the state the run's train iterator is made from (after this hook, the sanity check runs in its own
        # random state): a loader with workers draws its seed and its first order as its iterator is made
        self._before = torch.random.get_rng_state()
        # and the loader's own generators, where fit was given the loader itself (one a hook makes is made later)
        source = getattr(getattr(trainer.fit_loop, "_data_source", None), "instance", None)
        given = source is not None and not isinstance(source, (L.LightningModule, L.LightningDataModule))
        self._generators = [(g, g.get_state()) for g in loader_generators(source)] if given else []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.passed is not None and self._checked.same(trainer, pl_module):
            return  # a second fit of the same trainer and module is the same run's continuation
        self._wait()
        self.report, self.passed = None, None  # another run: its own check, not the last one's report
        self._checked.now(trainer, pl_module)
        # every random stream as it was afterwards (the check's reading of the batches, its rows, the report's
        # writing): the run draws as it would without the check
        self._drawn = torch.random.get_rng_state()  # what the run's sampler draws its first order from
        with random_state_kept(pl_module, "Tf32Check"):
            self._run(trainer, pl_module)

    def _run(self, trainer: Any, pl_module: Any) -> None:
        if _loop.unreached(pl_module, f" (precision {str(trainer.precision)!r})"):  # every rank alike
            return
        distributed = trainer.world_size > 1
        folder = trainer.log_dir  # a collective under DDP (rank 0's folder, broadcast): every rank asks
        error = None
        if trainer.is_global_zero:
            try:
                self.report = self._check(trainer, pl_module)
                self.passed = self.report.passed
            except Exception as exc:
                if not distributed and self.on_fail == "raise":
                    raise
                error = f"{type(exc).__name__}: {exc}"
        if distributed:  # every rank waits for rank 0's verdict, and ends (or raises) with it
            self.passed, error = trainer.strategy.broadcast((self.passed, error), src=0)
        if error is not None:
            _loop.not_run(" on rank 0" if distributed else "", error, self.on_fail)
            return
        if self.report is not None:
            self._said(trainer, folder)
        elif not self.passed and self.on_fail == "raise":
            raise Tf32LabError("tf32lab training check FAILED on rank 0 (its log has the report)")

    def _said(self, trainer: Any, folder: Optional[str]) -> None:
        report = self.report
        assert report is not None
        numbers = {k: v for k, v in _loop.headline(report).items() if math.isfinite(v)}
        for logger in trainer.loggers:  # at the run's current step: no step of its own
            logger.log_metrics(numbers, step=trainer.global_step)
        self._writing = Written(report, folder)
        if not report.passed and self.on_fail == "raise":
            self._wait()  # the run stops here: the files first
        _loop.said(report, self.on_fail)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._wait()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            self._wait()
        except Exception:  # the write-failure warning raised (warnings as errors): the run's own error goes on
            _loop.LOG.warning("tf32lab: the training check's report could not be written", exc_info=True)

    def _wait(self) -> None:
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.wait()

    # -- the run as a training workload --------------------------------------------------------------------------
    def _check(self, trainer: Any, module: Any) -> TrainingReport:
        manual = not module.automatic_optimization
        accumulate = 1 if manual else _accumulated(trainer)
        notes = []
        loader = trainer.train_dataloader
        if loader is None:
            raise Tf32LabError("Tf32Check: the trainer has no train dataloader at on_train_start")
        device = module.device
        # the run trains num_training_batches an epoch (limit_train_batches), then reads the loader again
        per_epoch = trainer.num_training_batches
        done = _done_in_epoch(trainer, loader, per_epoch)  # a mid-epoch resume trains the epoch's rest
        per_epoch -= done
        # max_steps counts each optimizer's steps, which a manual training_step may take several of
        # max_steps's note, unless the epoch is shorter still (then that one's: the steps checked are its)
        capped: list[str] = []
        # fast_dev_run sets max_steps (Trainer's _init_debugging_flags): the argument the run was given is named
        wanted = self.steps if manual else within(self.steps, trainer.max_steps, trainer.global_step, capped,
                                                  "fast_dev_run" if trainer.fast_dev_run else "max_steps")
        limited = math.isfinite(per_epoch) and per_epoch < wanted * accumulate
        # the run made its pass before on_train_start, from the states of on_fit_start: it drew its workers' seed
        # then, and what its sampler draws as a pass is made (a loader with workers its first order, a batch sampler
        # its own), and read the batches it reads ahead (a loader without a length, one); the rest it draws from
        # the states now. The check's pass is made and read so.
        # what refuses the run whatever its batches, before they are read
        mock = getattr(getattr(getattr(L, "core", None), "optimizer", None), "_MockOptimizer", ())
        why = _loop.refused(module, type(module).__name__,
                            [one for one in trainer.optimizers if not isinstance(one, mock)], self.policy)
        if why is not None:
            raise Tf32LabError(f"Tf32Check: {why}")
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        seeds: list[Any] = []
        per_batch: list[bool] = []
        _at_the_runs_epoch(loader, trainer.fit_loop.epoch_progress.current.processed)

        def iterate(one: Any) -> Iterator[Any]:
            made = _combined(trainer, one)
            seeds.append(getattr(made, "_base_seed", None))
            return made

        batches = first_batches(loader, int(per_epoch) if limited else wanted * accumulate,
                                lambda b: L.utilities.move_data_to_device(b, device), iterate=iterate,
                                made=self._drawn, before=self._before, generators=self._generators,
                                prefetch=len(getattr(fetcher, "batches", ()) or ()), per_batch=per_batch)
        drawn = interleaved(module, per_batch)
        if drawn:
            notes.append(drawn)
        if _made_elsewhere(trainer, loader, seeds):
            notes.append("the train dataloader's own generator was made after the fit started (in a "
                         "train_dataloader hook) and its workers draw the order as a pass is made: the check's "
                         "batches are a pass of the loader like the run's, not the run's own; give fit the "
                         "DataLoader itself for the run's own batches")
        # the epoch ends at the batches read (limit_train_batches, or a pass shorter than asked): Lightning steps
        # the optimizer at its last batch, over the micro-batches left
        steps = grouped(batches, accumulate, wanted, ended=limited or len(batches) < wanted * accumulate)
        if not steps:
            raise Tf32LabError(f"Tf32Check: the train dataloader has {len(batches)} batches, fewer than one "
                               f"optimizer step's {accumulate} (accumulate_grad_batches)")
        if len(steps) < wanted:
            # limit_train_batches named only where it is set (1.0, its default, takes the whole loader);
            # overfit_batches sets it (Trainer's _init_debugging_flags), and is the argument the run was given
            argument = "overfit_batches" if trainer.overfit_batches else "limit_train_batches"
            where = f"the run trains {len(batches)} batches an epoch ({argument})" \
                if limited and trainer.limit_train_batches != 1.0 else \
                f"the train dataloader has {len(batches)} batches"
            notes.append(f"the run resumes {done} batches into its epoch of {done + per_epoch}: {len(steps)} of the "
                         f"{self.steps} steps asked for were checked, the ones it trains in that epoch (Lightning "
                         f"reads its loader afresh)" if done and limited else
                         f"{where}: {len(steps)} of the {self.steps} steps asked for were checked, the first "
                         f"epoch's")
        else:
            notes.extend(capped)
        # Lightning calls the callbacks' on_train_start before the module's, and the module's on_train_epoch_start
        # after it (FitLoop.on_run_start, on_advance_start): what the module sets there comes after the check
        later = [hook for hook in rows.LATER_HOOKS if rows.overrides(module, hook)]
        if later:
            notes.append(f"the module's own {' and '.join(later)} ran after the check (Lightning calls the "
                         f"callbacks' on_train_start first): what it changes before the first step (a layer "
                         f"frozen, a learning rate) is not in the check; change it in setup or on_fit_start to "
                         f"have it checked")
        precision = str(trainer.precision)
        if precision in _MIXED:
            notes.append(f"the run trains at precision {precision!r}: its matmuls run in {_MIXED[precision]}, "
                         f"which the float32 matmul precision does not reach; the check trained the model in "
                         f"float32 without autocast (what the level decides where the run keeps float32)")
        original = _loop.trainable(module)
        optimizers = list(trainer.optimizers)
        # configure_optimizers returned None: Lightning trains on with a _MockOptimizer, stepping nothing
        mock = getattr(getattr(getattr(L, "core", None), "optimizer", None), "_MockOptimizer", ())
        if all(isinstance(one, mock) for one in optimizers):
            raise Tf32LabError("Tf32Check: the run has no optimizer (configure_optimizers returned none): no step "
                               "to check")
        configs = list(trainer.lr_scheduler_configs)
        per_epoch = math.ceil(per_epoch / accumulate) if math.isfinite(per_epoch) else 0
        schedule = []
        for config in configs:
            if manual:
                every = 0  # the training_step steps its schedulers itself (self.lr_schedulers())
            elif config.reduce_on_plateau:
                every = 0
                notes.append(f"{type(config.scheduler).__name__} steps on a monitored metric, which the check does "
                             f"not compute: its learning rate is held")
            elif config.interval == "step":
                every = _steps_between(config.frequency, accumulate)
            else:
                every = config.frequency * per_epoch
            schedule.append(every)
        clip = None
        if not manual and trainer.gradient_clip_val:
            clip = (float(trainer.gradient_clip_val), str(getattr(trainer.gradient_clip_algorithm, "value",
                                                                  trainer.gradient_clip_algorithm) or "norm"))
        # the module's own hooks, called as the Trainer calls them where the module overrides one: around the
        # optimizer's step, and around each micro-batch's backward (the step's loss zeroes and backpropagates)
        hooked = not manual and any(rows.overrides(module, hook) for hook in rows.STEP_HOOKS)
        backward = not manual and any(rows.overrides(module, hook) for hook in rows.BACKWARD_HOOKS)
        at: dict[str, Any] = {}  # the row's copy and step being trained (the hooks are called with them)
        stepper = (lambda optimizer: rows.hooked_step(at, optimizer, trainer, accumulate)) if hooked else None
        plain = not manual and not hooked and not backward and clip is None and len(optimizers) == 1 and not configs
        bundles: dict[int, _loop.Steps] = {}

        # a module's own lr_scheduler_step steps the schedulers as the run's loop calls it (timm's schedulers,
        # a rule of its own)
        own_schedule = not manual and rows.overrides(module, "lr_scheduler_step")

        def optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            made, schedulers = _loop.rebound(optimizers, [c.scheduler for c in configs], original, params)
            if own_schedule:
                schedulers = [rows.ModuleScheduled(one, at) for one in schedulers]
            bundle = _loop.Steps(made, list(zip(schedulers, schedule)), None if hooked else clip, manual, stepper,
                                 zeroed=backward)
            if backward or manual:  # bundle_of's only callers; kept past its row, a row's optimizers and their
                bundles[id(params[0])] = bundle  # state (float64's Adam moments) stayed alive until the check ended
            given = made[0] if plain else bundle
            made_for[id(params[0])] = given  # for the copy's self.optimizers(), while its row holds it
            return given

        made_for: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

        def row_of(model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
            # the row's own optimizers and schedulers, for automatic optimization's self.optimizers() and
            # self.lr_schedulers() (a warm-up in training_step setting the lr): the run's, through its trainer, took
            # the warm-up in the rows' place
            params = _loop.trainable(model)
            given = made_for.get(id(params[0]))
            if given is None:  # a probe's copy: its own
                given = optimizer(params)
            if not isinstance(given, _loop.Steps):
                return [given], []
            return list(given.optimizers), [getattr(one, "scheduler", one) for one, _ in given.schedulers]

        at["row_of"] = row_of

        def bundle_of(model: torch.nn.Module) -> _loop.Steps:
            params = _loop.trainable(model)
            if id(params[0]) not in bundles:  # a copy the check made without an optimizer (step 1's probes)
                optimizer(params)
            return bundles[id(params[0])]

        recorded: list[torch.Tensor] = []
        takes_index = rows.takes_index(module)
        skipped: set[int] = set()  # the steps all of whose batches training_step skipped, noted once

        def one(model: Any, batch: Any, index: int) -> torch.Tensor:
            recorded.clear()
            out = model.training_step(batch, index) if takes_index else model.training_step(batch)
            value = out.get("loss") if isinstance(out, Mapping) else out
            if manual:
                if value is None and recorded:
                    value = torch.stack([r.detach().reshape(()) for r in recorded]).sum()
                if not isinstance(value, torch.Tensor):
                    raise Tf32LabError("Tf32Check: training_step returned no loss and called manual_backward on "
                                       "none: return the loss (manual optimization)")
                # the step is done: what the check backpropagates reaches no parameter
                return value.detach().reshape(()) + torch.zeros((), dtype=value.dtype, device=value.device,
                                                                requires_grad=True)
            return value

        def backpropagated(model: Any, micro: list[Any], step: int) -> list[Any]:
            # Lightning's automatic optimization, micro-batch by micro-batch: training_step; at the step's first,
            # on_before_zero_grad and optimizer_zero_grad (even where it returned None); then, where it gave a
            # loss, on_before_backward, backward and on_after_backward of that loss over accumulate_grad_batches
            values = []
            for i, batch in enumerate(micro):
                index = step * accumulate + i
                value = one(model, batch, index)
                if i == 0:
                    for opt in bundle_of(model).optimizers:
                        model.on_before_zero_grad(opt)
                        model.optimizer_zero_grad(trainer.current_epoch, index, opt)
                if value is not None:
                    scaled = value / accumulate
                    model.on_before_backward(scaled)
                    model.backward(scaled)
                    model.on_after_backward()
                values.append(value)
            return values

        def loss(model: Any, micro: list[Any], step: int) -> torch.Tensor:
            # Lightning backpropagates each micro-batch's loss over accumulate_grad_batches (their mean's gradient);
            # a micro-batch whose training_step returned None is skipped, backpropagating nothing
            # global_step: the run's at the check's step; in manual optimization Lightning counts each optimizer's
            # step (two optimizers stepped a batch: two), as the row's own optimizers have counted them
            model.__dict__[rows.STEP] = at["step"] = bundle_of(model).steps if manual else step
            at["model"] = model  # the copy being trained (self.trainer.optimizers reads its row's)
            values = backpropagated(model, micro, step) if backward else \
                [one(model, batch, step * accumulate + i) for i, batch in enumerate(micro)]
            kept = [v for v in values if v is not None]
            if not kept:
                # Lightning's closure backpropagates nothing and its optimizer step moves no parameter (none has a
                # gradient), its schedulers stepping as at any step; so here: no loss reaches a parameter. Refused,
                # a row at a reduced level whose non-finite loss the module skips ended the whole check unjudged.
                if step not in skipped:
                    skipped.add(step)
                    notes.append(f"step {step + 1}: training_step returned None for every batch (a skipped step, "
                                 f"in at least one row): no parameter was updated there, as in the run, and its "
                                 f"loss is recorded as 0")
                total = torch.zeros((), device=device, requires_grad=True)
            elif accumulate == 1:
                total = values[0]
            else:  # over accumulate_grad_batches even at an epoch's last step of fewer batches (Lightning's closure)
                total = torch.stack(kept).sum() / accumulate
            if backward and kept:  # backpropagated already: what the check backpropagates reaches no parameter
                total = total.detach() + torch.zeros((), dtype=total.dtype, device=total.device, requires_grad=True)
            at.update(model=model, loss=total)
            return total

        around = (lambda model: rows.manual(model, bundle_of(model), recorded, at)) if manual else None
        try:
            model = _loop.stepping_copy(module, members=rows.outside_the_run(trainer, at))
            if manual and isinstance(trainer.max_steps, int) and trainer.max_steps > 0:
                left = trainer.max_steps - int(trainer.global_step)
                ran = _manual_batches(model, steps, left, bundle_of, recorded, one, at)
                if ran < len(steps):
                    notes.append(f"the run trains {ran} batches (max_steps={trainer.max_steps} counts each "
                                 f"optimizer's steps, {left} left, and a float32 pass of training_step stepped them "
                                 f"so): {ran} of the {self.steps} steps asked for were checked")
                    steps = steps[:ran]
            return _loop.run_check(model, type(module).__name__, steps, loss, optimizer, levels=self.levels,
                                   target=self.target, tolerance=self.tolerance, around=around, notes=notes,
                                   conv=self.conv, policy=self.policy)
        finally:
            # the last row's copy and loss: ``at`` and the closures that read it refer to each other, a cycle that
            # kept them until the collector's next full pass
            at.clear()


def _manual_batches(model: Any, steps: list[tuple[int, list[Any]]], left: int, bundle_of: Any,
                    recorded: list[torch.Tensor], one: Any, at: dict[str, Any]) -> int:
    """The batches of ``steps`` a run in manual optimization trains before its ``max_steps`` (``left`` of them to
    go): Lightning counts every optimizer's ``step`` (two optimizers stepped a batch: two), and stops before the
    batch at which the count has reached it. How many a ``training_step`` takes is the module's own (one a batch,
    several, none while it accumulates): a copy of the module trains the batches in float32, at the run's own
    flags, counting its optimizers' steps, and stops where the run stops."""
    copied = copy.deepcopy(model)
    bundle = bundle_of(copied)
    stepped = [0]

    def counted(optimizer: Any, args: Any, kwargs: Any) -> None:
        stepped[0] += 1

    handles = [optimizer.register_step_post_hook(counted) for optimizer in bundle.optimizers]
    try:
        with _loop.quiet(), torch.enable_grad():
            for ran, (step, micro) in enumerate(steps):
                if stepped[0] >= left:
                    return ran
                copied.__dict__[rows.STEP] = at["step"] = bundle.steps
                at["model"] = copied
                with rows.manual(copied, bundle, recorded, at):
                    for i, batch in enumerate(micro):
                        one(copied, batch, step * len(micro) + i)
    finally:
        for handle in handles:
            handle.remove()
        at.pop("step", None)
    return len(steps)


def _done_in_epoch(trainer: Any, loader: Any, per_epoch: float) -> int:
    """The batches of its epoch that a run resumed from a mid-epoch checkpoint trained before it: Lightning reads
    a loader that cannot resume its stream (no ``state_dict``/``load_state_dict``) afresh and trains the epoch's
    rest, counting the batch the checkpoint was saved at the end of as done (``TrainingEpochLoop.reset``, which
    runs after ``on_train_start``); 0 for a run that starts an epoch, or whose loader resumes its own stream."""
    loop = trainer.fit_loop.epoch_loop
    if not getattr(loop, "restarting", False) or not math.isfinite(per_epoch):
        return 0
    if all(callable(getattr(one, "state_dict", None)) and callable(getattr(one, "load_state_dict", None))
           for one in loaders(loader)):
        return 0
    done = int(loop.batch_progress.current.completed) + int(bool(getattr(loop, "restarted_on_train_batch_end",
                                                                         False)))
    return done if 0 < done < per_epoch else 0


def _accumulated(trainer: Any) -> int:
    """The batches each optimizer step of the run's epoch accumulates: the Trainer's ``accumulate_grad_batches``,
    or what a ``GradientAccumulationScheduler`` sets it to as the epoch starts (``on_train_epoch_start``, after the
    check: at ``on_train_start`` the Trainer still holds its own value)."""
    for callback in trainer.callbacks:
        if isinstance(callback, L.callbacks.GradientAccumulationScheduler):
            return int(callback.get_accumulate_grad_batches(trainer.current_epoch))
    return int(trainer.accumulate_grad_batches)


def _steps_between(frequency: int, accumulate: int) -> int:
    """The optimizer steps between two steps of an ``interval="step"`` scheduler: Lightning steps it after an
    optimizer step when the batch's ``batch_idx + 1`` is a multiple of ``frequency``
    (``TrainingEpochLoop._update_learning_rates``), batches, not optimizer steps, so with gradient accumulation the
    ``k``-th optimizer step (batch ``k * accumulate``) steps it where ``frequency`` divides ``k * accumulate``.

    >>> _steps_between(2, 1), _steps_between(2, 2), _steps_between(3, 2), _steps_between(4, 2)
    (2, 1, 3, 2)
    """
    return frequency // math.gcd(frequency, accumulate)


def _at_the_runs_epoch(loader: Any, epoch: int) -> None:
    """Each sampler of ``loader`` with a ``set_epoch`` (``DistributedSampler``, the one Lightning puts in under DDP)
    set to the epoch the run trains first, as Lightning's fit loop sets it as the epoch starts
    (``FitLoop.on_advance_start``, after ``on_train_start``), before the run reads its first batch: a run resumed
    at epoch 2 reads epoch 2's order, and so does the check (it read epoch 0's). The same value as the loop sets
    next, so the run is untouched. A loader with workers is left alone: its iterator, made before
    ``on_train_start``, drew its first order at the epoch its sampler was at then."""
    for one in loaders(loader):
        if getattr(one, "num_workers", 0) > 0:
            continue
        samplers = {id(s): s for s in (getattr(one, "sampler", None),
                                       getattr(getattr(one, "batch_sampler", None), "sampler", None)) if s is not None}
        for sampler in samplers.values():
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)


def _made_elsewhere(trainer: Any, loader: Any, seeds: list[Any]) -> bool:
    """Whether the check's pass drew another workers' seed, and so another first order, than the run's pass (its
    loader's generator at another state than the run's was at)."""
    if isinstance(loader, (Mapping, list, tuple)) or getattr(loader, "num_workers", 0) == 0:
        return False
    combined = getattr(getattr(trainer.fit_loop, "_combined_loader", None), "_iterator", None)
    runs = [getattr(one, "_base_seed", None) for one in getattr(combined, "iterators", ())]
    return len(runs) == 1 and len(seeds) == 1 and None not in (runs[0], seeds[0]) and runs[0] != seeds[0]


def _combined(trainer: Any, loader: Any) -> Iterator[Any]:
    """The run's batches as its fit loop reads them: several train dataloaders (a dict or a list of them) together,
    as Lightning's ``CombinedLoader`` does in the run's mode; one dataloader, itself."""
    if not isinstance(loader, (Mapping, list, tuple)):
        return iter(loader)
    mode = getattr(getattr(trainer.fit_loop, "_combined_loader", None), "_mode", "max_size_cycle")
    return (batch for batch, *_ in L.utilities.CombinedLoader(loader, mode))
