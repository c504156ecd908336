"""The model's own forward hooks in a layer's reruns (``measure.own_hooks``): they run there, as the model runs them,
and what a hook keeps from a rerun is the reference call's again afterwards. A model that returns what a hook
stored had its float64 reference replaced by a float32 rerun's output: under ``introduced="all"``, a policy row or
``tune``, every row was measured against it (`highest` read 2.5e-4, not 2e-7)."""

from __future__ import annotations

import collections
import functools

import pytest
import torch

import tf32lab
from tf32lab import Policy
from tf32lab.measure.own_hooks import OwnHooks


class _Three(torch.nn.Module):
    """Two layers and a head, and a store a hook keeps into."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 8)
        self.store: dict = {}


class _Stored(_Three):
    """Returns, through a head, what a forward hook on ``b`` stored: timm's ``FeatureHooks`` pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.b.register_forward_hook(lambda module, args, output: self.store.__setitem__("b", output))

    def forward(self, x):
        self.b(torch.tanh(self.a(x)))
        return self.head(self.store["b"])


class _Plain(_Stored):
    """The same model without the hook."""

    def __init__(self) -> None:
        super().__init__()
        self.b._forward_hooks.clear()

    def forward(self, x):
        return self.head(self.b(torch.tanh(self.a(x))))


def _workload(cls) -> tf32lab.Workload:
    torch.manual_seed(0)
    return tf32lab.Workload(cls(), torch.randn(256, 64), name=getattr(cls, "__name__", "captured"))


def _errors(report) -> list[tuple[str, float]]:
    return [(row.level, row.outputs[0].normwise) for row in report.levels]


def _layers(report) -> dict[tuple[str, str], tuple[float, float]]:
    return {(row.level, e.name): (e.introduced, e.accumulated) for row in report.levels for e in row.layers}


@pytest.mark.parametrize("introduced", ["failing", "all"])
def test_a_model_returning_what_its_hook_stored_is_measured_as_the_same_model_without_the_hook(introduced):
    kwargs = {"levels": ("highest", "high"), "target": "a100", "speed": False, "introduced": introduced}
    hooked = tf32lab.check(_workload(_Stored), **kwargs)
    plain = tf32lab.check(_workload(_Plain), **kwargs)
    assert _errors(hooked) == _errors(plain)
    assert hooked.level("highest").outputs[0].normwise < 1e-6
    assert _layers(hooked) == _layers(plain)


def test_a_policy_row_of_a_model_returning_what_its_hook_stored_is_measured_against_the_reference():
    policy = Policy("high", [("head", "highest")])
    kwargs = {"levels": ("highest",), "target": "a100", "speed": False, "policy": policy}
    hooked = tf32lab.check(_workload(_Stored), **kwargs)
    plain = tf32lab.check(_workload(_Plain), **kwargs)
    assert _errors(hooked) == _errors(plain)


class _Gathers(torch.nn.Module):
    """A parent whose own product reads what its children's hooks gathered in its forward: in its rerun the hooks
    gather its children's answers, float32 (the reference's float64 outputs met a float32 weight there)."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))
        self.out = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.gathered: dict = {}
        for i, stage in enumerate(self.stages):
            stage.register_forward_hook(lambda module, args, output, i=i: self.gathered.__setitem__(i, output))

    def forward(self, x):
        h = x
        for stage in self.stages:
            h = torch.tanh(stage(h))
        return torch.cat([self.gathered[0], self.gathered[1]], -1) @ self.out  # its own product: a layer


def test_a_parent_reading_what_its_childrens_hooks_gathered_is_rerun_with_them_and_measured():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Gathers(), torch.nn.Linear(64, 8))
    w = tf32lab.Workload(model, torch.randn(32, 32), name="gathers")
    kwargs = {"levels": ("highest", "high"), "target": "a100", "speed": False}
    failing, every = (tf32lab.check(w, introduced=i, tolerance=1e-9, **kwargs) for i in ("failing", "all"))
    assert _errors(failing) == _errors(every) and every.level("highest").outputs[0].normwise < 1e-6
    parent = next(e for e in every.level("high").layers if e.name == "0")
    assert 1e-6 < parent.introduced < 1e-2, parent


def test_own_hooks_calls_again_only_the_observers_and_puts_every_hook_back():
    layer = torch.nn.Linear(4, 4)
    calls: collections.Counter = collections.Counter()
    kept: dict = {}

    def observes(module, args, out):
        calls["observes"] += 1
        kept["out"] = out

    def scales(module, args, out):
        calls["scales"] += 1
        return out * 2

    def writes(module, args, out):
        calls["writes"] += 1
        out.mul_(1.0)

    def fsdps(module, args, out):  # PyTorch's own: left to run as it is
        calls["fsdps"] += 1

    fsdps.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    for hook in (observes, scales, writes, fsdps):
        layer.register_forward_hook(hook)
    before = layer._forward_hooks
    rerunning = [False]
    with torch.no_grad(), OwnHooks([layer], set(), lambda: rerunning[0]) as hooks:
        layer(torch.ones(1, 4))
        first = kept["out"]
        rerunning[0] = True
        layer(torch.zeros(1, 4))  # a rerun
        rerunning[0] = False
        assert kept["out"] is not first
        hooks.put_back()
        late = layer.register_forward_hook(lambda module, args, out: None)
    assert kept["out"] is first
    assert calls == {"observes": 3, "scales": 2, "writes": 2, "fsdps": 2}, calls
    assert layer._forward_hooks is before and late.id in before  # one registered meanwhile stays
    assert list(before.values())[:4] == [observes, scales, writes, fsdps]


class _OneShot(torch.nn.Module):
    """Keeps its first call of ``b`` by a hook that removes itself as it runs (a one-shot capture), and reads it."""

    def __init__(self, with_kwargs: bool) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.first: dict = {}

        def once(module, args, *rest):  # (kwargs,) output
            self.first["b"] = rest[-1]
            self.handle.remove()

        self.handle = self.b.register_forward_hook(once, with_kwargs=with_kwargs)

    def forward(self, x):
        h = self.b(self.b(torch.tanh(self.a(x))))  # the second call: the hook removed itself at the first
        return self.head(h) + self.head(self.first["b"])


@pytest.mark.parametrize("with_kwargs", [False, True])
@pytest.mark.parametrize("introduced", ["failing", "all"])
def test_a_hook_that_removes_itself_as_it_runs_is_removed_in_the_reference_too(with_kwargs, introduced):
    torch.manual_seed(0)
    model = _OneShot(with_kwargs)
    w = tf32lab.Workload(model, torch.randn(8, 16), name="one shot")
    report = tf32lab.check(w, levels=("highest", "high"), target="a100", speed=False, introduced=introduced)
    assert report.level("highest").outputs[0].normwise < 1e-6  # not the second call's output in the reference
    hooks = list(model.b._forward_hooks.values())
    assert len(hooks) == 1 and not hasattr(hooks[0], "__wrapped__")  # the model's own hook, as it was
    assert dict(model.b._forward_hooks_with_kwargs) == ({model.handle.id: True} if with_kwargs else {})


def test_a_hook_registered_while_own_hooks_watches_is_removed_by_its_handle():
    layer = torch.nn.Linear(4, 4)
    layer.register_forward_hook(lambda module, args, out: None)
    with torch.no_grad(), OwnHooks([layer], set(), lambda: False):
        late = layer.register_forward_hook(lambda module, args, out: None)
    late.remove()
    assert late.id not in layer._forward_hooks and len(layer._forward_hooks) == 1


class _Computes(torch.nn.Module):
    """A hook that keeps what it computes from ``b``'s output: a product with a float32 weight, or a float32 copy."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
        self.w = torch.nn.Parameter(torch.randn(32, 32) / 6)
        self.store: dict = {}

        def hook(module, args, out):
            self.store["b"] = out @ self.w if how == "product" else out.float() * 1.0

        self.b.register_forward_hook(hook)

    def forward(self, x):
        self.b(torch.tanh(self.a(x)))
        return self.head(self.store["b"])


@pytest.mark.parametrize("how", ["product", "float"])
def test_a_hook_that_computes_what_it_keeps_is_called_again_in_the_float64_run(how):
    """Called again with the float64 run paused, the product raised (double != float) and the copy was float32."""
    torch.manual_seed(0)
    w = tf32lab.Workload(_Computes(how), torch.randn(64, 32), name=how)
    kwargs = {"levels": ("highest", "high"), "target": "a100", "speed": False}
    failing, every = (tf32lab.check(w, introduced=i, **kwargs) for i in ("failing", "all"))
    assert _errors(failing) == _errors(every) and every.level("highest").outputs[0].normwise < 1e-6


class _Parent(torch.nn.Module):
    """A layer (its own product) around a nested layer, which its rerun answers."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32) / 6)
        self.part = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.part(x @ self.w)


def test_a_hook_that_removes_itself_in_a_rerun_is_the_models_again_after_the_check_and_unwrapped():
    # a rerun is not the model's run: what it changes of the model is put back (measure.state), the hooks
    # included; the wrappers of the reruns (an answered layer's) and of the reference's own hooks go with them
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), _Parent(), torch.nn.Linear(32, 8))
    part = model[2].part
    calls = []

    def second_call_only(module, args, output):  # removes itself at its second call: its own first rerun
        calls.append(len(calls))
        if len(calls) == 2:
            handle.remove()

    handle = part.register_forward_hook(second_call_only)
    tf32lab.check(tf32lab.Workload(model, torch.randn(8, 32), name="parent"), levels=("highest", "high"),
                  target="a100", speed=False, introduced="all")
    assert list(part._forward_hooks.values()) == [second_call_only]
    assert all(not module._forward_hooks for module in model.modules() if module is not part)


class _PreStored(_Three):
    """Returns, through a head, the input a forward pre-hook on ``b`` stored."""

    def __init__(self) -> None:
        super().__init__()
        self.b.register_forward_pre_hook(lambda module, args: self.store.__setitem__("b", args[0]))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.head(self.b(h) + self.store["b"])


class _PrePlain(_PreStored):
    def __init__(self) -> None:
        super().__init__()
        self.b._forward_pre_hooks.clear()

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.head(self.b(h) + h)


class _GlobalStored(_Plain):
    """Returns what a global forward hook stored for ``b``."""

    def forward(self, x):
        self.b(torch.tanh(self.a(x)))
        return self.head(_GLOBAL[id(self.b)])


_GLOBAL: dict = {}


@pytest.mark.parametrize("stored, plain", [(_PreStored, _PrePlain), (_GlobalStored, _Plain)], ids=["pre", "global"])
def test_a_pre_hook_or_a_global_hook_that_stores_is_measured_as_the_model_without_it(stored, plain):
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: _GLOBAL.__setitem__(id(module), output))
    try:
        kwargs = {"levels": ("highest", "high"), "target": "a100", "speed": False, "introduced": "all"}
        hooked = tf32lab.check(_workload(stored), **kwargs)
        without = tf32lab.check(_workload(plain), **kwargs)
    finally:
        handle.remove()
        _GLOBAL.clear()
    assert _errors(hooked) == _errors(without) and hooked.level("highest").outputs[0].normwise < 1e-6


def _scale_data(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    output.data.mul_(2.0)


class _ScalesData(_Plain):
    """A forward hook that scales its output in place through ``.data``, which bumps no version counter: called again
    after the reruns as an observer, it scaled the reference's output twice (highest read 0.497 under "all")."""

    def __init__(self, hooked: bool) -> None:
        super().__init__()
        self.hooked = hooked
        if hooked:
            self.b.register_forward_hook(_scale_data)

    def forward(self, x):
        y = self.b(torch.tanh(self.a(x)))
        return self.head(y if self.hooked else 2.0 * y)


@pytest.mark.parametrize("introduced", ["failing", "all"])
def test_a_hook_that_writes_into_its_output_through_data_is_not_called_again(introduced):
    kwargs = {"levels": ("highest", "high"), "target": "a100", "speed": False, "introduced": introduced}
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    torch.manual_seed(1)
    hooked = tf32lab.check(tf32lab.Workload(_ScalesData(True), x, name="hooked"), **kwargs)
    torch.manual_seed(1)
    without = tf32lab.check(tf32lab.Workload(_ScalesData(False), x, name="without"), **kwargs)
    assert _errors(hooked) == _errors(without) and hooked.level("highest").outputs[0].normwise < 1e-6


def test_a_check_called_inside_a_checked_models_hook_is_refused_in_one_line():
    # inside the float64 reference every tensor reads float64: the inner check blamed its model's float32 weights
    inner = tf32lab.Workload(torch.nn.Linear(8, 8), torch.randn(4, 8), name="inner")
    kwargs = {"levels": ("highest",), "target": "a100", "speed": False}
    model = _Plain()
    model.b.register_forward_hook(lambda module, args, output: tf32lab.check(inner, **kwargs) and None)
    with pytest.raises(tf32lab.Tf32LabError, match="inside another check") as caught:
        tf32lab.check(tf32lab.Workload(model, torch.randn(4, 64), name="outer"), **kwargs)
    assert "\n" not in str(caught.value)
    assert all(getattr(h, "__wrapped__", None) is None for h in model.b._forward_hooks.values())
    assert tf32lab.check(inner, **kwargs).level("highest").outputs[0].normwise < 1e-6  # outside: as ever


class _Twice(torch.nn.Module):
    """A layer of its own product that calls ``b``, then ``c``, then ``b`` again."""

    def __init__(self) -> None:
        super().__init__()
        self.b, self.c = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.w = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        return self.b(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(x @ self.w))))))


class _LastStored(torch.nn.Module):
    """Returns, through a head, what the hooks on ``b`` and ``c`` stored last under one key: ``b``'s second output."""

    def __init__(self, hooked: bool) -> None:
        super().__init__()
        self.inner, self.head, self.hooked, self.store = _Twice(), torch.nn.Linear(64, 8), hooked, {}
        if hooked:
            for module in (self.inner.b, self.inner.c):
                module.register_forward_hook(lambda module, args, output: self.store.__setitem__("last", output))

    def forward(self, x):
        y = self.inner(x)
        return self.head(self.store["last"] if self.hooked else y)


@pytest.mark.parametrize("introduced", ["failing", "all"])
def test_observers_are_called_again_in_the_order_of_their_last_reference_calls(introduced):
    # called again in the order they first ran in the reruns (b, c), c's output was left where the reference left
    # b's: highest read 1.10 under "all"
    kwargs = {"levels": ("highest", "high"), "target": "a100", "speed": False, "introduced": introduced}
    reports = []
    for hooked in (True, False):
        torch.manual_seed(1)
        model = _LastStored(hooked)
        torch.manual_seed(0)
        reports.append(tf32lab.check(tf32lab.Workload(model, torch.randn(256, 64), name="last"), **kwargs))
    assert _errors(reports[0]) == _errors(reports[1]) and reports[0].level("highest").outputs[0].normwise < 1e-6


class _Captured(_Plain):
    """Captures ``b``'s output in its forward through a global hook it registers there and removes, a capture
    context's pattern (or with a hook on ``b`` put first); the global hook runs before the layer's own."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x):
        store: dict = {}
        if self.how == "global":
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda module, args, output: store.__setitem__(id(module), output))
        else:
            handle = self.b.register_forward_hook(lambda module, args, output: store.__setitem__(id(module), output),
                                                  prepend=True)
        try:
            self.b(torch.tanh(self.a(x)))
        finally:
            handle.remove()
        return self.head(store[id(self.b)])


@pytest.mark.parametrize("how", ["global", "prepended"])
def test_a_hook_registered_in_the_forward_that_stores_is_measured_as_the_model_without_it(how):
    # registered after the reference began, it was not watched: the reruns left their float32 output in its store
    # (highest read 2.5e-4 under "all")
    kwargs = {"levels": ("highest", "high"), "target": "a100", "speed": False, "introduced": "all"}
    hooked, without = (tf32lab.check(_workload(cls), **kwargs)
                       for cls in (functools.partial(_Captured, how), _Plain))
    assert _errors(hooked) == _errors(without) and hooked.level("highest").outputs[0].normwise < 1e-6
    assert not torch.nn.modules.module._global_forward_hooks


def test_a_check_that_reruns_no_layer_leaves_the_models_hooks_as_they_are():
    # without reruns there is nothing to put back: a global observer (a NaN check on every module) was held with
    # each module's last float64 input and output, all-MiniLM-L6-v2's check peaking at 925 MiB instead of 800
    seen: list[bool] = []

    def watching(module, args, output):
        seen.append(any(hook is watching for hook in module._forward_hooks.values()))  # not a wrapper of it

    workload = _workload(_Plain)
    workload.model.b.register_forward_hook(watching)
    tf32lab.check(workload, levels=("highest", "high"))
    assert seen and all(seen)
    seen.clear()
    tf32lab.check(workload, levels=("highest", "high"), introduced="all")  # reruns: watched while the reference runs
    assert not all(seen)
