"""examples/value_head's training workload on the GPU, for `tf32lab check --train --target native` there.

    PYTHONPATH=src python3 -m tf32lab check scripts/gpu/training_spec.py:cuda --train --target native
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import tf32lab

_spec = importlib.util.spec_from_file_location(
    "value_head", Path(__file__).resolve().parents[2] / "examples" / "value_head" / "train.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def cuda(steps: int = 50) -> tf32lab.TrainingWorkload:
    """The same workload as ``examples/value_head/train.py:workload``, its model and batches on the GPU."""
    workload = example.workload(steps)

    def batch(step: int):
        return tuple(t.cuda() for t in example.batch(256, torch.Generator().manual_seed(1000 + step)))

    return tf32lab.TrainingWorkload(workload.model.cuda(), batch, loss=example.loss, optimizer=workload.optimizer,
                                    steps=steps, name="actor-critic (cuda)", inputs=workload.inputs)


def encoder(device: str = "cpu", steps: int = 10) -> tf32lab.TrainingWorkload:
    """A MiniLM-sized BERT encoder (random weights, seeded; dropout off, so that a GPU and a CPU train alike) fine-
    tuned for ``steps`` AdamW steps to regress its mean-pooled embedding onto fixed targets; 32 x 32 tokens."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertModel(config).to(device)

    def batch(step: int):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(1000, 30000, (32, 32), generator=g)
        return ids.to(device), torch.randn(32, 384, generator=g).to(device)

    def loss(out, b):
        return (out.last_hidden_state.mean(1) - b[1]).pow(2).mean()

    return tf32lab.TrainingWorkload(model, batch, loss=loss, steps=steps, inputs=lambda b: {"input_ids": b[0]},
                                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), name="MiniLM-sized encoder")


def encoder_cuda() -> tf32lab.TrainingWorkload:
    return encoder("cuda")
