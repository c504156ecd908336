"""What the training-loop callbacks cost: a run with `Tf32Check` (Lightning) or `Tf32CheckCallback` (Hugging Face)
minus the same run without it, as a multiple of `check_training` on the same steps of the same model: a
hand-written `TrainingWorkload` of the run's model, its first batches, its loss and its optimizer (the Trainer's own
class and arguments), at the same levels and target. Goal: at most 1x, the acceptance as written. And nothing added
where the callback is not in `callbacks`: importing the integrations adds no callback to a Trainer and no hook to
a module.

For comparison only, not a goal: the same done by hand, as one who calls `check_training` themselves to get what the
callback gives: the first batches read from the run's own loader, the check, and the report written as JSON and
HTML (`to_json`, `save_html`). The callback does that too, so its cost over this is what the callback itself adds.

The four are timed side by side in one process (without, with, check, by hand; then again), the ratio the median of
the rounds' own; only `fit` / `train`, `check_training` and what by hand does around it are timed (the Trainer, its
module and arguments made beforehand, alike for both runs), on one torch thread. The callback's hook is timed too:
the part of its cost spent before the run's first step (the report's files are synced to disk in a thread, while the
run trains on). What the process holds after the warm-up is frozen out of Python's collections (`gc.freeze`: Hugging
Face's `train` begins with a full collection, see `side_by_side`). Each is timed on two clocks: the wall clock (the
verdict, as the acceptance reads) and the process's CPU time (`time.process_time`, every thread of it: the report's
writer thread included), which another job on a shared machine moves much less than the wall clock.

    .venv/bin/python benchmarks/integrations.py [--rounds 11] [--steps 10]
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
from _common import WALL, header
from torch.utils.data import DataLoader, TensorDataset

import tf32lab

GOAL = 1.0  # the acceptance: the callback costs at most what check_training of the same steps costs
LEVELS = ("highest", "high")
TARGET = "a100"


WIDTH = 256  # the MLP's hidden width (--width): at 256 a step is a millisecond, and fixed costs weigh most


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 1, generator=g))


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))


class Hooked:
    """Seconds spent in a callback class's hook, per call."""

    def __init__(self, cls: type, hook: str) -> None:
        self.seconds: list[float] = []
        original = getattr(cls, hook)

        def timed(callback, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(callback, *args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)

        setattr(cls, hook, timed)


def lightning(steps: int, folder: str) -> dict[str, Callable[[], Callable[[], object]]]:
    """Each variant makes its run (untimed) and returns what is timed."""
    import pytorch_lightning as L

    from tf32lab.integrations.lightning import Tf32Check

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return (self(batch[0]) - batch[1]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def fit(callbacks: list) -> Callable[[], object]:
        trainer = L.Trainer(max_steps=steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                            default_root_dir=folder, enable_checkpointing=False, enable_model_summary=False,
                            accelerator="cpu")
        module, loader = Module(), DataLoader(data(), batch_size=16)
        return lambda: trainer.fit(module, loader)

    def workload(batches: list, model: torch.nn.Module) -> tf32lab.TrainingWorkload:
        # the module's net, the loader's first batches (not shuffled), its training_step's loss, its optimizer
        return tf32lab.TrainingWorkload(model, batches, loss=lambda out, b: (out - b[1]).pow(2).mean(),
                                        inputs=lambda b: b[0], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))

    def check() -> Callable[[], object]:
        made = workload([batch for _, batch in zip(range(steps), DataLoader(data(), batch_size=16))], mlp())
        return lambda: tf32lab.check_training(made, levels=LEVELS, target=TARGET)

    def by_hand() -> Callable[[], object]:
        loader, model = DataLoader(data(), batch_size=16), mlp()
        return lambda: _written(tf32lab.check_training(
            workload([batch for _, batch in zip(range(steps), loader)], model), levels=LEVELS, target=TARGET), folder)

    return {"without": lambda: fit([]), "with": lambda: fit([Tf32Check(TARGET, steps=steps, levels=LEVELS)]),
            "check": check, "by hand": by_hand, "hook": Hooked(Tf32Check, "on_train_start")}


def _written(report: tf32lab.TrainingReport, folder: str) -> None:
    """The report written as a user writes it by hand: its JSON and its page, each whole or not at all."""
    report.to_json(f"{folder}/by-hand.json")
    report.save_html(f"{folder}/by-hand.html")


def transformers_(steps: int, folder: str) -> dict[str, object]:
    from transformers import Trainer, TrainingArguments

    from tf32lab.integrations.transformers import Tf32CheckCallback

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x, labels):
            return {"loss": (self.net(x) - labels).pow(2).mean()}

    rows = [{"x": x, "labels": y} for x, y in data()]
    args = TrainingArguments(folder, max_steps=steps, per_device_train_batch_size=16, report_to=[],
                             save_strategy="no", disable_tqdm=True, use_cpu=True, learning_rate=1e-3,
                             lr_scheduler_type="constant", max_grad_norm=0.0, logging_strategy="no")

    def train(callbacks: list) -> Callable[[], object]:
        trainer = Trainer(model=Model(), args=args, train_dataset=rows, callbacks=callbacks)
        return trainer.train

    def made() -> tuple[Any, Callable]:
        # the Trainer's first batches (collated as its loader does), its model's loss, the optimizer it builds: its
        # class and arguments over its two parameter groups (Trainer.create_optimizer: weight decay on the weights,
        # none on the biases; one group, before, was one fused call a step fewer than the run's optimizer makes)
        trainer = Trainer(model=Model(), args=args, train_dataset=rows)
        kind, options = Trainer.get_optimizer_cls_and_kwargs(args)
        decay = set(trainer.get_decay_parameter_names(trainer.model))
        names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]

        def optimizer(params: list) -> torch.optim.Optimizer:
            groups = [[p for n, p in zip(names, params) if (n in decay) == wanted] for wanted in (True, False)]
            return kind([{"params": groups[0], "weight_decay": args.weight_decay},
                         {"params": groups[1], "weight_decay": 0.0}], **options)

        return trainer, optimizer

    def workload(batches: list, optimizer: Callable, model: torch.nn.Module) -> tf32lab.TrainingWorkload:
        return tf32lab.TrainingWorkload(model, batches, loss=lambda out, b: out["loss"], inputs=lambda b: b,
                                        optimizer=optimizer)

    def check() -> Callable[[], object]:
        trainer, optimizer = made()
        batches = [dict(batch) for _, batch in zip(range(steps), trainer.get_train_dataloader())]
        checked = workload(batches, optimizer, Model())
        return lambda: tf32lab.check_training(checked, levels=LEVELS, target=TARGET)

    def by_hand() -> Callable[[], object]:
        trainer, optimizer = made()
        loader, model = trainer.get_train_dataloader(), Model()
        return lambda: _written(tf32lab.check_training(workload(
            [dict(batch) for _, batch in zip(range(steps), loader)], optimizer, model), levels=LEVELS,
            target=TARGET), folder)

    return {"without": lambda: train([]), "with": lambda: train([Tf32CheckCallback(TARGET, steps=steps,
                                                                                   levels=LEVELS)]),
            "check": check, "by hand": by_hand, "hook": Hooked(Tf32CheckCallback, "on_train_begin")}


def side_by_side(runs: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each variant, timed in turn (without, with, check, by hand; again) after one warm-up round,
    and the median of each round's own ratio (a shared machine's load changes between rounds more than within one);
    ``cpu ratio`` the same ratio in the process's CPU time, ``by hand ratio`` the callback's cost over by hand's.

    After the warm-up, what the process holds is collected and frozen (``gc.freeze``): Hugging Face's ``train``
    begins with a full collection (accelerate's ``free_memory``, ``gc.collect()``), which walks every object the
    process holds (torch's, transformers' and Lightning's modules: about 400,000) in 175-225 ms, three times the
    check, with and without the callback alike; its swings were most of a round's difference (the rounds' ratios
    spread by 0.5-0.7x). Frozen, that walk and Python's automatic collections skip the objects made before the
    timing, and each run's collections walk what the runs make themselves, the callback's check included."""
    samples: dict[str, list[float]] = {name: [] for name in ("without", "with", "check", "by hand")}
    cpu: dict[str, list[float]] = {name: [] for name in samples}
    for round_ in range(rounds + 1):
        if round_ == 1:
            gc.collect()
            gc.freeze()
        for name in samples:
            timed = runs[name]()
            start, started = time.perf_counter(), time.process_time()
            timed()
            if round_:
                samples[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - started)
    gc.unfreeze()  # the next framework's runs are timed from a collection of their own
    hooked = runs["hook"].seconds[1:]  # the warm-up's first
    ratios = sorted((w - o) / c for o, w, c in zip(samples["without"], samples["with"], samples["check"]))
    return {**{name: statistics.median(v) for name, v in samples.items()}, "hook": statistics.median(hooked),
            "ratio": _ratio(samples), "cpu ratio": _ratio(cpu), "by hand ratio": _ratio(samples, "by hand"),
            "spread": (ratios[len(ratios) // 4],
                                                                           ratios[(3 * len(ratios)) // 4]),
            "hook ratio": statistics.median(
                [h / c for h, c in zip(hooked, samples["check"])])}


def _ratio(samples: dict[str, list[float]], over: str = "check") -> float:
    return statistics.median([(w - o) / c for o, w, c in zip(samples["without"], samples["with"], samples[over])])


def main() -> None:
    global WIDTH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=WIDTH, help="the MLP's hidden width (default 256)")
    args = parser.parse_args()
    WIDTH = args.width
    warnings.simplefilter("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "transformers", "tf32lab.integrations"):
        logging.getLogger(name).setLevel(logging.ERROR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the work itself, steadier on a shared machine than all threads
    try:
        header(f"integrations: callback overhead over check_training, an MLP of width {WIDTH}, {args.steps} steps, "
               f"levels {', '.join(LEVELS)}, target {TARGET}; medians of {args.rounds} rounds, one thread", WALL)
        failed = False
        with tempfile.TemporaryDirectory() as folder:
            for framework, make in (("lightning", lightning), ("transformers", transformers_)):
                times = side_by_side(make(args.steps, folder), args.rounds)
                ratio = times["ratio"]
                ok = ratio <= GOAL
                failed |= not ok
                print(f"{'PASSED' if ok else 'FAILED'} | {framework} | run {times['without']:.3f} s, with the "
                      f"callback {times['with']:.3f} s: the callback costs {ratio:.2f}x check_training's "
                      f"{times['check']:.3f} s (goal <= {GOAL:.2f}x); its hook {times['hook']:.3f} s "
                      f"({times['hook ratio']:.2f}x); in CPU time {times['cpu ratio']:.2f}x; the rounds' ratios' "
                      f"quartiles {times['spread'][0]:.2f}x-{times['spread'][1]:.2f}x")
                print(f"       | {framework} | the same done by hand (the first batches read from the run's loader, "
                      f"check_training, the report written as JSON and HTML): {times['by hand']:.3f} s; the callback "
                      f"costs {times['by hand ratio']:.2f}x that (for comparison, not a goal)")
    finally:
        torch.set_num_threads(threads)
    import pytorch_lightning as L

    after = len(L.Trainer(logger=False, enable_progress_bar=False).callbacks)
    same = after == runs_default()
    print(f"{'PASSED' if same else 'FAILED'} | nothing added without the callback: a Trainer's default callbacks "
          f"are {after} after importing tf32lab.integrations, as before")
    raise SystemExit(1 if failed or not same else 0)


def runs_default() -> int:
    """A Trainer's default callbacks, counted in a fresh process that never imported the integrations."""
    import subprocess
    import sys

    code = ("import pytorch_lightning as L, warnings; warnings.simplefilter('ignore'); "
            "print(len(L.Trainer(logger=False, enable_progress_bar=False).callbacks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
