"""What a module is called in a message or a report: its class's name, and a TorchScript module's the class it was
scripted from. One rule, low enough that control's refusals and a workload's name both read it.

Example:

    >>> import torch
    >>> from tf32lab.numbers.naming import module_kind
    >>> module_kind(torch.nn.Linear(4, 2)), module_kind(torch.jit.script(torch.nn.Linear(4, 2)))
    ('Linear', 'Linear')
"""

from __future__ import annotations

import torch

__all__ = ["module_kind"]


def module_kind(module: torch.nn.Module) -> str:
    """The module's class name; a TorchScript module's, the class it was scripted from (every scripted module is a
    ``RecursiveScriptModule``, which names none). A workload given no name is called this."""
    return getattr(module, "original_name", None) or type(module).__name__ \
        if isinstance(module, torch.jit.ScriptModule) else type(module).__name__
