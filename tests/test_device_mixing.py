"""No tensor of tf32lab's own meets the model's device in an op: what raises on a GPU (``device_tags``). On an H200
every ``check`` of a GPU model raised at its first output, from a histogram kept on the CPU."""

from __future__ import annotations

import torch

import tf32lab
from device_tags import DeviceTags


class _Net(torch.nn.Module):
    """A convolution with batch norm and dropout, an LSTM and attention with dropout: most paths a check takes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.lstm = torch.nn.LSTM(8, 16, batch_first=True)
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True, dropout=0.1)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).flatten(2).transpose(1, 2)
        out, _ = self.lstm(h)
        a, _ = self.attention(out, out, out, need_weights=False)
        return self.head(a.mean(1))


def _model_and_input():
    torch.manual_seed(0)
    return _Net(), torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def test_check_mixes_no_host_tensor_into_the_models_device():
    model, x = _model_and_input()
    with DeviceTags(model, x) as tags:
        tf32lab.check(tf32lab.Workload(model, x, name="net"), levels=("highest", "high"), speed=False)
        tf32lab.check(tf32lab.Workload(model, x, name="net"), levels=("highest",), target="native", speed=False)
    assert not tags.mixed, tags.mixed


def test_the_training_check_and_emulate_mix_none_either():
    model, x = _model_and_input()
    data = [(x, torch.randn(4, 5, generator=torch.Generator().manual_seed(s))) for s in range(2)]
    with DeviceTags(model, data) as tags:
        tf32lab.check_training(tf32lab.TrainingWorkload(model, data, inputs=lambda b: b[0],
                                                        loss=lambda out, b: (out - b[1]).pow(2).mean(), name="net"),
                               levels=("highest", "high"), speed=False)
        with tf32lab.precision("high"), tf32lab.emulate("h100"):
            model.train()
            model(x).sum().backward()
    assert not tags.mixed, tags.mixed


def test_the_tags_see_a_host_tensor_added_to_a_device_one():
    # the H200's bug, as it was: a CPU histogram += counts of the output's device
    y = torch.randn(8)
    with DeviceTags(y) as tags:
        counts = torch.zeros(4, dtype=torch.int64)
        counts += torch.bincount((y.abs() * 2).long().clamp(0, 3), minlength=4)
    assert set(tags.mixed) == {"add_"}
