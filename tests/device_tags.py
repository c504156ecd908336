"""A second device, simulated on the CPU, for code that only a GPU would break.

The model's parameters, buffers and inputs are tagged *device*; a tensor a factory makes without ``device=``
(``torch.zeros``, ``torch.tensor``, ...) or a ``.cpu()`` copy is tagged *host*; results inherit their operands' tag.
An op that combines a device tensor with a host tensor of more than 0 dims is what raises "Expected all tensors to
be on the same device" on a GPU: it is recorded with the tf32lab line that made it (:attr:`DeviceTags.mixed`).
``.numpy()`` of a device tensor would raise there too, but tf32lab's numpy paths (numba's kernels) are taken only
for tensors that are on the CPU (``is_cpu``), which the simulated device cannot show: not recorded. On an H200,
every ``check`` of a model on the GPU raised so at its first output (an error histogram kept on the CPU), which no
test on a CPU could see.

It is a function mode: tf32lab's own arithmetic under ``torch._C.DisableTorchFunction`` (``measure.norms.bare``)
goes unseen, and ``.to(device)``/``copy_`` are where a value may cross, by design.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = frozenset({torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange,
                        torch.linspace, torch.eye, torch.randn, torch.rand, torch.randint, torch.as_tensor,
                        torch.from_numpy, torch.randperm})
_CROSSING = frozenset({"copy_", "to", "__getitem__", "cpu", "__get__", "__set__", "equal", "numel", "size", "dim"})
DEVICE, HOST = "device", "host"


def _tensors(tree: Any, found: list) -> list:
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _tensors(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tensors(item, found)
    return found


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/tf32lab/" in frame.filename:
            return f"{frame.filename.split('/src/')[-1]}:{frame.lineno}"
    return "?"


class DeviceTags(TorchFunctionMode):
    """The tags and the mixed ops seen while the mode is on (``mixed``: op name -> tf32lab lines)."""

    def __init__(self, *trees: Any) -> None:
        super().__init__()
        self._tags: dict[int, tuple[Any, str]] = {}
        self.mixed: dict[str, set[str]] = {}
        for tree in trees:
            tensors = [*tree.parameters(), *tree.buffers()] if isinstance(tree, torch.nn.Module) else \
                _tensors(tree, [])
            for t in tensors:
                self._tag(t, DEVICE)

    def _tag(self, t: torch.Tensor, value: str) -> None:
        with contextlib.suppress(TypeError):  # a tensor that takes no weak reference: untagged
            self._tags[id(t)] = (weakref.ref(t), value)

    def _of(self, t: torch.Tensor) -> Any:
        entry = self._tags.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        operands = _tensors(args, []) + _tensors(kwargs, [])
        on_device = any(self._of(t) == DEVICE for t in operands)
        on_host = any(self._of(t) == HOST and t.dim() > 0 for t in operands)
        if on_device and on_host and name not in _CROSSING:
            self.mixed.setdefault(name, set()).add(_site())
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            if kwargs.get("device") is None and not (func in (torch.as_tensor, torch.tensor) and operands):
                for t in _tensors(out, []):
                    self._tag(t, HOST)
            return out
        if name == "cpu":
            for t in _tensors(out, []):
                self._tag(t, HOST)
            return out
        if name == "to" and (any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs):
            return out
        tag = DEVICE if on_device else HOST if on_host else None
        if tag is not None:
            for t in _tensors(out, []):
                fresh = all(t is not u for u in operands) or name.endswith("_")
                if fresh and (self._of(t) is None or tag == DEVICE):
                    self._tag(t, tag)
        return out
