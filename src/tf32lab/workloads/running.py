"""Running a workload for a measurement: a model carrying an applied policy refused, PyTorch's flags kept as they
were, a ``sys.exit()`` made a one-line error, the machine it ran on described, and a progress bar. Shared by
``check``, ``predict``, ``bench`` and ``tune``.

Example:

    >>> import torch
    >>> from tf32lab.workloads.running import kept_flags
    >>> with kept_flags() as changed:
    ...     torch.set_float32_matmul_precision("medium")   # as a model's forward might
    >>> torch.get_float32_matmul_precision(), any("'medium'" in note for note in changed)   # put back, and said
    ('highest', True)
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator
from typing import Any, Optional

import torch

from tf32lab.control import flags
from tf32lab.control.scope import get_float32_matmul_precision
from tf32lab.errors import Tf32LabError
from tf32lab.machine import hardware
from tf32lab.numbers.origin import exit_call
from tf32lab.numbers.trees import named_tensors
from tf32lab.report import terminal  # noqa: F401 (rich, imported later, without drawing from random)
from tf32lab.workloads.workload import Workload


def refuse_applied(workload: Workload, what: str) -> None:
    """Refuse, before any run, a model that carries an applied policy: it sets each module's level as the module
    runs, so ``check`` would measure the policy under every level's name (and ``tune`` would tune on top of it).
    Refusing (rather than lifting it for the duration) leaves the user's policy untouched; the message says how to
    go on (:func:`applied_refusal`)."""
    refusal = applied_refusal(workload.model, str(workload.name), what)
    if refusal is not None:
        raise Tf32LabError(refusal)


def applied_refusal(model: torch.nn.Module, name: str, what: str) -> Optional[str]:
    """The line refusing ``model`` where it carries an applied policy, in the words of ``what`` asks (``"check"``,
    ``"tune"``, ``"predict"``, ``"bench"``, or ``"callback"``: a training loop's, which checks a policy given to
    it); None where none is applied."""
    from tf32lab.control.policy import applied_to

    found = applied_to(model)
    if found is None:
        return None
    from tf32lab.report.conclusion import policy_summary

    summary = policy_summary(dict(found.to_dict(), base=get_float32_matmul_precision()))
    measure = {
        "check": "pass it as check(policy=...) (tf32lab check --policy FILE) to measure it beside the levels",
        "tune": "tune searches a policy itself",
        "predict": "check(policy=...) (tf32lab check --policy FILE) predicts its speedup beside the levels",
        "bench": "bench times each level of the model without a policy",
        "callback": "give it to the callback (policy=...), which checks it as one more row beside the levels",
    }[what]
    who = "the check" if what == "callback" else what
    return (f"workload {name!r}: its model has a policy applied ({summary}); {who} would measure that policy "
            f"instead of each level: remove it first (handle.remove()); {measure}")


@contextlib.contextmanager
def kept_flags() -> Iterator[list[str]]:
    """Every PyTorch precision flag as it was, put back on every exit (KeyboardInterrupt included): a model that
    calls ``torch.set_float32_matmul_precision`` in its forward must not leave its level in the process. Yields a
    list that names, at exit, each flag that had been changed (for the report's notes)."""
    before = flags.snapshot()
    changed: list[str] = []
    try:
        yield changed
    finally:
        diff = before.diff(flags.snapshot())
        if diff:
            flags.restore(before)
            changed += [f"{name} {old!r} -> {new!r}" for name, old, new in diff]


@contextlib.contextmanager
def autograd_on() -> Iterator[None]:
    """Autograd recording while a training step runs, whatever the caller's mode: a library that loads a model can
    turn it off for the whole process (silero-stress's ``load_accentor`` calls ``torch.set_grad_enabled(False)``),
    and a caller can call in from ``torch.inference_mode()``, where ``torch.enable_grad()`` alone records nothing
    (the loss then depended on no parameter). The caller's modes are put back on every exit."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


@contextlib.contextmanager
def exits_refused(name: object, what: str) -> Iterator[None]:
    """A ``SystemExit`` (``sys.exit()`` in a model, its loss or a batches function), or any other BaseException
    that is not an Exception, that leaves ``what`` (``"check"``) where no row records it, as one ``Tf32LabError``:
    ``what`` then has no verdict, and neither the CLI nor a caller's ``sys.exit(0 if report else 1)`` may end the
    program with 0 as if it had passed. (A run at a level that raises one fails that row instead: a finding.)
    KeyboardInterrupt goes through: Ctrl-C stops the program (the CLI's exit 130)."""
    try:
        yield
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as exc:
        said = f"called {exit_call(exc)}" if isinstance(exc, SystemExit) else (
            f"raised {type(exc).__name__}" + (f" ({str(exc).strip().splitlines()[0]})" if str(exc).strip() else ""))
        raise Tf32LabError(f"workload {name!r} {said} during {what}, outside any level's run, so {what} has "
                           f"no verdict; a model, loss, inputs or batches function must return or raise an "
                           f"Exception, not end the program") from exc


def changed_note(changed: list[str]) -> str:
    return (f"the workload changed PyTorch's flags while it ran ({'; '.join(changed[:3])}"
            f"{' …' if len(changed) > 3 else ''}); they were put back as they were")


# -- the model --------------------------------------------------------------------------------------------------
def environment_of(workload: Workload) -> dict[str, Any]:
    device = next((t.device for t in workload.model.parameters()), None)
    if device is None:
        device = next((t.device for _, t in named_tensors(workload.inputs)), torch.device("cpu"))
    hw = hardware.detect()
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "cpu": hw.cpu,
        "cpus": hw.usable_cpus,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


class Progress:
    """A rich progress bar on stderr when asked for; otherwise nothing."""

    def __init__(self, show: bool, steps: int) -> None:
        self.show, self.steps, self.bar, self.task = show, steps, None, None

    def __enter__(self) -> Progress:
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


            self.bar = Progress(TextColumn("{task.description:<48}"), BarColumn(), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=self.steps)
        return self

    def step(self, description: str) -> None:
        if self.bar is not None:
            if self.bar.tasks[0].description:
                self.bar.advance(self.task)
            self.bar.update(self.task, description=description)

    def more(self, description: str) -> None:
        """One step more than the bar was made with, begun now."""
        if self.bar is not None:
            self.steps += 1
            self.bar.update(self.task, total=self.steps)
        self.step(description)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
