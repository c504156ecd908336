"""A model that keeps state between calls: every run of check starts from the state the model had, the report
says the model keeps state, and the model has that state again afterwards."""

from __future__ import annotations

import pytest
import torch

import tf32lab
from tf32lab.measure.state import state_kept


class _Streaming(torch.nn.Module):
    """A streaming layer that carries its last output into the next call, as an attribute (not a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.carry = torch.zeros(16)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x):
        self.calls += 1
        self.seen.append(self.calls)
        out = self.linear(x) + self.carry
        self.carry = out.detach().mean(0)
        return out


class _Counting(torch.nn.Module):
    """A counter written in place into a tensor attribute, and a cache made at the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.count = torch.zeros(())

    def forward(self, x):
        self.count.add_(1.0)
        if not hasattr(self, "scale"):
            self.scale = x.abs().mean()  # float64 at the reference: kept, it would reach the float32 rows
        return self.linear(x) * self.count * self.scale


def _check(model: torch.nn.Module) -> tf32lab.CheckReport:
    torch.manual_seed(0)
    return tf32lab.check(tf32lab.Workload(model, torch.randn(8, 16), name="stateful"), levels=("highest",),
                         target="a100")


@pytest.mark.parametrize("make", [_Streaming, _Counting], ids=["attribute", "in-place-and-cache"])
def test_each_run_starts_from_the_models_state_and_the_report_says_it_keeps_state(make):
    torch.manual_seed(0)
    model = make()
    before = {k: (v, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(model).items()
              if not k.startswith("_")}
    report = _check(model)
    (output,) = report.levels[0].outputs
    # float32 at `highest` against the float64 reference of the same call: float32's own rounding, nothing more
    assert output.normwise < 1e-5, output
    assert any(note.startswith("the model keeps state between calls") for note in report.notes), report.notes
    for key, (value, copy) in before.items():  # the same objects, holding what they held
        assert getattr(model, key) is value, key
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, copy), key
    assert not hasattr(model, "scale")
    assert model.seen == [] if isinstance(model, _Streaming) else True


def test_a_model_without_state_gets_no_note():
    torch.manual_seed(0)
    report = _check(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()))
    assert not any("keeps state" in note for note in report.notes)


class _Moved(torch.nn.Module):
    """Moves a constant mask to its input's device at every call, as a buffer and as a plain attribute
    (speechbrain's LiGRU: ``self.drop_mask_te = self.drop_mask_te.to(w.device)``): in float32 the very same
    tensors, no state; the float64 reference's ops widen what they return, so there it assigns float64 copies."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.register_buffer("mask", torch.ones(16))
        self.scale = torch.full((16,), 0.5)

    def forward(self, x):
        self.mask = self.mask.to(x.device)
        self.scale = self.scale.to(x.device)
        return self.linear(x) * self.mask * self.scale


def test_a_model_that_only_moves_its_tensors_to_the_inputs_device_gets_no_note():
    torch.manual_seed(0)
    model = _Moved()
    mask, scale = model.mask, model.scale
    report = _check(model)
    assert report.levels[0].outputs[0].normwise < 1e-5
    assert not any("keeps state" in note for note in report.notes), report.notes
    assert model.mask is mask and model.scale is scale and mask.dtype == scale.dtype == torch.float32


class _Scripted(torch.nn.Module):
    """A TorchScript model with its state in attributes, as Silero VAD keeps its LSTM state."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.state = torch.zeros(16)
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        out = self.linear(x) + self.state
        self.state = out.mean(0)
        return out


def test_a_torchscript_models_attributes_are_put_back_between_runs():
    torch.manual_seed(0)
    model = torch.jit.script(_Scripted())
    state = model.state
    report = _check(model)
    assert report.levels[0].outputs[0].normwise < 1e-5
    assert any("state, steps changed as it ran" in note for note in report.notes), report.notes
    assert model.state is state and torch.equal(state, torch.zeros(16)) and model.steps == 0


def test_reset_puts_back_lists_and_dicts_in_the_same_objects():
    module = torch.nn.Linear(2, 2)
    module.history, module.table = [1], {"a": 1}
    history, table = module.history, module.table
    with state_kept(module) as reset:
        module.history.append(2)
        module.table["b"] = 2
        module.fresh = torch.ones(1)
        module.helper = print  # code, not state: left alone
        changed = reset()
        assert module.history is history and history == [1] and table == {"a": 1}
        assert not hasattr(module, "fresh") and module.helper is print
    assert sorted(changed) == ["fresh", "history", "table"]


def test_a_parameter_a_list_holds_is_watched_not_copied():
    # an LSTM's _flat_weights lists its parameters: copied as a list's contents, they doubled its weights in a
    # check (an LSTM encoder's check peaked at 2.06x its forward's memory, 1.89x without the copy)
    from tf32lab.measure.state import kept_contents

    lstm = torch.nn.LSTM(4, 8, 2)
    items, inner = kept_contents(lstm._flat_weights, weights={id(p) for p in lstm.parameters()})
    assert items == lstm._flat_weights and inner == [None] * len(items)
    buffer = torch.ones(3)
    assert torch.equal(kept_contents([buffer])[1][0], buffer)  # a plain tensor's values are still kept
    with state_kept(lstm) as reset:
        flat = lstm._flat_weights
        lstm._flat_weights = list(reversed(flat))  # the list swapped: put back, and said
        with torch.no_grad():
            lstm.weight_hh_l0.add_(1.0)  # a write into a weight: said, not undone
        assert reset() == ["_flat_weights"] and lstm._flat_weights is flat
        assert reset.written == ["weight_hh_l0"]


class _Unregistered(torch.nn.Module):
    """Parameters in a plain list and a dict (not a ParameterList: the module never registers them), scaled in
    place at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.scales = [torch.nn.Parameter(torch.ones(8))]
        self.table = {"shift": torch.nn.Parameter(torch.zeros(8))}

    def forward(self, x):
        with torch.no_grad():
            self.scales[0].mul_(1.5)
            self.table["shift"].add_(1.0)
        return self.linear(x) * self.scales[0] + self.table["shift"]


def test_a_parameter_the_model_does_not_register_is_put_back_and_said():
    # no version counter watches it (it is none of the model's parameters): left alone, every row started from the
    # last one's values (the `high` row 125% off, no note) and the caller's model kept the check's writes
    module = _Unregistered()
    with state_kept(module) as reset:
        module(torch.ones(2, 8))
        assert sorted(reset()) == ["scales", "table"] and not reset.written
        assert torch.equal(module.scales[0], torch.ones(8)) and torch.equal(module.table["shift"], torch.zeros(8))
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Unregistered(), torch.randn(4, 8), name="unregistered")
    report = tf32lab.check(workload, levels=("highest", "high"), speed=False)
    assert all(row.passed for row in report.levels) and any("keeps state" in note for note in report.notes)
    assert torch.equal(workload.model.scales[0], torch.ones(8))


def test_a_torchscript_models_buffers_are_put_back():
    # a scripted module's _buffers is TorchScript's wrapper, which has no .get(): every check of a scripted model
    # with a buffer (a BatchNorm's running statistics) raised AttributeError at the first reset
    model = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    running = model[1].running_mean.clone()
    with state_kept(model) as reset:
        model(torch.randn(8, 4) + 3)  # train mode: the running statistics move
        assert {"running_mean", "running_var"} <= {name.split(".")[-1] for name in reset()}
        assert torch.equal(model[1].running_mean, running)
    torch.manual_seed(0)
    report = _check(torch.jit.script(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))))
    assert report.levels[0].outputs[0].normwise < 1e-5


def test_a_parameter_in_an_object_the_model_is_given_is_put_back():
    # an input object's attributes are kept as a module's are, with no parameters of the model's to skip: a write
    # into a parameter in its list is undone and said, as into any tensor there
    from tf32lab.measure.given import KeptInputs

    class Holder:
        def __init__(self) -> None:
            self.items = [torch.nn.Parameter(torch.ones(3))]

    holder = Holder()
    kept = KeptInputs((torch.ones(1), holder))
    with torch.no_grad():
        holder.items[0].mul_(2)
    assert kept() and torch.equal(holder.items[0], torch.ones(3))
