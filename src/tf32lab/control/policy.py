"""Per-module precision: a :class:`Policy` says which level each module of a model runs at, forward and backward,
and, where it names one, the cuDNN convolution math (``conv``: ``"tf32"`` or ``"ieee"``).

A policy is plain data: a default level, a conv math for the model, and an ordered list of rules, given as
``(pattern, level)`` or ``(pattern, level, conv)`` and held as :class:`Rule`: the pair when it pins no conv math,
the triple when it does (read them by field, see there). Patterns are ``fnmatch``-style on the names of
``model.named_modules()`` (``"v_head"``, ``"encoder.layer.*.attention.*"``); the first rule that matches a
module gives its level and conv math (what the rule leaves as None is inherited), and a module no rule names
inherits its parent's. The model itself (named ``""``) gets the default; ``default=None`` leaves it at the level
in force where it is called, and ``conv=None`` at cuDNN's flag as it is there.

``policy.apply(model)`` wraps the ``forward`` of every module that has a level: it runs inside
``precision(level)``, however the module is called (through its parent, or directly), and the scope closes on every
exit, KeyboardInterrupt included; with a conv math, inside :class:`~tf32lab.control.scope.conv_math` too. cuDNN's
flag is process-wide, so while a module pinned to a conv math runs, other threads' convolutions run at that math too
(docs/design.md, "policy"). A module inside its parent's scope at the same level costs one Python call. The
first call of a policy on a thread checks the model against the tree it matched, and matches it again when a module
was replaced, added or taken out, so the levels are the ones :meth:`Policy.explain` gives for the model as it is.
The autograd nodes a module's forward created are tagged, and when backward runs one of them, a dispatch mode on
that node's thread runs its matmul-family ops inside the same ``precision(level)`` (and its convolutions inside the
module's ``conv_math``): natively (in autograd's own threads too) and under ``emulate()`` alike; a module's forward
recomputed inside a node (``torch.utils.checkpoint``) keeps its own level. PyTorch scopes the mode to the node (the
engine restores the thread's modes after each node), so a backward that raises leaves nothing behind.
docs/design.md ("policy") says what it costs and what it does not cover.

Example:

    >>> import torch, tf32lab
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    >>> policy = tf32lab.Policy(default="high", rules=[("1", "highest")])
    >>> [(a.name, a.level, a.source) for a in policy.explain(model)]
    [('', 'high', 'default'), ('0', 'high', 'inherited from the model'), ('1', 'highest', "rule 1 '1'")]
    >>> with policy.applied(model):
    ...     model(torch.randn(4, 8)).sum().backward()
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import json
import re
import reprlib
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tf32lab.control import modestack
from tf32lab.control.scope import conv_math, is_sensitive, precision
from tf32lab.errors import Tf32LabError
from tf32lab.know import optable
from tf32lab.know.levels import ALL_LEVELS, CONV_MATHS, check_conv, check_level
from tf32lab.numbers.files import write_atomically, write_json
from tf32lab.numbers.trees import named_tensors, operand_tensors

__all__ = ["Assignment", "Policy", "PolicyHandle", "Rule", "applied_policies", "applied_to", "exact_pattern", "explain"]

SCHEMA_VERSION = 2  # 2: a conv math per rule and for the model (``conv``); a policy without one is written as 1
SCHEMA_VERSIONS = (1, 2)  # what load() reads
_KEYS = ("schema_version", "default", "conv", "rules")
_RULE_KEYS = ("pattern", "level", "conv")
_NEEDS_2 = "'conv' needs schema_version 2 (version 1 has levels only); write schema_version 2"
_TAG = "tf32lab.level"  # key in an autograd node's metadata: the level its backward runs at (None: the caller's)
_CONV_TAG = "tf32lab.conv"  # and its conv math, when one is pinned
_LEAF = 1 << 63  # AccumulateGrad nodes carry the largest sequence number; they compute nothing to tag


def exact_pattern(name: str) -> str:
    """A rule pattern that matches exactly the module ``name`` (fnmatch's ``*``, ``?`` and ``[`` as literals).

    >>> exact_pattern("blocks[0]*"), Policy("high", [(exact_pattern("a*b"), "highest")]).rules[0].pattern
    ('blocks[[]0][*]', 'a[*]b')
    """
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _level(value: object, where: str) -> str:
    return check_level(value, where, loose=True)


def _conv(value: object, where: str) -> Optional[str]:
    """A conv math as a person may type it in a file (case and blanks do not matter); the error names the value."""
    name = value.strip().lower() if isinstance(value, str) else value
    return name if name in CONV_MATHS else check_conv(value, where)


def _check_version_1(data: Mapping, rules: Any, where: str) -> None:
    """A ``schema_version`` 1 file's own problems, in its own words (levels only; the constructor's messages name
    conv maths too): a conv math anywhere, a rule's unknown key, a rule without a level."""
    if "conv" in data:
        raise Tf32LabError(f"{where}: {_NEEDS_2}")
    for i, rule in enumerate(rules if isinstance(rules, list) else (), 1):
        if isinstance(rule, Mapping):
            if "conv" in rule:
                raise Tf32LabError(f"{where}: {_NEEDS_2}")
            unknown = sorted(set(map(str, rule)) - {"pattern", "level"})
            if unknown:
                raise Tf32LabError(f"{where}: policy rule {i}: unknown key {unknown[0]!r}; accepted: 'pattern', "
                                   "'level'")
            if "pattern" in rule and "level" not in rule:
                raise Tf32LabError(f"{where}: policy rule {i}: missing 'level'")
            pattern, level = rule.get("pattern"), rule.get("level")
        elif isinstance(rule, list) and len(rule) == 3:
            raise Tf32LabError(f"{where}: {_NEEDS_2}")
        elif isinstance(rule, list) and len(rule) == 2:
            pattern, level = rule
        else:
            raise Tf32LabError(f"{where}: policy rule {i}: {reprlib.repr(rule)} is not a (pattern, level) pair")
        if level is None and isinstance(pattern, str):
            raise Tf32LabError(f"{where}: policy rule {i} ({pattern!r}): names no level; accepted: "
                               f"{', '.join(map(repr, ALL_LEVELS))}")


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


def _shadowing(patterns: list[str]) -> Optional[tuple[int, int]]:
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


_ALIAS_WALK = 10_000  # module names walked beyond the first ones, at most: shared modules multiply the paths


def _aliases(model: torch.nn.Module, modules: Optional[list[torch.nn.Module]] = None) -> dict[int, list[str]]:
    """The names of each module registered under more than one (by ``id``; its first name first, as
    ``named_modules()`` gives it), for a rule naming any of them. Empty when no module is shared, the usual case,
    told by counting (``modules``: the model's, as ``modules()`` gives them) rather than walking every path.
    A module inside itself is not walked into again, and the walk stops after ``_ALIAS_WALK`` extra names."""
    if modules is None:
        modules = list(model.modules())
    if sum(child is not None for m in modules for child in m._modules.values()) == len(modules) - 1:
        return {}  # a tree: each module but the model is some module's child exactly once
    names: dict[int, list[str]] = {}
    shared = False
    todo: list[tuple[str, torch.nn.Module, frozenset[int]]] = [("", model, frozenset())]
    left = _ALIAS_WALK
    while todo and left > 0:
        prefix, module, path = todo.pop()
        known = names.setdefault(id(module), [])
        known.append(prefix)
        if len(known) > 1:
            shared = True
            left -= 1
        inside = path | {id(module)}
        for key, child in reversed(module._modules.items()):  # reversed: popped in named_modules() order
            if child is not None and id(child) not in inside:
                todo.append((f"{prefix}.{key}" if prefix else key, child, inside))
    return {key: more for key, more in names.items() if len(more) > 1} if shared else {}


class Rule(tuple):
    """One rule: modules whose name matches ``pattern`` (``fnmatch``) run at ``level``, and their convolutions at
    cuDNN's ``conv`` math (``"tf32"``, ``"ieee"``). Either may be None, not both: that one is inherited from the
    module's parent.

    A rule that pins no conv math is the pair ``(pattern, level)``, as rules always were (it unpacks, compares and
    hashes as that pair); one that pins a conv math is the triple ``(pattern, level, conv)``. Read it by field:
    ``rule.pattern``, ``rule.level``, ``rule.conv`` (None when it pins none).

    >>> Rule("head", "highest") == ("head", "highest"), tuple(Rule("stem", None, "ieee")), Rule("head", "high").conv
    (True, ('stem', None, 'ieee'), None)
    """

    __slots__ = ()

    def __new__(cls, pattern: str, level: Optional[str], conv: Optional[str] = None) -> Rule:
        return tuple.__new__(cls, (pattern, level) if conv is None else (pattern, level, conv))

    def __getnewargs__(self) -> tuple[Any, ...]:  # pickled and copied as the pair or triple it is
        return tuple(self)

    @property
    def pattern(self) -> str:
        return self[0]

    @property
    def level(self) -> Optional[str]:
        return self[1]

    @property
    def conv(self) -> Optional[str]:
        return self[2] if len(self) > 2 else None

    def __repr__(self) -> str:
        conv = "" if self.conv is None else f", conv={self.conv!r}"
        return f"Rule(pattern={self.pattern!r}, level={self.level!r}{conv})"


class Assignment(NamedTuple):
    """The level one module gets from a policy, and what gave it: ``"rule 2 'head.*'"``, ``"default"``, ...; and
    likewise its conv math (None: the cuDNN flag in force where it is called) and what gave that.

    Five fields, ``(name, level, source, conv, conv_source)``: read them by name (``a.level``), or unpack all five;
    the first three alone no longer unpack an assignment.
    """

    name: str
    level: Optional[str]
    source: str
    conv: Optional[str] = None
    conv_source: str = "inherited from the caller"


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which level each module of a model runs at; see the module docstring.

    Args:
        default: the model's own level (``"highest"``, ``"high"``, ``"medium"``), or None: the level in force where
            the model is called.
        rules: ``(pattern, level)`` pairs, ``(pattern, level, conv)`` triples (or :class:`Rule`), in order; the
            first match wins. A rule's level or conv math may be None (not both): the module inherits that one.
        conv: the model's own cuDNN convolution math (``"tf32"``, ``"ieee"``; ``torch.backends.cudnn.conv``'s
            ``fp32_precision``), or None: the flag in force where the model is called. A level never sets it.

    Example:

        >>> import tf32lab
        >>> p = tf32lab.Policy(default="high", rules=[("v_head", "highest"), ("stem", None, "ieee")])
        >>> p.rules
        (Rule(pattern='v_head', level='highest'), Rule(pattern='stem', level=None, conv='ieee'))
        >>> tf32lab.Policy(rules=[("v_head", "fast")])
        Traceback (most recent call last):
        ...
        tf32lab.errors.Tf32LabError: policy rule 1 ('v_head'): unknown level 'fast'; accepted: 'highest', ...
    """

    default: Optional[str] = None
    rules: tuple[Rule, ...] = ()
    conv: Optional[str] = None

    def __post_init__(self) -> None:
        default = None if self.default is None else _level(self.default, "policy default")
        conv = _conv(self.conv, "policy conv")
        if isinstance(self.rules, (str, bytes, Mapping)) or not isinstance(self.rules, Iterable):
            raise Tf32LabError("policy rules must be a list of (pattern, level) pairs, not "
                               f"{type(self.rules).__name__}")
        rules = []
        for i, rule in enumerate(self.rules, 1):
            if isinstance(rule, Mapping):
                unknown = sorted(set(map(str, rule)) - set(_RULE_KEYS))
                if unknown:
                    raise Tf32LabError(f"policy rule {i}: unknown key {unknown[0]!r}; accepted: "
                                       f"{', '.join(map(repr, _RULE_KEYS))}")
                if "pattern" not in rule:
                    raise Tf32LabError(f"policy rule {i}: missing 'pattern'")
                if "level" not in rule and "conv" not in rule:
                    raise Tf32LabError(f"policy rule {i}: missing 'level' (or 'conv')")
                rule = (rule["pattern"], rule.get("level"), rule.get("conv"))
            if isinstance(rule, (str, bytes)) or not isinstance(rule, (tuple, list)) or len(rule) not in (2, 3):
                raise Tf32LabError(f"policy rule {i}: {reprlib.repr(rule)} is not a (pattern, level) pair or a "
                                   "(pattern, level, conv) triple")
            pattern, level, rule_conv = (*rule, None) if len(rule) == 2 else rule
            if not isinstance(pattern, str):
                raise Tf32LabError(f"policy rule {i}: the pattern {reprlib.repr(pattern)} is not a string")
            where = f"policy rule {i} ({pattern!r})"
            rule_conv = _conv(rule_conv, where)
            if level is None and rule_conv is None:
                raise Tf32LabError(f"{where}: names neither a level nor a conv math; give it one (accepted levels: "
                                   f"{', '.join(map(repr, ALL_LEVELS))}; conv maths: "
                                   f"{', '.join(map(repr, CONV_MATHS))})")
            rules.append(Rule(pattern, None if level is None else _level(level, where), rule_conv))
        shadowed = _shadowing([rule.pattern for rule in rules])
        if shadowed is not None:  # the first match wins: that rule could never give a module its level
            i, j = shadowed
            raise Tf32LabError(
                f"policy rule {i + 1} ({rules[i].pattern!r}) never applies: rule {j + 1} ({rules[j].pattern!r}) "
                "comes first and matches every module name it matches; put the narrower rule first")
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "rules", tuple(rules))
        object.__setattr__(self, "conv", conv)

    def __repr__(self) -> str:  # as before conv existed, when it names none
        conv = "" if self.conv is None else f", conv={self.conv!r}"
        return f"Policy(default={self.default!r}, rules={self.rules!r}{conv})"

    @property
    def pins_conv(self) -> bool:
        """Whether the policy names a conv math anywhere (then it is saved as ``schema_version`` 2)."""
        return self.conv is not None or any(rule.conv is not None for rule in self.rules)

    # -- which level each module gets ------------------------------------------------------------------------------
    def explain(self, model: torch.nn.Module) -> list[Assignment]:
        """The level and conv math of every module of ``model`` (``named_modules()`` order) and the rule, default
        or parent that gave each. It reads no run: a module kept but never called is listed at its level all the
        same; :meth:`PolicyHandle.idle` names, after a call, the rules that did not act.

        >>> import torch, tf32lab
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 3))
        >>> policy = tf32lab.Policy("high", [("1", None, "ieee")], conv="tf32")
        >>> for a in policy.explain(model):
        ...     print(repr(a.name), a.level, a.conv, a.conv_source)
        '' high tf32 default
        '0' high tf32 inherited from the model
        '1' high ieee rule 1 '1'
        """
        return [a for a, _ in self._assignments(model)]

    def _assignments(self, model: torch.nn.Module) -> list[tuple[Assignment, Optional[str]]]:
        """Each module's assignment and its parent's name (None for the model)."""
        found: dict[str, Assignment] = {}
        named = list(model.named_modules())
        aliases = _aliases(model, [module for _, module in named])
        out = []
        for name, module in named:
            parent = None
            if name:
                parent = name.rpartition(".")[0]
                while parent and parent not in found:  # a module registered under a dotted name skips a level
                    parent = parent.rpartition(".")[0]
            found[name] = self._assign(name, None if parent is None else found[parent], aliases.get(id(module), ()))
            out.append((found[name], parent))
        return out

    def _assign(self, name: str, parent: Optional[Assignment], aliases: Iterable[str] = ()) -> Assignment:
        """The first rule matching ``name`` or one of the module's other names (a module registered twice) gives
        its level; else its parent's (the parent of its first name)."""
        others = [alias for alias in aliases if alias != name] if aliases else ()
        if parent is None:
            level, source = self.default, "default" if self.default else "inherited from the caller"
            conv, conv_source = self.conv, "default" if self.conv else "inherited from the caller"
        else:
            level, conv = parent.level, parent.conv
            source = conv_source = f"inherited from {parent.name!r}" if parent.name else "inherited from the model"
        for i, rule in enumerate(self.rules, 1):
            matched = f"rule {i} {rule.pattern!r}" if fnmatch.fnmatchcase(name, rule.pattern) else next(
                (f"rule {i} {rule.pattern!r} (it is also named {alias!r})" for alias in others
                 if fnmatch.fnmatchcase(alias, rule.pattern)), None)
            if matched is not None:  # the first match gives what it names; what it leaves out is inherited
                if rule.level is not None:
                    level, source = rule.level, matched
                if rule.conv is not None:
                    conv, conv_source = rule.conv, matched
                break
        return Assignment(name, level, source, conv, conv_source)

    def hooked(self, model: torch.nn.Module) -> list[str]:
        """The modules :meth:`apply` hooks: those whose level or conv math differs from their parent's (the model
        itself when the default or the policy's conv is set); the others run inside their parent's scope and cost
        nothing."""
        return _hooked(self._assignments(model))

    def unmatched(self, model: torch.nn.Module) -> list[Rule]:
        """The rules that match no module of ``model`` (a typo, or a policy written for another model)."""
        names = [name for name, _ in model.named_modules()]
        names += [alias for more in _aliases(model).values() for alias in more[1:]]
        return [rule for rule in self.rules if not any(fnmatch.fnmatchcase(n, rule.pattern) for n in names)]

    def unmatched_message(self, model: torch.nn.Module) -> Optional[str]:
        """One line naming the first rule that matches no module of ``model`` and some of its modules, or None."""
        missing = self.unmatched(model)
        if not missing:
            return None
        names = [name for name, _ in model.named_modules() if name][:6]
        return (f"policy rule {self.rules.index(missing[0]) + 1} {missing[0].pattern!r} matches no module of "
                f"{type(model).__name__} (its modules: {', '.join(names) or 'none but itself'}"
                f"{', ...' if len(names) == 6 else ''})")

    # -- applying it -----------------------------------------------------------------------------------------------
    def apply(self, model: torch.nn.Module, *, strict: bool = True) -> PolicyHandle:
        """Run each module of ``model`` at its level from now on, forward and backward, until ``handle.remove()``.

        ``strict``: a rule that matches no module is an error (else a warning). A model that already has a policy
        applied is an error: remove that one first.

        Example:

            >>> import torch, tf32lab
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
            >>> handle = tf32lab.Policy(rules=[("0", "highest")]).apply(model)
            >>> handle.hooked
            ['0']
            >>> handle.remove()
        """
        if not isinstance(model, torch.nn.Module):
            raise Tf32LabError(f"a policy applies to a torch.nn.Module, not {type(model).__name__}")
        message = self.unmatched_message(model)
        if message is not None:
            if strict:
                raise Tf32LabError(message)
            warnings.warn(message, stacklevel=2)
        return PolicyHandle(self, model)

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module, *, strict: bool = True) -> Iterator[PolicyHandle]:
        """:meth:`apply` for the duration of a ``with`` block."""
        handle = self.apply(model, strict=strict)
        try:
            yield handle
        finally:
            handle.remove()

    # -- as data ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The policy as plain data. A policy that names no conv math is written as before (``schema_version`` 1,
        no ``conv`` keys), so an older tf32lab reads it; one that does is ``schema_version`` 2."""
        if not self.pins_conv:
            return {"schema_version": 1, "default": self.default,
                    "rules": [{"pattern": r.pattern, "level": r.level} for r in self.rules]}
        return {"schema_version": SCHEMA_VERSION, "default": self.default, "conv": self.conv,
                "rules": [{"pattern": r.pattern, "level": r.level, **({"conv": r.conv} if r.conv else {})}
                          for r in self.rules]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "policy") -> Policy:
        """A policy from its dict form (``to_dict``); every problem is one ``Tf32LabError`` line naming it."""
        if not isinstance(data, Mapping):
            raise Tf32LabError(f"{where}: expected an object with {', '.join(_KEYS)}, not {type(data).__name__}")
        version = data.get("schema_version")
        # an int, not a float or a bool that compares equal to one: a file is read as strictly as it is written
        known = type(version) is int and version in SCHEMA_VERSIONS
        keys = _KEYS if not known or version > 1 else tuple(k for k in _KEYS if k != "conv")
        unknown = sorted(set(map(str, data)) - set(_KEYS))
        if unknown:
            raise Tf32LabError(f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(map(repr, keys))}")
        if version is None:
            raise Tf32LabError(f"{where}: missing 'schema_version' (this tf32lab writes {SCHEMA_VERSION})")
        if not known:
            raise Tf32LabError(f"{where}: schema_version {reprlib.repr(version)} is not supported; accepted: "
                               f"{', '.join(map(str, SCHEMA_VERSIONS))}")
        rules = data.get("rules", ())
        if version == 1:
            _check_version_1(data, rules, where)
        try:
            return cls(default=data.get("default"), rules=rules, conv=data.get("conv"))
        except Tf32LabError as exc:
            raise Tf32LabError(f"{where}: {exc}") from None

    def save(self, path: Union[str, Path]) -> Path:
        """Write the policy to ``path``: TOML when it ends in ``.toml``, else JSON. Written whole or not at all."""
        path = Path(path)
        if path.suffix.lower() == ".toml":
            return write_atomically(path, _toml(self, f"policy file {str(path)!r}"))
        return write_atomically(path, self.to_json())

    def to_json(self) -> str:
        """The policy as JSON text, as :meth:`save` writes it."""
        return write_json(None, self.to_dict())

    @classmethod
    def load(cls, path: Union[str, Path]) -> Policy:
        """Read a policy written by :meth:`save` (JSON, or TOML for a ``.toml`` file).

        Example:

            >>> import tempfile, os, tf32lab
            >>> path = os.path.join(tempfile.mkdtemp(), "policy.json")
            >>> _ = tf32lab.Policy("high", [("v_head", "highest")]).save(path)
            >>> tf32lab.Policy.load(path) == tf32lab.Policy("high", [("v_head", "highest")])
            True
        """
        path = Path(path)
        where = f"policy file {str(path)!r}"
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise Tf32LabError(f"{where}: cannot read it: {exc.strerror or exc}") from None
        if path.suffix.lower() == ".toml":
            data = _read_toml(text, where)
        else:
            try:
                data = json.loads(text)
            except (ValueError, UnicodeDecodeError) as exc:
                raise Tf32LabError(f"{where}: not JSON: {exc}") from None
            except RecursionError:
                raise Tf32LabError(f"{where}: not a policy: arrays or objects nested too deeply to read") from None
        return cls.from_dict(data, where)


def explain(policy: Policy, model: torch.nn.Module) -> list[Assignment]:
    """The level each module of ``model`` gets from ``policy``, and why (see :meth:`Policy.explain`)."""
    return policy.explain(model)


def _toml(policy: Policy, where: str) -> str:
    data = policy.to_dict()  # TOML has no null: a key whose value is None is left out
    lines = [f"schema_version = {data['schema_version']}"]
    for key in ("default", "conv"):
        if data.get(key) is not None:
            lines.append(f"{key} = {_toml_string(data[key], where)}")
    for rule in data["rules"]:
        lines += ["", "[[rules]]"]
        lines += [f"{key} = {_toml_string(rule[key], where)}" for key in _RULE_KEYS if rule.get(key) is not None]
    return "\n".join(lines) + "\n"


def _hooked(assignments: list[tuple[Assignment, Optional[str]]]) -> list[str]:
    """The names of the modules whose level or conv math differs from their parent's (the model: where it has one)."""
    by_name = {a.name: a for a, _ in assignments}
    return [a.name for a, parent in assignments if (a.level is not None or a.conv is not None) and (
        parent is None or (by_name[parent].level, by_name[parent].conv) != (a.level, a.conv))]


def _toml_string(text: str, where: str) -> str:
    """A TOML basic string: every character as it is but the ones TOML requires escaped. (JSON's escapes are not
    TOML's: JSON writes a character outside the BMP as a surrogate pair, ``\\ud83d\\ude00``, which TOML refuses.)"""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04X}")
        elif 0xD800 <= code <= 0xDFFF:
            raise Tf32LabError(f"{where}: {reprlib.repr(text)} holds a lone surrogate ({char!r}), which a TOML file "
                               "cannot hold; save the policy as JSON (a name ending in .json)")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


_DEEP_KEY = re.compile(r"(?:[A-Za-z0-9_-]+[ \t]*\.[ \t]*){64}")  # a dotted key 64 tables deep


def _read_toml(text: bytes, where: str) -> Any:
    try:
        import tomllib  # novermin (Python >= 3.11; tomli below)
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise Tf32LabError(f"{where}: reading TOML needs Python >= 3.11 or the tomli package; "
                               "save the policy as JSON instead") from None
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Tf32LabError(f"{where}: not TOML: {exc}") from None
    if _DEEP_KEY.search(decoded):  # tomllib's time and memory grow with the square of a dotted key's depth
        raise Tf32LabError(f"{where}: not a policy: a key nested more than 64 tables deep")
    try:
        return tomllib.loads(decoded)
    except ValueError as exc:
        raise Tf32LabError(f"{where}: not TOML: {exc}") from None
    except RecursionError:
        raise Tf32LabError(f"{where}: not a policy: arrays or tables nested too deeply to read") from None


# -- the mechanics of apply() -------------------------------------------------------------------------------------
class _Frame:
    """A policy module's forward running on this thread: its level and conv math (None: the caller's), and for its
    backward tags the dispatch stack's height and the autograd sequence number when it began."""

    __slots__ = ("conv", "depth", "handle", "level", "module", "start")

    def __init__(self, handle: PolicyHandle, level: Optional[str], conv: Optional[str], depth: int,
                 start: int, module: int = 0) -> None:
        self.handle, self.level, self.conv, self.depth, self.start = handle, level, conv, depth, start
        self.module = module  # the id of the module whose forward this is


class _Open(threading.local):
    """Per thread: the policy frames open now, innermost last; and the autograd nodes of ops that ran at the level
    of their weight's module (sequence number -> level, conv math), for the frame that tags them."""

    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.elevated: dict[int, tuple[Optional[str], Optional[str]]] = {}


_OPEN = _Open()
_APPLIED: weakref.WeakKeyDictionary[torch.nn.Module, PolicyHandle] = weakref.WeakKeyDictionary()
_APPLIED_LOCK = threading.RLock()
_dispatch_depth = torch._C._len_torch_dispatch_stack


class _Deciding(threading.local):
    active: bool = False  # set while a backward op runs under a node's level: outer nodes' modes defer


_DECIDING = _Deciding()
_CUDNN: dict[Any, bool] = {}  # op -> whether cuDNN's conv flag may decide its math (conv, rnn, ops outside aten)


def _follows_cudnn(func: Any) -> bool:
    known = _CUDNN.get(func)
    if known is None:
        name = func.name()
        known = _CUDNN[func] = optable.family(name) in ("conv", "rnn") or not name.startswith("aten::")
    return known


@modestack.skips_dynamo_lazily
class _NodeLevel(TorchDispatchMode):
    """Pushed by a tagged autograd node's pre-hook, for that node only: its family ops run at the node's level,
    and its convolutions (ops cuDNN's conv flag decides) at the node's conv math."""

    def __init__(self, level: Optional[str], conv: Optional[str]) -> None:
        super().__init__()
        self.level, self.conv = level, conv

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _DECIDING.active or not is_sensitive(func):
            return func(*args, **kwargs)
        frames = _OPEN.frames
        # A policy module's forward that began inside this node (a non-reentrant checkpoint recomputing it while
        # the node unpacks what it saved) keeps its own level: the frame was opened above this mode on the stack
        # (in a handler, the stack's height is the mode's own index).
        if frames and (frames[-1].level is not None or frames[-1].conv is not None) \
                and frames[-1].depth > _dispatch_depth():
            return func(*args, **kwargs)
        level = self.level
        conv = self.conv if self.conv is not None and _follows_cudnn(func) else None
        if level is None and conv is None:  # a node that pins only convolutions, at another op
            return func(*args, **kwargs)
        _DECIDING.active = True
        try:
            if conv is None:  # the usual node: a level only, as before conv maths were pinned
                with precision(level):  # type: ignore[arg-type]  # (set: not both are None)
                    return func(*args, **kwargs)
            # (a fresh conv_math block per op: one object entered by two threads could close the other's block)
            with (precision(level) if level is not None else contextlib.nullcontext()), conv_math(conv):
                return func(*args, **kwargs)
        finally:
            _DECIDING.active = False


_PINS = [(level, conv) for level in (None, *ALL_LEVELS) for conv in (None, *CONV_MATHS)
         if level is not None or conv is not None]  # what a node may be tagged with
_NODE_MODES = {pin: _NodeLevel(*pin) for pin in _PINS}


def _node_prehook(pin: tuple[Optional[str], Optional[str]]):
    mode = _NODE_MODES[pin]
    push = torch._C._push_on_torch_dispatch_stack

    def hook(grad_outputs):
        # The engine restores this thread's modes after the node, exception or not: no pop needed (or possible).
        push(mode)

    return hook


_PREHOOKS = {pin: _node_prehook(pin) for pin in _PINS}
_PRECISION = {level: i for i, level in enumerate(ALL_LEVELS)}  # most accurate first


def _owned(tree: _Tree, args: Any, found: list) -> None:
    """The owner entries of ``tree`` for the parameters among ``args`` (a view of one included), into ``found``."""
    for a in args:
        if isinstance(a, torch.Tensor):
            base = a._base if a._base is not None else a
            entry = tree.owners.get(id(base))
            if entry is not None and entry[0]() is base:
                found.append(entry)
        elif isinstance(a, (list, tuple)):
            _owned(tree, a, found)


@modestack.skips_dynamo_lazily
class _Owners(TorchDispatchMode):
    """Pushed around a policy module's forward where ops may use another module's parameters (the first call of
    a matched tree, to find out; then only the frames where one did): an op of a flag-sensitive family whose
    operands include a parameter of a module with another level or conv math runs at that module's
    (``nn.MultiheadAttention`` hands ``out_proj.weight`` to its functional attention and never calls
    ``out_proj``). Operands of several modules: the most accurate of their levels, and IEEE convolutions if any
    pins them. Every module whose parameters an op used is noted as reached."""

    def __init__(self, tree: _Tree) -> None:
        super().__init__()
        self.tree = tree

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tree = self.tree
        if _DECIDING.active or not tree.owners or not is_sensitive(func):
            return func(*args, **kwargs)
        found: list = []
        _owned(tree, args, found)
        _owned(tree, kwargs.values(), found)
        frames = _OPEN.frames
        if not found or not frames:
            return func(*args, **kwargs)
        top = frames[-1]
        for entry in found:
            tree.reached.add(entry[3])
        pins = {(entry[1], entry[2]) for entry in found}
        if pins == {(top.level, top.conv)}:  # run inside their own module, or at its level anyway
            return func(*args, **kwargs)
        levels = [level for level, _ in pins if level is not None]
        level = min(levels, key=_PRECISION.__getitem__) if levels else top.level
        convs = {conv for _, conv in pins if conv is not None}
        conv = ("ieee" if "ieee" in convs else convs.pop()) if convs else top.conv
        if (level, conv) == (top.level, top.conv):
            return func(*args, **kwargs)
        tree.foreign.add(top.module)  # this frame needs the mode at later calls too
        if torch.is_grad_enabled() and any(t.requires_grad for t in operand_tensors(args)):
            # autograd made this op's node just before it reached the modes: its backward runs at the same level
            _OPEN.elevated[_sequence_nr() - 1] = (level, conv)
        cudnn = conv if conv is not None and _follows_cudnn(func) else None
        with (precision(level) if level is not None else contextlib.nullcontext()), \
                (conv_math(cudnn) if cudnn is not None else contextlib.nullcontext()):
            return func(*args, **kwargs)


def _tag(output: Any, start: int, level: Optional[str], conv: Optional[str] = None) -> None:
    """Tag the autograd nodes created since sequence number ``start`` that lead to ``output`` and have no level yet
    (those of nested modules with a level or conv math of their own are tagged already, at their own forward's
    end) with ``level`` and ``conv`` (both None: only the nodes of ops that ran at their weight's level)."""
    todo = [t.grad_fn for _, t in named_tensors(output) if t.grad_fn is not None]
    # Each visit gets a fresh Python wrapper of the C++ node: keep the ones seen alive, or a freed wrapper's id is
    # reused by the next one and a node is skipped untagged (seen on CUDA: the default level's nodes ran untagged).
    seen: dict[int, Any] = {}
    elevated = _OPEN.elevated  # nodes of ops that ran at their weight's module's level (_Owners) get that one
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        number = node._sequence_nr()
        if number < start or number >= _LEAF:
            continue
        metadata = node.metadata
        if _TAG not in metadata:
            pin = elevated.pop(number, None) if elevated else None
            node_level, node_conv = pin if pin is not None else (level, conv)
            if node_level is not None or node_conv is not None:
                metadata[_TAG] = node_level
                if node_conv is not None:
                    metadata[_CONV_TAG] = node_conv
                node.register_prehook(_PREHOOKS[(node_level, node_conv)])
        todo.extend(fn for fn, _ in node.next_functions)


_sequence_nr = torch._C._autograd._get_sequence_nr


def _unwrapped(forward: Any) -> Any:
    return forward


class _Pinned:
    """Stands in for a module's ``forward`` while a policy is applied: the forward runs at the level the policy
    gives that module in the model as it is at call time, however the module is called (through its parent, or
    directly, as CLIP's ``encode_image`` calls ``self.visual``).

    A wrapper of ``forward`` rather than forward hooks: a hook pair cannot close a scope when a BaseException
    (KeyboardInterrupt) escapes the forward, since PyTorch runs ``always_call`` hooks on ``Exception`` only.
    A copy or a pickle of the module gets its plain ``forward`` back: a copy is not under the policy.
    """

    __slots__ = ("__weakref__", "forward", "handle", "module", "own")

    def __init__(self, handle: PolicyHandle, module: torch.nn.Module) -> None:
        own = module.__dict__.get("forward")  # someone else's wrapper (accelerate's, say) stays inside ours
        self.own = own is not None
        self.forward = own  # else the class's, bound at each call: no reference cycle through a bound method
        self.handle: Optional[PolicyHandle] = handle  # None once taken off: a wrapper kept by others calls through
        self.module = weakref.ref(module)

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(module.forward) sees the real one
        module = self.module()
        return self.forward if self.own or module is None else type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = _CALL[0]
        if call is None:
            call = _call
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is not None and hasattr(dynamo, "disable"):
                # A compiled model graph-breaks here and each module's forward compiles on its own (Dynamo cannot
                # trace the scope's contextvars and locks). Until torch._dynamo is loaded nothing compiles, and
                # importing it (71 MiB) just for this is not ours to do.
                call = _CALL[0] = dynamo.disable(_call, recursive=False)
        return call(self, args, kwargs)

    def __reduce__(self) -> Any:
        module = self.module()
        if self.own or module is None:
            return (_unwrapped, (self.forward,))
        return (getattr, (module, "forward"))  # rebuilt before the module's state: the class's forward


def _call(pinned: _Pinned, args: tuple, kwargs: dict) -> Any:
    """A module's forward at its level (see :class:`_Pinned`)."""
    module = pinned.module()
    if module is None:  # only a copy that kept this object could call it now
        raise Tf32LabError("this forward belongs to a module that no longer exists")
    forward = pinned.forward if pinned.own else type(module).forward.__get__(module)
    handle = pinned.handle
    if handle is None:
        return forward(*args, **kwargs)
    frames = _OPEN.frames
    top = frames[-1] if frames else None
    # The outermost frame of this policy on the thread checks the model against the one it matched last.
    tree = handle._tree if top is not None and top.handle is handle else handle._current()
    entry = tree.members.get(id(module))
    if entry is None or entry[0]() is not module:  # taken out of the model: no longer the policy's
        return forward(*args, **kwargs)
    level, conv = entry[1], entry[2]
    key = id(module)
    tree.ran.add(key)
    # ops using other modules' parameters: looked for under the first call of a tree, then where one was found
    owners = _Owners(tree) if tree.owners and (key in tree.foreign or (
        not tree.probed and (top is None or top.handle is not handle))) else None
    if owners is None and top is not None and top.handle is handle and top.level == level and top.conv == conv \
            and top.depth == _dispatch_depth():
        return forward(*args, **kwargs)  # inside its parent's frame at the same level: covered by it
    # The scope and the conv block close on every exit, a BaseException (KeyboardInterrupt) included. (One frame:
    # Dynamo skips this function's own code only.)
    scope = None
    if level is not None:
        scope = precision(level)
        scope.__enter__()
    try:
        block = None
        if conv is not None:  # cuDNN's flag is the process's: conv_math stacks blocks of any thread, in any order
            block = conv_math(conv)
            block.__enter__()
        try:
            frame = _Frame(handle, level, conv, _dispatch_depth(), _sequence_nr(), key)
            frames.append(frame)
            try:
                if owners is None:
                    output = forward(*args, **kwargs)
                else:
                    with owners:
                        output = forward(*args, **kwargs)
                if (level is not None or conv is not None or _OPEN.elevated) and output is not None \
                        and torch.is_grad_enabled():
                    _tag(output, frame.start, level, conv)
                return output
            finally:
                if frames and frames[-1] is frame:
                    frames.pop()
                else:  # closed out of order (not in a plain call; never leave it behind)
                    with contextlib.suppress(ValueError):
                        frames.remove(frame)
                if owners is not None and not tree.probed and not any(f.handle is handle for f in frames):
                    tree.probed = True  # the first whole call looked: later calls push _Owners where it acted
                if not frames:
                    _OPEN.elevated.clear()
        finally:
            if block is not None:
                block.__exit__(None, None, None)
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)


_CALL: list[Any] = [None]  # _call, skipped by Dynamo once it is loaded


def _wrap(module: torch.nn.Module, handle: PolicyHandle) -> _Pinned:
    pinned = _Pinned(handle, module)
    module.__dict__["forward"] = pinned
    return pinned


def _unwrap(module: torch.nn.Module, pinned: _Pinned) -> None:
    pinned.handle = None
    if module.__dict__.get("forward") is pinned:
        if pinned.own:
            module.__dict__["forward"] = pinned.forward
        else:
            del module.__dict__["forward"]


class _Tree:
    """The model as a handle matched it: each module's level and conv math (by ``id``, with a weak reference to
    tell a new module at a reused address), the modules where either changes, and each module's children to see a
    change."""

    __slots__ = ("foreign", "hooked", "members", "owners", "probed", "ran", "reached", "shape")

    def __init__(self) -> None:
        self.members: dict[int, tuple[weakref.ref, Optional[str], Optional[str]]] = {}
        self.hooked: list[str] = []
        self.shape: list[tuple[weakref.ref, tuple[str, ...], tuple[int, ...]]] = []
        # parameter id -> (its weak reference, its module's level and conv math, the module's id): where the
        # policy gives modules different pins, for ops that use a module's parameters outside its forward
        self.owners: dict[int, tuple[weakref.ref, Optional[str], Optional[str], int]] = {}
        self.probed = False  # whether a first call has looked for such ops (under _Owners)
        self.foreign: set[int] = set()  # the modules whose forward ran one: _Owners is pushed there from then on
        self.ran: set[int] = set()  # ids of the wrapped modules whose forward ran
        self.reached: set[int] = set()  # ids of the modules whose parameters an op used (seen under _Owners)

    def changed(self) -> bool:
        for ref, names, ids in self.shape:
            module = ref()
            if module is None:
                return True
            children = module._modules
            if tuple(children) != names or tuple(map(id, children.values())) != ids:
                return True
        return False


def _collected(handle_ref: weakref.ref) -> Any:
    def callback(_: Any) -> None:
        handle = handle_ref()
        if handle is not None:
            handle._stale = True

    return callback


def _on_register(parent: torch.nn.Module, name: Optional[str], child: Any) -> None:
    """PyTorch's hook for every submodule assigned (``model.head = ...``, ``add_module``), and ours for
    ``insert``: a module put into a model under a policy is wrapped at once, so a direct call of it finds the model
    changed and re-matches it, and it counts as the model's at once, so a module assigned into it in turn is too
    (``model.new = Module()``, then ``model.new.extra = ...``)."""
    handle = _APPLIED.get(parent)
    if handle is None or handle._removed or not isinstance(child, torch.nn.Module):
        return None
    with _APPLIED_LOCK:
        handle._stale = True
        for module in child.modules():
            owner = _APPLIED.get(module)
            if owner is not None and owner is not handle and not owner._removed:
                continue  # another policy's: the model's next call says so (one module takes one policy)
            if owner is None:
                _APPLIED[module] = handle
                handle._pending.append(weakref.ref(module))
            held = handle._wrapped.get(id(module))
            # (an entry of a freed module whose id came back for this one is stale: the weak reference tells)
            if (held is None or held[0]() is not module) and not isinstance(module, torch.jit.ScriptModule) \
                    and not isinstance(module.__dict__.get("forward"), _Pinned):
                handle._wrapped[id(module)] = (weakref.ref(module), _wrap(module, handle))
    return None


def _announcing(insert: Any) -> Any:
    @functools.wraps(insert)
    def announced(self: torch.nn.Module, index: int, module: torch.nn.Module) -> Any:
        out = insert(self, index, module)
        if _APPLIED:  # some policy is applied somewhere: one dictionary lookup
            _on_register(self, None, module)
        return out

    announced._tf32lab_announces = True  # type: ignore[attr-defined]
    return announced


_REGISTRATION: list[Any] = []


def _watch_registrations() -> None:
    """Once per process: PyTorch's registration hook (a dictionary lookup per submodule assigned anywhere), and
    the same announcement from ``ModuleList.insert`` and ``Sequential.insert``, which write the container's
    ``_modules`` directly, so the hook never fires for them. Wrapping those two methods costs nothing per forward
    and leaves every model's state as it is (a copy or a pickle holds no trace of it); the alternatives were a
    global forward pre-hook (every module call of every model in the process through PyTorch's slow path, and the
    call it catches already bound to the plain forward) or a watching dict in each ``_modules`` (in the model's
    state, and replaced wholesale by ``del container[i]``). Code that writes ``_modules`` itself announces nothing:
    such a module gets its level from the next call of any module of the model."""
    if _REGISTRATION:
        return
    _REGISTRATION.append(torch.nn.modules.module.register_module_module_registration_hook(_on_register))
    for container in (torch.nn.ModuleList, torch.nn.Sequential):
        insert = container.__dict__.get("insert")
        if insert is not None and not getattr(insert, "_tf32lab_announces", False):
            container.insert = _announcing(insert)  # type: ignore[method-assign]


def applied_to(module: torch.nn.Module) -> Optional[Policy]:
    """The policy applied to ``module`` or to a module inside it (or to a model it is part of), else None.

    Cheap (no forward run): for a measurement that must refuse, or lift, a policy the user applied rather than
    measure it without saying so.

    Example:

        >>> import torch, tf32lab
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> with tf32lab.Policy("high").applied(model):
        ...     tf32lab.control.policy.applied_to(model[0])
        Policy(default='high', rules=())
        >>> tf32lab.control.policy.applied_to(model) is None
        True
    """
    if not isinstance(module, torch.nn.Module):
        raise Tf32LabError(f"applied_to takes a torch.nn.Module, not {type(module).__name__}")
    with _APPLIED_LOCK:
        for m in module.modules():
            handle = _owner(m)
            if handle is not None:
                return handle.policy
    return None


def applied_policies() -> list[Policy]:
    """Every policy applied in this process now (each once, in no set order): what ranks of a job compare.

    Example:

        >>> import torch, tf32lab
        >>> from tf32lab.control.policy import applied_policies
        >>> with tf32lab.Policy("high").applied(torch.nn.Linear(2, 2)):
        ...     [p.default for p in applied_policies()]
        ['high']
    """
    with _APPLIED_LOCK:
        handles = {id(h): h for h in list(_APPLIED.values()) if not h._removed}
    return [h.policy for h in handles.values()]


def _owner(module: torch.nn.Module, but: Optional[PolicyHandle] = None) -> Optional[PolicyHandle]:
    """The live handle whose model holds ``module`` now (its model re-matched first if it changed); under the lock."""
    handle = _APPLIED.get(module)
    if handle is None or handle is but or handle._removed:
        return None
    if handle._stale or handle._tree.changed():
        with contextlib.suppress(Tf32LabError):  # that model's own problem, told when it runs
            handle._current()
    handle = _APPLIED.get(module)
    return None if handle is None or handle is but or handle._removed else handle


class PolicyHandle:
    """A policy applied to a model: ``remove()`` takes it off (graphs built meanwhile keep their levels).

    The policy follows the model as it is when called: a module replaced, added or taken out after ``apply()``
    is matched again at the next call (a module taken out is the policy's no longer). ``hooked`` names the modules
    whose level or conv math differs from their parent's.
    """

    def __init__(self, policy: Policy, model: torch.nn.Module) -> None:
        self.policy, self._model = policy, weakref.ref(model)
        self._wrapped: dict[int, tuple[weakref.ref, _Pinned]] = {}
        self._tree = _Tree()
        self._stale = False
        self._removed = False
        self._pending: list[weakref.ref] = []  # modules claimed as they were put in, until the model is matched
        with _APPLIED_LOCK:
            taken = next((name for name, m in model.named_modules() if _owner(m) is not None), None)
            if taken is not None:
                raise Tf32LabError(f"module {taken or type(model).__name__!r} already has a policy applied; "
                                   "remove it (handle.remove()) before applying another")
            try:
                self._tree = self._match(model)
            except BaseException:
                self._take_off()
                raise
            _watch_registrations()

    @property
    def hooked(self) -> list[str]:
        return list(self._tree.hooked)

    def __repr__(self) -> str:
        state = "removed" if self._removed or self._model() is None else "applied"
        return f"<PolicyHandle {state}: {len(self._tree.hooked)} module(s) hooked>"

    def idle(self) -> list[Rule]:
        """The rules that have not acted in the model's calls so far: no module that takes its level or conv math
        from the rule (itself or through its parent) ran its forward, and no matmul-family op used its parameters
        (a module kept but used functionally, or never called). Empty before the model's first call.

        Example:

            >>> import torch, tf32lab
            >>> class Net(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.a, self.unused = torch.nn.Linear(4, 4), torch.nn.ReLU()
            ...     def forward(self, x):
            ...         return self.a(x)
            >>> model = Net()
            >>> with tf32lab.Policy("high", [("a", "highest"), ("unused", "highest")]).applied(model) as handle:
            ...     _ = model(torch.randn(2, 4))
            ...     handle.idle()
            [Rule(pattern='unused', level='highest')]
        """
        model, tree = self._model(), self._tree
        if model is None or not tree.ran:
            return []
        acted = tree.ran | tree.reached
        modules = dict(model.named_modules())
        origin: dict[str, tuple[Optional[int], Optional[int]]] = {}  # the rules that gave a module's level, conv
        done: set[Optional[int]] = set()
        for a, parent in self.policy._assignments(model):
            above = origin.get(parent, (None, None)) if parent is not None else (None, None)
            origin[a.name] = tuple(int(source.split(" ", 2)[1]) if source.startswith("rule ") else inherited
                                   for source, inherited in zip((a.source, a.conv_source), above))
            if id(modules[a.name]) in acted:
                done.update(origin[a.name])
        return [rule for i, rule in enumerate(self.policy.rules, 1) if i not in done]

    def _current(self) -> _Tree:
        """The model's tree, matched again if it changed since (the caller is the outermost frame of this policy
        on its thread: nested modules trust it)."""
        tree = self._tree
        if not (self._stale or tree.changed()):
            return tree
        with _APPLIED_LOCK:
            model = self._model()
            if self._removed or model is None:
                return self._tree
            self._stale = False
            try:
                self._tree = self._match(model)
            except BaseException:
                self._stale = True  # told again at the next call, until the model is fixed or the policy removed
                raise
            return self._tree

    def _match(self, model: torch.nn.Module) -> _Tree:
        """Under the lock: match the policy to the model as it is now, wrap the modules that need it, unwrap the
        others, and register every module of the model as this policy's."""
        policy = self.policy
        assignments = policy._assignments(model)
        modules = dict(model.named_modules())
        tree = _Tree()
        tree.hooked = _hooked(assignments)
        hooked = set(tree.hooked)
        wanted: dict[int, torch.nn.Module] = {}
        on_collect = _collected(weakref.ref(self))
        for a, _ in assignments:
            module = modules[a.name]
            other = _owner(module, but=self)
            if other is not None:
                other_model = other._model()
                raise Tf32LabError(
                    f"module {a.name or type(model).__name__!r} of {type(model).__name__} is also in "
                    f"{type(other_model).__name__ if other_model is not None else 'another model'}, which has "
                    "another policy applied: one module takes one policy; remove that one first")
            ref = weakref.ref(module, on_collect)
            tree.members[id(module)] = (ref, a.level, a.conv)
            if isinstance(module, torch.jit.ScriptModule):  # its submodules are fixed by the compiler
                if a.name in hooked:
                    what = " and ".join(filter(None, (a.level and f"level {a.level!r}",
                                                      a.conv and f"conv math {a.conv!r}")))
                    inside = ", ".join(filter(None, (a.level and f"tf32lab.precision({a.level!r})",
                                                     a.conv and f"tf32lab.control.scope.conv_math({a.conv!r})")))
                    raise Tf32LabError(
                        f"module {a.name or type(model).__name__!r} is TorchScript, which takes no hooks, so a "
                        f"policy cannot give it {what}: apply the policy to the eager model, or call it inside "
                        f"{inside}")
                continue  # at its parent's level: runs inside its parent's scope (called directly: the caller's)
            tree.shape.append((ref, tuple(module._modules), tuple(map(id, module._modules.values()))))
            # the model itself always: its call checks for changes
            if a.level is not None or a.conv is not None or not a.name:
                wanted[id(module)] = module
        if len({(a.level, a.conv) for a, _ in assignments}) > 1:  # modules at different pins: whose weights
            for a, _ in assignments:
                module = modules[a.name]
                for p in module._parameters.values():
                    if p is not None:
                        known = tree.owners.get(id(p))
                        if known is None or (a.level is not None and known[1] is not None
                                             and _PRECISION[a.level] < _PRECISION[known[1]]):
                            tree.owners[id(p)] = (weakref.ref(p), a.level, a.conv, id(module))  # tied: accurate
        for key, (ref, pinned) in list(self._wrapped.items()):
            module = ref()
            if module is None or wanted.get(key) is not module or module.__dict__.get("forward") is not pinned:
                if module is not None:
                    _unwrap(module, pinned)
                del self._wrapped[key]
        for key, module in wanted.items():
            if key not in self._wrapped:
                self._wrapped[key] = (weakref.ref(module), _wrap(module, self))
        for ref in [entry[0] for entry in self._tree.members.values()] + self._pending:
            module = ref()
            if module is not None and id(module) not in tree.members and _APPLIED.get(module) is self:
                del _APPLIED[module]  # taken out (or put in and taken out again before this call)
        self._pending.clear()
        for module in modules.values():
            _APPLIED[module] = self
        return tree

    def _take_off(self) -> None:
        for ref, pinned in self._wrapped.values():
            module = ref()
            pinned.handle = None
            if module is not None:
                _unwrap(module, pinned)
        self._wrapped.clear()

    def remove(self) -> None:
        """Take the policy off the model (again: nothing happens)."""
        with _APPLIED_LOCK:
            self._removed = True
            self._take_off()
            for ref in [entry[0] for entry in self._tree.members.values()] + self._pending:
                module = ref()
                if module is not None and _APPLIED.get(module) is self:
                    del _APPLIED[module]
            self._pending.clear()

    def __enter__(self) -> PolicyHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
