"""Hardware: what this machine has that decides how float32 matmuls run, detected once.

A :class:`Hardware` value holds the torch build and its flag API generation, each GPU with its compute capability,
the CPU's reduced-precision instructions, the CPUs this process may really use (affinity and the cgroup v1/v2 CPU
quota, not ``os.cpu_count()``: kserve#1031) and the environment variables that override settings.
``Hardware.simulated("a100", cpus=8)`` builds the value another machine would give, for tests and for "what would
happen on ..." questions. Nothing here changes any setting.

Example:

    >>> from tf32lab import hardware
    >>> a100 = hardware.Hardware.simulated("a100", cpus=8, quota=1.5)
    >>> a100.target, a100.gpus[0].capability, a100.usable_cpus
    ('a100', (8, 0), 1)
    >>> hardware.detect().visible_cpus >= 1
    True
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from tf32lab.control import flags
from tf32lab.errors import Tf32LabError
from tf32lab.know import targets
from tf32lab.machine.distributed import rank_of

__all__ = ["ENV", "ISA", "Gpu", "Hardware", "cpu_quota", "detect"]

# Environment variables that override what the flags say (NVIDIA's cuBLAS docs for NVIDIA_TF32_OVERRIDE, PyTorch's
# CUDA notes for TORCH_ALLOW_TF32_CUBLAS_OVERRIDE), read as they are at detection.
ENV = ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "HIPBLASLT_ALLOW_TF32", "OMP_NUM_THREADS",
       "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE",  # torchrun's: this process's rank in its job
       "TF32LAB_DISABLE")  # autoconfig's kill switch
_ENV_PREFIXES = ("TORCHINDUCTOR_",)

# CPU instructions that decide reduced-precision float32 math on a CPU (oneDNN bf16/fp16 paths), /proc/cpuinfo names.
ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")

# Instructions a simulated machine is given: AMX for cpu-amx, a plain AVX2 server CPU otherwise.
_SIMULATED_ISA = {"cpu-amx": ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")}


@dataclass(frozen=True)
class Gpu:
    """One GPU: its name and compute capability. TF32 tensor cores need capability >= 8.0 (Ampere)."""

    name: str
    capability: tuple[int, int]
    memory_gib: Optional[float] = None

    @property
    def tf32(self) -> bool:
        return self.capability >= (8, 0)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "capability": f"{self.capability[0]}.{self.capability[1]}",
                "memory_gib": self.memory_gib, "tf32": self.tf32}


@dataclass(frozen=True)
class Hardware:
    """What decides float32 matmul math on a machine. Build with :func:`detect` or :meth:`simulated`.

    ``env`` holds only the overriding variables that are set (:data:`ENV` and ``TORCHINDUCTOR_*``).

    >>> hw = Hardware.simulated("t4", cpus=4, env={"LOCAL_WORLD_SIZE": "2"})
    >>> hw.gpus[0].tf32, hw.local_world_size, hw.simulated_as
    (False, 2, 't4')
    """

    torch: str
    api: str  # "per-backend" (PyTorch >= 2.9, fp32_precision cells) or "legacy"
    cuda: Optional[str]
    rocm: Optional[str]
    mps: bool
    gpus: tuple[Gpu, ...]
    cpu: str
    isa: tuple[str, ...]
    visible_cpus: int
    affinity_cpus: int
    cpu_quota: Optional[float] = None
    quota_source: Optional[str] = None
    env: Mapping[str, str] = field(default_factory=dict)
    simulated_as: Optional[str] = None  # the target a simulated value stands for

    @classmethod
    def simulated(cls, target: str, cpus: int = 8, *, quota: Optional[float] = None,
                  env: Optional[Mapping[str, str]] = None, isa: Optional[tuple[str, ...]] = None) -> Hardware:
        """The hardware a machine of ``target`` (a name from ``tf32lab.know.targets``) with ``cpus`` cores would report.

        ``quota`` is a cgroup CPU quota in CPUs; ``env`` the environment of that machine (this process's is not
        read). The torch build is this one: its flags are what ``autoconfig`` would set there.

        >>> Hardware.simulated("cpu-amx").isa[-1], Hardware.simulated("h100").gpus[0].name
        ('amx_bf16', 'NVIDIA H100 (Hopper)')
        >>> Hardware.simulated("a100", cpus=0)
        Traceback (most recent call last):
        ...
        tf32lab.errors.Tf32LabError: bad cpus 0; accepted: an int >= 1
        """
        spec = targets.get(target)
        if isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1:
            raise Tf32LabError(f"bad cpus {cpus!r}; accepted: an int >= 1")
        if quota is not None and (isinstance(quota, bool) or not isinstance(quota, (int, float))
                                  or not 0 < quota < math.inf):
            raise Tf32LabError(f"bad quota {quota!r}; accepted: None or a number of CPUs > 0")
        unknown = sorted(set(isa or ()) - set(ISA))
        if unknown:
            raise Tf32LabError(f"unknown instructions {unknown}; accepted: {', '.join(ISA)}")
        env = dict(env or {})
        bad = sorted(k for k in env if not _overriding(k))
        if bad:
            raise Tf32LabError(f"env names {bad} override nothing tf32lab knows; accepted: "
                               f"{', '.join(ENV)}, TORCHINDUCTOR_*")
        gpus = (Gpu(spec.title, spec.capability),) if spec.device == "cuda" and spec.capability else ()
        amd = _is_amd(spec)
        return cls(
            torch=torch.__version__, api=_api(),
            cuda=(torch.version.cuda or "simulated") if gpus and not amd else None,
            rocm="simulated" if gpus and amd else None, mps=False, gpus=gpus, cpu="simulated CPU",
            isa=tuple(isa) if isa is not None else _SIMULATED_ISA.get(spec.name, ("avx2",)),
            visible_cpus=cpus, affinity_cpus=cpus, cpu_quota=float(quota) if quota is not None else None,
            quota_source="simulated" if quota is not None else None, env=env, simulated_as=spec.name,
        )

    @property
    def usable_cpus(self) -> int:
        """CPUs this process can keep busy: its affinity, cut to the CPU quota rounded down (at least 1).

        Rounded down because threads beyond the quota get throttled; a quota of 1.5 gives 1.
        """
        usable = self.affinity_cpus
        if self.cpu_quota is not None:
            usable = min(usable, max(1, math.floor(self.cpu_quota)))
        return max(1, usable)

    @property
    def rank(self) -> Optional[int]:
        """This process's rank in a torchrun job of several (``RANK``, ``WORLD_SIZE``), else None."""
        return rank_of(self.env)[0]

    @property
    def world_size(self) -> int:
        """Processes in the torchrun job (``WORLD_SIZE``), 1 outside one."""
        return rank_of(self.env)[1]

    @property
    def local_world_size(self) -> int:
        """Processes per machine under torchrun (``LOCAL_WORLD_SIZE``), 1 when unset or not a positive int."""
        value = _positive_int(self.env.get("LOCAL_WORLD_SIZE"))
        return value or 1

    @property
    def target(self) -> str:
        """The ``tf32lab.know.targets`` name that describes how this machine's default device computes."""
        if self.simulated_as:
            return self.simulated_as
        if self.gpus and (self.cuda or self.rocm):
            return _target_for(self.gpus[0].capability, self.gpus[0].name, amd=bool(self.rocm))
        return "cpu-amx" if "amx_bf16" in self.isa else "cpu"

    @property
    def device(self) -> str:
        """``"cuda"`` when a CUDA (or ROCm) GPU is present, else ``"mps"`` or ``"cpu"``."""
        return "cuda" if self.gpus else "mps" if self.mps else "cpu"

    def tf32_override(self) -> Optional[str]:
        """The environment variable that changes TF32 in cuBLAS/cuDNN beside the flags, as ``NAME=value``, or None.

        ``NVIDIA_TF32_OVERRIDE=0`` turns TF32 off in NVIDIA's libraries whatever PyTorch asks;
        ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` only changes PyTorch's default: matmuls run TF32 while nothing sets a
        level, and an explicit ``highest`` still gives IEEE (PyTorch's ``Context.h`` starts the level from it;
        measured on an H100 with torch 2.11, docs/gpu-results.md). The first wins: it acts below PyTorch.
        """
        if self.env.get("NVIDIA_TF32_OVERRIDE", "").strip() == "0":
            return "NVIDIA_TF32_OVERRIDE=0"
        if self.env.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "").strip() == "1":
            return "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1"
        return None

    @property
    def default_level(self) -> str:
        """The level a fresh process here starts at before anything sets one: ``high`` under
        ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (unless ``NVIDIA_TF32_OVERRIDE=0`` wins), else ``highest``.

        >>> Hardware.simulated("h100", env={"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}).default_level
        'high'
        """
        return "high" if self.tf32_override() == "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" else "highest"

    def cells_in_force(self, cells: Mapping[str, str]) -> dict[str, str]:
        """Effective flag cells (``flags.read_cells()``) as this machine's libraries obey them, env overrides applied.

        Only ``NVIDIA_TF32_OVERRIDE=0`` changes cells: it acts inside NVIDIA's libraries. PyTorch reads
        ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` into its default level, so a process's cells already say what it does
        and an explicit level overrides it (:attr:`default_level`).

        >>> hw = Hardware.simulated("a100", env={"NVIDIA_TF32_OVERRIDE": "0"})
        >>> hw.cells_in_force({"cuda.matmul": "tf32", "cuda.conv": "tf32"})
        {'cuda.matmul': 'ieee', 'cuda.conv': 'ieee'}
        >>> Hardware.simulated("a100", env={"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}).cells_in_force(
        ...     {"cuda.matmul": "ieee", "cuda.conv": "tf32"})
        {'cuda.matmul': 'ieee', 'cuda.conv': 'tf32'}
        """
        out = dict(cells)
        if self.tf32_override() == "NVIDIA_TF32_OVERRIDE=0":
            out.update({k: "ieee" for k, v in out.items() if k.startswith("cuda.") and v == "tf32"})
        if self.rocm and self.gpus and not self.rocm_tf32_allowed and out.get("cuda.matmul") == "tf32":
            out["cuda.matmul"] = "ieee"  # hipBLASLt keeps float32 without HIPBLASLT_ALLOW_TF32=1
        return out

    @property
    def rocm_tf32_allowed(self) -> bool:
        """On ROCm, whether hipBLASLt may run TF32 (XF32 on an MI300): only with ``HIPBLASLT_ALLOW_TF32=1`` in the
        environment besides PyTorch's flags ("tf32 is behind a flag because the TF32 support is new and only for
        MI300+": PyTorch's ``test/test_linalg.py``).

        >>> Hardware.simulated("mi300").rocm_tf32_allowed, Hardware.simulated(
        ...     "mi300", env={"HIPBLASLT_ALLOW_TF32": "1"}).rocm_tf32_allowed
        (False, True)
        """
        return self.env.get("HIPBLASLT_ALLOW_TF32", "").strip() == "1"

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch": self.torch, "api": self.api, "cuda": self.cuda, "rocm": self.rocm, "mps": self.mps,
            "gpus": [gpu.to_dict() for gpu in self.gpus], "cpu": self.cpu, "isa": list(self.isa),
            "visible_cpus": self.visible_cpus, "affinity_cpus": self.affinity_cpus, "cpu_quota": self.cpu_quota,
            "quota_source": self.quota_source, "usable_cpus": self.usable_cpus,
            "local_world_size": self.local_world_size, "rank": self.rank, "world_size": self.world_size,
            "env": dict(sorted(self.env.items())),
            "target": self.target, "simulated_as": self.simulated_as,
        }


def _api() -> str:
    return "per-backend" if flags.NEW_API else "legacy"


def _overriding(name: str) -> bool:
    return name in ENV or name.startswith(_ENV_PREFIXES)


def _positive_int(text: Optional[str]) -> Optional[int]:
    try:
        value = int(str(text).strip())
    except ValueError:
        return None
    return value if value >= 1 else None


def _is_amd(target: targets.Target) -> bool:
    return target.title.startswith("AMD")


def _target_for(capability: tuple[int, int], name: str, amd: bool = False) -> str:
    """The listed target closest to a GPU of its vendor: same name first, else the newest one of no higher
    capability (on ROCm the capability is the gfx version: 9.4 for gfx942)."""
    lowered = name.lower().replace(" ", "")
    same = [t for t in targets.TARGETS.values() if t.device == "cuda" and _is_amd(t) == amd]
    for spec in same:
        if spec.name in lowered and spec.capability == capability:
            return spec.name
    older = [t for t in same if t.capability <= capability]
    if older:
        return max(older, key=lambda t: t.capability).name
    return "mi300" if amd else "v100"


# -- CPU quota ---------------------------------------------------------------------------------------------------
def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[Optional[float], str]:
    """The CPU quota of this process's cgroup, in CPUs, and the file it came from; ``(None, "")`` when unlimited.

    Reads cgroup v2 ``cpu.max`` and v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of the process's group and of
    every group above it (a parent's limit binds its children), and returns the smallest. ``root`` is where the
    cgroup file system is mounted.

    >>> cpu_quota("/nonexistent/cgroup")
    (None, '')
    """
    try:
        lines = Path(proc_cgroup).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None, ""
    found: list[tuple[float, str]] = []
    base = Path(root)
    for line in lines:
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, group = parts
        if controllers == "":  # cgroup v2: one unified hierarchy
            found += _walk(base, group, _v2_limit)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own hierarchy
            for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if (base / mount).is_dir():
                    found += _walk(base / mount, group, _v1_limit)
                    break
    if not found:
        return None, ""
    return min(found)


def _walk(mount: Path, group: str, limit: Any) -> list[tuple[float, str]]:
    """Limits of ``group`` and its ancestors; inside a container the group may be the mount root itself."""
    out = []
    parts = [p for p in group.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        directory = mount.joinpath(*parts[:depth])
        value = limit(directory)
        if value is not None:
            out.append(value)
    return out


def _v2_limit(directory: Path) -> Optional[tuple[float, str]]:
    path = directory / "cpu.max"
    try:
        quota, period = path.read_text(encoding="utf-8").split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        cpus = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return (cpus, str(path)) if cpus > 0 else None


def _v1_limit(directory: Path) -> Optional[tuple[float, str]]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text(encoding="utf-8"))
        period = int((directory / "cpu.cfs_period_us").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:  # -1: no limit
        return None
    return quota / period, str(directory / "cpu.cfs_quota_us")


# -- CPU ---------------------------------------------------------------------------------------------------------
def _cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and which of :data:`ISA` it has (x86 Linux; elsewhere the platform's name only)."""
    name, present = "", ()
    try:
        with open(path, encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "flags":
                    have = set(value.split())
                    present = tuple(isa for isa in ISA if isa in have)
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), present


def _gpus() -> tuple[Gpu, ...]:
    if not torch.cuda.is_available():
        return ()
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        out.append(Gpu(props.name, (props.major, props.minor), round(props.total_memory / 2**30, 1)))
    return tuple(out)


def _mps() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend and backend.is_available())


_DETECTED: Optional[Hardware] = None


def detect(*, refresh: bool = False) -> Hardware:
    """This machine's :class:`Hardware`, detected on the first call and kept (``refresh=True`` detects again).

    >>> detect() is detect()
    True
    """
    global _DETECTED
    if _DETECTED is None or refresh:
        cpu, isa = _cpuinfo()
        quota, source = cpu_quota()
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        _DETECTED = Hardware(
            torch=torch.__version__, api=_api(), cuda=torch.version.cuda, rocm=getattr(torch.version, "hip", None),
            mps=_mps(), gpus=_gpus(), cpu=cpu, isa=isa, visible_cpus=os.cpu_count() or 1, affinity_cpus=affinity,
            cpu_quota=quota, quota_source=source or None,
            env={k: v for k, v in sorted(os.environ.items()) if _overriding(k)},
        )
    return _DETECTED



def resolve_target(name: Union[str, targets.Target], *, speed: bool = False) -> targets.Target:
    """The :class:`~tf32lab.targets.Target` a user names: a row of ``tf32lab.targets``, or ``"native"``, this
    machine's own hardware (its profile's maths, run for real). Where a name becomes a Target, once, at the
    boundary; a Target passes through. ``speed``: one the speed model covers (a GPU), else a one-line error.

    >>> resolve_target("a100").name, resolve_target("native").emulated
    ('a100', False)
    >>> resolve_target("a200")
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: unknown target 'a200'; accepted: 'v100', ..., 'cpu', or 'native' (this machine's ...
    """
    if speed:  # predict and tune: a GPU with a speed model, and the error lists only those
        if isinstance(name, str) and name not in targets.TARGETS:
            gpus = ", ".join(map(repr, targets.speed_targets()))
            raise Tf32LabError(f"unknown target {name!r}; accepted: {gpus} (the GPU targets, which the speed model "
                               "covers; on a CPU, measure it: `tf32lab speed SPEC --target native --measure`, or "
                               "tf32lab.bench)")
        found = resolve_target(name)
        found.speed_peaks()
        return found
    if isinstance(name, targets.Target):
        return name
    if name == targets.NATIVE:
        return targets.native(targets.get(detect().target))
    try:
        return targets.get(name)
    except Tf32LabError as exc:
        raise Tf32LabError(f"{exc}, or 'native' (this machine's own hardware)") from None
