"""``check`` of a model sharded over the ranks of a ``torch.distributed`` job: the reductions that make the ranks'
errors one report, exactly.

Every rank runs the float64 reference and each level on its shard (FSDP2's ``fully_shard``, DTensor tensor
parallelism, or plain data parallelism); nothing is gathered whole. What each rank measures is reduced:

- a layer call's normwise error ‖y − r‖ / ‖r‖ from the sums of ‖y − r‖² and ‖r‖² over the ranks (one
  ``all_reduce`` per call, :meth:`Ranks.normwise`), so a layer whose output is split (by batch rows, by columns)
  gets the error of its whole output, and one whose output every rank holds whole (after a tensor-parallel
  all-reduce) gets its own error (both sums are multiplied by the number of ranks);
- an output's metrics (``numbers.metrics``) from sums (of squares, of relative errors, of histogram counts,
  of agreeing argmaxes), maxima by max and minima by min (:func:`outputs`). An output is *split by batch rows*
  (dim 0) when the ranks hold different values, as data parallelism and FSDP2 give them; *replicated* when every
  rank holds the same one (then it is measured as it is); a ``DTensor`` output by its placements (``Shard(0)``
  split, anything else made whole with ``full_tensor()``). Outputs that are not finite float tensors of at least
  two dimensions (NaN or Inf held, integer, 1-d) are gathered and compared whole: they are small or rare.

The reductions run in float64 in another order than one process's, so a sharded report equals the one process
check of the same model and the whole batch to float64 rounding, wherever the sharding leaves each float32 dot
product whole (FSDP2, data parallelism, a column-parallel layer). A row-parallel layer sums partial products
across ranks in float32 (the all-reduce), another computation than one GEMM: its errors are the sharded model's,
as the hardware running it would see them.

A rank that raises ends its check (its exception goes up); the others meet an error in their next collective
(its connection closed) or at the group's timeout, and :func:`ranks_fail` turns it into one ``Tf32LabError``.
Ranks that run the model differently (a layer called on some ranks only) are out of step: each collective carries
a tag of its site (:meth:`Ranks.meet`), and each rank raises one ``Tf32LabError`` at the first one where they
differ.

Example:

    >>> import torch
    >>> from tf32lab.measure.sharded import Ranks
    >>> Ranks.of_job() is None     # outside a job of several ranks: check runs as one process
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import sys
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

from tf32lab.errors import Tf32LabError
from tf32lab.machine.distributed import initialized
from tf32lab.measure.norms import squares_ratio
from tf32lab.numbers import metrics
from tf32lab.numbers.trees import named_leaves

__all__ = ["Ranks", "collective_failure", "local", "outputs", "plain", "ranks_fail", "type_name"]


_TAGS = 4096  # sites told apart by Ranks.meet (two sites share a tag once in 4096)


class Ranks:
    """The ranks of one process group, for check: float64 reductions, each one collective."""

    def __init__(self, group: Any = None) -> None:
        dist = torch.distributed
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.calls = 0  # collectives so far
        self.device = _collective_device(group)

    @classmethod
    def of_job(cls, group: Any = None) -> Optional[Ranks]:
        """The ranks of ``group`` (the whole job by default) when this process is one of several, else None."""
        if not initialized():
            return None
        found = cls(group)
        return found if found.world > 1 else None

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        self.calls += 1
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the ranks (NaN anywhere gives NaN)."""
        return self._reduce(values, torch.distributed.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        """Each value's maximum over the ranks; NaN on any rank gives NaN (the backends' max may drop it)."""
        nan = [1.0 if math.isnan(v) else 0.0 for v in values]
        found = self._reduce([*(-math.inf if math.isnan(v) else v for v in values), *nan],
                             torch.distributed.ReduceOp.MAX)
        n = len(values)
        return [math.nan if found[n + i] else found[i] for i in range(n)]

    def gather(self, value: Any, site: str = "the comparison of the outputs") -> list[Any]:
        """Every rank's ``value`` (a picklable object), in rank order, once every rank is at ``site``
        (:meth:`meet`)."""
        self.meet(site)
        self.calls += 1
        found: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(found, value, group=self.group)
        return found

    def meet(self, site: str) -> None:
        """Every rank at ``site``, or one ``Tf32LabError`` on every rank that is not where the others are."""
        self._at(site, [0.0, 0.0, 0.0])

    def _at(self, site: str, values: list[float]) -> list[float]:
        """``values`` summed over the ranks, each rank at ``site``: its tag t (1..4096) goes with them as t and
        t², and Σt² · ranks = (Σt)² holds only where every t is the same (Cauchy-Schwarz; exact in float64 up to
        16384 ranks). A model that calls a layer on some ranks only (a branch on the data) put each rank's
        collectives out of step: one rank's layer error was summed with another's output comparison, or the
        job stopped at the group's timeout saying another rank had failed. Every site's collective is three
        sums and the tag, so ranks at different sites still meet, and see it."""
        tag = float(zlib.crc32(site.encode()) % _TAGS + 1)
        *found, tags, squares = self.sum([*values, tag, tag * tag])
        if squares * self.world != tags * tags:
            raise Tf32LabError(f"the ranks ran the model differently: this rank was at {site}, another elsewhere; "
                               f"a sharded check needs every rank to call the same layers the same number of times "
                               f"and return outputs of the same names (only the data may differ)")
        return found

    def normwise(self, diff2: float, ref2: float, mismatch: Optional[str],
                 site: str = "a layer call") -> tuple[float, Optional[str]]:
        """A layer call's normwise error from every rank's ‖y − r‖² and ‖r‖², and a mismatch seen on any rank;
        every rank at ``site`` (:meth:`meet`)."""
        total_diff, total_ref, bad = self._at(site, [diff2, ref2, 0.0 if mismatch is None else 1.0])
        if bad:
            return math.nan, mismatch or "its output's structure differs from the reference's on another rank"
        return squares_ratio(total_diff, total_ref), None


def _collective_device(group: Any) -> torch.device:
    """Where a tensor of ``group``'s collectives lies: the CPU where the group has a CPU backend (gloo; the CLI's
    ``cpu:gloo,cuda:nccl``), else the current device of its one backend's kind. A group initialised with
    ``init_process_group("nccl")`` alone has no CPU backend: every all_reduce of a CPU tensor raised there."""
    c10d = torch.distributed.distributed_c10d
    found = getattr(c10d, "_get_object_coll_device", None)  # PyTorch 2.6 on
    if found is None and hasattr(c10d, "_get_pg_default_device"):  # before: the same rules, as a device
        found = lambda g: c10d._get_pg_default_device(g).type  # noqa: E731
    try:
        kind = found(group) if found is not None else "cpu"
    except (RuntimeError, ValueError):
        kind = "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    # the device the group was bound to (init_process_group(device_id=...)), else this kind's current one
    bound = getattr(group if group is not None else c10d._get_default_group(), "bound_device_id", None)
    return bound if isinstance(bound, torch.device) and bound.type == kind else torch.device(kind)


# -- what a rank holds ----------------------------------------------------------------------------------------
def plain(value: Any) -> Any:
    """A tensor as a plain local tensor: a ``DTensor`` split by rows (``Shard(0)``) as its local rows, any other
    ``DTensor`` made whole; a functional collective's pending result waited for."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        placements = value.placements
        if len(placements) == 1 and placements[0].is_shard(0):
            return value.to_local()
        return value.full_tensor()
    return _waited(value)


def local(value: Any) -> Any:
    """What this rank holds of a tensor: a ``DTensor``'s local shard, a pending collective's result; a plain
    tensor as it is. A layer's error sums these over the ranks."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return value.to_local()
    return _waited(value)


def _waited(value: Any) -> Any:
    wait = getattr(value, "wait", None)
    if isinstance(value, torch.Tensor) and type(value).__name__ == "AsyncCollectiveTensor" and callable(wait):
        return wait()
    return value


def _dtensor_type() -> Any:
    # No tensor is a DTensor before its module is imported; importing it to learn that would cost every check about
    # a CPU second (torch.distributed.tensor pulls in sympy). torch < 2.5 keeps it under _tensor.
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        dtensor = getattr(sys.modules.get(name), "DTensor", None)
        if dtensor is not None:
            return dtensor
    return None


def type_name(module: torch.nn.Module) -> str:
    """The module's class as its author wrote it: FSDP2's ``fully_shard`` swaps in a class named ``FSDP<Class>``."""
    cls = type(module)
    if cls.__name__.startswith("FSDP") and len(cls.__mro__) > 2:
        for base in cls.__mro__[1:]:
            if not base.__name__.startswith("FSDP") and issubclass(base, torch.nn.Module):
                return base.__name__
    return cls.__name__


def _fingerprint(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        head = f"{t.dtype}{tuple(t.shape)}"
        if t.is_complex():
            t = torch.view_as_real(t)
        # reshaped first: a 0-d tensor (a loss) has no byte view, and the check blamed the workload for it
        data = t.cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return head + hashlib.sha256(data).hexdigest()
    return repr(value)


def _splittable(y: Any, r: Any) -> bool:
    """A float tensor of two or more dimensions, finite on both sides, the same shape: reduced, not gathered."""
    return (isinstance(y, torch.Tensor) and isinstance(r, torch.Tensor) and y.shape == r.shape and y.dim() >= 2
            and y.is_floating_point() and r.is_floating_point() and y.numel() > 0
            and bool(torch.isfinite(y).all()) and bool(torch.isfinite(r).all()))


# -- outputs --------------------------------------------------------------------------------------------------
def outputs(out: Any, ref_out: Any, tolerances: dict[str, float], ranks: Ranks,
            compare_local: Any, underflow: Any = None) -> tuple[metrics.OutputError, ...]:
    """Every output's error over all ranks (see the module's docstring); ``compare_local(out, ref_out,
    tolerances)`` is the one-process comparison, used for what every rank holds whole and what is gathered;
    ``underflow(error, largest)``: what it adds to a float32 output's error whose reference's largest magnitude
    is ``largest`` (a note where that is below float32's normal range), given to a split output's error too."""
    refs = {name: plain(v) for name, v in named_leaves(ref_out)}
    found = {name: plain(v) for name, v in named_leaves(out)}
    names = list(refs) + [n for n in found if n not in refs]
    mine = {n: (_fingerprint(found.get(n)), _fingerprint(refs.get(n)),
                _splittable(found.get(n), refs.get(n))) for n in names}
    everyone = ranks.gather((names, mine))
    if any(other_names != names for other_names, _ in everyone):
        raise Tf32LabError("the ranks' outputs have different names: "
                           + "; ".join(f"rank {i}: {', '.join(n) or 'none'}" for i, (n, _) in enumerate(everyone)))
    results = []
    for name in names:
        kinds = [m[name] for _, m in everyone]
        tolerance = tolerances.get(name, tolerances["default"])
        y, r = found.get(name, metrics.ABSENT), refs.get(name, metrics.ABSENT)
        if all(k[:2] == kinds[0][:2] for k in kinds):  # replicated: every rank holds the same output
            results.extend(compare_local({name: y}, {name: r}, {**tolerances, "default": tolerance}))
        elif all(k[2] for k in kinds):
            results.append(_split_error(name, y, r, tolerance, ranks, underflow))
        else:
            # as CPU copies: a CUDA tensor pickled comes back on the device it left (another rank's GPU), where
            # the parts could not be joined, or could not be loaded at all on a rank that sees one GPU
            gathered = ranks.gather(tuple(v.detach().cpu() if isinstance(v, torch.Tensor) else v for v in (y, r)))
            ys, rs = [g[0] for g in gathered], [g[1] for g in gathered]
            results.extend(compare_local({name: _joined(ys)}, {name: _joined(rs)},
                                         {**tolerances, "default": tolerance}))
    return tuple(results)


def _joined(parts: list[Any]) -> Any:
    """The ranks' parts of an output as one: tensors stacked along dim 0 (a 0-d one as a vector), other values as
    the first rank's when all agree, else the list of them."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        with contextlib.suppress(RuntimeError):
            return torch.cat([p.reshape(1) if p.dim() == 0 else p for p in parts])
    return parts[0] if all(repr(p) == repr(parts[0]) for p in parts) else parts


def _split_error(name: str, y: torch.Tensor, r: torch.Tensor, tolerance: float, ranks: Ranks,
                 underflow: Any = None) -> metrics.OutputError:
    """``metrics.output_error`` of an output split by batch rows over the ranks: each rank's ``metrics.Partial``
    of its rows, summed or maximised over the ranks; ``underflow``: as :func:`outputs` takes it."""
    found, largest = _split(name, y, r, tolerance, ranks)
    return underflow(found, largest) if underflow is not None and y.dtype == torch.float32 else found


def _split(name: str, y: torch.Tensor, r: torch.Tensor, tolerance: float,
           ranks: Ranks) -> tuple[metrics.OutputError, float]:
    """:func:`_split_error`, and the reference's largest magnitude over the ranks."""
    y, r = y.detach(), r.detach()
    shapes = ranks.gather(tuple(y.shape))
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise Tf32LabError(f"output {name!r}: the ranks' parts have shapes {shapes}; accepted: parts of one batch "
                           f"(the same shape but for dim 0)")
    shape = (sum(s[0] for s in shapes), *shapes[0][1:])
    rows_y, rows_r = metrics.rows_of(y), metrics.rows_of(r)
    ref_norm, top = metrics.reference_extent(rows_r)
    low, high = torch.aminmax(y)  # its largest magnitude without a copy of its size (logits: tens of millions)
    top, ref_top, peak = ranks.max([top, ref_norm, max(-float(low), float(high))])
    total_n, ref_sum, rows = ranks.sum([float(r.numel()), _scaled(ref_norm, ref_top), float(rows_y.shape[0])])
    total_ref = _unscaled(ref_sum, ref_top)
    rms = total_ref / math.sqrt(total_n)
    logits = metrics.is_logits(name, y)
    part = metrics.Partial().add(rows_y, rows_r, metrics.REL_FLOOR * top, rms, logits)
    max_abs, max_rel, neg_cosine, diff_top = ranks.max([part.max_abs, part.max_rel, -part.cosine, part.diff_norm])
    diff_sum, rel_sum, rel_n, abs_sum, signed, agreed = ranks.sum(
        [_scaled(part.diff_norm, diff_top), part.rel, float(part.rel_n), part.magnitude, part.signed,
         float(part.agree)])
    counts = ranks.sum([float(c) for c in part.counts])
    total_diff = _unscaled(diff_sum, diff_top)
    if not (math.isfinite(total_ref) and math.isfinite(total_diff)):
        # as metrics.output_error does (every rank decides alike, on reduced numbers): finite values whose norm
        # or difference is past float64's largest made the error 0.0 (inf over inf parts); over both scaled down
        # by a power of two (exact) every metric is the same, max_abs scaled back
        shift = metrics.overflow_shift(max(top, peak), int(total_n))
        if shift:
            down = 2.0 ** -shift
            found, _ = _split(name, y.double() * down, r.double() * down, tolerance, ranks)
            return dataclasses.replace(found, max_abs=found.max_abs / down), top
    normwise = total_diff / total_ref if total_ref else (0.0 if total_diff == 0.0 else math.inf)
    return metrics.OutputError(name, shape, max_abs, max_rel, rel_sum / rel_n if rel_n else 0.0, normwise,
                               -neg_cosine, agreed / rows if logits else None, tuple(int(c) for c in counts),
                               tolerance, bias=metrics.bias(signed / total_n, abs_sum / total_n)), top


# The ranks' norms are combined as ‖(n₁, n₂, ...)‖ = top · sqrt(Σ (nᵢ / top)²), top the largest: their squares
# would overflow at 1e200 and underflow at 1e-300 (metrics.norm)
def _scaled(norm: float, top: float) -> float:
    return (norm / top) ** 2 if 0 < top < math.inf else 0.0


def _unscaled(total: float, top: float) -> float:
    return top * math.sqrt(total) if 0 < top < math.inf else top


# -- faults ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def ranks_fail(ranks: Optional[Ranks]) -> Iterator[None]:
    """A collective that fails (another rank raised and left, was killed, or did not answer within the group's
    timeout) becomes one ``Tf32LabError`` line naming this rank; this rank's own ``Tf32LabError`` gets its rank."""
    if ranks is None:
        yield
        return
    try:
        yield
    except Tf32LabError as exc:
        if str(exc).startswith("rank "):
            raise
        raise Tf32LabError(f"rank {ranks.rank}/{ranks.world}: {exc}") from exc
    except Exception as exc:
        if not collective_failure(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise Tf32LabError(f"rank {ranks.rank}/{ranks.world}: the sharded check stopped: another rank failed, was "
                           f"killed or did not answer within the process group's timeout ({first})") from exc


_DIST_ERRORS = tuple(e for e in (getattr(torch.distributed, "DistError", None),) if e is not None)


def collective_failure(exc: BaseException) -> bool:
    if _DIST_ERRORS and isinstance(exc, _DIST_ERRORS):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout",
                                  "broken pipe", "peer"))
