"""Names resolved once: old module paths still import (the public ones silently, the rest with a warning at the
importer's line), a target name becomes a ``Target`` at the boundary, and "which math" is a pure lookup that
agrees with what ``emulate`` computes."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

import cli_runner
import tf32lab
from tf32lab import targets
from tf32lab.control import flags
from tf32lab.emulation.emulator import context_cells
from tf32lab.errors import Tf32LabError
from tf32lab.machine.hardware import resolve_target


@pytest.mark.parametrize("old", sorted(tf32lab.PUBLIC_PATHS))
def test_the_public_module_paths_are_the_same_modules_without_a_warning(old):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = importlib.import_module(f"tf32lab.{old}")
    assert module is importlib.import_module(f"tf32lab.{tf32lab.PUBLIC_PATHS[old]}")
    assert module.__spec__.name == f"tf32lab.{tf32lab.PUBLIC_PATHS[old]}"  # its own spec, not the old name's


def test_an_old_internal_path_warns_at_the_importers_line_under_the_default_filters(tmp_path):
    script = tmp_path / "user.py"
    script.write_text("import tf32lab.compare\nfrom tf32lab.policy import Policy\nfrom tf32lab.speed import predict\n"
                      "import tf32lab\nassert predict is tf32lab.predict and Policy is tf32lab.Policy\n")
    # as `python -m user` in its folder, forked from the suite's CLI server (torch and tf32lab imported, none of the
    # old paths: a path imported there would not warn, and the test would fail)
    done = cli_runner.run(module="user", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    for line, old, new in ((1, "tf32lab.compare", "tf32lab.measure.check"),
                           (2, "tf32lab.policy", "tf32lab.control.policy"),
                           (3, "tf32lab.speed.predict", "tf32lab.speed.prediction.predict")):
        assert f"user.py:{line}: DeprecationWarning: {old} is now {new}" in done.stderr, done.stderr


def test_the_public_api_imports_without_a_deprecation_warning():
    code = "import tf32lab\nfor name in tf32lab.__all__:\n    getattr(tf32lab, name)\n"
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_policy_pickled_under_its_old_path_loads():
    policy = tf32lab.Policy("high", [("head", "highest")])
    # as the flat layout pickled it: the class under tf32lab.policy
    data = pickle.dumps(policy, protocol=0).replace(b"tf32lab.control.policy", b"tf32lab.policy")  # text framing
    assert b"tf32lab.policy" in data
    with pytest.warns(DeprecationWarning, match="tf32lab.policy is now tf32lab.control.policy"):
        sys.modules.pop("tf32lab.policy", None)
        loaded = pickle.loads(data)
    assert loaded == policy


def test_reloading_the_package_keeps_one_finder():
    importlib.reload(tf32lab)
    importlib.reload(tf32lab)
    assert sum(type(f).__qualname__ == "_OldPaths" for f in sys.meta_path) == 1


def test_a_target_is_resolved_once_and_passes_through():
    a100 = resolve_target("a100")
    assert a100 is targets.get("a100") and resolve_target(a100) is a100
    assert a100.peaks is not None and a100.speed_peaks().sms == 108
    native = resolve_target("native")
    assert native.name == "native" and not native.emulated and native.peaks is None
    with pytest.raises(Tf32LabError, match=r"unknown target 'a200'; accepted: .*or 'native'"):
        resolve_target("a200")
    with pytest.raises(Tf32LabError, match=r"no speed model for target .cpu.: predictions cover GPU targets"):
        resolve_target("cpu", speed=True)
    assert isinstance(Tf32LabError("x"), ValueError) and isinstance(Tf32LabError("x"), RuntimeError)


@pytest.mark.parametrize("name", ["v100", "a100", "h100", "b200", "cpu-amx", "cpu"])
@pytest.mark.parametrize("level", tf32lab.LEVELS)
def test_which_math_is_a_pure_lookup_that_agrees_with_emulate(name, level, user_flags):
    torch.backends.cudnn.allow_tf32 = False  # a cell no level writes: the lookup takes it from the caller's cells
    before = flags.snapshot()
    asked = targets.get(name).maths_at(level, context_cells())
    assert flags.snapshot() == before  # asking wrote nothing
    with tf32lab.precision(level), tf32lab.emulate(name) as emu:
        torch.nn.functional.linear(torch.randn(8, 16), torch.randn(4, 16))
        torch.nn.functional.conv2d(torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3))
    ran = dict(emu.coverage)  # (op, math) -> count
    assert ran == {("aten::mm", asked["matmul"]): 1, ("aten::convolution", asked["conv"]): 1}, (ran, asked)
