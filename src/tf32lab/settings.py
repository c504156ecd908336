"""Every ``TF32LAB_*`` environment variable, defined once: its name, how its text is read, its default, one line of doc.

:data:`SETTINGS` is the one table; :func:`get` is the one way to read a setting. It reads ``os.environ`` at each
call (a test's ``monkeypatch.setenv``, or a program that sets a variable before it calls tf32lab, is seen), so a
caller that reads a setting on a hot path keeps what it read itself (``tf32lab.control.scope``, once per process).

The rules are the same for every setting, the shell's own: unset, empty or only spaces means the default; letter
case and surrounding spaces do not matter. A value that is not understood is never guessed at or ignored: it is a
``Tf32LabError`` of one line naming the variable, the value as given and what is accepted, raised where the setting
is used (so ``import tf32lab`` never fails). ``TF32LAB_DISABLE`` too: before, anything but 1/true/yes/on counted as
"not disabled", so ``TF32LAB_DISABLE=y`` silently left autoconfig on; now a kill switch that cannot be read says so.

docs/cli.md lists the table (:func:`markdown`; tests/test_settings.py keeps the two the same).

Example:

    >>> from tf32lab import settings
    >>> settings.get("TF32LAB_SPILL_MIB", environ={})
    32.0
    >>> settings.get("TF32LAB_SCOPE_GUARD", environ={"TF32LAB_SCOPE_GUARD": " Always "})
    'always'
    >>> settings.get("TF32LAB_DISABLE", environ={"TF32LAB_DISABLE": "maybe"})
    Traceback (most recent call last):
    tf32lab.errors.Tf32LabError: TF32LAB_DISABLE='maybe' is not understood; accepted: 1, true, yes, on (disabled); \
0, false, no, off (not disabled)
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tf32lab.errors import Tf32LabError

__all__ = ["SETTINGS", "Setting", "get", "markdown"]


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``parse`` turns its stripped, non-empty text into the value or raises
    ``ValueError``; ``default`` is the value when it is unset or empty; ``accepted`` says, for the error, what
    ``parse`` takes; ``doc`` is one line for the docs."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    accepted: str
    doc: str


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in values:
            raise ValueError(text)
        return text.lower()

    return parse


_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _switch(text: str) -> bool:
    if text.lower() in _YES:
        return True
    if text.lower() in _NO:
        return False
    raise ValueError(text)


def _mib(text: str) -> float:
    mib = float(text)  # "lots": ValueError
    if not 0 <= mib < math.inf:  # NaN too; "1e400" is inf, which has no byte count
        raise ValueError(text)
    return mib


def _text(text: str) -> str:
    return text


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("TF32LAB_DISABLE", _switch, False, f"{', '.join(_YES)} (disabled); {', '.join(_NO)} (not disabled)",
            "The kill switch of `tf32lab.autoconfig()`: when on, it changes nothing and says so in the log."),
    Setting("TF32LAB_SCOPE_GUARD", _choice("auto", "always"), "auto", "'auto', 'always'",
            "When a `precision()` scope guards its thread's ops: `auto` when other threads may need it, `always` "
            "on every scope. Read once per process."),
    Setting("TF32LAB_ACCUMULATION", _choice("ideal", "hardware"), "ideal", "'ideal', 'hardware'",
            "How `emulate()` sums a GEMM's products when not told: `ideal` (exact products, this CPU's float32 "
            "sums) or `hardware` (the target's matrix unit, bit for bit; slower). Reaches `check` and the pytest "
            "plugin's emulated tests."),
    Setting("TF32LAB_SPILL_MIB", _mib, 32.0, "a finite number of MiB >= 0 (0: never write out)",
            "`check` writes a float64 layer output, or a result one row keeps for the next, of this many MiB or "
            "more to an unlinked temporary file until it is compared or taken; 0 keeps all in memory."),
    Setting("TF32LAB_PYTEST", _text, None, "TARGET[:LEVEL], e.g. a100:high",
            "The pytest plugin's `--tf32lab TARGET[:LEVEL]` when the option is not given (the plugin checks the "
            "target and level: a bad one is a usage error naming this variable)."),
)}


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of the setting ``name`` in ``environ`` (default: ``os.environ``, read now); its default when it is
    unset or empty. Raises ``Tf32LabError`` naming the variable, the value and what is accepted when it is not
    understood, and ``KeyError`` for a name not in :data:`SETTINGS`.

    >>> get("TF32LAB_SPILL_MIB", environ={"TF32LAB_SPILL_MIB": "lots"})
    Traceback (most recent call last):
    tf32lab.errors.Tf32LabError: TF32LAB_SPILL_MIB='lots' is not understood; accepted: a finite number of MiB >= 0 \
(0: never write out)
    """
    setting = SETTINGS[name]
    raw = (os.environ if environ is None else environ).get(name, "")
    if not raw.strip():
        return setting.default
    try:
        return setting.parse(raw.strip())
    except ValueError:
        raise Tf32LabError(f"{name}={raw!r} is not understood; accepted: {setting.accepted}") from None


def markdown() -> str:
    """The table as Markdown, as docs/cli.md shows it.

    >>> print(markdown().splitlines()[0])
    | variable | default | accepted | what it does |
    """
    rows = ["| variable | default | accepted | what it does |", "| --- | --- | --- | --- |"]
    for s in SETTINGS.values():
        default = "unset" if s.default is None else ("on" if s.default else "off") if isinstance(s.default, bool) \
            else str(s.default)
        rows.append(f"| `{s.name}` | {default} | {s.accepted} | {s.doc} |")
    return "\n".join(rows) + "\n"
