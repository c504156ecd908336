"""Two CPU processes under torchrun's environment (gloo): a Hugging Face Trainer run without the check, then one with
it; each process says its verdict, and process zero whether the weights are the same
(tests/test_integrations_transformers.py). ``python -m torch.distributed.run --nproc_per_node 2
transformers_ddp_job.py FOLDER warn`` runs it; the test forks both processes from one that imported transformers
once (``tests/distributed_jobs.py``'s ``trainer`` scenario), where torchrun made three interpreters, each importing
torch and two of them transformers' Trainer.

A tiny GPT-2, whose loss takes the token count (`num_items_in_batch`): with `average_tokens_across_devices` the
Trainer gathers that count from every process, a collective the check on process zero alone must not enter."""

import sys
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from tf32lab.integrations.transformers import Tf32CheckCallback


def said(line: str) -> None:
    """``line`` in one write: the processes share one pipe, and print() writes its parts and its newline apart,
    so that another process's output could land inside the line (seen: "same weights:", then another's newline)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Said(TrainerCallback):
    def __init__(self, check):
        self.check = check

    def on_train_end(self, args, state, control, **kwargs):
        said(f"process {args.process_index}: passed={self.check.passed} report={self.check.report is not None}")


def train(folder, check):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": (ids := torch.randint(0, 40, (10,), generator=g)), "labels": ids} for _ in range(16)]
    args = TrainingArguments(folder, max_steps=3, per_device_train_batch_size=2, report_to=[], save_strategy="no",
                             disable_tqdm=True, use_cpu=True, logging_strategy="no", learning_rate=1e-2,
                             ddp_backend="gloo", average_tokens_across_devices=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      callbacks=[check, Said(check)] if check else [])
    trainer.train()
    return model


def main(folder: str, on_fail: str) -> None:
    warnings.simplefilter("ignore")
    plain = train(folder + "/a", None)
    checked = train(folder + "/b", Tf32CheckCallback(steps=2, levels=("highest", "high"), on_fail=on_fail))
    if torch.distributed.get_rank() == 0:
        said(f"same weights: {all(torch.equal(p, q) for p, q in zip(plain.parameters(), checked.parameters()))}")
    # the Trainer leaves its process group open: its gloo threads, torn down by the interpreter's exit, once aborted
    # a process ("terminate called without an active exception")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
