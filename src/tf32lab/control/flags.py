"""Every precision-related PyTorch flag: read, snapshot, restore, without the legacy/new API trap.

PyTorch has two API generations for the same state (``aten/src/ATen/Context.cpp``). Since 2.9 it keeps one value
per (backend, op) cell (``generic``, ``cuda``, ``mkldnn`` × ``all``, ``matmul``, ``conv``, ``rnn``); a cell may hold
``"none"`` and inherit op -> backend -> generic, and its getter returns the *inherited* value. The legacy getters
(``get_float32_matmul_precision``, ``allow_tf32``) raise "mix of the legacy and new APIs" once the cells disagree,
so this module never calls them where the cells exist. Before 2.9 the legacy calls are the only ones and never raise.

``snapshot()`` records each cell's *raw* value (``"none"`` or explicit, told apart by a short probe of its
parent), so ``restore()`` brings back inheritance exactly, not just today's effective values.

Example:

    >>> import torch
    >>> from tf32lab import flags
    >>> before = flags.snapshot()
    >>> torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    >>> torch.set_float32_matmul_precision("medium")
    >>> sorted(name for name, _, _ in before.diff(flags.snapshot()))[:2]   # then, from torch 2.9, the cells too
    ['cuda.matmul.allow_fp16_reduced_precision_reduction', 'float32_matmul_precision']
    >>> flags.restore(before)
    >>> flags.snapshot() == before
    True
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import LEVELS, TORCH_LEVEL, level_cells, level_of

__all__ = ["NEW_API", "Snapshot", "read_level", "restore", "snapshot"]

_C: Any = torch._C
# The per-backend API (PyTorch >= 2.9).
NEW_API: bool = hasattr(_C, "_get_fp32_precision_getter") and hasattr(_C, "_set_fp32_precision_setter")

_BACKENDS = ("cuda", "mkldnn")
_OPS = ("matmul", "conv", "rnn")
# Cells only some torch builds have: XPU's (intel/torch-xpu-ops#4919) and the math SDPA backend's (ROCm's fork,
# upstream PRs). They are read, snapshotted and restored where the getter knows them, and skipped elsewhere.
_LATER_BACKENDS = ("xpu",)
_LATER_OPS = ("math_sdp",)


def _probe_cells() -> tuple[tuple[str, str], ...]:
    if not NEW_API:
        return ()
    cells = [("generic", "all")]
    for backend in (*_BACKENDS, *_LATER_BACKENDS):
        for op in ("all", *_OPS, *_LATER_OPS):
            try:
                _C._get_fp32_precision_getter(backend, op)
            except (RuntimeError, ValueError):
                continue  # this torch lacks the cell
            cells.append((backend, op))
    return tuple(cells)


_CELLS = _probe_cells()


def _get(cell: tuple[str, str]) -> str:
    return _C._get_fp32_precision_getter(*cell)


def _set(cell: tuple[str, str], value: str) -> None:
    _C._set_fp32_precision_setter(*cell, value)


def _parent(cell: tuple[str, str]) -> tuple[str, str]:
    return ("generic", "all") if cell[1] == "all" else (cell[0], "all")


def _raw(cell: tuple[str, str], raw_of_parents: dict[tuple[str, str], str]) -> str:
    """The stored value of a cell: its getter's value, or ``"none"`` if that value is inherited.

    When the cell shows the same value as its parent it may be either; flipping the parent for a moment and
    watching whether the cell follows tells them apart. The parent is put back to its raw value at once.
    """
    value = _get(cell)
    if cell == ("generic", "all"):
        return value
    parent = _parent(cell)
    if value != _get(parent):
        return value
    other = "tf32" if value == "ieee" else "ieee"
    try:
        _set(parent, other)
        follows = _get(cell) == other
    except RuntimeError:  # a parent that takes neither value (a backend of a newer torch): say what it shows
        return value
    finally:
        _set(parent, raw_of_parents[parent])
    return "none" if follows else value


def _read_raw_cells(cells: tuple[tuple[str, str], ...] = _CELLS) -> dict[tuple[str, str], str]:
    raw: dict[tuple[str, str], str] = {}
    # Parents first: a probe restores the parent from its raw value.
    for cell in sorted(cells, key=lambda c: (c != ("generic", "all"), c[1] != "all")):
        raw[cell] = _raw(cell, raw)
    return raw


@dataclass(frozen=True)
class _Flag:
    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]


def _tuple_flag(name: str, getter: str, setter: str) -> _Flag | None:
    if not (hasattr(_C, getter) and hasattr(_C, setter)):
        return None
    get, put = getattr(_C, getter), getattr(_C, setter)

    # Newer torch returns (allow_reduced_precision, allow_splitk) and takes both; older ones a bool.
    def set_(value: Any) -> None:
        put(*value) if isinstance(value, tuple) else put(value)

    return _Flag(name, get, set_)


def _plain_flag(name: str, getter: str, setter: str) -> _Flag | None:
    if not (hasattr(_C, getter) and hasattr(_C, setter)):
        return None
    return _Flag(name, getattr(_C, getter), getattr(_C, setter))


def _other_flags() -> tuple[_Flag, ...]:
    found = [
        _tuple_flag("cuda.matmul.allow_fp16_reduced_precision_reduction",
                    "_get_cublas_allow_fp16_reduced_precision_reduction",
                    "_set_cublas_allow_fp16_reduced_precision_reduction"),
        _tuple_flag("cuda.matmul.allow_bf16_reduced_precision_reduction",
                    "_get_cublas_allow_bf16_reduced_precision_reduction",
                    "_set_cublas_allow_bf16_reduced_precision_reduction"),
        _plain_flag("cuda.matmul.allow_fp16_accumulation",
                    "_get_cublas_allow_fp16_accumulation", "_set_cublas_allow_fp16_accumulation"),
        _plain_flag("cpu.allow_fp16_reduced_precision_reduction",
                    "_get_cpu_allow_fp16_reduced_precision_reduction",
                    "_set_cpu_allow_fp16_reduced_precision_reduction"),
        # off, a GPU computes convolutions and RNNs at the matmul flag's math (know.targets.CUDNN_CELL)
        _plain_flag("cudnn.enabled", "_get_cudnn_enabled", "_set_cudnn_enabled"),
    ]
    if not NEW_API:  # on the new API these are views of the cells above; reading them there can raise
        found += [
            _plain_flag("float32_matmul_precision", "_get_float32_matmul_precision", "_set_float32_matmul_precision"),
            _plain_flag("cudnn.allow_tf32", "_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
            _plain_flag("mkldnn.allow_tf32", "_get_onednn_allow_tf32", "_set_onednn_allow_tf32"),
        ]
    # A reader that answers None cannot be snapshotted (oneDNN's allow_tf32 on a build without Intel GPU support,
    # torch 2.8 and 2.13): its setter refuses None, so such a flag is not one this torch lets anyone read back.
    return tuple(f for f in found if f is not None and f.get() is not None)


_FLAGS = _other_flags()


# PyTorch >= 2.9 still keeps the legacy values as values of their own, beside the cells: only the legacy setters
# write them, and the legacy getters answer from them (or raise when the cells contradict them). Writing the cells
# alone leaves them stale, so they are part of every snapshot (the level also of the state a scope gives back).
# name -> (getter, setter, probes): each probe is a cell state under which the getter answers from its stored value
# (or raises, when that state contradicts it); the cells are put back right after.
_LEGACY_LEVEL = "float32_matmul_precision"
_MATMUL_PROBE = (("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("mkldnn", "all"), ("mkldnn", "matmul"))
_CUDNN_PROBE = (("generic", "all"), ("cuda", "all"), ("cuda", "conv"), ("cuda", "rnn"))
_STORED: dict[str, tuple[str, str, tuple[dict[tuple[str, str], str], ...]]] = {
    _LEGACY_LEVEL: ("_get_float32_matmul_precision", "_set_float32_matmul_precision",
                    ({cell: "none" for cell in _MATMUL_PROBE},)),
    "cudnn.allow_tf32": ("_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32", tuple(
        {**{cell: "none" for cell in _CUDNN_PROBE[:2]}, **{cell: value for cell in _CUDNN_PROBE[2:]}}
        for value in ("tf32", "ieee"))),
} if NEW_API else {}
_STORED = {name: (get, put, tuple({c: v for c, v in probe.items() if c in _CELLS} for probe in probes))
           for name, (get, put, probes) in _STORED.items() if hasattr(_C, get) and hasattr(_C, put)}


def _read_stored(name: str) -> Any:
    """A stored legacy value (see above) without raising: its getter, else its getter under each probe state."""
    getter, _, probes = _STORED[name]
    get = getattr(_C, getter)
    try:
        return get()
    except RuntimeError:
        pass
    raw = _read_raw_cells()
    for probe in probes:
        try:
            for cell, value in probe.items():
                _set(cell, value)
            return get()
        except RuntimeError:
            continue
        finally:
            for cell in probe:
                _set(cell, raw[cell])
    raise RuntimeError(f"cannot read PyTorch's stored {name}: every probe state contradicts it")


def read_legacy_level() -> str:
    """The legacy level PyTorch keeps (what ``torch.get_float32_matmul_precision()`` answers), without raising."""
    return _read_stored(_LEGACY_LEVEL) if _LEGACY_LEVEL in _STORED else _C._get_float32_matmul_precision()


@dataclass(frozen=True)
class Snapshot:
    """Every precision-related flag of this torch, by name; equal snapshots mean identical state.

    ``fp32_precision.<backend>.<op>`` entries hold raw values (``"none"`` where the cell inherits).
    """

    values: tuple[tuple[str, Any], ...]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.values)

    def __getitem__(self, name: str) -> Any:
        for key, value in self.values:
            if key == name:
                return value
        raise KeyError(f"no flag {name!r} in this snapshot; flags: {', '.join(k for k, _ in self.values)}")

    def diff(self, other: Snapshot) -> list[tuple[str, Any, Any]]:
        """``(name, value here, value in other)`` for every flag that differs."""
        theirs = dict(other.values)
        return [(k, v, theirs.get(k)) for k, v in self.values if theirs.get(k) != v]

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.values)
        return f"Snapshot({inner})"


def snapshot() -> Snapshot:
    """Read every precision-related flag this torch has, without provoking the mixed-API error."""
    values: list[tuple[str, Any]] = [
        (f"fp32_precision.{b}.{o}", v) for (b, o), v in _read_raw_cells().items()
    ]
    values += [(name, _read_stored(name)) for name in _STORED]
    values += [(f.name, f.get()) for f in _FLAGS]
    return Snapshot(tuple(sorted(values)))


def restore(snap: Snapshot) -> None:
    """Put every flag back as it was in ``snap`` (from :func:`snapshot` of this same process)."""
    if not isinstance(snap, Snapshot):
        raise TypeError(f"restore takes a flags.Snapshot, got {type(snap).__name__}")
    values = dict(snap.values)
    for name, (_, setter, _) in _STORED.items():  # first: the legacy setters also write cells
        if name in values:
            getattr(_C, setter)(values[name])
    for cell in _CELLS:
        key = f"fp32_precision.{cell[0]}.{cell[1]}"
        if key in values:
            _set(cell, values[key])
    for flag in _FLAGS:
        if flag.name in values:
            flag.set(values[flag.name])


# The cells a precision level is written to. ------------------------------------------------------------
LEVEL_CELLS = tuple(c for c in (("cuda", "matmul"), ("mkldnn", "matmul")) if c in _CELLS)


# Write an already validated level where PyTorch's matmul backends read it. PyTorch's own setter writes explicit
# values into exactly the level cells (levels.level_cells, checked by tests/test_flags.py) in one call, and never raises
# for a mix of APIs (only its getter does). Scopes call it on every entry and exit, directly for PyTorch's own levels.
write_torch_level: Callable[[str], None] = _C._set_float32_matmul_precision


def write_level(level: str) -> None:
    """Write a validated level: PyTorch's setter; for an extra level (``bfx9``) the setter at its ``TORCH_LEVEL``,
    then its cell values over it. An extra level must have passed :func:`native_refusal` first."""
    if level in LEVELS:
        write_torch_level(level)
        return
    refused = native_refusal(level)
    if refused is not None:  # before anything is written (a scope left open after its emulate() block ended)
        raise Tf32LabError(f"precision({level!r}) outside emulate(): {refused}")
    write_torch_level(TORCH_LEVEL[level])
    for name, value in level_cells(level).items():
        _set(tuple(name.split(".")), value)


_REFUSALS: dict[str, Optional[str]] = {}


def native_refusal(level: str) -> Optional[str]:
    """None when this torch can set ``level`` natively; else one line saying why not (the torch version named).

    PyTorch's own levels always can. For ``bfx9`` the cell's setter is asked once per process: a torch without
    pytorch#195301 raises "Unknown precision" and writes nothing; one that takes it gets its previous raw values
    back at once. Emulating a level (``emulate()``) never needs this.

    >>> native_refusal("high") is None
    True
    """
    if level in LEVELS:
        return None
    if level not in _REFUSALS:
        version = torch.__version__
        if not NEW_API:
            _REFUSALS[level] = (f"torch {version} has no per-backend precision cells, so the level {level!r} "
                                f"(cuda.matmul = {level_cells(level)['cuda.matmul']!r}) cannot be set natively")
        else:
            raw = read_level_state()[1]
            try:
                _set(("cuda", "matmul"), level_cells(level)["cuda.matmul"])
            except RuntimeError as exc:
                _REFUSALS[level] = (f"torch {version} cannot set cuda.matmul to {level!r} natively "
                                    f"({str(exc).splitlines()[0]}; it needs a torch with pytorch#195301)")
            else:
                write_level_raw(raw)
                _REFUSALS[level] = None
    return _REFUSALS[level]


def read_level_state() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(effective, raw)`` values of the cells a level is written to: what a scope must give back.

    On the per-backend API ``raw`` ends with PyTorch's stored legacy level (see :func:`read_legacy_level`).
    """
    if not NEW_API:
        value = (_C._get_float32_matmul_precision(),)
        return value, value
    raw = _read_raw_cells(tuple(c for c in _CELLS if c[1] == "all" or c in LEVEL_CELLS))
    return (tuple(_get(c) for c in LEVEL_CELLS),
            (*(raw[c] for c in LEVEL_CELLS), read_legacy_level()))


def _cell_functions() -> tuple[tuple[Callable[[], str], ...], tuple[Callable[[str], None], ...]]:
    # C-level partials, one getter and one setter per level cell: scopes call them on every entry and exit.
    if not NEW_API:
        return (_C._get_float32_matmul_precision,), (_C._set_float32_matmul_precision,)
    get, put = _C._get_fp32_precision_getter, _C._set_fp32_precision_setter
    return (tuple(functools.partial(get, b, o) for b, o in LEVEL_CELLS),
            tuple(functools.partial(put, b, o) for b, o in LEVEL_CELLS))


LEVEL_GETTERS, LEVEL_SETTERS = _cell_functions()


if len(LEVEL_GETTERS) == 2:
    _get_first, _get_second = LEVEL_GETTERS

    def read_level_effective() -> tuple[str, ...]:
        """Effective values of the level cells: cheap, for telling whether anyone changed them."""
        return (_get_first(), _get_second())
else:

    def read_level_effective() -> tuple[str, ...]:
        """Effective values of the level cells: cheap, for telling whether anyone changed them."""
        return tuple(get() for get in LEVEL_GETTERS)


if NEW_API and len(LEVEL_SETTERS) == 2:
    _set_first, _set_second = LEVEL_SETTERS

    def write_level_raw(raw: tuple[str, ...]) -> None:
        """Put back raw values of the level cells, from :func:`read_level_state`."""
        write_level(raw[2])  # the stored legacy level first: its setter writes the two cells too
        _set_first(raw[0])
        _set_second(raw[1])
else:

    def write_level_raw(raw: tuple[str, ...]) -> None:
        """Put back raw values of the level cells, from :func:`read_level_state`."""
        if len(raw) > len(LEVEL_SETTERS):  # the stored legacy level first: its setter writes two cells too
            write_level(raw[-1])
        for put, value in zip(LEVEL_SETTERS, raw):
            put(value)


def effective_from_raw(raw: tuple[str, ...]) -> tuple[str, ...]:
    """The effective values that raw level-cell values (from :func:`read_level_state`) give, without writing:
    a ``"none"`` cell takes its parent's value now."""
    if not NEW_API:
        return tuple(raw[:1])
    return tuple(_get(_parent(c)) if value == "none" else value for c, value in zip(LEVEL_CELLS, raw))


_CONV_CELLS = tuple(c for c in (("cuda", "conv"), ("cuda", "rnn")) if c in _CELLS)


def read_conv_state() -> tuple[Any, ...]:
    """What :func:`write_conv` changes, to give back: the raw cuDNN conv and RNN cells and PyTorch's stored
    ``cudnn.allow_tf32`` (per-backend API), or the legacy boolean (before torch 2.9)."""
    if not NEW_API:
        return (_C._get_cudnn_allow_tf32(),)
    raw = _read_raw_cells(tuple(c for c in _CELLS if c[1] == "all" or c in _CONV_CELLS))
    stored = _read_stored("cudnn.allow_tf32") if "cudnn.allow_tf32" in _STORED else None
    return (stored, *(raw[c] for c in _CONV_CELLS))


def write_conv_state(state: tuple[Any, ...]) -> None:
    """Put back a state from :func:`read_conv_state`: the stored boolean first (its setter writes both cells)."""
    if not NEW_API:
        _C._set_cudnn_allow_tf32(state[0])
        return
    if state[0] is not None:
        _C._set_cudnn_allow_tf32(state[0])
    for cell, value in zip(_CONV_CELLS, state[1:]):
        _set(cell, value)


def write_conv(conv: str) -> None:
    """cuDNN's float32 math, ``"tf32"`` or ``"ieee"`` (validated), through PyTorch's own ``cudnn.allow_tf32`` setter
    on every torch: it covers cuDNN's RNNs too and keeps the stored boolean and the per-backend cells in step, so
    that a model reading ``torch.backends.cudnn.allow_tf32`` meanwhile does not meet PyTorch's "different TF32
    flags" error (as it does after writing the ``cuda.conv`` cell alone)."""
    _C._set_cudnn_allow_tf32(conv == "tf32")


def level_values(level: str) -> tuple[str, ...]:
    """What :func:`read_level_effective` reads right after ``write_level(level)``."""
    cells = level_cells(level)
    return tuple(cells[f"{backend}.{op}"] for backend, op in LEVEL_CELLS) if NEW_API else (level,)


def level_raw(level: str) -> tuple[str, ...]:
    """What :func:`read_level_state` gives as raw values right after ``write_level(level)``."""
    return (*level_values(level), TORCH_LEVEL[level]) if NEW_API else (level,)


def level_from_effective(effective: tuple[str, ...]) -> str:
    """The level that :func:`read_level_effective` values amount to."""
    if not NEW_API:
        return effective[0]
    values = dict(zip(LEVEL_CELLS, effective))
    return level_of(values.get(("cuda", "matmul"), "ieee"), values.get(("mkldnn", "matmul"), "ieee"))


def read_level() -> str:
    """The level in force process-wide, from effective values (never raises for mixed APIs)."""
    return level_from_effective(read_level_effective())


# Effective values per (backend, op), for the emulator and doctor. --------------------------------------------
# cuda.* and mkldnn.* on every torch (from the legacy flags before 2.9), then the later cells this torch has.
CELL_NAMES = (*(f"{backend}.{op}" for backend in _BACKENDS for op in _OPS),
              *(f"{b}.{o}" for b, o in _CELLS if o != "all" and (b in _LATER_BACKENDS or o in _LATER_OPS)))


def _legacy_cells() -> dict[str, str]:
    # PyTorch < 2.9: one boolean per cuBLAS / cuDNN, and the level string for oneDNN.
    matmul = "tf32" if _C._get_cublas_allow_tf32() else "ieee"
    cudnn = "tf32" if _C._get_cudnn_allow_tf32() else "ieee"
    level = _C._get_float32_matmul_precision()
    mkldnn = {"highest": "ieee", "high": "tf32", "medium": "bf16"}.get(level, "ieee")
    return {"cuda.matmul": matmul, "cuda.conv": cudnn, "cuda.rnn": cudnn,
            "mkldnn.matmul": mkldnn, "mkldnn.conv": "ieee", "mkldnn.rnn": "ieee"}


def read_cells() -> dict[str, str]:
    """Effective value of every ``backend.op`` cell (``"ieee"``, ``"tf32"``, ``"bf16"``, ``"bfx9"``, or whatever
    a newer torch stores, passed through as it is), on any torch >= 2.4.

    Values are what the backend obeys now, inheritance resolved; nothing is written.

    Example:

        >>> from tf32lab import flags
        >>> cells = flags.read_cells()
        >>> cells["cuda.conv"], cells["cuda.matmul"]     # PyTorch's defaults: convs TF32, matmuls IEEE
        ('tf32', 'ieee')
    """
    if not NEW_API:
        return _legacy_cells()
    out = {}
    for name in CELL_NAMES:
        backend, op = name.split(".")
        value = _get((backend, op)) if (backend, op) in _CELLS else "ieee"
        out[name] = "ieee" if value == "none" else value
    return out


def read_cell(name: str) -> str:
    """Effective value of one ``backend.op`` cell (one of :data:`CELL_NAMES`), as :func:`read_cells` gives it:
    for a reader that needs one cell per op and cannot afford them all.

    >>> read_cell("cuda.conv") == read_cells()["cuda.conv"]
    True
    """
    if not NEW_API:
        return _legacy_cells()[name]
    cell = _CELL_OF[name]
    value = _get(cell) if cell in _CELLS else "ieee"
    return "ieee" if value == "none" else value


_CELL_OF = {name: tuple(name.split(".")) for name in CELL_NAMES}


def read_cell_table(snap: Snapshot | None = None) -> list[tuple[str, str, str]]:
    """``(cell, raw, effective)`` for every per-backend cell this torch has (none before 2.9), parents first.

    ``raw`` is ``"none"`` where the cell inherits (from ``snap`` when given: telling it takes a probe);
    ``effective`` is what its getter returns.
    """
    if not NEW_API:
        return []
    raw = _read_raw_cells() if snap is None else {c: snap[f"fp32_precision.{c[0]}.{c[1]}"] for c in _CELLS}
    order = sorted(raw, key=lambda c: (c != ("generic", "all"), c[1] != "all"))
    return [(f"{b}.{o}", raw[(b, o)], _get((b, o))) for b, o in order]


# The legacy readers, by the name users write; each raises "mix of the legacy and new APIs" when the per-backend
# cells disagree with what it can express (pytorch#179445).
LEGACY_READERS: tuple[tuple[str, Callable[[], Any]], ...] = tuple(
    (name, getattr(_C, getter)) for name, getter in (
        ("torch.get_float32_matmul_precision()", "_get_float32_matmul_precision"),
        ("torch.backends.cuda.matmul.allow_tf32", "_get_cublas_allow_tf32"),
        ("torch.backends.cudnn.allow_tf32", "_get_cudnn_allow_tf32"),
    ) if hasattr(_C, getter)
)

