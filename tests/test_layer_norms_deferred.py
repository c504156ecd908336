"""A layer output's ‖r‖² is summed when the first row compares with it, from the chunks the difference reads,
unless the reference pass reruns layers (then at once, as the reruns need it). Either way it is the same number,
so a layer's accumulated error does not depend on which pass measured it: in memory, spilled to disk, complex,
float32 state, or holding values a row holds alike (Inf)."""

from __future__ import annotations

import math

import pytest
import torch

import tf32lab
from tf32lab.measure.norms import reference_norm2, scratch, tree_normwise
from tf32lab.measure.spill import SpillFile


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 300)
        self.b = torch.nn.Linear(300, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _accumulated(report) -> dict[tuple[str, str], float]:
    return {(row.level, layer.name): layer.accumulated for row in report.levels for layer in row.layers}


@pytest.mark.parametrize("spill_mib", ["0", "0.01"])
def test_a_layers_accumulated_error_is_the_same_whether_its_norm_was_deferred_or_not(monkeypatch, spill_mib):
    monkeypatch.setenv("TF32LAB_SPILL_MIB", spill_mib)  # 0.01: the 300-wide output is written out
    torch.manual_seed(0)
    w = tf32lab.Workload(_Net(), torch.randn(512, 64), name="net")
    kwargs = {"levels": ("highest", "high"), "target": "a100", "speed": False}
    deferred = _accumulated(tf32lab.check(w, **kwargs))
    at_once = _accumulated(tf32lab.check(w, introduced="all", **kwargs))
    assert deferred == at_once
    assert all(e > 0 for e in deferred.values()), deferred


@pytest.mark.parametrize("r", [
    torch.randn(200_003, dtype=torch.float64),  # more than one chunk, the last one short
    torch.randn(300, 700, dtype=torch.float64).t(),  # not contiguous
    torch.randn(1000, dtype=torch.complex128),
    torch.tensor([3.0, math.inf, 4.0], dtype=torch.float64),  # a masked score: the row holds it alike
], ids=["chunks", "transposed", "complex", "inf"])
def test_a_deferred_norm_is_the_bits_of_reference_norm2(r):
    y = (r * (1 + 1e-3)).to(torch.complex64 if r.is_complex() else torch.float32)
    norms: dict = {"output": None}
    work = scratch(r.device)
    deferred = tree_normwise(y, r, norms, work)
    assert norms["output"] == reference_norm2(r)
    assert deferred == tree_normwise(y, r, {"output": reference_norm2(r)}, work)


def test_a_spilled_reference_defers_its_norm_to_the_same_bits():
    r = torch.randn(150_001, dtype=torch.float64)
    with SpillFile(min_bytes=1) as spill:
        kept = spill.put(r)
        norms: dict = {"output": None}
        error, _ = tree_normwise(r.float(), kept, norms, scratch(r.device))
    assert norms["output"] == reference_norm2(r) and 0 < error < 1e-7


def test_a_float32_output_kept_widened_has_the_norm_of_its_widened_values():
    t = torch.randn(70_000)
    assert reference_norm2(t) == reference_norm2(t.double())


class _Half(torch.nn.Module):
    """A layer whose output is float16, its values past 256: ‖r‖ beyond float16's range."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(128, 1024) / 11)

    def forward(self, x):
        return (x @ self.w).half() * 300.0


@pytest.mark.parametrize("introduced", ["failing", "all"])
def test_a_half_precision_layer_output_past_float16s_range_has_an_error(introduced):
    """Its ‖r‖ was summed in float16: Inf, and the layer's error 0.0 at every level."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Half(), torch.nn.Flatten(0))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(128, 128), name="half"), levels=("highest", "high"),
                           target="a100", speed=False, introduced=introduced)
    errors = _accumulated(report)
    assert 1e-6 < errors[("high", "0")] < 1e-2 and 0 < errors[("highest", "0")] < errors[("high", "0")], errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_outputs_norm_is_its_values_norm_in_float64(dtype):
    torch.manual_seed(0)
    r = (torch.rand(200_000) * 4).to(dtype)
    assert math.isclose(reference_norm2(r), float((r.double() ** 2).sum()), rel_tol=1e-12)
    norms: dict = {"output": None}
    tree_normwise(r.float(), r, norms, scratch(r.device))
    assert norms["output"] == reference_norm2(r)


@pytest.mark.parametrize("spilled", [False, True])
def test_a_reference_on_another_device_than_the_scratch_is_read_through_a_buffer_on_its_own(spilled):
    # a model spread over devices (layers on cuda:0 and cuda:1, or one left on the CPU) hands tree_normwise the
    # scratch made for the first layer's device: a difference across two devices raised on a GPU; a buffer on
    # another device (here the meta device, which the CPU can run) stands for it
    r = torch.linspace(-1.0, 1.0, 5000, dtype=torch.float64)
    y = (r * 1.5).float()
    elsewhere = torch.empty_like(scratch(r.device), device="meta")
    with SpillFile(min_bytes=1) as spill:
        kept = spill.put(r) if spilled else r
        found = tree_normwise(y, kept, {"output": None}, elsewhere)
        here = tree_normwise(y, kept, {"output": None}, scratch(r.device))
    assert found == here and found[1] is None and found[0] == pytest.approx(0.5, rel=1e-6)
