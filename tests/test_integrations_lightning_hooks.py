"""`Tf32Check` follows the LightningModule's own hooks around the optimizer step as the Trainer does:
`on_before_zero_grad`, `optimizer_zero_grad`, `on_before_backward`, `backward`, `on_after_backward`,
`on_before_optimizer_step` (beside `optimizer_step` and `configure_gradient_clipping`), and its copies read
`self.trainer.global_step` as `self.global_step`: the check's step."""

from __future__ import annotations

import csv
import importlib.util
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lazy_import import lazy

if importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("could not import 'pytorch_lightning'", allow_module_level=True)

# Lightning (about 3 CPU seconds) imported where a test first reads it, not where pytest-xdist's every worker collects
# this file; its tests, one group, run on one worker: the only one that imports it
L, lightning = lazy("pytorch_lightning"), lazy("tf32lab.integrations.lightning")
modules = lazy("lightning_hook_modules")
pytestmark = pytest.mark.xdist_group("lightning")


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


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


# by name: the classes subclass Lightning's, imported as a test reads them (the worker that collects may run none)
HOOKED = ["HalvesGrads", "AccumulatesByHand", "ClampsAfterBackward", "ScalesItsBackward", "WarmsUpByTheTrainer"]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("name", HOOKED)
def test_the_check_trains_as_the_modules_own_hooks_do(tmp_path, name, accumulate):
    # the check's float64 losses are the run's own (float32) at the same steps: each optimizer step's loss the mean
    # of its micro-batches' losses, as the run computed them before the step
    steps = 6 // accumulate
    check = lightning.Tf32Check(steps=steps, levels=("highest",))
    module, _, _ = fit(tmp_path, getattr(modules, name), [check], accumulate_grad_batches=accumulate)
    run = [sum(module.seen[k * accumulate:(k + 1) * accumulate]) / accumulate for k in range(steps)]
    assert check.report.passed
    assert check.report.reference_losses == pytest.approx(run, rel=1e-4)


def test_without_its_hook_the_modules_training_is_another(tmp_path):
    # the hooks matter here: the same batches, trained without them, give other losses than the tests above compare
    plain, _, _ = fit(tmp_path / "a", modules.Plain)
    for name in HOOKED:
        hooked, _, _ = fit(tmp_path / name, getattr(modules, name))
        assert hooked.seen[0] == plain.seen[0] and hooked.seen[5] != pytest.approx(plain.seen[5], rel=1e-3)


def test_the_modules_hooks_are_called_in_the_runs_order(tmp_path):
    # one optimizer step of two accumulated micro-batches, in the run and in the check's last row
    modules.calls.clear()
    fit(tmp_path, modules.Records, [modules.Marked(steps=1, levels=("highest",))], accumulate_grad_batches=2,
        max_steps=1)
    end = modules.calls.index("-- the check ends")
    check, run = modules.calls[:end], modules.calls[end + 1:]
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
    modules.calls.clear()
    plain, plain_trainer, plain_rows = fit(tmp_path / "a", modules.Records, accumulate_grad_batches=2)
    modules.calls.clear()
    check = lightning.Tf32Check(steps=2, levels=("highest", "high"))
    checked, trainer, rows = fit(tmp_path / "b", modules.Records, [check], accumulate_grad_batches=2)
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


def test_self_trainer_global_step_is_the_checks_step_as_self_global_step_is(tmp_path):
    modules.steps_seen.clear()
    check = lightning.Tf32Check(steps=3, levels=("highest",))
    _, trainer, _ = fit(tmp_path, modules.ReadsBothSteps, [check], max_steps=3)
    in_check = modules.steps_seen[:-3]  # the run's own three steps come last
    assert {a for a, _ in in_check} == {0, 1, 2}
    assert all(a == b for a, b in in_check)
    assert modules.steps_seen[-3:] == [(0, 0), (1, 1), (2, 2)] and trainer.global_step == 3


def test_a_hook_that_stops_a_diverging_row_stops_the_check_not_the_run(tmp_path):
    # `high` diverges (an infinite loss) and its copy's guard sets should_stop: on the check's trainer, not the run's
    check = lightning.Tf32Check(steps=2, levels=("highest", "high"))
    _, trainer, _ = fit(tmp_path, modules.StopsOnANonFiniteLoss, [check], max_steps=4)
    high = check.report.level("high")
    assert check.report.level("highest").passed and high.failure == "the loss is inf"
    assert trainer.global_step == 4 and not trainer.should_stop


@pytest.mark.parametrize("name", ["ManualClampsAfterBackward", "ManualScalesItsBackward", "ManualHalvesGrads"])
def test_manual_optimization_trains_as_the_modules_own_hooks_do(tmp_path, name):
    check = lightning.Tf32Check(steps=6, levels=("highest",))
    module, _, _ = fit(tmp_path, getattr(modules, name), [check])
    assert check.report.passed
    assert check.report.reference_losses == pytest.approx(module.seen[:6], rel=1e-4)
