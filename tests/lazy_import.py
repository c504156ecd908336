"""A module named where a test file is collected and imported where a test first reads one of its attributes.

Every pytest-xdist worker imports every test module to collect it, and a test module that imports PyTorch Lightning
(lightning_fabric, torch._dynamo, torchmetrics, scipy.signal: about 3 CPU seconds) made each worker pay for it,
though the tests that use it run on one worker (their ``xdist_group``). ``L = lazy("pytorch_lightning")`` costs
nothing until ``L.Trainer`` is read in a test. Unlike ``importlib.util.LazyLoader``, nothing is put in
``sys.modules`` before the import: code that asks whether a package is imported gets the truth."""

from __future__ import annotations

import importlib
from typing import Any


class Lazy:
    """The module ``name``, imported at the first read of a public attribute (then as cheap as a lookup in
    ``sys.modules``)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        # pytest's collection asks every object of a test module for its dunders and markers (``__test__``,
        # ``_fixture_function_marker``...): those are no reason to import, and a test reads none of them
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy(name: str) -> Lazy:
    return Lazy(name)
