"""Rule patterns (``fnmatch``'s ``*``, ``?``, ``[seq]``, ``[!seq]`` on module names) as automata: which names a
pattern matches, whether one pattern matches every name another matches, and so the first rule of a policy that
an earlier rule shadows (it could never give a module its level: the first match wins).

Pure: strings in, answers out; :class:`~tf32lab.control.policy.Policy` asks :func:`shadowing` once per policy.

Example:

    >>> shadowing(["encoder.*", "decoder.*", "encoder.layer.0"])   # rule 3 is shadowed by rule 1
    (2, 0)
    >>> shadowing(["encoder.layer.0", "encoder.*"]) is None          # the narrower rule first: both apply
    True
"""

from __future__ import annotations

import fnmatch
import functools
import re
from typing import Any, NamedTuple, Optional

__all__ = ["shadowing"]

_STAR = None  # a token of a pattern: "*", else (negated, characters) for one character


def _tokens(pattern: str) -> Optional[list[Any]]:
    """``pattern`` as fnmatch reads it (``*``, ``?``, ``[seq]``, ``[!seq]``, literal characters), or None for a
    class with a range too wide to list."""
    out: list[Any] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not out or out[-1] is not _STAR:
                out.append(_STAR)
        elif c == "?":
            out.append((True, frozenset()))
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:  # no closing bracket: a literal "[", as fnmatch reads it
                out.append((False, frozenset("[")))
                continue
            body, i = pattern[i:j], j + 1
            negated = body.startswith("!")
            body = body[1:] if negated else body
            chars: set[str] = set()
            k = 0
            while k < len(body):
                if k + 2 < len(body) and body[k + 1] == "-":
                    low, high = ord(body[k]), ord(body[k + 2])
                    if high - low > 1024:
                        return None
                    chars.update(map(chr, range(low, high + 1)))
                    k += 3
                else:
                    chars.add(body[k])
                    k += 1
            out.append((negated, frozenset(chars)))
        else:
            out.append((False, frozenset(c)))
    return out


def _closure(tokens: list[Any], states: frozenset[int]) -> frozenset[int]:
    more = set(states)
    for s in sorted(states):
        while s < len(tokens) and tokens[s] is _STAR:  # "*" may match nothing
            s += 1
            more.add(s)
    return frozenset(more)


def _step(tokens: list[Any], states: frozenset[int], char: Optional[str]) -> frozenset[int]:
    """The states after one character (None: any character no pattern names)."""
    nxt = set()
    for s in states:
        if s == len(tokens):
            continue
        token = tokens[s]
        if token is _STAR:
            nxt.add(s)
        elif (char is not None and char in token[1]) != token[0]:
            nxt.add(s + 1)
    return _closure(tokens, frozenset(nxt))


_COVER_STEPS = 5_000  # product states x alphabet one exact coverage test may explore before it gives up


@functools.lru_cache(maxsize=4096)
def _covers(wide: str, narrow: str) -> tuple[bool, int]:
    """Whether every name ``narrow`` matches, ``wide`` matches too (fnmatch, case-sensitive), and the steps it took:
    the two patterns' automata run side by side over the characters they name and one for all others. Past
    ``_COVER_STEPS`` (wide character ranges in long patterns) it answers False: a shadowed rule is then accepted,
    never a good one refused."""
    a, b = _tokens(wide), _tokens(narrow)
    if a is None or b is None:
        return wide == narrow, 1
    alphabet = [*sorted({c for t in (*a, *b) if t is not _STAR for c in t[1]}), None]
    start = (_closure(a, frozenset({0})), _closure(b, frozenset({0})))
    seen, todo = {start}, [start]
    budget = _COVER_STEPS
    while todo:
        sa, sb = todo.pop()
        if len(b) in sb and len(a) not in sa:
            return False, _COVER_STEPS - budget  # a name the narrow one matches and the wide one does not
        budget -= len(alphabet)
        if budget < 0:
            return False, _COVER_STEPS
        for char in alphabet:
            nb = _step(b, sb, char)
            if nb:
                pair = (_step(a, sa, char), nb)
                if pair not in seen:
                    seen.add(pair)
                    todo.append(pair)
    return True, _COVER_STEPS - budget


class _Shape(NamedTuple):
    """What the shadowed-rule check needs of a pattern, cheap to compare: the characters every name it matches
    starts and ends with, the one name it matches when it matches only one, and one name it matches."""

    prefix: str
    suffix: str
    literal: Optional[str]
    sample: str


def _fixed(token: Any) -> Optional[str]:
    return next(iter(token[1])) if token is not _STAR and not token[0] and len(token[1]) == 1 else None


def _shape(pattern: str) -> _Shape:
    if not _SPECIAL.search(pattern):  # a module's name (what tune writes): no need to read it character by character
        return _Shape(pattern, pattern, pattern, pattern)
    tokens = _tokens(pattern)
    if tokens is None:  # a range too wide to list: _covers compares it as text (only a duplicate)
        return _Shape("", "", None, "")
    fixed = [_fixed(t) for t in tokens]
    if None not in fixed:
        text = "".join(fixed)  # type: ignore[arg-type]
        return _Shape(text, text, text, text)
    first, last = fixed.index(None), fixed[::-1].index(None)
    sample = []
    for token in tokens:  # "*" matches nothing, "?" and a class one character they accept
        if token is not _STAR:
            chars = token[1]
            sample.append(next((c for c in "_0aA." if c not in chars), "\u2063") if token[0] else min(chars))
    return _Shape("".join(fixed[:first]), "".join(fixed[len(fixed) - last:]), None,  # type: ignore[arg-type]
                  "".join(sample))


_SPECIAL = re.compile(r"[*?\[]")
_SHADOW_CANDIDATES = 128  # earlier rules one rule is tested against, at most (the earliest ones)
_SHADOW_STEPS = 50_000  # automaton steps of exact tests for one policy (~0.2 s); then only the cheap tests


def shadowing(patterns: list[str]) -> Optional[tuple[int, int]]:
    """The first rule an earlier rule shadows, as (its index, the earlier one's), or None.

    A rule shadows a later one when it matches every name the later one matches. The exact test (:func:`_covers`)
    is far too slow for every pair of a policy of thousands of rules (minutes), so pairs are ruled out first by what
    is cheap: a wide pattern's fixed first and last characters must begin and end every name the narrow one matches,
    and it must match one name the narrow one matches. Candidates are found by the fixed start (a dictionary lookup
    per prefix), not by pairs. A literal name (what ``tune`` writes) costs a lookup per prefix and a comparison per
    candidate. Bounds keep a pathological policy fast: a rule is tested against its first ``_SHADOW_CANDIDATES``
    candidates and for an exact duplicate, and the exact tests of one policy stop after ``_SHADOW_STEPS`` steps. A
    bound can only let a shadowed rule through (as before this check existed), never refuse a rule that applies.
    """
    by_prefix: dict[str, list[int]] = {}
    first_of: dict[str, int] = {}
    shapes: list[_Shape] = []
    matchers: list[Any] = []  # each pattern's compiled match, once needed
    steps = 0
    for i, pattern in enumerate(patterns):
        shape = _shape(pattern)
        if pattern in first_of:
            return i, first_of[pattern]
        candidates: list[int] = []
        for k in range(len(shape.prefix) + 1):
            candidates += by_prefix.get(shape.prefix[:k], ())
        candidates.sort()
        for j in candidates[:_SHADOW_CANDIDATES]:
            wide = shapes[j]
            if wide.literal is not None:  # a literal covers only itself (any other pattern matches two names)
                if wide.literal == shape.literal:
                    return i, j
                continue
            if not shape.suffix.endswith(wide.suffix):
                continue
            if matchers[j] is None:  # compiled when first needed: most patterns never are
                matchers[j] = re.compile(fnmatch.translate(patterns[j])).match
            if not matchers[j](shape.sample):
                continue
            if shape.literal is not None:
                return i, j  # it matches the one name this rule matches
            if steps < _SHADOW_STEPS:
                covered, spent = _covers(patterns[j], pattern)
                steps += spent
                if covered:
                    return i, j
        first_of[pattern] = i
        by_prefix.setdefault(shape.prefix, []).append(i)
        shapes.append(shape)
        matchers.append(None)
    return None
