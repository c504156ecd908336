"""What ``check`` and ``check_training`` hold once they return: nothing. Their recorders and modes refer back to
their owners; a cycle among them kept each layer's float64 output, the rows' model copies and the model itself
alive until the garbage collector's next full pass, which comes at a time of its own choosing (rarely, in a
process that holds many objects, and never where it is off: ``timeit`` turns it off). The collector is off here."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

import tf32lab
from tf32lab.measure import resolution


@pytest.fixture
def no_collector() -> Iterator[None]:
    # no collection first (a full one costs 0.1-0.2 s in a test worker): what is garbage already stays so, counted
    # alike before and after
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))


def _elements(dtype: torch.dtype) -> int:
    return sum(o.numel() for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)
               and o.dtype == dtype)


@pytest.mark.parametrize("tolerance", [1e-7, 1.0], ids=["failing", "passing"])
def test_a_check_holds_no_kept_output_once_it_returns(no_collector, tolerance):
    # all-MiniLM-L6-v2's kept outputs: 212 MB a check, the process growing by as much at each check, and each
    # check's reference paging its memory in afresh (55,000 page faults a check)
    model = _mlp()
    before = _elements(torch.float64)
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(4, 16), name="mlp"), levels=("highest", "high"),
                           tolerance=tolerance, speed=False)
    assert report.level("high").passed is (tolerance == 1.0)
    assert _elements(torch.float64) == before


def test_the_model_goes_when_its_owner_drops_it_after_a_check(no_collector):
    model = _mlp()
    tf32lab.check(tf32lab.Workload(model, torch.randn(4, 16), name="mlp"), levels=("highest", "high"))
    gone = weakref.ref(model)
    del model
    assert gone() is None


def test_a_training_check_holds_no_copy_of_the_model_once_it_returns(no_collector):
    # each row trains a copy of the model: three copies a check were left to the collector
    model = _mlp()
    batches = [(torch.randn(4, 16), torch.randn(4, 8)) for _ in range(3)]
    workload = tf32lab.TrainingWorkload(model, batches, loss=lambda out, b: (out - b[1]).pow(2).mean(),
                                        inputs=lambda b: b[0], optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    tf32lab.check_training(workload, levels=("highest", "high"))  # the first: what a process loads once
    before = _elements(torch.float32), _elements(torch.float64)
    tf32lab.check_training(workload, levels=("highest", "high"))
    assert (_elements(torch.float32), _elements(torch.float64)) == before


_PASSES: list[int] = []  # the float64 passes so far (not the model's: check puts its attributes back before each run)


class _AtTheReference(torch.nn.Module):
    """An MLP whose float64 reference raises (``raises``: at its ``at``-th float64 pass) or is NaN throughout."""

    def __init__(self, how: str, at: int = 1) -> None:
        super().__init__()
        self.mlp, self.how, self.at = _mlp(), how, at
        _PASSES.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        if resolution.running():
            _PASSES.append(1)
            if self.how == "nan":
                return y * float("nan")
            if len(_PASSES) % self.at == 0:
                raise ValueError("no reference")
        return y


@pytest.mark.parametrize("how", ["raises", "nan"])
def test_a_check_refused_at_the_float64_reference_holds_nothing(no_collector, how):
    # the recorder and its float64 mode referred to each other, and the reference's kept ops (measure.scales) to
    # their keeper: each cycle kept the model, and the layers' kept outputs, once the error was raised
    model = _AtTheReference(how)
    before = _elements(torch.float64)
    with pytest.raises(tf32lab.Tf32LabError, match="float64 reference"):
        tf32lab.check(tf32lab.Workload(model, torch.randn(4, 16), name="mlp"), levels=("highest", "high"))
    gone = weakref.ref(model)
    del model
    assert gone() is None
    assert _elements(torch.float64) == before


def test_a_check_whose_second_reference_raises_holds_nothing(no_collector):
    # the levels fail, and the second float64 pass (each layer's introduced error) raises: the report stands, and
    # the second pass's recorder, dropped, held the model
    model = _AtTheReference("raises", at=2)
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(4, 16), name="mlp"), levels=("highest", "high"),
                           tolerance=1e-12, speed=False)
    assert any("introduced error at" in note and "not measured" in note for note in report.notes)
    gone = weakref.ref(model)
    del model, report
    assert gone() is None


def test_counting_entered_by_hand_counts_while_its_modes_are_on_the_stack():
    # its __enter__ gives its Counts, not itself: entered so, nothing but its modes held it, and their reference
    # to it is weak (every op then raised ReferenceError); they hold it while they are on the stack
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from tf32lab.control import modestack
    from tf32lab.speed.counting import Counting

    before = [*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack()]
    counts = Counting().__enter__()
    try:
        torch.nn.Linear(4, 4)(torch.ones(2, 4))
    finally:
        for mode in [*_get_current_dispatch_mode_stack(), *_get_current_function_mode_stack()]:
            if not any(mode is other for other in before):
                modestack.remove(mode)
    assert any(op.family == "matmul" for op in counts.ops), counts.ops
