"""`tf32lab.integrations.transformers.Tf32CheckCallback`: the training check inside a real `Trainer.train`, leaving
the run as it would be without it."""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import logging
import random
import re
import warnings

import numpy as np
import pytest
import torch

import cli_runner
from distributed_jobs import run_job
from drifting_models import offset_forward, offset_layers
from lazy_import import lazy
from tf32lab.emulation.emulator import RECOMPUTES_EMULATED
from tf32lab.errors import Tf32LabError

if importlib.util.find_spec("transformers") is None:
    pytest.skip("could not import 'transformers'", allow_module_level=True)

# transformers' Trainer and GPT-2 imported where a test first reads them, not where pytest-xdist's every worker
# collects this file; its tests, one group, run on one worker: the only one that imports them
transformers, integration = lazy("transformers"), lazy("tf32lab.integrations.transformers")
pytestmark = pytest.mark.xdist_group("transformers")


class Offset(torch.nn.Module):
    """TF32 breaks its training (tests/test_training.py's `Offset`), as a model that returns its own loss."""

    def __init__(self) -> None:
        super().__init__()
        offset_layers(self)

    def forward(self, x, labels=None):
        out = offset_forward(self, x)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


@functools.cache
def doubled_trainer() -> type:
    """A Trainer whose own compute_loss the check must train with (made at its first use: it subclasses Trainer)."""

    class Doubled(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return 2 * loss

    return Doubled


@functools.cache
def penalized_trainer() -> type:
    """A Trainer whose own training_step adds a penalty on the weights to the loss it backpropagates."""

    class Penalized(transformers.Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            loss = loss / self.current_gradient_accumulation_steps + 0.01 * sum(p.pow(2).sum()
                                                                                for p in model.parameters())
            self.accelerator.backward(loss)
            return loss.detach()

    return Penalized


@functools.cache
def value_clipping_trainer() -> type:
    """A Trainer whose own ``_clip_grad_norm`` clips each gradient element by value (the run's loop calls it where
    max_grad_norm > 0), not by the norm."""

    class ValueClipping(transformers.Trainer):
        def _clip_grad_norm(self, model):
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
            return torch.tensor(0.0)

    return ValueClipping


@functools.cache
def scaling_trainer() -> type:
    """A Trainer under fp16 with a GradScaler, as accelerate makes one on a GPU (native AMP; on the CPU it has
    none), whose own ``_clip_grad_norm`` calls the Trainer's: ``accelerator.clip_grad_norm_`` unscales first."""

    class Scaling(transformers.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.accelerator.native_amp = True
            self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1.0)

        def _clip_grad_norm(self, model):
            return super()._clip_grad_norm(model)

    return Scaling


@functools.cache
def metering_trainer() -> type:
    """A Trainer whose compute_loss logs and keeps metrics on itself, as TRL's trainers do (their ``_metrics``, a
    token count), and whose log adds the metrics' mean to the losses it logs."""

    class Metering(transformers.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._metrics = {"train": collections.defaultdict(list)}
            self._tokens = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self._tokens += int(inputs["input_ids"].numel())
            self._metrics["train"]["aux"].append(float(loss))
            self.log({"aux": float(loss)})
            return loss

        def log(self, logs, start_time=None):
            if "loss" in logs:
                aux = self._metrics["train"].pop("aux")
                logs = {**logs, "aux_mean": sum(aux) / len(aux), "aux_n": len(aux), "tokens": self._tokens}
            super().log(logs, start_time)

    return Metering


@functools.cache
def self_model_trainer() -> type:
    """A Trainer whose compute_loss runs `self.model`, the model being trained, not the one it is given."""

    class SelfModel(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return self.model(**inputs).loss

    return SelfModel


def gpt2(dropout: float = 0.0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def tokens(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(0, 40, (10,), generator=g)), "labels": ids} for _ in range(n)]


def offsets(n: int = 320) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": (x := torch.randn(16, generator=g)), "labels": x.sum(-1, keepdim=True)} for _ in range(n)]


def train(tmp_path, model=None, dataset=None, callback=None, trainer_class=None, optimizers=(None, None), **options):
    """A seeded `Trainer.train` (shuffled batches) and what it leaves: the model, its logged losses, the trainer and
    the random streams' next draws."""
    np.random.seed(0)
    random.seed(0)
    model = model if model is not None else gpt2()
    options = {"per_device_train_batch_size": 4, "num_train_epochs": 1, "logging_steps": 1, "report_to": [],
               "save_strategy": "no", "disable_tqdm": True, "learning_rate": 1e-3, "use_cpu": True, "seed": 3,
               **options}
    args = transformers.TrainingArguments(str(tmp_path), **options)
    trainer = (trainer_class or transformers.Trainer)(model=model, args=args, train_dataset=dataset or tokens(),
                            callbacks=[callback] if callback else [], optimizers=optimizers)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    trainer.warned = [str(w.message) for w in seen]
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return model, losses, trainer, (torch.rand(3), np.random.rand(), random.random())


@pytest.fixture(autouse=True)
def quiet_transformers():
    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(before)


def test_a_run_with_the_check_ends_bit_identical_to_one_without(tmp_path, caplog):
    # shuffled batches, dropout, accumulation, a warmup schedule and max_grad_norm clipping (on by default)
    options = {"gradient_accumulation_steps": 2, "warmup_steps": 2, "max_grad_norm": 0.5}
    plain, plain_losses, _, plain_after = train(tmp_path / "a", gpt2(0.1), tokens(16), **options)
    check = integration.Tf32CheckCallback(target="a100", steps=2, levels=("highest", "high"))
    caplog.set_level(logging.INFO, logger="tf32lab.integrations")
    checked, losses, trainer, after = train(tmp_path / "b", gpt2(0.1), tokens(16), callback=check, **options)
    assert all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(), checked.state_dict().values()))
    assert losses == plain_losses and [step for step, _ in losses] == [1, 2]
    assert torch.equal(after[0], plain_after[0]) and after[1:] == plain_after[1:]
    report = check.report
    assert report.passed and check.passed and report.steps == 2
    assert "PASSED | level 'high' | training 2 steps" in caplog.text
    assert "TrainingArguments(tf32=True) trains this run within tolerance on a100" in report.notes[-1]
    assert json.loads((tmp_path / "b" / "tf32lab-training.json").read_text())["steps"] == 2
    assert (tmp_path / "b" / "tf32lab-training.html").exists()
    logged = [h for h in trainer.state.log_history if "tf32lab/passed" in h]
    assert len(logged) == 1 and logged[0]["step"] == 0 and logged[0]["tf32lab/passed"] == 1.0


def test_the_check_trains_the_runs_own_batches_and_compute_loss(tmp_path):
    # no dropout: the check's float32 row reads the batches the run trains on, and gets its first loss
    check = integration.Tf32CheckCallback(steps=1, levels=("highest",))
    _, losses, _, _ = train(tmp_path / "a", callback=check, max_steps=1)
    assert check.report.floor.losses[0] == pytest.approx(losses[0][1], rel=1e-5)
    doubled = integration.Tf32CheckCallback(steps=1, levels=("highest",))
    train(tmp_path / "b", callback=doubled, trainer_class=doubled_trainer(), max_steps=1)
    assert doubled.report.reference_losses[0] == pytest.approx(2 * check.report.reference_losses[0], rel=1e-9)


def alike_with_and_without(tmp_path, check, **options):
    """The run with ``check`` and without it, from the same seeds: they end with the same weights, bit for bit, and
    log the same losses. The checked run's losses and trainer."""
    plain, plain_losses, _, _ = train(tmp_path / "a", **options)
    checked, losses, trainer, _ = train(tmp_path / "b", callback=check, **options)
    assert all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(), checked.state_dict().values()))
    assert losses == plain_losses
    return losses, trainer


def test_a_trainers_own_training_step_is_the_checks_step_and_the_run_untouched(tmp_path):
    # the subclass's training_step backpropagates a penalty besides compute_loss: the check's float32 losses are
    # the run's logged ones (the compute_loss alone gave 3.30 where the run logged 3.55)
    check = integration.Tf32CheckCallback(steps=3, levels=("highest",))
    losses, _ = alike_with_and_without(tmp_path, check, trainer_class=penalized_trainer(), max_steps=3,
                                       gradient_accumulation_steps=2)
    assert check.report.floor.losses == pytest.approx([loss for _, loss in losses], rel=1e-5)


def test_rows_train_in_float32_without_the_runs_gradient_scaler(tmp_path):
    # through the run's accelerator, a row's clipping unscaled the run's own optimizer with the run's GradScaler:
    # the check could not run ("Attempted unscale_ but _scale is None"); where the scaler had scaled already, the
    # run then failed at its first step ("unscale_() has already been called on this optimizer")
    check = integration.Tf32CheckCallback(steps=2, levels=("highest", "high"))
    _, trainer = alike_with_and_without(tmp_path, check, trainer_class=scaling_trainer(), max_steps=2,
                                        max_grad_norm=1.0, optim="sgd", learning_rate=0.1, fp16=True)
    assert check.report is not None and check.report.passed, trainer.warned
    assert trainer.accelerator.scaler is not None and trainer.accelerator.native_amp  # the run's own, as it was


def test_a_trainers_own_gradient_clipping_is_the_checks(tmp_path):
    # clipped by clip_grad_norm_ at max_grad_norm instead, the check's float32 losses left the run's at step 2
    # (3.3308 and 3.3077 where the run logged 3.3363 and 3.3259), and the check judged another training than it
    check = integration.Tf32CheckCallback(steps=3, levels=("highest",))
    losses, _ = alike_with_and_without(tmp_path, check, trainer_class=value_clipping_trainer(), max_steps=3,
                                       max_grad_norm=1.0, optim="sgd", learning_rate=0.1)
    assert check.report.floor.losses == pytest.approx([loss for _, loss in losses], rel=1e-5)


@functools.cache
def forwarding_trainer(method: str = "training_step") -> type:
    """A Trainer whose own ``method`` takes what the loop gives as ``*args, **kwargs`` and hands it on."""

    class Forwarding(transformers.Trainer):
        def training_step(self, *args, **kwargs):
            return super().training_step(*args, **kwargs)

        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    # the other method stays the Trainer's own
    delattr(Forwarding, "compute_loss" if method == "training_step" else "training_step")
    return Forwarding


@pytest.mark.parametrize("method", ["training_step", "compute_loss"])
def test_a_training_step_of_args_and_kwargs_is_given_the_step_s_token_count(tmp_path, method):
    # the loop calls training_step(model, inputs, num_items_in_batch), which calls compute_loss(model, inputs,
    # num_items_in_batch=...): a subclass's step or loss taking *args, **kwargs was called without the count (its
    # parameters counted, or the keyword's name looked for), its loss each micro-batch's mean over the
    # accumulation, not the step's tokens' sum over their count as the run's: with uneven labels its float32
    # losses were not the run's
    g = torch.Generator().manual_seed(1)
    data = []
    for i in range(16):
        ids = torch.randint(0, 40, (10,), generator=g)
        data.append({"input_ids": ids, "labels": torch.where(torch.arange(10) < 2 + (i * 5) % 8, -100, ids)})
    options = {"trainer_class": forwarding_trainer(method), "max_steps": 2, "gradient_accumulation_steps": 2}
    check = integration.Tf32CheckCallback(steps=2, levels=("highest",))
    _, losses, _, _ = train(tmp_path, dataset=data, callback=check, **options)
    assert check.report.floor.losses == pytest.approx([loss for _, loss in losses], rel=1e-5)


def test_a_model_whose_training_tf32_ruins_fails_and_names_the_tf32_argument(tmp_path, caplog):
    check = integration.Tf32CheckCallback(target="a100", steps=20, levels=("highest", "high"))
    caplog.set_level(logging.INFO, logger="tf32lab.integrations")
    torch.manual_seed(0)
    trainer = train(tmp_path, Offset(), offsets(), callback=check, optim="sgd", learning_rate=1e-2,
                    max_grad_norm=0.0, per_device_train_batch_size=16, lr_scheduler_type="constant")[2]
    assert check.report.passed is False and check.passed is False
    assert "FAILED | level 'high' | training 20 steps | diverges at step" in caplog.text
    assert "keep TrainingArguments(tf32=False)" in check.report.notes[-1]
    assert any(w.startswith("tf32lab training check FAILED | level 'high'") for w in trainer.warned)


def test_on_fail_raise_stops_the_run_before_its_first_step(tmp_path):
    check = integration.Tf32CheckCallback(target="a100", steps=20, levels=("highest", "high"), on_fail="raise")
    torch.manual_seed(0)
    model = Offset()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(Tf32LabError, match="FAILED \\| level 'high'"):
        train(tmp_path, model, offsets(), callback=check, optim="sgd", learning_rate=1e-2, max_grad_norm=0.0,
              per_device_train_batch_size=16, lr_scheduler_type="constant")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_loss_that_fails_in_float64_is_said_without_advice_on_a_function_the_user_never_wrote(tmp_path):
    # the check's own step reaches the run's model through the Trainer, and the error went on with "the inputs
    # function uses the workload's own model through 'loss' ...: take the row's copy as an argument, inputs=lambda
    # batch, model: ..." (check_training's advice to one who wrote the workload)
    class NotANumber(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * float("nan")

    check = integration.Tf32CheckCallback(steps=1, levels=("highest",), on_fail="raise")
    with pytest.raises(Tf32LabError) as raised:
        train(tmp_path, callback=check, trainer_class=NotANumber, max_steps=1)
    assert str(raised.value).endswith("fails in float64, before any level ran: step 1: the loss is nan")


def test_mixed_precision_is_said_not_to_be_float32(tmp_path):
    check = integration.Tf32CheckCallback(steps=1, levels=("highest", "high"))
    train(tmp_path, callback=check, bf16=True, max_steps=1)
    assert any("bf16=True: autocast runs its matmuls in bfloat16" in note for note in check.report.notes)


class Augmented(torch.utils.data.Dataset):
    """Token rows shifted at random in the loader's workers, as a data augmentation draws."""

    def __init__(self) -> None:
        self.rows = tokens(16)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        ids = (self.rows[i]["input_ids"] + torch.randint(0, 3, ())) % 40
        return {"input_ids": ids, "labels": ids}


def test_persistent_workers_keep_the_runs_iterator_and_their_random_streams(tmp_path):
    options = {"dataloader_num_workers": 1, "dataloader_persistent_workers": True}
    plain, plain_losses, _, _ = train(tmp_path / "a", dataset=Augmented(), **options)
    check = integration.Tf32CheckCallback(steps=2, levels=("highest",))
    checked, losses, _, _ = train(tmp_path / "b", dataset=Augmented(), callback=check, **options)
    assert all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(), checked.state_dict().values()))
    assert losses == plain_losses


@pytest.mark.parametrize("workers", [0, 1])
def test_an_augmentation_draws_in_the_check_as_in_the_run(tmp_path, workers):
    # the run's iterator is made after the hook, from the state the hook was entered with: the check's pass is made
    # from it too (the main process's draws, or the workers' seeds drawn from it), not from one its own check drew
    # from first
    check = integration.Tf32CheckCallback(steps=1, levels=("highest",))
    _, losses, _, _ = train(tmp_path, dataset=Augmented(), callback=check, max_steps=1,
                            dataloader_num_workers=workers)
    assert check.report.floor.losses[0] == pytest.approx(losses[0][1], rel=1e-5)


class Recurrent(torch.nn.Module):
    """A small LSTM over `offsets`' first 4 features as a sequence: a cuDNN RNN, whose float32 math cuDNN's flag
    sets."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(1, 4, batch_first=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out, _ = self.rnn(x[:, :4].unsqueeze(-1))
        return {"loss": (self.head(out[:, -1]) - labels).pow(2).mean()}


def test_the_rnn_math_the_report_advises_is_an_argument_of_the_callback(tmp_path):
    # the report's advice for cuDNN's RNNs, "train with conv='ieee'" (in the report of this run without conv: they
    # ran TF32 in every row), names an argument the callback takes; with it, they ran IEEE float32
    check = integration.Tf32CheckCallback(target="a100", steps=1, levels=("highest", "high"), conv="ieee")
    torch.manual_seed(0)
    train(tmp_path, Recurrent(), offsets(8), callback=check, max_steps=1)
    notes = check.report.notes
    assert not [n for n in notes if "RNNs ran TF32" in n] and any("RNNs ran at cudnn.rnn 'ieee'" in n for n in notes)


def test_the_pin_the_report_advises_is_checked_by_the_callback(tmp_path):
    # the report's advice, "pin 'lin' with tf32lab.Policy(...) and check again", is a policy the callback takes
    import tf32lab

    check = integration.Tf32CheckCallback(target="a100", steps=2, levels=("high",),
                                          policy=tf32lab.Policy("high", [("lin", "highest")]))
    torch.manual_seed(0)
    train(tmp_path, Offset(), offsets(32), callback=check, max_steps=2, per_device_train_batch_size=16)
    assert [lv.level for lv in check.report.levels] == ["high", "policy"]
    assert check.passed is check.report.passed is check.report.level("policy").passed


def test_the_tf32_advice_does_not_contradict_a_policy_that_passed(tmp_path):
    # 'high' fails, the policy pinning 'lin' passes (the callback's verdict): the advice said "keep
    # TrainingArguments(tf32=False)" and nothing of the policy, beside a check that passed
    import tf32lab

    check = integration.Tf32CheckCallback(target="a100", steps=2, levels=("high",), tolerance=1e-4,
                                          policy=tf32lab.Policy("high", [("lin", "highest")]))
    torch.manual_seed(0)
    train(tmp_path, Offset(), offsets(32), callback=check, max_steps=2, per_device_train_batch_size=16)
    assert not check.report.level("high").passed and check.passed
    advice = check.report.notes[-1]
    assert not advice.startswith("keep TrainingArguments(tf32=False)"), advice
    assert "the check's verdict is the policy's, which passed" in advice, advice


def test_a_policy_naming_modules_the_model_lacks_is_refused_before_a_batch_is_read(tmp_path):
    # the refusal came after the check had read its 20 steps' batches again (workers, tokenizing), for nothing
    import tf32lab

    class Counted(torch.utils.data.Dataset):
        def __init__(self):
            self.items, self.read = offsets(32), 0

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            self.read += 1
            return self.items[i]

    dataset = Counted()
    check = integration.Tf32CheckCallback(target="a100", steps=2, levels=("high",), on_fail="raise",
                                          policy=tf32lab.Policy("high", [("nope", "highest")]))
    torch.manual_seed(0)
    with pytest.raises(Tf32LabError, match=r"^Tf32CheckCallback: policy rule 1 'nope' matches no module of Offset"):
        train(tmp_path, Offset(), dataset, callback=check, max_steps=2, per_device_train_batch_size=16)
    assert dataset.read == 0


def test_an_optimizer_stepping_parameters_outside_the_model_is_refused_in_one_line(tmp_path):
    # sentence-transformers' SoftmaxLoss keeps a classifier of its own, which its Trainer's optimizer steps beside
    # the model: the rows trained copies of the model through the run's classifier, and the check said "training
    # workload 'SentenceTransformer' fails in float64 ... ToCopyBackward0 returned an invalid gradient"
    head = torch.nn.Linear(16, 1)

    class WithAHead(transformers.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.head = head

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return (self.head(model(**inputs)["logits"].expand(-1, 16)) - inputs["labels"]).pow(2).mean()

    torch.manual_seed(0)
    model = Offset()
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=1e-2)
    check = integration.Tf32CheckCallback(target="a100", steps=1, levels=("high",), on_fail="raise")
    with pytest.raises(Tf32LabError, match=r"the optimizer steps 2 trainable parameters outside the model "
                                           r"\(Linear's, the trainer's head\)"):
        train(tmp_path, model, offsets(16), callback=check, trainer_class=WithAHead, max_steps=1,
              optimizers=(optimizer, None))
    assert head.weight.grad is None  # the run's own parameters untouched


@pytest.mark.parametrize("in_a_dict", [False, True])
def test_a_loss_module_that_holds_the_model_holds_the_runs_model_after_the_check(tmp_path, in_a_dict):
    # sentence-transformers' Trainer keeps its loss (a module holding the model) on itself, one per dataset in a dict
    # where it trains on several (self.loss[dataset_name]), and its compute_loss puts the model it is given into it
    # (override_model_in_loss): after the check, the run's loss held the last row's copy of the model until the
    # run's first step put the run's back
    class Loss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, inputs):
            return self.model(**inputs)["loss"]

    def loss_of(trainer):
        return trainer.loss["a"] if in_a_dict else trainer.loss

    class HoldsItsLoss(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = loss_of(self)
            if model is self.model_wrapped and loss.model is not model:
                loss.model = model
            return loss(inputs)

    seen = []

    class Peek(transformers.TrainerCallback):  # a callback after the check's
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen.append(loss_of(trainer).model is model)

    torch.manual_seed(0)
    model = Offset()
    check = integration.Tf32CheckCallback(target="a100", steps=1, levels=("high",))
    args = transformers.TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
                                          save_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = HoldsItsLoss(model=model, args=args, train_dataset=offsets(8), callbacks=[check, Peek()])
    trainer.loss = {"a": Loss(model)} if in_a_dict else Loss(model)
    trainer.train()
    assert check.passed is not None and seen == [True]


def test_bad_arguments_are_one_line():
    import tf32lab

    with pytest.raises(Tf32LabError, match="on_fail must be 'raise' or 'warn', not 'ignore'"):
        integration.Tf32CheckCallback(on_fail="ignore")
    with pytest.raises(Tf32LabError, match="steps must be a whole number >= 1, not -1"):
        integration.Tf32CheckCallback(steps=-1)
    # refused when the callback is made, not when training starts (after the model and data are loaded)
    with pytest.raises(Tf32LabError, match="unknown target 'h999'"):
        integration.Tf32CheckCallback(target="h999")
    with pytest.raises(Tf32LabError, match=r"tolerance is one number >= 0.*not -1"):
        integration.Tf32CheckCallback(tolerance=-1)
    with pytest.raises(Tf32LabError, match="unknown conv math 'fast'"):
        integration.Tf32CheckCallback(conv="fast")
    with pytest.raises(Tf32LabError, match=r"policy must be a tf32lab\.Policy, not str"):
        integration.Tf32CheckCallback(policy="pins.json")
    with pytest.raises(Tf32LabError, match=r"^level 'bfx9' \(cuda.matmul = 'bfx9'\) needs compute capability 10.0"):
        integration.Tf32CheckCallback(target="h100", levels=("high",), policy=tf32lab.Policy("high", [("lin", "bfx9")]))
    with pytest.raises(Tf32LabError, match=r"^level 'bfx9' \(cuda.matmul = 'bfx9'\) needs compute capability 10.0"):
        integration.Tf32CheckCallback(target="h100", levels=("bfx9",))
    assert integration.Tf32CheckCallback(levels="high").levels == ("high",)  # one level named alone, not its letters
    # another object as the trainer stopped the run with a TypeError from inside the callback, at on_train_begin
    with pytest.raises(Tf32LabError, match=r"^trainer must be a transformers\.Trainer \(or None: the one whose "
                                           r"train\(\) calls the callback\), not int$"):
        integration.Tf32CheckCallback(trainer=42)


def test_without_transformers_the_integration_names_its_extra(tmp_path):
    code = ("import sys; sys.modules['transformers'] = None; import tf32lab\n"
            "try:\n    import tf32lab.integrations.transformers\nexcept tf32lab.Tf32LabError as e:\n    print(e)")
    # forked from the suite's CLI server (tf32lab imported there, transformers and the integration not)
    (tmp_path / "without_transformers.py").write_text(code)
    out = cli_runner.run(module="without_transformers", cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'tf32lab[transformers]'" in out.stdout and len(out.stdout.strip().splitlines()) == 1


@pytest.mark.slow
def test_under_ddp_process_zero_checks_and_every_process_ends_with_its_verdict(tmp_path):
    # two CPU processes with torchrun's environment (gloo), a loss that takes the token count gathered across
    # processes (the check on process zero alone once waited forever in that gather): forked from one process that
    # imported transformers' Trainer (tests/transformers_ddp_job.py), where torchrun's agent and each process
    # imported torch, and each process the Trainer, anew (21 CPU seconds, against 8)
    ranks = run_job("trainer", 2, str(tmp_path), "warn", timeout=400)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-3000:] for r in ranks]
    out = "".join(r.stdout for r in ranks)
    found = sorted(re.findall(r"process (\d): passed=(True|False|None) report=(True|False)", out))
    assert found == [("0", "True", "True"), ("1", "True", "False")], out
    assert "same weights: True" in out.splitlines()


def test_a_report_file_that_cannot_be_written_is_warned_of_and_the_run_is_kept(tmp_path):
    # the JSON's path is taken by a folder: the writing (in a thread) fails; the run's own training must not
    (tmp_path / "b" / "tf32lab-training.json").mkdir(parents=True)
    plain, plain_losses, _, _ = train(tmp_path / "a", gpt2(), tokens(8))
    check = integration.Tf32CheckCallback(target="a100", steps=1, levels=("highest", "high"))
    checked, losses, trainer, _ = train(tmp_path / "b", gpt2(), tokens(8), callback=check)
    assert all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(), checked.state_dict().values()))
    assert losses == plain_losses and check.report is not None and check.report.passed
    said = [w for w in trainer.warned if "report could not be written" in w]
    assert len(said) == 1 and str(tmp_path / "b") in said[0], trainer.warned



def test_max_steps_caps_the_steps_checked(tmp_path):
    # the run trains 2 steps: the check trains those, not steps the run never takes
    check = integration.Tf32CheckCallback(steps=5, levels=("highest",))
    train(tmp_path, callback=check, max_steps=2)
    assert check.report.steps == 2
    assert any("the run trains 2 optimizer steps (max_steps)" in note for note in check.report.notes)


def test_an_epoch_shorter_than_the_runs_steps_is_the_one_note_on_the_steps_checked(tmp_path):
    # 3 epochs of 2 steps: the check trains the first epoch's 2, and said besides that it had checked the run's 6
    check = integration.Tf32CheckCallback(steps=10, levels=("highest",))
    train(tmp_path, callback=check, dataset=tokens()[:8], num_train_epochs=3)
    assert check.report.steps == 2
    assert [note for note in check.report.notes if "steps asked for" in note] == [
        "the train dataloader has 2 batches: 2 of the 10 steps asked for were checked"]


def _without_and_with(tmp_path, callback, dataset, train_options: dict, eval_dataset=None, **arguments) -> list:
    """The same seeded run of a fresh GPT-2 without the callback, then with it: each run's model and logged losses."""
    runs = []
    for given in (None, callback):
        np.random.seed(0)
        random.seed(0)
        model = gpt2()
        args = transformers.TrainingArguments(str(tmp_path / ("b" if given else "a")), per_device_train_batch_size=4,
                                              report_to=[], save_strategy="no", disable_tqdm=True,
                                              learning_rate=1e-3, use_cpu=True, seed=3, **arguments)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                                       callbacks=[given] if given else [])
        trainer.train(**train_options)
        runs.append((model, [h["loss"] for h in trainer.state.log_history if "loss" in h]))
    return runs


def test_a_run_resumed_from_its_checkpoint_is_checked_and_untouched(tmp_path):
    # the resumed optimizer has state (AdamW's moments, float32): the float64 row steps its own float64 copy of it
    train(tmp_path / "first", max_steps=3, save_strategy="steps", save_steps=3)
    saved = str(tmp_path / "first" / "checkpoint-3")
    callback = integration.Tf32CheckCallback(steps=2, levels=("highest", "high"), on_fail="raise")
    runs = _without_and_with(tmp_path, callback, tokens(), {"resume_from_checkpoint": saved}, max_steps=6)
    assert callback.report is not None and callback.report.steps == 2
    assert all(torch.equal(p, q) for p, q in zip(runs[0][0].state_dict().values(), runs[1][0].state_dict().values()))


def test_a_model_without_float32_weights_is_said_to_have_nothing_to_check_and_trains_on(tmp_path):
    # a model loaded in bfloat16 trains no float32 matmul: tf32=... changes nothing, and no failure is raised
    check = integration.Tf32CheckCallback(steps=2, levels=("highest", "high"), on_fail="raise")
    trainer = train(tmp_path, gpt2().to(torch.bfloat16), callback=check, max_steps=2)[2]
    assert check.report is None and trainer.state.global_step == 2
    assert [w for w in trainer.warned if w.startswith("tf32lab")] == [
        "tf32lab training check (TrainingArguments(tf32=...) changes nothing here): nothing to check, the run trains "
        "its weights in bfloat16, not float32, and the float32 matmul precision reaches only float32 matmuls"]


def test_gradient_checkpointing_is_checked_and_the_run_untouched(tmp_path):
    # the emulated rows' copies train with checkpointing, recomputed under the emulator as the forward ran, and no
    # row fails with a CheckpointError; a PyTorch that cannot recompute so trains them without it, with a note
    plain = train(tmp_path / "a", gradient_checkpointing=True, max_steps=2)[0]
    check = integration.Tf32CheckCallback(steps=2, levels=("highest", "high"), on_fail="raise")
    checked, losses, _, _ = train(tmp_path / "b", callback=check, gradient_checkpointing=True, max_steps=2)
    assert check.report.passed and check.report.floor.failure is None
    assert check.report.floor.losses[0] == pytest.approx(losses[0][1], rel=1e-5)
    noted = any("gradient checkpointing" in note for note in check.report.notes)
    assert noted is not RECOMPUTES_EMULATED
    assert all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(), checked.state_dict().values()))


@pytest.mark.parametrize("kind", ["reduce_lr_on_plateau", "greedy"])
def test_a_scheduler_stepped_on_evaluation_metrics_is_held_and_the_run_untouched(tmp_path, kind):
    # the Trainer steps ReduceLROnPlateau (and GreedyLR) after an evaluation, with its metric, in no training step:
    # the check holds its learning rate, as the run does until its first evaluation (here after the check's steps)
    if kind == "greedy" and not hasattr(transformers.optimization, "GreedyLR"):
        pytest.skip("this transformers has no GreedyLR")
    callback = integration.Tf32CheckCallback(steps=2, levels=("highest", "high"), on_fail="raise")
    runs = _without_and_with(tmp_path, callback, tokens(16), {}, max_steps=4, logging_steps=1,
                             lr_scheduler_type=kind, eval_strategy="steps", eval_steps=2, eval_dataset=tokens(4))
    report = callback.report
    assert report is not None and report.passed and report.steps == 2
    assert any("steps on an evaluation metric, which the check does not compute" in n for n in report.notes)
    assert report.floor.losses[1] == pytest.approx(runs[0][1][1], rel=1e-5)
    assert all(torch.equal(p, q) for p, q in zip(runs[0][0].state_dict().values(), runs[1][0].state_dict().values()))
    assert runs[0][1] == runs[1][1]


def test_levels_that_are_no_collection_of_names_are_one_line():
    # refused as the callback is made, in one line, not a TypeError's traceback
    for levels in (5, b"high"):
        with pytest.raises(Tf32LabError, match=r"^levels must be a level's name or a collection of them .*, not "):
            integration.Tf32CheckCallback(levels=levels)


def test_a_run_resumed_mid_epoch_is_checked_on_the_batches_it_trains_next(tmp_path):
    # 8 batches an epoch, resumed at step 3: the Trainer skips the epoch's 3 batches trained before the checkpoint;
    # the check's float32 row trains the run's next ones (it trained the first 3 again, and lost 0.05 less)
    train(tmp_path / "first", max_steps=3, save_strategy="steps", save_steps=3)
    check = integration.Tf32CheckCallback(steps=2, levels=("highest",))
    np.random.seed(0)
    random.seed(0)
    args = transformers.TrainingArguments(str(tmp_path / "b"), per_device_train_batch_size=4, max_steps=5,
                                          report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-3,
                                          use_cpu=True, seed=3, logging_steps=1)
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=tokens(), callbacks=[check])
    trainer.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-3"))
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > 3]
    assert check.report.steps == 2 and len(logged) == 2
    assert check.report.floor.losses == pytest.approx(logged, rel=1e-5)
    assert any("the run resumes at step 3, 3 batches into its epoch" in note for note in check.report.notes)


def test_an_epochs_last_shorter_accumulation_is_checked_as_the_trainer_steps_it(tmp_path):
    # 5 batches an epoch, gradient_accumulation_steps=3: the Trainer's second step is the epoch's last 2 batches,
    # their losses over 2; the check trains it too (it trained 1 step of the 2 asked for)
    check = integration.Tf32CheckCallback(steps=2, levels=("highest",))
    _, losses, _, _ = train(tmp_path, dataset=tokens(20), callback=check, gradient_accumulation_steps=3)
    assert check.report.steps == 2 and len(losses) == 2
    assert check.report.floor.losses == pytest.approx([loss for _, loss in losses], rel=1e-5)


def test_a_constant_schedule_is_not_stepped_in_the_rows_and_changes_no_number(tmp_path, monkeypatch):
    # lr_scheduler_type="constant" sets every lr to the same float at every step: the rows step their optimizer
    # alone; a schedule that moves the lr (linear, here) is still stepped in them
    stepped = []
    step, begin = torch.optim.lr_scheduler.LambdaLR.step, integration.Tf32CheckCallback.on_train_begin

    def counted(self, *args, **kwargs):
        stepped[-1] += 1
        return step(self, *args, **kwargs)

    def checked(self, *args, **kwargs):
        stepped.append(0)
        monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", counted)
        try:
            return begin(self, *args, **kwargs)
        finally:
            monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", step)

    monkeypatch.setattr(integration.Tf32CheckCallback, "on_train_begin", checked)
    reports = []
    for kind in ("constant", "linear"):
        check = integration.Tf32CheckCallback(target="a100", steps=2, levels=("highest", "high"))
        train(tmp_path / kind, callback=check, max_steps=2, lr_scheduler_type=kind)
        reports.append(check.report)
    assert stepped[0] == 0 and stepped[1] > 0
    # the constant schedule stepped as before: the same numbers, bit for bit
    monkeypatch.setattr("tf32lab.integrations.transformers._holds_lr", lambda scheduler, optimizer: False)
    check = integration.Tf32CheckCallback(target="a100", steps=2, levels=("highest", "high"))
    train(tmp_path / "stepped", callback=check, max_steps=2, lr_scheduler_type="constant")
    assert stepped[2] > 0
    for made, before in zip(reports[0].to_dict()["levels"], check.report.to_dict()["levels"]):
        assert made["losses"] == before["losses"] and made["drift"] == before["drift"]
    assert reports[0].floor.losses == check.report.floor.losses
    assert reports[0].reference_losses == check.report.reference_losses


def test_an_augmentation_in_the_main_process_beside_dropout_is_said_to_draw_otherwise(tmp_path):
    # the Trainer reads a batch, trains a step (its dropout draws), reads the next: the check reads its batches at
    # once, its second batch shifted with other draws than the run's, without a word; without dropout, no note
    notes = []
    for dropout in (0.1, 0.0):
        check = integration.Tf32CheckCallback(steps=2, levels=("highest",))
        train(tmp_path / str(dropout), gpt2(dropout), dataset=Augmented(), callback=check, max_steps=2)
        notes.append(any("augmented with other draws" in note for note in check.report.notes))
    assert notes == [True, False]


def test_what_a_compute_loss_logs_and_counts_on_its_trainer_stays_in_the_check(tmp_path):
    # the check called the run's own trainer: its self.log put each row's losses into the run's log_history (and
    # every report_to) at step 0, and the metrics it kept were averaged into the run's first logged ones (aux_n 7
    # where the run's was 1, its token count 280 where the run's was 40)
    def logged(trainer) -> list:
        return [h for h in trainer.state.log_history  # not the check's own, nor the run's timings
                if not any(k.startswith("tf32lab") for k in h) and "train_runtime" not in h]

    plain = train(tmp_path / "a", dataset=tokens(4), trainer_class=metering_trainer(), max_steps=1)[2]
    check = integration.Tf32CheckCallback(steps=1, levels=("highest",), on_fail="raise")
    checked = train(tmp_path / "b", dataset=tokens(4), callback=check, trainer_class=metering_trainer(),
                    max_steps=1)[2]
    assert check.report.passed
    assert logged(checked) == logged(plain) and [h["aux_n"] for h in logged(plain) if "loss" in h] == [1]


def test_a_callback_kept_for_another_run_checks_that_run(tmp_path):
    # a second Trainer given the same callback (a hyperparameter sweep) was left unchecked, the report the first's
    check = integration.Tf32CheckCallback(steps=2, levels=("highest",))
    reports = []
    for lr in (1e-2, 1e-4):
        train(tmp_path / str(lr), dataset=tokens(8), callback=check, max_steps=2, learning_rate=lr)
        reports.append(check.report)
    first, second = (report.reference_losses for report in reports)
    assert first[0] == pytest.approx(second[0], rel=1e-12) and first[1] != pytest.approx(second[1], rel=1e-3)


def test_a_compute_loss_running_self_model_trains_the_rows_copy(tmp_path):
    # self.model was the run's model in every row (float32, whatever the row): the float64 row failed, and the
    # check could not run ("the inputs function uses the workload's own model ... inputs=lambda batch, model")
    check = integration.Tf32CheckCallback(steps=2, levels=("highest",), on_fail="raise")
    _, losses, _, _ = train(tmp_path, dataset=tokens(8), callback=check, trainer_class=self_model_trainer(),
                            max_steps=2)
    assert check.report.floor.losses == pytest.approx([loss for _, loss in losses], rel=1e-5)
