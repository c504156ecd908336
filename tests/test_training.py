"""`check_training` and `tf32lab check --train`: training at each level against float64 and float32's own drift."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import textwrap
from pathlib import Path

import jsonschema
import pytest
import torch

import cli_runner
import tf32lab
from drifting_models import Offset, offset_forward, offset_layers
from tf32lab import Policy, TrainingWorkload, check_training
from tf32lab.control import flags
from tf32lab.errors import Tf32LabError
from tf32lab.report.training import training_schema

ROOT = Path(__file__).resolve().parents[1]


def mse(out, batch):
    return (out - batch[1]).pow(2).mean()


def regression(steps: int = 6, model: torch.nn.Module | None = None, **kwargs) -> TrainingWorkload:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)) for _ in range(steps)]
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return TrainingWorkload(model, data, loss=mse, inputs=lambda b: b[0], name="regression", **kwargs)


def offset_batches(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(-1, keepdim=True)


def heavy_offset(lr: float, steps: int = 20) -> TrainingWorkload:
    """`Offset` (256 features) behind two wide layers that TF32 speeds up: big enough for a training step to be
    predicted 1.3-1.5x faster at `high` on an A100, so that tune weighs its levels and pins. At lr 5e-2 over 8 steps
    `high` fails (the offset's `lin`; past the 1e-2 tolerance from step 6, 0.1 at step 8) and pinning `3.lin`
    passes (6e-4); at lr 1e-2 the same, only from step 19 of 20; at 3e-3 `high` passes (1.6e-3 at most, over 8
    steps as over 20)."""
    def batches(step: int):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(1024, 256, generator=g)
        return x, x[:, :16].sum(-1, keepdim=True)

    torch.manual_seed(0)
    offset = Offset()
    offset.lin, offset.head = torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256), offset)
    return TrainingWorkload(model, batches, loss=mse, inputs=lambda b: b[0], steps=steps,
                            optimizer=lambda p: torch.optim.SGD(p, lr=lr), name="heavy_offset")


class Kernel(torch.nn.Module):
    """An RBF kernel matrix of the batch's points, factored by Cholesky (its log-determinant is the loss). The
    squared distances come from |x|^2 + |y|^2 - 2 x.y, whose product TF32 rounds: on points far from the origin
    (from step 3 on) the matrix is no longer positive definite under TF32, and float32 has 1000x margin."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        sq = (x * x).sum(-1)
        d = sq[:, None] + sq[None, :] - 2 * (x @ x.T)
        k = torch.exp(-d.clamp_min(0) * torch.exp(self.log_scale)) + 1e-2 * torch.eye(len(x))
        return torch.linalg.cholesky(k).diagonal().log().sum()


def kernel_batches(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.rand(64, 2, generator=g) + (8.0 if step >= 2 else 0.0)


def kernel_workload(**kwargs) -> TrainingWorkload:
    return TrainingWorkload(Kernel(), kernel_batches, loss=lambda out, batch: -out, steps=5,
                            optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), **kwargs)


# -- what the rows say ------------------------------------------------------------------------------------------
def test_a_level_computed_as_highest_is_float32s_own_path_exactly():
    report = check_training(regression(), levels=("highest", "high"), target="cpu")
    high, floor = report.level("high"), report.floor
    assert high.same_as == "highest" and report.level("highest").same_as is None
    assert high.deviations == floor.deviations and high.losses == floor.losses
    assert high.multiple == 1.0 and high.passed and high.speedup is None  # no speed model for a CPU
    assert [g.normwise for g in high.gradients] == [g.normwise for g in floor.gradients]
    # float32's own drift is real but small: the floor is measured, not assumed to be zero
    assert 0 < floor.drift < 1e-5 and floor.gradients[0].normwise < 1e-5


def test_identical_runs_give_identical_reports():
    first = check_training(regression(), levels=("highest", "high"), target="a100")
    again = check_training(regression(), levels=("highest", "high"), target="a100")
    for a, b in zip((first.floor, *first.levels), (again.floor, *again.levels)):
        assert a.losses == b.losses and a.gradients == b.gradients and a.layers == b.layers
    assert first.reference_losses == again.reference_losses


def test_tf32_moves_gradients_state_and_loss_by_its_own_rounding_and_passes():
    report = check_training(regression(), levels=("highest", "high"), target="a100")
    high, floor = report.level("high"), report.floor
    assert high.passed and report.passed
    assert 1e-5 < high.gradients[0].normwise < 1e-2 and floor.gradients[0].normwise < 1e-5
    assert 0.999 < high.gradients[0].cosine <= 1.0
    assert high.weights and high.weights[0].normwise > floor.weights[0].normwise
    assert high.optimizer_state > floor.optimizer_state > 0  # AdamW's moments
    assert {e.name for e in high.layers} == {"0", "2"}
    assert all(e.introduced > 1e-5 for e in high.layers) and all(e.introduced < 1e-6 for e in floor.layers)
    assert high.coverage == {"aten::addmm tf32-rna": 12, "aten::mm tf32-rna": 18}
    assert report.conclusion()[0].startswith("TF32 (`high`) is safe for training regression for 6 steps on a100")
    # the speed model's prediction of a training step (forward, backward, AdamW) beside the verdict
    assert high.speedup is not None and high.speedup >= 1.0 and floor.speedup is None
    assert report.level("highest").speedup == 1.0
    assert "a training step is predicted" in report.conclusion()[0]


def test_gradients_that_tf32_ruins_diverge_at_a_step_and_fail():
    torch.manual_seed(0)
    workload = TrainingWorkload(Offset(), offset_batches, loss=mse, inputs=lambda b: b[0], steps=20,
                                optimizer=lambda p: torch.optim.SGD(p, lr=1e-2), name="offset")
    report = check_training(workload, levels=("highest", "high"), target="a100")
    high = report.level("high")
    assert report.level("highest").passed and not high.passed and not report
    assert high.divergence_step is not None and high.divergence_step > 1  # worse over the steps, not at once
    assert high.multiple > 100 and high.gradients[0].name == "lin.weight" and high.gradients[0].normwise > 1e-2
    assert high.failure is None
    text = " ".join(report.conclusion())
    assert f"diverges at step {high.divergence_step} on a100" in text
    assert "gradients of 'lin.weight' are off by" in text and 'Policy("high", [("lin", "highest")])' in text
    assert f"FAILED | level 'high' | training 20 steps | diverges at step {high.divergence_step}" in str(report)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_scripted_models_parameters_are_trained_not_frozen_by_the_copy():
    """The saved state every row starts from is a deep copy made under no_grad, and a ScriptModule's deep copy
    under no_grad has parameters that no longer require grad: a scripted part of a model was silently frozen in
    every row (its gradients and weights missing from the report, the verdict about the rest only), and a
    scripted model refused ('optimizer got an empty parameter list')."""
    class Host(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.front, self.back = torch.jit.script(torch.nn.Linear(32, 16)), torch.nn.Linear(16, 1)

        def forward(self, x):
            return self.back(torch.tanh(self.front(x)))

    torch.manual_seed(0)
    host = Host()
    report = check_training(regression(model=host), levels=("highest",), target="a100", speed=False)
    names = {g.name for g in report.floor.gradients}
    assert names == {"front.weight", "front.bias", "back.weight", "back.bias"}, names
    assert {w.name for w in report.floor.weights} == names
    assert all(p.requires_grad for p in host.parameters())
    torch.manual_seed(0)
    scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    report = check_training(regression(model=scripted), levels=("highest",), target="a100", speed=False)
    assert {g.name for g in report.floor.gradients} == {"0.weight", "0.bias", "2.weight", "2.bias"}


class _Unhooked(torch.nn.Linear):
    """A Linear whose ``__call__`` runs ``forward`` itself, past PyTorch's module hooks, as every gpytorch module
    does (``gpytorch.Module.__call__``)."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def test_no_module_is_named_to_pin_where_no_modules_backward_was_measured():
    """gpytorch's exact GP fit read 'gradients of 'gp.mean.raw_constant' are off ...; pin 'gp.mean'': its modules
    run past the hooks that measure each module's own backward, so no module had a row, and the advice named the
    owner of the worst gradient, a constant mean that runs no matmul-family op (pinning it trained exactly as
    `high`). With no module measured the advice names none, and a note says why there are no rows."""
    torch.manual_seed(0)
    model = Offset()
    model.lin, model.head = _Unhooked(16, 16, bias=False), _Unhooked(16, 1)
    workload = TrainingWorkload(model, offset_batches, loss=mse, inputs=lambda b: b[0], steps=20,
                                optimizer=lambda p: torch.optim.SGD(p, lr=1e-2), name="offset")
    report = check_training(workload, levels=("highest", "high"), target="a100")
    high = report.level("high")
    assert not high.passed and not high.layers and high.gradients[0].name == "lin.weight"
    text = " ".join(report.conclusion())
    assert "pin 'lin'" not in text and "keep `highest`" in text, text
    (note,) = [note for note in report.notes if "hooks" in note]
    assert "'lin', 'head'" in note


class Tagged(torch.nn.Module):
    """`Offset` fed a learnt embedding of a tag beside its input, its `lin` and `head` frozen: the only gradient is
    the embedding's, which TF32 ruins through `lin`'s forward, while the embedding itself computes alike at every
    level (a lookup, no matmul-family op)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4, 16)
        offset_layers(self)
        self.lin.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, tag: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return offset_forward(self, x + self.emb(tag))


def tagged_batches(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    return (torch.randint(0, 4, (32,), generator=g), x), x.sum(-1, keepdim=True)


def test_a_failing_level_is_not_told_to_pin_a_module_it_computes_alike():
    # the worst gradient is the embedding's, but pinning `emb` to highest changes nothing: the advice must not
    # name it, nor call it the module whose backward adds the most error
    torch.manual_seed(0)
    workload = TrainingWorkload(Tagged(), tagged_batches, loss=mse, inputs=lambda b: b[0], steps=10,
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.2), name="tagged")
    report = check_training(workload, levels=("highest", "high"), target="a100", tolerance=5e-3, speed=False)
    high = report.level("high")
    assert not high.passed and high.gradients[0].name == "emb.weight" and high.gradients[0].normwise > 1e-2
    emb = {layer.name: layer.introduced for layer in high.layers}["emb"]
    assert emb == {layer.name: layer.introduced for layer in report.floor.layers}["emb"]
    said = report.conclusion()[0]
    assert said.startswith("TF32 (`high`) diverges at step"), said
    assert "'emb'" not in said and "keep `highest`" in said, said
    # what that advice would have bought: the very same path
    pinned = check_training(workload, levels=("high",), target="a100", tolerance=5e-3, speed=False,
                            policy=Policy("high", [("emb", "highest")]))
    assert pinned.policy_row.losses == high.losses


def test_a_step_that_raises_only_under_tf32_fails_its_level_at_that_step():
    report = check_training(kernel_workload(name="kernel"), levels=("highest", "high"), target="a100")
    high = report.level("high")
    assert report.floor.failure is None and report.level("highest").passed
    assert not high.passed and high.failed_step == 3 and high.failure.startswith("LinAlgError: linalg.cholesky")
    assert high.losses and len(high.losses) == 2 and high.weights == () and high.drift == float("inf")
    assert report.conclusion()[0].startswith("TF32 (`high`) fails at step 3 on a100: LinAlgError")
    assert "FAILED | level 'high' | training 5 steps | step 3: LinAlgError" in str(report)


def test_the_conclusion_says_how_to_enable_a_level_that_is_safe_and_worth_it_and_what_to_do_when_one_fails():
    report = check_training(regression(), levels=("highest", "high"), target="a100")
    # the same rows with the step predicted 2x as fast (this small model's own prediction buys little: its words
    # say so, and name no setting to change)
    high = report.level("high")
    worth = dataclasses.replace(report, levels=tuple(
        dataclasses.replace(lv, speedup=2.0, speedup_band=(1.8, 2.2)) if lv is high else lv for lv in report.levels))
    said = worth.conclusion()[0]
    assert said.startswith("TF32 (`high`) is safe for training regression") and "predicted 2.00x" in said, said
    assert said.endswith('Enable it with `torch.set_float32_matmul_precision("high")` or '
                         '`tf32lab.precision("high")`.'), said
    failed = check_training(kernel_workload(name="kernel"), levels=("highest", "high"), target="a100").conclusion()
    assert failed[0].startswith("TF32 (`high`) fails at step 3 on a100: LinAlgError"), failed
    assert "keep `highest`" in failed[0] and "tf32lab tune SPEC --train" in failed[0], failed


def test_a_level_that_fails_where_float32_fails_too_is_not_told_to_keep_highest():
    # float32 itself fails at step 1 (a loss that refuses float32 outputs): keeping `highest` is no answer, and
    # the conclusion said it beside "float32 itself (`highest`) fails"
    def float64_only(out, batch):
        if out.dtype != torch.float64:
            raise ValueError(f"a {out.dtype} output")
        return mse(out, batch)

    workload = regression(steps=2)
    workload = TrainingWorkload(workload.model, workload.batches, loss=float64_only, inputs=lambda b: b[0],
                                name="regression")
    report = check_training(workload, levels=("highest", "high"), target="a100")
    assert report.floor.failure is not None and report.level("high").failure is not None
    said = report.conclusion()
    assert any(line.startswith("float32 itself (`highest`) fails at step 1") for line in said), said
    assert not any("keep `highest`" in line for line in said), said
    alone = check_training(workload, levels=("highest",), target="a100").conclusion()
    assert not any("keep `highest`" in line for line in alone), alone


def test_dropout_draws_the_same_masks_in_every_row():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(128, 1))
    first = check_training(regression(model=model), levels=("highest", "high"), target="a100")
    # float32 follows float64 closely: with other masks the two paths would be as far apart as two batches
    assert first.floor.drift < 1e-5 and first.floor.gradients[0].normwise < 1e-5
    again = check_training(regression(model=model), levels=("highest", "high"), target="a100")
    assert again.level("high").losses == first.level("high").losses


def test_a_policy_row_changes_only_the_pinned_modules_backward():
    class ValueModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh())
            self.v_head = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

        def forward(self, x):
            return self.v_head(self.body(x))

    torch.manual_seed(0)
    policy = Policy("high", [("v_head", "highest")])
    report = check_training(regression(model=ValueModel()), levels=("highest", "high"), policy=policy)
    row, high, floor = report.level("policy"), report.level("high"), report.floor
    assert row.policy == dict(policy.to_dict(), base="high") and row.maths["matmul"] == "mixed"
    introduced = {lv.level: {e.name: e.introduced for e in lv.layers} for lv in (row, high, floor)}
    for name in ("v_head.0", "v_head.2"):  # the pinned modules compute their backward as float32 does
        assert introduced["policy"][name] == introduced["float32"][name] < 1e-6
    assert introduced["policy"]["body.0"] == introduced["high"]["body.0"] > 1e-5  # the rest as at `high`
    # per op: the head's products (forward and backward) IEEE, the body's TF32
    assert {key.split()[1] for key in row.coverage} == {"ieee", "tf32-rna"}
    assert report.passed == row.passed


# -- nothing of the caller's changes --------------------------------------------------------------------------------
class Interrupt(Exception):
    pass


CALLS = {"forward": 0}  # shared by every copy the check makes (a list on the module would be copied too)


class Stopping(torch.nn.Module):
    """Raises at its ``at``-th call: float64 (a probe of step 1 twice, its three steps) and step 1's backward come
    first, then `high`'s."""

    def __init__(self, raised: type, at: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(16, 1))
        self.raised, self.at = raised, at
        CALLS["forward"] = 0

    def forward(self, x):
        CALLS["forward"] += 1
        if CALLS["forward"] == self.at:
            raise self.raised("stop")
        return self.net(x)


@pytest.mark.parametrize("raised", [KeyboardInterrupt, Interrupt])
def test_everything_is_as_it_was_after_an_exception_inside_a_step(raised):
    torch.manual_seed(0)
    model = Stopping(raised, at=2 + 3 + 1 + 2)  # step 2 at `high` (after float64: its probe of step 1, its 3 steps)
    model.eval()
    model.net[1].train()  # mixed modes, kept exactly
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(3)]
    kept = [tuple(t.clone() for t in batch) for batch in data]
    workload = TrainingWorkload(model, data, loss=mse, inputs=lambda b: b[0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    before, rng = flags.snapshot(), torch.get_rng_state()
    if raised is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            check_training(workload, levels=("highest", "high"), target="a100")
    else:  # the workload's own exception in a step is that level's finding
        high = check_training(workload, levels=("highest", "high"), target="a100").level("high")
        assert not high.passed and high.failed_step == 2 and high.failure == "Interrupt: stop"
    assert flags.snapshot() == before and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == modes
    assert all(torch.equal(a, b) for batch, copy in zip(data, kept) for a, b in zip(batch, copy))
    assert tf32lab.get_float32_matmul_precision() == "highest"


def test_the_callers_model_and_random_state_are_untouched_by_a_whole_check():
    workload = regression()
    state = {k: v.clone() for k, v in workload.model.state_dict().items()}
    rng = torch.get_rng_state()
    check_training(workload, levels=("high",))
    assert all(torch.equal(v, state[k]) for k, v in workload.model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng) and workload.model.training


def test_a_hugging_face_output_supplies_its_own_loss():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 100, (8, 12), generator=g),
                "labels": torch.randint(0, 3, (8,), generator=g)} for _ in range(2)]
    report = check_training(TrainingWorkload(model, batches), levels=("highest", "high"))
    assert report.passed and len(report.reference_losses) == 2
    assert report.level("high").gradients and report.level("high").coverage


# -- bad input: one line, before any run ----------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": "model"}, "model must be a torch.nn.Module, not str"),
    ({"batches": 3}, "batches must be a sequence of batches or a function step -> batch, not int"),
    ({"batches": []}, "batches are empty"),
    ({"loss": 1.0}, "loss must be callable, not float"),
    ({"optimizer": "adam"}, "optimizer must be callable, not str"),
    ({"steps": 0}, "steps must be a whole number >= 1, not 0"),
    ({"steps": 9}, "of 1 batches cannot run 9 steps"),
    ({"batches": lambda step: step}, "needs steps="),
    ({"model": torch.nn.Linear(2, 1).double()}, "holds float64 tensors"),
])
def test_a_bad_training_workload_is_one_line(kwargs, message):
    args = {"model": torch.nn.Linear(2, 1), "batches": [torch.ones(1, 2)], **kwargs}
    with pytest.raises(Tf32LabError, match=message) as info:
        TrainingWorkload(**args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("loss", "message"), [
    (lambda out, batch: out, r"the loss must be a real floating scalar tensor, not a tensor of shape \(4, 1\)"),
    (lambda out, batch: 1.0, "the loss must be a real floating scalar tensor, not float"),
    # the user's dtype, not the float64 row's widened twin (complex128)
    (lambda out, batch: out.sum().to(torch.complex64), r"not a torch\.complex64 tensor \(its \.real or \.abs\(\)"),
    (lambda out, batch: out.sum().detach(), "the loss does not depend on any parameter"),
    (None, r"no loss= given and the model's output \(Tensor\) has no .loss"),
])
def test_a_bad_loss_is_one_line_and_nothing_ran_in_float32(loss, message):
    workload = TrainingWorkload(torch.nn.Linear(2, 1), [torch.ones(4, 2)], loss=loss)
    with pytest.raises(Tf32LabError, match=message):
        check_training(workload)


def test_bad_arguments_to_check_training():
    with pytest.raises(Tf32LabError, match=r"takes a tf32lab\.TrainingWorkload, not Workload"):
        check_training(tf32lab.Workload(torch.nn.Linear(2, 1), torch.ones(1, 2)))
    with pytest.raises(Tf32LabError, match=r"steps=7, but training workload 'regression' has 6 batches"):
        check_training(regression(), steps=7)
    with pytest.raises(Tf32LabError, match="tolerance is one number >= 0"):
        check_training(regression(), tolerance=float("nan"))
    with pytest.raises(Tf32LabError, match="unknown level"):
        check_training(regression(), levels=("fast",))
    with pytest.raises(Tf32LabError, match=r"fails in float64"):
        check_training(TrainingWorkload(torch.nn.Linear(2, 1), [torch.ones(4, 3)], loss=lambda o, b: o.sum()))


# -- the report's forms ---------------------------------------------------------------------------------------------
def test_the_json_follows_its_schema_and_the_html_draws_the_paths(tmp_path):
    torch.manual_seed(0)
    report = check_training(kernel_workload(name="<b>kernel</b>"), levels=("highest", "high"),
                            policy=Policy("high", []))
    data = json.loads(report.to_json(tmp_path / "r.json"))
    jsonschema.validate(data, training_schema())
    assert data["kind"] == "training" and data["levels"][1]["failed_step"] == 3 and data["passed"] is False
    assert data["levels"][1]["drift"] == "inf"
    page = report.to_html()
    assert "&lt;b&gt;kernel&lt;/b&gt;" in page and "<b>kernel</b>" not in page
    assert page.index(report.conclusion()[0].split("`")[0][:30]) < page.index("<svg")  # the conclusion at the top
    assert page.count("<polyline") == 3  # float32, high, the policy


CLI_MODEL = textwrap.dedent("""
    import torch, tf32lab
    from test_training import heavy_offset, kernel_workload, regression

    def good():
        return regression()

    def kernel():
        return kernel_workload(name="kernel")

    def offset():
        return heavy_offset(5e-2, steps=8)

    def forward():
        return tf32lab.Workload(torch.nn.Linear(2, 1), torch.ones(1, 2))
""")


def _env() -> dict[str, str]:
    """The worker's environment, tests/ on the path and no TF32LAB_* setting of the user's: the CLI then forks from
    the suite's server (cli_runner; a run without the start-up variables the server read, LANG, PYTHON*..., took a
    fresh interpreter each time)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF32LAB_")}
    return {**env, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}"}


def _cli(tmp_path, *args):
    (tmp_path / "trainmodel.py").write_text(CLI_MODEL)
    env = _env()
    return cli_runner.run("check", *args, cwd=tmp_path, env=env, timeout=300)


def test_cli_check_train_exit_codes_and_outputs(tmp_path):
    ok = _cli(tmp_path, "trainmodel.py:good", "--train", "--levels", "highest,high", "--steps", "3",
              "--json", "out.json", "--html", "out.html")
    assert ok.returncode == 0, ok.stderr
    assert "PASSED | level 'high' | training 3 steps" in ok.stdout and "is safe for training" in ok.stdout
    jsonschema.validate(json.loads((tmp_path / "out.json").read_text()), training_schema())
    assert (tmp_path / "out.html").read_text().count("<polyline") == 2
    failed = _cli(tmp_path, "trainmodel.py:kernel", "--train", "--levels", "highest,high", "--json", "-")
    assert failed.returncode == 1 and json.loads(failed.stdout)["levels"][1]["failed_step"] == 3


@pytest.mark.parametrize(("args", "message"), [
    (["trainmodel.py:forward", "--train"], "--train needs a factory that returns a tf32lab.TrainingWorkload"),
    (["trainmodel.py:good"], "is a training workload (tf32lab.TrainingWorkload): add --train"),
    (["trainmodel.py:good", "--train", "--steps", "0"], "bad number of steps '0'"),
    (["trainmodel.py:forward", "--steps", "3"], "--steps 3 goes with --train"),
    (["--train"], "--train needs a spec"),
])
def test_cli_check_train_bad_input_is_exit_2_in_one_line(tmp_path, args, message):
    done = _cli(tmp_path, *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


# -- tune ------------------------------------------------------------------------------------------------------------
def test_tune_pins_the_module_whose_gradients_tf32_ruins_and_trains_it():
    tuning = tf32lab.tune(heavy_offset(5e-2, steps=8), target="a100")
    assert tuning.passed and tuning.pinned == ("3.lin",) and tuning.level is None
    assert tuning.policy.to_dict()["rules"] == [{"pattern": "3.lin", "level": "highest"}]
    # the worst step-1 gradient is the head's, but the cancellation is in `lin`: the head's pin, made first, is
    # dropped once `lin`'s makes it unneeded (one more training)
    assert [(c.pinned, c.passed) for c in tuning.candidates] == [
        (("3.head",), False), (("3.head", "3.lin"), True), (("3.lin",), True)]
    assert tuning.report.policy_row is not None and tuning.report.policy_row.passed
    assert not tuning.report.level("high").passed
    assert "with '3.lin' at `highest` training passes on a100" in tuning.advice()[0]
    assert tuning.report.policy_row.speedup >= 1.1 and "as fast as at `highest` on a100" in tuning.advice()[0]
    assert json.loads(tuning.to_json())["candidates"][0]["pinned"] == ["3.head"]


def test_tune_pins_no_module_that_the_level_computes_alike():
    # `heavy_offset` behind a learnt embedding of a tag, only the embedding trained: its gradient is the only one
    # and TF32 ruins it (through the frozen `lin`'s forward), but the embedding computes alike at every level, so
    # no pin can help, and none is trained
    class HeavyTagged(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(4, 256)
            self.body = heavy_offset(0.5).model.requires_grad_(False)

        def forward(self, tag: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return self.body(x + self.emb(tag))

    def batches(step: int):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(1024, 256, generator=g)
        return (torch.randint(0, 4, (1024,), generator=g), x), x[:, :16].sum(-1, keepdim=True)

    workload = TrainingWorkload(HeavyTagged(), batches, loss=mse, inputs=lambda b: b[0], steps=8,
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.5), name="heavy_tagged")
    tuning = tf32lab.tune(workload, target="a100", tolerance=5e-4)
    assert not tuning.report.level("high").passed and tuning.level == "highest"
    assert tuning.report.level("high").gradients[0].name == "emb.weight"
    assert tuning.candidates == (), tuning.candidates
    assert "no module to pin" in tuning.reason, tuning.reason


def test_tune_keeps_a_level_that_trains_within_tolerance():
    tuning = tf32lab.tune(heavy_offset(3e-3, steps=8), target="a100")
    assert tuning.passed and tuning.level == "high" and tuning.candidates == ()
    assert all(lv.speedup is not None for lv in tuning.report.levels)  # as check --train predicts them
    assert tuning.report.level("high").speedup >= 1.1 and "buys little" not in tuning.advice()[0]
    assert tuning.runs == 2  # the floor and `high` (medium computes as high on an A100)


def test_tune_takes_no_pins_that_buy_too_little():
    # as a forward tune: a passing level is taken whatever its speedup, which the answer states
    tuning = tf32lab.tune(regression(steps=3), target="a100")
    assert tuning.passed and tuning.level == "high" and "predicted only 1.00x as fast" in tuning.reason
    # but a pinned policy is slower than its level: where that level gains nothing, no pin is tried
    torch.manual_seed(0)
    failing = TrainingWorkload(Offset(), offset_batches, loss=mse, inputs=lambda b: b[0], steps=20,
                               optimizer=lambda p: torch.optim.SGD(p, lr=1e-2), name="offset")
    tuning = tf32lab.tune(failing, target="a100")
    assert tuning.level == "highest" and tuning.candidates == () and not tuning.report.level("high").passed
    assert "no pinned policy is worth trying" in tuning.reason


def test_tune_cli_train_writes_the_policy(tmp_path):
    (tmp_path / "trainmodel.py").write_text(CLI_MODEL)
    env = _env()
    done = cli_runner.run("tune", "trainmodel.py:offset", "--train", "--out", "policy.json", "--conv", "ieee", "--json",
                          "tuning.json", cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "policy.json").read_text())["rules"] == [{"pattern": "3.lin", "level": "highest"}]
    assert "high, pinned: 3.lin" in done.stdout and "cudnn.allow_tf32" not in done.stdout  # no convolution in it
    assert json.loads((tmp_path / "tuning.json").read_text())["conv"] is None


class ConvHead(torch.nn.Module):
    """A convolution feeding a linear head: TF32 convolutions show in float32's floor on an A100, IEEE ones not."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, 5)
        self.head = torch.nn.Linear(8 * 28, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def test_tune_of_a_training_searches_under_the_conv_math_named():
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 4, 32, generator=g), torch.randn(16, 1, generator=g)) for _ in range(3)]
    floors = {}
    for conv in ("tf32", "ieee"):
        torch.manual_seed(0)
        workload = TrainingWorkload(ConvHead(), data, loss=mse, inputs=lambda b: b[0], name="convhead")
        tuning = tf32lab.tune(workload, target="a100", conv=conv)
        assert tuning.passed and tuning.level == "high" and tuning.conv == conv
        assert any(f"cudnn.conv {conv!r} in every row" in note for note in tuning.report.notes)
        assert json.loads(tuning.to_json())["conv"] == conv
        assert tuning.policy.conv == conv  # the policy file sets the math it was trained under
        floors[conv] = tuning.report.floor.drift
    assert "allow_tf32 = False" in tuning.advice()[-1] and "which sets it itself" in tuning.advice()[-1]
    # a TorchScript model takes no hooks, and applying a policy to it is refused: the flag alone is named
    torch.manual_seed(0)
    scripted = tf32lab.tune(TrainingWorkload(torch.jit.script(ConvHead()), data, loss=mse, inputs=lambda b: b[0],
                                             name="scripted"), target="a100", conv="ieee")
    # its convolutions are no module's: the math it was searched under is said and written into its policy too
    assert scripted.passed and scripted.conv == "ieee" and scripted.policy.conv == "ieee", scripted.advice()
    assert "allow_tf32 = False" in scripted.advice()[-1], scripted.advice()
    assert "which sets it itself" not in scripted.advice()[-1]
    applied = check_training(workload, levels=("highest",), target="a100", policy=tuning.policy)
    assert applied.policy_row.drift == tuning.report.level("high").drift  # the answer, reproduced from its policy
    plain = tf32lab.tune(regression(steps=2), target="a100", conv="ieee")  # no convolution: nothing to set
    assert plain.conv is None and plain.policy.conv is None and "cudnn" not in " ".join(plain.advice())
    assert floors["ieee"] < floors["tf32"] / 10  # the floor trained with the convolutions the search named
    with pytest.raises(Tf32LabError, match="unknown conv math 'fast'"):
        tf32lab.tune(workload, target="a100", conv="fast")


def test_a_workload_that_writes_the_conv_flag_is_not_reported_as_run_at_the_math_asked_for():
    def loss(out, batch):  # the workload's own code sets TF32 convolutions, as a training script might
        flags.write_conv("tf32")
        return mse(out, batch)

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 4, 32, generator=g), torch.randn(16, 1, generator=g)) for _ in range(2)]
    torch.manual_seed(0)
    workload = TrainingWorkload(ConvHead(), data, loss=loss, inputs=lambda b: b[0], name="writes")
    before = flags.snapshot()
    report = check_training(workload, levels=("highest",), target="a100", conv="ieee", speed=False)
    note = next(n for n in report.notes if "cudnn.conv 'ieee'" in n)
    assert "until the workload wrote 'tf32'" in note and "in every row" not in note
    assert flags.snapshot() == before  # the process's TF32 default: the workload's write of it is undone too
    tuning = tf32lab.tune(workload, target="a100", conv="ieee")  # nor does the answer claim the math, or set it
    assert tuning.conv is None and (tuning.policy is None or tuning.policy.conv is None)
    assert any("until the workload wrote 'tf32'" in note for note in tuning.report.notes)


# -- what a hostile workload must not get past ------------------------------------------------------------------------
def test_a_batches_function_that_draws_from_a_stream_gives_every_row_the_same_data():
    g = torch.Generator().manual_seed(0)
    workload = TrainingWorkload(torch.nn.Linear(4, 1), lambda k: (torch.randn(8, 4, generator=g),
                                                                   torch.randn(8, 1, generator=g)),
                                steps=3, loss=mse, inputs=lambda b: b[0])
    report = check_training(workload, levels=("highest", "high"))
    assert report.floor.drift < 1e-5  # float32 and float64 trained on the same batches


def test_a_model_that_edits_its_inputs_in_place_changes_neither_the_callers_data_nor_the_next_row():
    class Doubling(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            x.mul_(2)
            return self.lin(x)

    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    kept = [tuple(t.clone() for t in b) for b in data]
    report = check_training(TrainingWorkload(Doubling(), data, loss=mse, inputs=lambda b: b[0]),
                            levels=("highest", "high"))
    assert report.passed and report.level("high").drift < 1e-2
    assert all(torch.equal(a, b) for batch, copy in zip(data, kept) for a, b in zip(batch, copy))


def test_float32_made_inside_the_model_is_widened_in_the_float64_reference():
    class Upcast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.head(torch.softmax(self.lin(x), -1, dtype=torch.float32) + torch.arange(8) / 10)

    torch.manual_seed(0)
    workload = TrainingWorkload(Upcast(), [(torch.randn(8, 8), torch.randn(8, 1))] * 3, loss=mse,
                                inputs=lambda b: b[0])
    report = check_training(workload, levels=("highest", "high"))
    assert report.passed and 0 < report.floor.drift < 1e-5  # float32 against a float64 that really is


def test_the_models_own_train_and_eval_modes_are_kept():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.9), torch.nn.Linear(64, 1))
    model.eval()  # no dropout: each row's loss is then a deterministic function of its weights
    report = check_training(regression(model=model), levels=("highest",))
    assert report.floor.drift < 1e-5 and not model.training


def test_when_float32_itself_fails_a_level_past_the_tolerance_cannot_pass_beside_it():
    class Fragile(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            if CALLS["forward"] == 2 + 3 + 1 + 3 + 2:  # a late step of the floor (trained last)
                CALLS["forward"] += 1
                raise RuntimeError("float32 broke")
            CALLS["forward"] += 1
            return self.lin(x)

    CALLS["forward"] = 0
    torch.manual_seed(0)
    workload = TrainingWorkload(Fragile(), [(torch.randn(8, 4), torch.randn(8, 1))] * 3, loss=mse,
                                inputs=lambda b: b[0], optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    report = check_training(workload, levels=("highest", "high"), tolerance=0.0)
    assert report.floor.failure == "RuntimeError: float32 broke" and report.floor.failed_step > 1
    high = report.level("high")
    assert high.failure is None and high.divergence_step is not None and not high.passed
    assert "no measure of float32's own drift" in str(report) and "is safe" not in " ".join(report.conclusion())


@pytest.mark.parametrize(("optimizer", "message"), [
    (lambda p: torch.optim.AdamW(p, lr=-1), "optimizer\\(params\\) raised ValueError: Invalid learning rate: -1"),
    (lambda p: torch.optim.LBFGS(p), "LBFGS needs a closure"),
    (lambda p: torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), "does not step the parameters it was given"),
])
def test_an_optimizer_the_check_cannot_step_is_one_line(optimizer, message):
    workload = TrainingWorkload(torch.nn.Linear(4, 1), [(torch.ones(8, 4), torch.ones(8, 1))], loss=mse,
                                inputs=lambda b: b[0], optimizer=optimizer)
    with pytest.raises(Tf32LabError, match=message) as info:
        check_training(workload)
    assert "\n" not in str(info.value)


def test_a_gradient_that_is_not_finite_fails_the_step_that_made_it():
    class Root(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return (x * self.w).pow(2).sum().sqrt()  # finite (0); its gradient at w = 0 is NaN

    workload = TrainingWorkload(Root(), [torch.ones(2, 4)] * 2, loss=lambda out, batch: out)
    with pytest.raises(Tf32LabError, match="fails in float64, before any level ran: step 1: the gradient of 'w' "
                                           "is not finite"):
        check_training(workload)


def test_a_batch_the_model_cannot_be_called_with_is_one_line_naming_inputs():
    workload = TrainingWorkload(torch.nn.Sequential(torch.nn.Linear(4, 1)), [(torch.ones(8, 4), torch.ones(8, 1))],
                                loss=mse)
    with pytest.raises(Tf32LabError, match=r"the model cannot be called with the batch's 2 positional argument\(s\) "
                                           r"\(the whole batch, as no inputs= was given"):
        check_training(workload)


def test_speed_predicts_a_training_workloads_step(tmp_path):
    (tmp_path / "trainmodel.py").write_text(CLI_MODEL)
    env = _env()
    done = cli_runner.run("speed", "trainmodel.py:good", "--target", "h100", "--json", "-", cwd=tmp_path, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["predicted"]["step"] == "training"


def test_ops_that_ran_without_emulation_are_said_in_the_conclusion():
    class MatrixExp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(16, 16)

        def forward(self, x):  # matrix_exp: GEMMs inside one native kernel, which no emulation rule has
            return torch.linalg.matrix_exp(self.q(x).view(4, 16, 16) * 0.1).sum()

    torch.manual_seed(0)
    report = check_training(TrainingWorkload(MatrixExp(), [torch.randn(64, 16)] * 2, loss=lambda out, batch: out),
                            levels=("highest", "high"))
    assert report.level("high").unhandled
    assert any(line.startswith("Some matmul-family ops ran without emulation (aten::linalg_matrix_exp")
               for line in report.conclusion())


class Laplacian(torch.nn.Module):
    """A physics-informed net: its value and its Laplacian (torch.func.hessian under vmap), the same net called
    inside the transform, then outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                       torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = lambda p: self.net(p).squeeze(-1)  # noqa: E731
        laplacian = torch.func.vmap(torch.func.hessian(u))(x).diagonal(dim1=-2, dim2=-1).sum(-1)
        return self.net(x).squeeze(-1), laplacian


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func's own
def test_a_module_called_inside_vmap_is_attributed_at_its_call_outside():
    # the backward attribution kept each module's first call: the one inside vmap, whose batched tensors escaped
    # the transform and raised a RuntimeError out of check_training
    torch.manual_seed(0)
    batches = [torch.rand(64, 2) for _ in range(2)]
    workload = TrainingWorkload(Laplacian(), batches, inputs=lambda b: b,
                                loss=lambda out, b: (out[1] + 1).pow(2).mean() + out[0].pow(2).mean())
    report = check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    high = report.level("high")
    assert report.level("highest").passed and report.floor.drift < 1e-5
    assert sorted(layer.name for layer in high.layers) == ["net.0", "net.2", "net.4"]
    assert all(1e-5 < layer.introduced < 1e-2 for layer in high.layers), high.layers


class Recurrent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 32, batch_first=True)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


@pytest.mark.parametrize("conv", [None, "ieee"])
def test_the_floor_of_an_lstm_runs_at_cudnns_rnn_math_not_natively(conv):
    """An emulated LSTM's GEMMs are counted as ``aten::linear``/``aten::mm``: the rows seemed to meet the matmul
    family only, which an A100 computes IEEE at `highest`, so the floor (and `highest`, computed alike) ran natively
    in IEEE float32, where cuDNN's RNN flag (TF32 by default) makes an A100 run the LSTM in TF32 at `highest`."""
    torch.manual_seed(0)
    batches = [(torch.randn(16, 20, 8), torch.randn(16, 1)) for _ in range(2)]
    workload = TrainingWorkload(Recurrent(), batches, loss=lambda out, b: (out - b[1]).pow(2).mean(),
                                inputs=lambda b: b[0], optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    report = check_training(workload, levels=("highest", "high"), target="a100", speed=False, conv=conv)
    lstm = {g.name: g.normwise for g in report.level("highest").gradients if g.name.startswith("lstm.")}
    if conv is None:  # TF32 in the LSTM at `highest`, emulated: its gradients a TF32 rounding away from float64's
        assert report.floor.coverage and min(lstm.values()) > 1e-5, lstm
    else:  # IEEE at `highest` for every family met: native float32 may stand for it
        assert max(lstm.values()) < 1e-5, lstm


class _Scale(torch.nn.Module):
    """A module whose output holds no tensor: a distribution object its caller samples the loss from."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = torch.nn.Parameter(torch.zeros(2))

    def forward(self, loc):
        return torch.distributions.Normal(loc, self.log_scale.exp())


class _WithScale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loc, self.scale = torch.nn.Linear(4, 2), _Scale()

    def forward(self, x):
        return self.scale(self.loc(x)).mean


def test_a_module_whose_output_holds_no_tensor_is_said_to_have_no_backward_row():
    # zuko's flows return transform objects: no gradient can be hooked at their outputs, and their modules were left
    # out of the backward table without a word
    torch.manual_seed(0)
    batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(2)]
    workload = TrainingWorkload(_WithScale(), batches, loss=mse, inputs=lambda b: b[0], steps=2, name="scaled")
    report = tf32lab.check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    assert "loc" in {layer.name for layer in report.levels[-1].layers}
    (note,) = [n for n in report.notes if "no backward row" in n]
    assert note.startswith("1 module(s) with parameters have no backward row ('scale'): no gradient reached"), note


class _Tied(torch.nn.Module):
    """T5's ties: ``shared`` an embedding never called itself, its weight that of ``embed`` and ``head`` (which
    run), as ``T5ForConditionalGeneration.shared`` is ``encoder.embed_tokens``'s and ``lm_head``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Embedding(10, 8)
        self.embed = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.embed.weight = self.head.weight = self.shared.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def _tied_loss(out, batch):
    return torch.nn.functional.cross_entropy(out.reshape(-1, 10), batch.reshape(-1))


def test_a_module_whose_weights_are_tied_to_modules_that_ran_is_not_said_to_run_past_the_hooks():
    # a tiny T5 trained by transformers' Trainer read "1 module(s) with parameters have no backward row ('shared'):
    # their forward ran past PyTorch's module hooks (a __call__ of their own, as gpytorch's modules have)": `shared`
    # never runs, its weight is tied to modules that do, whose rows measure it
    torch.manual_seed(0)
    batches = [torch.randint(0, 10, (4, 5)) for _ in range(2)]
    workload = TrainingWorkload(_Tied(), batches, inputs=lambda b: b, steps=2, name="tied",
                                loss=_tied_loss)
    report = check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    assert not [n for n in report.notes if "no backward row" in n], report.notes
    assert {"embed", "head"} <= {layer.name for layer in report.levels[-1].layers}


def test_a_failing_level_is_not_told_to_pin_a_tied_module_that_never_runs():
    # the worst gradient is named after the tied weight's first owner, `shared` (named_parameters' name for it),
    # which never runs: pinning it changes nothing. The advice names a module that runs, as the sentence's
    # "the module whose own backward adds the most error" does
    torch.manual_seed(0)
    batches = [torch.randint(0, 10, (4, 5)) for _ in range(2)]
    workload = TrainingWorkload(_Tied(), batches, inputs=lambda b: b, steps=2, name="tied",
                                loss=_tied_loss)
    report = check_training(workload, levels=("highest", "high"), target="a100", tolerance=1e-9, speed=False)
    high = report.level("high")
    assert not high.passed and high.worst_gradient.name == "shared.weight"
    text = " ".join(report.conclusion())
    assert "pin 'shared'" not in text, text
    assert "pin 'head'" in text or "pin 'embed'" in text, text


class _UsedByItsParent(torch.nn.Module):
    """``shared`` never called: its weight used by the model's own functional calls (an embedding lookup and the
    logits' ``F.linear``), as a hand-written language model ties its head to its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Embedding(10, 8)
        self.body = torch.nn.Linear(8, 8)

    def forward(self, ids):
        x = torch.nn.functional.embedding(ids, self.shared.weight)
        return torch.nn.functional.linear(self.body(x), self.shared.weight)


def test_a_module_that_never_ran_whose_weight_its_parent_used_is_not_said_to_run_past_the_hooks():
    # the note said `shared`'s "forward ran past PyTorch's module hooks (a __call__ of their own, as gpytorch's
    # modules have)": it never ran, and its class has PyTorch's own __call__
    torch.manual_seed(0)
    batches = [torch.randint(0, 10, (4, 5)) for _ in range(2)]
    workload = TrainingWorkload(_UsedByItsParent(), batches, inputs=lambda b: b, steps=2, name="used",
                                loss=lambda out, b: torch.nn.functional.cross_entropy(out.flatten(0, 1), b.flatten()))
    report = check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    (note,) = [n for n in report.notes if "no backward row" in n]
    assert "('shared'): they never ran" in note and "hooks" not in note, note


class _TwoHalves(torch.nn.Module):
    """The whole model run once a half of the batch, as a step of two micro-batches runs it; ``shared``: one module
    run once more besides."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.a, self.b, self.shared = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), shared

    def forward(self, x):
        halves = [self.b(torch.tanh(self.a(h))) for h in x.chunk(2)]
        if self.shared:
            halves[0] = halves[0] + self.b(x[:1]).sum()
        return torch.cat(halves)


@pytest.mark.parametrize("shared", [False, True])
def test_a_step_that_runs_every_module_as_often_is_said_so(shared):
    # gradient accumulation through the callbacks runs every module once a micro-batch: "2 module(s) run more than
    # once a step" read as if some modules were shared
    torch.manual_seed(0)
    batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(2)]
    workload = TrainingWorkload(_TwoHalves(shared), batches, loss=mse, inputs=lambda b: b[0], steps=2, name="halves")
    report = tf32lab.check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    (note,) = [n for n in report.notes if "first call" in n]
    if shared:  # 'b' three times, 'a' twice: named
        assert note.startswith("2 module(s) run more than once a step ('a', 'b')"), note
    else:
        assert note.startswith("every module ran 2 times a step (once a micro-batch under gradient accumulation"), note


def test_float64_batches_a_float32_model_refuses_are_said_to_be_the_batches_not_the_precision():
    # "float32 itself (`highest`) fails at step 1: RuntimeError: mat1 and mat2 must have the same dtype" and
    # "no level can be judged": nothing said the batches were float64
    data = [(torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1))] * 2
    workload = TrainingWorkload(torch.nn.Linear(4, 1), data, loss=mse, inputs=lambda b: b[0], name="wide")
    report = check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    assert not report.passed and report.floor.failure is not None
    assert any(note.startswith("the inputs hold float64 tensors ('0')") for note in report.notes), report.notes
    said = " ".join(report.conclusion())
    assert "give the model float32 batches (.float())" in said and "no level can be judged" not in said, said
    benign = TrainingWorkload(torch.nn.Linear(4, 1), [(torch.randn(8, 4), torch.randn(8, 1))] * 2, loss=mse,
                              inputs=lambda b: b[0])
    assert not any("inputs hold" in note for note in check_training(benign, levels=("high",), speed=False).notes)


@pytest.mark.parametrize("off", [lambda: torch.set_grad_enabled(False), torch.no_grad, torch.inference_mode])
def test_training_runs_with_autograd_on_when_the_caller_turned_it_off(off):
    # a library that loads its model can leave autograd off for the whole process (silero-stress's
    # load_accentor calls torch.set_grad_enabled(False)); a training step needs it: the check turns it on for its
    # own steps and leaves the caller's mode as it was, rather than blaming the loss for having no gradient
    was = torch.is_grad_enabled()
    try:
        scope = off()
        with scope if hasattr(scope, "__enter__") else contextlib.nullcontext():
            report = check_training(regression(steps=2), levels=("highest", "high"), target="a100", speed=False)
            tuning = tf32lab.tune(regression(steps=2), target="a100")
            assert not torch.is_grad_enabled()
        assert report.passed and report.level("high").losses and tuning.passed
    finally:
        torch.set_grad_enabled(was)


def test_the_same_command_gives_the_same_training_report_in_every_new_process(tmp_path):
    # a new process draws PyTorch's CPU seed from the operating system; the check's seed (its dropout masks) is drawn
    # from that stream, so without the command seeding it, a dropout model's loss path changed on every run (pesto's
    # encoder: a final loss of 0.27 in one run, 1.40 in the next)
    (tmp_path / "drop.py").write_text(textwrap.dedent("""
        import torch, tf32lab

        def make():
            model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1))
            data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(2)]
            return tf32lab.TrainingWorkload(model, data, loss=lambda o, b: (o - b[1]).pow(2).mean(),
                                            inputs=lambda b: b[0])
    """), encoding="utf-8")
    # one run in a fresh interpreter (its seed the operating system's), one forked from the test's server (its seed
    # the server's start-up one): two processes, two seeds, for the cost of one start-up
    runs = [cli_runner.run("check", "drop.py:make", "--train", "--levels", "highest", "--no-speed", "--json", "-",
                           cwd=tmp_path, timeout=300, fresh=fresh) for fresh in (True, False)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    first, again = (json.loads(r.stdout)["reference_losses"] for r in runs)
    assert first == again


def _conv_training() -> TrainingWorkload:
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 2, 64, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 8, 9), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(448, 1))
    return TrainingWorkload(model, data, loss=mse, inputs=lambda b: b[0], name="convs")


def test_a_training_whose_convolutions_ran_tf32_in_every_row_says_float32s_floor_holds_them():
    # no level sets cuDNN's flag: under PyTorch's default 'tf32' float32's own row ran the convolutions in TF32 too,
    # and its drift, which every level is read against, is not IEEE float32's (pesto's encoder: 8e-3 against 8e-5)
    said = check_training(_conv_training(), levels=("highest", "high"), target="a100", speed=False).notes
    assert any("convolutions ran TF32 in every row, float32's own included" in n and "--conv ieee" in n for n in said)
    for kwargs in ({"target": "a100", "conv": "ieee"}, {"target": "v100"}, {"target": "cpu"}):
        said = check_training(_conv_training(), levels=("highest",), speed=False, **kwargs).notes
        assert not any("ran TF32 in every row" in n for n in said), (kwargs, said)
    # a model without convolutions is told nothing of them
    said = check_training(regression(steps=2), levels=("highest",), target="a100", speed=False).notes
    assert not any("ran TF32 in every row" in n for n in said)


def test_tune_train_whose_convolutions_ran_tf32_in_every_row_says_float32s_floor_holds_them():
    # its search reads every policy against float32's own drift as check_training does, and no policy sets cuDNN's
    # flag: the same note, in the lines the command prints
    tuning = tf32lab.tune(_conv_training(), target="a100", levels=("high", "highest"))
    said = [n for n in tuning.report.notes if "convolutions ran TF32 in every row, float32's own included" in n]
    assert said and said[0] in " ".join(tuning.lines(width=10_000)), tuning.report.notes


def test_a_training_with_cudnn_off_is_not_told_its_convolutions_ran_tf32_in_float32s_row(user_flags):
    # with cuDNN off a convolution runs as PyTorch's own GEMMs at the level's matmul math: float32's row ran it in
    # IEEE float32 whatever cuDNN's flag holds, so no note says it ran TF32 there (a process at 'high' had it said)
    torch.backends.cudnn.enabled = False
    torch.set_float32_matmul_precision("high")
    report = check_training(_conv_training(), levels=("highest",), target="a100", speed=False)
    assert report.floor.maths["conv"] == "ieee"
    assert not any("ran TF32 in every row" in n for n in report.notes), report.notes


def test_a_training_whose_convolutions_are_all_depthwise_is_not_told_they_ran_tf32_in_float32s_row():
    # a GPU runs an NCHW depthwise convolution in PyTorch's own CUDA kernel, which no TF32 flag reaches: float32's row
    # computed it in IEEE float32 (its coverage says so), so no note says it ran TF32 there
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 2, 64, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 2, 9, groups=2), torch.nn.Tanh(), torch.nn.Flatten(),
                                torch.nn.Linear(112, 1))
    depthwise = TrainingWorkload(model, data, loss=mse, inputs=lambda b: b[0], name="depthwise")
    report = check_training(depthwise, levels=("highest", "high"), target="a100", speed=False)
    assert "aten::convolution ieee" in report.floor.coverage
    assert not any("ran TF32 in every row" in n for n in report.notes), report.notes
    # and each row's conv math says so, as check's rows do (the table's TF32, before)
    assert {row.level: row.maths["conv"] for row in (report.floor, *report.levels)} == \
        {"float32": "ieee", "highest": "ieee", "high": "ieee"}


def test_depthwise_convolutions_summed_as_the_hardware_does_are_not_told_they_ran_tf32_in_float32s_row():
    # accumulation="hardware" labels each count with its sum ("ieee, ideal sum"): the math is still IEEE float32's,
    # so a float32 row that ran only depthwise convolutions ran none in TF32
    from tf32lab.emulation.emulator import emulate
    from tf32lab.machine.hardware import resolve_target
    from tf32lab.measure.training import cudnn_floor_note

    with emulate("a100", accumulation="hardware") as emu:
        torch.nn.Conv1d(2, 2, 9, groups=2)(torch.randn(1, 2, 16))
    assert dict(emu.coverage) == {("aten::convolution", "ieee, ideal sum"): 1}
    a100 = resolve_target("a100")
    assert cudnn_floor_note({"conv"}, a100, emu.coverage) is None
    summed = {("aten::convolution", "tf32-rna, nvidia k4 f24"): 1}
    assert "ran TF32 in every row" in cudnn_floor_note({"conv"}, a100, summed)
    assert "ran TF32 at every level" in cudnn_floor_note({"conv"}, a100, {("aten::convolution", "tf32-rna"): 1},
                                                         {("aten::convolution", "ieee, ideal sum"): 1})


def test_the_note_on_convolutions_in_tf32_leaves_out_a_policy_row_that_ran_them_in_ieee():
    # a policy that gives the convolutions conv='ieee' ran them in IEEE float32 in its row: the note on float32's
    # row says TF32 at every level, not in every row
    policy = tf32lab.Policy.from_dict(
        {"schema_version": 2, "default": "high", "rules": [{"pattern": "0", "level": "high", "conv": "ieee"}]})
    report = check_training(_conv_training(), levels=("highest", "high"), target="a100", speed=False, policy=policy)
    assert "aten::convolution ieee" in report.level("policy").coverage
    said = [n for n in report.notes if "float32's own included" in n]
    assert said and "in every row" not in said[0] and "ran TF32 at every level, float32's own included" in said[0]



@pytest.mark.parametrize("run", [
    lambda w: check_training(w, levels=("high",), target="a100", conv="ieee", speed=False),
    lambda w: tf32lab.tune(w, target="a100", levels=("high",), conv="ieee").report,
], ids=["check_training", "tune"])
def test_a_conv_math_given_for_a_training_without_convolutions_is_said_to_have_set_the_flag_alone(run):
    # as check says it: conv='ieee' set cuDNN's flag, and no convolution ran (the note said they ran at it)
    said = run(regression(steps=1)).notes
    assert any("the model ran no convolution" in n for n in said), said
    assert not any("convolutions ran at cudnn.conv" in n for n in said), said


class _OuterOffset(torch.nn.Module):
    """A Linear, then the model's own product outside any submodule on an offset TF32 takes away: TF32 ruins the
    output, and so the gradient reaching the Linear, while the Linear's own backward stays close to float32's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("m", torch.randn(16, 1))

    def forward(self, x):
        return (self.lin(x) + 1000.0) @ self.m - 1000.0 * self.m.sum(0)


def test_a_pin_whose_own_backward_adds_little_of_the_gradients_error_is_called_a_guess():
    # kornia's find_homography_dlt in a model's own forward, fed weights by a small MLP: "gradients of 'net.2.bias'
    # are off by 4e-01 ...; pin 'net.2'", whose own backward added 8e-04, and the pinned run diverged earlier than
    # `high` did; where the damage is the module's forward (Offset), pinning it does help: either may be
    torch.manual_seed(0)
    workload = TrainingWorkload(_OuterOffset(), offset_batches, loss=mse, inputs=lambda b: b[0], steps=3,
                                optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), name="outer")
    report = check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    high = report.level("high")
    assert not high.passed and high.layers[0].introduced < high.worst_gradient.normwise / 100
    text = " ".join(report.conclusion())
    assert "pin 'lin'" in text and "(--policy): a guess, its own backward adding little" in text, text
    assert "only a run tells which" in text, text


def test_a_callbacks_report_is_in_the_callbacks_words_not_the_clis():
    # a callback's LSTM report said "train with conv='ieee' (`--conv ieee`)" and was headed "tf32lab check --train":
    # its user gave the callback conv=, and ran no command
    import io

    from rich.console import Console

    from tf32lab.integrations._loop import run_check, stepping_copy

    class Recurrent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(4, 4, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0].pow(2).mean()

    torch.manual_seed(0)
    batches = [(step, [torch.randn(2, 3, 4)]) for step in range(2)]
    report = run_check(stepping_copy(Recurrent()), "rnn", batches, lambda model, micro, step: model(micro[0]),
                       lambda params: torch.optim.SGD(params, lr=1e-2), levels=("highest", "high"), target="a100",
                       tolerance=None)
    notes = " ".join(report.notes)
    assert "RNNs ran TF32" in notes and "conv='ieee'" in notes and "--conv" not in notes, notes
    out = io.StringIO()
    Console(file=out, width=80).print(report)
    assert "tf32lab check --train" not in out.getvalue() and "tf32lab training check" in out.getvalue()


def test_a_training_reports_asked_is_check_or_callback():
    # any other word was taken as "check" silently: a callback's report given "Callback" advised `tf32lab tune`
    import math

    from tf32lab.report.training import TrainingLevel, TrainingReport

    floor = TrainingLevel("float32", {}, (1.0,), (0.0,), None, (), (), (), math.nan, 1.0, True, {}, {}, 0.0)
    report = TrainingReport("w", "a100", 1, 1e-3, (1.0,), floor, (), {}, 0.0)
    assert dataclasses.replace(report, asked="callback").asked == "callback"
    with pytest.raises(Tf32LabError, match="asked must be one of 'check', 'callback', not 'Callback'"):
        dataclasses.replace(report, asked="Callback")
