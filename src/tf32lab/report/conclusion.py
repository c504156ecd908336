"""What a report means and what to do, in one to four plain sentences (after the tables, in every format).

The answer follows the levels from the most reduced to ``highest``: the fastest level within tolerance is the
advice, with the one line that enables it; a level that fails names the output that failed and the layer that
introduces the most error there; a level at which the model raised says so; an error already at ``highest`` that
comes from convolutions or RNNs (TF32 by default on CUDA even at ``highest``) is explained; the math the model's
convolutions and RNNs ran at, which cuDNN's flag sets rather than the level, is stated (``tf32lab.report.cudnn``);
and a level (or policy) recommended within tolerance whose error is :data:`AMPLIFIED` times float32 `highest`'s or
more is said to be so (:func:`amplified`).

Example:

    >>> import torch, tf32lab
    >>> w = tf32lab.Workload(torch.nn.Linear(64, 8), torch.randn(16, 64), name="tiny")
    >>> tf32lab.check(w, levels=("highest", "high")).conclusion()[0][:38]
    'TF32 is safe for this workload on a100'
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Any, Optional

from tf32lab.know.targets import NATIVE, counted_math
from tf32lab.report import cudnn
from tf32lab.report.wording import given

# A ``tf32lab.report.Report`` and one of its ``LevelResult`` rows: the package's own module calls this one
# (``Report.conclusion()``), so they are named, not imported, not even for type checking
# (tests/test_layers.py: no import circle, TYPE_CHECKING imports included).
Report = LevelResult = LayerError = Any

__all__ = ["AMPLIFIED", "DRAWS_UNMATCHED", "INPUTS_NOT_FLOAT32", "MAX_REL_NOTE", "NO_FAMILY_OPS", "NO_TENSOR",
           "ON_ANOTHER_THREAD", "PINNED_CONV", "UNMEASURED", "WORTH", "WRITES_PARAMETERS", "amplified", "choices_said",
           "conclusion", "inputs_held", "on_other_threads", "pinned_and_diverged", "policy_summary", "unmeasured"]

# The smallest predicted speedup worth acting on: a level is advised for its speed (here, and for a training step
# in report.training), and tune takes a mixed or pinned policy over a uniform level, only when predicted at least
# this much faster. 1.10, because the speed model's speedups are off by a median 8% on an H200 (docs/gpu-results.md,
# 2026-11-26) and each pinned module's scope switch costs time of its own: a smaller gain may not be there, while
# the precision given up is certain.
WORTH = 1.10

# why a large max rel can stand beside PASSED (the footnote of the outputs table)
MAX_REL_NOTE = ("max rel is over the elements whose reference is at least 1e-6 of the largest, so a reference "
                "element near zero can make it large while the output as a whole (normwise, which decides) is close")

# in an output's failure (``compare``): float32 overflowed where the float64 reference is finite and larger than
# float32 can hold
BEYOND_FLOAT32 = "beyond float32's range"
# in an output's note (``check``): a failing float32 output whose float64 reference lies wholly below float32's
# least normal number, where float32 keeps fewer significant bits the smaller a value is
BELOW_FLOAT32 = "below float32's normal range"
# the note check adds where the float64 reference's random draws and its rows' could not be matched one for one
DRAWS_UNMATCHED = "the random draws could not be matched"
# the note check adds where a level raised and the workload's inputs hold floating tensors of another dtype than
# float32 (float64 ones beside a float32 model's weights: every row raises, whatever its precision)
INPUTS_NOT_FLOAT32 = "the inputs hold"
# the note check adds where the float64 reference ran no matmul-family op: no level changes the model
NO_FAMILY_OPS = "the model ran no matmul-family op"
# the note check adds where the model wrote into its own parameters as it ran (every run started from other weights)
WRITES_PARAMETERS = "the model writes into its own parameters as it runs"
# how ``metrics.compare`` begins the failure of an output that is NaN/Inf where its reference is not
_NOT_FINITE = "NaN/Inf at"
_DEFAULT_CONV_TF32 = ("conv", "rnn")  # cuDNN's allow_tf32 is on by default: TF32 even at `highest` on CUDA


# the levels below `highest` a conclusion weighs, the fastest first (bfx9, float32-accurate, is the slowest of them)
REDUCED = ("medium", "high", "bfx9")


def inputs_held(note: str, what: str = "inputs") -> str:
    """The head of an :data:`INPUTS_NOT_FLOAT32` note, said of the model's ``what`` (its inputs, its batches).

    >>> inputs_held("the inputs hold float64 tensors ('x'): every row is fed them as given", "batches")
    "its batches hold float64 tensors ('x')"
    """
    return note.split(":")[0].replace("the inputs", f"its {what}", 1)


def enable(level: str) -> str:
    """The code that turns ``level`` on, as the advice quotes it.

    >>> enable("high")
    '`torch.set_float32_matmul_precision("high")` or `tf32lab.precision("high")`'
    """
    if level == "bfx9":  # torch's set_float32_matmul_precision knows only its three levels; the per-backend cell does
        return '`tf32lab.precision("bfx9")` or `torch.backends.cuda.matmul.fp32_precision = "bfx9"`'
    return f'`torch.set_float32_matmul_precision("{level}")` or `tf32lab.precision("{level}")`'


def _name(level: LevelResult) -> str:
    """How a level is spoken of: ``high`` as TF32; ``medium`` as what the target makes of it."""
    matmul = level.maths.get("matmul", "")
    if level.level == "medium" and matmul.startswith("tf32"):
        return "TF32 (`medium`, computed as `high` here)"
    if matmul:
        word = {"tf32": "TF32", "bf16": "bf16", "ieee": "IEEE float32"}.get(matmul.split("-")[0].split("x")[0])
        if word and level.level != "highest":
            return f"{word} (`{level.level}`)"
    return f"`{level.level}`"


# An output error this many times the worst layer's own was amplified after the layers (a cancellation, an
# ill-conditioned solve): which layer's error it was, the ranking by introduced error cannot tell
BEYOND_LAYERS = 100.0


# A layer whose accumulated error is this many times both its own introduced error and every accumulated error
# before it (the layers whose first call ended before its own ended, in the reference) amplifies what reaches it, or
# the code between it and the layer before does: named where the output's error is over JUMPED_OUTPUT times the most
# any layer introduces, which rounding alone does not explain. Layers that only round grow the accumulated error
# 1-3x each (all-MiniLM-L6-v2, an MLP); a mixture of experts whose router's top-k TF32 flips grew it 9x and 26x in
# one layer (Qwen2-MoE and GPT-OSS built from configs: 8.4e-4 to 2.2e-2).
JUMP = 5.0
JUMPED_OUTPUT = 10.0


def _jump(level: LevelResult) -> Optional[tuple[LayerError, float, float, Optional[LayerError]]]:
    """The layer whose accumulated error grows most past its own introduced error and the largest of the layers
    that ended before it, by at least :data:`JUMP` times, among the layers called once: (it, that growth, the
    largest before it, the layer that ended just before it); None where none does or the order of the calls is not
    known (a report of an older version)."""
    # every layer with an order counts before the next, one whose introduced error is not measured (its rerun
    # raised) too: what its output carries is not the next layer's jump
    ordered = sorted((e for e in level.layers if e.order is not None), key=lambda e: e.order)
    found, before, previous = None, 0.0, None
    for e in ordered:
        measured = math.isfinite(e.introduced) and math.isfinite(e.accumulated)
        base = max(e.introduced, before) if measured else 0.0
        # a layer called again later (shared weights, a loop) has its worst call's error set against the layers
        # before its first: only a layer called once is placed
        if measured and e.calls == 1 and base > 0.0 and e.accumulated >= JUMP * base and \
                (found is None or e.accumulated / base > found[1]):
            found = (e, e.accumulated / base, before, previous)
        if not math.isnan(e.accumulated):  # an infinite one: nothing after it jumps
            before = max(before, e.accumulated)
        previous = e
    return found


def _flipped(level: LevelResult) -> Optional[str]:
    """How many of the float64 reference's discrete choices (a top-k's, an argmax's indices) the level made
    otherwise, or that its choice ops parted from the reference's, as a clause; None where it made them all alike or
    the reference made none."""
    c = level.choices
    if c is None or (not c.changed and c.comparable):
        return None
    if not c.changed:  # alike up to where the runs' choice ops part: that they part is the flip
        return (f"`{level.level}` made other choice ops than the float64 reference after {c.made} indices alike "
                f"(another op, count or shape: control flow that depends on the values)")
    return choices_said(level)


def choices_said(level: LevelResult) -> Optional[str]:
    """The level's discrete choices against the float64 reference's, as a clause (the report's notes say it for
    every level; the conclusion where the level fails); None where the reference made none.

    >>> from types import SimpleNamespace as Level, SimpleNamespace as Choices
    >>> choices_said(Level(level="high", choices=Choices(changed=6, made=64, ops=("aten::argmax",), comparable=True)))
    '6 of the 64 choices the float64 reference made (aten::argmax) came out otherwise at `high`'
    >>> choices_said(Level(level="highest", choices=Choices(changed=0, made=64, ops=(), comparable=True)))
    'all 64 choices the float64 reference made (indices of top-k, argmax, sort) came out alike at `highest`'
    """
    c = level.choices
    if c is None:
        return None
    part = "" if c.comparable else ", compared up to where the two runs' choice ops part"
    if not c.changed:
        return (f"all {c.made} choices the float64 reference made (indices of top-k, argmax, sort) came out alike at "
                f"`{level.level}`{part}")
    return (f"{c.changed} of the {c.made} choices the float64 reference made ({', '.join(c.ops)}) came out otherwise "
            f"at `{level.level}`{part}")


def _around(a: str, b: str) -> str:
    """The innermost module that holds both layers, neither inside the other (by their dotted names), ``(model)``
    for the model itself.

    >>> _around("model.layers.0.mlp.router", "model.layers.0.mlp.experts"), _around("pre", "head")
    ('model.layers.0.mlp', '(model)')
    """
    common = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        common.append(x)
    return ".".join(common) or "(model)"


def _worst_layer(level: LevelResult) -> Optional[str]:
    layer = next((e for e in level.layers if not math.isnan(e.introduced)), None)
    if layer is None:
        return None
    worst = level.worst
    jump = _jump(level) if worst is not None and worst.failure is None and \
        worst.normwise > JUMPED_OUTPUT * layer.introduced else None
    if jump is not None:
        e, grown, before, previous = jump
        inner = previous is None or e.name == "(model)" or previous.name.startswith(e.name + ".")
        where = f"inside {e.name!r}" if inner else \
            f"inside {e.name!r} or in the code of {_around(previous.name, e.name)!r} between {previous.name!r} and it"
        flipped = _flipped(level)
        what = f"amplifies small differences: {flipped}" if flipped else \
            ("amplifies small differences, such as a choice TF32 flips (an expert router's top-k, an argmax) or a "
             "cancellation (the difference of two nearly equal values)")
        return (f"no layer introduces that much (at most {layer.introduced:.1e}, in {layer.name!r}), but the error "
                f"grows {grown:.0f}x to {e.accumulated:.1e} at the output of {e.name!r} (which introduces "
                f"{e.introduced:.1e}; the layers before it reach {before:.1e}): something {where} {what}; pinning "
                f"one layer may not do, as what feeds it is rounded too: `tf32lab tune` finds what to pin")
    flipped = _flipped(level)
    if flipped and worst is not None and worst.failure is None:
        return f"the layer that introduces the most error is {layer.name!r} ({layer.introduced:.1e}), and {flipped}"
    if worst is not None and worst.failure is None and worst.normwise > BEYOND_LAYERS * layer.introduced:
        return (f"no layer introduces that much (at most {layer.introduced:.1e}, in {layer.name!r}): a layer's error "
                f"is amplified after it (a cancellation, an ill-conditioned solve), which layer's this ranking cannot "
                f"tell; `tf32lab tune` finds the one to pin by trying candidates")
    return f"the layer that introduces the most error is {layer.name!r} ({layer.introduced:.1e})"


def _why_failed(level: LevelResult) -> str:
    if level.error is not None:
        first = level.error.splitlines()[0].rstrip(".") if level.error else ""
        return f"at `{level.level}` the model raises {first}"
    worst = level.worst
    if worst is None:
        return f"at `{level.level}` there is no output to compare"
    if worst.failure is not None:
        text = f"at `{level.level}` the output {worst.name!r} fails: {worst.failure}"
    else:
        text = (f"at `{level.level}` the output {worst.name!r} is off by {worst.normwise:.1e} "
                f"(tolerance {given(worst.tolerance)})")
    layer = _worst_layer(level)
    return f"{text}; {layer}" if layer else text


def conclusion(report: Report, policy_file: Optional[str] = None) -> list[str]:
    """The sentences (see the module's docstring). With a policy row, the policy's verdict is the recommendation
    and the levels are context; ``policy_file``: where the policy was read from, named in the advice to apply it."""
    levels = list(report.levels)
    by_name = {lv.level: lv for lv in levels}
    lines: list[str] = []
    native = report.target == NATIVE
    where = "on this machine" if native else f"on {report.target}"
    reduced = [by_name[name] for name in REDUCED if name in by_name]
    passing = [lv for lv in reduced if lv.passed]
    failing = [lv for lv in reduced if not lv.passed]
    best = passing[0] if passing else None
    if best is not None and best.same_as is not None:
        best = by_name.get(best.same_as, best)
    row = by_name.get("policy")
    top = by_name.get("highest")
    # at `highest` the model samples, or float32 itself overflows: no level is the answer, and saying "keep
    # `highest`" (or "safe") first would contradict the sentence that explains it
    unmatched = any(DRAWS_UNMATCHED in note for note in report.notes)
    rewritten = any(WRITES_PARAMETERS in note for note in report.notes)
    blocked = row is None and top is not None and not top.passed and (
        top.unstable is not None or _overflowed(top) is not None or _underflowed(top) is not None or unmatched
        or rewritten)
    if blocked:
        lines.append(_highest_failed(top, report.target, unmatched, rewritten))
    elif row is not None:
        lines.append(_policy_sentence(row, where, policy_file))
        lines += _levels_beside(row, best, failing)
    elif best is not None:
        worst = best.worst
        measured = (f"worst normwise {worst.normwise:.1e} (output {worst.name!r}) against tolerance "
                    f"{given(worst.tolerance)}" if worst is not None and not worst.exact else "every output equal")
        lines.append(_safe(report, best, where, measured))
        # a faster level that fails (`medium` where it differs from `high`; `high` where bfx9 is the answer)
        rank = {name: i for i, name in enumerate(REDUCED)}  # `best` may be `highest` (a target where high is IEEE)
        passed_over = [lv for lv in failing
                       if lv.same_as is None and rank[lv.level] < rank.get(best.level, len(REDUCED))]
        if passed_over:
            lines.append(f"Not `{passed_over[0].level}`: {_why_failed(passed_over[0])}.")
    elif failing:  # where `highest` fails too, the sentence on it (below) says what to do instead
        keep = "No level passes" if top is not None and not top.passed else "Keep `highest`"
        lines.append(f"{keep}: {_why_failed(failing[-1])}.")
    lines += amplified(report)
    if not native and "medium" in by_name and by_name["medium"].same_as == "high":
        lines.append(f"On {report.target} `medium` computes exactly as `high`: on a GPU PyTorch asks the BLAS "
                     f"(cuBLAS, hipBLASLt) for TF32 at both, never bf16 for float32 matmuls, so it was measured once.")
    if top is not None and not top.passed and not blocked:
        inputs = next((note for note in report.notes if note.startswith(INPUTS_NOT_FLOAT32)), None)
        lines.append(_highest_failed(top, report.target, inputs=inputs))
    reasons = [(e.name, pinned_and_diverged(e.diverged)) for lv in levels for e in lv.layers if e.diverged]
    pinned = sorted({name for name, (pin, _) in reasons if pin})
    if pinned:
        names = ", ".join(repr(n) for n in pinned[:3]) + (" …" if len(pinned) > 3 else "")
        lines.append(f"{len(pinned)} layer(s) pinned by the policy to another conv math ({names}) have no introduced "
                     f"error in the policy row: they were not rerun at it (a session made without the policy's "
                     f"pins); their accumulated error, from the run under the policy, is measured.")
    diverged = sorted({name for name, (_, rest) in reasons if rest and not rest.startswith(("raised", UNMEASURED))})
    if diverged:
        names = ", ".join(repr(n) for n in diverged[:3]) + (" …" if len(diverged) > 3 else "")
        lines.append(f"{len(diverged)} layer(s) could not be matched with the reference at every call ({names}): "
                     f"control flow that depends on the data; their rows say why, the outputs are compared as "
                     f"they are.")
    if not lines:
        lines.append("Every level checked is within tolerance." if report.passed else
                     "Some level exceeds its tolerance; see the tables.")
    # the math the convolutions and RNNs ran at, which no level sets (the fix already said where they fail highest)
    lines += cudnn.stated(report, hint=not any("(cuDNN's default)" in line for line in lines))
    partial = unmeasured(report)
    if partial is not None:  # right under the recommendation it qualifies, not among the notes above the tables
        lines.insert(1, partial)
    return lines


# A level within tolerance whose error on some output is at least this multiple of float32 `highest`'s own is named
# as amplifying it, whatever the tolerance. TF32's unit roundoff is 2^13 times float32's, and where an output's
# float32 error is its rounding alone (no long sums for it to grow in) the multiple reaches that: pytorch#79270's
# rotation round trip is 7e3-8.8e3x under TF32 (emulated a100), its error 0.07 against float32's 1e-9, and a result
# that must match float32's (a round trip back to its input, a residual) then does not. Ordinary models measured
# 1.1e3-2.9e3x (a 1024-wide Linear, an MLP, the built-in model's logits): 2^12, half the formats' ratio, names the
# first kind and not the second. The multiple itself is in every table, whatever its size.
AMPLIFIED = 2.0**12


def amplified(report: Report) -> list[str]:
    """The sentence naming the recommended row's largest multiple of float32 `highest`'s error, where it is at
    least :data:`AMPLIFIED` (none otherwise, or where no row within tolerance is recommended)."""
    by_name = {lv.level: lv for lv in report.levels}
    row = report.policy_row
    if row is None:
        row = next((by_name[name] for name in REDUCED if name in by_name and by_name[name].passed), None)
        if row is not None and row.same_as is not None:
            row = by_name.get(row.same_as, row)
    if row is None or not row.passed:
        return []
    worst = max((o for o in row.outputs if o.multiple is not None and not math.isnan(o.multiple)),
                key=lambda o: o.multiple, default=None)
    if worst is None or worst.multiple < AMPLIFIED:
        return []
    floor = worst.normwise / worst.multiple if math.isfinite(worst.multiple) and worst.multiple > 0 else 0.0
    what = "the policy" if row.policy is not None else _name(row).split(" (")[0]
    over = ", both over the magnitudes that formed it: its reference is zero or cancels" \
        if worst.scale == "operands" else ""
    return [f"Within tolerance, but {what} makes the error of output {worst.name!r} {worst.multiple:.0f}x float32's "
            f"own ({worst.normwise:.1e} against {floor:.1e} at `highest`{over}): a result that must match float32's "
            f"(a round trip back to its input, a residual, a comparison with results computed in float32) will not; "
            f"keep `highest` where it must (pytorch#79270)."]


# The phrase by which a report's conclusion finds the note of ``tf32lab.speed.counting.OtherThreads.note`` (which
# writes it from this constant): defined here, below speed/, as the report layer must not import upward.
ON_ANOTHER_THREAD = "matmul-family op(s) ran on another thread"


def on_other_threads(notes: Iterable[str]) -> Optional[str]:
    """The note, among a report's ``notes``, saying that some products ran on other threads, if there is one.

    >>> on_other_threads(["3 matmul-family op(s) ran on another thread (aten::mm x3) and were not emulated", "x"])[:9]
    '3 matmul-'
    >>> on_other_threads(["nothing of the kind"]) is None
    True
    """
    return next((note for note in notes if ON_ANOTHER_THREAD in note), None)


def unmeasured(report: Report) -> Optional[str]:
    """The sentence saying that the verdict leaves out products the model ran on other threads, if it did."""
    note = on_other_threads(report.notes)
    return None if note is None else f"Not all of the model was measured; this verdict covers only part of it: {note}."


def notes_apart(report: Report) -> list[str]:
    """The report's notes printed apart from its verdict: all but the one :func:`unmeasured` says beside it."""
    partial = unmeasured(report)
    return [note for note in report.notes if not (partial and note in partial)]


def _levels_beside(row: LevelResult, best: Optional[LevelResult], failing: list[LevelResult]) -> list[str]:
    """The uniform levels as context for the policy's verdict, in words that agree with it."""
    if best is not None:
        name = _name(best).split(" (")[0]
        faster = f", predicted {_than_highest(best.speedup)}" if best.speedup is not None else ""
        if row.passed:
            return [f"For comparison, {name} everywhere is within tolerance too{faster}: "
                    f"{enable(best.level)} needs no policy."]
        return [f"{name} everywhere is within tolerance{faster}: use it instead, {enable(best.level)}."]
    if failing:
        because = _why_failed(failing[-1])
        if row.passed:
            return [f"For comparison, without the policy: {because}."]
        return [f"Without the policy: {because}. Keep `highest`, or let `tf32lab tune` find a policy that passes."]
    return []


# How check words the reason a layer pinned to another conv math has no introduced error (``LayerError.diverged``
# starts with it; measure/ writes it from this constant, as the report layer must not import upward). check()
# reruns pinned layers at their math; a session made without the pins (``measure.check.Session``) cannot.
PINNED_CONV = "the policy pins its conv math to"
# a layer the reruns cannot measure (no control flow of the model's, nothing the level did): said so, not matched
UNMEASURED = "not measured:"
NO_TENSOR = f"{UNMEASURED} its output holds no tensor to compare"  # a torch.distributions object


def pinned_and_diverged(reason: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """A layer's ``diverged`` text split into the conv pin's reason (first, one clause) and the rest, either None.

    >>> pinned_and_diverged("the policy pins its conv math to 'ieee', at which ...; another call diverged")
    ("the policy pins its conv math to 'ieee', at which ...", 'another call diverged')
    >>> pinned_and_diverged("another call diverged")
    (None, 'another call diverged')
    """
    if not reason or not reason.startswith(PINNED_CONV):
        return None, reason or None
    pin, _, rest = reason.partition("; ")
    return pin, rest or None


def _rule_summary(rule: dict) -> str:
    what = [f"`{rule['level']}`" if rule.get("level") else "", f"conv {rule['conv']}" if rule.get("conv") else ""]
    return f"{rule['pattern']!r} → {', '.join(filter(None, what))}"


def policy_summary(policy: dict) -> str:
    """A policy's dict form in a few words: ```high` by default, 'v_head' → `highest```, conv maths named
    (```high` by default, conv tf32, 'stem' → conv ieee``)."""
    default = f"`{policy['default']}`" if policy.get("default") else f"the caller's level (`{policy.get('base')}`)"
    default += f" by default, conv {policy['conv']}" if policy.get("conv") else " by default"
    rules = "".join(f", {_rule_summary(r)}" for r in policy.get("rules", ())[:3])
    more = len(policy.get("rules", ())) - 3
    return f"{default}{rules}" + (f" and {more} more rule(s)" if more > 0 else "")


def _policy_sentence(row: LevelResult, where: str, policy_file: Optional[str] = None) -> str:
    summary = policy_summary(row.policy or {})
    if row.passed:
        worst = row.worst
        measured = (f"worst normwise {worst.normwise:.1e} (output {worst.name!r}) against tolerance "
                    f"{given(worst.tolerance)}" if worst is not None and not worst.exact else "every output equal")
        faster = "" if row.speedup is None else f" and predicted {_than_highest(row.speedup)} there"
        apply = (f"`tf32lab.Policy.load({_quoted(policy_file)}).apply(model)`" if policy_file is not None
                 else "`policy.apply(model)` (the Policy given to check)")
        return f"The policy ({summary}) is within tolerance {where}{faster}: {measured}. Apply it with {apply}."
    return f"The policy ({summary}) fails: {_why_failed(row)}."


def _than_highest(speedup: float) -> str:
    """A predicted speedup over `highest` in words; below 1 (a policy that pins convolutions to IEEE where
    `highest` runs them in TF32) as a slowdown, not "0.36x faster".

    >>> _than_highest(1.5), _than_highest(0.5), _than_highest(0.996)
    ('1.50x faster than `highest`', '2.00x slower than `highest`', 'about as fast as `highest`')
    """
    if f"{speedup:.2f}" == "1.00" or f"{1 / speedup:.2f}" == "1.00":  # 0.996x: "1.00x slower" said nothing
        return "about as fast as `highest`"
    if speedup < 1:
        return f"{1 / speedup:.2f}x slower than `highest`"
    return f"{speedup:.2f}x faster than `highest`"


def _quoted(path: str) -> str:
    """A path as a Python string literal in the advice (a backslash or a quote in it stays valid)."""
    import json

    return json.dumps(path, ensure_ascii=False)


def _safe(report: Report, best: LevelResult, where: str, measured: str) -> str:
    """The advice for the fastest level within tolerance, weighed by its predicted speedup when there is one."""
    name = _name(best).split(" (")[0]
    if any(note.startswith(NO_FAMILY_OPS) for note in report.notes):  # "Enable it" would be advice about nothing
        return (f"{name} is safe for this workload {where} and changes nothing there: {NO_FAMILY_OPS} (see the "
                f"notes), and those are all the float32 matmul precision reaches ({measured}).")
    if best.speedup is None and report.target == NATIVE:  # no speed model for this machine: whether it gains is timed
        return (f"{name} is safe for this workload {where}: {measured}. Whether it is faster here is not predicted: "
                f"`tf32lab speed SPEC --target native --measure` (or `tf32lab.bench(workload)`) times it; enable it "
                f"with {enable(best.level)}.")
    if best.speedup is None:
        return f"{name} is safe for this workload {where}: {measured}. Enable it with {enable(best.level)}."
    if best.speedup >= WORTH:
        return (f"{name} is safe for this workload {where} and predicted {best.speedup:.2f}x faster there: "
                f"{measured}. Enable it with {enable(best.level)}.")
    share = ""
    if report.speed is not None:
        share = cudnn.why_little(report, best.level) or _why_little(report.speed, best.level, name,
                                                                    cudnn.held(report))
    return (f"{name} is safe for this workload {where}, but predicted only {best.speedup:.2f}x faster there"
            f"{share}. It buys little here; if you enable it anyway: {enable(best.level)} ({measured}).")


def _why_little(speed: Any, level: str, name: str, held: Collection[str] = cudnn.CUDNN_FAMILIES) -> str:
    """Why a level buys little: few matmul-family ops, or matmul-family ops too small to gain themselves
    (``speed``: the report's ``SpeedReport``; ``held``: the families whose math no level sets, left out)."""
    base = speed.level("highest")
    try:
        at = speed.level(level)
    except KeyError:
        at = None
    share = cudnn.level_share(base, held)  # convolutions and RNNs, which cuDNN's flag sets, left out
    if math.isnan(share):
        return ""
    if at is not None and share >= 0.5 and not math.isnan(at.family_share) and at.seconds > 0:
        at_share = cudnn.level_share(at, held)
        own = (base.seconds * share) / (at.seconds * at_share) if at_share > 0 else math.inf
        return (f": matmul-family ops are {share:.0%} of its predicted time, but they are small, so each is bound "
                f"by kernel launch and memory traffic rather than arithmetic; {name} makes them only {own:.2f}x "
                f"faster")
    return (f": matmul-family ops are only {share:.0%} of its predicted time, the rest is memory traffic and "
            f"kernel launches that {name} does not speed up")


def nondeterministic(top: LevelResult) -> str:
    """Why a failure at `highest` is the model's randomness, not precision."""
    return (f"Even `highest` fails, but two runs at `highest` differ ({top.unstable}): the model is not "
            f"deterministic (it samples from a generator no run seeds: one outside the model, such as a "
            f"module-level torch.Generator or numpy.random.default_rng()), so its error is chance, not precision; "
            f"seed it where it samples or take the sampling out of what is checked.")


def _overflowed(top: LevelResult) -> Optional[str]:
    """``output 'x': NaN/Inf at …``: an output that float32 turns to NaN/Inf where the float64 reference is
    finite, if any."""
    return next((f"output {o.name!r}: {o.failure}" for o in top.outputs
                 if o.failure is not None and o.failure.startswith(_NOT_FINITE)), None)


def _underflowed(top: LevelResult) -> Optional[str]:
    """``output 'x': below float32's normal range …``: a failing output whose reference float32 cannot hold with
    its full precision, if any."""
    return next((f"output {o.name!r} lies {o.note[o.note.index(BELOW_FLOAT32):]}" for o in top.outputs
                 if not o.passed and o.note is not None and BELOW_FLOAT32 in o.note), None)


def _highest_failed(top: LevelResult, target: str, unmatched: bool = False, rewritten: bool = False,
                    inputs: Optional[str] = None) -> str:
    """Why `highest` fails and what to do; ``inputs``: check's note on inputs that are not float32, if any."""
    if rewritten and top.error is None:  # before "not deterministic": its two runs differ for this reason
        return (f"Even `highest` fails ({_why_failed(top)}), but the model writes into its own parameters as it "
                f"runs (see the notes): each run started from the weights the last one left, so the error is "
                f"their difference, not float32's: check a model whose forward leaves its parameters alone (an EMA "
                f"or momentum update made outside it).")
    if top.unstable is not None:
        return nondeterministic(top)
    if unmatched and top.error is None:
        return (f"Even `highest` fails ({_why_failed(top)}), but the float64 reference and the rows made other "
                f"random draws (see the notes), so the error is their noise's difference, not float32's: make the "
                f"model draw alike in every run (a torch.Generator it seeds, the same number of draws), or take "
                f"the sampling out of what is checked.")
    overflow = _overflowed(top)
    if overflow is not None and BEYOND_FLOAT32 in overflow:
        return (f"Even `highest` fails, and no precision level fixes it: the values exceed float32's range (finite "
                f"only up to ~3.4e38), so float32 overflows to Inf where float64 does not ({overflow}); rescale the "
                f"computation (normalize, work in log space) or compute that part in float64.")
    if overflow is not None:
        return (f"Even `highest` fails, and no precision level fixes it: float32 gives NaN/Inf where float64 stays "
                f"finite ({overflow}), which rounding alone does not do: most likely a value on the way exceeds "
                f"float32's range (finite only up to ~3.4e38), or underflows to zero before a division; rescale "
                f"the computation or compute that part in float64.")
    underflow = _underflowed(top)
    if underflow is not None:
        return (f"Even `highest` fails, and no precision level fixes it: {underflow}, where float32 keeps fewer "
                f"significant bits the smaller a value is; rescale the computation into range (a scale factor, log "
                f"space) or compute that part in float64.")
    tf32_by_default = [f for f in _DEFAULT_CONV_TF32 if top.maths.get(f, "").startswith("tf32")]
    # "op math" keys; a "hardware" row's math says how it was summed too ("aten::mm tf32-rna, nvidia k4 f24")
    ops = [op for op in top.coverage if counted_math(op).endswith(("tf32-rna", "tf32-rne"))]
    if tf32_by_default and ops:
        families = " and ".join({"conv": "convolutions", "rnn": "RNNs"}[f] for f in tf32_by_default)
        return (f"Even `highest` fails ({_why_failed(top)}): on {target} {families} run TF32 at every level "
                f"unless told otherwise (cuDNN's default); set `torch.backends.cudnn.conv.fp32_precision = \"ieee\"` "
                f"and `torch.backends.cudnn.rnn.fp32_precision = \"ieee\"` (or `torch.backends.cudnn.allow_tf32 = "
                f"False`) for full float32.")
    if top.error is not None and inputs is not None:
        return (f"Even `highest` fails: {_why_failed(top)}; {inputs_held(inputs)}"
                f" (see the notes): give the model float32 inputs (.float()); no precision level is the matter.")
    if top.error is not None:
        return (f"Even `highest` fails: {_why_failed(top)}; the model needs more than float32 here, whatever "
                f"the matmul precision.")
    return (f"Even `highest` fails ({_why_failed(top)}): the computation amplifies float32 rounding itself; no "
            f"matmul setting fixes that, loosen the tolerance or compute that part in float64.")
