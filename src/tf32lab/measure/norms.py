"""Normwise error of a module's output against its kept float64 reference, in float64, through a reused chunk
buffer: the inner loop of ``check``'s per-layer errors (one call per layer call and level).

Example:

    >>> import torch
    >>> from tf32lab.measure.norms import scratch, tree_normwise
    >>> r = torch.ones(3, dtype=torch.float64)
    >>> tree_normwise(torch.full((3,), 1.5), r, {"output": 3.0}, scratch(r.device))
    (0.5, None)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Optional

import torch

from tf32lab.measure.spill import Spilled
from tf32lab.numbers import metrics
from tf32lab.numbers.trees import named_leaves, named_tensors

CHUNK = 1 << 16  # elements: a chunk's difference stays in the L2 cache between its two passes (3x faster than 1 Mi)


def scratch(device: torch.device) -> torch.Tensor:
    """The buffer :func:`tree_normwise` works in: a chunk read back from a spill file, and a chunk's difference."""
    return torch.empty(2 * CHUNK, dtype=torch.float64, device=device)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


@contextlib.contextmanager
def bare(*tensors: Any) -> Iterator[None]:
    """No torch-function or dispatch mode sees the block's ops, where every tensor it reads is a plain tensor (a
    subclass may need its own handlers, and keeps them). ``check``'s own arithmetic runs inside its runs (the
    float64 reference's modes, the emulator): through them, each of a comparison's many small ops cost several
    Python calls, a third of its time, for the same bits (each mode passes float64 arithmetic through as it is).

        >>> with bare(torch.ones(2)):
        ...     float(torch.ones(2).sum())
        2.0
    """
    if not all(type(t) in _PLAIN for t in tensors):
        yield
        return
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        yield


def tree_normwise(output: Any, reference: Any, norms: dict[str, Optional[float]],
                   scratch: torch.Tensor, ranks: Any = None, site: str = "a layer call") -> tuple[float, Optional[str]]:
    """‖y − r‖ / ‖r‖ over the float tensors of a module's output, in float64 (``norms``: each ‖r‖², from the
    reference run; None for one summed here on the way, in the chunks the difference reads, and filled in), and
    what does not match the reference's structure, if anything. The difference goes through a
    reused chunk buffer (:func:`scratch`): fresh multi-MB temporaries cost page faults that dwarf the arithmetic.
    A reference kept in memory and one read back from a spill file give the same bits. With ``ranks``
    (``measure.sharded.Ranks``) the sums of squares are those of every rank: one collective per call, which every
    rank makes at the same ``site`` (the layer and its call, named)."""
    diff2, ref2, mismatch = _sums(output, reference, norms, scratch)
    if ranks is not None:
        return ranks.normwise(diff2, ref2, mismatch, site)
    if mismatch is not None:
        return math.nan, mismatch
    return squares_ratio(diff2, ref2), None


def squares_ratio(diff2: float, ref2: float) -> float:
    """‖y − r‖ / ‖r‖ from the squares: 0 where both are 0, Inf where only ‖r‖ is, and Inf where both squares
    overflowed float64 (Inf / Inf was NaN, a layer not measured): ‖r‖² overflows only where the reference holds
    values beyond 1.3e154, which float32 cannot hold, so the row holds Inf (or its own limit) there, an error
    without bound, as an output's is (``metrics.compare``: NaN/Inf where the reference has finite values).

    >>> squares_ratio(4.0, 16.0), squares_ratio(math.inf, math.inf)
    (0.5, inf)
    """
    if ref2 == 0.0:
        return 0.0 if diff2 == 0.0 else math.inf
    if math.isinf(ref2) and math.isinf(diff2):
        return math.inf
    return math.sqrt(diff2 / ref2)


def _sums(output: Any, reference: Any, norms: dict[str, Optional[float]],
          scratch: torch.Tensor) -> tuple[float, float, Optional[str]]:
    """‖y − r‖², ‖r‖² and a mismatch of structure, if any."""
    refs = {key: r for key, r in named_leaves(reference) if isinstance(r, (torch.Tensor, Spilled))}
    ys = list(named_tensors(output))
    with bare(scratch, *(y for _, y in ys), *(r for r in refs.values() if isinstance(r, torch.Tensor))):
        return _summed(ys, refs, norms, scratch)


def _summed(ys: list[tuple[str, torch.Tensor]], refs: dict[str, Any], norms: dict[str, Optional[float]],
            scratch: torch.Tensor) -> tuple[float, float, Optional[str]]:
    buffers = {scratch.device: scratch}
    diff2 = ref2 = 0.0
    for name, y in ys:
        r = refs.get(name)
        if r is None or name not in norms:
            continue
        if r.shape != y.shape:
            what = "its output" if name == "output" else f"its output {name}"
            return math.nan, math.nan, f"{what} has shape {tuple(y.shape)}, the reference's {tuple(r.shape)}"
        # the chunks on the reference's device (a spilled one's: the CPU): a model spread over devices (a layer on
        # cuda:1, one left on the CPU) made the difference of tensors on two devices, or read a file into a GPU buffer
        buffer = buffers.get(r.device)
        if buffer is None:
            buffer = buffers[r.device] = torch.empty_like(scratch, device=r.device)
        read, work = buffer[:CHUNK], buffer[CHUNK:]
        known = norms[name]
        diff2, found = _diff2(y, r, read, work, diff2, known is None)
        if known is None:  # deferred: summed from the chunks the difference reads, and kept for the next row
            known = norms[name] = found if math.isfinite(found) else \
                reference_norm2(r.load() if isinstance(r, Spilled) else r)
        ref2 += known
    return diff2, ref2, None


def _diff2(y: torch.Tensor, r: Any, read: torch.Tensor, work: torch.Tensor, diff2: float,
           norm: bool = False) -> tuple[float, float]:
    """``diff2`` plus ‖y − r‖² in float64, a chunk at a time through ``work`` (summed on, in the same order); and
    with ``norm``, ‖r‖² summed as :func:`reference_norm2` sums it, from the chunks in the cache (else 0.0)."""
    y = y.detach()  # an output of a forward that differentiates requires grad: copied into work, it made a graph
    if isinstance(r, Spilled):
        parts = r.chunks(read)
    else:
        if y.is_complex():
            y, r = torch.view_as_real(y), torch.view_as_real(r)
        parts = _chunks(r)
    y = y.reshape(-1)
    start = 0
    r2 = 0.0
    for part in parts:
        d = work[:part.numel()]
        piece = y[start:start + part.numel()]
        d.copy_(piece)  # widened exactly; then a float64-only subtraction (fast path)
        d.sub_(part)
        found = float(torch.dot(d, d))
        if not math.isfinite(found):  # rare: only then are the positions both hold alike looked for
            found = _over_values(d, piece, part)
        diff2 += found
        if norm:
            wide = part if part.dtype == torch.float64 else part.double()  # as reference_norm2 sums it
            r2 += float(torch.dot(wide, wide))
        start += part.numel()
    return diff2, r2


def _chunks(r: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = r.reshape(-1)
    return (flat[start:start + CHUNK] for start in range(0, flat.numel(), CHUNK))


def _over_values(d: torch.Tensor, y: torch.Tensor, r: torch.Tensor) -> float:
    """‖d‖², ``d = y − r``, without the positions where ``y`` and ``r`` hold the same NaN or Inf, or their dtypes'
    limits (``metrics.dtype_limits``): an output's metrics leave them out (``metrics.compare``), and a layer's error
    did not (Inf − Inf is NaN, float64's limit squared Inf), so a layer that returns masked scores had none."""
    held = (torch.isnan(y) & torch.isnan(r)) | (torch.isinf(y) & (y == r))
    limits = metrics.dtype_limits(y, r)
    if limits is not None:
        held |= limits
    d = d.masked_fill(held, 0.0)
    found = float(torch.dot(d, d))
    # a NaN left is one where one side holds a value and the other NaN (a row that overflowed into inf - inf): an
    # error without bound, as an output's is (metrics.compare), not a layer that could not be measured (NaN)
    return math.inf if math.isnan(found) else found


def reference_norm2(r: torch.Tensor) -> float:
    """‖r‖² of a layer's reference output over its values: without NaN, Inf and float64's largest magnitude, which
    a row holds alike or fails on by its difference (:func:`_over_values`); the plain sum where it is finite,
    summed a chunk at a time as :func:`tree_normwise` sums a deferred one (None): the same bits either way.

    >>> reference_norm2(torch.tensor([3.0, -math.inf, 4.0, -torch.finfo(torch.float64).max], dtype=torch.float64))
    25.0
    """
    if r.dtype not in (torch.float64, torch.complex128):
        # summed in float64: a float32 output (the model's own state) as it is kept, widened; a half-precision one
        # (``y.half()``) summed in its own dtype had a float16 ‖r‖ past 65504 Inf (the layer's error then read 0.0
        # at every level) and a bfloat16 ‖r‖² 0.2% off
        r = r.to(torch.complex128 if r.is_complex() else torch.float64)
    t = torch.view_as_real(r) if r.is_complex() else r
    found = sum(float(torch.dot(part, part)) for part in _chunks(t))
    if math.isfinite(found):
        return found
    held = ~torch.isfinite(r)
    if r.dtype == torch.float64:
        held |= r.abs() == torch.finfo(torch.float64).max
    return float(torch.linalg.vector_norm(r.masked_fill(held, 0.0))) ** 2


# Sums of squares whose square roots lie in metrics' safe range (no square overflowed, none that mattered
# underflowed): there the plain sums stand for the norms
_SAFE_SQUARES = (1e-280, 1e280)


def distance_sums(y: torch.Tensor, r: torch.Tensor, work: torch.Tensor) -> Optional[tuple[float, float, float]]:
    """``(‖y‖², ‖r‖², ‖y − r‖²)`` in float64, a chunk at a time through ``work`` (:func:`scratch`): no
    float64 copy of ``y`` and no difference the tensors' size. The training check compares every parameter,
    gradient and optimizer state of each row with float64's so, and fresh multi-MB buffers cost page faults that
    dwarf the arithmetic: all-MiniLM-L6-v2's word embedding (11.7M values) took 176 ms a comparison through
    float64 copies, 27 ms so. None where the sums cannot stand for the norms (the caller takes the scaled norms
    then): a tensor off the CPU (a sync per chunk), complex, sparse or not floating, sizes that differ, or a sum
    that is not finite or is outside the range where no square overflowed or underflowed (zero included: an exact
    match, or values below 1e-154).

        >>> ref = torch.tensor([3.0, 0.0], dtype=torch.float64)
        >>> distance_sums(torch.tensor([3.0, 4.0]), ref, scratch(ref.device))
        (25.0, 9.0, 16.0)
    """
    if y.device.type != "cpu" or r.device.type != "cpu" or y.numel() != r.numel() or y.numel() == 0 \
            or not (y.is_floating_point() and r.is_floating_point()) or torch.strided != y.layout \
            or torch.strided != r.layout:
        return None
    y, r = y.detach().reshape(-1), r.detach().reshape(-1)
    with bare(work, y, r):
        read, d = work[:CHUNK], work[CHUNK:]
        y2 = r2 = d2 = 0.0
        for start in range(0, y.numel(), CHUNK):
            part = r[start:start + CHUNK]
            if part.dtype != torch.float64:
                part = read[:part.numel()].copy_(part)
            piece = d[:part.numel()].copy_(y[start:start + CHUNK])  # widened exactly
            y2 += float(torch.dot(piece, piece))
            r2 += float(torch.dot(part, part))
            piece.sub_(part)
            d2 += float(torch.dot(piece, piece))
    low, high = _SAFE_SQUARES
    if not all(low <= s <= high for s in (y2, r2, d2)):
        return None
    return y2, r2, d2
