"""A policy that pins one module's cuDNN conv math (``conv="ieee"|"tf32"``): which modules get which, that their
forward and backward really run at it (emulated: the convolutions' results; natively: cuDNN's flag at each
convolution), files old and new, bad values, and the flags after every exit."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cli_runner
import tf32lab
from test_conv_math import conv_training_workload
from tf32lab import Policy
from tf32lab.control import flags, scope
from tf32lab.control.policy import Rule
from tf32lab.control.scope import conv_math
from tf32lab.errors import Tf32LabError
from tf32lab.numbers.formats import round_tf32
from tf32lab.report import schema

CONV_OPS = ("aten::convolution", "aten::convolution_backward")


def _convs(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Tanh(), torch.nn.Conv2d(8, 4, 3))


def _input() -> torch.Tensor:
    # an offset of 8 makes TF32's 10-bit operands visibly worse than float32's (rounding errors do not cancel)
    return 8.0 + torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(1))


# a tf32 model whose last convolution is pinned to IEEE; the level is the model's own throughout
PINNED = Policy("highest", [("2", None, "ieee")], conv="tf32")


def _step(model: torch.nn.Sequential, x: torch.Tensor):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    h = model[1](model[0](x))
    y = model[2](h)
    (y * y).sum().backward()
    return h.detach(), y.detach(), [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _by_hand(model: torch.nn.Sequential, x: torch.Tensor):
    """The same step with each part run, forward and backward, inside its own conv_math block."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with conv_math("tf32"):
        h = model[1](model[0](x))
    cut = h.detach().requires_grad_()
    with conv_math("ieee"):
        y = model[2](cut)
        (y * y).sum().backward()
    with conv_math("tf32"):
        h.backward(cut.grad)
    return h.detach(), y.detach(), [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _equal(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(map(torch.equal, a[2], b[2]))


class _CudnnFlagAtConvs(TorchDispatchMode):
    """Records cuDNN's conv cell as each convolution (forward or backward) meets it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name in CONV_OPS:
            weight = args[1] if name == "aten::convolution" else args[2]
            self.seen.append((name, flags.read_cell("cuda.conv"), tuple(weight.shape)))
        return func(*args, **(kwargs or {}))


# -- which conv math each module gets -------------------------------------------------------------------------
def test_explain_gives_each_modules_conv_math_and_where_it_came_from():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3)),
                                torch.nn.Conv2d(4, 4, 3))
    policy = Policy("high", [("1", None, "ieee"), ("2", "highest")])
    got = [(a.name, a.level, a.source, a.conv, a.conv_source) for a in policy.explain(model)]
    assert got == [
        ("", "high", "default", None, "inherited from the caller"),
        ("0", "high", "inherited from the model", None, "inherited from the model"),
        ("1", "high", "inherited from the model", "ieee", "rule 1 '1'"),
        ("1.0", "high", "inherited from '1'", "ieee", "inherited from '1'"),
        ("2", "highest", "rule 2 '2'", None, "inherited from the model"),
    ]
    assert policy.hooked(model) == ["", "1", "2"]  # where the level or the conv math changes
    with_default = Policy(rules=[("1", "highest", "tf32")], conv="ieee")
    assert [(a.name, a.conv, a.conv_source) for a in with_default.explain(model)][:3] == [
        ("", "ieee", "default"), ("0", "ieee", "inherited from the model"), ("1", "tf32", "rule 1 '1'")]
    assert with_default.hooked(model) == ["", "1"]  # the model (its conv math) and the rule's module
    # a policy without conv is what it was: its rules, repr and hooked modules
    plain = Policy("high", [("2", "highest")])
    assert plain.rules == (Rule("2", "highest"),) and repr(plain) == \
        "Policy(default='high', rules=(Rule(pattern='2', level='highest'),))"
    assert plain.hooked(model) == ["", "2"] and not plain.pins_conv


def test_bad_conv_values_are_one_line_naming_the_value_and_the_accepted_ones():
    cases = [
        (lambda: Policy("high", [("0", "high", "fast")]),
         "policy rule 1 ('0'): unknown conv math 'fast'; accepted: 'tf32', 'ieee'"),
        (lambda: Policy("high", conv="TF32x"), "policy conv: unknown conv math 'TF32x'; accepted: 'tf32', 'ieee'"),
        (lambda: Policy("high", [("0", None)]), "policy rule 1 ('0'): names neither a level nor a conv math"),
        (lambda: Policy("high", [("0", None, None)]), "names neither a level nor a conv math"),
        (lambda: Policy("high", [("0", "high", "ieee", "x")]), "is not a (pattern, level) pair or a (pattern, level, "
                                                               "conv) triple"),
        (lambda: Policy("high", [{"pattern": "0", "conv": 3}]), "unknown conv math 3"),
    ]
    for make, message in cases:
        with pytest.raises(Tf32LabError) as info:
            make()
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    # as typed in a file: case and blanks do not matter, as for levels
    assert Policy("high", [("0", None, " IEEE ")], conv="Tf32").rules[0].conv == "ieee"


# -- forward and backward run at it -----------------------------------------------------------------------------
def test_emulated_a_pinned_module_computes_ieee_convolutions_and_the_rest_tf32():
    model, x = _convs(), _input()
    with PINNED.applied(model), tf32lab.emulate("a100") as emu:
        applied = _step(model, x)
    with tf32lab.precision("highest"), tf32lab.emulate("a100"):
        by_hand = _by_hand(model, x)
    assert _equal(applied, by_hand)  # forward and every gradient, bit for bit
    # and against the convolutions themselves: TF32-rounded operands outside the pinned module, float32 in it
    h, y = applied[0], applied[1]
    first, last = model[0], model[2]
    assert torch.equal(h, torch.tanh(F.conv2d(round_tf32(x), round_tf32(first.weight), first.bias)))
    assert not torch.equal(h, torch.tanh(first(x)))
    with torch.no_grad():
        assert torch.equal(y, last(h))  # plain float32, on this CPU, as an IEEE convolution
        assert not torch.equal(y, F.conv2d(round_tf32(h), round_tf32(last.weight), last.bias))
    assert emu.coverage == {("aten::convolution", "tf32-rna"): 1, ("aten::convolution", "ieee"): 1,
                            ("aten::convolution_backward", "ieee"): 1, ("aten::convolution_backward", "tf32-rna"): 1}
    # the other way round: a tf32 module inside an IEEE model
    flipped = Policy("highest", [("0", None, "tf32")], conv="ieee")
    with flipped.applied(model), tf32lab.emulate("a100") as emu:
        _step(model, x)
    assert emu.coverage == {("aten::convolution", "tf32-rna"): 1, ("aten::convolution", "ieee"): 1,
                            ("aten::convolution_backward", "ieee"): 1, ("aten::convolution_backward", "tf32-rna"): 1}
    assert flags.read_cells()["cuda.conv"] == "tf32"  # PyTorch's default, as before


def test_natively_each_convolution_meets_its_modules_conv_flag_forward_and_backward():
    model, x = _convs(), _input()
    recorder = _CudnnFlagAtConvs()
    with conv_math("tf32"), PINNED.applied(model), recorder:
        _step(model, x)
    first, last = tuple(model[0].weight.shape), tuple(model[2].weight.shape)
    assert recorder.seen == [("aten::convolution", "tf32", first), ("aten::convolution", "ieee", last),
                             ("aten::convolution_backward", "ieee", last),
                             ("aten::convolution_backward", "tf32", first)]
    # the backward of a pinned module runs at its math wherever it runs: here after the policy came off
    recorder.seen.clear()
    with PINNED.applied(model):
        y = model(x.requires_grad_())
    with recorder:
        y.sum().backward()
    assert [(op, cell) for op, cell, _ in recorder.seen] == [("aten::convolution_backward", "ieee"),
                                                            ("aten::convolution_backward", "tf32")]
    # a model that reads PyTorch's boolean inside a pinned module sees the module's math (both cuDNN cells agree)
    class Reads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 2, 3)

        def forward(self, t):
            assert torch.backends.cudnn.allow_tf32 is False
            return self.conv(t)

    reads = Reads()
    with Policy(rules=[("", None, "ieee")]).applied(reads):
        reads(x)


def test_a_pinned_module_at_another_level_keeps_both_and_nested_pins_nest():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Sequential(
        torch.nn.Conv2d(4, 4, 3), torch.nn.Linear(6, 6), torch.nn.Conv2d(4, 4, 1)))
    policy = Policy("high", [("1.0", "highest", "tf32"), ("1", None, "ieee")])
    recorder = _CudnnFlagAtConvs()
    with conv_math("tf32"), policy.applied(model), tf32lab.emulate("a100") as emu, recorder:
        model(_input()).sum().backward()
    # 0: the caller's tf32; 1.0: tf32 at highest inside the ieee block; 1.2: the block's ieee; and the linear
    # inside the block at the model's level, high: TF32 matmuls
    assert [(op, cell, shape[:2]) for op, cell, shape in recorder.seen] == [
        ("aten::convolution", "tf32", (4, 3)), ("aten::convolution", "tf32", (4, 4)),
        ("aten::convolution", "ieee", (4, 4)), ("aten::convolution_backward", "ieee", (4, 4)),
        ("aten::convolution_backward", "tf32", (4, 4)), ("aten::convolution_backward", "tf32", (4, 3))]
    assert emu.coverage[("aten::convolution", "tf32-rna")] == 2 and emu.coverage[("aten::convolution", "ieee")] == 1
    assert all(math == "tf32-rna" for op, math in emu.coverage if not op.startswith("aten::conv"))
    assert flags.read_cells()["cuda.conv"] == "tf32"


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputes_each_module_at_its_own_conv_math(reentrant):
    import torch.utils.checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _convs()

        def forward(self, t):
            return torch.utils.checkpoint.checkpoint(self.inner, t, use_reentrant=reentrant)

    model = Checkpointed()
    recorder = _CudnnFlagAtConvs()
    with Policy("highest", [("inner.2", None, "ieee")], conv="tf32").applied(model), recorder:
        model(_input().requires_grad_()).sum().backward()
    cells = [(op[len("aten::"):], cell, shape[0]) for op, cell, shape in recorder.seen]
    # the forward, then in the backward the region recomputed (a non-reentrant checkpoint stops once it has what
    # the backward needs) and its gradients: each convolution at its own module's math
    assert all(cell == ("ieee" if out == 4 else "tf32") for _, cell, out in cells)
    assert len([c for c in cells if c[0] == "convolution"]) == (4 if reentrant else 3)
    assert [c for c in cells if c[0] == "convolution_backward"] == [("convolution_backward", "ieee", 4),
                                                                  ("convolution_backward", "tf32", 8)]


def test_a_pinned_conv_math_leaves_every_flag_as_it_was_on_every_exit():
    class Boom(torch.nn.Module):
        def __init__(self, error: BaseException, where: str) -> None:
            super().__init__()
            self.conv, self.error, self.where = torch.nn.Conv2d(3, 2, 3), error, where

        def forward(self, t):
            out = self.conv(t)
            if self.where == "forward":
                raise self.error
            out.register_hook(self._raise)
            return out

        def _raise(self, grad):
            raise self.error

    before = flags.snapshot()
    for error in (RuntimeError("boom"), KeyboardInterrupt()):
        for where in ("forward", "backward"):
            model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), Boom(error, where))
            with Policy("high", [("1", None, "ieee")], conv="tf32").applied(model), \
                    pytest.raises(type(error)):
                model(_input().requires_grad_()).sum().backward()
            assert flags.snapshot() == before, (error, where, before.diff(flags.snapshot()))
            assert scope._CONV_OPEN == [] and tf32lab.get_float32_matmul_precision() == "highest"
    # and with a conv block of the caller's open around it: that block's math is back afterwards
    with conv_math("ieee"):
        model = torch.nn.Sequential(Boom(RuntimeError("boom"), "forward"))
        with Policy(rules=[("0", None, "tf32")]).applied(model), pytest.raises(RuntimeError):
            model(_input())
        assert flags.read_cells()["cuda.conv"] == "ieee"
    assert flags.snapshot() == before


def test_two_threads_in_modules_pinned_to_two_conv_maths_give_the_process_its_flag_back():
    # cuDNN's flag is the process's: while both run, the newest open block's math is in force for both (the
    # documented limit); what must hold is that, closing in any order, nothing is left behind
    import threading

    before = flags.snapshot()
    errors: list[BaseException] = []

    def run(conv: str) -> None:
        try:
            model = _convs()
            with Policy(rules=[("2", None, conv)]).applied(model):
                for _ in range(20):
                    model(_input().requires_grad_()).sum().backward()
        except BaseException as exc:  # reported below: an assertion in a thread would pass unseen
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(conv,)) for conv in ("ieee", "tf32", "ieee")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and flags.snapshot() == before and scope._CONV_OPEN == []


# -- files -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_policy_with_conv_maths_round_trips_and_one_without_is_written_as_version_1(tmp_path, suffix):
    policy = Policy("high", [("stem", None, "ieee"), ("head.*", "highest", "tf32"), ("v_head", "highest")],
                    conv="tf32")
    path = policy.save(tmp_path / f"policy{suffix}")
    assert Policy.load(path) == policy
    plain = Policy("high", [("v_head", "highest")])
    assert Policy.load(plain.save(tmp_path / f"plain{suffix}")) == plain
    if suffix == ".json":
        assert json.loads(path.read_text())["schema_version"] == 2
        assert json.loads(plain.to_json()) == {"schema_version": 1, "default": "high",
                                               "rules": [{"pattern": "v_head", "level": "highest"}]}
    else:
        assert path.read_text().startswith("schema_version = 2\n")
        assert (tmp_path / "plain.toml").read_text().startswith("schema_version = 1\n")


def test_files_of_schema_version_1_load_unchanged(tmp_path):
    (tmp_path / "old.json").write_text('{"schema_version": 1, "default": "high", "rules": '
                                       '[{"pattern": "v_head", "level": "highest"}]}')
    (tmp_path / "old.toml").write_text('schema_version = 1\ndefault = "medium"\n\n[[rules]]\npattern = "body.*"\n'
                                       'level = "high"\n')
    old_json, old_toml = Policy.load(tmp_path / "old.json"), Policy.load(tmp_path / "old.toml")
    assert old_json == Policy("high", [("v_head", "highest")]) and old_json.conv is None
    assert old_toml == Policy("medium", [("body.*", "high")]) and old_toml.rules[0].conv is None
    assert old_json.to_dict()["schema_version"] == 1  # and written back the same


@pytest.mark.parametrize("text,message", [
    ('{"schema_version": 1, "conv": "ieee"}', "'conv' needs schema_version 2"),
    ('{"schema_version": 1, "rules": [{"pattern": "a", "level": "high", "conv": "ieee"}]}',
     "'conv' needs schema_version 2"),
    ('{"schema_version": 2, "conv": "fast"}', "policy conv: unknown conv math 'fast'; accepted: 'tf32', 'ieee'"),
    ('{"schema_version": 2, "rules": [{"pattern": "a", "conv": "TF16"}]}',
     "policy rule 1 ('a'): unknown conv math 'TF16'; accepted: 'tf32', 'ieee'"),
    ('{"schema_version": 2, "rules": [{"pattern": "a", "level": null}]}', "names neither a level nor a conv math"),
    ('{"schema_version": 2, "rules": [{"pattern": "a"}]}', "rule 1: missing 'level' (or 'conv')"),
    ('{"schema_version": 3}', "schema_version 3 is not supported; accepted: 1, 2"),
])
def test_a_bad_conv_in_a_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "policy.json"
    path.write_text(text)
    with pytest.raises(Tf32LabError) as info:
        Policy.load(path)
    assert message in str(info.value) and "\n" not in str(info.value) and "policy.json" in str(info.value)


# -- measured -----------------------------------------------------------------------------------------------------
def test_check_measures_a_policy_that_pins_convolutions_to_ieee():
    workload = tf32lab.Workload(_convs(), _input(), name="convs")
    report = tf32lab.check(workload, introduced="all", levels=("highest",), target="a100", conv="tf32", speed=False,
                           policy=Policy("highest", conv="ieee"))
    tf32, pinned = report.level("highest"), report.level("policy")
    assert pinned.outputs[0].normwise < tf32.outputs[0].normwise / 100  # TF32 convolutions against IEEE ones
    assert pinned.maths["conv"] == "ieee" and tf32.maths["conv"] == "tf32-rna"
    both = tf32lab.check(workload, introduced="all",
                         levels=("highest",), target="a100", conv="tf32", speed=False, policy=PINNED)
    mixed = both.level("policy")
    assert mixed.maths["conv"] == "mixed" and mixed.policy["rules"] == [{"pattern": "2", "level": None,
                                                                         "conv": "ieee"}]
    for measured in (report, both):
        jsonschema.validate(json.loads(measured.to_json()), schema())
    # a layer's introduced error is rerun at the conv math the policy gives it: the pinned one's at IEEE
    layers = {layer.name: layer for layer in mixed.layers}
    tf32_layers = {layer.name: layer for layer in both.level("highest").layers}
    assert layers["0"].introduced > 0 and layers["0"].diverged is None
    assert layers["0"].introduced == tf32_layers["0"].introduced  # the same TF32 convolution as at highest
    assert 0 < layers["2"].introduced < tf32_layers["2"].introduced / 100 and layers["2"].diverged is None
    assert layers["2"].accumulated < tf32_layers["2"].accumulated  # its own rounding no longer adds to its input's
    # the same layer alone at IEEE convolutions introduces what the pinned one does
    alone = tf32lab.check(workload, introduced="all", levels=("highest",), target="a100", conv="ieee", speed=False)
    assert {layer.name: layer for layer in alone.level("highest").layers}["2"].introduced == layers["2"].introduced


def test_a_pinned_layer_whose_calls_run_a_convolution_or_not_is_measured_whole():
    # one module, two calls: a product, then a convolution. The pinned rerun covers the convolution's call; the
    # product's (no cuDNN op: the same at any conv math) counts too, so the layer's worst is a plain IEEE check's
    class Dual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64))
            self.k = torch.nn.Parameter(torch.randn(4, 4, 3, 3))

        def forward(self, x, conv: bool):
            return F.conv2d(x, self.k, padding=1) if conv else x @ self.w

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.pre, self.d = torch.nn.Linear(64, 64), Dual()

        def forward(self, x):
            h = self.pre(x)
            return self.d(h, False), self.d(h.reshape(1, 4, 8, 8), True)

    workload = tf32lab.Workload(Model(), 8 + torch.randn(4, 64, generator=torch.Generator().manual_seed(1)))
    pinned = tf32lab.check(workload, introduced="all", levels=("high",), target="a100", conv="tf32", speed=False,
                           policy=Policy("high", [("d", None, "ieee")]))
    plain = tf32lab.check(workload, introduced="all", levels=("high",), target="a100", conv="ieee", speed=False)
    got = {layer.name: layer for layer in pinned.level("policy").layers}["d"]
    want = {layer.name: layer for layer in plain.level("high").layers}["d"]
    assert got.introduced == want.introduced and got.diverged is None


def test_only_the_pins_that_change_a_layer_are_rerun():
    # a pin to the check's own conv math changes nothing: no rerun; another math: the pinned layer, at its level
    from tf32lab.control.scope import conv_math
    from tf32lab.measure.check import PolicyRow, _pins, alike_levels

    model = _convs()
    target = tf32lab.know.targets.get("a100")
    alike = alike_levels(("highest", "high", "medium"), target)
    with conv_math("tf32"):
        same = PolicyRow.of(Policy("highest", [("2", None, "tf32")], conv="tf32"), model)
        other = PolicyRow.of(Policy("medium", [("2", "highest", "ieee")], conv="tf32"), model)
        assert _pins(same, target, alike) == {}
        assert _pins(other, target, alike) == {"2": ("highest", "ieee")}


def test_a_session_not_told_the_pinned_conv_math_says_so_instead_of_a_number():
    # check() tells its session every conv math the policy pins; a session made without them (as tune makes its
    # own) has no rerun there: the pinned layer's introduced error is NaN, with the reason (one clause: the report
    # tells it from a diverged call's reason joined after it)
    from tf32lab.control.scope import conv_math
    from tf32lab.measure.check import PolicyRow, Session, alike_levels

    workload = tf32lab.Workload(_convs(), _input(), name="convs")
    target = tf32lab.know.targets.get("a100")
    with conv_math("tf32"), Session(workload, ["highest"], target, {"default": 1e-3}, speed=False) as session:
        result = session.policy(PolicyRow.of(PINNED, workload.model), alike_levels(("highest",), target))
    layers = {layer.name: layer for layer in result.layers}
    assert layers["2"].introduced != layers["2"].introduced and layers["0"].introduced > 0
    assert layers["2"].diverged.startswith("the policy pins its conv math to 'ieee', at which its reruns did not run")
    assert "; " not in layers["2"].diverged


def test_the_training_check_trains_a_policy_that_pins_convolutions():
    workload = conv_training_workload()
    report = tf32lab.check_training(workload, levels=("highest",), target="a100", speed=False, conv="tf32",
                                    policy=Policy("highest", conv="ieee"))
    tf32, pinned = report.level("highest"), report.level("policy")
    assert pinned.maths["conv"] == "ieee" and tf32.maths["conv"] == "tf32-rna"
    assert pinned.gradients[0].normwise < tf32.gradients[0].normwise / 100  # the gradients' convolutions too


def test_check_decides_a_pinned_layer_by_the_convolutions_it_ran_not_by_its_class():
    class FunctionalConv(torch.nn.Module):  # a layer of its own: F.conv2d, not a torch.nn.Conv2d
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8, 3, 3) * 0.2)

        def forward(self, t):
            return F.conv2d(t, self.weight)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Tanh(), FunctionalConv(),
                                torch.nn.Linear(10, 10))
    workload = tf32lab.Workload(model, 8.0 + torch.randn(2, 3, 12, 12), name="convs")
    report = tf32lab.check(workload, levels=("highest",), target="a100", conv="tf32", speed=False,
                           policy=Policy("highest", [("2", None, "ieee"), ("3", None, "ieee")]))
    layers = {layer.name: layer for layer in report.level("policy").layers}
    tf32 = {layer.name: layer for layer in report.level("highest").layers}
    # ran IEEE convolutions, rerun so: far below the TF32 rerun's number
    assert 0 < layers["2"].introduced < tf32["2"].introduced / 100 and layers["2"].diverged is None
    # a pinned layer that runs no convolution keeps its introduced error (a conv math does not change a Linear)
    assert layers["3"].introduced == tf32["3"].introduced and layers["3"].diverged is None


def test_a_write_of_cudnns_flag_made_while_blocks_were_open_is_kept_when_the_last_one_closes():
    import threading

    before = flags.snapshot()
    try:
        torch.backends.cudnn.allow_tf32 = False
        entered, written = threading.Event(), threading.Event()

        def pinned_module() -> None:  # a module pinned to IEEE, running in another thread
            with conv_math("ieee"):
                entered.set()
                written.wait(10)

        thread = threading.Thread(target=pinned_module)
        thread.start()
        entered.wait(10)
        torch.backends.cudnn.allow_tf32 = True  # the user's own write, while the block is open
        written.set()
        thread.join(10)
        assert scope._CONV_OPEN == [] and flags.read_cells()["cuda.conv"] == "tf32"
        assert torch.backends.cudnn.allow_tf32 is True  # the user's, not the False the block found
        # the user wrote what the block had written: indistinguishable, so the block's base comes back
        torch.backends.cudnn.allow_tf32 = True
        with conv_math("ieee"):
            torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        with conv_math("ieee"):
            torch.backends.cudnn.allow_tf32 = True  # a write that differs from the block's: kept, as above
        assert torch.backends.cudnn.allow_tf32 is True
        # a write of one part only (cuDNN's RNN cell): that part stays, the block's conv write is undone, and the
        # flag stays readable
        torch.backends.cudnn.allow_tf32 = True
        if hasattr(torch.backends.cudnn, "rnn"):  # the per-backend cells (torch 2.9 and newer)
            with conv_math("ieee"):
                torch.backends.cudnn.rnn.fp32_precision = "tf32"
            assert torch.backends.cudnn.conv.fp32_precision == "tf32" and torch.backends.cudnn.allow_tf32 is True
        # nested and out of order, with no write of the user's, the base comes back as before
        outer, inner = conv_math("ieee"), conv_math("tf32")
        torch.backends.cudnn.allow_tf32 = False
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)
        assert flags.read_cells()["cuda.conv"] == "tf32"
        inner.__exit__(None, None, None)
        assert torch.backends.cudnn.allow_tf32 is False
    finally:
        flags.restore(before)


def test_the_report_names_conv_pins_and_measures_a_pinned_layer_at_its_math(tmp_path):

    (tmp_path / "convs.py").write_text(
        "import torch, tf32lab\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Tanh(), "
        "torch.nn.Conv2d(8, 4, 3))\n"
        "    return tf32lab.Workload(model, 8.0 + torch.randn(2, 3, 12, 12), name='convs')\n")
    (tmp_path / "policy.json").write_text('{"schema_version": 2, "default": "high", "conv": "tf32", '
                                          '"rules": [{"pattern": "2", "conv": "ieee"}]}')
    done = cli_runner.run("check", str(tmp_path / "convs.py") + ":make", "--levels", "highest", "--policy",
                          str(tmp_path / "policy.json"), "--conv", "tf32", module="tf32lab.cli", timeout=300,
                          env={**__import__("os").environ,
                                                                             "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "`high` by default, conv tf32, '2' → conv ieee" in text and "None" not in text
    assert "could not be matched" not in text and "control flow" not in text and "diverged" not in text
    assert "pinned by the policy" not in text and "pins its conv math" not in text  # measured: nothing to excuse
    assert ("convolutions ran at cudnn.conv 'tf32' in every row (conv=), except where the policy pins another: "
            "'2' → ieee") in text


@pytest.mark.parametrize("text,message", [
    ('{"schema_version": 1, "rules": [{"pattern": "a"}]}', "policy rule 1: missing 'level'"),
    ('{"schema_version": 1, "rules": [{"pattern": "a", "level": null}]}',
     "policy rule 1 ('a'): names no level; accepted: 'highest'"),
    ('{"schema_version": 1, "rules": [{"pattern": "a", "level": "high", "lvl": 1}]}',
     "policy rule 1: unknown key 'lvl'; accepted: 'pattern', 'level'"),
    ('{"schema_version": 1, "rules": [["a", null]]}',
     "policy rule 1 ('a'): names no level; accepted: 'highest'"),
    ('{"schema_version": 1, "rules": [["a", "high", "ieee"]]}', "'conv' needs schema_version 2"),
    ('{"schema_version": 1, "rules": [["a"]]}', "policy rule 1: ['a'] is not a (pattern, level) pair"),
    ('{"schema_version": 1, "rules": ["a"]}', "policy rule 1: 'a' is not a (pattern, level) pair"),
    ('{"schema_version": 1, "defaults": "high"}',
     "unknown key 'defaults'; accepted: 'schema_version', 'default', 'rules'"),
])
def test_a_version_1_file_is_told_about_levels_only(tmp_path, text, message):
    path = tmp_path / "policy.json"
    path.write_text(text)
    with pytest.raises(Tf32LabError) as info:
        Policy.load(path)
    said = str(info.value)
    assert message in said and "\n" not in said
    assert "conv" not in said.replace("'conv' needs schema_version 2", "")


@pytest.mark.parametrize("version,shown", [("2.0", "2.0"), ("1.0", "1.0"), ("true", "True"), ('"2"', "'2'")])
def test_a_schema_version_that_is_not_an_integer_is_refused(tmp_path, version, shown):
    path = tmp_path / "policy.json"
    path.write_text(f'{{"schema_version": {version}, "default": "high"}}')
    with pytest.raises(Tf32LabError) as info:
        Policy.load(path)
    assert f"schema_version {shown} is not supported; accepted: 1, 2" in str(info.value)


@pytest.mark.parametrize("data", [
    {"schema_version": 1, "default": "high", "rules": [{"pattern": "a", "level": "highest"}]},
    {"schema_version": 1, "default": None, "rules": []},
    {"schema_version": 1, "default": "high", "conv": "ieee", "rules": []},
    {"schema_version": 1, "default": "high", "rules": [{"pattern": "a", "level": "high", "conv": "ieee"}]},
    {"schema_version": 1, "default": "high", "rules": [{"pattern": "a", "level": None}]},
    {"schema_version": 1, "default": "high", "rules": [{"pattern": "a"}]},
    {"schema_version": 2, "default": "high", "conv": "tf32", "rules": [{"pattern": "a", "conv": "ieee"}]},
    {"schema_version": 2, "default": "high", "conv": None, "rules": [{"pattern": "a", "level": "high",
                                                                      "conv": None}]},
    {"schema_version": 2, "default": "high", "rules": [{"pattern": "a", "level": None, "conv": "ieee"}]},
    {"schema_version": 2, "default": "high", "rules": [{"pattern": "a", "level": None, "conv": None}]},
    {"schema_version": 2, "default": "high", "rules": [{"pattern": "a"}]},
    {"schema_version": 2, "default": "high", "rules": [{"pattern": "a", "conv": "fast"}]},
    {"schema_version": 3, "default": "high", "rules": []},
])
def test_the_report_schema_accepts_the_policies_the_loader_reads_and_no_other(data):
    subschema = schema()["$defs"]["level"]["properties"]["policy"]
    try:
        Policy.from_dict(data)
        loads = True
    except Tf32LabError:
        loads = False
    valid = jsonschema.Draft202012Validator(subschema).is_valid({**data, "base": "high"})
    assert valid == loads, (data, loads)


def test_the_policy_rows_predicted_speed_counts_each_modules_conv_math():
    # cuDNN's TF32 flag speeds convolutions up on an A100: a module pinned to IEEE gives that back, in the policy
    # row's predicted speedup (over `highest` at the check's conv math)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(128, 128, 3, padding=1))
    work = tf32lab.Workload(model, torch.randn(8, 64, 16, 16), name="convs")
    speed = {}
    for name, policy in (("tf32", tf32lab.Policy("high", conv="tf32")),
                         ("one ieee", tf32lab.Policy("high", [("2", None, "ieee")], conv="tf32")),
                         ("ieee", tf32lab.Policy("high", conv="ieee"))):
        report = tf32lab.check(work, levels=("highest",), target="a100", conv="tf32", policy=policy)
        speed[name] = report.level("policy").speedup
    assert speed["tf32"] == pytest.approx(1.0) and speed["ieee"] < speed["one ieee"] < 0.9 * speed["tf32"]


def test_a_conv_pin_on_a_cudnn_rnn_counts_in_the_predicted_speed_too():
    # cuDNN's flag covers its RNNs: an LSTM pinned to IEEE is predicted slower, as it runs
    torch.manual_seed(0)
    work = tf32lab.Workload(torch.nn.LSTM(256, 512, batch_first=True), torch.randn(32, 16, 256), name="lstm")
    speed = [tf32lab.check(work, levels=("highest",), target="a100", conv="tf32", policy=policy).level("policy").speedup
             for policy in (tf32lab.Policy("high", conv="tf32"), tf32lab.Policy("high", conv="ieee"))]
    assert speed[0] == pytest.approx(1.0) and speed[1] < 0.95
