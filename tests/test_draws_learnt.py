"""The float64 reference draws each random value at the dtype its float32 rows draw it, learnt from the first
row where a ``torch.dtype`` cannot tell: one read off a widened tensor and kept (torchsde's
``BrownianInterval(dtype=y0.dtype)``) is float64 in the reference and float32 in every row, and a draw on a tensor
the model made float64 through arithmetic is float64 in the rows. A reference that drew otherwise failed
``highest`` at 0.76 normwise, blamed on float32's amplification; draws that cannot be matched are said in a note."""

from __future__ import annotations

import torch

import tf32lab


class _Noise(torch.nn.Module):
    def __init__(self, like: torch.Tensor) -> None:
        super().__init__()
        self.dtype_ = like.dtype  # read when made, kept: float64 in the reference, float32 in the rows

    def forward(self, x):
        h = x * 2  # arithmetic between the read and the draw
        return h * 0 + torch.randn(x.shape, dtype=self.dtype_, generator=torch.Generator().manual_seed(1))


class _Kept(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x + _Noise(x)(x))


class _Through(torch.nn.Module):
    """Draws on a tensor it made float64 through arithmetic: float64 in its rows too."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.l1(x)
        noise = torch.rand_like(h.double() * 2)
        return self.l2(torch.tanh((h.double() + noise).float()))


def _check(model: torch.nn.Module, levels=("highest",)) -> tf32lab.Report:
    torch.manual_seed(0)
    return tf32lab.check(tf32lab.Workload(model, torch.randn(16, 8)), levels=levels, speed=False)


def test_a_dtype_read_off_a_widened_tensor_and_kept_draws_as_the_rows_do():
    torch.manual_seed(0)
    report = _check(_Kept())
    assert report.level("highest").outputs[0].normwise < 1e-5, report.level("highest").outputs[0]
    assert report.passed and "amplifies" not in " ".join(report.conclusion())
    assert any("run again drawing each as the rows do" in note for note in report.notes), report.notes


def test_a_float64_draw_through_arithmetic_is_float64_in_the_reference_too():
    torch.manual_seed(0)
    report = _check(_Through())
    assert report.level("highest").outputs[0].normwise < 1e-5, report.level("highest").outputs[0]
    assert any("(1 at float64" in note for note in report.notes), report.notes


def test_the_second_row_is_compared_with_the_learnt_reference():
    torch.manual_seed(0)
    report = _check(_Kept(), levels=("highest", "high"))
    assert report.level("highest").outputs[0].normwise < 1e-5
    assert 1e-5 < report.level("high").outputs[0].normwise < 1e-1  # TF32's own error, not the noise's


def test_a_model_that_draws_nothing_gets_no_note():
    torch.manual_seed(0)
    report = _check(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)))
    assert not any("draw" in note for note in report.notes), report.notes


class _Branching(torch.nn.Module):
    """Draws twice where its input reads float64 (the reference's, widened), once in the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(2 if x.dtype == torch.float64 else 1):
            x = x + torch.rand_like(x)
        return self.lin(x)


def test_draws_that_cannot_be_matched_are_said_and_not_blamed_on_float32():
    torch.manual_seed(0)
    report = _check(_Branching())
    assert any("random draws could not be matched" in note for note in report.notes), report.notes
    assert not report.level("highest").passed
    assert "made other random draws" in report.conclusion()[0], report.conclusion()
