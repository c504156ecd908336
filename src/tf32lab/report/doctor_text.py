"""A diagnosis as rich tables (hardware, flags, what each level does; ``tables.Fitted`` where they have columns)
and unwrapped lines (warnings, advice)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rich.table import Table
from rich.text import Text

from tf32lab.report.tables import Column, Fitted

# A ``tf32lab.machine.doctor.Diagnosis``: that layer sits above this one (it calls this renderer), so it is named,
# not imported, not even for type checking.
Diagnosis = Any


def _hardware(d: Diagnosis) -> Table:
    hw = d.hardware
    table = Table(title="hardware", title_justify="left", show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("torch", f"{hw.torch} ({hw.api} flag API)")
    backend = ", ".join(f"{name} {value}" for name, value in (("CUDA", hw.cuda), ("ROCm", hw.rocm)) if value)
    table.add_row("GPU", "; ".join(f"{g.name}, capability {g.capability[0]}.{g.capability[1]}"
                                   + ("" if g.tf32 else ", no TF32") for g in hw.gpus) + f" ({backend})"
                  if hw.gpus else ("Apple GPU (MPS)" if hw.mps else "none"))
    table.add_row("CPU", f"{hw.cpu}; {', '.join(hw.isa) or 'no listed instructions'}")
    cpus = f"{hw.usable_cpus} usable: {hw.visible_cpus} visible, {hw.affinity_cpus} in affinity"
    if hw.cpu_quota is not None:
        cpus += f", quota {hw.cpu_quota:g} ({hw.quota_source})"
    table.add_row("CPUs", cpus)
    if hw.rank is not None:
        table.add_row("rank", f"{hw.rank} of {hw.world_size} (torchrun); tf32lab.distributed.agree() compares "
                              "the ranks' precision")
    table.add_row("threads", f"intra-op {d.threads['intra_op']}, inter-op {d.threads['inter_op']}")
    table.add_row("env", ", ".join(f"{k}={v}" for k, v in sorted(hw.env.items())) or "no overriding variables")
    table.add_row("target", hw.target + (" (simulated)" if hw.simulated_as else ""))
    return table


def _flags(d: Diagnosis) -> Fitted:
    table = Fitted(f"flags now: level {d.level!r}", [Column("flag", "text", key=True), Column("raw", "text"),
                                                     Column("effective", "text")])
    for cell, raw, effective in d.cells:
        table.add_row(f"fp32_precision {cell}", raw, effective)
    for name, value in d.legacy.items():
        table.add_row(name, "legacy", "raises (mixed APIs)" if value is None else repr(value))
    for name, value in d.other_flags.items():
        table.add_row(name, "", repr(value))
    return table


def _levels(d: Diagnosis) -> Fitted:
    families = list(next(iter(d.levels.values())))
    table = Fitted(f"what each level does here ({d.hardware.target})",
                   [Column("level", "text", key=True), *(Column(family, "text") for family in families)])
    for level, maths in d.levels.items():
        table.add_row(level + (" *" if level == d.level else ""), *(maths[f] for f in families))
    caption = ("* in force now; math: ieee, tf32-rna / tf32-rne (operands rounded to TF32, ties away / to "
               "even), bf16-rne, tf32x3 (3 passes), bfx9 (9 bf16 passes)")
    if not d.hardware.gpus and "rnn" in families:
        # oneDNN's RNN kernel is the LSTM's only (aten RNN.cpp); the others are aten GEMMs (docs/gpu-results.md)
        caption += ("\nrnn: an LSTM's; on a CPU a GRU, an Elman RNN or an LSTM with proj_size runs as matmuls, at the "
                    "matmul column's math")
    for level, refusal in d.native_levels.items():
        shown = "" if level in d.levels else f" (no row: {d.hardware.target} cannot compute it)"
        caption += f"\n{level}{shown}: " + ("this torch sets it natively" if refusal is None else
                                           f"emulated only here: {refusal}")
    table.caption = caption
    return table


_PROBED = {"same-as-highest": "the same bits as at 'highest'",
           "ieee": "other bits than at 'highest', no operand rounded (another float32 kernel)",
           "tf32-rna": "operands rounded to TF32 (to nearest, ties away)",
           "tf32-rne": "operands rounded to TF32 (to nearest, ties to even)",
           "tf32-rz": "operands truncated to TF32", "bf16-rne": "operands rounded to bf16"}


def _probe(d: Diagnosis) -> Fitted:
    assert d.probe is not None
    table = Fitted(f"probed: one float32 matmul on this {d.hardware.device} at each level",
                   [Column("level", "text", key=True), Column("computed", "text"), Column("error vs float64")])
    for level, found in d.probe.items():
        what = "float32, the reference of the other rows" if level == "highest" else _PROBED[found.math]
        table.add_row(level, what, f"{found.error:.1e}")
    return table


def render(d: Diagnosis) -> Iterator[Any]:
    yield Text.assemble(("tf32lab doctor", "bold"),
                        f"  {'simulated ' + d.hardware.simulated_as if d.hardware.simulated_as else 'this machine'}")
    yield _hardware(d)
    yield _flags(d)
    yield _levels(d)
    if d.probe is not None:
        yield _probe(d)
    for alert in d.warnings:
        yield f"warning | {alert.code} | {alert.message}"
    rec = d.recommendation
    yield f"recommend | level {rec.level!r} | {rec.reason}"
    yield f"recommend | threads {d.recommended_threads} | {d.threads_reason}"
    if rec.advice:
        yield f"advice | {rec.advice}"
    off = any(alert.code == "autoconfig-disabled" for alert in d.warnings)
    yield "apply with: tf32lab.autoconfig(workers=N) at program start; it logs each decision and can undo them" + (
        " (once TF32LAB_DISABLE is unset or off)" if off else "")
