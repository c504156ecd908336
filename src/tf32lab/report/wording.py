"""Words the same in every rendering (text, HTML, summaries), without importing rich (``import tf32lab`` stays
light, and the conclusion's sentences use these too): a tolerance as given, a name made inert for a terminal."""

from __future__ import annotations

import math
import re

from tf32lab.numbers.metrics import DEFAULT_TOLERANCE

__all__ = ["given", "inert", "one_line", "share", "tolerance_words"]

# C0 controls but tab and newline, DEL, C1 controls, lone surrogates (which no terminal encoding can write)
_NOT_INERT = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def one_line(text: object) -> str:
    """The first non-blank line of ``text``, with `` …`` when more follow: an exception's message in a verdict line.

    Example:

        >>> one_line("NotPSDError: not positive definite\\n  at step 3")
        'NotPSDError: not positive definite …'
    """
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] + (" …" if len(lines) > 1 else "") if lines else ""


def inert(text: object) -> str:
    """``text`` with control characters and lone surrogates written as escapes (``\\x1b``), so that printing it
    cannot move the cursor, retitle the window or fail to encode."""
    return _NOT_INERT.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"),
                          str(text))


def tolerance_words(tolerance: float | dict[str, float]) -> str:
    """A tolerance as it was given, in as many digits as it has: ``tolerance 2e-04`` (``default tolerance`` only
    when it is the default, which no one gave), with any per-output entries.

    Example:

        >>> tolerance_words({"default": 2.5e-4, "logits": 1e-3})
        "tolerance 2.5e-04, output 'logits' 1e-03"
        >>> tolerance_words(1e-2)
        'default tolerance 1e-02'
    """
    entries = dict(tolerance) if isinstance(tolerance, dict) else {"default": tolerance}
    default = entries.pop("default", DEFAULT_TOLERANCE)
    words = ("default tolerance " if default == DEFAULT_TOLERANCE else "tolerance ") + given(default)
    return "".join([words, *(f", output {inert(repr(name))} {given(value)}" for name, value in entries.items())])


def given(value: float) -> str:
    """``value`` in e-notation without a digit more or less than it needs (at most 3): 2e-04, 1.25e-04."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"


def share(value: float) -> str:
    """A share (0 to 1) as a percentage with one decimal, or as many more as it takes not to round a share below 1
    up to 100.0% (a row of 99.995% read 100.0% beside FAILED against agreement>=0.99999).

    >>> share(0.96875), share(1.0), share(0.99995)
    ('96.9%', '100.0%', '99.995%')
    """
    for digits in range(1, 16):
        text = f"{value:.{digits}%}"
        if not (value < 1 and text.startswith("100.")):
            return text
    return text
