"""What the training-loop callbacks cost: a run with `Tf32Check` (Lightning) or `Tf32CheckCallback` (Hugging Face)
minus the same run without it, as a multiple of `check_training` on the same steps of the same model (a
hand-written `TrainingWorkload`: its first batches, its loss, its optimizer). Goal: at most 1x plus a little (the
callback reads its batches again and copies the model once more). And nothing added where the callback is not in
`callbacks`: importing the integrations adds no callback to a Trainer and no hook to a module. Both sides write
the report's JSON and HTML, as the callbacks do.

    .venv/bin/python benchmarks/integrations.py [--rounds 3] [--steps 10]
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch
from _common import header, interleaved
from torch.utils.data import DataLoader, TensorDataset

import tf32lab

MARGIN = 0.25  # the callback's own work beyond the check: one more copy of the model, the batches read again
LEVELS = ("highest", "high")


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 1, generator=g))


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))


def by_hand(steps: int, folder: str):
    """The same model, batches (the loader's order: not shuffled), loss and optimizer as a TrainingWorkload, its
    report written as the callbacks write theirs (JSON and HTML)."""
    loader = DataLoader(data(), batch_size=16)
    batches = [batch for _, batch in zip(range(steps), loader)]
    workload = tf32lab.TrainingWorkload(mlp(), batches, loss=lambda out, b: (out - b[1]).pow(2).mean(),
                                        inputs=lambda b: b[0], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    def run() -> None:
        report = tf32lab.check_training(workload, levels=LEVELS, target="a100")
        report.to_json(f"{folder}/by-hand.json")
        report.save_html(f"{folder}/by-hand.html")

    return run


def lightning(steps: int, folder: str) -> dict[str, object]:
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

    def fit(callbacks: list) -> None:
        trainer = L.Trainer(max_steps=steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                            default_root_dir=folder,
                            enable_checkpointing=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(Module(), DataLoader(data(), batch_size=16))

    before = len(L.Trainer(logger=False, enable_progress_bar=False).callbacks)
    return {"without": lambda: fit([]), "with": lambda: fit([Tf32Check(steps=steps, levels=LEVELS)]),
            "default callbacks": before}


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

    def train(callbacks: list) -> None:
        args = TrainingArguments(folder, max_steps=steps, per_device_train_batch_size=16, report_to=[],
                                 save_strategy="no", disable_tqdm=True, use_cpu=True, learning_rate=1e-3,
                                 lr_scheduler_type="constant", max_grad_norm=0.0, logging_strategy="no")
        Trainer(model=Model(), args=args, train_dataset=rows, callbacks=callbacks).train()

    return {"without": lambda: train([]), "with": lambda: train([Tf32CheckCallback(steps=steps, levels=LEVELS)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "transformers", "tf32lab.integrations"):
        logging.getLogger(name).setLevel(logging.ERROR)
    header(f"integrations: callback overhead over check_training, {args.steps} steps, levels {', '.join(LEVELS)}")
    import tempfile

    failed = False
    with tempfile.TemporaryDirectory() as folder:
        for framework, make in (("lightning", lambda: lightning(args.steps, folder)),
                                ("transformers", lambda: transformers_(args.steps, folder))):
            runs = make()
            variants = {"without": runs["without"], "with": runs["with"], "check": by_hand(args.steps, folder)}
            times = interleaved(variants, rounds=args.rounds, number=1)
            ratio = (times["with"] - times["without"]) / times["check"]
            ok = ratio <= 1 + MARGIN
            failed |= not ok
            print(f"{'PASSED' if ok else 'FAILED'} | {framework} | run {times['without']:.2f} s, with the callback "
                  f"{times['with']:.2f} s: the callback costs {ratio:.2f}x check_training's {times['check']:.2f} s "
                  f"(goal <= {1 + MARGIN:.2f}x)")
    import pytorch_lightning as L

    after = len(L.Trainer(logger=False, enable_progress_bar=False).callbacks)
    same = after == runs_default(args)
    print(f"{'PASSED' if same else 'FAILED'} | nothing added without the callback: a Trainer's default callbacks "
          f"are {after} after importing tf32lab.integrations, as before")
    raise SystemExit(1 if failed or not same else 0)


def runs_default(args: argparse.Namespace) -> int:
    """A Trainer's default callbacks, counted in a fresh process that never imported the integrations."""
    import subprocess
    import sys

    code = ("import pytorch_lightning as L, warnings; warnings.simplefilter('ignore'); "
            "print(len(L.Trainer(logger=False, enable_progress_bar=False).callbacks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
