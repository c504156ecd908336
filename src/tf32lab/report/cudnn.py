"""Convolutions and RNNs: the op families whose math cuDNN's own flag sets, not the level.

``torch.backends.cudnn.conv.fp32_precision`` (``...cudnn.rnn.fp32_precision`` for RNNs; before torch 2.9 the one
``torch.backends.cudnn.allow_tf32``) defaults to TF32, so on Ampere and later a model's convolutions and cuDNN RNNs
run TF32 at every level, ``highest`` included (PyTorch's CUDA notes, "TensorFloat-32 (TF32) on Ampere (and later)
devices"), and no level makes them faster. A check of a model that has them says so: the math they ran at per row
and their share of the predicted time (:class:`CudnnFamily`, the report's ``cudnn``), a sentence of the conclusion
(:func:`stated`), and, where they hold more of the time than the families a level changes, that they are why the
level buys little (:func:`why_little`).

Example:

    >>> import torch, tf32lab
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))
    >>> report = tf32lab.check(tf32lab.Workload(model, torch.randn(2, 3, 8, 8)), levels=("highest", "high"))
    >>> conv = report.cudnn[0]
    >>> conv.family, conv.ops, conv.maths
    ('conv', 1, {'highest': 'tf32-rna', 'high': 'tf32-rna'})
    >>> stated(report)[0][:57]
    'Convolutions ran TF32 at every level, `highest` included:'
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from tf32lab.know.levels import ALL_LEVELS
from tf32lab.know.targets import CUDNN_CELL, NATIVE, TARGETS, rnn_math

if TYPE_CHECKING:
    from tf32lab.know.targets import Target

# A ``tf32lab.report.Report`` and one of its ``LevelResult`` rows: the package's own module reaches this one
# (through its conclusion and renderers), so they are named, not imported, not even for type checking
# (tests/test_layers.py: no import circle, TYPE_CHECKING imports included).
Report = LevelResult = Any

__all__ = ["CUDNN_FAMILIES", "FLAGS", "OFF", "CudnnFamily", "families", "held", "level_share", "off_depthwise",
           "on_cpu", "stated", "why_little"]

CUDNN_FAMILIES = ("conv", "rnn")
# the flag that sets each family's float32 math (torch >= 2.9; the legacy torch.backends.cudnn.allow_tf32 sets both)
FLAGS = {"conv": "torch.backends.cudnn.conv.fp32_precision", "rnn": "torch.backends.cudnn.rnn.fp32_precision"}
_NAMES = {"conv": "convolutions", "rnn": "RNNs"}
_WORDS = {"tf32": "TF32", "ieee": "IEEE float32", "bf16": "bf16", "tf32x3": "3xTF32", "bf16x3": "bf16x3",
          "mixed": "TF32 or IEEE float32 by module"}
_CPU_MIXED = "bf16 or IEEE float32 by module"


@dataclass(frozen=True)
class CudnnFamily:
    """An op family that cuDNN's flag sets, not the level (``conv``: convolutions, ``rnn``: RNNs), as a check ran
    it: ``ops`` in one forward (the float64 reference's count); ``flag``: the value cuDNN's flag held for the run
    (``"tf32"``, PyTorch's default, or ``"ieee"``; ``"off"`` where cuDNN was off and the level set the math);
    ``asked``: the conv math the check was given (``conv=``, ``--conv``), None where the process's flag was left as
    it was; ``maths``: per row (level, or ``policy``), the math the target computed the family in; ``shares``: per
    row, the family's share of the row's predicted time (empty when not predicted; no policy row)."""

    family: str
    ops: int
    flag: str
    asked: Optional[str]
    maths: dict[str, str]
    shares: dict[str, float]

    @property
    def flag_name(self) -> str:
        """The setting that sets the family's math: ``torch.backends.cudnn.conv.fp32_precision`` (where cuDNN is on)."""
        return FLAGS[self.family]

    @property
    def title(self) -> str:
        """The family in words: ``convolutions``, ``RNNs``."""
        return _NAMES[self.family]


def families(ops: Mapping[str, int], rows: Sequence[LevelResult], target: Target, cells: Mapping[str, str],
             asked: Optional[str] = None, speed: Any = None,
             rnn_ops: Collection[str] = ()) -> tuple[CudnnFamily, ...]:
    """The report's :class:`CudnnFamily` entries: one per family of ``CUDNN_FAMILIES`` that ran (``ops``: op count
    per family), each row's math (the row's own; on ``native``, where nothing is emulated, the target's table at
    the level), ``cells``: the flag cells in force for the run, ``speed``: the report's predicted ``SpeedReport``,
    ``rnn_ops``: the RNN ops that ran, by name (on a CPU a GRU or Elman RNN runs as GEMMs, in the matmul math)."""
    found = []
    for family in CUDNN_FAMILIES:
        if not ops.get(family):
            continue
        maths, shares = {}, {}
        for lv in rows:
            m = lv.maths.get(family)  # an RNN's as it ran (know.targets.rnn_math: a CPU's GRU in the matmul's)
            if m is None and lv.level in ALL_LEVELS:  # native: run for real, the table says what the level computes
                table = target.maths_at(lv.level, cells)
                m = rnn_math(table, target.device, rnn_ops) if family == "rnn" and rnn_ops else table.get(family)
            if m is not None:
                maths[lv.level] = m
            share = _share(speed, lv.level, family)
            if share is not None:
                shares[lv.level] = share
        flag = OFF if target.device == "cuda" and cells.get(CUDNN_CELL) == "off" else \
            cells.get(f"cuda.{family}", "tf32")
        found.append(CudnnFamily(family, int(ops[family]), flag, asked, maths, shares))
    return tuple(found)


def _share(speed: Any, level: str, family: str) -> Optional[float]:
    if speed is None or level not in ALL_LEVELS:
        return None
    try:
        shares = speed.level(level).shares
    except KeyError:
        return None
    return shares.get(family, 0.0) if shares else None


def _word(math_name: str, cpu: bool = False) -> str:
    # "ieee/bf16-rne": a CPU's LSTMs' math and its GRUs' (know.targets.rnn_math); a policy's levels mix bf16 and
    # IEEE on a CPU, which has no TF32
    words = {**_WORDS, "mixed": _CPU_MIXED} if cpu else _WORDS
    return " and ".join(words.get(m.split("-")[0], m) for m in math_name.split("/"))


def _rows(names: Sequence[str]) -> str:
    said = [f"`{n}`" if n != "policy" else "the policy" for n in names]
    return said[0] if len(said) == 1 else f"{', '.join(said[:-1])} and {said[-1]}"


def _per_row(entry: CudnnFamily, report: Report, cpu: bool = False) -> str:
    """``TF32 at every level, `highest` included`` or ``TF32 at `highest`, IEEE float32 with the policy``."""
    groups: dict[str, list[str]] = {}
    for row, m in entry.maths.items():
        groups.setdefault(_word(m, cpu), []).append(row)
    if len(groups) == 1:
        word, rows = next(iter(groups.items()))
        levels = [r for r in rows if r != "policy"]
        every = "at every level" + (" and with the policy" if "policy" in rows else "") if len(levels) > 1 else \
            f"at {_rows(rows)}"
        return f"{word} {every}" + (", `highest` included" if word != "IEEE float32" and "highest" in rows
                                    and len(levels) > 1 else "")
    return ", ".join(f"{word} {'with' if rows == ['policy'] else 'at'} {_rows(rows)}" for word, rows in groups.items())


# on a CPU oneDNN computes them, under its own flags (PyTorch's torch.backends.mkldnn fp32_precision cells)
_CPU_WHY = {
    "conv": "on a CPU oneDNN's own flag sets their math, not the level (`torch.backends.mkldnn.conv.fp32_precision`)",
    "rnn": "on a CPU an LSTM runs oneDNN's RNN kernel, whose math its own flag sets "
           "(`torch.backends.mkldnn.rnn.fp32_precision`), and a GRU, an Elman RNN or an LSTM with proj_size runs "
           "as GEMMs, at the level's math",
}


def on_cpu(report: Report) -> bool:
    """Whether the report's hardware computed on a CPU: the target's device, or on ``native`` the model's."""
    if report.target == NATIVE:
        return str(report.environment.get("device", "cpu")).startswith("cpu")
    return report.target in TARGETS and TARGETS[report.target].device == "cpu"


# PyTorch's own CUDA kernels for a float32 NCHW depthwise conv (aten/src/ATen/native/Convolution.cpp,
# ConvBackend::CudaDepthwise2d/3d), and on Hopper cuDNN's channels-last ones: counted IEEE by the emulator
# (emulation.rules._depthwise, the targets' conv.depthwise key)
_DEPTHWISE = ("they are depthwise (one input channel a group), which a GPU runs in PyTorch's own CUDA kernels in NCHW "
              "and in cuDNN's depthwise kernels channels-last, whose forward takes no TF32 on Hopper: no TF32 flag "
              "reaches them")


# a family's ``flag`` where ``torch.backends.cudnn.enabled`` was False for the run: no cuDNN, the level sets its math
# (tf32lab.know.targets.CUDNN_CELL)
OFF = "off"
_OFF_WHY = {
    "conv": "cuDNN is off (`torch.backends.cudnn.enabled = False`), so a GPU runs them in PyTorch's own kernels, "
            "as cuBLAS GEMMs under the matmul flag: the level sets their math (a depthwise one's own kernel: IEEE "
            "float32)",
    "rnn": "cuDNN is off (`torch.backends.cudnn.enabled = False`), so a GPU runs them as PyTorch's own layers of "
           "cuBLAS GEMMs under the matmul flag: the level sets their math",
}
# every convolution depthwise, cuDNN off: PyTorch's own kernels in any memory format (emulation.rules._depthwise)
_OFF_DEPTHWISE = ("cuDNN is off (`torch.backends.cudnn.enabled = False`), and they are depthwise (one input channel a "
                  "group), which a GPU then runs in PyTorch's own CUDA kernels in any memory format, so neither the "
                  "level nor a TF32 flag reaches them")


# how many of a family's convolutions a GPU ran in PyTorch's own depthwise kernels (:func:`_depthwise`)
_ALL, _SOME, _NONE = "all", "some", "none"


def _depthwise(entry: CudnnFamily, report: Report) -> str:
    """Which of ``entry``'s convolutions a GPU ran in PyTorch's own depthwise kernels, not cuDNN's: ``"all"``,
    ``"some"`` or ``"none"`` (another family, or a CPU). Read off the maths the emulator counted them at (IEEE
    float32, ``emulation.rules._depthwise``): with cuDNN on, IEEE where cuDNN's flag gave TF32 on a target
    whose cuDNN has it; with cuDNN off, IEEE in every row where some row's level gave the matmuls another math (the
    other convolutions would have taken it)."""
    if entry.family != "conv" or not entry.maths or on_cpu(report):
        return _NONE
    maths = list(entry.maths.values())
    if entry.flag == OFF:
        if all(m == "ieee" for m in maths) and any(lv.maths.get("matmul", "ieee") != "ieee" for lv in report.levels
                                                   if lv.level in entry.maths):
            return _ALL
    elif all(_word(m) == "IEEE float32" for m in maths) and entry.flag == "tf32" and _has_tf32_conv(report.target):
        return _ALL
    return _SOME if any(m.endswith("/ieee") for m in maths) else _NONE  # the IEEE ones beside others in a row


def _off_depthwise(entry: CudnnFamily, report: Report) -> bool:
    """Whether ``entry`` is convolutions run with cuDNN off that are all depthwise: IEEE float32 in every row."""
    return entry.flag == OFF and _depthwise(entry, report) == _ALL


def off_depthwise(report: Report) -> bool:
    """Whether cuDNN was off for the run and every convolution of ``report`` was depthwise: PyTorch's own kernels ran
    them in IEEE float32 at every level, which no level reaches (the page's heading says so)."""
    return any(_off_depthwise(e, report) for e in report.cudnn)


def held(report: Report) -> tuple[str, ...]:
    """The families of ``CUDNN_FAMILIES`` whose math no level sets in ``report``: all but those that ran with cuDNN
    off."""
    # depthwise convolutions, in PyTorch's own kernels, are IEEE at every level: held all the same
    off = {e.family for e in report.cudnn if e.flag == OFF and not _off_depthwise(e, report)}
    return tuple(f for f in CUDNN_FAMILIES if f not in off)


def _has_tf32_conv(target: str) -> bool:
    """Whether ``target``'s cuDNN computes convolutions in TF32 under PyTorch's default flag."""
    return target in TARGETS and TARGETS[target].device == "cuda" and \
        TARGETS[target].maths_at("highest", {"cuda.conv": "tf32"}).get("conv", "ieee") != "ieee"


def _why(entry: CudnnFamily, report: Report, cpu: bool = False) -> str:
    """Why ``entry`` ran at its maths."""
    if cpu:
        return _CPU_WHY[entry.family]
    depthwise = _depthwise(entry, report)
    if entry.flag == OFF:
        return _OFF_DEPTHWISE if depthwise == _ALL else _OFF_WHY[entry.family]
    if depthwise == _ALL:
        return _DEPTHWISE
    flag = f"`{FLAGS[entry.family]}`"
    tf32 = any(_word(m) != "IEEE float32" for m in entry.maths.values())
    if not tf32 and entry.flag == "tf32":  # the flag allows TF32, the target has none (V100, a CPU)
        where = "this machine" if report.target == NATIVE else report.target
        return f"{where} has no TF32 for them, whatever a level or {flag} says"
    if entry.asked is not None:
        why = f"{flag} = '{entry.asked}', as conv='{entry.asked}' set it for the check"
    elif entry.flag == "tf32":
        why = f"{flag}, PyTorch's default 'tf32'"
    else:
        why = f"{flag} = '{entry.flag}', as this process set it"
    levels = {m for row, m in entry.maths.items() if row != "policy"}
    if "policy" in entry.maths and entry.maths["policy"] not in levels:
        why += "; the policy sets it for its modules"
    return f"cuDNN's own flag sets their math, not the level ({why})"


def stated(report: Report, hint: bool = True) -> list[str]:
    """One sentence per family of ``report.cudnn``: the math it ran at per row, that cuDNN's flag sets it, not the
    level, its share of ``highest``'s predicted time, and (``hint``, where it ran TF32 by default) how to check it
    in IEEE float32."""
    lines = []
    cpu = on_cpu(report)
    for entry in report.cudnn:
        if not entry.maths:
            continue
        name = entry.title
        text = f"{name[0].upper()}{name[1:]} ran {_per_row(entry, report, cpu)}: {_why(entry, report, cpu)}"
        if entry.flag != OFF and _depthwise(entry, report) == _SOME:
            text += f"; the IEEE float32 ones: {_DEPTHWISE}"
        first = next(iter(entry.shares), None)
        if first is not None:
            text += f"; they are {entry.shares[first]:.0%} of `{first}`'s predicted time on {report.target}"
        if hint and entry.asked is None and entry.flag == "tf32" and \
                any("TF32" in _word(m).split(" and ") for m in entry.maths.values()):
            text += ". To see them in IEEE float32, check with conv='ieee' (`--conv ieee`)"
        lines.append(text + ".")
    return lines


def _cudnn_shares(speed_level: Any, families: Collection[str] = CUDNN_FAMILIES) -> dict[str, float]:
    shares = getattr(speed_level, "shares", None) or {}
    return {f: shares[f] for f in families if shares.get(f, 0.0) > 0}


def level_share(speed_level: Any, families: Collection[str] = CUDNN_FAMILIES) -> float:
    """The share of a level's predicted time in the families a level sets: its ``family_share`` less that of
    ``families`` (the convolutions' and RNNs', whose math cuDNN's flag sets: :func:`held`), where the shares are
    known."""
    # at least 0: the shares summed in another order than ``family_share`` left -1e-16 ("-0%") with no matmul at all
    return max(0.0, speed_level.family_share - sum(_cudnn_shares(speed_level, families).values()))


def why_little(report: Report, level: str) -> Optional[str]:
    """Why ``level`` buys little, where convolutions or RNNs hold more of ``highest``'s predicted time than the
    families a level sets: a clause naming them and their shares; else None."""
    speed = report.speed
    if speed is None:
        return None
    base = speed.level("highest")
    families = held(report)
    cudnn = _cudnn_shares(base, families)
    if not cudnn or math.isnan(base.family_share):
        return None
    own = level_share(base, families)
    if own >= sum(cudnn.values()):
        return None
    maths = {e.family: e.maths for e in report.cudnn}
    named = " and ".join(f"{_NAMES[f]}, {share:.0%}{_ran(maths.get(f, {}))}" for f, share in cudnn.items())
    rest = 1.0 - base.family_share
    tail = f"; the rest, {rest:.0%}, is memory traffic and kernel launches" if rest >= 0.05 else ""
    return (f": the level changes only the matmul-family ops, {own:.0%} of its predicted time; {named}, run "
            f"{_run_by(report, cudnn)}, which no level changes{tail}")


def _run_by(report: Report, shown: Collection[str]) -> str:
    """What sets the math of the families ``shown``: cuDNN's flag, and for a GPU's NCHW depthwise convolutions
    PyTorch's own kernels (:data:`_DEPTHWISE`)."""
    conv = next((e for e in report.cudnn if e.family == "conv" and e.maths), None)
    if "conv" not in shown or conv is None:
        return "at cuDNN's own flag"
    depthwise = _depthwise(conv, report)
    # cuDNN off, the convolutions are held only where every one is depthwise (held): shown alone
    if depthwise == _ALL and (conv.flag == OFF or len(shown) == 1):
        return "in PyTorch's own depthwise kernels"
    if depthwise != _NONE:
        return "at cuDNN's own flag (the depthwise convolutions in PyTorch's own kernels)"
    return "at cuDNN's own flag"


def _ran(maths: Mapping[str, str]) -> str:
    words = {_word(m) for m in maths.values()}
    return f" ({words.pop()} at every level)" if len(words) == 1 else ""
