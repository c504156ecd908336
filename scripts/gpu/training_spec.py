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
