"""``check_training(workload)``: what each precision level does to training, against float64, beside float32's own
drift.

Every row trains a copy of the model made from one saved state, on the same batches, from the same random seed
(dropout masks included), for the same steps:

- **float64**, the reference: model, loss and optimizer state in float64 (a ``.double()`` copy, the batches'
  float32 tensors widened);
- **float32** at ``highest`` on the target (emulated, or native with ``target="native"``): float32's own drift
  from float64, the noise floor every level is judged beside;
- each level, and the policy when one is given (``policy=``: the HALOs pattern, a body at ``high`` and a value
  head at ``highest``, is one row).

Per row: the loss of each step and its relative deviation from float64's (the first step past the tolerance is the
*divergence step*); the gradients of the first step (the same weights for every row) against float64's, per
parameter, with the module whose own backward introduces the most error (each module with parameters rerun under
the level fed float64's inputs and output gradients, as ``check`` does for the forward); and after the last step
each parameter's distance from float64's weights and the optimizer state's error. A step that raises, or a loss
that turns NaN/Inf, fails the row at that step; it is a finding, never a crash.

Nothing of the caller's changes: the model is never run itself (copies are), and PyTorch's flags and random
state are put back on every exit, exceptions and Ctrl-C included.

Example:

    >>> import torch, tf32lab
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> data = [(torch.randn(64, 32), torch.randn(64, 1)) for _ in range(5)]
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    >>> w = tf32lab.TrainingWorkload(model, data, loss=lambda o, b: (o - b[1]).pow(2).mean(),
    ...                              inputs=lambda b: b[0], name="mlp")
    >>> report = tf32lab.check_training(w, levels=("highest", "high"), target="a100")
    >>> bool(report), report.level("high").gradients[0].normwise > report.floor.gradients[0].normwise
    (True, True)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import numbers
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, Optional, Union

import torch

from tf32lab.control import flags, modestack
from tf32lab.control.policy import Policy
from tf32lab.control.scope import precision, set_float32_matmul_precision
from tf32lab.emulation.emulator import (
    check_accumulation,
    context_cells,
    counted_math,
    emulate,
    families_met,
    release_buffers,
)
from tf32lab.emulation.rules import scripted_rnns
from tf32lab.errors import Tf32LabError
from tf32lab.know import optable
from tf32lab.know.levels import ALL_LEVELS, LEVELS, check_levels
from tf32lab.know.targets import CUDNN_CELL, Target, cudnn_cell
from tf32lab.machine.hardware import resolve_target
from tf32lab.measure.check import (
    ConvRun,
    PolicyRow,
    alike_levels,
    conv_ran,
    dtypes_refused,
    float_inputs_note,
    policy_maths,
    refuse_native_levels,
    rows_of_alike,
)
from tf32lab.measure.draws import (
    DrawLog,
    MathPathDropout,
    SameDraws,
    Streams,
    cuda_devices,
    draw_plan,
    lazy_note,
    materialised,
    seeded,
)
from tf32lab.measure.layers import ROOT, described, out_of_memory, transformed
from tf32lab.measure.norms import distance_sums, scratch
from tf32lab.measure.reference import Float64Run, widen, widened_model
from tf32lab.numbers import metrics
from tf32lab.numbers.origin import internal_error
from tf32lab.numbers.trees import map_tensors, named_tensors
from tf32lab.report.cudnn import FLAGS
from tf32lab.report.training import FLOOR, FLOOR_MULTIPLE, BackwardLayer, ParameterError, TrainingLevel, TrainingReport
from tf32lab.speed.counting import Counting
from tf32lab.speed.prediction import optimizer_ops, predict_counts, seconds_at
from tf32lab.workloads.eager import eager
from tf32lab.workloads.running import (
    Progress,
    autograd_on,
    changed_note,
    environment_of,
    exits_refused,
    kept_flags,
    refuse_applied,
)
from tf32lab.workloads.training import TrainingWorkload, check_steps

__all__ = ["TrainingSession", "check_training", "random_state_kept", "scripted_rnn_note", "training_steps",
           "training_tolerance"]

# A parameter's step-1 gradient error is relative to its own float64 gradient's norm, or to this share of a typical
# parameter's (the whole gradient's norm over the square root of the parameters' count) when its own is smaller:
# a true gradient of 0 (an attention key's bias, which softmax cannot see) leaves only rounding to compare, and
# its error over its own near-zero norm (1e+11 on all-MiniLM-L6-v2) would rank it first at every level
GRADIENT_FLOOR = 0.1

# torch.optim's optimizers whose step is element-wise (no matmul-family op), by exact type: a subclass may do more
_ELEMENTWISE_OPTIMIZERS = frozenset(
    getattr(torch.optim, name) for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                                            "Adagrad", "Adadelta", "ASGD", "Rprop") if hasattr(torch.optim, name))


def elementwise_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step runs no matmul-family op, so that the check steps it outside the emulator:
    one of PyTorch's element-wise optimizers (by exact type: a subclass may do more), or one that says so of
    itself with ``elementwise_step = True`` (the training-loop callbacks' bundle of such optimizers).

    >>> elementwise_step(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    True
    """
    return type(optimizer) in _ELEMENTWISE_OPTIMIZERS or getattr(optimizer, "elementwise_step", False) is True


def check_training(workload: TrainingWorkload, *, levels: Iterable[str] = LEVELS, target: Union[str, Target] = "a100",
                   steps: Optional[int] = None, tolerance: Optional[float] = None, policy: Optional[Policy] = None,
                   progress: bool = False, accumulation: Optional[str] = None, speed: bool = True,
                   conv: Optional[str] = None) -> TrainingReport:
    """Train ``workload`` at each level as ``target`` computes it, against float64 and float32's own drift.

    Args:
        levels: precision levels, in order.
        target: a target name or ``Target`` (emulated here), or ``"native"`` (the levels on this hardware).
        steps: how many steps (default: the workload's).
        tolerance: the largest relative deviation of the loss from float64's at any step (default 1e-2); a level
            past it still passes when its drift is within ``FLOOR_MULTIPLE`` (3x) float32's own.
        policy: a :class:`~tf32lab.Policy` trained as one more row, ``"policy"`` (its verdict is the report's).
        progress: a progress bar on stderr.
        accumulation: how emulated GEMMs sum their products, ``"ideal"`` or ``"hardware"`` (``emulate()``'s
            argument; None: the ``TF32LAB_ACCUMULATION`` setting, ``"ideal"`` by default).
        speed: predict each level's speedup of a training step on the target (GPU targets; one step counted).
        conv: cuDNN's float32 convolution math for every row, ``"tf32"`` or ``"ieee"`` (no level sets it; None: as
            the process's flag holds it), set for the run and put back, as ``check(conv=)``.

    Returns a :class:`~tf32lab.report.training.TrainingReport`; ``bool(report)`` is the verdict. Raises
    ``Tf32LabError`` for bad arguments, a loss that is not a scalar, or a model that fails in float64.

    Example:

        >>> import torch, tf32lab
        >>> data = [(torch.ones(4, 3), torch.zeros(4, 1))] * 2
        >>> w = tf32lab.TrainingWorkload(torch.nn.Linear(3, 1), data, inputs=lambda b: b[0],
        ...                              loss=lambda o, b: (o - b[1]).pow(2).mean())
        >>> report = tf32lab.check_training(w, levels=("highest", "high"), target="h100")
        >>> len(report.reference_losses), [lv.level for lv in report.levels], bool(report)
        (2, ['highest', 'high'], True)
    """
    if not isinstance(workload, TrainingWorkload):
        raise Tf32LabError(f"check_training() takes a tf32lab.TrainingWorkload, not {type(workload).__name__}"
                           + (" (check() measures a forward pass)" if type(workload).__name__ == "Workload" else ""))
    levels = check_levels(levels)
    target = resolve_target(target)
    refuse_native_levels(levels, target)
    steps = training_steps(workload, steps)
    tolerance = training_tolerance(tolerance)
    accumulation = check_accumulation(accumulation)
    conv_scope = ConvRun(conv)
    refuse_applied(workload, workload.asked)  # type: ignore[arg-type]  # it reads .model and .name
    row = PolicyRow.of(policy, workload.model) if policy is not None else None
    # training needs autograd: on for the check's own steps (a library's loader can leave it off for the whole
    # process: silero-stress's; a caller in inference mode), the caller's modes as they were after
    with exits_refused(workload.name, "check_training"), kept_flags() as changed, autograd_on(), \
            random_state_kept(workload.model), conv_scope, eager(workload.model):
        session = TrainingSession(workload, target, steps, tolerance, accumulation)
        report = _Training(session, levels, row, progress, speed).run()
    floor = report.floor.failure
    fed = float_inputs_note(session.batch(0)) if floor is not None and dtypes_refused(floor) else None
    if fed is not None:  # float64 batches a float32 model refuses at every row: the batches, not the precision
        report = dataclasses.replace(report, notes=(*report.notes, fed))
    if conv is not None:  # what ran at the flag, where the emulated rows tell (as check says it)
        report = dataclasses.replace(report, notes=(*report.notes, conv_scope.note(
            policy, cpu=target.device == "cpu", **ran_at_the_flag(session))))
    if changed:
        report = dataclasses.replace(report, notes=(*report.notes, changed_note(changed)))
    policy_row = next((lv for lv in report.levels if lv.policy is not None), None)
    floor_tf32 = None if conv is not None else cudnn_floor_note(
        session.families, target, session.op_maths.get(FLOOR, {}),
        session.op_maths.get(policy_row.level) if policy_row is not None else None, asked=workload.asked)
    if floor_tf32 is not None:
        report = dataclasses.replace(report, notes=(*report.notes, floor_tf32))
    rnns = scripted_rnn_note(workload.model, target)
    if rnns is not None:
        report = dataclasses.replace(report, notes=(*report.notes, rnns))
    return report


def ran_at_the_flag(session: TrainingSession) -> dict[str, bool]:
    """What the training ran that cuDNN's flag sets, as far as its rows tell (the emulated rows' op families), as
    ``ConvRun.note``'s ``convolutions`` and ``rnns``; a target not emulated tells nothing: the note's defaults (the
    convolutions ran at it)."""
    if not session.target.emulated:
        return {}
    return {"convolutions": "conv" in session.families, "rnns": "rnn" in session.families}


def cudnn_floor_note(families: Iterable[Optional[str]], target: Target,
                     floor_coverage: Mapping[tuple[str, str], int],
                     policy_coverage: Optional[Mapping[tuple[str, str], int]] = None, asked: str = "check"
                     ) -> Optional[str]:
    """The note for a training whose convolutions or RNNs ran TF32 in every row under cuDNN's flag as the process
    holds it (PyTorch's default 'tf32'), or None. No level sets that flag, so float32's own row ran them in TF32 too:
    its drift, against which every level is read (``x fp32``, the 3x floor), is then not IEEE float32's, and nothing
    in the tables said so (pesto's encoder: float32's drift 8e-3 with TF32 convolutions, 8e-5 with IEEE ones).
    ``floor_coverage``: float32's row's ops by math as the emulator counted them (``("aten::convolution",
    "tf32-rna")``: :attr:`TrainingSession.op_maths`), which say whether its
    convolutions ran TF32: a depthwise one runs in PyTorch's own kernel, IEEE whatever the flag;
    ``policy_coverage``, the policy row's, where one ran (a policy's conv math can give them IEEE there); ``asked``:
    whose words (a callback's takes conv= and has no ``--conv``: ``TrainingReport.asked``)."""
    if not target.emulated or target.device != "cuda":
        return None
    cells = {**flags.read_cells(), CUDNN_CELL: cudnn_cell()}
    # with cuDNN off they run as PyTorch's own GEMMs, at the level's matmul math (table_key): float32's row ran
    # them in IEEE float32, and no flag of cuDNN's set anything
    ran = [f for f in ("conv", "rnn") if f in families and target.table_key(f, cells) == f
           and target.math(f, cells).name != "ieee"]
    # a convolution as float32's row counted it: an NCHW depthwise one (PyTorch's own CUDA kernel) in IEEE float32
    if "conv" in ran and not _tf32_convs(floor_coverage):
        ran.remove("conv")
    if not ran:
        return None
    what = " and ".join({"conv": "convolutions", "rnn": "cuDNN's RNNs"}[f] for f in ran)
    flag = " and ".join(f"`{FLAGS[f]}` = '{cells.get('cuda.' + f, 'tf32')}'" for f in ran)
    # a policy row that gave them IEEE float32 (its conv math) is no row they ran TF32 in
    rows = "at every level" if policy_coverage is not None and not _tf32_convs(policy_coverage) else "in every row"
    return (f"{what} ran TF32 {rows}, float32's own included: cuDNN's own flag sets their math, not the level "
            f"({flag}, as this process holds it), so float32's drift here carries their TF32 rounding and each "
            f"level's multiple of it measures its matmuls alone; to see them in IEEE float32, train with conv='ieee'"
            f"{' (`--conv ieee`)' if asked == 'check' else ''}")


def _tf32_convs(coverage: Mapping[tuple[str, str], int]) -> bool:
    """Whether a row's coverage (``("aten::convolution", "tf32-rna")``: the emulator's ops by math) counted a
    convolution in a math other than IEEE float32 (however a ``"hardware"`` row summed it: ``"ieee, ideal sum"``
    is IEEE float32)."""
    return any(optable.family(op) == "conv" and counted_math(math) != "ieee" for op, math in coverage)


def scripted_rnn_note(model: torch.nn.Module, target: Target) -> Optional[str]:
    """The note for a model that trains a TorchScript part running an RNN on an emulated target, or None: not the
    target's RNN math, and no number says so (a traced GRU's drift read float32's own)."""
    names = scripted_rnns(model) if target.emulated else []
    if not names:
        return None
    shown = ", ".join(repr(n or ROOT) for n in names[:3]) + (" …" if len(names) > 3 else "")
    return (f"TorchScript with an RNN ({shown}): in training PyTorch breaks its aten::gru, rnn_tanh, rnn_relu or "
            f"lstm into plain GEMMs before the emulator sees it, so its GEMMs ran in each level's matmul math, not "
            f"the target's RNN math (cuDNN's, TF32 by its own flag on a GPU), or natively (oneDNN's LSTM, in "
            f"unhandled); train the eager module to measure it, or check() its forward, whose rows see the RNN whole")


def training_steps(workload: TrainingWorkload, steps: Optional[int]) -> int:
    """The steps to run: the workload's, or ``steps`` (a whole number >= 1, no more than its batches)."""
    steps = workload.steps if steps is None else check_steps(steps)
    if workload.available is not None and steps > workload.available:
        raise Tf32LabError(f"steps={steps}, but training workload {workload.name!r} has {workload.available} "
                           f"batches")
    return steps


def training_tolerance(tolerance: Optional[float]) -> float:
    """The training check's tolerance: ``None`` for the default, else one finite number >= 0."""
    if tolerance is None:
        return metrics.DEFAULT_TOLERANCE
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not math.isfinite(tolerance) \
            or tolerance < 0:  # a NumPy number is one (numbers.Real), a tensor is not
        raise Tf32LabError(f"a training check's tolerance is one number >= 0 (the loss's relative deviation), "
                           f"not {tolerance!r}")
    return float(tolerance)


def _scoped(level: str, target: Target, policy: Optional[PolicyRow]) -> Any:
    """The level of a row, for this thread (the emulator, when there is one, is entered apart).

    Natively with a policy, the level is the process's for the run: on CUDA, autograd runs the backward on its own
    (daemon) device thread, where the policy enters the pinned modules' scopes, and beside an unguarded scope of
    this thread that is refused (``control.scope``'s docstring); the flags are put back after the run."""
    return _process_level(level) if policy is not None and not target.emulated else precision(level)


@contextlib.contextmanager
def _inside(emu: Any, level: str) -> Iterator[None]:
    """``emu`` entered, then ``precision(level)`` inside it (where a scope never writes PyTorch's flag)."""
    with emu, precision(level):
        yield


@contextlib.contextmanager
def _process_level(level: str) -> Iterator[None]:
    before = flags.snapshot()
    try:
        set_float32_matmul_precision(level)
        yield
    finally:
        flags.restore(before)


def _cuda_devices(model: torch.nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def random_state_kept(model: torch.nn.Module, what: str = "check_training") -> Iterator[None]:
    """The random state as it was on every exit (``measure.draws.Streams``: PyTorch's CPU generator and the model's
    CUDA devices', NumPy's and Python's), and no other thread's check drawing from them meanwhile (refused)."""
    with Streams(_cuda_devices(model), what):
        yield


def _seeded(seed: int, model: torch.nn.Module) -> None:
    """The same streams for every row: the CPU generator and those of the model's CUDA devices (never another
    device's: ``torch.manual_seed`` would seed them all, and the caller's streams there would change)."""
    seeded(seed, _cuda_devices(model))


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a dense tensor: ``nn.Embedding(sparse=True)`` gives a sparse one, which the comparisons (and
    ``torch.equal``) do not take; an embedding's dense gradient is its weight's size, as the rows' copies of it are."""
    return grad.to_dense() if grad.layout != torch.strided else grad


def _not_finite(named: list[tuple[str, torch.nn.Parameter]]) -> Optional[str]:
    """The first parameter whose gradient holds a NaN or an Inf. Their norms in one fused call first (finite norms
    prove there is none; a norm can overflow where no element does), then the exact test where one is not."""
    grads = [(n, _dense(p.grad)) for n, p in named if p.grad is not None and p.grad.is_floating_point()]
    if not grads:
        return None
    norms = torch._foreach_norm([g.detach() for _, g in grads])
    # stacked on one device: each norm is on its gradient's, and a model spread over GPUs raised in torch.stack
    if bool(torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms])).all()):
        return None
    return next((n for (n, g), norm in zip(grads, norms)
                 if not bool(torch.isfinite(norm)) and not bool(torch.isfinite(g).all())), None)


@dataclasses.dataclass
class _Run:
    """What one row's training left: the losses, the first step's gradients, the model and optimizer after the
    last step (None after a failure), and how it failed."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    model: Optional[torch.nn.Module]
    optimizer: Optional[torch.optim.Optimizer]
    failure: Optional[str] = None
    failed_step: Optional[int] = None
    coverage: dict[str, int] = dataclasses.field(default_factory=dict)
    unhandled: dict[str, int] = dataclasses.field(default_factory=dict)
    families: set[Optional[str]] = dataclasses.field(default_factory=set)  # emulator.families_met
    op_maths: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)  # the emulator's (op, math) pairs


MATH_PATH_NOTE = (
    "attention with dropout ran on PyTorch's math path in the native rows, as in float64: a fused kernel "
    "(memory-efficient, flash, cuDNN) draws its dropout mask inside, where the float64 reference cannot draw the "
    "same; the math path's products follow the level (TF32 at 'high') where the fused float32 kernel computes "
    "3xTF32, so attention's error at 'high' is an upper bound")


class TrainingSession:
    """A training workload's float64 reference and step 1's backward per module, run once on :meth:`start`; then
    rows trained against them: a level (:meth:`level`) or a policy (:meth:`policy`), and float32's floor
    (:meth:`floor`, trained once, when first asked for). ``check_training`` is one session; ``tune`` trains many
    policies in one. :meth:`judged` gives a row its verdict against the floor."""

    def __init__(self, workload: TrainingWorkload, target: Target, steps: int, tolerance: float,
                 accumulation: Optional[str] = None) -> None:
        self.workload, self.target, self.steps, self.tolerance = workload, target, steps, tolerance
        self.accumulation = check_accumulation(accumulation)
        self.saved = _copied(workload.model, workload.name)  # the one saved state every row starts from
        self.seed = int(torch.randint(0, 2**31 - 1, ()))  # drawn inside the kept random state: the caller's is intact
        self.names = [name for name, p in self.saved.named_parameters() if p.requires_grad]
        self.runs = 0  # float32 rows trained
        self.families: set[Optional[str]] = set()  # the op families the emulated rows ran (None: an op of no family)
        # each row's ops by math, the emulator's (op, math) pairs, by the row's label (float32's floor, "policy": the
        # last row trained under it); the report's coverage is the same counts keyed "op math" for reading
        self.op_maths: dict[str, dict[tuple[str, str], int]] = {}
        self._floor: Optional[TrainingLevel] = None
        self._batches: dict[int, Any] = {}
        self._speed_notes: list[str] = []
        self._counted: Any = None  # one training step's counts, made once (with_speed may be asked again)
        # lazy modules made once, in the saved state, so every row (float64's too) starts from the same weights
        made = materialised(self.saved, lambda model: workload.run(model, self.batch(0)),
                            f"training workload {workload.name!r}")
        self._lazy_notes = [lazy_note(made)] if made else []
        # the dtype kind each draw of a step is made at in the float64 row, learnt from step 1 of a float32 copy
        # where the float64 row would draw otherwise (None: as Float64Run decides); see _plan
        self.plan: Optional[list[Optional[str]]] = None
        self._draw_notes: list[str] = []
        # native rows on a GPU: attention with dropout on the math path, whose draws float64 makes alike
        self._math_dropout = MathPathDropout() if cuda_devices(self.saved) else None

    def start(self, bar: Progress) -> None:
        """The float64 reference, then step 1's backward per module in float64."""
        bar.step(f"{self.workload.name}: float64 reference, {self.steps} steps")
        reference = self._train(torch.float64, None)
        if reference.failure is not None:
            reached = self.workload.reaching_model()  # the likely cause: the float32 original inside a float64 step
            raise Tf32LabError(f"training workload {self.workload.name!r} fails in float64, before any level "
                               f"ran: step {reference.failed_step}: {reference.failure}"
                               + (f"; {reached}" if reached else ""))
        self.reference = reference
        self.ref_grads = {n: g.to(torch.complex128) if g.is_complex() else g.double()
                          for n, g in reference.grads.items()}
        # a parameter whose float64 gradient is a negligible part of the whole (a key bias, which softmax cannot
        # see: its gradient is 0 but for rounding) is measured against this, not against its own near-zero norm
        # hypot: a one-value gradient's norm past 1.3e154 squared raised OverflowError, where the rows' failure is due
        total = math.hypot(*(float(torch.linalg.vector_norm(g)) for g in self.ref_grads.values()))  # no copies
        self.grad_floor = GRADIENT_FLOOR * total / math.sqrt(max(1, len(self.ref_grads)))
        self.ref_params = dict(reference.model.named_parameters())
        self.ref_state = _optimizer_state(reference.model, reference.optimizer)
        bar.step("backward of each module at step 1, float64")
        self.attribution = _Attribution(self.workload, self.saved, self.seed, self.batch(0, torch.float64),
                                        self._float64_run)

    def floor(self, bar: Optional[Progress] = None) -> TrainingLevel:
        """float32 at ``highest`` on the target, judged against itself (trained on the first call).

        When an emulated row has already run and every op family it met computes IEEE at ``highest`` on the
        target, the floor runs natively in float32 (``precision("highest")``, no emulator): the same math, without
        the emulator's per-op dispatch, which costs more than the row itself on small models."""
        if self._floor is None:
            if bar is not None:
                bar.step(f"float32 (highest on {self.target.name}), {self.steps} steps")
            floor = self._row("highest", FLOOR, None, emulated=not self._ieee_at_highest())
            self._floor = self.judged(floor, floor)
        return self._floor

    def _ieee_at_highest(self) -> bool:
        if not self.target.emulated or not self.families or None in self.families or self.accumulation != "ideal":
            return False  # "hardware": even IEEE float32 sums as the target's kernels do
        maths = self.target.maths_at("highest", context_cells())
        return all(m == "ieee" for key, m in maths.items() if key.split(".")[0] in self.families)

    def level(self, level: str) -> TrainingLevel:
        """A row trained at ``level`` (not judged yet: :meth:`judged`)."""
        return self._row(level, level, None)

    def policy(self, row: PolicyRow) -> TrainingLevel:
        """A row trained with ``row``'s policy applied, at its base level (not judged yet: :meth:`judged`)."""
        return self._row(row.base, "policy", row)

    def judged(self, row: TrainingLevel, floor: Optional[TrainingLevel] = None) -> TrainingLevel:
        """The verdict: no failure, and within the tolerance or within FLOOR_MULTIPLE of float32's own drift."""
        floor = floor or self.floor()
        multiple = _multiple(row.drift, floor.drift)
        # float32 failing itself is no drift to be within: past the tolerance, a level then fails
        passed = row.failure is None and (row.divergence_step is None or multiple <= FLOOR_MULTIPLE)
        return dataclasses.replace(row, multiple=multiple, passed=passed)

    @property
    def notes(self) -> tuple[str, ...]:
        routed = (MATH_PATH_NOTE,) if self._math_dropout is not None and self._math_dropout.rerouted else ()
        return tuple(self._lazy_notes) + tuple(self._draw_notes) + routed + tuple(self.attribution.notes) + \
            tuple(self._speed_notes)

    def with_speed(self, rows: list[TrainingLevel], policy: Optional[PolicyRow]) -> list[TrainingLevel]:
        """``rows`` with each one's predicted speedup of a training step on the target over ``highest``
        (``tf32lab.speed``: one step's forward, backward and optimizer update counted here), where the target has
        a speed model; a step the counter cannot follow leaves the rows without one, and a note says why."""
        if self.target.peaks is None or not rows:
            return rows
        if self._counted is None:
            try:
                self._counted = self._step_counts()
            except (Tf32LabError, KeyboardInterrupt):
                raise
            except BaseException as exc:  # sys.exit() included: the rows, run already, say it as their failure
                bug = internal_error(exc, "counting a training step")
                if bug is not None:  # said as tf32lab's, in one line, as everywhere else
                    raise bug from exc
                self._speed_notes.append(f"no speed predicted: counting one training step raised {described(exc)}")
                self._counted = False
        if self._counted is False:
            return rows
        counts = self._counted
        levels = sorted({r.level for r in rows if r.level in ALL_LEVELS} | {"highest"}, key=ALL_LEVELS.index)
        report = predict_counts(counts, str(self.workload.name), self.target, levels, step="training")
        out = []
        for row in rows:
            if row.level in ALL_LEVELS:
                speed = report.level(row.level)
                out.append(dataclasses.replace(row, speedup=speed.speedup, speedup_band=speed.band))
            elif row.level == "policy" and policy is not None:
                base = report.level("highest").seconds
                time = seconds_at(counts, self.target, lambda layer: policy.by_name.get(layer, policy.base),
                                  lambda layer: policy.conv_by_name.get(layer, policy.conv_by_name.get(ROOT)))
                out.append(dataclasses.replace(row, speedup=base / time if time > 0 else None))
            else:
                out.append(row)
        return out

    def _step_counts(self) -> Any:
        model = _trainable_copy(self.saved)
        batch = self.batch(0)
        with Counting(model, backward=True) as counts:
            loss = self.workload.loss_of(self.workload.run(model, batch), batch, model)
            loss.backward()
        name = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}.get(
            type(self._optimizer(model)))
        counts.ops.extend(optimizer_ops(model, name))
        return counts

    def report(self, rows: Iterable[TrainingLevel], seconds: float) -> TrainingReport:
        return TrainingReport(
            workload=str(self.workload.name), target=self.target.name, steps=self.steps, tolerance=self.tolerance,
            reference_losses=tuple(self.reference.losses), floor=self.floor(), levels=tuple(rows),
            environment=environment_of(self.workload),  # type: ignore[arg-type]  # reads .model
            seconds=seconds, notes=self.notes, asked=self.workload.asked,
        )

    # -- one row ------------------------------------------------------------------------------------------------
    def _row(self, level: str, label: str, policy: Optional[PolicyRow], emulated: bool = True) -> TrainingLevel:
        started = time.perf_counter()
        self.runs += 1
        cells = context_cells()
        run = self._train(torch.float32, level, policy, emulated=emulated)
        self.families |= run.families
        self.op_maths[label] = run.op_maths
        maths = {} if not self.target.emulated else (
            policy_maths(policy, self.target, cells) if policy else self.target.maths_at(level, cells))
        if maths.get("conv") not in (None, "ieee", "mixed") and run.op_maths:  # as check's rows: depthwise ones IEEE
            maths = {**maths, "conv": conv_ran(maths["conv"], run.op_maths)}
        deviations = tuple(_deviation(x, r) for x, r in zip(run.losses, self.reference.losses)
                           if math.isfinite(x))
        divergence = next((k + 1 for k, d in enumerate(deviations) if d > self.tolerance), None)
        work = scratch(torch.device("cpu"))  # the comparisons' chunk buffer, for the tensors on the CPU
        gradients = _ranked({n: _against(g, self.ref_grads[n], self.grad_floor, work) for n, g in run.grads.items()
                             if n in self.ref_grads})
        weights: tuple[ParameterError, ...] = ()
        state = math.nan
        if run.model is not None:
            params = dict(run.model.named_parameters())
            weights = _ranked({n: _against(params[n], self.ref_params[n], work=work) for n in self.names})
            state = _state_error(_optimizer_state(run.model, run.optimizer), self.ref_state)
        layers = self.attribution.introduced(level, self.target, policy, self.accumulation if emulated else None)
        return TrainingLevel(
            level=label, maths=maths, losses=tuple(run.losses), deviations=deviations, divergence_step=divergence,
            gradients=gradients, layers=layers, weights=weights, optimizer_state=state, multiple=math.nan,
            passed=False, coverage=run.coverage, unhandled=run.unhandled, seconds=time.perf_counter() - started,
            failure=run.failure, failed_step=run.failed_step,
            policy=policy.describe() if policy is not None else None,
        )

    def _train(self, dtype: torch.dtype, level: Optional[str], policy: Optional[PolicyRow] = None,
               emulated: bool = True) -> _Run:
        """``steps`` steps of a fresh copy in ``dtype``, at ``level`` on the target (float64: no level; not
        ``emulated``: natively, for a level the target computes in IEEE)."""
        workload = self.workload
        model = _trainable_copy(self.saved)  # train/eval modes as the caller's model has them
        if dtype == torch.float64:
            model = widened_model(model)  # complex64 weights too: Module.double() leaves them
        optimizer = self._optimizer(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        run = _Run([], {}, model, optimizer)
        emu = emulate(self.target, accumulation=self.accumulation) \
            if level is not None and self.target.emulated and emulated else None
        # emulated, the level's scope is entered inside each emulate() block: such a scope never writes the flag
        # (a level this torch cannot set, bfx9, runs), and the ops between blocks run no matmul-family op
        scoped = contextlib.nullcontext() if level is None or emu is not None else _scoped(level, self.target, policy)
        # float64: every random op drawn as a float32 row draws it (measure.draws), and every op of the step
        # widened (a tensor the model makes in float32 on the fly too) where step 1 shows it matters
        if dtype == torch.float64:
            widened = self._widening()  # before the row's seed: the probe draws from the streams too
            forward = self._float64_run if widened else SameDraws
        elif emu is not None:
            forward = lambda: _inside(emu, level)  # noqa: E731
        else:
            forward = self._native
        _seeded(self.seed, model)
        applied = policy.policy.applied(model) if policy is not None else contextlib.nullcontext()
        # PyTorch's own element-wise optimizers run no matmul-family op: their step runs outside the emulator,
        # whose dispatch costs more than the step itself (any other optimizer's step is emulated like the rest)
        step_emu = emu if not elementwise_step(optimizer) else None
        release_buffers()
        step = 0
        with scoped, applied:
            try:
                for step in range(self.steps):
                    batch = self.batch(step, dtype)
                    with forward():
                        loss = workload.loss_of(workload.run(model, batch), batch, model)
                        value = float(loss.detach())
                        run.losses.append(value)
                        if not math.isfinite(value):
                            run.failure, run.failed_step = f"the loss is {value}", step + 1
                            break
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                    bad = _not_finite(named)
                    if bad is not None:
                        run.failure, run.failed_step = f"the gradient of {bad!r} is not finite", step + 1
                        break
                    if step == 0:
                        run.grads = {n: _dense(p.grad.detach()).clone() for n, p in named if p.grad is not None}
                    with _inside(step_emu, level) if step_emu is not None else contextlib.nullcontext():
                        optimizer.step()
            except (Tf32LabError, KeyboardInterrupt):  # Ctrl-C stops the check
                raise
            except BaseException as exc:  # sys.exit() included: the row fails at that step, never a silent end
                where = "float64" if level is None else f"level {level!r}"
                if out_of_memory(exc):
                    raise Tf32LabError(f"training workload {workload.name!r}: out of memory at step {step + 1} "
                                       f"({where}); the training check holds the model's float64 copy and its "
                                       f"optimizer state beside the run: try a smaller batch") from exc
                bug = internal_error(exc, f"training workload {workload.name!r} at {where}, step {step + 1}")
                if bug is not None:
                    raise bug from exc
                run.failure, run.failed_step = described(exc), step + 1
        if emu is not None:
            run.op_maths = dict(sorted(emu.coverage.items()))
            run.coverage = {f"{op} {m}": n for (op, m), n in run.op_maths.items()}
            run.unhandled = dict(sorted(emu.unhandled.items()))
            run.families = families_met(emu)
        if run.failure is not None:
            run.model = run.optimizer = None
        return run

    def _native(self) -> contextlib.AbstractContextManager:
        """A native float32 row's forward and backward: on a GPU, attention with dropout on PyTorch's math path
        (:class:`~tf32lab.measure.draws.MathPathDropout`)."""
        return contextlib.nullcontext() if self._math_dropout is None else self._math_dropout

    def _widening(self) -> bool:
        """Whether the float64 row needs ``Float64Run`` beyond the ``.double()`` copy (whose random ops draw at
        float32 under ``SameDraws``). Its per-op handlers cost more than a small model's step, and most models make
        no float32 tensor of their own: step 1 is run both ways, and only when loss and gradients differ in a bit
        (the model made a float32 tensor) does every step run inside it. Where step 1 drew, the draws' dtypes are
        learnt first (:meth:`_plan`)."""
        wide = self._step_one(self._float64_run)
        if wide is not None and wide[1]:
            self.plan = self._plan(wide[1])
            if self.plan is not None:
                wide = self._step_one(self._float64_run)
        same = self._step_one(SameDraws)
        if wide is None or same is None:
            return True  # the row itself says what fails, with every op widened
        return len(wide[0]) != len(same[0]) or not all(torch.equal(a, b) for a, b in zip(wide[0], same[0]))

    def _step_one(self, mode: Callable[[], Any], dtype: torch.dtype = torch.float64
                  ) -> Optional[tuple[list[torch.Tensor], list[tuple[str, Optional[str]]]]]:
        """Step 1's loss and gradients in a fresh copy in ``dtype``, inside ``mode()`` (a ``Float64Run``, or a
        ``DrawLog`` pushed on the stack), and the draws it kept; None where it raises."""
        model = _trainable_copy(self.saved)
        model = widened_model(model) if dtype == torch.float64 else model
        _seeded(self.seed, model)
        batch = self.batch(0, dtype)
        run = mode()
        try:
            with contextlib.ExitStack() as stack:
                if isinstance(run, DrawLog):  # a mode of its own, not a context manager of ours
                    modestack.push(run)
                    stack.callback(modestack.remove, run)
                else:
                    stack.enter_context(run)
                loss = self.workload.loss_of(self.workload.run(model, batch), batch, model)
                loss.backward()
        except (Tf32LabError, KeyboardInterrupt):
            raise
        except BaseException:  # sys.exit() included
            return None
        grads = [loss.detach()] + [_dense(p.grad) for p in model.parameters() if p.grad is not None]
        return grads, list(run.drawn) if isinstance(run, (Float64Run, DrawLog)) else []

    def _float64_run(self) -> Float64Run:
        """``Float64Run`` for one step of the float64 row: each draw at the dtype the float32 rows make it at, where
        step 1 showed that it would not be (:meth:`_plan`)."""
        run = Float64Run()
        run.plan = self.plan
        return run

    def _plan(self, drawn: list[tuple[str, Optional[str]]]) -> Optional[list[Optional[str]]]:
        """The dtype kind of each draw of a step as the float32 rows make them, where ``Float64Run`` made some of
        step 1's (``drawn``) at the other of float32 and float64 (None where they agree). In the float64 row's
        ``.double()`` copy a dtype read off its weights or inputs and kept (torchsde's Brownian motion takes
        ``y0.dtype``) cannot be told from the model's own float64 (``torch.randn(n, dtype=torch.float64)``), and
        a float64 draw where the rows draw float32 made float32's own drift noise (0.86 at step 1), beside which
        every level passed. Step 1 is run once more in float32 (as ``check`` learns its reference's draws from its
        first row); each step is assumed to draw as step 1 did."""
        rows = self._step_one(DrawLog, torch.float32)
        if rows is None:
            return None
        plan, differing = draw_plan(drawn, rows[1])
        if plan is not None:
            self._draw_notes.append(
                f"{differing} of the {len(plan)} random draw(s) of step 1 were made at another dtype in float64 than "
                f"in float32 (a dtype read off a widened tensor and kept); the float64 row draws each step's as the "
                f"float32 rows do ({plan.count('float64')} at float64, the rest at float32 and cast up)")
        return plan

    def batch(self, step: int, dtype: torch.dtype = torch.float32) -> Any:
        """Step ``step``'s batch, fetched once for every row (a function that draws from a random stream gives
        every row the same data), each row given its own copy (a model that edits its inputs in place changes
        neither the caller's tensors nor the next row's)."""
        if step not in self._batches:
            self._batches[step] = self.workload.batch(step)
        batch = self._batches[step]
        return map_tensors(widen if dtype == torch.float64 else torch.Tensor.clone, batch)

    def _optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The workload's optimizer over ``model``'s trainable parameters, refused in one line when it cannot
        serve a training check (it raises, needs a closure, or steps other parameters)."""
        workload = self.workload
        params = [p for p in model.parameters() if p.requires_grad]
        try:
            optimizer = workload.make_optimizer(params)
        except Tf32LabError:
            raise
        except Exception as exc:
            raise Tf32LabError(f"training workload {workload.name!r}: optimizer(params) raised {described(exc)}"
                               ) from exc
        step = inspect.signature(optimizer.step).parameters.get("closure")
        if step is not None and step.default is inspect.Parameter.empty:
            raise Tf32LabError(f"training workload {workload.name!r}: {type(optimizer).__name__} needs a closure "
                               f"(it evaluates the loss itself); the training check steps optimizers that take "
                               f"the gradients as they are (SGD, Adam, AdamW, ...)")
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not held or not held <= {id(p) for p in params}:
            raise Tf32LabError(f"training workload {workload.name!r}: the optimizer does not step the parameters "
                               f"it was given (optimizer must make one from its argument, e.g. lambda params: "
                               f"torch.optim.AdamW(params), not from the model itself)")
        return optimizer


class _Training:
    """One check: the session, then each level (levels the target computes alike run once), then the policy."""

    def __init__(self, session: TrainingSession, levels: tuple[str, ...], row: Optional[PolicyRow],
                 progress: bool, speed: bool = True) -> None:
        self.session, self.levels, self.row, self.progress, self.speed = session, levels, row, progress, speed

    def run(self) -> TrainingReport:
        started = time.perf_counter()
        session, target = self.session, self.session.target
        alike = alike_levels(("highest", *[lv for lv in self.levels if lv != "highest"]), target)
        runs = 2 + sum(1 for lv in self.levels if lv != "highest" and alike[lv] is None) + (self.row is not None)
        with Progress(self.progress, steps=runs + 1) as bar:
            session.start(bar)
            rows: dict[str, TrainingLevel] = {}
            for level in self.levels:  # the floor last: the emulated rows tell whether it may run natively
                if level != "highest" and alike[level] is None:
                    bar.step(f"{level}: {session.steps} steps")
                    rows[level] = session.level(level)
            policy = None
            if self.row is not None:
                bar.step(f"policy: {session.steps} steps")
                policy = session.policy(self.row)
            floor = session.floor(bar)
        rows_of_alike(self.levels, alike, rows, floor)
        results = [session.judged(rows[level]) for level in self.levels]
        if policy is not None:
            results.append(session.judged(policy))
        if self.speed:
            results = session.with_speed(results, self.row)
        return session.report(results, time.perf_counter() - started)


# -- the first step's backward, module by module --------------------------------------------------------------
class _Attribution:
    """Each module with parameters, at step 1 in float64: its inputs and the gradients reaching its outputs, and
    the gradients its own backward computes from them. :meth:`introduced` reruns each one in float32 under a
    level (fed those float64 inputs and output gradients, rounded to float32) and measures its own gradients."""

    def __init__(self, workload: TrainingWorkload, saved: torch.nn.Module, seed: int, batch: Any,
                 run: Callable[[], Float64Run] = Float64Run) -> None:
        self.saved, self.seed, self.notes = saved, seed, []
        model = widened_model(_trainable_copy(saved))
        self.kinds = {}
        calls: dict[str, list[Any]] = {}
        handles = []
        for name, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):  # takes no hooks (nor do its insides): no row
                continue
            if name and any(p.requires_grad for p in module.parameters(recurse=False)):
                self.kinds[name] = type(module).__name__
                handles.append(module.register_forward_hook(self._keep(name, calls), with_kwargs=True))
        _seeded(seed, model)
        try:
            with run():  # step 1's draws as the float64 row makes them
                loss = workload.loss_of(workload.run(model, batch), batch, model)
                loss.backward()
        finally:
            for handle in handles:
                handle.remove()
        self.calls: dict[str, tuple[Any, Any, dict[str, torch.Tensor], list[torch.Tensor]]] = {}
        again = [name for name, (_, _, _, count) in calls.items() if count[0] > 1]
        times = {count[0] for _, _, _, count in calls.values()}
        if again and len(again) == len(calls) and len(times) == 1:  # a step of micro-batches, each the whole model
            self.notes.append(f"every module ran {times.pop()} times a step (once a micro-batch under gradient "
                              f"accumulation, or a forward called as often): the backward of each is measured at "
                              f"its first call")
        elif again:
            names = ", ".join(repr(n) for n in again[:3]) + (" …" if len(again) > 3 else "")
            self.notes.append(f"{len(again)} module(s) run more than once a step ({names}): the backward of each is "
                              f"measured at its first call")
        # a module a gradient reached whose forward no hook saw: a __call__ of its own runs forward past PyTorch's
        # hooks (every gpytorch module's), so its own backward cannot be measured. A parameter tied to a module
        # that ran (T5's `shared`, whose weight is `encoder.embed_tokens`'s and `lm_head`'s, and which never runs
        # itself) is measured in that module's row: its owner that did not run is no module past the hooks
        ran = {id(p) for name in calls for p in model.get_submodule(name).parameters(recurse=False)}
        unhooked = [name for name in self.kinds if name not in calls and
                    any(p.grad is not None and id(p) not in ran
                        for p in model.get_submodule(name).parameters(recurse=False))]
        # one whose class has PyTorch's own __call__ did not run past the hooks: it never ran, and its parameters
        # were used by other code (a parent's functional call, F.linear(x, self.shared.weight))
        unused = [name for name in unhooked if type(model.get_submodule(name)).__call__ is torch.nn.Module.__call__]
        unhooked = [name for name in unhooked if name not in unused]
        if unhooked:
            names = ", ".join(repr(n) for n in unhooked[:3]) + (" …" if len(unhooked) > 3 else "")
            self.notes.append(f"{len(unhooked)} module(s) with parameters have no backward row ({names}): their "
                              f"forward ran past PyTorch's module hooks (a __call__ of their own, as gpytorch's "
                              f"modules have), so their own backward is not measured")
        if unused:
            names = ", ".join(repr(n) for n in unused[:3]) + (" …" if len(unused) > 3 else "")
            self.notes.append(f"{len(unused)} module(s) with parameters have no backward row ({names}): they never "
                              f"ran, and their parameters were used by other code (a parent's functional call, "
                              f"such as F.linear(x, self.{unused[0]}.weight)), whose own backward is not measured")
        reached = [name for name, (_, _, grads, _) in calls.items() if not grads]
        if reached:
            names = ", ".join(repr(n) for n in reached[:3]) + (" …" if len(reached) > 3 else "")
            self.notes.append(f"{len(reached)} module(s) with parameters have no backward row ({names}): no "
                              f"gradient reached a tensor of their output (an output that holds none, such as a "
                              f"transform or distribution object, or one off the loss's path)")
        for name, (args, kwargs, grads, _) in calls.items():
            if not grads:
                continue
            module = model.get_submodule(name)
            with Float64Run():
                local = _local_grads(module, args, kwargs, grads, seed)
            if local is not None:
                self.calls[name] = (args, kwargs, grads, local)

    def _keep(self, name: str, calls: dict[str, list[Any]]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if transformed():  # inside vmap or grad: its tensors cannot leave the transform; its caller's ops
                return
            if name in calls:
                calls[name][3][0] += 1
                return
            grads: dict[str, torch.Tensor] = {}
            for key, t in named_tensors(output):
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(lambda g, key=key: grads.__setitem__(key, g.detach()))
            detach = lambda t: t.detach()  # noqa: E731
            calls[name] = [map_tensors(detach, args), map_tensors(detach, kwargs), grads, [1]]

        return hook

    def introduced(self, level: str, target: Target, policy: Optional[PolicyRow],
                   accumulation: Optional[str]) -> tuple[BackwardLayer, ...]:
        """Each module's backward error at ``level``, emulated with ``accumulation`` (None: natively)."""
        model = _trainable_copy(self.saved)
        applied = policy.policy.applied(model) if policy is not None else contextlib.nullcontext()
        emulated = target.emulated and accumulation
        scoped = _inside(emulate(target, accumulation=accumulation), level) if emulated else \
            _scoped(level, target, policy)
        # natively on a GPU, attention with dropout on the math path, as in the rows (TrainingSession._native)
        routed = MathPathDropout() if not emulated and cuda_devices(model) else contextlib.nullcontext()
        found = []
        with scoped, applied, routed:
            for name, (args, kwargs, grads, reference) in self.calls.items():
                narrow = {k: g.float() if g.dtype == torch.float64 else g for k, g in grads.items()}
                local = _local_grads(model.get_submodule(name), map_tensors(_narrowed, args),
                                     map_tensors(_narrowed, kwargs), narrow, self.seed)
                error = math.nan if local is None else _tree_error(local, reference)
                found.append(BackwardLayer(name, self.kinds[name], error))
        return tuple(sorted(found, key=lambda e: -math.inf if math.isnan(e.introduced) else -e.introduced))


def _local_grads(module: torch.nn.Module, args: Any, kwargs: Any, grads: dict[str, torch.Tensor],
                 seed: int) -> Optional[list[torch.Tensor]]:
    """The gradients ``module``'s own backward gives its floating inputs and parameters, fed ``grads`` at its
    outputs; None when it cannot be run alone (it then has no row)."""
    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(True) if t.is_floating_point() or t.is_complex() else t

    args, kwargs = map_tensors(leaf, args), map_tensors(leaf, kwargs)
    inputs = [t for _, t in named_tensors((args, kwargs)) if t.requires_grad]
    params = [p for p in module.parameters(recurse=False) if p.requires_grad]
    _seeded(seed, module)  # a module that samples (dropout inside) draws alike in every rerun
    try:
        with torch.enable_grad():
            output = module(*args, **kwargs)
            outs = dict(named_tensors(output))
            keys = [k for k in grads if k in outs and outs[k].requires_grad]
            if not keys:
                return None
            found = torch.autograd.grad([outs[k] for k in keys], inputs + params,
                                        grad_outputs=[grads[k].to(outs[k].dtype) for k in keys], allow_unused=True)
    except (Tf32LabError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # sys.exit() included: as a step's, a finding (its row says it), not an end
        if internal_error(exc, "rerunning a module's backward") is not None:
            raise
        return None
    return [torch.zeros_like(x) if g is None else _dense(g.detach()) for g, x in zip(found, inputs + params)]


def _narrowed(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
        return t.float()
    if isinstance(t, torch.Tensor) and t.dtype == torch.complex128:
        return t.to(torch.complex64)
    return t


# -- numbers ----------------------------------------------------------------------------------------------------
def _copied(model: torch.nn.Module, name: Any) -> torch.nn.Module:
    try:
        return _trainable_copy(model)
    except Exception as exc:
        raise Tf32LabError(f"training workload {name!r}: the model cannot be copied ({type(exc).__name__}: {exc}); "
                           f"the training check trains copies, never the model itself") from exc


def _trainable_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters are leaves that require grad where the model's do. A
    ScriptModule's deep copy clones its parameters as ops: under no_grad they no longer require grad (a scripted
    part was frozen in every row), with grad on they are not leaves (no optimizer takes them)."""
    with torch.no_grad():
        copied = copy.deepcopy(model, _unmade_buffers(model))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    for n, p in copied.named_parameters():
        if n in trained and not p.requires_grad:
            p.requires_grad_(True)
    return copied


def _unmade_buffers(model: torch.nn.Module) -> dict[int, Any]:
    """A deepcopy memo that gives each buffer a lazy module has not made yet (``nn.LazyBatchNorm1d``'s running
    statistics) a fresh unmade one: PyTorch copies an unmade parameter so, but refuses to copy an unmade buffer."""
    unmade = torch.nn.parameter.UninitializedBuffer
    return {id(b): unmade(requires_grad=b.requires_grad, device=b.device, dtype=b.dtype,
                          persistent=getattr(b, "persistent", True))
            for b in model.buffers() if isinstance(b, unmade)}


def _deviation(value: float, reference: float) -> float:
    """|value − reference| relative to |reference| (absolute where the reference is 0)."""
    diff = abs(value - reference)
    return diff / abs(reference) if reference != 0 else diff


# ‖x‖²/‖r‖² where 1 − cos from ‖x − r‖ is the closer (norms within 1e4 of each other: error below 1e-12); beyond it
# (a gradient that is 0 in float64 but for rounding, against a row's 1e-3 of noise) the dot product's cosine
_COMPARABLE = (1e-8, 1e8)


def _against(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0, work: Optional[torch.Tensor] = None
             ) -> tuple[float, float]:
    """(normwise error, cosine) of ``x`` against ``ref``, in float64; the error over ``max(‖ref‖, floor)``. A complex
    gradient (a Fourier layer's weights) as (real, imaginary) pairs: ``.double()`` drops the imaginary part.
    ``work``: a :func:`~tf32lab.measure.norms.scratch` to sum through a chunk at a time, without float64 copies."""
    sums = distance_sums(x, ref, work) if work is not None else None
    if sums is not None and not _COMPARABLE[0] <= sums[0] / sums[1] <= _COMPARABLE[1]:
        sums = None  # the difference's cosine loses eps·(‖x‖/‖r‖) to cancellation: x·r is exact enough there
    if sums is not None:
        x_norm, ref_norm, diff = (math.sqrt(s) for s in sums)
        # 1 − cos from the difference's norm (‖x − r‖² = ‖x‖² + ‖r‖² − 2 x·r), which keeps what x·r loses to
        # cancellation where the two are nearly parallel, as a row's weights and float64's are
        cosine = min(1.0, 1.0 - (sums[2] - (x_norm - ref_norm) ** 2) / (2.0 * x_norm * ref_norm))
    else:
        x, ref = (metrics.pairs(t.detach().to(torch.complex128)) if t.is_complex() else t.detach().double()
                  for t in (x, ref))
        x, ref = x.reshape(-1), ref.reshape(-1)
        ref_norm, x_norm = float(ref.norm()), float(x.norm())
        if not math.isfinite(x_norm):
            return math.inf, math.nan
        cosine = float(x @ ref) / (x_norm * ref_norm) if x_norm > 0 and ref_norm > 0 else math.nan
        diff = float((x - ref).norm())
    if ref_norm < floor:
        return diff / floor, cosine
    if ref_norm == 0.0:  # as metrics.normwise: 0 when both are zero, inf when only the reference is
        return (0.0 if diff == 0.0 else math.inf), cosine
    return diff / ref_norm, cosine


def _ranked(found: dict[str, tuple[float, float]]) -> tuple[ParameterError, ...]:
    rows = [ParameterError(name, normwise, cosine) for name, (normwise, cosine) in found.items()]
    return tuple(sorted(rows, key=lambda e: -math.inf if math.isnan(e.normwise) else -e.normwise))


def _tree_error(found: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The normwise error of several tensors taken as one vector (:func:`metrics.normwise_over`), summed a chunk at
    a time where each pair allows (:func:`~tf32lab.measure.norms.distance_sums`)."""
    if len(found) != len(reference) or any(x.shape != r.shape for x, r in zip(found, reference)):
        return math.nan
    work = scratch(torch.device("cpu"))
    sums = [distance_sums(x, r, work) for x, r in zip(found, reference)]
    if any(s is None for s in sums):
        return metrics.normwise_over(found, reference)
    # as normwise_over combines them: the norm of the norms (the references' not 0: their sums are in the safe range)
    return math.hypot(*(math.sqrt(s[2]) for s in sums)) / math.hypot(*(math.sqrt(s[1]) for s in sums))


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every per-parameter state tensor of ``optimizer`` (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's momentum),
    named ``param:key``."""
    found = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                found[f"{name}:{key}"] = _dense(value.detach())  # SGD's momentum of a sparse gradient is sparse
    return found


def _state_error(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    keys = [k for k in reference if k in state]
    if not keys:
        return math.nan
    return _tree_error([state[k] for k in keys], [reference[k] for k in keys])


def _multiple(drift: float, floor: float) -> float:
    if math.isinf(drift):
        return math.inf
    if math.isinf(floor):  # float32 failed: no drift to compare with
        return math.nan
    if floor == 0:
        return 1.0 if drift == 0 else math.inf
    return drift / floor
