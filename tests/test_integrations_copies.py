"""The training-loop callbacks' copies of the run's module (`tf32lab.integrations._loop.stepping_copy`): the check
deep-copies the view about ten times (its snapshot, each row and probe), and the copy is made submodule by
submodule, each empty hook dict a new one, rather than by `deepcopy`'s `__reduce_ex__` of every one of them. It must
be the copy `deepcopy` makes: the same modules, values, sharing, hooks and state, none of it the run's own."""

from __future__ import annotations

import collections
import copy
import copyreg

import pytest
import torch

from tf32lab.integrations._loop import StepCall, stepping_copy


class Copied(torch.nn.Linear):
    """A submodule that copies itself its own way: left to deepcopy, which calls this."""

    made = 0

    def __deepcopy__(self, memo):
        type(self).made += 1
        out = torch.nn.Linear(self.in_features, self.out_features)
        out.load_state_dict(self.state_dict())
        memo[id(self)] = out
        return out


class Packed(torch.nn.Module):
    """A submodule whose state is its own (a tuple, not its __dict__'s entries): given back through __setstate__."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def __getstate__(self):
        return ("packed", dict(self.__dict__))

    def __setstate__(self, state):
        assert state[0] == "packed"
        self.__dict__.update(state[1])

    def forward(self, x):
        return x * self.scale


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = torch.nn.Linear(4, 4)
        self.again = self.shared  # one submodule under two names
        self.head = torch.nn.Linear(4, 4)
        self.head.weight = self.shared.weight  # tied weights
        self.frozen = torch.nn.Linear(4, 2)
        self.frozen.bias.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("scratch", torch.arange(3.0), persistent=False)
        self.rnn = torch.nn.LSTM(4, 3, batch_first=True)  # its own __setstate__ (its flat weights)
        self.own = Copied(2, 2)
        self.packed = Packed()
        self.seen = []
        self.head.register_forward_hook(lambda module, args, out: self.seen.append(out.shape))
        self.empty = torch.nn.ModuleList()  # falsy (len 0): copied all the same

    def forward(self, x):
        h = self.head(torch.tanh(self.again(self.norm(x))))
        return self.frozen(h).sum() + self.rnn(h.unsqueeze(0))[0].sum() + self.own(self.packed(h[:, :2])).sum()


def test_a_copy_of_the_view_is_the_copy_deepcopy_makes():
    net = Net()
    view = stepping_copy(net)
    made, plain = copy.deepcopy(view), copy.deepcopy(net)
    assert type(made) is type(view)
    assert [(n, type(m)) for n, m in made.named_modules(remove_duplicate=False)][1:] == \
        [(n, type(m)) for n, m in plain.named_modules(remove_duplicate=False)][1:]
    assert made.again is made.shared and made.head.weight is made.shared.weight  # sharing kept
    for (name, p), q, o in zip(made.named_parameters(), plain.parameters(), net.parameters()):
        assert torch.equal(p, q) and p.requires_grad == q.requires_grad and type(p) is type(q), name
        assert p is not o and p.data_ptr() != o.data_ptr(), name  # none of it the run's own
    assert not made.frozen.bias.requires_grad
    for (name, b), c in zip(made.named_buffers(), plain.buffers()):
        assert torch.equal(b, c) and b is not dict(net.named_buffers())[name], name
    assert made._non_persistent_buffers_set == {"scratch"} and "scratch" not in made.state_dict()
    assert Copied.made == 2  # the submodule's own __deepcopy__, once for each copy
    # the hook is the copy's (it is copied as deepcopy copies a lambda: the same function)
    x = torch.randn(5, 4)
    made.train()
    out = made(StepCall(0, lambda model, micro, step: model(micro[0])), [x])
    assert torch.equal(out, plain(x)) and len(net.seen) == 2
    # each hook dict is new: a hook added to the copy is not the run's, nor another copy's
    made.shared.register_forward_hook(lambda *a: None)
    assert not net.shared._forward_hooks and not copy.deepcopy(view).shared._forward_hooks
    assert made.rnn._flat_weights[0] is made.rnn.weight_ih_l0  # the LSTM's own __setstate__ ran
    assert made.packed.scale is not net.packed.scale and float(made.packed.scale.detach()) == 2.0
    out.backward()
    assert net.shared.weight.grad is None  # the run's parameters untouched


def test_no_empty_hook_dict_is_rebuilt_through_reduce(monkeypatch):
    """What made the copies slow: deepcopy rebuilds each of a module's dozen empty hook dicts through
    ``__reduce_ex__`` (a LightningModule over a three-layer MLP: 0.41 ms a copy); the copy makes new empty ones."""
    view = stepping_copy(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    rebuilt = collections.Counter()
    reconstruct = copy._reconstruct

    def counted(x, memo, *args, **kwargs):
        rebuilt[type(x).__name__] += 1
        return reconstruct(x, memo, *args, **kwargs)

    monkeypatch.setattr(copy, "_reconstruct", counted)
    made = copy.deepcopy(view)
    assert rebuilt["OrderedDict"] == 0 and rebuilt["Linear"] == 0, rebuilt
    assert all(type(m._forward_hooks) is collections.OrderedDict for m in made.modules())


@pytest.mark.xdist_group("lightning")  # the worker that imports Lightning for its other tests
def test_a_lightning_modules_copy_drops_its_trainer():
    L = pytest.importorskip("pytorch_lightning")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

    module = Module()
    module._trainer = object()  # LightningModule.__getstate__ leaves it out of every copy
    made = copy.deepcopy(stepping_copy(module))
    assert made._trainer is None and module._trainer is not None
    assert torch.equal(made.net.weight, module.net.weight) and made.net.weight is not module.net.weight


class Pickled(torch.nn.Module):
    """A submodule whose ``__getstate__`` builds new containers (its submodules and hooks as pickling should see
    them): deepcopy keeps that state alive while it copies, so no later object takes one of their ids."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4)

    def __getstate__(self):
        state = super().__getstate__()
        state["_modules"] = dict(self._modules)
        state["_forward_hooks"] = collections.OrderedDict()  # a hook is no pickle's
        state["cache"] = {}
        return state

    def forward(self, x):
        return self.lin(x)


def test_a_state_built_by_getstate_is_copied_as_deepcopy_copies_it():
    net = torch.nn.Sequential(*[Pickled(seed) for seed in range(6)])
    made, plain = copy.deepcopy(stepping_copy(net)), copy.deepcopy(net)
    assert [sorted(block._modules) for block in made] == [["lin"]] * 6  # each block its own submodules
    for name in ("_modules", "_forward_hooks", "cache"):  # none of them one block's and another's
        assert len({id(getattr(block, name)) for block in made}) == 6, name
    x = torch.randn(3, 4)
    assert torch.equal(made(x), plain(x))


class Registered(torch.nn.Linear):
    """A submodule class whose copies copyreg makes (deepcopy asks copyreg's table before the class itself)."""


def test_a_class_copyreg_reduces_and_an_instances_own_deepcopy_are_left_to_deepcopy(monkeypatch):
    monkeypatch.setitem(copyreg.dispatch_table, Registered,
                        lambda m: (torch.nn.Linear, (m.in_features, m.out_features), m.__getstate__()))
    net = torch.nn.Sequential(Registered(4, 4), torch.nn.Linear(4, 4))

    def own(memo):  # set on the instance: deepcopy calls it as it would the class's
        out = torch.nn.Linear(4, 4)
        out.load_state_dict(net[1].state_dict())
        out.marked = True
        memo[id(net[1])] = out
        return out

    net[1].__dict__["__deepcopy__"] = own
    made, plain = copy.deepcopy(stepping_copy(net)), copy.deepcopy(net)
    assert type(made[0]) is type(plain[0]) is torch.nn.Linear
    assert getattr(made[1], "marked", False) and getattr(plain[1], "marked", False)


def test_a_hook_bound_to_the_run_module_is_bound_to_the_copy():
    """A hook that is a method of the run's module (``self.layer.register_forward_hook(self.keep)``): deepcopy binds
    it to the copy, and so must a copy of the view (not to a second copy of the run's module)."""

    class Kept(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 4)
            self.layer.register_forward_hook(self.keep)
            self.last = None

        def keep(self, module, args, out):
            self.last = out

        def forward(self, x):
            self.layer(x)
            return self.last * 2

    net = Kept()
    made, plain = copy.deepcopy(stepping_copy(net)), copy.deepcopy(net)
    assert next(iter(made.layer._forward_hooks.values())).__self__ is made
    x = torch.randn(3, 4)
    assert torch.equal(made(x), plain(x)) and net.last is None
    made.last = None  # a graph's tensor: no deepcopy's
    again = copy.deepcopy(made)  # a copy of a copy: bound to itself
    assert next(iter(again.layer._forward_hooks.values())).__self__ is again
