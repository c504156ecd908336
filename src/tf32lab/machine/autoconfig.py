"""``autoconfig()``: the known heuristics for precision, threads and the compile cache as one explicit call.

Serving and training stacks each hard-code one of these (TorchServe's ``base_handler.py``, LLM Guard, HALOs): TF32
turned on as a side effect of an import, one thread per worker, the FX graph cache. Here they run only when called,
decide from a :class:`Hardware` value, log every decision through :mod:`logging` (logger ``tf32lab.autoconfig``) and
return :class:`Decisions` whose ``undo()`` puts back what was changed. ``TF32LAB_DISABLE=1`` in the environment makes
the call a logged no-op; a value it cannot read (``TF32LAB_DISABLE=maybe``) is an error (``tf32lab.settings``).

Inter-op threads are the exception: PyTorch lets a process call ``torch.set_num_interop_threads`` once, before any
inter-op parallel work ("Can only be called once and before any inter-op parallel work is started", PyTorch docs,
https://pytorch.org/docs/stable/generated/torch.set_num_interop_threads.html), so no one can set them back. autoconfig
therefore leaves them alone unless asked (``interop_threads="auto"`` or a number), and says so in the decision.

Example:

    >>> import tf32lab
    >>> from tf32lab.machine.hardware import Hardware
    >>> decisions = tf32lab.autoconfig(hardware=Hardware.simulated("a100", cpus=8), workers=4)
    >>> decisions["precision"].new, decisions["threads"].new
    ('high', 2)
    >>> decisions.undo()
    >>> tf32lab.get_float32_matmul_precision()
    'highest'
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from tf32lab import settings
from tf32lab.control import flags, scope
from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import check_level
from tf32lab.machine import compile_cache, distributed
from tf32lab.machine.hardware import Hardware, detect

__all__ = ["MEGA_CACHE", "Decision", "Decisions", "Recommendation", "autoconfig", "recommend", "save_compile_cache"]

log = logging.getLogger("tf32lab.autoconfig")

# The Mega-Cache artifact in a compile-cache folder, and what it was saved with (it loads only on the same
# torch, Triton and GPU: ``torch.compiler.load_cache_artifacts``).
MEGA_CACHE = compile_cache.ARTIFACT
_cache_folder, _read_cache = compile_cache.folder, compile_cache.read

PathLike = Union[str, "os.PathLike[str]"]
_Undo = Callable[[], Optional[bool]]  # returns False when the old value could not be put back


@dataclass(frozen=True)
class Decision:
    """One setting: its value before, the value decided, why, and whether it was applied.

    ``applied`` is False when the setting was left alone: already so, or PyTorch refused (``reason`` says which).
    """

    setting: str
    old: Any
    new: Any
    reason: str
    applied: bool = True

    @property
    def changed(self) -> bool:
        return self.applied and self.old != self.new

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "old": self.old, "new": self.new, "reason": self.reason,
                "applied": self.applied, "changed": self.changed}

    def __str__(self) -> str:
        if self.changed:
            what = f"{self.old!r} -> {self.new!r}"
        elif self.applied:
            what = f"{self.new!r} kept"
        elif self.new is None:
            what = "nothing done"
        else:
            what = f"stays {self.old!r}, not {self.new!r}"
        return f"{self.setting}: {what} ({self.reason})"


@dataclass(frozen=True)
class Recommendation:
    """The level ``auto`` picks on a machine, why, and advice beyond this call (None when there is none)."""

    level: str
    reason: str
    advice: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "reason": self.reason, "advice": self.advice}


class Decisions(Sequence[Decision]):
    """What :func:`autoconfig` decided, in order; ``decisions["threads"]`` looks one up by setting.

    ``undo()`` puts back every setting it changed, newest first, and may be called more than once.
    """

    def __init__(self, decisions: Sequence[Decision], undo_steps: Sequence[tuple[Decision, _Undo]],
                 hardware: Hardware, recommendation: Optional[Recommendation], disabled: bool = False) -> None:
        self._decisions = tuple(decisions)
        self._undo = list(undo_steps)
        self.hardware = hardware
        self.recommendation = recommendation
        self.disabled = disabled

    def __len__(self) -> int:
        return len(self._decisions)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            for decision in self._decisions:
                if decision.setting == key:
                    return decision
            raise KeyError(f"no decision on {key!r}; decided: {', '.join(d.setting for d in self._decisions)}")
        return self._decisions[key]

    def __iter__(self) -> Iterator[Decision]:
        return iter(self._decisions)

    def undo(self) -> None:
        """Put back what this call changed, newest first, so that a program (or a test) can return to where it was.

        Put back exactly: the precision flags (every cell, raw, as :func:`tf32lab.control.flags.snapshot` sees them),
        intra-op threads, inductor's ``fx_graph_cache`` and ``TORCHINDUCTOR_CACHE_DIR``. Not put back, because
        nothing can: inter-op threads set by ``interop_threads=`` (PyTorch allows one
        ``torch.set_num_interop_threads`` per process; a warning names the value that stays), and the entries of a
        loaded Mega-Cache artifact (they were written into the cache folder). Inside ``precision()`` scopes it
        works too: the process level it puts back applies once they end.
        """
        while self._undo:
            decision, undo = self._undo[-1]
            done = undo()
            self._undo.pop()  # only once it is done: a step that raised is tried again by the next undo()
            if done is False:
                log.warning("undo %s: not put back: PyTorch allows setting it once per process; it stays %r "
                            "(was %r)", decision.setting, decision.new, decision.old)
            else:
                log.info("undo %s: %r -> %r", decision.setting, decision.new, decision.old)

    def to_dict(self) -> dict[str, Any]:
        return {
            "disabled": self.disabled,
            "decisions": [d.to_dict() for d in self._decisions],
            "recommendation": self.recommendation.to_dict() if self.recommendation else None,
            "hardware": self.hardware.to_dict(),
        }

    def __repr__(self) -> str:
        if self.disabled:
            return "Decisions(disabled by TF32LAB_DISABLE)"
        return "Decisions(\n" + "".join(f"  {d}\n" for d in self._decisions) + ")"


# -- precision ---------------------------------------------------------------------------------------------------
def recommend(hardware: Optional[Hardware] = None) -> Recommendation:
    """The level ``autoconfig(level="auto")`` picks on ``hardware`` (this machine by default), with its reason.

    >>> from tf32lab.machine.hardware import Hardware
    >>> recommend(Hardware.simulated("h100")).level, recommend(Hardware.simulated("v100")).level
    ('high', 'highest')
    >>> print(recommend(Hardware.simulated("t4")).advice)
    for speed on this GPU use float16 autocast (torch.autocast('cuda', dtype=torch.float16)); measure it first
    """
    hw = hardware or detect()
    if hw.gpus and hw.rocm:
        return Recommendation("highest", f"ROCm GPU {hw.gpus[0].name}: which float32 matmuls use reduced precision "
                                         "depends on the GPU and hipBLASLt; tf32lab does not decide it for you",
                              "measure with tf32lab check --target native before choosing 'high'")
    if hw.gpus:
        oldest = min(hw.gpus, key=lambda g: g.capability)
        where = f"{oldest.name} (capability {oldest.capability[0]}.{oldest.capability[1]})"
        if not oldest.tf32:
            return Recommendation(
                "highest", f"{where} has no TF32 tensor cores: 'high' and 'medium' would change nothing",
                "for speed on this GPU use float16 autocast (torch.autocast('cuda', dtype=torch.float16)); "
                "measure it first")
        override = hw.tf32_override()
        if override == "NVIDIA_TF32_OVERRIDE=0":
            return Recommendation("highest", f"{override} turns TF32 off in cuBLAS and cuDNN: 'high' would change "
                                             "nothing", "unset NVIDIA_TF32_OVERRIDE to let PyTorch use TF32")
        return Recommendation(
            "high", f"{where} has TF32 tensor cores: up to ~8x float32 matmul throughput at ~1e-3 relative "
                    "rounding of each operand ('medium' is the same as 'high' on CUDA)",
            f"see what it does to your model first: tf32lab check SPEC --target {hw.target}")
    if hw.mps:
        return Recommendation("highest", "Apple GPU (MPS): tf32lab has no target for it; 'highest' keeps IEEE "
                                         "float32")
    if "amx_bf16" in hw.isa:
        return Recommendation(
            "highest", "no GPU; this CPU has AMX, so 'medium' would run oneDNN float32 matmuls in bf16 "
                       "(~3 significant digits): not turned on without a check",
            "tf32lab check SPEC --target cpu-amx, then autoconfig('medium') if it passes")
    return Recommendation("highest", "no GPU and no AMX on this CPU: 'high' and 'medium' change (almost) nothing "
                                     "here")


def _precision(level: str, hw: Hardware) -> tuple[Decision, Optional[_Undo], Optional[Recommendation]]:
    recommendation = recommend(hw)
    if level == "auto":
        new, reason = recommendation.level, recommendation.reason
    else:
        new, reason = level, "asked for"
        if hw.gpus and level != "highest" and not min(g.capability for g in hw.gpus) >= (8, 0):
            reason += "; no TF32 on this GPU, so it changes nothing here"
        elif not hw.gpus and not hw.rocm and not hw.mps:
            # PyTorch asks oneDNN for TF32 only with AMX-FP16 and for bf16 with AMX (use_mkldnn_tf32_matmul,
            # Matmul.cpp); measured: 'high' the bits of 'highest' on an AMX-BF16 CPU (docs/gpu-results.md)
            if level == "high" and "amx_fp16" not in hw.isa:
                reason += "; no GPU and no AMX-FP16 on this CPU, so it changes nothing here (oneDNN's TF32 needs it)"
            elif level == "medium" and "amx_bf16" not in hw.isa:
                reason += "; no GPU and no AMX on this CPU, so it changes (almost) nothing here"
    override = hw.tf32_override()
    if override and hw.gpus and override not in reason:
        reason += (f"; {override} is set: it only makes 'high' PyTorch's default, the level set here decides"
                   if override.startswith("TORCH") else
                   f"; {override} is set and turns cuBLAS/cuDNN TF32 off whatever the level")
    old = scope.get_float32_matmul_precision()
    if old == new:  # no write: explicit values where the cells inherit would cut them off (pytorch#179445)
        return Decision("precision", old, new, reason), None, recommendation
    state = flags.read_level_state()
    scope.set_float32_matmul_precision(new)

    def undo() -> None:
        scope.write_process_state(state[1])

    return Decision("precision", old, new, reason), undo, recommendation


# -- threads -----------------------------------------------------------------------------------------------------
def _env_threads(hw: Hardware) -> Optional[tuple[str, int]]:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        text = hw.env.get(name)
        if text is None:
            continue
        try:
            value = int(text.strip())
        except ValueError:
            log.warning("%s=%r is not a number of threads; ignored", name, text)
            continue
        if value >= 1:
            return name, value
        log.warning("%s=%r is not a number of threads >= 1; ignored", name, text)
    return None


def decide_threads(threads: Union[str, int], workers: int, hw: Hardware) -> tuple[int, str]:
    share = workers * hw.local_world_size
    auto = max(1, hw.usable_cpus // share)
    usable = f"{hw.usable_cpus} usable CPUs"
    if hw.cpu_quota is not None:
        usable += f" (quota {hw.cpu_quota:g} of {hw.affinity_cpus})"
    split = f"{workers} worker(s) x {hw.local_world_size} local process(es)"
    given = hw.env.get("LOCAL_WORLD_SIZE", "").strip()
    if given and hw.local_world_size == 1 and given.lstrip("+0") != "1":  # read as hardware reads it (int())
        # torchrun's count of processes on this machine, read as 1 (all the CPUs to each) without a word
        log.warning("LOCAL_WORLD_SIZE=%r is not a number of processes >= 1; counted as 1", given)
        split += f" (LOCAL_WORLD_SIZE={given!r} is not a number >= 1: counted as 1)"
    env = _env_threads(hw)
    if threads != "auto":
        reason = "asked for"
        if env:
            reason += f"; overrides {env[0]}={env[1]}"
    elif env:
        threads = env[1]
        reason = f"{env[0]}={env[1]} is set: honoured (automatic would be {usable} // {split} = {auto})"
    else:
        threads = auto
        reason = f"{usable} // {split}"
    if threads > auto and threads * share > hw.usable_cpus:
        reason += f"; oversubscribes: {threads} threads x {share} process(es) > {hw.usable_cpus} usable CPUs"
    return int(threads), reason


def _threads(threads: Union[str, int], interop_threads: Union[str, int, None], workers: int,
             hw: Hardware) -> list[tuple[Decision, Optional[_Undo]]]:
    n, reason = decide_threads(threads, workers, hw)
    out: list[tuple[Decision, Optional[_Undo]]] = []
    old = torch.get_num_threads()
    undo = None
    if old != n:
        torch.set_num_threads(n)

        def undo() -> None:
            torch.set_num_threads(old)

    out.append((Decision("threads", old, n, reason), undo))
    old_inter = torch.get_num_interop_threads()
    if interop_threads is None:
        # Set once per process and never again: a call that undo() could not take back is left to the user.
        if old_inter == n:
            out.append((Decision("interop_threads", old_inter, n, reason), None))
        else:
            why = (f"left alone: PyTorch allows torch.set_num_interop_threads once per process, so undo() could "
                   f"not put {old_inter} back; interop_threads='auto' or a number sets it")
            out.append((Decision("interop_threads", old_inter, n, why, applied=False), None))
        return out
    if interop_threads != "auto":
        n, reason = int(interop_threads), "asked for"
    if old_inter == n:
        out.append((Decision("interop_threads", old_inter, n, reason), None))
        return out
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        why = (f"PyTorch sets inter-op threads once per process, before inter-op parallel work starts, and that "
               f"has happened here; left at {old_inter}")
        out.append((Decision("interop_threads", old_inter, n, why, applied=False), None))
        return out

    def undo_inter() -> bool:
        try:
            torch.set_num_interop_threads(old_inter)
        except RuntimeError:
            return False  # set once per process: the value just set stays
        return True

    reason += "; undo() cannot put it back (PyTorch allows one set per process)"
    out.append((Decision("interop_threads", old_inter, n, reason), undo_inter))
    return out


# -- compile cache -----------------------------------------------------------------------------------------------
def _inductor_config() -> Any:
    """``torch._inductor.config``, imported. PyTorch's import makes its cache folder (``TORCHINDUCTOR_CACHE_DIR``)
    and raised ``FileExistsError`` for one that is a file (``PermissionError`` for one it may not write): one line
    naming the variable, before anything changes."""
    try:
        import torch._inductor.config as inductor_config
    except OSError as exc:
        value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        named = f"TORCHINDUCTOR_CACHE_DIR={value!r}" if value is not None else "its default cache folder"
        raise Tf32LabError(f"compile_cache: PyTorch's compiler cannot start with {named}: "
                           f"{exc.strerror or exc} ({exc.filename}); name a folder it may write, or unset it") from None
    return inductor_config


def _compile_cache(folder: Path, found: compile_cache.Loaded,
                   old_dir: Optional[str]) -> list[tuple[Decision, Optional[_Undo]]]:
    """``old_dir``: ``TORCHINDUCTOR_CACHE_DIR`` as it was before inductor's import, which sets its default."""
    inductor_config = _inductor_config()

    out: list[tuple[Decision, Optional[_Undo]]] = []
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    old_cache = inductor_config.fx_graph_cache
    reason = "compile_cache given: compiled graphs are reused across processes"
    if os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "").strip() in ("1", "true", "True"):
        reason += "; but TORCHINDUCTOR_FORCE_DISABLE_CACHES is set, so inductor will not use it"
    undo_cache = None
    if old_cache is not True:
        inductor_config.fx_graph_cache = True

        def undo_cache() -> None:
            inductor_config.fx_graph_cache = old_cache

    out.append((Decision("inductor.fx_graph_cache", old_cache, True, reason), undo_cache))

    new_dir = str(folder)
    reason = "inductor's caches go to compile_cache"
    if old_dir is not None and old_dir != new_dir:
        reason += f" instead of TORCHINDUCTOR_CACHE_DIR={old_dir} (for this process)"
    undo_dir = None
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != new_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = new_dir

        def undo_dir() -> None:
            if old_dir is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old_dir

    out.append((Decision("env.TORCHINDUCTOR_CACHE_DIR", old_dir, new_dir, reason), undo_dir))
    loaded = compile_cache.load(found)
    out.append((Decision("compile_cache.artifacts", None, loaded.artifact, loaded.reason, loaded.applied), None))
    return out


def save_compile_cache(folder: PathLike) -> Path:
    """Write this process's ``torch.compile`` artifacts (a Mega-Cache) into ``folder``; returns the file.

    A later ``autoconfig(compile_cache=folder)`` loads it, on the same torch, Triton and GPU (as
    ``torch.compiler.save_cache_artifacts`` requires). The folder must be trusted like code
    (``tf32lab.machine.compile_cache``): it is made private to this user, and one that others may write is refused.

    >>> import tempfile, tf32lab
    >>> tf32lab.save_compile_cache(tempfile.mkdtemp())     # nothing compiled in this process
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: nothing to save: ...
    """
    return compile_cache.save(compile_cache.folder(folder))


# -- the call ----------------------------------------------------------------------------------------------------
def autoconfig(level: str = "auto", *, workers: int = 1, threads: Union[str, int] = "auto",
               interop_threads: Union[str, int, None] = None, compile_cache: Optional[PathLike] = None,
               hardware: Optional[Hardware] = None, agree: bool = False) -> Decisions:
    """Apply the known heuristics for this machine (or ``hardware``), log each decision and return them.

    Args:
        level: ``"auto"`` (``high`` on a GPU with TF32 that no env override forbids, ``highest`` elsewhere, with a
            recommendation), or a level of ``tf32lab.LEVELS``, applied as asked.
        workers: processes of this program on the machine (a server's workers); threads are shared among them
            and among torchrun's ``LOCAL_WORLD_SIZE`` processes.
        threads: ``"auto"`` (usable CPUs // (workers x LOCAL_WORLD_SIZE), at least 1; ``OMP_NUM_THREADS`` or
            ``MKL_NUM_THREADS`` honoured when set) or a number: PyTorch's intra-op threads.
        interop_threads: ``None`` (left as they are: PyTorch allows one ``torch.set_num_interop_threads`` per
            process, so ``undo()`` could not put them back), ``"auto"`` (the same number as ``threads``) or a
            number. Ask for it where the process will not undo, e.g. a server's worker at start.
        compile_cache: a folder: inductor's FX graph cache on and kept there, and a Mega-Cache artifact in it
            (see :func:`save_compile_cache`) loaded when present. **Trust it like code**: the artifact holds
            pickles that inductor unpickles. A folder or artifact that another user owns or may write, a corrupt
            artifact, or one with an entry that would be written outside the folder is refused
            (``Tf32LabError``) before anything changes (``tf32lab.machine.compile_cache``).
        hardware: decide as on this :class:`~tf32lab.machine.hardware.Hardware` (``Hardware.simulated("a100")``); the
            settings are applied here all the same. Default: this machine.

    Nothing is changed when an argument is bad, or when ``TF32LAB_DISABLE=1`` is set (logged); a value of it that is
    not understood is a ``Tf32LabError`` (``tf32lab.settings``).

    Example:

        >>> import tf32lab
        >>> decisions = tf32lab.autoconfig(threads=1)
        >>> decisions["threads"].new, decisions["threads"].reason  # "; overrides OMP_NUM_THREADS=..." if set
        (1, 'asked for...')
        >>> decisions.undo()
    """
    check_level(level, also=("auto",), torch_only=True)  # applied process-wide through PyTorch's setter
    if not isinstance(agree, bool):
        raise Tf32LabError(f"bad agree {agree!r}; accepted: True or False")
    if agree and not distributed.initialized():
        raise Tf32LabError("autoconfig(agree=True) needs an initialised torch.distributed process group (under "
                           "torchrun, call torch.distributed.init_process_group first)")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise Tf32LabError(f"bad workers {workers!r}; accepted: an int >= 1")
    if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise Tf32LabError(f"bad threads {threads!r}; accepted: 'auto' or an int >= 1")
    if interop_threads not in (None, "auto") and (
            isinstance(interop_threads, bool) or not isinstance(interop_threads, int) or interop_threads < 1):
        raise Tf32LabError(f"bad interop_threads {interop_threads!r}; accepted: None, 'auto' or an int >= 1")
    folder = None if compile_cache is None else _cache_folder(compile_cache)
    if hardware is not None and not isinstance(hardware, Hardware):
        raise Tf32LabError(f"bad hardware {type(hardware).__name__}; accepted: None or a "
                           f"tf32lab.machine.hardware.Hardware")
    hw = hardware or detect()
    if settings.get("TF32LAB_DISABLE"):  # a value it cannot read is an error, before anything changes
        log.info("TF32LAB_DISABLE is on: autoconfig changes nothing")
        if agree:  # a collective: every rank takes part, whatever it decided
            distributed.agree()
        return Decisions((), (), hw, None, disabled=True)
    if scope.live_scopes():
        raise Tf32LabError("autoconfig() sets process-wide settings; call it outside precision() scopes")
    found = None if folder is None else _read_cache(folder)  # every refusal before anything changes
    old_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # before inductor's import, which sets its default
    if folder is not None:
        _inductor_config()
        if old_dir is None:  # the default its import wrote: the decision below sets the folder, undo() unsets it
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)

    steps: list[tuple[Decision, Optional[_Undo]]] = []
    try:
        decision, undo, recommendation = _precision(level, hw)
        steps.append((decision, undo))
        steps += _threads(threads, interop_threads, workers, hw)
        if folder is not None:
            steps += _compile_cache(folder, found, old_dir)
        if agree:
            agreement = distributed.agree()
            steps.append((Decision("agreement", None, agreement.ranks,
                                   f"{agreement.ranks} ranks run at the same precision", applied=False), None))
    except BaseException:
        for _, undo in reversed(steps):  # all or nothing
            if undo:
                undo()
        raise
    where = f" as on {hw.simulated_as}" if hw.simulated_as else ""
    for decision, _ in steps:
        log.info("autoconfig%s: %s", where, decision)
    if recommendation and recommendation.advice and level == "auto":
        log.info("autoconfig%s: advice: %s", where, recommendation.advice)
    return Decisions([d for d, _ in steps], [(d, u) for d, u in steps if u], hw, recommendation)
