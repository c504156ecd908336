"""``Tf32CheckCallback``: the training check as a Hugging Face ``TrainerCallback``.

When ``Trainer.train`` begins (``on_train_begin``: the optimizer, scheduler and dataloader made), it trains copies
of the run's model for ``steps`` optimizer steps at each level, as ``target`` computes it, against float64 and
float32's own drift (:func:`tf32lab.check_training`): the Trainer's ``compute_loss`` (a subclass's own included;
``compute_loss_func`` and label smoothing with it, given the token count as ``training_step`` gives it), the
optimizer and learning-rate scheduler the Trainer built, ``gradient_accumulation_steps`` (the micro-batches' losses
summed as the Trainer scales them), ``max_grad_norm`` clipping, and the first
batches of its train dataloader. The run is untouched: its model, optimizer and scheduler are never stepped
(copies are), the batches are read again from a fresh pass of the dataloader (every random stream and the
sampler's generator put back), and nothing changes its step count. A run with the callback ends with the same
weights, bit for bit, as a run without it.

Its conclusion answers ``TrainingArguments(tf32=...)``: ``tf32=True`` makes float32 matmuls TF32, the check's
``high``. The report is kept on the callback (``cb.report``), written as ``tf32lab-training.json`` and ``.html``
into ``args.output_dir``, its verdicts logged (``logging``, ``tf32lab.integrations``) and its headline numbers
given to ``Trainer.log`` (the ``report_to`` integrations, ``state.log_history``) at the current step. A failed
check warns (``on_fail="warn"``, the default) or stops the run before its first step (``on_fail="raise"``).

The Trainer is not among a callback's arguments: the callback takes the one whose ``train`` calls it (or
``trainer=`` given). Under DDP (``torchrun``) the check runs on the world's process zero, the others waiting for
its verdict. ``bf16=True`` / ``fp16=True`` train under autocast, whose 16-bit matmuls the float32 matmul precision
does not reach: the check trains in float32 and a note says so.

Example (not run here: it needs transformers)::

    from transformers import Trainer, TrainingArguments
    from tf32lab.integrations.transformers import Tf32CheckCallback

    check = Tf32CheckCallback(target="a100", steps=20)
    trainer = Trainer(model=model, args=TrainingArguments("out"), train_dataset=data, callbacks=[check])
    trainer.train()
    check.report.passed   # and check.report.notes: whether TrainingArguments(tf32=True) is safe here

The callback is made once, its arguments checked at once:

    >>> Tf32CheckCallback(target="a100", steps=10, levels=("highest", "high")).levels
    ('highest', 'high')
    >>> Tf32CheckCallback(steps=0)
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: steps must be a whole number >= 1, not 0
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import inspect
import math
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import torch

from tf32lab.control.policy import Policy
from tf32lab.emulation.emulator import RECOMPUTES_EMULATED
from tf32lab.errors import Tf32LabError
from tf32lab.integrations import _loop
from tf32lab.integrations.batches import first_batches, grouped, interleaved, within
from tf32lab.integrations.written import Written
from tf32lab.know.targets import Target
from tf32lab.machine.hardware import resolve_target
from tf32lab.measure.training import random_state_kept
from tf32lab.numbers.trees import map_tensors
from tf32lab.report.training import TrainingReport

transformers = _loop.require("transformers", "Hugging Face transformers", "transformers")

__all__ = ["Tf32CheckCallback"]


class Tf32CheckCallback(transformers.TrainerCallback):
    """Check, before the first step, what each precision level does to this run's training (see the module).

    Args:
        target: the GPU whose math is emulated (``"a100"``, ``"h100"``, ...), or ``"native"``.
        steps: optimizer steps to train (each ``gradient_accumulation_steps`` batches).
        levels: the precision levels (default all three).
        tolerance: the loss's largest relative deviation from float64's (default 1e-2).
        on_fail: ``"warn"`` (log and warn, train on) or ``"raise"`` (``Tf32LabError`` before the first step).
        trainer: the ``Trainer`` (by default the one whose ``train`` calls the callback).
        conv: cuDNN's float32 math for the convolutions and RNNs in every row, ``"tf32"`` or ``"ieee"`` (no level
            sets it; None: as this process's flag holds it, the run's own math), as ``check_training(conv=)``.
        policy: a :class:`~tf32lab.Policy` (the pin a failed check advises) trained as one more row, ``"policy"``,
            whose verdict is the report's and the callback's, as ``check_training(policy=)``.

    After ``train``, :attr:`report` holds the :class:`~tf32lab.report.training.TrainingReport` (None on processes
    but zero under DDP) and :attr:`passed` the verdict (on every process).
    """

    def __init__(self, target: Union[str, Target] = "a100", steps: int = 20, levels: Optional[Iterable[str]] = None,
                 tolerance: Optional[float] = None, on_fail: str = "warn", trainer: Any = None,
                 conv: Optional[str] = None, policy: Optional[Policy] = None) -> None:
        (self.target, self.steps, self.levels, self.tolerance, self.on_fail, self.conv,
         self.policy) = _loop.Options.checked(target, steps, levels, tolerance, on_fail, conv, policy)
        if trainer is not None and not isinstance(trainer, transformers.Trainer):
            raise Tf32LabError(f"trainer must be a transformers.Trainer (or None: the one whose train() calls the "
                               f"callback), not {type(trainer).__name__}")
        self.trainer = trainer
        self.report: Optional[TrainingReport] = None
        self.passed: Optional[bool] = None
        self._writing: Optional[Written] = None
        self._drawn: Optional[torch.Tensor] = None
        self._checked = _loop.Checked()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer or _calling_trainer()
        if self.passed is not None and self._checked.same(trainer, kwargs.get("model")):
            return  # a second train() of the same Trainer and model is the same run's continuation
        self._wait()
        self.report, self.passed = None, None  # another run: its own check, not the last one's report
        self._checked.now(trainer, kwargs.get("model"))
        # every random stream as it was afterwards (the check's reading of the batches, its rows, the report's
        # writing): the run draws as it would without the check
        self._drawn = torch.random.get_rng_state()  # what the run's iterator, made after this hook, draws from
        with random_state_kept(kwargs["model"], "Tf32CheckCallback"):
            self._run(args, state, trainer, kwargs)

    def _run(self, args: Any, state: Any, trainer: Any, hooked: dict[str, Any]) -> None:
        if hooked.get("model") is not None and _loop.unreached(hooked["model"], " (TrainingArguments(tf32=...) "
                                                               "changes nothing here)"):  # every process alike
            return
        distributed = args.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        error = None
        if state.is_world_process_zero:
            try:
                self.report = self._check(args, state, trainer, **hooked)
                self.passed = self.report.passed
            except Exception as exc:
                if not distributed and self.on_fail == "raise":
                    raise
                error = f"{type(exc).__name__}: {exc}"
        if distributed:  # every process waits for process zero's verdict, and ends (or raises) with it
            shared = [(self.passed, error)]
            torch.distributed.broadcast_object_list(shared, src=0)
            self.passed, error = shared[0]
        if error is not None:
            _loop.not_run(" on process zero" if distributed else "", error, self.on_fail)
            return
        if self.report is None:
            if not self.passed and self.on_fail == "raise":
                raise Tf32LabError("tf32lab training check FAILED on process zero (its log has the report)")
            return
        numbers = {k: v for k, v in _loop.headline(self.report).items() if math.isfinite(v)}
        if trainer is not None:
            trainer.log(numbers)
        self._writing = Written(self.report, args.output_dir)
        if not self.report.passed and self.on_fail == "raise":
            self._wait()  # the run stops here: the files first
        _loop.said(self.report, self.on_fail)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._wait()

    def _wait(self) -> None:
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.wait()

    def _check(self, args: Any, state: Any, trainer: Any, model: Any = None, optimizer: Any = None,
               lr_scheduler: Any = None, train_dataloader: Any = None, **_: Any) -> TrainingReport:
        if model is None or optimizer is None or train_dataloader is None:
            raise Tf32LabError("Tf32CheckCallback: on_train_begin came without the model, optimizer or train "
                               "dataloader")
        # what refuses the run whatever its batches, before they are read
        why = _loop.refused(model, type(model).__name__, [getattr(optimizer, "optimizer", optimizer)], self.policy,
                            trainer)
        if why is not None:
            raise Tf32LabError(f"Tf32CheckCallback: {why}")
        accumulate = int(args.gradient_accumulation_steps)
        notes = []
        device = next(model.parameters()).device
        # from the state the run's pass will start from (random_state_kept has drawn its seed since)
        # the Trainer's whole run, from max_steps or else num_train_epochs
        capped: list[str] = []  # its note, unless the loader's pass is shorter still (then that one's)
        wanted = within(self.steps, state.max_steps, state.global_step, capped,
                        "max_steps" if args.max_steps > 0 else "num_train_epochs")
        # a run resumed mid-epoch skips the batches of its epoch it trained before its checkpoint: the check trains
        # the ones the run trains next, at the run's epoch (the sampler's order of that epoch)
        epoch, skipped = _resumed_at(args, state, train_dataloader)
        per_batch: list[bool] = []
        read = first_batches(train_dataloader, skipped + wanted * accumulate, lambda b: _moved(b, device),
                             iterate=functools.partial(_fresh_pass, epoch=epoch), before=self._drawn,
                             per_batch=per_batch)
        drawn = interleaved(model, per_batch)
        if drawn:
            notes.append(drawn)
        batches = read[skipped:]
        if skipped:
            notes.append(f"the run resumes at step {state.global_step}, {skipped} batches into its epoch: the check "
                         f"trained the batches it trains next, past those")
        # a pass shorter than asked is the epoch's end: the Trainer steps its last, shorter accumulation too
        steps = grouped(batches, accumulate, wanted, ended=len(read) < skipped + wanted * accumulate)
        left = f"the train dataloader has {len(read)} batches" + (f", {len(batches)} past the {skipped} the resumed "
                                                                     f"run skips" if skipped else "")
        if not steps:
            raise Tf32LabError(f"Tf32CheckCallback: {left}, fewer than one optimizer step's {accumulate} "
                               f"(gradient_accumulation_steps)")
        notes.extend([f"{left}: {len(steps)} of the {self.steps} steps asked for were checked"]
                     if len(steps) < wanted else capped)
        for flag, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
            if getattr(args, flag, False):
                notes.append(f"the run trains with {flag}=True: autocast runs its matmuls in {dtype}, which the "
                             f"float32 matmul precision (TrainingArguments(tf32=...)) does not reach; the check "
                             f"trained the model in float32 without autocast")
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
        schedulers = [scheduler] if scheduler is not None else []
        if isinstance(scheduler, _on_metrics()):
            schedulers = []  # the Trainer steps it after an evaluation, with its metric: in no training step
            notes.append(f"{type(scheduler).__name__} steps on an evaluation metric, which the check does not "
                         f"compute: its learning rate is held")
        # a schedule that holds every learning rate where it is (lr_scheduler_type="constant") sets each group's lr
        # to the same float at every step: the rows' optimizers step alone, without a scheduler stepped each step
        schedulers = [one for one in schedulers if not _holds_lr(one, inner)]
        clip = (float(args.max_grad_norm), "norm") if args.max_grad_norm and args.max_grad_norm > 0 else None
        original = _loop.trainable(model)
        # a Trainer subclass's own training_step (a penalty added, its own backward) is the run's step: the check
        # calls it, and it backpropagates itself
        own_step = trainer is not None and _overrides_training_step(trainer)
        # what its compute_loss or training_step logs or counts on the trainer (self.log, TRL's self._metrics and
        # token count) stays in the check: they are called on a trainer aside
        aside = _aside(trainer) if trainer is not None else None
        if clip is not None and trainer is not None and _overrides(trainer, "_clip_grad_norm"):
            # a Trainer subclass's own clipping (by value, a norm of its own over sparse gradients), as the run's
            # loop calls it (max_grad_norm > 0): on the Trainer aside, whose model is the row's copy at its step;
            # clipped by clip_grad_norm_ instead, the check trained another step than the run's
            def clip(params: list[torch.Tensor]) -> None:
                aside._clip_grad_norm(aside.model)

        plain = clip is None and not schedulers and not own_step

        def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            made, rescheduled = _loop.rebound([inner], schedulers, original, params)
            return made[0] if plain else _loop.Steps(made, [(s, 1) for s in rescheduled], clip, zeroed=own_step)

        if trainer is None:
            notes.append("no Trainer found: the loss is the model output's own .loss (Trainer.compute_loss's "
                         "default), not a subclass's compute_loss")
        counts: dict[int, Any] = {}  # each step's token count, the same for every row: counted once
        # as the Trainer's training_step calls it: by keyword, which a compute_loss(model, inputs, **kwargs) takes too
        takes_count = trainer is not None and _takes(trainer.compute_loss, 2, "num_items_in_batch")

        # gradient checkpointing recomputes a layer's forward inside the backward. A PyTorch without
        # torch.overrides.redispatch_function runs that backward without the emulator's function mode: its attention
        # (SDPA) rule is off there, the recompute saves other tensors than the forward did, and every emulated row
        # failed (CheckpointError). There the emulated rows' copies train without it: the same values, their
        # activations kept. A newer PyTorch recomputes under the emulator as the forward ran: nothing to change.
        unchecked = _checkpointed(model) and _emulated(self.target) and not RECOMPUTES_EMULATED
        if unchecked:
            notes.append("the run trains with gradient checkpointing; the check's emulated rows trained without it "
                         "(the same values: a recomputed forward inside the backward is outside the emulator's "
                         "attention rule)")

        def loss(copy: Any, micro: list[Any], step: int) -> torch.Tensor:
            if not all(module.training for module in copy.modules()):
                copy.train()  # as Trainer.training_step does, whatever mode the model was loaded in
            if unchecked:
                for module in copy.modules():  # the row's copy only (never the run's model: the view is not trained)
                    if getattr(module, "gradient_checkpointing", False):
                        module.gradient_checkpointing = False
            if trainer is None:
                outs = [copy(**batch) for batch in micro]
                return torch.stack([out["loss"] if isinstance(out, dict) else out[0] for out in outs]).mean()
            with _tokens_of_this_process(aside):
                # self.model (and model_wrapped) in a compute_loss or training_step: the model being trained, as in
                # the run, here the row's copy (the run's would train in every row's place, in float32)
                aside.__dict__.update(model=copy, model_wrapped=copy)
                if step not in counts:
                    counts[step] = _token_count(aside, micro, device)
                if own_step:
                    return _trainers_step(aside, copy, micro, counts[step])
                return _trainers_loss(aside, copy, micro, counts[step], takes_count)

        stepping = _loop.stepping_copy(model)
        with _submodules_kept(trainer):
            report = _loop.run_check(stepping, type(model).__name__, steps, loss, make, levels=self.levels,
                                     target=self.target, tolerance=self.tolerance, notes=notes, conv=self.conv,
                                     policy=self.policy)
        return dataclasses.replace(report, notes=(*report.notes, tf32_advice(report, args)))


def _aside(trainer: Any) -> Any:
    """The run's Trainer as the check calls its ``compute_loss`` and ``training_step``: an instance of its class
    over a copy of its attributes, those that are plain data (dicts and lists of numbers and strings: TRL's
    ``self._metrics``, which its ``compute_loss`` appends to) copied too, and whose ``log`` does nothing (its
    ``model`` is set to the row's copy at each step). What they
    log (``self.log({...})`` in a ``compute_loss``: the run's ``log_history`` and every ``report_to``), append or
    count (``self._total_train_tokens += ...``) stays in the check; the objects it holds (the model, accelerator,
    arguments) are the run's own."""
    base = type(trainer)

    def log(self: Any, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        return None

    viewed = type(base.__name__, (base,), {"log": log, "__qualname__": base.__qualname__,
                                           "__module__": base.__module__})
    seen = object.__new__(viewed)
    attributes = {key: copy.deepcopy(value) if _plain_data(value) else value for key, value in vars(trainer).items()}
    if attributes.get("accelerator") is not None:
        attributes["accelerator"] = _in_float32(attributes["accelerator"])
    object.__setattr__(seen, "__dict__", attributes)
    return seen


def _in_float32(accelerator: Any) -> Any:
    """The run's accelerator as the check's rows train, in float32: without fp16's loss scaling and autocast
    (``native_amp`` off, no ``scaler``), else the run's own. Through the run's, a subclass's ``training_step``
    (``self.accelerator.backward``) backpropagated each row's loss scaled by the run's GradScaler, and its
    ``_clip_grad_norm`` (``accelerator.clip_grad_norm_``) unscaled the run's own optimizers, once a row: the check
    could not run ("Attempted unscale_ but _scale is None"), or the run itself then failed at its first step
    ("unscale_() has already been called on this optimizer"). A shallow copy: the rest is the run's."""
    if not getattr(accelerator, "native_amp", False) and getattr(accelerator, "scaler", None) is None:
        return accelerator
    made = copy.copy(accelerator)
    made.native_amp, made.scaler = False, None
    return made


@contextlib.contextmanager
def _submodules_kept(trainer: Any) -> Iterator[None]:
    """The submodules of the modules the run's Trainer holds (its ``loss``, which sentence-transformers' Trainer
    keeps, a module holding the model) as they were, put back after the check: the Trainer aside shares those
    modules with the run, and a ``compute_loss`` that puts the model it is given into them
    (sentence-transformers' ``override_model_in_loss``: ``loss.model = model``) left the run's loss holding the
    last row's copy of the model until the run's first step put its own back. The modules in a dict, list or
    tuple the Trainer holds are held too (sentence-transformers' ``loss`` of several datasets: a dict of them)."""
    held = [module for key, value in vars(trainer).items() if key not in ("model", "model_wrapped")
            for module in _modules_in(value)] if trainer is not None else []
    kept = [(module, dict(module._modules)) for one in held for module in one.modules()]
    try:
        yield
    finally:
        for module, submodules in kept:
            if module._modules != submodules:
                module._modules.clear()
                module._modules.update(submodules)


def _modules_in(value: Any) -> list[torch.nn.Module]:
    """``value`` itself where it is a module, else the modules among a dict's values or a list's or tuple's items
    (one level: a Trainer's dict of losses)."""
    if isinstance(value, torch.nn.Module):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [item for item in items if isinstance(item, torch.nn.Module)]


_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _plain_data(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is a container (a dict, list, tuple, set or deque, of any subclass: a ``defaultdict``)
    of Python numbers and strings only, nested at most four deep: copied whole at the cost of its data."""
    if depth > 4 or not isinstance(value, (dict, list, tuple, set, frozenset, collections.deque)):
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
    return all(isinstance(item, _SCALARS) or _plain_data(item, depth + 1) for item in items)


@contextlib.contextmanager
def _tokens_of_this_process(trainer: Any) -> Iterator[None]:
    """Under DDP with ``average_tokens_across_devices``, the Trainer gathers each step's token count from every
    process and scales the loss by their number: a collective that the processes waiting for process zero's
    verdict never join (the check would hang). The check trains process zero's shard as one process would: its own
    tokens, unscaled. The run's arguments are put back on every exit."""
    args = trainer.args
    if not (getattr(args, "average_tokens_across_devices", False) and getattr(args, "world_size", 1) > 1):
        yield
        return
    args.average_tokens_across_devices = False
    try:
        yield
    finally:
        args.average_tokens_across_devices = True


def _token_count(trainer: Any, micro: list[Any], device: torch.device) -> Any:
    """The token count of one step's micro-batches, as ``Trainer.training_step`` gives ``compute_loss`` it
    (``get_batch_samples``; None where this Trainer has none)."""
    return trainer.get_batch_samples(iter(micro), len(micro), device)[1] if hasattr(trainer, "get_batch_samples") \
        else None


def _trainers_loss(trainer: Any, model: Any, micro: list[Any], count: Any, takes_count: bool) -> torch.Tensor:
    """One optimizer step's loss as ``Trainer.training_step`` backpropagates it over its micro-batches: each one's
    ``compute_loss`` given the token count of them all (``count``, where it takes one), divided by their number
    unless that count already scaled it."""
    total = None
    for batch in micro:
        value = trainer.compute_loss(model, dict(batch), num_items_in_batch=count) if takes_count else \
            trainer.compute_loss(model, dict(batch))
        scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (getattr(trainer, "model_accepts_loss_kwargs", False) and count is not None) or \
                getattr(trainer, "compute_loss_func", None) is not None
        if not scaled and len(micro) > 1:  # a division by 1 is exact: the op (and its backward) left out
            value = value / len(micro)
        total = value if total is None else total + value
    assert total is not None
    return total


def _overrides_training_step(trainer: Any) -> bool:
    """Whether the trainer's class has a ``training_step`` of its own, not ``transformers.Trainer``'s."""
    return _overrides(trainer, "training_step")


def _overrides(trainer: Any, name: str) -> bool:
    """Whether the trainer's class has its own ``name``, a method ``transformers.Trainer`` has too (a Trainer
    without it, an older transformers', has nothing to override)."""
    base = getattr(transformers.Trainer, name, None)
    return base is not None and getattr(type(trainer), name, None) is not base


def _trainers_step(trainer: Any, model: Any, micro: list[Any], count: Any) -> torch.Tensor:
    """One optimizer step of a Trainer whose class has its own ``training_step``, as ``Trainer._inner_training_loop``
    runs it on the row's copy: the gradients zeroed (the loop's ``model.zero_grad()`` after each step), then each
    micro-batch's ``training_step(model, inputs, num_items_in_batch)``, which backpropagates itself, with
    ``current_gradient_accumulation_steps`` the step's micro-batches (put back after). The step's loss is the sum
    of what it returned (what the Trainer logs), plus a zero that reaches no parameter: backpropagated already."""
    model.zero_grad(set_to_none=True)
    takes_count = _takes(trainer.training_step, 3)  # as the loop calls it; (*args, **kwargs) takes three too
    missing = object()
    before = trainer.__dict__.get("current_gradient_accumulation_steps", missing)
    trainer.current_gradient_accumulation_steps = len(micro)
    try:
        values = [trainer.training_step(model, dict(batch), count) if takes_count else
                  trainer.training_step(model, dict(batch)) for batch in micro]
    finally:
        if before is missing:
            trainer.__dict__.pop("current_gradient_accumulation_steps", None)
        else:
            trainer.current_gradient_accumulation_steps = before
    total = torch.stack([v.detach().reshape(()) for v in values]).sum()
    return total + torch.zeros((), dtype=total.dtype, device=total.device, requires_grad=True)


def _takes(function: Any, n: int, *keywords: str) -> bool:
    """Whether ``function`` can be called with ``n`` positional arguments and ``keywords`` (its parameters' count
    and names are not that: a ``*args`` takes any number, a ``**kwargs`` any name)."""
    try:
        inspect.signature(function).bind(*([None] * n), **dict.fromkeys(keywords))
    except TypeError:
        return False
    except ValueError:  # no signature to read: called as the loop calls it
        return True
    return True


def tf32_advice(report: TrainingReport, args: Any) -> str:
    """What the report says of ``TrainingArguments(tf32=...)``: TF32 is the check's ``high``."""
    asked = getattr(args, "tf32", None)
    now = f" (this run: tf32={asked})" if asked is not None else ""
    try:
        high = report.level("high")
    except KeyError:
        return (f"TrainingArguments(tf32=True) is TF32, the level 'high', which this check did not run; add 'high' "
                f"to levels to know whether it is safe here{now}")
    # with a policy, the verdict is its row's: the advice on TF32 alone says so, not contradicting it unsaid
    pinned = report.policy_row
    verdict = "" if pinned is None else (f"; the check's verdict is the policy's, which "
                                         f"{'passed' if pinned.passed else 'failed'}")
    if high.passed:
        return (f"TrainingArguments(tf32=True) trains this run within tolerance on {report.target} (TF32 is the "
                f"level 'high', which passed){now}{verdict}")
    if pinned is not None and pinned.passed:
        return (f"TF32 alone (TrainingArguments(tf32=True), the level 'high') fails this run's training on "
                f"{report.target}{now}{verdict}: the policy's levels, its pins applied, train it within tolerance")
    return (f"keep TrainingArguments(tf32=False): TF32 (the level 'high') fails this run's training on "
            f"{report.target}{now}{verdict}")


def _holds_lr(scheduler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether stepping ``scheduler`` leaves every learning rate of ``optimizer`` as it is: transformers' constant
    schedule (``get_constant_schedule``: a ``LambdaLR`` whose every factor is 1), over groups whose lr is still
    its base lr (``base_lr * 1``, the same float); any other scheduler, or a group whose lr was changed since, is
    stepped as the run steps it.

    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> _holds_lr(transformers.get_constant_schedule(opt), opt)
    True
    >>> _holds_lr(transformers.get_linear_schedule_with_warmup(opt, 0, 10), opt)
    False
    """
    constant = getattr(transformers.optimization, "_get_constant_lambda", None)
    if type(scheduler) is not torch.optim.lr_scheduler.LambdaLR or constant is None:
        return False
    groups = scheduler.optimizer.param_groups  # what its step sets (the run's optimizer, or accelerate's wrapper)
    if [id(g) for g in groups] != [id(g) for g in optimizer.param_groups] or len(scheduler.lr_lambdas) != len(groups):
        return False
    return all(fn is constant for fn in scheduler.lr_lambdas) and all(
        type(group["lr"]) is float and type(base) is float and group["lr"] == base
        for group, base in zip(groups, scheduler.base_lrs))


def _on_metrics() -> tuple[type, ...]:
    """The schedulers the Trainer steps after an evaluation, given its metric, and never in a training step
    (``Trainer._inner_training_loop`` leaves them out): ``ReduceLROnPlateau``, and transformers' ``GreedyLR`` where
    this transformers has it.

    >>> torch.optim.lr_scheduler.ReduceLROnPlateau in _on_metrics()
    True
    """
    greedy = getattr(transformers.optimization, "GreedyLR", None)
    return (torch.optim.lr_scheduler.ReduceLROnPlateau, *([greedy] if isinstance(greedy, type) else []))


def _emulated(target: Any) -> bool:
    """Whether the check emulates ``target`` (not ``"native"``: the machine's own kernels, no mode)."""
    return (target if isinstance(target, Target) else resolve_target(target)).emulated


def _checkpointed(model: Any) -> bool:
    """Whether the model recomputes its layers in the backward (``activation_checkpointing_enable``, formerly
    ``gradient_checkpointing_enable``): any module's ``gradient_checkpointing`` flag, which its layers read."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def _calling_trainer() -> Any:
    """The ``Trainer`` whose ``train`` runs this hook: the ``self`` of the nearest calling frame that is one."""
    frame = inspect.currentframe()
    try:
        for _ in range(12):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, transformers.Trainer):
                return owner
        return None
    finally:
        del frame


def _resumed_at(args: Any, state: Any, loader: Any) -> tuple[Optional[int], int]:
    """The epoch a run resumed from a checkpoint trains first and the batches of it that the run skips, as
    ``Trainer._init_training_state`` counts them from the resumed ``global_step`` (none with
    ``ignore_data_skip``); ``(None, 0)`` for a run that starts afresh (its ``global_step`` 0 when training begins).

    >>> from types import SimpleNamespace as Args
    >>> _resumed_at(Args(gradient_accumulation_steps=2, ignore_data_skip=False), Args(global_step=5, max_steps=9),
    ...             list(range(8)))   # 4 steps an epoch: epoch 1, its first step's 2 batches done
    (1, 2)
    """
    if not state.global_step:
        return None, 0
    accumulate = int(args.gradient_accumulation_steps)
    try:
        length: Optional[int] = len(loader)
    except TypeError:  # a stream without a length: the Trainer counts max_steps as one epoch
        length = None
    per_epoch = max(length // accumulate + int(length % accumulate > 0), 1) if length else max(state.max_steps, 1)
    skipped = 0 if args.ignore_data_skip else (state.global_step % per_epoch) * accumulate
    return state.global_step // per_epoch, skipped


def _fresh_pass(loader: Any, epoch: Optional[int] = None) -> Any:
    """A pass over accelerate's prepared dataloader as its own ``__iter__`` would read it (its sampler at the epoch
    it is at, or at ``epoch``, the one a resumed run sets first), without its bookkeeping: the gradient state's
    active dataloader and the pass count stay the run's."""
    base = getattr(loader, "base_dataloader", None)
    if base is None:
        if epoch is not None and hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        return iter(loader)
    if hasattr(loader, "set_epoch") and hasattr(loader, "iteration"):
        loader.set_epoch(loader.iteration if epoch is None else epoch)  # what the run's own pass sets first
    return iter(base)


def _moved(batch: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), batch)
