"""Error of an output against its reference: the numbers a report shows, each defined once.

All are computed in float64 from the output ``y`` and the reference ``r`` (same shape):

- ``max_abs``: max |y − r|;
- ``max_rel`` / ``mean_rel``: |y − r| / |r| over the elements whose |r| is at least ``REL_FLOOR`` × max |r|
  (relative error of a reference that is zero, or nearly, says nothing);
- ``normwise``: ‖y − r‖₂ / ‖r‖₂ over the whole output, the number verdicts use (:data:`DEFAULT_TOLERANCE`); where
  the reference is zero or cancels (‖r‖ at most :data:`CANCELLED` of the magnitudes that formed it, a
  :class:`Scale` recorded by the caller), ‖y − r‖₂ over those magnitudes instead, and ``scale`` says so;
- ``cosine``: the smallest cosine similarity of a row (the last dimension) with its reference row (1 for a row
  of zeros in both; rows of one value, an ``(N, 1)``, as one row: their column);
- ``top1``: for outputs named like logits, the fraction of rows whose argmax agrees;
- ``histogram``: counts of |y − r| / rms(r) in decades (:data:`HISTOGRAM_EDGES`).

:func:`compare` takes any output leaf, not only float tensors (docs/design.md, "outputs"):

- a float (or complex, as real/imaginary pairs) tensor gets the metrics above; NaN and Inf are compared by position
  and value (they must be where the reference has them, the same ones), the metrics then cover the finite rest,
  and ``note`` says the output holds them;
- an integer or bool tensor, and a Python number, string or ``None``, is compared exactly; an object with no
  equality of its own (a KV cache: each run makes another) is said not compared (:data:`NOT_COMPARED`);
- an output whose shape differs from its reference's fails with that as its ``failure`` (data-dependent control
  flow: a detector that kept another number of boxes);
- an empty tensor passes when its shape is the reference's, with a note (there is nothing else to compare).

Example:

    >>> import torch
    >>> from tf32lab.numbers import metrics
    >>> r = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    >>> e = metrics.output_error("logits", r + 1e-3, r)
    >>> round(e.max_abs, 6), round(e.max_rel, 6), e.top1
    (0.001, 0.001, 1.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from tf32lab.errors import Tf32LabError

__all__ = ["ABSENT", "CANCELLED", "DEFAULT_TOLERANCE", "HISTOGRAM_EDGES", "OPERANDS", "REFERENCE", "OutputError",
           "Partial", "Scale", "bias", "comparable", "compare", "dtype_limits", "is_logits", "multiple", "norm",
           "normwise", "normwise_over", "output_error", "overflow_shift", "pairs", "reference_extent", "row_chunks",
           "rows_of"]

# The default verdict: normwise relative error at most 1e-2, i.e. the output keeps two significant digits as a
# whole. A well-conditioned network stays well below it at every reduced level (TF32's unit roundoff is
# 2^-11 ≈ 4.9e-4, bf16's 2^-8 ≈ 3.9e-3; all-MiniLM-L6-v2 measures 5.5e-4 under TF32 and 4.7e-3 under bf16);
# a computation that amplifies rounding (a rotation undone step by step, a one-pass covariance) goes past it.
# Past 1e-2, embeddings lose more than ~5e-5 of cosine similarity and close logits change order.
DEFAULT_TOLERANCE = 1e-2
REL_FLOOR = 1e-6
# An output whose float64 reference has a norm at most this fraction of the magnitudes that formed it (a residual
# ``R.T @ (R @ x) - x``, a difference of nearly equal terms) is judged over those magnitudes, not its own norm.
# float32 keeps ~7 digits of those magnitudes (u = 2^-24 ≈ 6e-8); below 1e-4 of them, float32's own rounding
# (a few units of u, more over long sums) already makes the relative error reach 1e-2, the default tolerance, and
# a zero reference makes it infinite: the relative error would judge float32, not the level (pytorch#79270).
CANCELLED = 1e-4
REFERENCE, OPERANDS = "reference", "operands"  # the scales an output's normwise error can be over
# decades of |y - r| / rms(r), from 1e-10 to 1e+1; errors below the first edge (zeros included) count in bin 0
HISTOGRAM_EDGES = tuple(float(e) for e in range(-10, 2))


@dataclass(frozen=True)
class Scale:
    """The magnitudes that formed an output: ``norm`` is ‖op(|a|, |b|, ...)‖₂, its last op computed over the
    absolute values of its operands (a difference as a sum), in float64; ``op`` names that op (``aten::sub``)."""

    norm: float
    op: str


@dataclass(frozen=True)
class OutputError:
    """One output's error against its reference. ``passed`` compares ``normwise`` with ``tolerance``."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    mean_rel: float
    normwise: float
    cosine: float
    top1: Optional[float]
    histogram: tuple[int, ...]
    tolerance: float
    failure: Optional[str] = None  # why it fails whatever its error: another shape, other exact values
    note: Optional[str] = None  # what a reader must know: NaN/Inf held, compared exactly, empty
    exact: bool = False  # compared for equality (not a float tensor): no tolerance applies
    bias: float = 0.0  # mean signed error over mean |reference|: a rounding that leans one way (MI300's XF32)
    # what ``normwise`` is over: the reference's norm, or (OPERANDS) the magnitudes that formed the output, where
    # the reference is zero or cancels (CANCELLED)
    scale: str = REFERENCE
    # the error over float32 `highest`'s own on the target (same output, same scale); None: not known
    multiple: Optional[float] = None

    @property
    def passed(self) -> bool:
        if self.failure is not None:
            return False
        return self.exact or self.normwise <= self.tolerance  # NaN compares False: a NaN error fails

    def verdict(self, level: Optional[str] = None) -> str:
        """A line to grep: ``PASSED | level 'high' | output 'x' | normwise 1.2e-04 <= 1.0e-02``, followed by
        ``(over the magnitudes that formed it)`` where the reference is zero or cancels (``scale``)."""
        where = "" if level is None else f" | level {level!r}"
        if self.failure is not None:
            return f"FAILED{where} | output {self.name!r} | {self.failure}"
        if self.exact and self.note is not None and NOT_COMPARED in self.note:
            return f"PASSED{where} | output {self.name!r} | {self.note}"
        if self.exact:
            return f"PASSED{where} | output {self.name!r} | equal (compared exactly)"
        word, sign = ("PASSED", "<=") if self.passed else ("FAILED", ">")
        over = " (over the magnitudes that formed it)" if self.scale == OPERANDS else ""
        return (f"{word}{where} | output {self.name!r} | normwise {self.normwise:.2e} {sign} {self.tolerance:.1e}"
                f"{over}")


def normwise(y: torch.Tensor, r: torch.Tensor) -> float:
    """‖y − r‖ / ‖r‖ in float64; 0 when both are zero, inf when only the reference is."""
    r64 = r.double()
    return _ratio(norm(y.double() - r64), norm(r64))


# Where a float64 norm lies in these bounds, no square in its sum overflowed, and the squares that underflowed
# (of elements below ~1e-154) are below 1e-28 of it per element: the plain norm is exact to float64's rounding
_SAFE_NORMS = (1e-140, 1e140)


def norm(t: torch.Tensor) -> float:
    """‖t‖₂ in ``t``'s precision, over the largest magnitude where the squares of the elements would overflow or
    underflow (1e200 and 1e-300 have a norm; torch's is inf and 0 there, as its BLAS-free sum of squares is
    unscaled).

    >>> norm(torch.full((4,), 1e200, dtype=torch.float64)), norm(torch.full((4,), 1e-300, dtype=torch.float64))
    (2e+200, 2e-300)
    """
    found = float(torch.linalg.vector_norm(t))
    if math.isnan(found) or _SAFE_NORMS[0] <= found <= _SAFE_NORMS[1] or t.numel() == 0:
        return found
    top = float(t.abs().max())
    if top == 0 or not math.isfinite(top):
        return top
    return top * float(torch.linalg.vector_norm(t / top))


def _ratio(diff: float, ref: float) -> float:
    """``diff / ref``, the norms of the difference and the reference: 0 when both are zero, inf when only ``ref``."""
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref


def normwise_over(found: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """:func:`normwise` of several tensors taken as one vector, without joining them into one: each difference
    is made in float64 as it is read (a float32 tensor is not copied to float64 first), and the norms are
    combined with :func:`math.hypot`, which neither overflows nor underflows where their squares would (1e200,
    1e-200). An optimizer's state over a 22M-parameter model was four float64 copies of 45M numbers. Complex
    tensors are compared in complex128, their imaginary parts included.

    >>> normwise_over([torch.ones(3), torch.zeros(1)], [torch.full((3,), 2.0, dtype=torch.float64), torch.zeros(1)])
    0.5
    """
    if len(found) != len(reference):
        raise ValueError(f"normwise_over: {len(found)} tensors found against {len(reference)} in the reference; "
                         f"the same number is accepted")
    diffs, refs = [], []
    for y, r in zip(found, reference):
        wide = torch.complex128 if y.is_complex() or r.is_complex() else torch.float64
        r64 = r.detach().to(wide)  # the same tensor when it is float64 already
        # a bool or integer tensor cannot be subtracted from as it is (bool) or is promoted anyway: widen it
        y = y.detach() if y.is_floating_point() and not r.is_complex() else y.detach().to(wide)
        diffs.append(norm(torch.sub(r64, y)))
        refs.append(norm(r64))
    return _ratio(_combined(diffs), _combined(refs))


def _combined(norms: list[float]) -> float:
    """The norm of the norms, as the norm of the joined vector: NaN where one is NaN (math.hypot says inf there
    when another is inf, torch's norm of the joined vector NaN)."""
    return math.nan if any(math.isnan(n) for n in norms) else math.hypot(*norms)


def output_error(name: str, y: torch.Tensor, r: torch.Tensor, tolerance: float = DEFAULT_TOLERANCE,
                 scale: Optional[Scale] = None, *, held: int = 0) -> OutputError:
    """The metrics of the module docstring for output ``name``; ``scale``: the magnitudes that formed it, over
    which ``normwise`` is taken where the reference cancels to at most :data:`CANCELLED` of them; ``held``: how
    many positions are zero in both in place of a NaN or Inf they both hold (:func:`compare`), left out of the
    counts (the histogram's, the mean magnitude's).

    Computed over chunks of whole rows (:data:`CHUNK` elements or one row), each widened to float64 as it is read:
    a language model's logits (tens of millions of numbers) made about fifteen float64 buffers their size before,
    GBs of pages to fault in, and a boolean gather over all of them. Sums and norms are combined over the chunks
    (the norms with :func:`math.hypot`), so they may differ from one reduction over the whole in their last bits.

    >>> r = torch.zeros(4, dtype=torch.float64)                 # a residual whose reference is exactly zero
    >>> e = output_error("residual", r + 1e-5, r, scale=Scale(2000.0, "aten::sub"))
    >>> e.scale, f"{e.normwise:.0e}", e.passed
    ('operands', '1e-08', True)
    """
    if y.shape != r.shape:
        raise ValueError(f"output {name!r} has shape {tuple(y.shape)}, its reference {tuple(r.shape)}")
    shape = tuple(y.shape)
    y, r = pairs(y.detach()), pairs(r.detach())
    n = y.numel()
    if n == 0:
        return OutputError(name, shape, 0.0, 0.0, 0.0, 0.0, 1.0, None, (0,) * len(HISTOGRAM_EDGES), tolerance)
    rows_y, rows_r = rows_of(y), rows_of(r)
    # the reference alone first: its norm (is it cancelled?) and largest magnitude (which elements have a relative
    # error) come before the errors
    ref_norm, top = reference_extent(rows_r)
    count = n - held  # the positions with values
    over, note, rms = REFERENCE, None, ref_norm / math.sqrt(count)
    cancelled = scale is not None and scale.norm > 0 and math.isfinite(scale.norm) and \
        ref_norm <= CANCELLED * scale.norm
    if cancelled:  # the bias and the histogram over those magnitudes too
        over, note, rms = OPERANDS, scale_note(ref_norm, scale), scale.norm / math.sqrt(count)
    logits = is_logits(name, y)
    part = Partial().add(rows_y, rows_r, REL_FLOOR * top, rms, logits)
    if not (math.isfinite(ref_norm) and math.isfinite(part.diff_norm)) and math.isfinite(top):
        shift = _overflow_shift(y, top, n)
        if shift:
            # finite values whose norm (or difference) is past float64's largest, 1.7e308 each: an infinite norm
            # made a 1e-3 error 0.0 (and -r NaN). Every metric but max_abs is the same over both scaled down by a
            # power of two (exact); max_abs is scaled back (inf where it is past float64's largest itself)
            down = 2.0 ** -shift
            small = Scale(scale.norm * down, scale.op) if scale is not None else None
            found = output_error(name, y.double() * down, r.double() * down, tolerance, small, held=held)
            return dataclasses.replace(found, shape=shape, max_abs=found.max_abs / down)
    error = part.diff_norm / scale.norm if cancelled else _ratio(part.diff_norm, ref_norm)
    magnitude = rms if cancelled else part.magnitude / count
    part.counts[0] -= held  # their errors, zero, counted in the first bin
    return OutputError(name, shape, part.max_abs, part.max_rel, part.rel / part.rel_n if part.rel_n else 0.0,
                       error, part.cosine, part.agree / rows_y.shape[0] if logits else None,
                       tuple(int(c) for c in part.counts), tolerance, note=note,
                       bias=bias(part.signed / count, magnitude), scale=over)


def _overflow_shift(y: torch.Tensor, top: float, n: int) -> int:
    """The power of two to scale an output and its reference (largest magnitude ``top``) down by, so that their
    norms and differences stay in float64's range; 0 where ``y`` holds NaN or Inf, or no scaling helps."""
    return overflow_shift(_largest(top, float(y.abs().max())), n)  # NaN where y holds one


def overflow_shift(peak: float, n: int) -> int:
    """The power of two that brings ``n`` values of largest magnitude ``peak`` (an output and its reference)
    down far enough that their norms and differences stay in float64's range; 0 where ``peak`` is not finite
    or no scaling is needed.

    >>> overflow_shift(1.0, 16), overflow_shift(1.7e308, 16)
    (0, 6)
    """
    if not math.isfinite(peak):
        return 0
    return max(0, math.frexp(peak)[1] + math.frexp(math.sqrt(n))[1] + 2 - 1023)


def bias(signed: float, magnitude: float) -> float:
    """The mean signed error over the mean magnitude, signed infinity where the magnitude is zero."""
    if magnitude > 0:
        return signed / magnitude
    return 0.0 if signed == 0 else math.copysign(math.inf, signed)


def pairs(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as (real, imaginary) pairs in float64 (a last dimension of 2), as :func:`compare` takes
    it; any other as it is."""
    return torch.view_as_real(t.to(torch.complex128)) if t.is_complex() else t


def is_logits(name: str, y: torch.Tensor) -> bool:
    """Whether output ``name`` gets ``top1``: named like logits, with more than one per row."""
    return "logit" in name.lower() and y.dim() >= 1 and y.shape[-1] > 1


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` as rows of its last dimension (a 0-d tensor as one row of one)."""
    return t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)


# Elements in a chunk of an output's compare (whole rows: one row where a row is longer): 2 MiB of float64, so
# that a chunk's few buffers stay in the caches between the passes over it
CHUNK = 1 << 18


def row_chunks(rows: torch.Tensor) -> list[slice]:
    """Slices of whole rows of ``rows`` (a :func:`rows_of` view), about :data:`CHUNK` elements each."""
    step = max(1, CHUNK // max(1, rows.shape[1]))
    return [slice(start, start + step) for start in range(0, rows.shape[0], step)]


def reference_extent(rows_r: torch.Tensor) -> tuple[float, float]:
    """The norm of a reference (:func:`rows_of`) and its largest magnitude (NaN where it holds NaN), in float64
    a chunk at a time."""
    norms, top = [], []
    for rows in row_chunks(rows_r):
        part = _wide(rows_r[rows])
        norms.append(norm(part))
        low, high = torch.aminmax(part)
        top.append(_largest(-float(low), float(high)))
    return _combined(norms), _largest(*top)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 (itself when it is)."""
    return t if t.dtype == torch.float64 else t.double()


def _largest(*values: float) -> float:
    """The largest of ``values``, NaN where one is NaN (as a tensor's ``max`` says; Python's ``max`` does not)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


class Partial:
    """What an output's metrics add up, or take the largest of, over chunks of its rows (or over the ranks that
    each hold some rows: ``measure.sharded``): the signed error, the magnitude, the relative errors and their
    count, the rows whose argmax agrees, the histogram's counts; and the norm of the error, its largest magnitude
    and relative value, the smallest cosine.

    >>> r = torch.ones(2, 3, dtype=torch.float64)
    >>> part = Partial().add(rows_of(r + 0.5), r, threshold=1e-6, rms=1.0, logits=False)
    >>> part.max_rel, part.rel / part.rel_n, part.cosine
    (0.5, 0.5, 1.0)
    """

    def __init__(self) -> None:
        self._diff_norms: list[float] = []
        self._max_abs: list[float] = []
        self._max_rel: list[float] = []
        self._cosine: list[float] = []
        self.signed = self.magnitude = self.rel = 0.0
        self.rel_n = self.agree = 0
        self.counts = torch.zeros(len(HISTOGRAM_EDGES), dtype=torch.int64)

    @property
    def diff_norm(self) -> float:
        return _combined(self._diff_norms)

    @property
    def max_abs(self) -> float:
        return _largest(*self._max_abs)

    @property
    def max_rel(self) -> float:
        """0 where no element has a relative error."""
        return _largest(*self._max_rel) if self._max_rel else 0.0

    @property
    def cosine(self) -> float:
        return -_largest(*(-c for c in self._cosine))

    def add(self, rows_y: torch.Tensor, rows_r: torch.Tensor, threshold: float, rms: float,
            logits: bool) -> Partial:
        """Rows of an output and of its reference (:func:`rows_of`), a chunk at a time; ``threshold``: the smallest
        |r| with a relative error; ``rms``: the histogram's scale; ``logits``: count the rows whose argmax agrees."""
        for rows in row_chunks(rows_r):
            self._chunk(_wide(rows_y[rows]), _wide(rows_r[rows]), threshold, rms, logits)
        return self

    def _chunk(self, y: torch.Tensor, r: torch.Tensor, threshold: float, rms: float, logits: bool) -> None:
        diff = y - r
        self.signed += float(diff.sum())
        self._diff_norms.append(norm(diff))
        self._cosine.append(float(_cosines(y, r).min()))
        if logits:
            self.agree += int((y.argmax(-1) == r.argmax(-1)).sum())
        diff.abs_()
        self._max_abs.append(float(diff.max()))
        work = r.abs()
        self.magnitude += float(work.sum())
        big = work >= threshold
        count = int(big.sum())
        if count:
            # |y - r| / |r| where |r| is large enough, 0 elsewhere: the sum and the largest of those
            rel = torch.div(diff, work, out=work).masked_fill_(big.logical_not_(), 0.0)
            self.rel += float(rel.sum())
            self.rel_n += count
            self._max_rel.append(float(rel.max()))
        self.counts += _decades(diff, rms, work)


def _cosines(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The cosine similarity of each row of ``y`` with its row of ``r`` (1 where both are zero: the same row, such
    as a padded position's, where ``cosine_similarity`` says 0 and a report's smallest cosine read 0.0 for an
    output equal to its reference; 0 where one alone is), rows whose norms are out of :data:`_SAFE_NORMS` taken
    over their largest magnitudes: ``cosine_similarity`` says 0 for rows of 1e200 and 13.7 for rows of 1e-300.
    Rows of one value (a regression or value head's ``(N, 1)``) have no direction, a cosine that is only their sign
    (-1 for a value near zero moved across it): their column is taken as one row, as an ``(N,)`` output is."""
    if y.dim() == 2 and y.shape[-1] == 1:
        y, r = y.T, r.T
    found = torch.nn.functional.cosine_similarity(y, r, dim=-1, eps=1e-300)
    low, high = _SAFE_NORMS
    ny, nr = torch.linalg.vector_norm(y, dim=-1), torch.linalg.vector_norm(r, dim=-1)
    odd = (ny < low) | (ny > high) | (nr < low) | (nr > high)  # a norm of 0 included: its squares may underflow
    if bool(odd.any()):
        ys, rs = y[odd], r[odd]
        ys = ys / ys.abs().amax(-1, keepdim=True).clamp_min(1e-300)  # a zero row stays zero
        rs = rs / rs.abs().amax(-1, keepdim=True).clamp_min(1e-300)
        found[odd] = torch.nn.functional.cosine_similarity(ys, rs, dim=-1, eps=1e-300)
        zero = odd.clone()  # rows of zeros on both sides (a norm of 0 may be an underflow: the values are read)
        zero[odd] = (ys == 0).all(-1) & (rs == 0).all(-1)
        found[zero] = 1.0
    return found


def _decades(diff: torch.Tensor, rms: float, work: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Counts of ``diff / rms`` per decade of :data:`HISTOGRAM_EDGES`, NaN in the last; in ``work`` (``diff``'s
    shape and dtype) where given."""
    scaled = torch.div(diff, rms if rms > 0 else 1.0, out=work)
    lo, hi = HISTOGRAM_EDGES[0], HISTOGRAM_EDGES[-1]
    scaled.masked_fill_(torch.isnan(scaled), 10.0 ** (hi + 1))  # NaN errors count as the largest
    index = scaled.clamp_min_(1e-300).log10_().floor_().clamp_(lo, hi).sub_(lo).long().flatten()
    # on the CPU, where Partial sums them: a GPU output's counts are a GPU tensor (every check of a CUDA model
    # raised "Expected all tensors to be on the same device" at its first output, on an H200)
    return torch.bincount(index, minlength=len(HISTOGRAM_EDGES)).cpu()


def scale_note(reference: float, scale: Scale) -> str:
    """What an output judged over its operands' magnitudes says about it.

    >>> scale_note(0.0, Scale(1.7e3, "aten::sub"))[:60]
    'its float64 reference is zero: normwise is over the magnitud'
    """
    what = "is zero" if reference == 0 else f"cancels to {reference / scale.norm:.0e} of them"
    return (f"its float64 reference {what}: normwise is over the magnitudes that formed it "
            f"(‖{scale.op} over its operands' absolute values‖ = {scale.norm:.2e}), not over its own norm")


def multiple(error: float, floor: float) -> float:
    """``error`` as a multiple of float32 `highest`'s ``floor`` (the same output's error); NaN where the floor
    measures nothing (NaN or infinite).

    >>> round(multiple(2e-4, 2.5e-8)), multiple(0.0, 0.0), multiple(1e-9, 0.0)
    (8000, 1.0, inf)
    """
    if math.isnan(error) or math.isnan(floor) or math.isinf(floor):
        return math.nan
    if floor == 0:
        return 1.0 if error == 0 else math.inf
    return error / floor


def histogram(diff: torch.Tensor, r: torch.Tensor, rms: Optional[float] = None) -> tuple[int, ...]:
    """Counts of ``diff / rms(r)`` per decade: bin i holds [10^e_i, 10^e_(i+1)), the first also everything below,
    the last everything above (and NaN); ``rms``: another scale than rms(r) (the magnitudes that formed a cancelling
    one).

    >>> histogram(torch.tensor([1e-3, 2e-3, float("nan")]), torch.ones(3))[7:]
    (2, 0, 0, 0, 1)
    """
    rms = float(r.double().pow(2).mean().sqrt()) if rms is None else rms
    return tuple(int(c) for c in _decades(diff.double(), rms))


_NO_HISTOGRAM = (0,) * len(HISTOGRAM_EDGES)


# an output leaf that is an object with no equality of its own: neither compared exactly nor by value
NOT_COMPARED = "not compared (an object each run makes anew, with no equality of its own; its values not reached)"


def _fixed(name: str, shape: tuple[int, ...], tolerance: float, *, error: float = 0.0, failure: Optional[str] = None,
           note: Optional[str] = None, exact: bool = False) -> OutputError:
    return OutputError(name, shape, error, error, error, error, 1.0 if failure is None else math.nan, None,
                       _NO_HISTOGRAM, tolerance, failure, note, exact)


class _Absent:
    """An output that one side has and the other does not."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


def comparable(value: Any) -> bool:
    """Whether an output leaf holds anything to compare (``None``, empty tensors and objects with no equality of
    their own do not)."""
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    return type(value).__eq__ is not object.__eq__


def compare(name: str, y: Any, r: Any, tolerance: float = DEFAULT_TOLERANCE,
            scale: Optional[Scale] = None) -> OutputError:
    """Output leaf ``y`` against reference leaf ``r``, whatever their kinds (see the module's docstring);
    ``scale``: the magnitudes that formed a float output (:func:`output_error`)."""
    y, r = _as_tensor(y), _as_tensor(r)
    if y is ABSENT or r is ABSENT:
        return _fixed(name, (), tolerance, error=math.inf,
                      failure="missing here, the reference has it" if y is ABSENT else "not in the reference")
    if not isinstance(r, torch.Tensor) or not isinstance(y, torch.Tensor):
        return _compare_values(name, y, r, tolerance)
    shape = tuple(y.shape)
    if y.shape != r.shape:
        return _fixed(name, shape, tolerance, error=math.inf,
                      failure=f"shape {shape} differs from the reference's {tuple(r.shape)}")
    if y.numel() == 0:
        return _fixed(name, shape, tolerance, note="empty: its shape is the reference's, it has no values")
    if not (y.is_floating_point() or y.is_complex()) or not (r.is_floating_point() or r.is_complex()):
        if y.dtype != r.dtype and not (y.is_floating_point() or y.is_complex()):
            return _fixed(name, shape, tolerance, error=math.inf,
                          failure=f"dtype {_dtype(y)} differs from the reference's {_dtype(r)}")
        differ = int((y != r).sum())
        if differ:
            return _fixed(name, shape, tolerance, error=differ / y.numel(), exact=True,
                          failure=f"{differ} of {y.numel()} {_dtype(y)} elements differ (compared exactly)")
        return _fixed(name, shape, tolerance, exact=True, note=f"{_dtype(y)}: compared exactly")
    note, pairs = None, y.is_complex() or r.is_complex()
    if pairs:
        y, r = torch.view_as_real(y.to(torch.complex128)), torch.view_as_real(r.to(torch.complex128))
        note = "complex: compared as (real, imaginary) pairs"
    finite_y, finite_r = torch.isfinite(y), torch.isfinite(r)
    limits = dtype_limits(y, r)
    if limits is not None:  # held as a NaN or Inf both hold is: taken out of the values on both sides
        finite_y, finite_r = finite_y & ~limits, finite_r & ~limits
    if not (bool(finite_y.all()) and bool(finite_r.all())):
        where = finite_y != finite_r
        other = ~finite_y & ~finite_r & (y.double() != r.double()) & ~(torch.isnan(y) & torch.isnan(r))
        if limits is not None:
            other &= ~limits
        wrong = int(where.sum()) + int(other.sum())
        if pairs:  # complex: a number with one part NaN or Inf is held whole (its other part, often 0, left
            # alone made a live pair of zeros: cosine 0.0 for an output equal to its reference)
            finite_r = finite_r.all(-1, keepdim=True).expand_as(r)
        held = int((~finite_r).sum())
        if wrong:
            return OutputError(name, shape, math.inf, math.inf, math.inf, math.inf, math.nan, None, _NO_HISTOGRAM,
                               tolerance, f"NaN/Inf at {wrong} positions where the reference has "
                                          f"{'finite values or other ones' if held else 'finite values'}")
        at_limit = 0 if limits is None else int(limits.sum())
        said = []
        if held > at_limit:
            said.append(f"holds NaN/Inf at {held - at_limit} of {r.numel()} positions, the reference's same ones")
        if at_limit:
            said.append(f"holds its dtype's largest magnitude at {at_limit} of {r.numel()} positions, where the "
                        f"reference holds float64's (a mask made with torch.finfo(dtype).min or -max, whose dtype "
                        f"reads float64 there)")
        note = ((note + "; ") if note else "") + f"{'; '.join(said)}: the metrics cover the finite rest"
        if held == r.numel():
            return _fixed(name, shape, tolerance, note=note)
        found = _finite_rest(name, y, r, finite_r, held, tolerance, scale)
    else:
        found = output_error(name, y, r, tolerance, scale)
    if note is None:
        return found
    note = note if found.note is None else f"{note}; {found.note}"
    return OutputError(name, shape, found.max_abs, found.max_rel, found.mean_rel, found.normwise, found.cosine,
                       found.top1, found.histogram, tolerance, None, note, bias=found.bias, scale=found.scale)


_FLOAT32_MAX, _FLOAT64_MAX = torch.finfo(torch.float32).max, torch.finfo(torch.float64).max


def dtype_limits(y: torch.Tensor, r: torch.Tensor) -> Optional[torch.Tensor]:
    """Where float32 ``y`` holds float32's largest magnitude and its float64 reference ``r`` float64's, with the
    same sign (None where there is no such position): the value a model reads off its tensor's dtype
    (``-torch.finfo(t.dtype).max``, x-transformers' mask; ``torch.finfo(dtype).min``, Hugging Face's), which is
    float64's in the reference, where every dtype reads float64, and float32's in the rows. Neither is a rounding
    of the other: both are "the most negative number", held as a NaN or Inf both hold is.

    >>> y = torch.tensor([1.0, -torch.finfo(torch.float32).max])
    >>> dtype_limits(y, torch.tensor([1.0, -torch.finfo(torch.float64).max], dtype=torch.float64))
    tensor([False,  True])
    """
    if y.dtype != torch.float32 or r.dtype != torch.float64 or r.numel() == 0:
        return None
    # read on the float32 side (half the bytes of the reference's); no buffer the output's size where none holds it
    lo, hi = (float(t) for t in torch.aminmax(y.detach()))  # an output may require grad: no warning
    if lo > -_FLOAT32_MAX and hi < _FLOAT32_MAX:  # NaN compares False: looked for
        return None
    limits = ((r == _FLOAT64_MAX) & (y == _FLOAT32_MAX)) | ((r == -_FLOAT64_MAX) & (y == -_FLOAT32_MAX))
    return limits if bool(limits.any()) else None


def _finite_rest(name: str, y: torch.Tensor, r: torch.Tensor, finite: torch.Tensor, held: int, tolerance: float,
                 scale: Optional[Scale]) -> OutputError:
    """:func:`output_error` of ``y`` against ``r`` over ``finite``, the positions where they hold values (both hold
    the same NaN or Inf at the ``held`` others). Those are taken as zero in both, so that the rows keep their shape:
    the finite rest flattened into one row made the cosine that of the whole (a reversed row, -1, said 0.98) and
    top1 one argmax (0 or 1). A row's cosine is over its values (a row of none has none); its argmax as PyTorch's
    is, over its values and infinities (a NaN left out)."""
    y0, r0 = y.masked_fill(~finite, 0.0), r.masked_fill(~finite, 0.0)
    found = output_error(name, y0, r0, tolerance, scale, held=held)
    live = rows_of(finite).any(-1)
    cosine = float(_cosines(_wide(rows_of(y0)[live]), _wide(rows_of(r0)[live])).min())
    top1 = found.top1
    if top1 is not None:
        nan = torch.isnan(r)
        agree = y.masked_fill(nan, -math.inf).argmax(-1) == r.masked_fill(nan, -math.inf).argmax(-1)
        top1 = int(agree.sum()) / agree.numel()
    return dataclasses.replace(found, cosine=cosine, top1=top1)


def _as_tensor(value: Any) -> Any:
    """A NumPy array or scalar as a tensor (models that return ``.numpy()``); anything else as it is."""
    if type(value).__module__ == "numpy" and hasattr(value, "__array__"):
        try:
            return torch.as_tensor(value)
        except (TypeError, RuntimeError):  # object arrays: compared as values
            return value
    return value


def _compare_values(name: str, y: Any, r: Any, tolerance: float) -> OutputError:
    if isinstance(y, float) and isinstance(r, float):  # a Python float (``.item()``): a 0-d float output
        return compare(name, torch.tensor(y, dtype=torch.float64), torch.tensor(r, dtype=torch.float64), tolerance)
    kind = type(r).__name__
    if type(y) is not type(r):
        return _fixed(name, (), tolerance, error=math.inf,
                      failure=f"a {type(y).__name__} where the reference has a {kind}")
    if type(r).__eq__ is object.__eq__ and y is not r:
        # an object with no equality of its own (a transformers KV cache): each run makes another, so "compared
        # exactly" said every level, highest included, differed from the reference, and blamed float32 for it
        return _fixed(name, (), tolerance, exact=True, note=f"{kind}: {NOT_COMPARED}")
    try:
        differ = bool(y != r)
    except (TypeError, ValueError):  # no single truth value (an object array): by their text
        differ = repr(y) != repr(r)
    if differ:
        return _fixed(name, (), tolerance, error=1.0, exact=True,
                      failure=f"{_short(y)} differs from the reference's {_short(r)} (compared exactly)")
    return _fixed(name, (), tolerance, exact=True, note=f"{kind}: compared exactly")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def tolerances_of(tolerance: Union[float, Mapping[str, float], None]) -> dict[str, float]:
    if tolerance is None:
        return {"default": DEFAULT_TOLERANCE}
    if isinstance(tolerance, Mapping):
        found = {str(k): _tolerance_value(v, k) for k, v in tolerance.items()}
        return {"default": found.pop("default", DEFAULT_TOLERANCE), **found}
    return {"default": _tolerance_value(tolerance, None)}


def _tolerance_value(value: Any, key: Optional[str]) -> float:
    where = f" for {key!r}" if key is not None else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise Tf32LabError(f"bad tolerance{where} {value!r}; accepted: a finite number >= 0 (normwise relative error)")
    return float(value)
