"""measure.choices: a top-k compared as a set, a row whose choice ops part from the reference's compared up to
there, and the reference's indices kept within their budget."""

from __future__ import annotations

import torch

from tf32lab.measure import choices
from tf32lab.measure.choices import ChoiceLog, Kept, compared


def _kept(run) -> Kept:
    kept = Kept()
    with ChoiceLog() as log:
        run()
    for name, indices in log.choices:
        kept.choices.append((name, indices))
    return kept


def test_a_top_k_in_another_order_is_the_same_choice():
    scores = torch.tensor([[0.1, 0.9, 0.8, 0.0]])
    reference = _kept(lambda: scores.topk(2))
    with ChoiceLog() as row:
        torch.tensor([[0.1, 0.8, 0.9, 0.0]]).topk(2)  # the same two experts, the other first
    assert compared(reference.choices, row.choices) == choices.Choices(0, 2, (), True)
    with ChoiceLog() as row:
        torch.tensor([[0.95, 0.8, 0.9, 0.0]]).topk(2)  # another expert in: one index of two differs
    assert compared(reference.choices, row.choices) == choices.Choices(1, 2, ("aten::topk",), True)


def test_a_row_whose_choice_ops_part_is_compared_up_to_there():
    x = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    reference = _kept(lambda: (x.argmax(1), x.sort(1)))
    with ChoiceLog() as row:
        x.argmax(1)
        x.topk(1)  # another op where the reference sorted
    assert compared(reference.choices, row.choices) == choices.Choices(0, 2, (), False)
    assert compared([], row.choices) is None


def test_the_reference_keeps_indices_within_its_budget(monkeypatch):
    monkeypatch.setattr(choices, "BUDGET", 5)
    kept = Kept()
    x = torch.randn(2, 3)
    for _ in range(3):
        kept.keep(torch.ops.aten.argmax.default, (x, 1), {}, x.argmax(1))
    assert len(kept.choices) == 2 and kept.full  # 2 + 2 of 5, the third left out
    kept.keep(torch.ops.aten.max.default, (x,), {}, x.max())  # a value, not an index: no choice
    assert len(kept.choices) == 2


class _Counting(torch.nn.Module):
    """A linear layer beside integer maxima (no index chosen) and an argsort (the reference may run it as a sort)."""

    def __init__(self, argsort: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 8)
        self.argsort = argsort

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.max(torch.arange(4), torch.arange(4).flip(0)).sum() + torch.tensor([1, 0, 2]).max()
        h = self.linear(x) + steps
        return h + torch.argsort(h, 1).float() if self.argsort else h


def test_a_maximum_of_integers_is_no_choice():
    import tf32lab

    report = tf32lab.check(tf32lab.Workload(_Counting(False), torch.randn(4, 16)), levels=("highest", "high"),
                           speed=False)
    assert all(level.choices is None for level in report.levels), [level.choices for level in report.levels]


def test_an_argsort_is_compared_with_the_references_however_it_ran():
    import tf32lab

    report = tf32lab.check(tf32lab.Workload(_Counting(True), torch.randn(4, 16)), levels=("highest",), speed=False)
    assert report.level("highest").choices == choices.Choices(0, 32, (), True)


def test_a_row_that_makes_more_choice_ops_than_the_reference_is_not_comparable():
    x = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    reference = _kept(lambda: x.argmax(1))
    with ChoiceLog(len(reference.choices)) as row:  # as check logs a row: no more than the reference's kept
        x.argmax(1)
        x.argmax(1)  # one more (a loop that ran once more at this level)
    assert compared(reference.choices, row.choices, row.more) == choices.Choices(0, 2, (), False)
    with ChoiceLog(len(reference.choices)) as row:
        x.argmax(1)
    assert compared(reference.choices, row.choices, row.more) == choices.Choices(0, 2, (), True)


def test_a_median_mode_or_running_max_along_a_dim_is_a_choice_and_over_everything_is_not():
    x = torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]])
    for run in (lambda: x.median(1), lambda: x.nanmedian(1), lambda: x.mode(1), lambda: x.cummax(1),
                lambda: x.cummin(1)):
        assert len(_kept(run).choices) == 1
    assert _kept(lambda: (x.median(), x.nanmedian())).choices == []  # a value: nothing chosen by index
