"""autoconfig(): each simulated machine decides as documented, every change is logged and undone exactly."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cli_runner
import tf32lab
from tf32lab import Tf32LabError
from tf32lab.control import flags
from tf32lab.machine import compile_cache
from tf32lab.machine.hardware import Hardware


@pytest.fixture
def restore_env():
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    yield
    if saved is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def _apply(hw: Hardware, **kwargs):
    before, threads = flags.snapshot(), torch.get_num_threads()
    decisions = tf32lab.autoconfig(hardware=hw, **kwargs)
    state = {"level": tf32lab.get_float32_matmul_precision(), "cells": flags.read_cells(),
             "threads": torch.get_num_threads()}
    decisions.undo()
    assert flags.snapshot() == before, "undo() left flags changed"
    assert torch.get_num_threads() == threads
    return decisions, state


@pytest.mark.parametrize("name", ["a100", "h100"])
def test_ampere_and_newer_get_tf32(name):
    decisions, state = _apply(Hardware.simulated(name, cpus=8))
    assert decisions["precision"].new == "high" and decisions["precision"].changed
    assert "TF32 tensor cores" in decisions["precision"].reason
    assert state["level"] == "high" and state["cells"]["cuda.matmul"] == "tf32"
    assert f"--target {name}" in decisions.recommendation.advice
    assert decisions["threads"].new == 8 and state["threads"] == 8


@pytest.mark.parametrize("name", ["v100", "t4"])
def test_pre_ampere_keeps_highest_and_recommends_fp16_autocast(name):
    decisions, state = _apply(Hardware.simulated(name, cpus=8))
    precision = decisions["precision"]
    assert (precision.old, precision.new, precision.changed) == ("highest", "highest", False)
    assert "no TF32 tensor cores" in precision.reason
    assert "float16 autocast" in decisions.recommendation.advice
    assert state["level"] == "highest"


def test_cpu_amx_keeps_highest_and_says_how_to_check_medium():
    decisions, _ = _apply(Hardware.simulated("cpu-amx", cpus=8))
    assert decisions["precision"].new == "highest" and "AMX" in decisions["precision"].reason
    assert "--target cpu-amx" in decisions.recommendation.advice


def test_a_quota_of_one_and_a_half_cpus_on_eight_cores_gives_one_thread():
    decisions, state = _apply(Hardware.simulated("a100", cpus=8, quota=1.5))
    assert decisions["threads"].new == 1 and state["threads"] == 1
    assert "1 usable CPUs (quota 1.5 of 8)" in decisions["threads"].reason
    assert decisions["interop_threads"].new == 1


def test_nvidia_tf32_override_zero_forbids_tf32():
    decisions, state = _apply(Hardware.simulated("a100", env={"NVIDIA_TF32_OVERRIDE": "0"}))
    assert decisions["precision"].new == "highest" and state["level"] == "highest"
    assert "NVIDIA_TF32_OVERRIDE=0" in decisions["precision"].reason
    assert "unset NVIDIA_TF32_OVERRIDE" in decisions.recommendation.advice


def test_cublas_override_is_explained():
    hw = Hardware.simulated("a100", env={"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"})
    decisions, _ = _apply(hw)
    assert decisions["precision"].new == "high"
    decisions, state = _apply(hw, level="highest")
    assert state["level"] == "highest"
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 is set: it only makes 'high' PyTorch's default" in \
        decisions["precision"].reason


def test_torchrun_local_world_size_shares_the_cpus():
    hw = Hardware.simulated("h100", cpus=16, env={"LOCAL_WORLD_SIZE": "4"})
    decisions, state = _apply(hw, workers=2)
    assert decisions["threads"].new == 2 and state["threads"] == 2
    assert "2 worker(s) x 4 local process(es)" in decisions["threads"].reason
    decisions, _ = _apply(Hardware.simulated("h100", cpus=2, env={"LOCAL_WORLD_SIZE": "8"}))
    assert decisions["threads"].new == 1  # never 0


@pytest.mark.parametrize("bad", ["abc", "0", "-2", "4.5"])
def test_a_local_world_size_that_is_not_a_count_is_said_not_taken_silently(bad, caplog):
    # read as 1 without a word: every torchrun process on the machine would take all of its CPUs
    with caplog.at_level(logging.WARNING, logger="tf32lab"):
        decisions, _ = _apply(Hardware.simulated("h100", cpus=16, env={"LOCAL_WORLD_SIZE": bad}))
    assert decisions["threads"].new == 16
    assert f"LOCAL_WORLD_SIZE={bad!r} is not a number >= 1: counted as 1" in decisions["threads"].reason
    assert any(f"LOCAL_WORLD_SIZE={bad!r}" in r.getMessage() for r in caplog.records)


def test_explicit_thread_env_is_honoured_and_explained():
    decisions, state = _apply(Hardware.simulated("a100", cpus=8, env={"OMP_NUM_THREADS": "3"}))
    assert decisions["threads"].new == 3 and state["threads"] == 3
    assert decisions["threads"].reason.startswith("OMP_NUM_THREADS=3 is set: honoured (automatic would be")
    decisions, _ = _apply(Hardware.simulated("a100", cpus=8, env={"MKL_NUM_THREADS": "2"}))
    assert decisions["threads"].new == 2 and "MKL_NUM_THREADS=2" in decisions["threads"].reason
    decisions, _ = _apply(Hardware.simulated("a100", cpus=8, env={"OMP_NUM_THREADS": "3"}), threads=5)
    assert decisions["threads"].new == 5 and "overrides OMP_NUM_THREADS=3" in decisions["threads"].reason
    decisions, _ = _apply(Hardware.simulated("a100", cpus=8, env={"OMP_NUM_THREADS": "lots"}))
    assert decisions["threads"].new == 8


def test_oversubscription_is_said():
    decisions, _ = _apply(Hardware.simulated("a100", cpus=4), workers=2, threads=4)
    assert "oversubscribes: 4 threads x 2 process(es) > 4 usable CPUs" in decisions["threads"].reason


def test_an_explicit_level_is_applied_as_asked():
    decisions, state = _apply(Hardware.simulated("v100"), level="medium")
    assert state["level"] == "medium" and decisions["precision"].reason.startswith("asked for")
    assert "no TF32 on this GPU" in decisions["precision"].reason
    decisions, state = _apply(Hardware.simulated("a100"), level="highest")
    assert state["level"] == "highest" and not decisions["precision"].changed


def test_a_level_that_changes_nothing_on_a_cpu_is_said_to():
    # no oneDNN TF32 without AMX-FP16: 'high' is the bits of 'highest' on an AMX-BF16 CPU (docs/gpu-results.md)
    decisions, state = _apply(Hardware.simulated("cpu-amx"), level="high")
    assert state["level"] == "high" and "no AMX-FP16 on this CPU, so it changes nothing" in \
        decisions["precision"].reason
    decisions, _ = _apply(Hardware.simulated("cpu-amx"), level="medium")
    assert decisions["precision"].reason == "asked for"  # bf16 on AMX
    decisions, _ = _apply(Hardware.simulated("cpu"), level="medium")
    assert "no AMX on this CPU, so it changes (almost) nothing" in decisions["precision"].reason
    fp16 = Hardware.simulated("cpu-amx", isa=("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16"))
    assert _apply(fp16, level="high")[0]["precision"].reason == "asked for"


def test_undo_is_exact_from_a_users_own_settings(user_flags):
    if flags.NEW_API:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    else:  # the legacy API's own knobs
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)
    before = flags.snapshot()
    decisions = tf32lab.autoconfig("high", threads=2, hardware=Hardware.simulated("a100", cpus=2))
    assert flags.snapshot() != before
    decisions.undo()
    decisions.undo()  # a second undo changes nothing
    assert flags.snapshot() == before and torch.get_num_threads() == 1


def test_undo_inside_a_scope_works_and_a_second_undo_outside_keeps_everything():
    before, threads = flags.snapshot(), torch.get_num_threads()
    decisions = tf32lab.autoconfig(threads=threads + 1, hardware=Hardware.simulated("a100", cpus=threads + 1))
    assert decisions["precision"].changed and tf32lab.get_float32_matmul_precision() == "high"
    with tf32lab.precision("medium"):
        decisions.undo()  # the process level comes back once the scope ends; the scope keeps its own
        assert tf32lab.get_float32_matmul_precision() == "medium"
        assert torch.get_num_threads() == threads
    assert tf32lab.get_float32_matmul_precision() == "highest"
    assert flags.snapshot() == before
    decisions.undo()
    assert flags.snapshot() == before and torch.get_num_threads() == threads


def test_the_same_level_is_not_written_again():
    # Writing explicit values where the cells inherit would cut them off from the generic setting.
    before = flags.snapshot()
    decisions = tf32lab.autoconfig(hardware=Hardware.simulated("cpu", cpus=torch.get_num_threads()))
    assert flags.snapshot() == before and not any(d.changed for d in decisions)


def test_every_decision_is_logged(caplog):
    threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="tf32lab.autoconfig"):
        decisions = tf32lab.autoconfig(hardware=Hardware.simulated("t4", cpus=threads + 2))
        decisions.undo()
    lines = [r.getMessage() for r in caplog.records]
    for decision in decisions:
        assert f"autoconfig as on t4: {decision}" in lines
    assert any(line.startswith("autoconfig as on t4: advice: for speed on this GPU use float16") for line in lines)
    assert f"undo threads: {threads + 2} -> {threads}" in lines


def test_tf32lab_disable_makes_it_a_logged_no_op(monkeypatch, caplog):
    monkeypatch.setenv("TF32LAB_DISABLE", "1")
    before = flags.snapshot()
    with caplog.at_level(logging.INFO, logger="tf32lab.autoconfig"):
        decisions = tf32lab.autoconfig(hardware=Hardware.simulated("a100", cpus=1))
    assert decisions.disabled and len(decisions) == 0 and flags.snapshot() == before
    assert "TF32LAB_DISABLE is on: autoconfig changes nothing" in caplog.text
    decisions.undo()


@pytest.mark.parametrize("kwargs, message", [
    ({"level": "fast"}, "unknown level 'fast'; accepted: 'auto', 'highest', 'high', 'medium'"),
    ({"workers": 0}, "bad workers 0; accepted: an int >= 1"),
    ({"workers": 1.5}, "bad workers 1.5"),
    ({"threads": "many"}, "bad threads 'many'; accepted: 'auto' or an int >= 1"),
    ({"threads": 0}, "bad threads 0"),
    ({"compile_cache": 3}, "bad compile_cache 3; accepted: None or a folder path"),
    ({"hardware": "a100"}, "bad hardware str; accepted: None or a tf32lab.machine.hardware.Hardware"),
])
def test_bad_arguments_change_nothing(kwargs, message):
    before, threads = flags.snapshot(), torch.get_num_threads()
    with pytest.raises(Tf32LabError) as err:
        tf32lab.autoconfig(**{"hardware": Hardware.simulated("a100", cpus=1), **kwargs})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert flags.snapshot() == before and torch.get_num_threads() == threads


def test_a_file_is_not_a_compile_cache(tmp_path):
    path = tmp_path / "cache"
    path.write_text("")
    with pytest.raises(Tf32LabError, match="it is a file"):
        tf32lab.autoconfig(compile_cache=path, hardware=Hardware.simulated("a100", cpus=1))


def test_refused_inside_a_precision_scope():
    with tf32lab.precision("high"), pytest.raises(Tf32LabError, match="outside precision"):
        tf32lab.autoconfig(hardware=Hardware.simulated("a100", cpus=1))


def test_compile_cache_settings_are_undone(tmp_path, restore_env):
    import torch._inductor.config as inductor_config

    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    inductor_config.fx_graph_cache = False
    try:
        decisions = tf32lab.autoconfig(compile_cache=tmp_path / "cc", threads=torch.get_num_threads(),
                                       hardware=Hardware.simulated("a100", cpus=1))
        assert inductor_config.fx_graph_cache is True
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc") and (tmp_path / "cc").is_dir()
        assert not decisions["compile_cache.artifacts"].applied
        decisions.undo()
        assert inductor_config.fx_graph_cache is False and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    finally:
        inductor_config.fx_graph_cache = True


def _run(code: str, env: dict | None = None, timeout: int = 300) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_tf32lab_changes_nothing():
    out = _run("""
        import json, os, torch
        def state():
            if hasattr(torch._C, "_get_fp32_precision_getter"):
                cells = [torch._C._get_fp32_precision_getter(b, o) for b in ("cuda", "mkldnn")
                         for o in ("all", "matmul", "conv", "rnn")]
            else:  # torch before 2.9: the legacy flags are all there is
                cells = [torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
                         torch.backends.cudnn.allow_tf32]
            return [cells, torch.get_num_threads(), torch.get_num_interop_threads(), dict(os.environ)]
        before = state()
        import tf32lab, tf32lab.cli
        print(json.dumps([before == state(), before[1]]))
    """)
    assert json.loads(out)[0] is True


def test_inter_op_threads_are_left_alone_unless_asked():
    # torch.set_num_interop_threads works once per process: setting it by default would make undo() a lie.
    out = _run("""
        import json, logging, torch, tf32lab
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        before = torch.get_num_interop_threads()
        d = tf32lab.autoconfig(threads=before + 1)
        during = torch.get_num_interop_threads()
        d.undo()
        after = torch.get_num_interop_threads()
        torch.set_num_interop_threads(before + 2)  # still possible: autoconfig used up nobody's one call
        decision = d["interop_threads"].to_dict()
        print(json.dumps([decision, before, during, after, torch.get_num_interop_threads()]))
    """)
    decision, before, during, after, later = json.loads(out)
    assert (decision["applied"], decision["old"], decision["new"]) == (False, before, before + 1)
    assert decision["reason"] == (f"left alone: PyTorch allows torch.set_num_interop_threads once per process, so "
                                  f"undo() could not put {before} back; interop_threads='auto' or a number sets it")
    assert during == after == before and later == before + 2


def test_inter_op_threads_when_asked_and_what_undo_says_it_cannot_put_back():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json, logging, torch, tf32lab
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        before = torch.get_num_interop_threads()
        d = tf32lab.autoconfig(threads=1, interop_threads=before + 1)
        during = torch.get_num_interop_threads()
        d.undo()
        print(json.dumps([d["interop_threads"].to_dict(), before, during, torch.get_num_interop_threads()]))
    """)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    decision, before, during, after = json.loads(done.stdout)
    assert decision["applied"] and decision["reason"].startswith("asked for; undo() cannot put it back")
    assert during == after == before + 1
    assert (f"undo interop_threads: not put back: PyTorch allows setting it once per process; it stays {before + 1} "
            f"(was {before})") in done.stderr.splitlines()


def test_bad_interop_threads_changes_nothing():
    before, threads = flags.snapshot(), torch.get_num_threads()
    for bad in (0, "many", True, 1.5):
        with pytest.raises(Tf32LabError, match=r"^bad interop_threads .*; accepted: None, 'auto' or an int >= 1$"):
            tf32lab.autoconfig(interop_threads=bad, hardware=Hardware.simulated("a100", cpus=1))
    assert flags.snapshot() == before and torch.get_num_threads() == threads


@pytest.mark.slow
@pytest.mark.skipif(not compile_cache.MEGA_CACHE, reason="this torch has no Mega-Cache (torch 2.7+)")
def test_mega_cache_saved_then_loaded_in_another_process(tmp_path):
    compile_and_count = """
        import json, sys, torch, tf32lab
        from torch._dynamo.utils import counters
        d = tf32lab.autoconfig(compile_cache=sys.argv[1] if len(sys.argv) > 1 else {folder!r})
        # one matmul: a graph Inductor caches as any other, and no C++ kernel to build (a compiler run costs
        # seconds of CPU in each process)
        f = torch.compile(lambda x, w: x @ w)
        f(torch.randn(8, 16), torch.randn(16, 4))
        saved = str(tf32lab.save_compile_cache({folder!r})) if {save} else None
        print(json.dumps([dict(counters["inductor"]), d["compile_cache.artifacts"].to_dict(), saved]))
    """
    first, second = tmp_path / "first", tmp_path / "second"

    def run(save: bool, folder: Path) -> str:
        # each run its own process, forked from the suite's CLI server (torch and tf32lab imported, nothing
        # compiled: no in-memory cache of Dynamo's or Inductor's to carry over), as a fresh one without paying the
        # 2-3 CPU seconds of importing torch again
        script = tmp_path / f"compile_and_count_{'saves' if save else 'loads'}.py"
        script.write_text(textwrap.dedent(compile_and_count.format(folder=str(folder), save=save)))
        done = cli_runner.run(module=script.stem, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    counts, artifacts, _ = json.loads(run(True, first))
    assert counts.get("fxgraph_cache_miss", 0) >= 1 and not artifacts["applied"]
    second.mkdir()
    for name in ("tf32lab-mega-cache.bin", "tf32lab-mega-cache.json"):  # only the artifact travels
        (second / name).write_bytes((first / name).read_bytes())
    counts, artifacts, _ = json.loads(run(False, second))
    assert artifacts["applied"] and "Mega-Cache loaded" in artifacts["reason"]
    assert counts.get("fxgraph_cache_hit", 0) >= 1 and counts.get("fxgraph_cache_miss", 0) == 0
    # An artifact from another torch is not loaded.
    meta = json.loads((second / "tf32lab-mega-cache.json").read_text())
    (second / "tf32lab-mega-cache.json").write_text(json.dumps({**meta, "torch": "0.0.1"}))
    decisions = tf32lab.autoconfig(compile_cache=second, threads=torch.get_num_threads(),
                                   hardware=Hardware.simulated("cpu", cpus=1))
    try:
        assert not decisions["compile_cache.artifacts"].applied
        assert "not loaded" in decisions["compile_cache.artifacts"].reason
    finally:
        decisions.undo()


# -- the compile cache is a trust boundary ---------------------------------------------------------------------------
MEGA_CACHE = pytest.mark.skipif(not compile_cache.MEGA_CACHE, reason="this torch has no Mega-Cache (torch 2.7+)")


@pytest.mark.skipif(compile_cache.MEGA_CACHE, reason="for a torch without the Mega-Cache")
def test_without_a_mega_cache_saving_is_a_clear_error_and_an_artifact_is_left_alone(tmp_path, restore_env):
    with pytest.raises(Tf32LabError, match=r"^nothing to save: torch .* has no Mega-Cache .*torch 2.7"):
        tf32lab.save_compile_cache(tmp_path / "cache")
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / compile_cache.ARTIFACT).write_bytes(b"made by a newer torch")
    decisions = tf32lab.autoconfig(compile_cache=folder, threads=torch.get_num_threads(),
                                   hardware=Hardware.simulated("cpu", cpus=1))
    try:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)  # the folder still serves Inductor's caches
        loaded = decisions["compile_cache.artifacts"]
        assert not loaded.applied and "has no Mega-Cache" in loaded.reason and "not loaded" in loaded.reason
    finally:
        decisions.undo()


def _artifact(folder, entries, *, note=True) -> None:
    """Write a Mega-Cache artifact with PyTorch's own writer: ``entries`` are (type, key, content)."""
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    grouped: dict = {}
    for kind, key, content in entries:
        grouped.setdefault(kind, []).append(CacheArtifactFactory.create(kind, key, content))
    writer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    writer.extend(grouped.items())
    data = writer.to_bytes()
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / compile_cache.ARTIFACT).write_bytes(data)
    if note:
        import hashlib

        meta = {**compile_cache.identity(), "artifacts": len(entries), "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}
        (folder / compile_cache.NOTE).write_text(json.dumps(meta))


def _refused(folder, match):
    before, threads = flags.snapshot(), torch.get_num_threads()
    dir_before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with pytest.raises(Tf32LabError, match=match) as err:
        tf32lab.autoconfig(compile_cache=folder, threads=threads + 1, hardware=Hardware.simulated("a100", cpus=2))
    assert "\n" not in str(err.value)
    assert flags.snapshot() == before and torch.get_num_threads() == threads  # all or nothing
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == dir_before


@MEGA_CACHE
def test_an_entry_that_would_write_outside_the_folder_refuses_the_artifact(tmp_path, restore_env):
    outside = tmp_path / "outside" / "escaped.best_config"
    for key in (str(outside), "../outside/escaped.best_config"):
        folder = tmp_path / "cache"
        _artifact(folder, [("autotune", "triton/ok.best_config", b'{"a": 1}'), ("autotune", key, b'{"b": 2}')])
        _refused(folder, "autotune entry .* would be written outside")
        assert not outside.exists() and not (folder / "triton").exists()  # nothing of it was written


@MEGA_CACHE
def test_a_corrupt_artifact_is_an_error_not_zero_artifacts(tmp_path, restore_env):
    folder = tmp_path / "cache"
    _artifact(folder, [("autotune", "triton/ok.best_config", b'{"a": 1}')])
    (folder / compile_cache.ARTIFACT).write_bytes(b"\x00garbage" * 8)
    _refused(folder, "is corrupt: its size or SHA-256 differs")
    _artifact(folder, [("autotune", "triton/ok.best_config", b'{"a": 1}')], note=False)
    (folder / compile_cache.NOTE).write_text(json.dumps(compile_cache.identity()))  # an older note, no checksum
    (folder / compile_cache.ARTIFACT).write_bytes(b"\x00garbage" * 8)
    _refused(folder, "is corrupt: it holds no compile artifact PyTorch can read")


@pytest.mark.parametrize("what", [pytest.param("folder", marks=MEGA_CACHE), pytest.param("artifact", marks=MEGA_CACHE),
                                  "empty folder"])
def test_a_cache_others_may_write_is_refused(tmp_path, restore_env, what):
    folder = tmp_path / "cache"
    if what == "empty folder":  # inductor would read its own pickled entries from it
        folder.mkdir()
    else:
        _artifact(folder, [("autotune", "triton/ok.best_config", b'{"a": 1}')])
    target = folder / compile_cache.ARTIFACT if what == "artifact" else folder
    target.chmod(0o666 if what == "artifact" else 0o777)
    _refused(folder, f"compile_cache {target} is writable by other users .*chmod go-w")


@MEGA_CACHE
def test_a_trusted_artifact_loads_into_the_folder(tmp_path, restore_env):
    folder = tmp_path / "cache"
    _artifact(folder, [("autotune", "triton/ok.best_config", b'{"a": 1}')])
    decisions = tf32lab.autoconfig(compile_cache=folder, threads=torch.get_num_threads(),
                                   hardware=Hardware.simulated("cpu", cpus=1))
    try:
        loaded = decisions["compile_cache.artifacts"]
        assert loaded.applied and "Mega-Cache loaded: 1 artifacts" in loaded.reason
        assert (folder / "triton" / "ok.best_config").is_file()
    finally:
        decisions.undo()


def test_a_cache_dir_variable_that_names_a_file_is_one_line_and_changes_nothing(tmp_path):
    # PyTorch's compiler makes TORCHINDUCTOR_CACHE_DIR when it is imported: a file there raised FileExistsError
    # from inside torch._dynamo's import, a traceback where one line naming the variable is due
    taken = tmp_path / "taken"
    taken.write_text("")
    code = ("import torch, tf32lab\n"
            "from tf32lab.control import flags\n"
            "before, threads = flags.snapshot(), torch.get_num_threads()\n"
            "try:\n"
            f"    tf32lab.autoconfig(compile_cache={str(tmp_path / 'cache')!r})\n"
            "except tf32lab.Tf32LabError as exc:\n"
            "    print('ERROR', exc)\n"
            "print(flags.snapshot() == before, torch.get_num_threads() == threads)\n")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(taken))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    error, same = done.stdout.strip().splitlines()
    assert error.startswith("ERROR compile_cache: PyTorch's compiler cannot start with TORCHINDUCTOR_CACHE_DIR=")
    assert str(taken) in error and same == "True True"
    assert not (tmp_path / "cache").exists()  # refused before anything changed
