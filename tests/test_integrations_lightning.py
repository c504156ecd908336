"""`tf32lab.integrations.lightning.Tf32Check`: the training check inside a real `Trainer.fit`, leaving the run as it
would be without it."""

from __future__ import annotations

import csv
import gc
import importlib
import importlib.util
import json
import logging
import random
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import cli_runner
from lazy_import import lazy
from tf32lab.errors import Tf32LabError

if importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("could not import 'pytorch_lightning'", allow_module_level=True)

# Lightning (about 3 CPU seconds) imported where a test first reads it, not where pytest-xdist's every worker collects
# this file; its tests, one group, run on one worker: the only one that imports it
L, lightning, modules = lazy("pytorch_lightning"), lazy("tf32lab.integrations.lightning"), lazy("lightning_modules")
pytestmark = pytest.mark.xdist_group("lightning")


def data(n: int = 96, offset: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    if offset:
        x = torch.randn(n, 16, generator=g)
        return TensorDataset(x, x.sum(-1, keepdim=True))
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def fit(tmp_path, module_class=None, callback=None, dataset=None, generator=None, **options):
    """A seeded `Trainer.fit` (shuffled batches, dropout), and what it leaves: the module, the losses it logged and
    the random streams' next draws."""
    # Lightning's first Trainer imports rich, which draws from Python's stream as it is imported (rich/style.py):
    # imported before the seeding, or the first fit of a process (the run without the check, alone) draws once more
    importlib.import_module("pytorch_lightning.callbacks.progress.rich_progress")
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    module = (module_class or modules.Regression)()
    loader = DataLoader(dataset or data(), batch_size=8, shuffle=True, generator=generator)
    logger = L.loggers.CSVLogger(tmp_path, name="run")
    options = {"max_epochs": 2, "enable_progress_bar": False, "enable_checkpointing": False,
               "enable_model_summary": False, "log_every_n_steps": 1, **options}
    trainer = L.Trainer(callbacks=[callback] if callback else [], default_root_dir=tmp_path, logger=logger,
                        **options)
    with warnings.catch_warnings(record=True) as seen:  # Lightning's advice on workers and CPUs, and the check's
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    trainer.warned = [str(w.message) for w in seen]
    with open(f"{logger.log_dir}/metrics.csv") as f:
        losses = [(row["step"], row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]
    after = (torch.rand(3), np.random.rand(), random.random())
    return module, losses, after, trainer


def same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_run_with_the_check_ends_bit_identical_to_one_without(tmp_path, caplog):
    # shuffled batches drawn from the torch stream, a loader generator, dropout, accumulation, clipping, a scheduler
    options = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    plain, plain_losses, plain_after, _ = fit(tmp_path / "a", generator=torch.Generator().manual_seed(5), **options)
    check = lightning.Tf32Check(target="a100", steps=3, levels=("highest", "high"))
    caplog.set_level(logging.INFO, logger="tf32lab.integrations")
    checked, losses, after, _ = fit(tmp_path / "b", callback=check,
                                    generator=torch.Generator().manual_seed(5), **options)
    assert same_weights(plain, checked)
    assert losses == plain_losses and len(losses) == 12  # 96 / 8 batches / 2 accumulated x 2 epochs, same steps
    assert torch.equal(after[0], plain_after[0]) and after[1:] == plain_after[1:]
    report = check.report
    assert report.passed and check.passed and report.steps == 3 and [lv.level for lv in report.levels] == \
        ["highest", "high"]
    assert "PASSED | level 'high' | training 3 steps" in caplog.text
    # the report beside the run's logs, its headline numbers in the run's logger at the step it was at
    written = json.loads((tmp_path / "b" / "run" / "version_0" / "tf32lab-training.json").read_text())
    assert written["steps"] == 3 and (tmp_path / "b" / "run" / "version_0" / "tf32lab-training.html").exists()
    with open(tmp_path / "b" / "run" / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("tf32lab/passed")]
    assert len(rows) == 1 and rows[0]["step"] == "0" and float(rows[0]["tf32lab/passed"]) == 1.0
    assert float(rows[0]["tf32lab/high/drift"]) == pytest.approx(report.level("high").drift)


def test_a_rows_optimizers_are_not_kept_past_its_row(tmp_path):
    # each row's optimizers were kept in the callback's own lookup until the whole check ended, with their state
    # (float64's Adam moments, twice the model in float64): the callback's peak memory over a 19M-parameter MLP was
    # a float32 model and its optimizer's state above check_training's of the same steps
    modules.Counted.alive.clear()
    fit(tmp_path, modules.Counted, callback=lightning.Tf32Check(steps=2, levels=("highest", "high", "medium")),
        max_steps=1)
    checked = modules.Counted.alive[:-1]  # the run's own step last
    assert len(checked) >= 6 and checked[-1] == checked[0], modules.Counted.alive


def test_no_copy_of_the_module_is_left_once_the_check_is_done(tmp_path):
    # the callback's record of the row being trained (its copy of the module and its last loss) and the closures
    # that read it referred to each other: the last row's copy stayed until the collector's next full pass
    gc.collect()
    gc.disable()
    try:
        module = fit(tmp_path, callback=lightning.Tf32Check(steps=2, levels=("highest", "high")), max_steps=1)[0]
        # by type: a copy is of a class made from the module's, and isinstance() on a dead weakref.proxy raises
        copies = [o for o in gc.get_objects() if issubclass(type(o), modules.Regression) and o is not module]
    finally:
        gc.enable()
    assert copies == []


def test_the_check_trains_the_runs_own_schedule_and_clipping(tmp_path):
    # the same module and batches, clipped hard: the check's float64 losses follow the run's clipping
    loose = lightning.Tf32Check(steps=3, levels=("highest",))
    fit(tmp_path / "a", callback=loose, max_epochs=1)
    tight = lightning.Tf32Check(steps=3, levels=("highest",))
    fit(tmp_path / "b", callback=tight, max_epochs=1, gradient_clip_val=1e-3)
    assert loose.report.reference_losses[0] == pytest.approx(tight.report.reference_losses[0], rel=1e-6)
    # two AdamW steps of lr 1e-2 apart on the run's own batches: 5e-4 apart at step 3 here
    assert loose.report.reference_losses[2] != pytest.approx(tight.report.reference_losses[2], rel=1e-4)


def test_a_model_whose_training_tf32_ruins_fails_and_says_so(tmp_path, caplog):
    check = lightning.Tf32Check(target="a100", steps=20, levels=("highest", "high"))
    caplog.set_level(logging.INFO, logger="tf32lab.integrations")
    trainer = fit(tmp_path, modules.Offset, callback=check, dataset=data(320, offset=True), max_epochs=1)[3]
    assert any(w.startswith("tf32lab training check FAILED | level 'high'") for w in trainer.warned)
    assert check.report.passed is False and check.passed is False
    assert "FAILED | level 'high' | training 20 steps | diverges at step" in caplog.text
    # its advice in the callback's words: a policy given to it, not the CLI's --policy nor tune on a spec
    advice = " ".join(check.report.conclusion())
    assert "give the callback `policy=tf32lab.Policy(\"high\", [(\"lin\", \"highest\")])`" in advice, advice
    assert "--policy" not in advice and "tune SPEC" not in advice and "give the callback" in caplog.text


def test_the_pin_the_report_advises_is_checked_by_the_callback(tmp_path):
    # a failed check advises "pin 'lin' with `tf32lab.Policy("high", [("lin", "highest")])` and check again": the
    # callback had no policy to check (and a policy applied to the run's module is refused): it takes one, trained
    # as one more row whose verdict is the report's
    import tf32lab

    check = lightning.Tf32Check(target="a100", steps=4, levels=("high",),
                                policy=tf32lab.Policy("high", [("net.0", "highest")]))
    module, losses = fit(tmp_path / "checked", callback=check, max_epochs=1)[:2]
    assert [lv.level for lv in check.report.levels] == ["high", "policy"]
    assert check.passed is check.report.passed is check.report.level("policy").passed
    # the policy trained the row's copy: the run's module is not hooked, and trains as without the callback
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    alone, alone_losses = fit(tmp_path / "alone", max_epochs=1)[:2]
    assert same_weights(module, alone) and losses == alone_losses


def test_a_failed_policy_is_the_verdict_the_stopped_run_names(tmp_path):
    # with a policy, its row is the verdict: a run stopped by it named the first failed level instead
    import tf32lab

    check = lightning.Tf32Check(target="a100", steps=2, levels=("high",), tolerance=1e-12, on_fail="raise",
                                policy=tf32lab.Policy("high"))
    with pytest.raises(Tf32LabError, match=r"^tf32lab training check FAILED \| level 'policy'"):
        fit(tmp_path, callback=check, max_epochs=1)


def test_an_optimizer_stepping_parameters_outside_the_module_is_refused_in_one_line(tmp_path):
    # the rows trained copies of the module through the run's own head, and the check said the module "fails in
    # float64 ... ToCopyBackward0 returned an invalid gradient"
    check = lightning.Tf32Check(target="a100", steps=1, levels=("high",), on_fail="raise")
    with pytest.raises(Tf32LabError, match=r"^Tf32Check: the optimizer steps 2 trainable parameters outside the model"):
        fit(tmp_path, modules.StepsAHeadOutside, callback=check, max_steps=1)


def test_a_policy_applied_to_the_runs_module_is_refused_in_the_callbacks_words(tmp_path):
    # check_training's refusal advised check(policy=...) and `tf32lab check --policy FILE`, neither of which the
    # callback's user calls: the callback takes the policy itself
    import tf32lab

    class Applied(modules.Regression):
        def __init__(self):
            super().__init__()
            tf32lab.Policy("high", [("net.0", "highest")]).apply(self)

    check = lightning.Tf32Check(target="a100", steps=1, levels=("high",), on_fail="raise")
    with pytest.raises(Tf32LabError, match=r"has a policy applied .*give it to the callback \(policy=\.\.\.\)") as e:
        fit(tmp_path, module_class=Applied, callback=check, max_epochs=1)
    assert "check(policy=" not in str(e.value) and "--policy" not in str(e.value)


def test_on_fail_raise_stops_the_run_before_its_first_step(tmp_path):
    check = lightning.Tf32Check(target="a100", steps=20, levels=("highest", "high"), on_fail="raise")
    torch.manual_seed(0)
    module = modules.Offset()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = L.Trainer(callbacks=[check], default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, max_epochs=1)
    with pytest.raises(Tf32LabError, match="FAILED \\| level 'high'"):
        trainer.fit(module, DataLoader(data(320, offset=True), batch_size=16))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert check.report.passed is False


def test_manual_optimization_with_two_optimizers(tmp_path):
    plain, plain_losses, _, _ = fit(tmp_path / "a", modules.TwoOptimizers, max_epochs=1)
    check = lightning.Tf32Check(steps=3, levels=("highest", "high"))
    checked, losses, _, _ = fit(tmp_path / "b", modules.TwoOptimizers, callback=check, max_epochs=1)
    assert same_weights(plain, checked) and losses == plain_losses
    report = check.report
    assert report.passed and len(report.reference_losses) == 3
    # the rows stepped both optimizers: every parameter moved from where the run started, in float64 too
    assert all(w.normwise < 1e-3 for w in report.level("high").weights)
    assert report.reference_losses[0] != report.reference_losses[2]


def test_a_training_step_that_reads_self_trainer_is_checked_and_its_run_untouched(tmp_path):
    plain, plain_losses, _, _ = fit(tmp_path / "a", modules.ReadsItsTrainer, max_epochs=1)
    check = lightning.Tf32Check(steps=2, levels=("highest", "high"))
    checked, losses, _, _ = fit(tmp_path / "b", modules.ReadsItsTrainer, callback=check, max_epochs=1)
    assert check.report.passed and check.report.steps == 2
    assert same_weights(plain, checked) and losses == plain_losses and len(losses) == 12


class OneShot(torch.utils.data.IterableDataset):
    """A stream read once: each `iter` is the same iterator, so a batch read is a batch gone."""

    def __init__(self) -> None:
        self.rows = iter(data(64))

    def __iter__(self):
        return self.rows


def test_a_stream_that_cannot_be_read_again_is_refused_before_a_batch_is_consumed(tmp_path):
    class Stop(L.Callback):
        def on_train_start(self, trainer, pl_module):
            raise Tf32LabError("stopped where the check would run")

    left = []
    check = lightning.Tf32Check(steps=2, on_fail="raise")  # "warn": a warning, and the run reads the stream itself
    for callback, match in ((Stop(), "stopped"), (check, "hands out one shared iterator")):
        stream = OneShot()
        trainer = L.Trainer(callbacks=[callback], default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False, max_epochs=1)
        with pytest.raises(Tf32LabError, match=match):
            trainer.fit(modules.Regression(), DataLoader(stream, batch_size=8))
        left.append(len(list(stream.rows)))
    assert left[0] == left[1] > 0  # the check read no row of what Lightning left for the run


def test_a_generator_of_batches_is_refused_and_the_run_trains_all_of_them(tmp_path):
    # Lightning trains on any iterable; a generator of batches is read once, and the check read its first 2 batches
    # out of the run (which trained 6 of its 8 batches, other weights, other logged losses)
    def run(callback) -> tuple:
        batches = [(x.reshape(8, 8), y.reshape(8, 1)) for x, y in zip(data(64).tensors[0].split(8),
                                                                      data(64).tensors[1].split(8))]
        torch.manual_seed(0)
        module = modules.Plain()
        trainer = L.Trainer(callbacks=[callback] if callback else [], default_root_dir=tmp_path, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                            max_epochs=1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.fit(module, (batch for batch in batches))
        return module, trainer.global_step, [str(w.message) for w in seen if "tf32lab" in str(w.message)]

    plain, plain_steps, _ = run(None)
    check = lightning.Tf32Check(steps=2, levels=("highest",))
    checked, steps, warned = run(check)
    assert steps == plain_steps == 8 and same_weights(plain, checked)
    assert check.passed is None and len(warned) == 1 and "the train dataloader is a generator, read once" in warned[0]


def test_several_train_dataloaders_are_read_together_as_the_run_reads_them(tmp_path):
    def both():
        return {"a": DataLoader(data(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)),
                "b": DataLoader(data(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))}

    runs = []
    for callback in (None, lightning.Tf32Check(steps=2, levels=("highest", "high"))):
        torch.manual_seed(0)
        module = modules.TwoLoaders()
        trainer = L.Trainer(callbacks=[callback] if callback else [], default_root_dir=tmp_path, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                            max_epochs=1, limit_train_batches=4)
        trainer.fit(module, both())
        runs.append(module)
    assert callback.report.passed and callback.report.steps == 2
    assert same_weights(*runs)


def test_a_skipped_micro_batch_is_skipped_in_the_check_too(tmp_path):
    plain, plain_losses, _, _ = fit(tmp_path / "a", modules.SkipsSome, max_epochs=1, accumulate_grad_batches=2)
    check = lightning.Tf32Check(steps=2, levels=("highest", "high"))
    checked, losses, _, _ = fit(tmp_path / "b", modules.SkipsSome, callback=check, max_epochs=1,
                                accumulate_grad_batches=2)
    assert check.report.passed and check.report.steps == 2
    assert same_weights(plain, checked) and losses == plain_losses


def test_a_step_all_of_whose_batches_are_skipped_is_a_step_without_an_update(tmp_path):
    # Lightning steps no parameter where training_step returned None: nor does the check, which recorded no loss
    # there (it could not run at all: no verdict, where a module skipping a non-finite loss at a reduced level is
    # what the check is for); its float32 losses around it are the run's own
    check = lightning.Tf32Check(steps=3, levels=("highest", "high"), on_fail="raise")
    _, losses, _, _ = fit(tmp_path, modules.SkipsItsSecond, callback=check, max_epochs=1)
    assert check.report.passed and check.report.steps == 3
    run = [float(loss) for _, loss in losses[:3]]  # it logs its second loss before returning None
    found = check.report.floor.losses
    assert found[1] == 0.0 and [found[0], found[2]] == pytest.approx([run[0], run[2]], rel=1e-5)
    assert any("step 2: training_step returned None" in note for note in check.report.notes), check.report.notes


class Augmented(torch.utils.data.Dataset):
    """Rows with random noise drawn in the loader's workers, as a data augmentation draws."""

    def __init__(self) -> None:
        self.rows = data(32)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        x, y = self.rows[i]
        return x + 0.1 * torch.rand(8), y


def test_persistent_workers_keep_the_runs_iterator_and_their_random_streams(tmp_path):
    runs = []
    for callback in (None, lightning.Tf32Check(steps=2, levels=("highest",))):
        torch.manual_seed(0)
        module = modules.Regression()
        trainer = L.Trainer(callbacks=[callback] if callback else [], default_root_dir=tmp_path, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                            max_epochs=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on the number of workers
            trainer.fit(module, DataLoader(Augmented(), batch_size=8, shuffle=True, num_workers=1,
                                           persistent_workers=True))
        runs.append(module)
    assert same_weights(*runs)


def test_a_loader_with_workers_is_read_in_the_runs_order_with_the_runs_augmentation(tmp_path):
    # the run's iterator, made before on_train_start, drew its seed and its first order then (its workers are
    # handed their first indices as it is made): the check trains the run's own first batches, noise and all
    check, logged = _checked_and_logged(tmp_path, 4, DataLoader(Augmented(), batch_size=8, shuffle=True,
                                                                num_workers=1))
    assert check.report.reference_losses == pytest.approx(logged[:4], rel=1e-4)


def _checked_and_logged(tmp_path, steps: int, loader) -> tuple:
    """A run of ``lightning_modules.Plain`` over ``loader`` with a check of ``steps`` steps at `highest`: the
    callback and the losses the run logged."""
    torch.manual_seed(0)
    module = modules.Plain()
    check = lightning.Tf32Check(steps=steps, levels=("highest",))
    logger = L.loggers.CSVLogger(tmp_path, name="run")
    trainer = L.Trainer(callbacks=[check], default_root_dir=tmp_path, logger=logger, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, max_epochs=1, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on the number of workers
        trainer.fit(module, loader)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        return check, [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def test_mixed_precision_is_said_not_to_be_float32(tmp_path):
    check = lightning.Tf32Check(steps=2, levels=("highest", "high"))
    fit(tmp_path, callback=check, max_epochs=1, precision="bf16-mixed")
    assert any("'bf16-mixed': its matmuls run in bfloat16" in note for note in check.report.notes)


def test_the_rnn_math_the_report_advises_is_an_argument_of_the_callback(tmp_path):
    # an LSTM's report said "to see them in IEEE float32, train with conv='ieee' (`--conv ieee`)", which Tf32Check
    # did not take: it takes conv, as check_training does, and with conv="ieee" its RNNs ran IEEE float32
    notes = {}
    before = torch.backends.cudnn.allow_tf32
    for conv in (None, "ieee"):
        check = lightning.Tf32Check(target="a100", steps=2, levels=("highest", "high"), conv=conv)
        fit(tmp_path / str(conv), module_class=modules.Recurrent, callback=check, max_steps=2)
        notes[conv] = " ".join(check.report.notes)
    assert "RNNs ran TF32" in notes[None] and "conv='ieee'" in notes[None]
    assert "RNNs ran TF32" not in notes["ieee"]
    assert torch.backends.cudnn.allow_tf32 == before  # the run's own flag put back


def test_conv_given_for_a_model_without_convolutions_is_said_to_be_the_checks_not_the_runs(tmp_path):
    # the note said conv='ieee' "set cuDNN's convolution flag ... for the run": the run's own flag is untouched
    before = torch.backends.cudnn.conv.fp32_precision
    check = lightning.Tf32Check(target="a100", steps=1, levels=("high",), conv="ieee")
    fit(tmp_path, callback=check, max_steps=1)
    note = next(n for n in check.report.notes if "the model ran no convolution" in n)
    assert "for the run" not in note and "for the check's rows, and put it back" in note, note
    assert torch.backends.cudnn.conv.fp32_precision == before


def test_bad_arguments_are_one_line():
    import tf32lab

    with pytest.raises(Tf32LabError, match="on_fail must be 'raise' or 'warn', not 'stop'"):
        lightning.Tf32Check(on_fail="stop")
    with pytest.raises(Tf32LabError, match="steps must be a whole number >= 1, not 0"):
        lightning.Tf32Check(steps=0)
    with pytest.raises(Tf32LabError, match="'fast'"):
        lightning.Tf32Check(levels=("fast",))
    with pytest.raises(Tf32LabError, match="unknown target 'h999'"):
        lightning.Tf32Check(target="h999")
    with pytest.raises(Tf32LabError, match=r"tolerance is one number >= 0.*not 'x'"):
        lightning.Tf32Check(tolerance="x")
    with pytest.raises(Tf32LabError, match="unknown conv math 'fast'"):
        lightning.Tf32Check(conv="fast")
    with pytest.raises(Tf32LabError, match=r"policy must be a tf32lab\.Policy, not str"):
        lightning.Tf32Check(policy="pins.json")
    with pytest.raises(Tf32LabError, match=r"^level 'bfx9' \(cuda.matmul = 'bfx9'\) needs compute capability 10.0"):
        lightning.Tf32Check(target="h100", levels=("high",), policy=tf32lab.Policy("high", [("lin", "bfx9")]))
    assert lightning.Tf32Check(levels="high").levels == ("high",)
    # a level the target cannot compute was refused only when training started, after the run loaded its data
    with pytest.raises(Tf32LabError, match=r"^level 'bfx9' \(cuda.matmul = 'bfx9'\) needs compute capability 10.0"):
        lightning.Tf32Check(target="a100", levels=("highest", "bfx9"))
    assert lightning.Tf32Check(target="b200", levels=("bfx9",)).levels == ("bfx9",)


def test_without_lightning_the_integration_names_its_extra_and_tf32lab_never_imports_it(tmp_path):
    code = ("import sys; import tf32lab, tf32lab.integrations; tf32lab.check_training; "
            "print('pytorch_lightning' in sys.modules, 'transformers' in sys.modules); "
            "sys.modules['pytorch_lightning'] = None\n"
            "try:\n    import tf32lab.integrations.lightning\nexcept tf32lab.Tf32LabError as e:\n    print(e)")
    # forked from the suite's CLI server (tf32lab imported there; Lightning, transformers and the integration not,
    # or the first line would say so)
    (tmp_path / "without_lightning.py").write_text(code)
    out = cli_runner.run(module="without_lightning", cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.strip().splitlines()
    assert first == "False False"
    assert "pip install 'tf32lab[lightning]'" in message


@pytest.mark.slow
def test_under_ddp_rank_0_checks_and_every_rank_ends_with_its_verdict(tmp_path):
    # Lightning's own launcher, two CPU ranks (gloo), each a process forked from one that imported Lightning once
    # (tests/lightning_ddp_job.py): 16 CPU seconds, a minute of wall time on a loaded 2-core machine. The job
    # itself is forked from the suite's CLI server, as `python -m lightning_ddp_job` in tests/: torch imported
    # there already (its forkserver is a fresh interpreter all the same)
    out = cli_runner.run(str(tmp_path), "warn", module="lightning_ddp_job", cwd=Path(__file__).parent, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    # the two ranks print to one pipe: their lines may land in either order, even on one line
    ranks = sorted(re.findall(r"rank (\d): passed=(True|False|None) report=(True|False)", out.stdout))
    assert ranks == [("0", "True", "True"), ("1", "True", "False")], out.stdout
    assert "same weights: True" in out.stdout.splitlines(), out.stdout
    # and every rank ends both fits with the same weights (DDP keeps its ranks alike; the check is on rank 0 only)
    traces = re.findall(r"trace of rank (\d), (with|without): threads \d+, weights (\w+), steps ([^\n]*)", out.stdout)
    assert sorted((rank, fit) for rank, fit, _, _ in traces) == [(r, f) for r in "01" for f in ("with", "without")]
    assert len({weights for _, _, weights, _ in traces}) == 1, out.stdout
    for rank in "01":  # each rank trained the same batches to the same losses with the check as without it
        assert len({steps for r, _, _, steps in traces if r == rank}) == 1, out.stdout


@pytest.mark.parametrize("name", ["Plain", "WarmsUp", "ClipsItself", "ClipsAsTheTrainerSays", "ClipsItselfInCapitals",
                                  "WarmsUpInItsStep", "WarmsUpThroughItsTrainer"])
def test_the_check_trains_as_the_runs_own_hooks_do(tmp_path, name):
    # the check's float64 losses are the run's own logged ones (float32) at the same steps: the module's
    # optimizer_step (with self.global_step) and configure_gradient_clipping are followed as the Trainer follows them;
    # a warm-up set in training_step through self.optimizers() or self.trainer.optimizers sets the row's learning
    # rate (it set the run's)
    check, module_class = lightning.Tf32Check(steps=6, levels=("highest",)), getattr(modules, name)
    # Lightning refuses both
    clipped = {} if issubclass(module_class, modules.ClipsItself) else {"gradient_clip_val": 0.05}
    _, losses, _, _ = fit(tmp_path, module_class, callback=check, max_epochs=1, **clipped)
    logged = [float(value) for _, value in losses[:6]]
    assert check.report.reference_losses == pytest.approx(logged, rel=1e-4)


def test_manual_clipping_by_the_enum_clips_by_value(tmp_path):
    check = lightning.Tf32Check(steps=6, levels=("highest",))
    _, losses, _, _ = fit(tmp_path, modules.ClipsByValueByHand, callback=check, max_epochs=1)
    assert check.report.reference_losses == pytest.approx([float(v) for _, v in losses[:6]], rel=1e-4)


def test_a_short_loader_is_named_as_such_not_as_limit_train_batches(tmp_path):
    # 32 rows of 8: 4 batches, all the run trains an epoch, without limit_train_batches
    check = lightning.Tf32Check(steps=5, levels=("highest",))
    fit(tmp_path, modules.Plain, callback=check, dataset=data(32), max_epochs=1)
    assert check.report.steps == 4
    assert any("the train dataloader has 4 batches" in note for note in check.report.notes), check.report.notes
    assert not any("limit_train_batches" in note for note in check.report.notes)


def test_limit_train_batches_caps_the_steps_checked(tmp_path):
    # the run trains 2 batches an epoch, again and again: the check trains those 2, not batches the run never reads
    check = lightning.Tf32Check(steps=5, levels=("highest",))
    fit(tmp_path, modules.Plain, callback=check, max_epochs=3, limit_train_batches=2)
    assert check.report.steps == 2
    assert any("limit_train_batches" in note for note in check.report.notes)


def test_overfit_batches_caps_the_steps_checked_and_is_named(tmp_path):
    # Lightning sets limit_train_batches to overfit_batches: the note named the argument the run never set
    check = lightning.Tf32Check(steps=5, levels=("highest",))
    fit(tmp_path, modules.Plain, callback=check, max_epochs=2, overfit_batches=2)
    assert check.report.steps == 2
    assert any(note.startswith("the run trains 2 batches an epoch (overfit_batches)") for note in check.report.notes)


def test_a_report_that_cannot_be_written_never_replaces_the_runs_own_exception(tmp_path):
    # the JSON's path is taken by a folder, and warnings are errors (pytest -W error): the run's error must surface
    (tmp_path / "run" / "version_0" / "tf32lab-training.json").mkdir(parents=True)
    check = lightning.Tf32Check(target="a100", steps=2, levels=("highest", "high"))
    torch.manual_seed(0)
    logger = L.loggers.CSVLogger(tmp_path, name="run", version=0)
    trainer = L.Trainer(callbacks=[check], default_root_dir=tmp_path, logger=logger, max_epochs=1,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tf32lab: the training check's report could not be written")
        with pytest.raises(RuntimeError, match="the run's own error"):
            trainer.fit(modules.RaisesMidRun(), DataLoader(data(), batch_size=8))
    assert check.report is not None and check.report.passed


class DrawsAsItIsMade(torch.utils.data.Sampler):
    """A batch sampler that draws its order from PyTorch's stream as a pass is made (its __iter__ is no generator)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        return iter([order[i:i + 8] for i in range(0, self.n, 8)])

    def __len__(self) -> int:
        return self.n // 8


class NoisyStream(torch.utils.data.IterableDataset):
    """A stream without a length whose rows draw noise from PyTorch's stream (Lightning reads one batch ahead)."""

    def __iter__(self):
        for x, y in data(48):
            yield x + 0.1 * torch.rand(8), y


LOADERS = {
    "workers and a seeded generator": lambda: DataLoader(data(48), batch_size=8, shuffle=True, num_workers=1,
                                                         generator=torch.Generator().manual_seed(5)),
    "a batch sampler that draws as a pass is made": lambda: DataLoader(data(48), batch_sampler=DrawsAsItIsMade(48)),
    "a stream without a length": lambda: DataLoader(NoisyStream(), batch_size=8),
}


@pytest.mark.parametrize("loader", LOADERS)
def test_the_check_trains_the_runs_own_first_batches_however_its_loader_draws(tmp_path, loader):
    # the run makes its pass before on_train_start (its generators and PyTorch's stream as at on_fit_start) and
    # reads what it reads ahead then: the check's pass is made so, and its losses are the run's
    check, logged = _checked_and_logged(tmp_path, 3, LOADERS[loader]())
    assert check.report.reference_losses == pytest.approx(logged[:3], rel=1e-4)
    assert not any("not the run's own" in note for note in check.report.notes)


def test_a_loader_whose_first_order_cannot_be_read_again_is_said_to_be_another_pass(tmp_path):
    check = lightning.Tf32Check(steps=2, levels=("highest",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on the number of workers
        L.Trainer(callbacks=[check], default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, enable_model_summary=False,
                  max_epochs=1).fit(modules.MakesItsLoader(data(48)))
    assert any("not the run's own" in note for note in check.report.notes), check.report.notes


def test_max_steps_caps_the_steps_checked(tmp_path):
    # the run trains 2 steps: the check trains those, not steps the run never takes
    check = lightning.Tf32Check(steps=5, levels=("highest",))
    fit(tmp_path, modules.Plain, callback=check, max_steps=2)
    assert check.report.steps == 2
    assert any("the run trains 2 optimizer steps (max_steps)" in note for note in check.report.notes)


def test_fast_dev_run_caps_the_steps_checked_and_is_named(tmp_path):
    # Lightning sets max_steps to fast_dev_run's 1: the note named max_steps, which the run was never given
    check = lightning.Tf32Check(steps=3, levels=("highest",))
    trainer = L.Trainer(callbacks=[check], default_root_dir=tmp_path, enable_progress_bar=False,
                        enable_model_summary=False, fast_dev_run=True)
    trainer.fit(modules.Plain(), DataLoader(data(32), batch_size=8))
    assert check.report.steps == 1
    assert "the run trains 1 optimizer step (fast_dev_run): 1 of the 3 steps asked for were checked" in \
        check.report.notes


def test_an_epoch_shorter_than_max_steps_is_the_one_note_on_the_steps_checked(tmp_path):
    # max_steps=6 over epochs of 2 batches: the check trains the first epoch's 2, and said besides that it had
    # checked the run's 6
    check = lightning.Tf32Check(steps=10, levels=("highest",))
    fit(tmp_path, modules.Plain, callback=check, dataset=data(16), max_epochs=3, max_steps=6)
    assert check.report.steps == 2
    assert [note for note in check.report.notes if "steps asked for" in note] == [
        "the train dataloader has 2 batches: 2 of the 10 steps asked for were checked, the first epoch's"]


def test_max_steps_caps_the_batches_checked_in_manual_optimization(tmp_path):
    # max_steps counts each optimizer's steps: two optimizers stepped a batch, max_steps=4 is the run's 2 batches
    check = lightning.Tf32Check(steps=5, levels=("highest",))
    _, losses, _, trainer = fit(tmp_path, modules.TwoOptimizers, callback=check, max_steps=4)
    assert trainer.global_step == 4 and len(losses) == 2
    assert check.report.steps == 2
    assert any("the run trains 2 batches (max_steps=4" in note for note in check.report.notes), check.report.notes


def test_a_run_resumed_from_its_checkpoint_is_checked_and_untouched(tmp_path):
    # the resumed optimizer has state (Adam's moments, float32): the float64 row steps its own float64 copy of it
    first = L.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, max_steps=3,
                      enable_model_summary=False)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.fit(modules.Regression(), DataLoader(data(), batch_size=8))
    saved = next(Path(tmp_path).rglob("*.ckpt"))
    runs = []
    for callback in (None, lightning.Tf32Check(steps=2, levels=("highest", "high"), on_fail="raise")):
        torch.manual_seed(0)
        module = modules.Regression()
        trainer = L.Trainer(callbacks=[callback] if callback else [], default_root_dir=tmp_path / "again",
                            logger=False, enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False, max_steps=6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(data(), batch_size=8), ckpt_path=saved)
        runs.append(module)
    assert callback.report is not None and callback.report.steps == 2
    assert same_weights(*runs)


def test_a_run_resumed_mid_epoch_is_checked_on_the_batches_left_in_its_epoch(tmp_path):
    # a checkpoint 3 batches into a 4-batch epoch: Lightning reads its loader afresh and trains 1 batch more (a
    # loader that is not resumable: its own warning), and the check trained 4 steps, 3 of them steps the run never
    # takes
    first = L.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, max_epochs=1,
                      enable_model_summary=False, callbacks=[L.callbacks.ModelCheckpoint(
                          dirpath=tmp_path, every_n_train_steps=3, filename="mid")])
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.fit(modules.Plain(), DataLoader(data(32), batch_size=8))
    check = lightning.Tf32Check(steps=4, levels=("highest",))
    trainer = L.Trainer(callbacks=[check], default_root_dir=tmp_path / "again", logger=False, max_epochs=1,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(modules.Plain(), DataLoader(data(32), batch_size=8), ckpt_path=tmp_path / "mid.ckpt")
    assert trainer.global_step == 4 and check.report.steps == 1
    assert "the run resumes 3 batches into its epoch of 4: 1 of the 4 steps asked for were checked, the ones " \
        "it trains in that epoch (Lightning reads its loader afresh)" in check.report.notes


def test_a_run_without_float32_weights_is_said_to_have_nothing_to_check_and_trains_on(tmp_path):
    # bf16-true trains bfloat16 weights: no float32 matmul for the level to decide, and no failure to raise
    check = lightning.Tf32Check(steps=2, levels=("highest", "high"), on_fail="raise")
    trainer = fit(tmp_path, modules.Plain, callback=check, max_epochs=1, precision="bf16-true")[3]
    assert check.report is None and trainer.global_step == 12
    said = [w for w in trainer.warned if w.startswith("tf32lab")]
    assert said == ["tf32lab training check (precision 'bf16-true'): nothing to check, the run trains its weights in "
                    "bfloat16, not float32, and the float32 matmul precision reaches only float32 matmuls"]


def test_a_run_without_an_optimizer_is_said_to_have_none(tmp_path):
    # configure_optimizers returned None (Lightning trains on, stepping nothing): the warning told the run to write
    # its optimizer as "lambda params: torch.optim.AdamW(params)", check_training's advice on a function it never wrote
    class Unoptimized(modules.Plain):
        def configure_optimizers(self):
            return None

    check = lightning.Tf32Check(steps=2, levels=("highest",))
    trainer = fit(tmp_path, Unoptimized, callback=check, max_epochs=1)[3]
    said = [w for w in trainer.warned if w.startswith("tf32lab")]
    assert check.passed is None and said == [
        "tf32lab training check could not run: Tf32LabError: Tf32Check: the run has no optimizer "
        "(configure_optimizers returned none): no step to check; the run goes on without a verdict"]


def test_a_step_schedulers_frequency_counts_batches_as_lightning_does_under_accumulation(tmp_path):
    # Lightning steps an interval="step" scheduler where frequency divides batch_idx + 1: with two batches a step,
    # frequency 2 steps it after every optimizer step, as frequency 1 does (the runs end alike); the check trains
    # the run's schedule, not one of every other optimizer step
    runs, checks = [], []
    for frequency in (1, 2):
        torch.manual_seed(0)
        module = type("Every", (modules.StepsItsScheduleEvery,), {"frequency": frequency})()
        check = lightning.Tf32Check(steps=4, levels=("highest",))
        L.Trainer(callbacks=[check], default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, enable_model_summary=False, max_epochs=1,
                  accumulate_grad_batches=2).fit(module, DataLoader(data(64), batch_size=8))
        runs.append(module)
        checks.append(check.report.reference_losses)
    assert same_weights(*runs)
    assert checks[0] == pytest.approx(checks[1], rel=1e-12)


def test_a_modules_own_lr_scheduler_step_steps_the_checks_schedulers(tmp_path):
    # the module steps its scheduler after every other optimizer step: the check's float32 losses are the run's
    # own logged ones (stepped after every step, the third differed by a third)
    check = lightning.Tf32Check(steps=4, levels=("highest",))
    _, losses, _, _ = fit(tmp_path, modules.SchedulesItsOwnWay, callback=check, max_epochs=1)
    run = [float(loss) for _, loss in losses[:4]]
    assert check.report.level("highest").losses == pytest.approx(run, rel=1e-5)


def test_levels_that_are_no_collection_of_names_are_one_line():
    # refused as the callback is made, in one line, not a TypeError's traceback
    for levels in (5, b"high"):
        with pytest.raises(Tf32LabError, match=r"^levels must be a level's name or a collection of them .*, not "):
            lightning.Tf32Check(levels=levels)


def test_an_epoch_shorter_than_one_accumulation_is_checked_as_lightning_steps_it(tmp_path):
    # 4 batches an epoch, accumulate_grad_batches=6: Lightning steps at the epoch's last batch, each of the 4
    # micro-batches' losses over 6; the check trains that step (it refused: "fewer than one optimizer step's 6")
    check = lightning.Tf32Check(steps=2, levels=("highest", "high"), on_fail="raise")
    plain = fit(tmp_path / "a", modules.Plain, dataset=data(32), max_epochs=2, accumulate_grad_batches=6)[0]
    checked = fit(tmp_path / "b", modules.Plain, callback=check, dataset=data(32), max_epochs=2,
                  accumulate_grad_batches=6)[0]
    assert same_weights(plain, checked)
    assert check.report.passed and check.report.steps == 1
    # the step's loss: its 4 batches' mean losses over 6, in whatever order they come: 4/6 of the mean over all rows
    torch.manual_seed(0)  # the run's first weights (fit seeds 0 before making the module)
    x, y = data(32).tensors
    first = float((modules.Plain()(x) - y).pow(2).mean()) * 4 / 6
    assert check.report.reference_losses[0] == pytest.approx(first, rel=1e-5)


def test_a_gradient_accumulation_scheduler_is_followed_as_the_run_follows_it(tmp_path):
    # GradientAccumulationScheduler sets accumulate_grad_batches as each epoch starts, after the check: the check
    # trains the run's accumulation of 4, as a Trainer given accumulate_grad_batches=4 does, not steps of 1 batch
    checks = []
    for callbacks, options in (([L.callbacks.GradientAccumulationScheduler({0: 4})], {}),
                               ([], {"accumulate_grad_batches": 4})):
        torch.manual_seed(0)
        check = lightning.Tf32Check(steps=2, levels=("highest",))
        L.Trainer(callbacks=[check, *callbacks], default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, enable_model_summary=False, max_epochs=1,
                  **options).fit(modules.Plain(), DataLoader(data(64), batch_size=8))
        checks.append(check.report.reference_losses)
    assert checks[0] == pytest.approx(checks[1], rel=1e-12)


def test_a_run_resumed_at_a_later_epoch_is_checked_on_that_epochs_order(tmp_path):
    # a sampler with set_epoch (the DistributedSampler Lightning puts in under DDP) shuffles by epoch, which the fit
    # loop sets as the epoch starts, after on_train_start: resumed after epoch 0, the run reads epoch 1's order, and
    # the check read epoch 0's (its float64 first loss 1.136 where the run logged 0.797)
    def loader():
        return DataLoader(data(64), batch_size=8, sampler=torch.utils.data.DistributedSampler(
            data(64), num_replicas=1, rank=0, shuffle=True, seed=0))

    options = {"default_root_dir": tmp_path, "enable_progress_bar": False, "enable_model_summary": False}
    torch.manual_seed(0)
    L.Trainer(logger=False, max_epochs=1, **options).fit(modules.Plain(), loader())
    saved = next(Path(tmp_path).rglob("*.ckpt"))
    check = lightning.Tf32Check(steps=3, levels=("highest",))
    logger = L.loggers.CSVLogger(tmp_path, name="run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers
        L.Trainer(callbacks=[check], logger=logger, max_epochs=2, enable_checkpointing=False, log_every_n_steps=1,
                  **options).fit(modules.Plain(), loader(), ckpt_path=saved)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        logged = [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]
    assert check.report.reference_losses == pytest.approx(logged[:3], rel=1e-4)


def test_what_the_modules_own_on_train_start_changes_after_the_check_is_said(tmp_path):
    # the module freezes a layer in on_train_start, which Lightning calls after the callbacks' own: the run trains
    # one layer, the check trained both (its second float64 loss 0.712 where the run logged 0.720), without a word
    check = lightning.Tf32Check(steps=3, levels=("highest",))
    fit(tmp_path, modules.FreezesAtTrainStart, callback=check, dataset=data(64), max_epochs=1)
    assert any("the module's own on_train_start ran after the check" in note for note in check.report.notes), \
        check.report.notes


@pytest.mark.parametrize("name", ["UsesItsLightningOptimizers", "ScalesByItsGlobalStep"])
def test_manual_optimization_is_checked_as_lightnings_optimizers_and_global_step_are(tmp_path, name):
    # self.optimizers() gives LightningOptimizers (toggle_model(), .optimizer): the copies' had neither, and the
    # check could not run; self.global_step counts each optimizer's step (two a batch here): the check's counted
    # batches (its third loss 1.71 where the run logged 3.20)
    check = lightning.Tf32Check(steps=3, levels=("highest",), on_fail="raise")
    _, losses, _, _ = fit(tmp_path, getattr(modules, name), callback=check, dataset=data(64), max_epochs=1)
    assert check.report.reference_losses == pytest.approx([float(v) for _, v in losses[:3]], rel=1e-4)


def test_an_augmentation_in_the_main_process_beside_dropout_is_said_to_draw_otherwise(tmp_path):
    # the run reads a batch, trains a step (its dropout draws), reads the next: the check reads its batches at once,
    # and its second batch was augmented with other draws than the run's (a row sum of 29.44 where the run's was
    # 31.69), without a word; with workers (streams of their own) it reads the run's own, and says nothing
    notes = []
    for workers in (0, 1):
        check = lightning.Tf32Check(steps=2, levels=("highest",))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on the number of workers
            L.Trainer(callbacks=[check], default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, max_steps=2).fit(
                modules.Regression(), DataLoader(Augmented(), batch_size=8, num_workers=workers))
        notes.append(any("augmented with other draws" in note for note in check.report.notes))
    assert notes == [True, False]


def test_numpy_numbers_are_taken_and_an_array_for_on_fail_is_one_line():
    # a sweep's NumPy numbers were refused as what they are ("steps must be a whole number >= 1, not
    # np.int64(3)"), and an array given as on_fail raised NumPy's ValueError, not one line naming it
    check = lightning.Tf32Check(steps=np.int64(3), tolerance=np.float32(0.5))
    assert (check.steps, check.tolerance) == (3, 0.5) and type(check.steps) is int
    with pytest.raises(Tf32LabError, match=r"^on_fail must be 'raise' or 'warn', not array\("):
        lightning.Tf32Check(on_fail=np.array(["raise", "warn"]))


def test_a_training_step_writing_to_its_logger_is_checked_and_the_runs_logs_untouched(tmp_path):
    # a copy's self.logger was None (the check could not run: no verdict), and self.trainer.logger the run's own
    # (the check's rows wrote their losses into the run's metrics.csv)
    def written(trainer) -> list:
        with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
            return [(row["step"], row["direct"], row["through"]) for row in csv.DictReader(f)
                    if row.get("direct") or row.get("through")]

    plain = fit(tmp_path / "a", modules.LogsThroughItsLogger, dataset=data(32), max_epochs=1)[3]
    check = lightning.Tf32Check(steps=2, levels=("highest",), on_fail="raise")
    checked = fit(tmp_path / "b", modules.LogsThroughItsLogger, callback=check, dataset=data(32), max_epochs=1)[3]
    assert check.report.passed and written(checked) == written(plain) and len(written(plain)) == 8


def test_a_callback_kept_for_another_run_checks_that_run_and_a_second_fit_continues(tmp_path):
    # a cross-validation's next fold (a new Trainer and module) was left unchecked, the callback's report still the
    # first fold's; a second fit of the same trainer and module continues the run checked
    check = lightning.Tf32Check(steps=2, levels=("highest",))
    reports = []
    for lr in (0.1, 0.01):
        torch.manual_seed(0)
        module = type("Slower", (modules.Plain,), {"configure_optimizers": lambda self, lr=lr: torch.optim.SGD(
            self.parameters(), lr=lr)})()
        trainer = L.Trainer(callbacks=[check], default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False, max_epochs=1)
        trainer.fit(module, DataLoader(data(32), batch_size=8))
        reports.append(check.report)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, DataLoader(data(32), batch_size=8))
    assert check.report is reports[1] and trainer.global_step == 8
    first, second = (report.reference_losses for report in reports)
    assert first[0] == pytest.approx(second[0], rel=1e-12) and first[1] != pytest.approx(second[1], rel=1e-3)


def test_a_compiled_module_is_checked_eagerly_and_its_run_still_runs_its_compiled_graphs(tmp_path, counted_graphs):
    # the check's float64 reference traced the copy's compiled forward under its dispatch mode: Dynamo gave up on
    # that code for good, and the run's compiled net ran eagerly from then on (with Inductor, other kernels than
    # without the check: its weights no longer bit-identical)
    counting, graphs = counted_graphs

    class Compiled(modules.Plain):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.compile(self.net, backend=counting)

    class Seen(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.at_start = dict(graphs)

    check, seen = lightning.Tf32Check(steps=2, levels=("highest", "high")), Seen()
    trainer = L.Trainer(callbacks=[check, seen], default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Compiled(), DataLoader(data(32), batch_size=8))
    assert check.report.passed and seen.at_start == {"compiled": 0, "ran": 0}  # the check compiled and ran none
    assert graphs["ran"] == 4  # the run's four steps, each through its compiled graph
