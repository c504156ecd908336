"""Ranks of a ``torch.distributed`` job: which one this process is, and whether all of them run at one precision.

Under ``torchrun`` every rank is its own process with its own PyTorch flags. A library that sets
``torch.set_float32_matmul_precision("high")`` on some ranks only (in a constructor that runs where a condition
holds, or in an import order that differs) gives ranks that compute the same model differently, and nothing in
the job says so. :func:`agree` compares, with one collective (``all_gather_object``), what every rank runs at:

- every backend cell's effective value (``flags.read_cells()``: ``cuda.matmul``, ``mkldnn.conv``, ...) and the
  level in force in the caller's scope;
- the policies applied (to ``model`` when given, else any in the process), as a digest of their JSON form;
- the tf32lab and torch versions.

A difference is one ``Tf32LabError`` line, the same on every rank, naming the ranks and the settings. The
collective obeys the process group's timeout (``init_process_group(timeout=...)``): a rank that never arrives
ends it there with an error, not a hang.

Example (one process, a group of one; under ``torchrun`` the same call compares every rank):

    >>> import torch.distributed as dist
    >>> from tf32lab.machine import distributed
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> distributed.agree().ranks
    1
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Optional

import torch

from tf32lab.control import flags
from tf32lab.control.policy import Policy, applied_policies, applied_to
from tf32lab.control.scope import get_float32_matmul_precision
from tf32lab.errors import Tf32LabError
from tf32lab.know.targets import CUDNN_CELL, cudnn_cell

__all__ = ["Agreement", "RankState", "agree", "initialized", "policy_digest", "rank_of", "rank_prefix"]


def initialized() -> bool:
    """Whether this process is in an initialised default process group."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def rank_of(env: Optional[dict[str, str]] = None) -> tuple[Optional[int], int]:
    """``(rank, world size)`` of this process: from the initialised process group, else from torchrun's ``RANK``
    and ``WORLD_SIZE`` (``env``; default the process's environment); ``(None, 1)`` outside a distributed job."""
    if env is None and initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    env = os.environ if env is None else env
    try:
        rank, world = int(env.get("RANK", "")), int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return None, 1
    return (rank, world) if world > 1 and 0 <= rank < world else (None, 1)


def rank_prefix() -> str:
    """``"rank 3/8: "`` in a job of several ranks, else ``""``: for messages that every rank prints."""
    rank, world = rank_of()
    return "" if rank is None else f"rank {rank}/{world}: "


def _digest(policies: list[Policy]) -> str:
    text = json.dumps(sorted(json.dumps(p.to_dict(), sort_keys=True) for p in policies))
    return hashlib.sha256(text.encode()).hexdigest()[:12] if policies else "none"


@dataclasses.dataclass(frozen=True)
class RankState:
    """What one rank runs at: the settings :func:`agree` compares (``rank`` is not compared)."""

    rank: int
    cells: dict[str, str]
    level: str
    policy: str  # digest of the applied policies' JSON, or "none"
    tf32lab: str
    torch: str
    also: dict[str, str] = dataclasses.field(default_factory=dict)  # the caller's own settings (a check's arguments)

    @classmethod
    def here(cls, rank: int, model: Optional[torch.nn.Module] = None,
             also: Optional[dict[str, str]] = None) -> RankState:
        if model is not None:
            found = applied_to(model)
            policies = [] if found is None else [found]
        else:
            policies = applied_policies()
        from tf32lab import __version__  # the package's face holds the version; a string, no import of layers
        # cuDNN on or off sets a GPU's convolution and RNN math as the cells do (know.targets.CUDNN_CELL)
        cells = {**flags.read_cells(), CUDNN_CELL: cudnn_cell()}
        return cls(rank, cells, get_float32_matmul_precision(), _digest(policies), __version__,
                   torch.__version__, {str(k): str(v) for k, v in (also or {}).items()})

    def settings(self) -> dict[str, str]:
        """Every compared setting by name, one flat dict."""
        return {**{f"cell {k}": v for k, v in self.cells.items()}, "level": self.level, "policy": self.policy,
                "tf32lab": self.tf32lab, "torch": self.torch, **self.also}


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What every rank agreed on: one rank's :class:`RankState` (the settings) and the number of ranks."""

    state: RankState
    ranks: int


def _ranges(ranks: list[int]) -> str:
    return ",".join(map(str, sorted(ranks)))


def disagreement(states: list[RankState]) -> Optional[str]:
    """The one line that says which ranks differ in which settings, or None when they all agree."""
    by_setting: dict[str, dict[str, list[int]]] = {}
    for state in states:
        for name, value in state.settings().items():
            by_setting.setdefault(name, {}).setdefault(value, []).append(state.rank)
    names = sorted({name for s in states for name in s.settings()})
    parts = []
    for name in names:
        values = by_setting.get(name, {})
        missing = [s.rank for s in states if name not in s.settings()]
        if len(values) + bool(missing) <= 1:
            continue
        groups = sorted(values.items(), key=lambda kv: min(kv[1]))
        said = "; ".join(f"ranks {_ranges(r)} {v!r}" if len(r) > 1 else f"rank {r[0]} {v!r}" for v, r in groups)
        if missing:
            said += f"; ranks {_ranges(missing)} none"
        parts.append(f"{name}: {said}")
    if not parts:
        return None
    return f"ranks disagree on precision ({len(states)} ranks): " + " | ".join(parts)


def policy_digest(policy: Optional[Policy]) -> str:
    """A short digest of ``policy``'s JSON form ("none" for None): what ranks compare."""
    return _digest([] if policy is None else [policy])


def agree(group: Any = None, *, model: Optional[torch.nn.Module] = None,
          also: Optional[dict[str, str]] = None) -> Agreement:
    """Check that every rank of ``group`` (default: the whole job) runs at the same precision; call it on every
    rank (it is a collective).

    Compares each rank's effective backend cells, level, applied policies (to ``model`` when given) and tf32lab
    and torch versions with one ``all_gather_object``; ``also``: more settings by name, compared as text (the
    sharded check's levels, target and tolerance). Returns the :class:`Agreement`; raises ``Tf32LabError``
    on every rank, with the same line, when they differ, and when no process group is initialised; on a rank
    outside ``group``. A rank that
    does not arrive ends the call at the group's timeout (PyTorch raises there).

    Example:

        >>> import torch.distributed as dist
        >>> from tf32lab.machine.distributed import agree
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> agree().state.level
        'highest'
        >>> dist.destroy_process_group()
    """
    if not initialized():
        raise Tf32LabError("agree() needs an initialised torch.distributed process group (run under torchrun and "
                           "call torch.distributed.init_process_group first)")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise Tf32LabError(f"agree(model=...) takes a torch.nn.Module, not {type(model).__name__}")
    dist = torch.distributed
    if also is not None and not isinstance(also, dict):
        raise Tf32LabError(f"agree(also=...) takes a dict of setting names to values, not {type(also).__name__}")
    if group is not None and dist.get_rank(group) < 0:
        # PyTorch's collectives return at once on a rank outside their group: an agreement of no ranks
        raise Tf32LabError(f"agree(group=...) was called on rank {dist.get_rank()}, which is not a member of that "
                           f"group: call it on the group's ranks only (or with group=None, the whole job)")
    mine = RankState.here(dist.get_rank(), model, also)  # the job's rank, as torchrun names it
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, mine, group=group)
    line = disagreement(states)
    if line is not None:
        # every rank knows and raises; none leaves while another still reads the gathered states (gloo aborts a
        # process whose peer closes the connection under a collective)
        dist.barrier(group=group)
        raise Tf32LabError(line)
    return Agreement(mine, len(states))
