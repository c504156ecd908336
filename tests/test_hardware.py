"""tf32lab.machine.hardware: detection on this machine against what the OS says, cgroup quotas, simulated machines."""

from __future__ import annotations

import os

import pytest
import torch

from tf32lab import Tf32LabError
from tf32lab.know import targets
from tf32lab.machine import hardware
from tf32lab.machine.hardware import Hardware, cpu_quota


def _cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux /proc/cpuinfo")
def test_detect_matches_this_machine():
    hw = hardware.detect(refresh=True)
    assert hw.simulated_as is None
    assert hw.torch == torch.__version__
    assert hw.visible_cpus == os.cpu_count()
    assert hw.affinity_cpus == len(os.sched_getaffinity(0))
    assert 1 <= hw.usable_cpus <= hw.affinity_cpus
    have = _cpuinfo_flags()
    assert set(hw.isa) == {isa for isa in hardware.ISA if isa in have}
    if not torch.cuda.is_available():
        assert hw.target == ("cpu-amx" if "amx_bf16" in have else "cpu")
    assert len(hw.gpus) == torch.cuda.device_count()
    assert hw.api == ("per-backend" if hasattr(torch._C, "_get_fp32_precision_getter") else "legacy")
    quota, _ = cpu_quota()
    assert hw.cpu_quota == quota


def test_detect_is_kept_and_reads_the_overriding_environment(monkeypatch):
    assert hardware.detect() is hardware.detect()
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("HOME_IS_NOT_READ", "x")
    try:
        env = hardware.detect(refresh=True).env
        assert env["NVIDIA_TF32_OVERRIDE"] == "0" and env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
        assert "HOME_IS_NOT_READ" not in env
    finally:
        monkeypatch.undo()
        hardware.detect(refresh=True)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_the_group_and_its_parents(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "fs"
    _write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    _write(root / "kubepods/pod1/cpu.max", "150000 100000\n")  # the pod's limit binds the container
    _write(root / "kubepods/cpu.max", "400000 100000\n")
    quota, source = cpu_quota(str(proc), str(root))
    assert quota == 1.5 and source.endswith("kubepods/pod1/cpu.max")


def test_cgroup_v2_inside_a_container_namespace(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/\n")
    _write(tmp_path / "fs/cpu.max", "50000 100000\n")
    assert cpu_quota(str(proc), str(tmp_path / "fs"))[0] == 0.5


def test_cgroup_v1_quota(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    root = tmp_path / "fs"
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    _write(root / "cpu,cpuacct/docker/cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct/docker/cpu.cfs_period_us", "100000\n")
    assert cpu_quota(str(proc), str(root)) == (2.5, str(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us"))


@pytest.mark.parametrize("content", ["max 100000\n", "garbage\n", "0 100000\n", ""])
def test_cgroup_without_a_quota(tmp_path, content):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/a\n")
    _write(tmp_path / "fs/a/cpu.max", content)
    assert cpu_quota(str(proc), str(tmp_path / "fs")) == (None, "")


@pytest.mark.parametrize("quota, usable", [(None, 8), (1.5, 1), (0.5, 1), (3.99, 3), (16.0, 8)])
def test_usable_cpus_round_the_quota_down(quota, usable):
    assert Hardware.simulated("a100", cpus=8, quota=quota).usable_cpus == usable


@pytest.mark.parametrize("name", list(targets.TARGETS))
def test_every_target_can_be_simulated(name):
    hw = Hardware.simulated(name, cpus=4)
    spec = targets.get(name)
    assert hw.target == name and hw.simulated_as == name and hw.visible_cpus == 4
    if spec.device == "cuda":
        assert [g.capability for g in hw.gpus] == [spec.capability]
        assert hw.gpus[0].tf32 == (spec.capability >= (8, 0))
    else:
        assert hw.gpus == () and hw.device == "cpu"
    assert ("amx_bf16" in hw.isa) == (name == "cpu-amx")


def test_local_world_size():
    assert Hardware.simulated("h100", env={"LOCAL_WORLD_SIZE": "8"}).local_world_size == 8
    assert Hardware.simulated("h100", env={"LOCAL_WORLD_SIZE": "zero"}).local_world_size == 1
    assert Hardware.simulated("h100").local_world_size == 1


@pytest.mark.parametrize("env, cells", [
    ({}, {"cuda.matmul": "ieee", "cuda.conv": "tf32"}),
    ({"NVIDIA_TF32_OVERRIDE": "0"}, {"cuda.matmul": "ieee", "cuda.conv": "ieee"}),
    ({"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}, {"cuda.matmul": "ieee", "cuda.conv": "tf32"}),  # an explicit level
    ({"NVIDIA_TF32_OVERRIDE": "0", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"},
     {"cuda.matmul": "ieee", "cuda.conv": "ieee"}),
])
def test_env_overrides_decide_the_cells_in_force(env, cells):
    hw = Hardware.simulated("a100", env=env)
    assert hw.cells_in_force({"cuda.matmul": "ieee", "cuda.conv": "tf32"}) == cells


@pytest.mark.parametrize("kwargs, message", [
    ({"cpus": 0}, "bad cpus 0"),
    ({"cpus": True}, "bad cpus True"),
    ({"quota": -1}, "bad quota -1"),
    ({"quota": float("nan")}, "bad quota nan"),
    ({"env": {"PATH": "/bin"}}, "env names ['PATH'] override nothing"),
    ({"isa": ("sse9",)}, "unknown instructions ['sse9']"),
])
def test_simulated_rejects_bad_values(kwargs, message):
    with pytest.raises(Tf32LabError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Hardware.simulated("a100", **kwargs)
    with pytest.raises(Tf32LabError, match="unknown target 'a200'"):
        Hardware.simulated("a200")


def test_to_dict_round_numbers():
    d = Hardware.simulated("v100", cpus=8, quota=1.5).to_dict()
    assert d["gpus"] == [{"name": "NVIDIA V100 (Volta)", "capability": "7.0", "memory_gib": None, "tf32": False}]
    assert (d["usable_cpus"], d["cpu_quota"], d["target"]) == (1, 1.5, "v100")


def test_rank_under_torchrun():
    hw = Hardware.simulated("h100", env={"RANK": "2", "WORLD_SIZE": "4"})
    assert (hw.rank, hw.world_size) == (2, 4)
    assert hw.to_dict()["rank"] == 2 and hw.to_dict()["world_size"] == 4
    assert (Hardware.simulated("h100").rank, Hardware.simulated("h100").world_size) == (None, 1)
    assert Hardware.simulated("h100", env={"RANK": "x", "WORLD_SIZE": "4"}).rank is None
