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
docs/design.md ("policy") says what it costs and what it does not cover. This module holds the policy as data
(rules, matching, files); how it is applied lives in :mod:`tf32lab.control.pinning`, and which rule patterns
shadow which in :mod:`tf32lab.control.patterns`.

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
import json
import re
import reprlib
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import torch

from tf32lab.control.patterns import shadowing
from tf32lab.control.pinning import (
    PolicyHandle,
    _unwrapped,  # noqa: F401 (pickles of a pinned forward name it here)
    applied_policies,
    applied_to,
    hooked_names,
)
from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import ALL_LEVELS, CONV_MATHS, check_conv, check_level
from tf32lab.numbers.files import write_atomically, write_json
from tf32lab.numbers.naming import module_kind

__all__ = ["Assignment", "Policy", "PolicyHandle", "Rule", "applied_policies", "applied_to", "exact_pattern", "explain"]

SCHEMA_VERSION = 2  # 2: a conv math per rule and for the model (``conv``); a policy without one is written as 1
SCHEMA_VERSIONS = (1, 2)  # what load() reads
_KEYS = ("schema_version", "default", "conv", "rules")
_RULE_KEYS = ("pattern", "level", "conv")
_NEEDS_2 = "'conv' needs schema_version 2 (version 1 has levels only); write schema_version 2"


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
        shadowed = shadowing([rule.pattern for rule in rules])
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
        return hooked_names(self._assignments(model))

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
                f"{module_kind(model)} (its modules: {', '.join(names) or 'none but itself'}"
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
        if isinstance(path, str) and not path.strip():  # Path("") is the working folder: name what was given
            raise Tf32LabError(f"policy file {path!r}: no path given; accepted: a JSON or TOML file")
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
                data = json.loads(text, object_pairs_hook=_no_duplicates)
            except _Duplicate as exc:
                raise Tf32LabError(f"{where}: {exc}") from None
            except (ValueError, UnicodeDecodeError) as exc:
                raise Tf32LabError(f"{where}: not JSON: {exc}") from None
            except RecursionError:
                raise Tf32LabError(f"{where}: not a policy: arrays or objects nested too deeply to read") from None
        return cls.from_dict(data, where)


class _Duplicate(Exception):
    """A key written twice in one JSON object of a policy file."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: Python's reader keeps the last of two equal keys without a
    word, so a file edited by hand to ``"default": "highest"`` above an old ``"default": "high"`` ran at ``high``.
    TOML refuses such a file itself."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _Duplicate(f"the key {key!r} appears twice in one object; keep one (JSON readers take the last "
                             "silently)")
        found[key] = value
    return found


def explain(policy: Policy, model: torch.nn.Module) -> list[Assignment]:
    """The level each module of ``model`` gets from ``policy``, and why (see :meth:`Policy.explain`).

    >>> import torch, tf32lab
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> [(a.name, a.level, a.source) for a in tf32lab.explain(tf32lab.Policy("high", [("1", "highest")]), model)]
    [('', 'high', 'default'), ('0', 'high', 'inherited from the model'), ('1', 'highest', "rule 1 '1'")]"""
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
