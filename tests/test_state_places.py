"""State a model keeps in more places: a submodule or parameter it adds or replaces as it runs, a buffer or tensor
it resizes or gives another dtype, a random generator, a deque or a dataclass; and a buffer on the meta device."""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import math
import random
from typing import Any, Optional

import numpy as np
import pytest
import torch

import tf32lab
import tf32lab.measure.given
import tf32lab.measure.state


def _check(model: torch.nn.Module) -> tf32lab.CheckReport:
    torch.manual_seed(0)
    return tf32lab.check(tf32lab.Workload(model, torch.randn(8, 16), name="stateful"), levels=("highest",),
                         target="a100")


def _error(report: tf32lab.CheckReport) -> float:
    (level,) = report.levels
    assert level.error is None, level.error
    (output,) = level.outputs
    return output.normwise


class _Base(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)


class _AddsModule(_Base):
    def forward(self, x):
        if not hasattr(self, "cache"):
            self.cache = torch.nn.Linear(16, 16)  # made at the first call: in the reference run, in float64
        return self.linear(x) + self.cache(x)


class _ReplacesModule(_Base):
    def forward(self, x):
        out = self.linear(x)
        self.linear = torch.nn.Linear(16, 16)
        return out


class _ReplacesParameter(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        out = self.linear(x) * self.gain
        self.gain = torch.nn.Parameter(self.gain.detach() * 1.5)
        return out


def test_a_submodule_or_parameter_added_or_replaced_as_it_runs_is_put_back():
    # the module made in the float64 reference run had float64 weights: every row raised a dtype error (a level
    # FAILED for no precision reason), and the model kept it, in float64
    model = _AddsModule()
    assert _error(_check(model)) < 1e-5
    assert not hasattr(model, "cache")
    model = _ReplacesModule()
    linear = model.linear
    assert _error(_check(model)) < 1e-5
    assert model.linear is linear and linear.weight.dtype == torch.float32
    # a parameter made anew, scaled: each row started from the last one's (normwise 0.5 at highest)
    model = _ReplacesParameter()
    gain = model.gain
    report = _check(model)
    assert _error(report) < 1e-5
    assert model.gain is gain and torch.equal(gain, torch.ones(16))
    assert any("gain" in note for note in report.notes), report.notes


class _DrawsOnce(_Base):
    """Draws its samples at the first call into a buffer registered as None, as botorch's MCSampler draws its
    ``base_samples``, and registers a buffer of a new name then too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("base", None)

    def forward(self, x):
        if self.base is None:
            self.base = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype)
            self.register_buffer("scale", x.detach().abs().mean(0))
        return self.linear(x) * self.base * self.scale


def test_a_buffer_registered_as_none_or_anew_as_it_runs_is_put_back():
    # the float64 reference's samples were kept: every row drew nothing (a note said the draws could not be
    # matched) and multiplied its float32 products by them in float64, and the model kept them after the check
    model = _DrawsOnce()
    report = _check(model)
    assert _error(report) < 1e-5
    assert model.base is None and "scale" not in model._buffers and not hasattr(model, "scale")
    assert not any("could not be matched" in note for note in report.notes), report.notes
    assert any("keeps state between calls" in note and "base" in note for note in report.notes), report.notes


class _ToInput(_Base):
    """Moves itself to its input's dtype, as botorch's analytic acquisition functions do (``self.to(X)``)."""

    def forward(self, x):
        self.to(x)
        return self.linear(x)


def test_a_model_that_converts_itself_to_its_inputs_dtype_is_not_said_to_write_its_parameters():
    # in the float64 reference its parameters became float64: said to be written as it runs ("the levels'
    # differences are not precision's alone"), where each row's self.to(x) gave float32 the same values back
    model = _ToInput()
    weight = model.linear.weight
    data = weight.detach()
    report = _check(model)
    assert _error(report) < 1e-5
    assert not any("writes into its own parameters" in note for note in report.notes), report.notes
    assert model.linear.weight is weight and weight.dtype == torch.float32 and weight.data_ptr() == data.data_ptr()


class _Resized(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(16))
        self.total = torch.zeros(16)

    def forward(self, x):
        out = self.linear(x) + self.seen.sum() + self.total.sum()
        self.seen.resize_(self.seen.numel() + 1).fill_(1.0)  # in place, another shape
        self.total.data = self.total + 1  # another tensor under the same object: float64 in the reference run
        return out


def test_a_buffer_or_tensor_given_another_shape_or_dtype_is_put_back():
    model = _Resized()
    seen, total = model.seen, model.total
    assert _error(_check(model)) < 1e-5  # was 32 at highest: each row added the last one's ones
    assert model.seen is seen and model.total is total
    for held in (seen, total):
        assert held.dtype == torch.float32 and torch.equal(held, torch.zeros(16))


class _Noisy(_Base):
    """Noise from a generator of its own, and a history in a deque and in a dataclass."""

    @dataclasses.dataclass
    class Memory:
        last: torch.Tensor
        calls: int = 0

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(1)
        self.history = collections.deque([torch.zeros(16)], maxlen=2)
        self.memory = self.Memory(torch.zeros(16))

    def forward(self, x):
        out = self.linear(x) + 1e-3 * torch.randn(16, generator=self.generator)
        out = out + self.history[-1] + self.memory.last
        self.history.append(out.detach().mean(0))
        self.memory.last = out.detach().mean(0)
        self.memory.calls += 1
        return out


def test_a_generator_deque_or_dataclass_of_its_own_is_put_back():
    model = _Noisy()
    state = model.generator.get_state()
    history, first = model.history, model.history[0]
    memory, last = model.memory, model.memory.last
    assert _error(_check(model)) < 1e-5  # was 1.1: each row drew other noise and added another history
    assert torch.equal(model.generator.get_state(), state)
    assert model.history is history and list(history) == [first]
    assert model.memory is memory and memory.last is last and memory.calls == 0


class _Meta(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("placeholder", torch.empty(4, device="meta"), persistent=False)

    def forward(self, x):
        return self.linear(x)


def test_a_buffer_on_the_meta_device_is_no_crash():
    model = _Meta()
    assert _error(_check(model)) < 1e-5  # torch.equal raised NotImplementedError on it
    assert model.placeholder.is_meta


class _TurnsDropoutOn(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        out = self.dropout(self.linear(x))
        self.dropout.train()  # as a model that turns its own dropout on (Monte Carlo dropout) after a call
        return out


def test_a_mode_a_run_changes_is_put_back_before_the_next():
    model = _TurnsDropoutOn()
    report = _check(model)
    assert _error(report) < 1e-5  # was 1.0: every row after the reference ran with the dropout on
    assert any("dropout.training" in note for note in report.notes), report.notes
    assert model.training and model.dropout.training  # as it was: check's eval mode ends too


def test_sparse_and_nested_tensors_are_put_back():
    # torch.equal has no sparse kernel and a nested tensor no sizes: the reset raised on either
    model = torch.nn.Linear(4, 4)
    model.register_buffer("adjacency", torch.eye(3).to_sparse())
    model.table = torch.eye(3).to_sparse()
    model.ragged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with tf32lab.measure.state.state_kept(model) as reset:
        model.adjacency.mul_(2)
        model.table = model.table * 2
        model.ragged.mul_(2)
        assert sorted(reset()) == ["adjacency", "ragged", "table"]
    assert torch.equal(model.adjacency.to_dense(), torch.eye(3)) and torch.equal(model.table.to_dense(), torch.eye(3))
    assert all(torch.equal(piece, torch.ones(n)) for piece, n in zip(model.ragged.unbind(), (2, 3)))


def test_a_model_that_writes_into_its_parameters_is_put_back_or_said_to():
    # an EMA-style update in forward: the reference run, which sees the write coming, copies that parameter first
    # and every run starts from its values (before, each run started from the last one's weights: highest FAILED);
    # a write it cannot see (through NumPy) is said: each run started from the last one's weights
    class Decays(torch.nn.Module):
        def __init__(self, numpy: bool) -> None:
            super().__init__()
            self.lin, self.numpy = torch.nn.Linear(8, 8), numpy

        def forward(self, x):
            out = self.lin(x)
            with torch.no_grad():
                if self.numpy:
                    self.lin.weight.detach().numpy()[:] *= 0.9
                else:
                    self.lin.weight.mul_(0.9)
            return out

    torch.manual_seed(0)
    model = Decays(numpy=False)
    weight = model.lin.weight.detach().clone()
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(16, 8)), levels=("highest", "high"), speed=False)
    assert not any("writes into its own parameters" in note for note in report.notes), report.notes
    assert any("(lin.weight changed as it ran)" in note for note in report.notes), report.notes
    assert report.level("highest").passed and torch.equal(model.lin.weight, weight)
    model = Decays(numpy=True)
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(16, 8)), levels=("highest", "high"), speed=False)
    said = [note for note in report.notes if "writes into its own parameters" in note]
    assert len(said) == 1 and "(lin.weight)" in said[0], report.notes
    plain = torch.nn.Linear(8, 8)
    report = tf32lab.check(tf32lab.Workload(plain, torch.randn(16, 8)), levels=("highest",), speed=False)
    assert not any("parameters" in note for note in report.notes), report.notes


@pytest.mark.parametrize("width", [8, 1024], ids=["small", "summed-at-its-ends"])
def test_a_write_into_parameters_through_data_is_put_back_too(width):
    # the common EMA form, p.data.mul_(d).add_(q.data, ...): .data is another tensor on the parameter's storage,
    # with a version counter of its own; the write is seen by that storage and put back (a weight of a million
    # elements as well)
    class Ema(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student, self.teacher = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

        def forward(self, x):
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.data.mul_(0.5).add_(s.data, alpha=0.5)
            return self.teacher(x)

    torch.manual_seed(0)
    model = Ema()
    teacher = copy.deepcopy(model.teacher)
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(16, width)), levels=("highest",), speed=False)
    assert any("(teacher.weight, teacher.bias changed as it ran)" in note for note in report.notes), report.notes
    assert report.passed and torch.equal(model.teacher.weight, teacher.weight) and \
        torch.equal(model.teacher.bias, teacher.bias)


def test_a_tensor_attribute_written_through_data_or_numpy_is_put_back():
    # .data and .numpy() write the values without moving the tensor's version counter: the attribute was taken
    # as unchanged, every row after the reference started from its last value (high failed at 1.6), and the
    # model kept it
    class Writes(_Base):
        def __init__(self, through: str) -> None:
            super().__init__()
            self.through, self.state = through, torch.zeros(16)

        def forward(self, x):
            out = self.linear(x) + self.state
            if self.through == "data":
                self.state.data.add_(1.0)
            else:
                self.state.numpy()[:] += 1.0
            return out

    for through in ("data", "numpy"):
        model = Writes(through)
        report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 16)), levels=("highest", "high"),
                               target="a100", speed=False)
        assert all(output.normwise < 1e-2 for level in report.levels for output in level.outputs), through
        assert torch.equal(model.state, torch.zeros(16)), through


class _Cache:
    def __init__(self) -> None:
        self.k = None


class _Holder:
    def __init__(self) -> None:
        self.inner = _Counter()


class _Counter:
    def __init__(self) -> None:
        self.total = torch.zeros(16)


@dataclasses.dataclass
class _Slotted:
    # what dataclass(slots=True) makes (Python 3.10 on; the package runs on 3.9): fields, no __dict__
    __slots__ = ("calls",)
    calls: int


def test_data_objects_in_lists_in_each_other_slotted_or_deep_are_put_back():
    # each was left alone: every row after the reference started from the state the last one left (highest failed
    # at 0.8 to 1.6), and the model kept it
    class Holds(_Base):
        def __init__(self) -> None:
            super().__init__()
            self.caches = [_Cache()]  # a per-layer cache object in a list
            self.holder = _Holder()  # a data object held by a data object
            self.slotted = _Slotted(0)  # a dataclass without __dict__
            self.deep = [{"layers": [{"h": torch.zeros(16)}]}]  # four levels of lists and dicts

        def forward(self, x):
            out = self.linear(x)
            cache = self.caches[0]
            cache.k = out.detach() if cache.k is None else cache.k + 1
            self.holder.inner.total.add_(1.0)
            self.slotted.calls += 1
            self.deep[0]["layers"][0]["h"].add_(1.0)
            return out + cache.k + self.holder.inner.total + self.slotted.calls + self.deep[0]["layers"][0]["h"]

    model = Holds()
    assert _error(_check(model)) < 1e-6
    assert model.caches[0].k is None and model.slotted.calls == 0
    assert torch.equal(model.holder.inner.total, torch.zeros(16))
    assert torch.equal(model.deep[0]["layers"][0]["h"], torch.zeros(16))


class _HooksOnce(_Base):
    """Registers a hook at its first call and marks itself, as transformers 5's output capture does: the hook
    gathers the inner layer's output, which the model adds to its own."""

    def forward(self, x):
        if not getattr(self, "_hooked", False):
            self._hooked = True
            self.linear.register_forward_hook(lambda module, args, out: self._seen.append(out))
        self._seen = []
        y = self.linear(x)
        return y + sum(self._seen)


def test_a_hook_a_run_registers_is_removed_with_the_mark_it_leaves():
    # the mark put back and the hook left, every row after the reference registered it again and gathered the
    # inner output twice: highest failed at 0.5
    model = _HooksOnce()
    report = _check(model)
    assert _error(report) < 1e-6 and report.passed
    assert not model.linear._forward_hooks and not hasattr(model, "_hooked")
    assert any("_hooked" in note for note in report.notes)


class _ScalesItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        ids.add_(1)
        return self.lin(x) + ids[:, None]


@pytest.mark.parametrize("levels", [("highest", "high"), ("high",)])
def test_a_model_that_writes_into_its_inputs_is_given_them_as_they_were_at_every_run(levels) -> None:
    # each run saw the last one's doubled input: `highest` failed at normwise 1.02, and the caller's tensor changed
    torch.manual_seed(0)
    x, ids = torch.randn(8, 16), torch.arange(8)
    before = x.clone(), ids.clone()
    report = tf32lab.check(tf32lab.Workload(_ScalesItsInput(), (x, ids), name="scales"), levels=levels, speed=False)
    assert all(row.passed for row in report.levels)
    assert torch.equal(x, before[0]) and torch.equal(ids, before[1])
    assert any("writes into its inputs" in note for note in report.notes)


class _LazyScalesItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.LazyLinear(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.lin(x)


def test_a_lazy_model_that_writes_into_its_inputs_leaves_the_callers_tensor_as_it_was() -> None:
    # the call that makes the lazy modules ran before the inputs were kept: the caller's tensor stayed doubled
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    before = x.clone()
    report = tf32lab.check(tf32lab.Workload(_LazyScalesItsInput(), (x,), name="lazy"), levels=("highest",),
                           speed=False)
    assert report.levels[0].passed
    assert torch.equal(x, before)
    assert any("writes into its inputs" in note for note in report.notes)


class _KeepsADtypeAndScalesItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)
        self.dtype: Optional[torch.dtype] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype is None:  # a dtype read off the (widened) input and kept: the reference is run again
            self.dtype = x.dtype
        x.mul_(2)
        return self.lin(x) + 1e-3 * torch.randn(8, 4, dtype=self.dtype).to(x.dtype)


def test_the_reference_run_again_for_the_draws_is_given_the_inputs_as_they_were() -> None:
    # it was given them as the first row had left them (doubled): every row failed against a reference of 2x
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    report = tf32lab.check(tf32lab.Workload(_KeepsADtypeAndScalesItsInput(), (x,), name="draws"),
                           levels=("highest", "high"), speed=False)
    assert any("run again drawing" in note for note in report.notes)
    assert all(row.passed for row in report.levels)


def test_inputs_made_under_inference_mode_are_checked() -> None:
    # the reference's layer frames read their version counters, which inference tensors have none of: it raised
    torch.manual_seed(0)
    with torch.inference_mode():
        x = torch.randn(8, 16)
    report = tf32lab.check(tf32lab.Workload(torch.nn.Linear(16, 4), (x,), name="inference"), levels=("highest",),
                           speed=False)
    assert report.levels[0].passed


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64, torch.float64])
def test_an_input_holding_nan_that_no_run_writes_is_not_said_written(dtype) -> None:
    # complex128 (16 bytes an element) was compared by value, and NaN is not equal to itself: every run "wrote" it
    x = torch.tensor([complex(math.nan, 1.0), 2.0], dtype=dtype) if dtype.is_complex else \
        torch.tensor([math.nan, 2.0], dtype=dtype)
    kept = tf32lab.measure.given.KeptInputs((x, x[0]))
    assert not kept() and not kept.written
    x.mul_(2)
    assert kept() and kept.written and x[1].item() == 2  # put back


def test_a_lazy_model_that_does_not_write_into_its_inputs_is_not_said_to() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(4))
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(8, 16), name="lazy"), levels=("highest",), speed=False)
    assert not any("writes into its inputs" in note for note in report.notes)


class _AppendsToItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, cache: list, extra: dict) -> torch.Tensor:
        y = self.lin(x)
        cache.append(y)
        extra["seen"] = extra.get("seen", 0) + 1
        return sum(cache) * extra["seen"]


def test_a_model_that_appends_to_a_list_it_is_given_gets_the_list_as_it_was_at_every_run() -> None:
    # each run saw the last one's entries: `high` failed at normwise 1.0 with no note, and the caller's list grew
    torch.manual_seed(0)
    cache: list = []
    extra: dict = {}
    report = tf32lab.check(tf32lab.Workload(_AppendsToItsInput(), (torch.randn(8, 16), cache, extra), name="appends"),
                           levels=("highest", "high"), speed=False)
    assert all(row.passed for row in report.levels)
    assert cache == [] and extra == {}
    assert any("writes into its inputs" in note for note in report.notes)


class _KeysOfALayer:  # a plain object holding a layer's cached keys, as transformers' DynamicLayer
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


class _KeyCache:  # as transformers' DynamicCache: its layers, and a class (code, not data) beside them
    def __init__(self, keys: torch.Tensor) -> None:
        self.layers = [_KeysOfALayer(keys)]
        self.layer_class = _KeysOfALayer


class _Attends(torch.nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.q, self.k, self.in_place = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), in_place

    def forward(self, x: torch.Tensor, cache: _KeyCache) -> torch.Tensor:
        layer, k = cache.layers[0], self.k(x)
        if self.in_place:  # a static cache: its last rows written over
            layer.keys[-k.size(0):].copy_(k)
        else:  # a dynamic one: appended to
            layer.keys = torch.cat((layer.keys, k))
        return self.q(x) @ layer.keys.t()


class _Decodes(torch.nn.Module):
    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.attn = _Attends(in_place)

    def forward(self, x: torch.Tensor, cache: _KeyCache) -> torch.Tensor:
        return torch.tanh(self.attn(x, cache))


def test_a_cache_object_the_model_appends_to_is_given_as_it_was_to_every_run_and_every_layer_rerun() -> None:
    # each run appended to the caller's cache, the float64 reference its float64 keys among them: every row raised
    # "expected scalar type Double but found Float" and FAILED; the cache grew. Then each layer's rerun was given
    # the cache as its call had left it (its own keys appended): the attention's introduced error was NaN
    torch.manual_seed(0)
    keys = torch.randn(12, 16)
    cache = _KeyCache(keys)
    report = tf32lab.check(tf32lab.Workload(_Decodes(), (torch.randn(4, 16), cache), name="decodes"),
                           introduced="all", levels=("highest", "high"), speed=False)
    assert all(row.passed and row.error is None for row in report.levels)
    assert cache.layers[0].keys is keys and cache.layer_class is _KeysOfALayer
    assert any("writes into its inputs" in note for note in report.notes)
    for row in report.levels:
        attn = next(layer for layer in row.layers if layer.name == "attn")
        assert attn.diverged is None and 0 < attn.introduced < (1e-6 if row.level == "highest" else 1e-2)


def test_a_cache_object_written_in_place_leaves_the_layer_unfed_and_the_rows_right() -> None:
    # a static cache's rows written over in place cannot be put back by reference for a layer's rerun: it was
    # rerun on the keys its call had written, and said nothing
    torch.manual_seed(0)
    keys = torch.randn(12, 16)
    before = keys.clone()
    cache = _KeyCache(keys)
    report = tf32lab.check(tf32lab.Workload(_Decodes(in_place=True), (torch.randn(4, 16), cache), name="static"),
                           introduced="all", levels=("highest", "high"), speed=False)
    assert all(row.passed for row in report.levels)
    assert cache.layers[0].keys is keys and torch.equal(keys, before)
    attn = next(layer for layer in report.level("high").layers if layer.name == "attn")
    assert math.isnan(attn.introduced) and "not fed" in attn.diverged


def test_held_puts_back_what_a_call_changed_and_tells_a_write_in_place() -> None:
    import types

    from tf32lab.measure.given import Held

    keys = torch.zeros(2, 16)
    cache, config = _KeyCache(keys), types.SimpleNamespace(width=16)
    held = Held.among(((torch.ones(2), cache), {"config": config, "mask": None}))
    assert held is not None and Held.among(((torch.ones(2),), {"mask": None})) is None  # tensors alone: nothing
    cache.layers[0].keys = torch.cat((keys, torch.ones(1, 16)))  # appended, as a dynamic cache is
    cache.layers.append(_KeysOfALayer(keys))
    config.width = 32
    assert not held.written()
    held.put_back()
    assert cache.layers[0].keys is keys and len(cache.layers) == 1 and config.width == 16
    keys.add_(1)  # written in place, as a static cache is: references cannot undo that
    assert held.written()


class _Decoder(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, cache: Optional[object] = None) -> torch.Tensor:
        return self.lm(ids, past_key_values=cache, use_cache=True).logits


def test_a_transformers_decoders_attention_layers_are_measured_with_its_own_cache_and_with_one_given() -> None:
    # with use_cache (a causal LM's default) the model makes a DynamicCache and hands it to every attention layer,
    # which appends to it: each rerun was given the cache as its call had left it, the reference's float64 keys in
    # it, and raised "expected scalar type Double but found Float": every attention layer's introduced error NaN
    import hf_builders

    lm = hf_builders.llama().eval()
    torch.manual_seed(0)
    ids = torch.randint(0, hf_builders.VOCAB, (2, 6))
    with torch.no_grad():
        cache = lm(ids, use_cache=True).past_key_values
    length = cache.get_seq_length()
    for inputs in ((ids,), (ids[:, -1:], cache)):
        report = tf32lab.check(tf32lab.Workload(_Decoder(lm), inputs, name="decoder"), introduced="all",
                               levels=("highest", "high"),
                               speed=False)
        assert all(row.passed and row.error is None for row in report.levels)
        attention = [layer for layer in report.level("high").layers if layer.name.endswith("self_attn")]
        assert len(attention) == 2 and all(0 < layer.introduced < 1e-3 for layer in attention), attention
    assert cache.get_seq_length() == length


def test_a_cache_object_made_under_inference_mode_is_held_for_the_reruns() -> None:
    # a cache prefilled under torch.inference_mode() (as a generation loop's is): holding it for a layer's reruns
    # asked is_inference() through the reference's function mode, which answered for a float64 copy of the keys
    # (not an inference tensor), and reading their version counter then raised: "workload 'decodes' raised at the
    # float64 reference: Inference tensors do not track version counter"
    torch.manual_seed(0)
    with torch.inference_mode():
        keys = torch.randn(12, 16)
    cache = _KeyCache(keys)
    report = tf32lab.check(tf32lab.Workload(_Decodes(), (torch.randn(4, 16), cache), name="decodes"),
                           introduced="all", levels=("highest", "high"), speed=False)
    assert all(row.passed and row.error is None for row in report.levels)
    assert cache.layers[0].keys is keys
    attn = next(layer for layer in report.level("high").layers if layer.name == "attn")
    assert attn.diverged is None and 0 < attn.introduced < 1e-2


class _DecodesTwice(torch.nn.Module):
    """Two decoding steps in one forward: the second attends over the keys the first appended to the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attends(in_place=False)

    def forward(self, x: torch.Tensor, cache: _KeyCache) -> torch.Tensor:
        return torch.tanh(self.attn(torch.tanh(self.attn(x, cache)[:, :16]), cache))


def test_a_layers_rerun_is_given_the_cache_its_call_was_given_in_float32() -> None:
    # the second call was given the cache as the reference had left it, float64 keys appended; its float32
    # reruns then raised "expected scalar type Float but found Double" at the concatenation (introduced NaN)
    torch.manual_seed(0)
    keys = torch.randn(12, 16)
    cache = _KeyCache(keys)
    report = tf32lab.check(tf32lab.Workload(_DecodesTwice(), (torch.randn(4, 16), cache), name="twice"),
                           introduced="all", levels=("highest", "high"), speed=False)
    assert all(row.passed and row.error is None for row in report.levels)
    assert cache.layers[0].keys is keys
    for row in report.levels:
        attn = next(layer for layer in row.layers if layer.name == "attn")
        assert attn.calls == 2 and attn.diverged is None, attn
        assert 0 < attn.introduced < (1e-6 if row.level == "highest" else 1e-2), attn


class _Frames:  # a streaming model's ring of past frames' keys
    def __init__(self, first: torch.Tensor) -> None:
        self.frames = collections.deque([first], maxlen=3)


class _AttendsToFrames(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, ring: _Frames) -> torch.Tensor:
        ring.frames.append(self.k(x))
        return self.q(x) @ torch.cat(list(ring.frames)).t()


class _Streams(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _AttendsToFrames()

    def forward(self, x: torch.Tensor, ring: _Frames) -> torch.Tensor:
        return torch.tanh(self.attn(x, ring))


def test_a_deque_among_a_layers_objects_is_given_to_its_reruns_as_the_call_was() -> None:
    # a deque was not held: each rerun was given the ring with its call's float64 keys appended, and raised at
    # its float32 product with them ("expected m1 and m2 to have the same dtype"): introduced NaN
    torch.manual_seed(0)
    first = torch.randn(4, 16)
    ring = _Frames(first)
    report = tf32lab.check(tf32lab.Workload(_Streams(), (torch.randn(4, 16), ring), name="ring"),
                           introduced="all", levels=("highest", "high"), speed=False)
    assert list(ring.frames) == [first]
    for row in report.levels:
        attn = next(layer for layer in row.layers if layer.name == "attn")
        assert attn.diverged is None and 0 < attn.introduced < (1e-6 if row.level == "highest" else 1e-2), attn


class _NoisyLayer(torch.nn.Module):
    """A layer that scales its product by a number drawn from the generator it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor, generator: Any) -> torch.Tensor:
        if isinstance(generator, torch.Generator):
            drawn = float(torch.rand((), generator=generator))
        else:  # random.Random, numpy.random.Generator
            drawn = float(generator.random())
        return torch.nn.functional.linear(x, self.weight) * (1 + drawn)


class _DrawsFromAGivenGenerator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.noisy = _NoisyLayer()

    def forward(self, x: torch.Tensor, generator: Any) -> torch.Tensor:
        return torch.tanh(self.noisy(x, generator))


@pytest.mark.parametrize("kind", ["torch", "random", "numpy"])
def test_a_random_generator_among_the_inputs_draws_alike_in_every_run_and_every_rerun(kind: str) -> None:
    # a generator given among the inputs was not kept: each run drew the next numbers from it (normwise 0.1 to 0.6
    # at `highest`, FAILED and blamed on precision), each rerun of the layer drawing from it too, and the caller's
    # generator was left advanced
    torch.manual_seed(0)
    generator = {"torch": lambda: torch.Generator().manual_seed(1), "random": lambda: random.Random(1),
                 "numpy": lambda: np.random.default_rng(1)}[kind]()
    fresh = {"torch": lambda: torch.Generator().manual_seed(1), "random": lambda: random.Random(1),
             "numpy": lambda: np.random.default_rng(1)}[kind]()
    report = tf32lab.check(tf32lab.Workload(_DrawsFromAGivenGenerator(), (torch.randn(4, 16), generator),
                                            name="draws"), introduced="all", levels=("highest", "high"), speed=False)
    assert report.level("highest").outputs[0].normwise < 1e-6 and all(row.passed for row in report.levels)
    noisy = next(layer for layer in report.level("highest").layers if layer.name == "noisy")
    assert noisy.introduced < 1e-6, noisy
    draw = (lambda g: float(torch.rand((), generator=g))) if kind == "torch" else (lambda g: float(g.random()))
    assert draw(generator) == draw(fresh)  # the caller's generator as it was


def test_each_float64_tensor_among_the_layers_objects_is_narrowed_once_for_all_their_reruns() -> None:
    # every layer call's reruns made float32 copies of every float64 tensor in the cache it was given: each
    # attention layer is given the whole cache, so every earlier layer's keys were copied again at every layer
    # (quadratic in the layers); a copy goes with its tensor (a decoding loop replaces its keys at every step)
    cache = _KeyCache(torch.randn(12, 16, dtype=torch.float64))
    narrowed = tf32lab.measure.given.Narrowed()
    first, second = _held_among(cache), _held_among(cache)
    first.put_back(narrowed)
    copy = cache.layers[0].keys
    second.put_back(narrowed)
    assert copy.dtype == torch.float32 and cache.layers[0].keys is copy
    first.put_back()
    assert cache.layers[0].keys.dtype == torch.float64
    del first, second, cache, copy
    gc.collect()
    assert not narrowed._copies


def _held_among(cache: _KeyCache) -> tf32lab.measure.given.Held:
    held = tf32lab.measure.given.Held.among(((torch.ones(1), cache), {}))
    assert held is not None
    return held


def test_a_model_that_rescales_its_weights_once_is_checked_from_its_weights_and_left_as_it_was():
    # RWKV's eval mode (transformers' RwkvModel): at its first call it divides some weights in place and marks
    # itself so. The mark was put back before every run and the weights were not: every run divided them again,
    # `highest` failed at 0.38 (float64's own answer: 3.7e-07), and the model was left with its weights divided
    # and unmarked, to divide them once more at its next call (its outputs 78% off a fresh copy's)
    class Rescales(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)
            self.rescaled = False

        def forward(self, x):
            if not self.training and not self.rescaled:
                with torch.no_grad():
                    self.out.weight.div_(2)
                self.rescaled = True
            return self.out(torch.tanh(self.lin(x)))

    torch.manual_seed(0)
    model, x = Rescales().eval(), torch.randn(32, 16)
    fresh = copy.deepcopy(model)
    report = tf32lab.check(tf32lab.Workload(model, x), levels=("highest", "high"), speed=False)
    assert report.level("highest").outputs[0].normwise < 1e-5 < report.level("high").outputs[0].normwise < 1e-2
    assert not any("writes into its own parameters" in note for note in report.notes), report.notes
    assert any("keeps state between calls" in note and "out.weight" in note for note in report.notes), report.notes
    assert not model.rescaled and torch.equal(model.out.weight, fresh.out.weight)
    assert torch.equal(model(x), fresh(x))
