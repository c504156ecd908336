"""Per-module policies: which level each module gets, and that its forward and backward really run at it."""

from __future__ import annotations

import asyncio
import copy
import gc
import inspect
import json
import pickle
import re
import threading
import warnings
import weakref
from pathlib import Path

import hypothesis
import pytest
import torch
import torch.utils.checkpoint

import cli_runner
import tf32lab
from tf32lab import Policy
from tf32lab.control import flags
from tf32lab.control.policy import Rule
from tf32lab.errors import Tf32LabError


class ActorCritic(torch.nn.Module):
    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
        self.pi = torch.nn.Linear(width, 6)
        self.v_head = torch.nn.Sequential(torch.nn.Linear(width, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))

    def forward(self, x):
        h = self.body(x)
        return self.pi(h), self.v_head(h)


def _model(seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    return ActorCritic()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _step(model: ActorCritic, x: torch.Tensor):
    model.zero_grad(set_to_none=True)
    pi, v = model(x)
    (pi.square().sum() + v.square().sum()).backward()
    return pi.detach(), v.detach(), _grads(model)


def _by_hand(model: ActorCritic, x: torch.Tensor, body: str, head: str):
    """The same step with each part run, forward and backward, inside its own scope."""
    model.zero_grad(set_to_none=True)
    with tf32lab.precision(body):
        h = model.body(x)
        pi = model.pi(h)
    cut = h.detach().requires_grad_()
    with tf32lab.precision(head):
        v = model.v_head(cut)
        v.square().sum().backward()
    with tf32lab.precision(body):
        torch.autograd.backward([pi.square().sum(), h], [None, cut.grad])
    return pi.detach(), v.detach(), _grads(model)


def _same(a, b) -> bool:
    flat = lambda r: [r[0], r[1], *r[2]]  # noqa: E731
    return all(torch.equal(u, v) for u, v in zip(flat(a), flat(b)))


# -- which level each module gets -----------------------------------------------------------------------------
def test_the_first_matching_rule_wins_and_children_inherit():
    model = _model()
    policy = Policy("high", [("v_head.2", "medium"), ("v_head*", "highest"), ("body.*", "medium")])
    got = {a.name: (a.level, a.source) for a in policy.explain(model)}
    assert got[""] == ("high", "default")
    assert got["pi"] == ("high", "inherited from the model")
    assert got["body"] == ("high", "inherited from the model")
    assert got["body.0"] == ("medium", "rule 3 'body.*'")
    assert got["v_head"] == ("highest", "rule 2 'v_head*'")
    assert got["v_head.0"] == ("highest", "rule 2 'v_head*'")  # '*' crosses dots, as fnmatch does
    assert got["v_head.2"] == ("medium", "rule 1 'v_head.2'")


def test_nested_modules_inherit_from_the_nearest_named_parent():
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model = torch.nn.Sequential(inner, torch.nn.Linear(4, 4))
    got = {a.name: a.level for a in Policy(None, [("0", "highest"), ("0.1.0", "medium")]).explain(model)}
    assert got == {"": None, "0": "highest", "0.0": "highest", "0.1": "highest", "0.1.0": "medium", "1": None}


def _untouched(model: torch.nn.Module) -> bool:
    return not any("forward" in m.__dict__ or m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_hooked_names_the_modules_where_the_level_changes_and_remove_leaves_none_touched():
    model = _model()
    policy = Policy("high", [("v_head", "highest"), ("v_head.*", "highest"), ("pi", "high")])
    with policy.applied(model) as handle:
        assert handle.hooked == ["", "v_head"]
    assert _untouched(model)
    with Policy(None, [("pi", "medium")]).applied(model) as handle:
        assert handle.hooked == ["pi"]
    assert _untouched(model)


# -- forward and backward at each module's level ----------------------------------------------------------------
@pytest.mark.parametrize("body,head", [("high", "highest"), ("highest", "medium"), ("medium", "high")])
def test_emulated_forward_and_gradients_follow_each_modules_level(body, head):
    model, x = _model(), torch.randn(16, 32)
    with tf32lab.emulate("a100"):
        expected = _by_hand(model, x, body, head)
        with Policy(body, [("v_head", head)]).applied(model), tf32lab.emulate("a100") as emu:
            got = _step(model, x)
    assert _same(got, expected)
    # a100 gives medium and high alike (TF32): the counts per math prove which modules ran at which level
    math = {"highest": "ieee", "high": "tf32-rna", "medium": "tf32-rna"}
    head_ops = {"aten::addmm": 2, "aten::mm": 4}  # two linears; backward: grad of input and of weight each
    body_ops = {"aten::addmm": 3, "aten::mm": 5}  # body's two linears and pi; the first gets no input grad
    want: dict = {}
    for level, ops in ((head, head_ops), (body, body_ops)):
        for op, n in ops.items():
            want[(op, math[level])] = want.get((op, math[level]), 0) + n
    assert dict(emu.coverage) == want


@pytest.mark.parametrize("body,head", [("medium", "highest"), ("highest", "medium"), ("high", "medium")])
def test_native_forward_and_gradients_follow_each_modules_level(body, head):
    # The reference is each part run inside precision(its level) on this very CPU: whatever this CPU does at a
    # level (bf16 through oneDNN, another float32 kernel, or nothing new) is what the policy must give that part.
    # Whether two levels differ here is the CPU's business, not asserted.
    model, x = _model(), torch.randn(16, 32)
    expected = _by_hand(model, x, body, head)
    with Policy(body, [("v_head", head)]).applied(model):
        got = _step(model, x)
    assert _same(got, expected)


def test_a_policy_pins_gradients_computed_in_another_thread():
    # forward and backward in a worker thread (on a GPU, autograd runs nodes in its own device threads: the
    # mode that pins a node is pushed on whichever thread runs it)
    model, x = _model(), torch.randn(16, 32)
    with tf32lab.emulate("a100"):
        expected = _by_hand(model, x, "high", "highest")
    policy = Policy("high", [("v_head", "highest")])
    result = {}

    def work():
        with tf32lab.emulate("a100"), policy.applied(model):
            result["got"] = _step(model, x)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert _same(result["got"], expected)


def test_two_threads_with_two_policies_do_not_cross():
    a, b = _model(1), _model(2)
    x = torch.randn(16, 32)
    pa, pb = Policy("high", [("v_head", "highest")]), Policy("highest", [("body", "high")])
    with tf32lab.emulate("a100"):
        want_a = _by_hand(a, x, "high", "highest")
        model_b_expected = {}
        with pb.applied(b):
            model_b_expected["r"] = _step(b, x)
    got = {"a": [], "b": []}
    barrier = threading.Barrier(2)

    def work(model, policy, key):
        torch.init_num_threads()  # the thread count the expectations were computed with (see _native)
        barrier.wait()
        with tf32lab.emulate("a100"), policy.applied(model):
            for _ in range(15):
                got[key].append(_step(model, x))

    threads = [threading.Thread(target=work, args=(a, pa, "a")), threading.Thread(target=work, args=(b, pb, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(_same(r, want_a) for r in got["a"])
    assert all(_same(r, model_b_expected["r"]) for r in got["b"])
    # and natively: two threads, two policies, the flag follows each module
    native_a = _by_hand(a, x, "medium", "highest")
    native_b = []
    with Policy("highest", [("body", "medium")]).applied(b):
        native_b.append(_step(b, x))
    got = {"a": [], "b": []}
    pa, pb = Policy("medium", [("v_head", "highest")]), Policy("highest", [("body", "medium")])
    threads = [threading.Thread(target=lambda: _native(a, pa, x, got["a"])),
               threading.Thread(target=lambda: _native(b, pb, x, got["b"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(_same(r, native_a) for r in got["a"]) and all(_same(r, native_b[0]) for r in got["b"])


def _native(model, policy, x, into):
    # A new thread's first GEMM runs on MKL's default thread count, not torch.set_num_threads()'s (that reaches a
    # thread at its first parallel_for, pytorch#37461): under xdist (1 thread a worker) another split of the sums
    # than the main thread's expectation, and other bits. torch.init_num_threads() gives the thread the same count.
    torch.init_num_threads()
    with policy.applied(model):
        for _ in range(15):
            into.append(_step(model, x))


def test_asyncio_tasks_serve_a_model_with_a_policy():
    model, x = _model(), torch.randn(16, 32)
    with tf32lab.emulate("a100"):
        expected = _by_hand(model, x, "high", "highest")

    async def one():
        with tf32lab.emulate("a100"):
            await asyncio.sleep(0)
            return _step(model, x)

    async def many():
        return await asyncio.gather(*(one() for _ in range(6)))

    with Policy("high", [("v_head", "highest")]).applied(model):
        results = asyncio.run(many())
    assert all(_same(r, expected) for r in results)


COMPILED = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_policy import Policy, _model, _step

model, x = _model(), torch.randn(16, 32)
policy = Policy("medium", [("v_head", "highest")])
with policy.applied(model):
    eager = _step(model, x)
with Policy("medium").applied(model):
    all_medium = _step(model, x)
compiled = torch.compile(model)
with policy.applied(model):
    got = _step(compiled, x)

def gap(a, b):
    return max((u - v).abs().max().item() for u, v in zip([a[1], *a[2]], [b[1], *b[2]]))

print(gap(got, eager), gap(eager, all_medium), gap(got, all_medium))
"""


def test_torch_compile_breaks_the_graph_at_policy_boundaries_and_keeps_the_levels(tmp_path):
    # In a child process: what torch.compile leaves in a process (its caches) is not this suite's to keep. Forked
    # from the suite's CLI server (torch and tf32lab imported, nothing compiled), as a fresh one without the 2-3 CPU
    # seconds of importing torch again.
    # Compiled code fuses pointwise ops (float32 rounding differs by ~1e-7); the levels' effect is ~1e-4 (bf16).
    (tmp_path / "compiled_policy.py").write_text(COMPILED.format(tests=str(Path(__file__).parent)))
    done = cli_runner.run(module="compiled_policy", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled_vs_eager, eager_vs_all_medium, compiled_vs_all_medium = map(float, done.stdout.split()[-3:])
    assert compiled_vs_eager < 2e-6
    # Where this CPU's medium differs from highest by more than fusion noise, the pinned head shows in compiled
    # code too (whether and how much it differs is the CPU's: bf16 through oneDNN, another float32 kernel, none).
    if eager_vs_all_medium > 20 * 2e-6:
        assert compiled_vs_all_medium > 10 * max(compiled_vs_eager, 1e-7)


# -- wherever its modules run: direct calls, a changed model, checkpoint recomputation -------------------------
def _maths(fn) -> dict[str, int]:
    """The maths an A100 gives the matmuls ``fn()`` runs, forward and backward, counted by the emulator."""
    with tf32lab.emulate("a100") as emu:
        fn()
    found: dict[str, int] = {}
    for (_, math), n in emu.coverage.items():
        found[math] = found.get(math, 0) + n
    return found


def test_a_child_called_directly_runs_at_the_level_explain_gives_it():
    # CLIP's encode_image calls self.visual directly, not through the model's forward
    model, x, h = _model(), torch.randn(16, 32), torch.randn(16, 48)
    policy = Policy("high", [("v_head", "highest")])
    levels = {a.name: a.level for a in policy.explain(model)}
    assert (levels["body"], levels["v_head.2"]) == ("high", "highest")
    with policy.applied(model):
        assert _maths(lambda: model.body(x).sum().backward()) == {"tf32-rna": 5}  # 2 forward, 3 backward
        assert _maths(lambda: model.v_head[2](h[:, :24]).sum().backward()) == {"ieee": 2}  # inside the pinned one
        assert _maths(lambda: model.pi(h)) == {"tf32-rna": 1}
    assert _maths(lambda: model.body(x)) == {"ieee": 2}  # removed: the caller's level again
    with Policy(None, [("v_head", "highest")]).applied(model), tf32lab.precision("high"):
        assert _maths(lambda: model.body(x)) == {"tf32-rna": 2}  # no level of its own: the caller's


def _new_head(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(48, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))


def test_a_module_replaced_after_apply_runs_at_its_level_and_the_old_one_is_let_go():
    model, x = _model(), torch.randn(16, 32)
    policy = Policy("high", [("v_head", "highest")])
    with policy.applied(model):
        old = model.v_head
        model.v_head = _new_head(5)
        assert {a.name: a.level for a in policy.explain(model)}["v_head.2"] == "highest"
        with tf32lab.emulate("a100"):
            got = _step(model, x)
        assert tf32lab.control.policy.applied_to(old) is None
        assert "forward" not in old.__dict__ and _maths(lambda m=old: m(torch.randn(2, 48))) == {"ieee": 2}
        with tf32lab.precision("medium"):  # out of the model: the caller's level
            assert _maths(lambda m=old: m(torch.randn(2, 48))) == {"tf32-rna": 2}
        Policy("medium").apply(old).remove()  # free for another policy
        gone = weakref.ref(old)
        del old
        gc.collect()
        assert gone() is None
    with tf32lab.emulate("a100"):
        assert _same(got, _by_hand(model, x, "high", "highest"))


def test_a_module_added_after_apply_gets_its_level_however_it_is_called():
    model, h = _model(), torch.randn(16, 48)
    with Policy("high", [("v_head*", "highest")]).applied(model):
        model.extra = torch.nn.Linear(48, 4)  # a new module, called directly before the model ever runs again
        assert _maths(lambda: model.extra(h)) == {"tf32-rna": 1}
        model.v_head.insert(0, torch.nn.Linear(48, 48))  # bypasses PyTorch's registration hooks
        model.v_head.append(torch.nn.Tanh())
        assert _maths(lambda: model(torch.randn(16, 32))) == {"tf32-rna": 3, "ieee": 3}
        assert _maths(lambda: model.v_head[0](h)) == {"ieee": 1}
        del model.v_head[0]  # taken out again: the rest as before
        assert _maths(lambda: model(torch.randn(16, 32))) == {"tf32-rna": 3, "ieee": 2}


def test_a_module_put_in_where_no_registration_hook_fires_runs_at_its_level_when_called_directly():
    # ModuleList.insert and Sequential.insert write _modules themselves, and an empty container assigned after
    # apply() was not in the tree the policy matched: each new module, called before the model runs again, ran at
    # the caller's level while explain() gave it the policy's
    model, h = _model(), torch.randn(16, 48)
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(48, 48)])
    policy = Policy("highest", [("pi", "high")])
    with policy.applied(model), tf32lab.precision("high"):
        model.blocks.insert(0, torch.nn.Linear(48, 48))
        assert _maths(lambda: model.blocks[0](h)) == {"ieee": 1}
        model.v_head.insert(0, torch.nn.Linear(48, 48))
        assert _maths(lambda: model.v_head[0](h)) == {"ieee": 1}
        model.new = torch.nn.Module()
        model.new.extra = torch.nn.Linear(48, 4)
        assert _maths(lambda: model.new.extra(h)) == {"ieee": 1}
        del model.blocks[0]  # replaces the list's _modules wholesale: later inserts still count
        model.blocks.insert(1, torch.nn.Linear(48, 48))
        assert _maths(lambda: model.blocks[1](h)) == {"ieee": 1}
        levels = {a.name: a.level for a in policy.explain(model)}
        assert levels["blocks.1"] == levels["v_head.0"] == levels["new.extra"] == "highest"
        spare = torch.nn.Module()
        model.spare = spare
        spare.inner = torch.nn.Linear(4, 4)
        del model.spare  # put in and taken out before the model ran: not the policy's
        assert tf32lab.control.policy.applied_to(spare) is None
        assert tf32lab.control.policy.applied_to(model.new.extra) is policy
    assert _untouched(model) and _untouched(spare)
    assert tf32lab.control.policy.applied_to(model) is None
    assert _maths(lambda: model.new.extra(h)) == {"ieee": 1}  # removed: the caller's level (highest) again
    with tf32lab.precision("high"):
        assert _maths(lambda: model.blocks[1](h)) == {"tf32-rna": 1}


def test_a_module_moved_into_a_model_under_another_policy_is_a_clear_error():
    a, b, x = _model(1), _model(2), torch.randn(16, 32)
    with Policy("high").applied(a), Policy("highest").applied(b):
        b.v_head = a.v_head  # one module, two policies: which level would it run at?
        with pytest.raises(Tf32LabError, match=r"module 'v_head' of ActorCritic is also in ActorCritic, which has "
                                               "another policy applied"):
            b(x)
        assert tf32lab.control.scope.live_scopes() == 0


class _Checkpointed(torch.nn.Module):
    """Modules at two levels inside one checkpointed region: the node that unpacks first is the last one's."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48))
        self.v_head = torch.nn.Sequential(torch.nn.Linear(48, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24))
        self.out = torch.nn.Linear(24, 3)
        self.how = how

    def part(self, x):
        return self.out(torch.tanh(self.v_head(self.body(x))))

    def forward(self, x):
        if self.how == "plain":
            return self.part(x)
        return torch.utils.checkpoint.checkpoint(self.part, x, use_reentrant=self.how == "reentrant")


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("default,head", [("high", "highest"), ("highest", "high")])
def test_checkpoint_recomputes_each_module_at_its_own_level(how, default, head):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))

    def grads(model):
        with tf32lab.emulate("a100"), Policy(default, [("v_head", head)]).applied(model):
            model(x.requires_grad_(how == "reentrant")).square().sum().backward()
        return [p.grad for p in model.parameters()]

    for got, want in zip(grads(_Checkpointed(how)), grads(_Checkpointed("plain"))):
        assert torch.equal(got, want)


def test_applied_to_says_whether_a_model_or_a_part_of_it_has_a_policy():
    model = _model()
    assert tf32lab.control.policy.applied_to(model) is None
    policy = Policy("high")
    with policy.applied(model.v_head):
        assert tf32lab.control.policy.applied_to(model) is policy  # a part of it: check would measure the policy
        assert tf32lab.control.policy.applied_to(model.v_head[0]) is policy
        assert tf32lab.control.policy.applied_to(model.body) is None
    assert tf32lab.control.policy.applied_to(model) is None
    with pytest.raises(Tf32LabError, match=r"torch\.nn\.Module, not str"):
        tf32lab.control.policy.applied_to("model")


# -- global state --------------------------------------------------------------------------------------------
class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


class _Raising(torch.nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.lin = where, torch.nn.Linear(8, 8)

    def forward(self, x):
        if self.where == "forward":
            raise RuntimeError("boom in forward")
        return _Boom.apply(self.lin(x))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_flags_are_identical_after_an_exception_inside_a_pinned_module(where):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Raising(where))
    before = flags.snapshot()
    with Policy("high", [("1", "highest")]).applied(model):
        with pytest.raises(RuntimeError, match=f"boom in {where}"):
            model(torch.randn(2, 8)).sum().backward()
        assert tf32lab.get_float32_matmul_precision() == "highest"
        assert torch._C._len_torch_dispatch_stack() == 0
    assert flags.snapshot() == before
    assert tf32lab.control.scope.live_scopes() == 0


class _Stop(BaseException):
    """Not an Exception: PyTorch's always_call forward hooks do not run for it."""


class _Interrupted(torch.nn.Module):
    def __init__(self, error: type) -> None:
        super().__init__()
        self.error, self.lin = error, torch.nn.Linear(8, 8)

    def forward(self, x):
        self.lin(x)
        raise self.error()


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, _Stop])
def test_a_base_exception_inside_a_pinned_module_leaves_level_and_scopes_as_before(error):
    # Ctrl-C inside a pinned module, called through its parent and directly
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(_Interrupted(error)))
    before = flags.snapshot()
    with Policy("medium", [("1", "high"), ("1.0", "highest")]).applied(model):
        for call in (model, model[1], model[1][0]):
            with pytest.raises(error) as info:  # its traceback (and frames) alive while the level is read
                call(torch.randn(2, 8))
            assert info.tb is not None
            assert tf32lab.control.scope.live_scopes() == 0 and flags.snapshot() == before
            assert tf32lab.get_float32_matmul_precision() == "highest"
            assert torch._C._len_torch_dispatch_stack() == 0 and tf32lab.control.pinning._OPEN.frames == []
        assert _maths(lambda: model[0](torch.randn(2, 8))) == {"tf32-rna": 1}  # the policy still holds


def test_apply_and_remove_leave_flags_and_modules_as_they_were():
    model = _model()
    before = flags.snapshot()
    handle = Policy("medium", [("v_head", "highest")]).apply(model)
    assert flags.snapshot() == before
    handle.remove()
    handle.remove()  # again: nothing
    assert flags.snapshot() == before
    assert "removed" in repr(handle)
    assert _untouched(model)


def test_a_copy_or_a_pickle_of_a_model_under_a_policy_is_a_plain_model_and_signatures_stay():
    model, x = _model(), torch.randn(16, 32)
    with Policy("high", [("v_head", "highest")]).applied(model):
        assert str(inspect.signature(model.v_head[0].forward)) == "(input: torch.Tensor) -> torch.Tensor"
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert tf32lab.control.policy.applied_to(twin) is None
            assert _maths(lambda t=twin: t(x)) == {"ieee": 5}  # the caller's level, not the policy's
            assert twin.v_head.forward.__self__ is twin.v_head  # its own forward, not the original's


def test_a_second_policy_on_the_same_model_is_refused():
    model = _model()
    with Policy("high").applied(model), pytest.raises(Tf32LabError, match="already has a policy applied"):
        Policy("highest").apply(model.v_head)
    Policy("highest").apply(model).remove()  # free again


# -- as data ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_save_and_load_round_trip(tmp_path, suffix):
    policy = Policy("high", [("encoder.layer.*.attention.*", "highest"), ('odd "name"', "medium")])
    path = policy.save(tmp_path / f"policy{suffix}")
    assert Policy.load(path) == policy
    assert Policy.load(Policy(rules=[("v", "highest")]).save(tmp_path / f"p2{suffix}")).default is None


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_names_outside_the_basic_plane_and_control_characters_round_trip(tmp_path, suffix):
    # JSON writes U+1F600 as a surrogate pair escape, which TOML refuses: the TOML writer has its own escapes
    policy = Policy("high", [("enc\U0001F600der.*", "highest"), ('tab\there "q" back\\slash\x7f\x00', "medium")])
    assert Policy.load(policy.save(tmp_path / f"p{suffix}")) == policy


@hypothesis.settings(max_examples=60, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(pattern=hypothesis.strategies.text(max_size=12))  # every code point but lone surrogates
def test_any_pattern_round_trips_through_toml(tmp_path, pattern):
    policy = Policy(None, [(pattern, "high")])
    assert Policy.load(policy.save(tmp_path / "p.toml")) == policy


def test_a_hand_written_toml_file_with_an_emoji_comment_loads_and_a_lone_surrogate_is_refused(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('# tuned for \U0001F600\nschema_version = 1\n[[rules]]\npattern = "v_\U0001F600"\nlevel = "high"\n',
                    encoding="utf-8")
    assert Policy.load(path).rules == (Rule("v_\U0001F600", "high"),)
    with pytest.raises(Tf32LabError, match=r"lone surrogate .* save the policy as JSON"):
        Policy(None, [("bad\udc80", "high")]).save(tmp_path / "q.toml")
    assert not (tmp_path / "q.toml").exists()
    assert Policy.load(Policy(None, [("bad\udc80", "high")]).save(tmp_path / "q.json")).rules[0].pattern == "bad\udc80"


DEEP = {
    "p.json": "[" * 100_000 + "]" * 100_000,
    "q.json": '{"schema_version": 1, "rules": [' + "[" * 900 + "]" * 900 + "]}",
    "p.toml": "a = " + "[" * 100_000 + "]" * 100_000,
    "q.toml": "a = " + "{b = " * 5_000 + "1" + "}" * 5_000,
    "r.toml": "x" + ".x" * 100_000 + " = 1",  # tomllib: time and memory grow with the square of the depth
}


@pytest.mark.parametrize("name", sorted(DEEP))
def test_a_file_nested_very_deep_is_one_line(tmp_path, name):
    path = tmp_path / name
    path.write_text(DEEP[name])
    with pytest.raises(Tf32LabError) as info:
        Policy.load(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300 and name in message


def test_policy_show_on_a_file_nested_very_deep_exits_2_with_one_line(tmp_path):
    (tmp_path / "p.json").write_text("[" * 100_000 + "]" * 100_000)
    done = cli_runner.run("policy", "show", str(tmp_path / "p.json"), module="tf32lab.cli", timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "nested too deeply" in done.stderr


def test_policy_show_of_a_policy_without_rules_says_so_in_one_line(tmp_path):
    # an empty table of rules said nothing
    (tmp_path / "p.json").write_text(Policy("high", []).to_json())
    done = cli_runner.run("policy", "show", str(tmp_path / "p.json"), module="tf32lab.cli", timeout=120)
    assert done.returncode == 0, done.stderr
    assert " ".join(done.stdout.split()) == f"{tmp_path / 'p.json'}: high for every module (no rules)"  # no table


def test_the_json_form_is_plain_and_versioned():
    data = json.loads(Policy("high", [("v_head", "Highest")]).to_json())
    assert data == {"schema_version": 1, "default": "high", "rules": [{"pattern": "v_head", "level": "highest"}]}
    assert Rule("v_head", "highest") in Policy.from_dict(data).rules


BAD = {
    "not json": ("{", "not JSON"),
    "a list": ("[]", "expected an object"),
    "unknown key": ('{"schema_version": 1, "rulez": []}', "unknown key 'rulez'"),
    "no version": ('{"default": "high"}', "missing 'schema_version'"),
    "future version": ('{"schema_version": 3}', "schema_version 3 is not supported"),
    "bad default": ('{"schema_version": 1, "default": "fast"}', "policy default: unknown level 'fast'"),
    "bad level": ('{"schema_version": 1, "rules": [{"pattern": "a", "level": "tf32"}]}',
                  "rule 1 ('a'): unknown level 'tf32'"),
    "rules not a list": ('{"schema_version": 1, "rules": "a"}', "must be a list"),
    "rule not a pair": ('{"schema_version": 1, "rules": [["a"]]}', "rule 1: ['a'] is not a (pattern, level) pair"),
    "rule key": ('{"schema_version": 1, "rules": [{"pattern": "a", "levle": "high"}]}', "unknown key 'levle'"),
    "rule missing": ('{"schema_version": 1, "rules": [{"pattern": "a"}]}', "rule 1: missing 'level'"),
    "pattern type": ('{"schema_version": 1, "rules": [[3, "high"]]}', "the pattern 3 is not a string"),
    # a file edited by hand: Python's JSON reader kept the last of two equal keys without a word (ran at `high`)
    "twice": ('{"schema_version": 1, "default": "highest", "default": "high"}', "the key 'default' appears twice"),
    "twice in a rule": ('{"schema_version": 1, "rules": [{"pattern": "a", "level": "highest", "level": "medium"}]}',
                        "the key 'level' appears twice in one object; keep one"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_bad_policy_file_gets_one_line_naming_the_problem(tmp_path, case):
    text, message = BAD[case]
    path = tmp_path / "policy.json"
    path.write_text(text)
    with pytest.raises(Tf32LabError) as info:
        Policy.load(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert "policy.json" in str(info.value)


def test_a_bad_toml_file_and_a_missing_file(tmp_path):
    (tmp_path / "p.toml").write_text("schema_version = ")
    with pytest.raises(Tf32LabError, match="not TOML"):
        Policy.load(tmp_path / "p.toml")
    with pytest.raises(Tf32LabError, match="cannot read it"):
        Policy.load(tmp_path / "none.json")
    # an empty path is Path("."), the working folder: the error names what was given, not "."
    with pytest.raises(Tf32LabError, match=re.escape("policy file '': no path given; accepted: a JSON or TOML file")):
        Policy.load("")


@pytest.mark.parametrize("rules,message", [
    ([("*", "high"), ("v_head", "highest")], "policy rule 2 ('v_head') never applies: rule 1 ('*') comes first"),
    ([("v_head*", "high"), ("v_head.*", "highest")], "rule 2 ('v_head.*') never applies: rule 1 ('v_head*')"),
    ([("pi", "high"), ("body.?", "medium"), ("body.[02]", "highest")], "rule 3 ('body.[02]') never applies: rule 2"),
    ([("v_head", "high"), ("v_head", "highest")], "rule 2 ('v_head') never applies: rule 1 ('v_head')"),
])
def test_a_rule_an_earlier_rule_shadows_is_an_error(rules, message):
    # the first match wins, so the later rule could never give a module its level: a mistake, not a preference
    with pytest.raises(Tf32LabError, match=re.escape(message)) as info:
        Policy("high", rules)
    assert "put the narrower rule first" in str(info.value) and "\n" not in str(info.value)
    if rules[0][0] != rules[-1][0]:
        Policy("high", rules[::-1])  # the narrower rule first: both apply somewhere


def test_a_policy_of_thousands_of_rules_builds_and_still_finds_a_shadowed_rule():
    # the pairwise check took minutes (2,000 rules: over four minutes in `policy show`)
    Policy("high", [(f"encoder.layer.{i}.attention.self.query", "highest") for i in range(3000)])  # as tune writes
    wild = [(f"encoder.layer.{i}.*", "highest") for i in range(1500)] + [(f"*.head{i}", "medium") for i in range(1500)]
    classes = [(f"blk[{chr(65 + i % 26)}-z]{i}.[0-9]*[!x]", "high") for i in range(1000)]
    Policy("high", wild + classes)
    with pytest.raises(Tf32LabError, match=re.escape(
            "rule 4000 ('encoder.layer.7.attention.self') never applies: rule 8 ('encoder.layer.7.*')")):
        Policy("high", wild + classes[:-1] + [("encoder.layer.7.attention.self", "high")])
    with pytest.raises(Tf32LabError, match=re.escape("rule 3001 ('*.head1400') never applies: rule 2901")):
        Policy("high", [*wild, ("*.head1400", "high")])  # past the bound of exact tests: a duplicate still is
    with pytest.raises(Tf32LabError, match=re.escape("rule 1001 ('blkQ7.[0-9]*[!x]') never applies: rule 8")):
        Policy("high", [*classes, ("blkQ7.[0-9]*[!x]", "high")])  # an exact test among a thousand rules


def test_overlapping_rules_that_each_match_something_of_their_own_are_fine():
    Policy("high", [("v_head.2", "medium"), ("v_head*", "highest"), ("*.0", "medium"), ("body.*", "high")])
    Policy("high", [("[*]", "medium"), ("*", "highest")])  # a literal star first, then everything else


def test_a_pattern_that_matches_no_module_is_an_error_or_with_strict_false_a_warning():
    model = _model()
    policy = Policy("high", [("v_haed", "highest")])
    with pytest.raises(Tf32LabError, match=r"rule 1 'v_haed' matches no module of ActorCritic \(its modules: body"):
        policy.apply(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy.apply(model, strict=False).remove()
    assert any("v_haed" in str(w.message) for w in caught)
    assert policy.unmatched(model) == [Rule("v_haed", "highest")]


def test_the_refusals_name_a_torchscript_model_by_the_class_it_was_scripted_from():
    # every scripted module is a RecursiveScriptModule, which names none: the refusals name the scripted class
    def scripted():
        return torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4)))

    model = scripted()
    with pytest.raises(Tf32LabError, match=r"rule 1 'nope' matches no module of Sequential \(its modules: 0\)"):
        Policy("high", [("nope", "highest")]).apply(model)
    with Policy(rules=[]).applied(model):
        with pytest.raises(Tf32LabError, match=r"module 'Sequential' already has a policy applied"):
            Policy(rules=[]).apply(model)
        outer = torch.nn.Sequential()
        with Policy(rules=[]).applied(outer):
            outer.add_module("s", model)  # one module, two policies
            with pytest.raises(Tf32LabError, match=r"module 's' of Sequential is also in Sequential, which has "):
                outer(torch.randn(2, 4))
    with pytest.raises(Tf32LabError, match=r"module 'Sequential' is TorchScript"):
        Policy("highest").apply(scripted())


def test_a_rule_naming_a_module_by_its_other_name_matches_it():
    model, h = _model(), torch.randn(16, 48)
    model.critic = model.v_head  # one module, two names: named_modules() gives only the first
    policy = Policy("high", [("critic", "highest")])
    assert policy.unmatched(model) == [] and policy.unmatched_message(model) is None
    got = {a.name: (a.level, a.source) for a in policy.explain(model)}
    assert got["v_head"] == ("highest", "rule 1 'critic' (it is also named 'critic')")
    assert got["v_head.2"] == ("highest", "inherited from 'v_head'")
    with policy.applied(model):
        assert _maths(lambda: model.critic(h)) == {"ieee": 2}
    got = {a.name: a.level for a in Policy("high", [("critic.2", "highest")]).explain(model)}
    assert (got["v_head"], got["v_head.2"]) == ("high", "highest")
    model.body[0].loop = model  # a module inside itself: named once, not walked into forever
    assert Policy("high", [("critic.*", "medium")]).unmatched(model) == []


def test_a_torchscript_module_that_needs_hooks_is_a_clear_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.jit.script(torch.nn.Linear(4, 4)))
    with pytest.raises(Tf32LabError, match=r"module '1' is TorchScript, which takes no hooks"):
        Policy("high", [("1", "highest")]).apply(model)
    assert not any(m._forward_pre_hooks for m in model.modules() if not isinstance(m, torch.jit.ScriptModule))
    Policy("high", [("1", "high")]).apply(model).remove()  # at its parent's level it needs no hook: fine


def test_every_autograd_node_of_a_policy_forward_gets_its_level():
    # Backward levels come from tags on the nodes the forward made. The walk that tags them once skipped nodes whose
    # Python wrapper had the id of a freed one (on an H100 the default level's whole backward then ran at the
    # caller's level); every node reachable from the outputs must carry a level.
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                              for _ in range(6)])
            self.heads = torch.nn.ModuleList(torch.nn.Linear(16, 2) for _ in range(4))
            self.v_head = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def forward(self, x):
            h = self.body(x)
            return [head(h) for head in self.heads] + [self.v_head(h)]

    for seed in range(5):
        torch.manual_seed(seed)
        model = Branchy()
        with tf32lab.Policy("high", [("v_head", "highest")]).applied(model):
            outputs = model(torch.randn(4, 16))
        todo, seen, untagged = [o.grad_fn for o in outputs], {}, []
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            if node._sequence_nr() < 2**63 and "tf32lab.level" not in node.metadata:  # AccumulateGrad has none
                untagged.append(type(node).__name__)
            todo.extend(fn for fn, _ in node.next_functions)
        assert untagged == [] and len(seen) > 40


def test_a_module_put_in_with_the_id_of_one_taken_out_gets_its_level():
    # A freed module's entry stayed in the policy's table of wrapped modules; a new module that CPython put at the
    # same address (the same id) was taken for it and left unwrapped: it ran at the caller's level. Seen as a flaky
    # failure of the test above on torch 2.4.1; here every insert reuses the address.
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])
    wrong, seen, reused = 0, set(), 0
    with Policy("highest").applied(model):
        for _ in range(50):
            module = torch.nn.Linear(8, 8)
            reused += id(module) in seen
            seen.add(id(module))
            model.blocks.insert(0, module)
            with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
                model.blocks[0](torch.randn(2, 8))
            wrong += any(math != "ieee" for _, math in emu.coverage)
            del model.blocks[0], module
    assert reused > 0  # (the case this is about happened)
    assert wrong == 0
