"""``doctor()``: what every precision setting really means on this machine, what is risky, what to set.

A :class:`Diagnosis` is data: the :class:`~tf32lab.machine.hardware.Hardware`, every precision flag now (both API
generations), what each level does here for each op family (from ``tf32lab.know.targets``, environment overrides
applied), warnings with stable codes, and the recommendation ``autoconfig()`` would apply. Nothing is changed.

Example:

    >>> import tf32lab
    >>> from tf32lab.machine.hardware import Hardware
    >>> d = tf32lab.doctor(Hardware.simulated("a100"))
    >>> d.levels["highest"]["conv"], d.levels["high"]["matmul"], d.recommendation.level
    ('tf32-rna', 'tf32-rna', 'high')
    >>> sorted(w.code for w in d.warnings if not w.code.startswith("inductor-"))  # (those: once a process compiles)
    ['conv-tf32-at-highest', 'medium-equals-high']
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from tf32lab import settings
from tf32lab.control import flags
from tf32lab.errors import Tf32LabError
from tf32lab.know import targets
from tf32lab.know.levels import ALL_LEVELS, EXTRA_LEVELS, level_cells
from tf32lab.know.optable import FAMILIES
from tf32lab.machine import inductor
from tf32lab.machine.autoconfig import Recommendation, decide_threads, recommend
from tf32lab.machine.hardware import Hardware, detect
from tf32lab.machine.probe import SHAPE, ProbeResult, probe_matmul
from tf32lab.numbers.files import write_json
from tf32lab.report import terminal  # noqa: F401 (rich, imported later, without drawing from random)

__all__ = ["FAMILIES", "SCHEMA_VERSION", "Alert", "Diagnosis", "doctor", "schema"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Alert:
    """Something that matters here: ``code`` is stable (for scripts), ``message`` says what and what to do."""

    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True)
class Diagnosis:
    """The result of :func:`doctor`; ``print()`` shows it, ``to_dict()`` / ``to_json()`` give the documented JSON."""

    hardware: Hardware
    level: str
    cells: tuple[tuple[str, str, str], ...]  # (cell, raw, effective), per-backend API only
    legacy: dict[str, Any]  # legacy reader -> value, or None where it raises (mixed APIs)
    other_flags: dict[str, Any]
    threads: dict[str, int]
    levels: dict[str, dict[str, str]]  # level -> family -> math, as this machine computes it
    warnings: tuple[Alert, ...]
    recommendation: Recommendation
    recommended_threads: int
    threads_reason: str
    # level -> what a float32 matmul on the device really gave (None: simulated machine, or inside emulate())
    probe: Optional[dict[str, ProbeResult]] = None
    # extra level -> None where this torch can set it natively, else why not (emulate() computes it anyway)
    native_levels: dict[str, Optional[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "hardware": self.hardware.to_dict(),
            "flags": {
                "api": self.hardware.api,
                "level": self.level,
                "cells": [{"cell": c, "raw": r, "effective": e} for c, r, e in self.cells],
                "legacy": dict(self.legacy),
                "other": {k: list(v) if isinstance(v, tuple) else v for k, v in self.other_flags.items()},
            },
            "threads": dict(self.threads),
            "target": self.hardware.target,
            "levels": {level: dict(maths) for level, maths in self.levels.items()},
            "native_levels": dict(self.native_levels),
            "probe": None if self.probe is None else {
                "device": self.hardware.device, "shape": list(SHAPE),
                "levels": {level: found.to_dict() for level, found in self.probe.items()}},
            "warnings": [w.to_dict() for w in self.warnings],
            "recommendation": {**self.recommendation.to_dict(), "threads": self.recommended_threads,
                               "threads_reason": self.threads_reason},
        }

    def to_json(self, path: Optional[str] = None) -> str:
        """The JSON text (docs/doctor-schema.md); written to ``path`` as well when given (whole or not at all)."""
        return write_json(path, self.to_dict())

    def print(self, console: Any = None) -> None:
        """Tables on the terminal (rich); warnings as unwrapped lines (``warning | code | message``, to grep), the
        recommendation wrapped at the console's width."""
        from rich.console import Console

        from tf32lab.report.doctor_text import render

        console = console or Console(highlight=False)
        for item in render(self):
            if isinstance(item, str):
                console.print(item, soft_wrap=item.startswith("warning | "), markup=False, highlight=False)
            else:
                console.print(item)


def schema() -> dict[str, Any]:
    """The JSON Schema of :meth:`Diagnosis.to_dict` (``doctor_schema.json`` beside this module)."""
    return json.loads(Path(__file__).with_name("doctor_schema.json").read_text(encoding="utf-8"))


def _legacy() -> tuple[dict[str, Any], list[str]]:
    values: dict[str, Any] = {}
    raising = []
    for name, read in flags.LEGACY_READERS:
        try:
            values[name] = read()
        except RuntimeError:
            values[name] = None
            raising.append(name)
    return values, raising


def _level_table(hw: Hardware, cells: dict[str, str]) -> dict[str, dict[str, str]]:
    target = targets.get(hw.target)
    sdpa, cudnn = targets.sdpa_kernel(), targets.cudnn_cell()
    table = {}
    for level in ALL_LEVELS:
        if level in EXTRA_LEVELS and not _gives(target, level):
            continue  # bfx9 before Blackwell: PyTorch raises there, no row of maths to show
        asked = {**cells, **level_cells(level)}
        obeyed = {**hw.cells_in_force(asked), "sdpa": sdpa, targets.CUDNN_CELL: cudnn}
        table[level] = {family: target.math_name(family, obeyed) for family in FAMILIES}
    return table


def _gives(target: targets.Target, level: str) -> bool:
    try:
        target.maths_at(level, {})
    except Tf32LabError:
        return False
    return True


def _native_levels() -> dict[str, Optional[str]]:
    """Each extra level: None where this torch can set it, else why not (one line naming the torch version)."""
    return {level: flags.native_refusal(level) for level in EXTRA_LEVELS}


def _probe(hw: Hardware) -> tuple[Optional[dict[str, ProbeResult]], Optional[Alert]]:
    from tf32lab.control.scope import current_emulation

    if hw.simulated_as is not None or current_emulation() is not None:
        return None, None  # another machine's kernels cannot be asked; emulated matmuls would answer for the target
    try:
        return probe_matmul(hw.device), None
    except Tf32LabError as exc:  # another thread holds a level that a probe here would change under it
        return None, Alert("probe-skipped", f"what each level really does was not probed: {exc}")


def _probe_alerts(table: dict[str, dict[str, str]], probe: dict[str, ProbeResult]) -> list[Alert]:
    out = []
    for level, found in probe.items():
        expected = table[level]["matmul"]
        # the probe's operands are half exact TF32 ties: it tells RNA, RNE and truncation apart
        if found.math not in ("same-as-highest", "ieee", expected) or (
                found.math in ("same-as-highest", "ieee") and expected != "ieee" and level != "highest"):
            out.append(Alert("probe-disagrees", (
                f"at {level!r} a float32 matmul here computed {found.math} (error {found.error:.1e} against "
                f"float64), where the target's table says {expected}: trust the probe for this machine")))
        elif found.math == "ieee" and level != "highest":
            out.append(Alert("other-float32-kernel", (
                f"at {level!r} a float32 matmul here runs another float32 kernel: its bits differ from "
                f"'highest' (error {found.error:.1e} against float64, {probe['highest'].error:.1e} at 'highest'), "
                "but no operand is rounded: results change in the last bits only")))
    return out


def _warnings(hw: Hardware, level: str, table: dict[str, dict[str, str]],
              cell_rows: list[tuple[str, str, str]], raising: list[str],
              probe: Optional[dict[str, ProbeResult]], cells: dict[str, str]) -> list[Alert]:
    out = [] if probe is None else _probe_alerts(table, probe)
    target = targets.get(hw.target)
    if table["highest"]["conv"].startswith("tf32"):
        out.append(Alert("conv-tf32-at-highest", (
            "convolutions run TF32 even at 'highest': cuDNN's setting is separate and PyTorch's default is TF32; "
            "set torch.backends.cudnn.conv.fp32_precision = 'ieee' (legacy: torch.backends.cudnn.allow_tf32 = "
            "False) for IEEE convolutions")))
    if target.device == "cuda" and target.capability and target.capability >= (8, 0):
        out.append(Alert("medium-equals-high", (
            "'medium' is the same as 'high' on CUDA: cuBLAS gets TF32, never bf16 (bf16 needs torch.autocast)")))
    override = hw.tf32_override()
    if override:
        what = ("TF32 is off in cuBLAS and cuDNN whatever the flags say" if override.startswith("NVIDIA")
                else "PyTorch's default level is 'high' (cuBLAS matmuls run TF32 while nothing sets a level); an "
                     "explicit 'highest' still gives IEEE")
        out.append(Alert("env-override", f"{override} is set: {what}"))
    try:
        if settings.get("TF32LAB_DISABLE", hw.env):
            out.append(Alert("autoconfig-disabled", (
                "TF32LAB_DISABLE is set: tf32lab.autoconfig() changes nothing (it logs that it is off)")))
    except Tf32LabError as unreadable:
        out.append(Alert("autoconfig-disabled", f"{unreadable}: tf32lab.autoconfig() raises on it"))
    if hw.rocm and hw.gpus:
        if hw.rocm_tf32_allowed:
            out.append(Alert("rocm-tf32", (
                "HIPBLASLT_ALLOW_TF32=1: at 'high' hipBLASLt runs TF32 (on an MI300 the XF32 instruction, which "
                "truncates operands: sums are biased low); see the bias with tf32lab check --target mi300")))
        else:
            out.append(Alert("rocm-tf32", (
                "HIPBLASLT_ALLOW_TF32 is not 1: on ROCm hipBLASLt keeps float32 matmuls IEEE whatever the level; "
                "set HIPBLASLT_ALLOW_TF32=1 to let 'high' use TF32")))
    if raising:
        out.append(Alert("mixed-api", (
            f"the per-backend flags hold values the legacy API cannot express: {', '.join(raising)} raise "
            "RuntimeError ('mix of the legacy and new APIs') in any code that reads them; set the level with "
            "one API only")))
    raw = {cell: r for cell, r, _ in cell_rows}
    generic = raw.get("generic.all", "none")
    if generic != "none":
        cut = [c for c in ("cuda.matmul", "mkldnn.matmul") if raw.get(c, "none") not in ("none", generic)]
        if cut:
            out.append(Alert("mixed-api", (
                f"torch.backends.fp32_precision = {generic!r} has no effect on {', '.join(cut)}, which hold "
                "explicit values (set_float32_matmul_precision writes them; pytorch#179445)")))
    if level in table and level != "highest" and table[level] == table["highest"]:
        out.append(Alert("level-has-no-effect", (
            f"the level is {level!r}, but here every op family computes as at 'highest' (target {hw.target})")))
    for cell, _, effective in cell_rows:
        if effective not in (*targets.CELL_VALUES, "none"):
            level_note = " the level shows as 'unknown'," if cell in ("cuda.matmul", "mkldnn.matmul") else ""
            out.append(Alert("unknown-value", (
                f"{cell} holds {effective!r}, a value this tf32lab does not know (a newer torch's):{level_note} "
                "emulate() refuses to guess what it computes")))
    if any(cell == "cuda.matmul" and effective == "bfx9" for cell, _, effective in cell_rows):
        if target.device != "cuda":
            where = f"; {target.name} computes on the CPU, which does not read that cell"
        elif target.capability and target.capability >= (10, 0):
            where = ""
        else:
            where = f"; on {target.name} (before Blackwell) PyTorch raises for every float32 matmul"
        out.append(Alert("bfx9", (
            "cuda.matmul is 'bfx9': cuBLAS computes float32 matmuls with nine bf16 products (CUDA 12.9+, compute "
            f"capability 10.0+; pytorch#195301): float32's accuracy, other bits than IEEE{where}")))
    gpu = target.device == "cuda"
    tensor_cores = gpu and bool(target.capability) and target.capability >= (8, 0)
    out += [Alert(code, message) for code, message in inductor.alerts(cells, tensor_cores, hw.env, gpu=gpu)]
    if hw.cpu_quota is not None and hw.cpu_quota < hw.visible_cpus:
        out.append(Alert("cpu-quota", (
            f"the CPU quota ({hw.cpu_quota:g} CPUs, {hw.quota_source}) is smaller than the {hw.visible_cpus} "
            f"visible cores: size thread pools from the {hw.usable_cpus} usable CPU(s), not os.cpu_count()")))
    if hw.simulated_as is None and torch.get_num_threads() > hw.usable_cpus:
        out.append(Alert("threads-oversubscribed", (
            f"torch uses {torch.get_num_threads()} intra-op threads on {hw.usable_cpus} usable CPU(s): threads "
            "beyond the CPUs get throttled; tf32lab.autoconfig() sets them from the usable CPUs")))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        text = hw.env.get(name, "")
        if text.strip().isdigit() and int(text) > hw.usable_cpus:
            out.append(Alert("threads-oversubscribed", (
                f"{name}={text} asks for more threads than the {hw.usable_cpus} usable CPU(s)")))
    return out


def doctor(hardware: Optional[Hardware] = None) -> Diagnosis:
    """Explain the precision settings on this machine (or on ``hardware``, e.g. ``Hardware.simulated("v100")``).

    The flags are always this process's (a simulated machine would start from the same ones). Changes nothing;
    telling inherited cells from explicit ones flips a parent cell for a moment, as ``flags.snapshot()`` does,
    and on the real machine one small matmul per level asks the device what each level does
    (:func:`tf32lab.machine.probe.probe_matmul`, inside scopes that put every flag back).

    Example:

        >>> import tf32lab
        >>> d = tf32lab.doctor()
        >>> d.hardware.visible_cpus >= 1 and d.level in tf32lab.LEVELS
        True
    """
    if hardware is not None and not isinstance(hardware, Hardware):
        hint = f": Hardware.simulated({hardware!r})" if isinstance(hardware, str) else ""
        raise Tf32LabError(f"doctor() takes None (this machine) or a tf32lab.machine.hardware.Hardware{hint}, not "
                           f"{type(hardware).__name__} {hardware!r}")
    hw = hardware or detect()
    snap = flags.snapshot()  # one probe of the raw cells, shared by the cell table
    cell_rows = flags.read_cell_table(snap)
    cells = flags.read_cells()
    legacy, raising = _legacy()
    # Before torch 2.9 the level and cuDNN's boolean are the legacy readers' own values, shown once, with them.
    shown = () if flags.NEW_API else ("float32_matmul_precision", "cudnn.allow_tf32")
    other = {name: value for name, value in snap if not name.startswith("fp32_precision.") and name not in shown}
    level = flags.read_level()
    table = _level_table(hw, cells)
    threads, reason = decide_threads("auto", 1, hw)
    probe, skipped = _probe(hw)
    warnings = [*_warnings(hw, level, table, cell_rows, raising, probe, cells), *([skipped] if skipped else [])]
    return Diagnosis(
        hardware=hw, level=level, cells=tuple(cell_rows), legacy=legacy, other_flags=other,
        threads={"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()},
        levels=table, warnings=tuple(warnings),
        recommendation=recommend(hw), recommended_threads=threads, threads_reason=reason, probe=probe,
        native_levels=_native_levels(),
    )
