"""tf32lab.precision: nesting, exceptions, decorators, threads and asyncio tasks without cross-talk."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

import cli_runner
import tf32lab
from kernel_levels import KernelLevels as Recorder
from tf32lab import Tf32LabError, precision
from tf32lab.control import flags, scope
from tf32lab.know.levels import LEVELS


def level_now() -> str:
    return tf32lab.get_float32_matmul_precision()


# -- single context ------------------------------------------------------------------------------------------

def test_nesting_follows_the_innermost_scope():
    outside = flags.read_level()
    with precision("high"):
        assert level_now() == flags.read_level() == "high"
        with precision("medium"):
            assert level_now() == flags.read_level() == "medium"
            with precision("highest"):
                assert level_now() == flags.read_level() == "highest"
            assert level_now() == flags.read_level() == "medium"
        assert level_now() == flags.read_level() == "high"
    assert level_now() == flags.read_level() == outside


def test_exit_by_exception_restores_every_flag():
    before = flags.snapshot()
    with pytest.raises(KeyError), precision("high"), precision("medium"):
        raise KeyError("boom")
    assert flags.snapshot() == before
    assert level_now() == "highest"


def test_one_object_reentered_and_shared():
    p = precision("medium")
    with p:
        with p:
            assert level_now() == "medium"
        assert level_now() == "medium"
    assert level_now() == "highest"


def test_flags_exact_also_from_an_explicit_user_setting(user_flags):
    # Raw values are given back, not just effective ones: an explicit "ieee" stays explicit, "none" stays "none".
    if flags.NEW_API:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.fp32_precision = "tf32"
    else:  # legacy: the level and cuBLAS's own boolean disagree, as a user's two writes leave them
        torch.set_float32_matmul_precision("medium")
        torch.backends.cuda.matmul.allow_tf32 = False
    scope.forget_flags_cache()
    before = flags.snapshot()
    with precision("medium"):
        assert level_now() == "medium"
    assert flags.snapshot() == before


def test_decorator_on_a_function():
    @precision("high")
    def f(x):
        return level_now(), x

    assert f(3) == ("high", 3)
    assert f.__name__ == "f"
    assert level_now() == "highest"


def test_decorator_on_an_async_function():
    @precision("medium")
    async def f():
        await asyncio.sleep(0)
        return level_now()

    assert asyncio.run(f()) == "medium"
    assert level_now() == "highest"


def test_decorator_refuses_generators():
    with pytest.raises(TypeError, match="generator function") as info:
        @precision("high")
        def gen():
            yield 1
    # the advice must not be the same leak: a `with` block that spans a yield is seen by the caller as well
    assert "not across a yield" in str(info.value)

    def spanning():
        with precision("high"):
            yield 1

    before = flags.snapshot()
    g = spanning()
    next(g)
    assert tf32lab.get_float32_matmul_precision() == "high"  # the caller, between two next() calls
    g.close()
    assert tf32lab.get_float32_matmul_precision() == "highest" and flags.snapshot() == before


@pytest.mark.parametrize("bad", ["fast", "HIGH", None, 3])
def test_unknown_level_is_refused_before_anything_changes(bad):
    with pytest.raises(ValueError, match=r"unknown level .*accepted: 'highest', 'bfx9', 'high', 'medium'"):
        precision(bad)
    with pytest.raises(ValueError, match="accepted"):
        tf32lab.set_float32_matmul_precision(bad)


def test_set_inside_a_scope_applies_after_it(user_flags):
    before = flags.snapshot()
    with precision("medium"):
        tf32lab.set_float32_matmul_precision("high")
        assert level_now() == "medium"
    assert level_now() == flags.read_level() == "high"
    assert flags.snapshot() != before


def test_a_direct_torch_write_inside_a_scope_is_undone_on_exit():
    before = flags.snapshot()
    with precision("high"):
        torch.set_float32_matmul_precision("medium")
    assert flags.snapshot() == before


def test_a_direct_torch_write_inside_a_nested_scope_gives_the_outer_scope_its_level_back():
    before = flags.snapshot()
    with precision("high"):
        with precision("high"):
            torch.set_float32_matmul_precision("medium")
        assert level_now() == flags.read_level() == "high"  # what the outer scope's matmuls run at
    assert flags.snapshot() == before


def test_exiting_out_of_order_closes_that_scope():
    outer, inner = precision("high"), precision("medium")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # as generators closed in opening order do
    assert level_now() == flags.read_level() == "medium"
    inner.__exit__(None, None, None)
    assert level_now() == flags.read_level() == "highest"
    assert scope.live_scopes() == 0


def test_exiting_a_scope_never_entered_is_an_error():
    with pytest.raises(Tf32LabError, match="exited without being entered"):
        precision("high").__exit__(None, None, None)


# -- the mixed-API trap ---------------------------------------------------------------------------------------

@pytest.mark.skipif(not flags.NEW_API, reason="the mixed-API error exists with the per-backend API")
def test_never_trips_over_the_mixed_api_error(user_flags):
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # now torch's own getter raises on 2.9+
    scope.forget_flags_cache()
    assert tf32lab.get_float32_matmul_precision() == "medium"
    tf32lab.set_float32_matmul_precision("high")
    assert tf32lab.get_float32_matmul_precision() == "high"
    with precision("highest"):
        assert flags.read_level() == "highest"


# -- native effect ----------------------------------------------------------------------------------------------

A = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))
B = torch.randn(512, 64, generator=torch.Generator().manual_seed(2))


def references() -> dict[str, torch.Tensor]:
    refs = {}
    for level in LEVELS:
        with precision(level):
            refs[level] = torch.mm(A, B)
    return refs


def test_scope_reaches_real_cpu_matmuls_where_medium_changes_them():
    # What medium does on a CPU is the CPU's: bf16 through oneDNN, another float32 kernel, or nothing new
    refs = references()
    if torch.equal(refs["medium"], refs["highest"]):
        pytest.skip("on this CPU 'medium' computes this matmul as 'highest' does")
    assert not torch.equal(refs["medium"], refs["highest"])
    assert (refs["medium"] - refs["highest"]).abs().max() < 1e-2 * refs["highest"].abs().max()


def check_step(level: str, rec: Recorder, refs: dict[str, torch.Tensor], native: bool) -> str | None:
    if level_now() != level:
        return f"context says {level_now()!r}, scope is {level!r}"
    rec.seen.clear()
    out = torch.mm(A, B)
    if rec.seen != [level]:
        return f"mm reached the kernel under {rec.seen}, scope is {level!r}"
    if native and not torch.equal(out, refs[level]):
        return f"mm result is not the {level!r} one"
    return None


def nested_walk(rng: random.Random, steps: int, rec: Recorder, refs, native: bool, errors: list[str]) -> None:
    """Random nested scopes, checking the level at every step."""
    stack: list[precision] = []
    for _ in range(steps):
        if stack and (len(stack) >= 4 or rng.random() < 0.45):
            stack.pop().__exit__(None, None, None)
        else:
            p = precision(rng.choice(LEVELS))
            p.__enter__()
            stack.append(p)
        expected = stack[-1].level if stack else None
        if expected is not None:
            problem = check_step(expected, rec, refs, native)
            if problem:
                errors.append(problem)
    while stack:
        stack.pop().__exit__(None, None, None)


def test_16_threads_500_random_nested_scopes_no_cross_talk():
    refs = references()
    native = not torch.equal(refs["medium"], refs["highest"])
    errors: list[str] = []
    start = threading.Barrier(16)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with Recorder() as rec:
                start.wait()
                nested_walk(rng, 500, rec, refs, native, errors)
        except Exception as exc:  # a crash is a failure too, never a silent thread death
            errors.append(f"thread {seed}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(seed,), name=f"w{seed}") for seed in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert scope.census() == {"scopes": 0, "holders": 0, "guards": 0}


def test_concurrent_asyncio_tasks_keep_their_own_levels():
    refs = references()
    native = not torch.equal(refs["medium"], refs["highest"])
    errors: list[str] = []

    async def task(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            level = rng.choice(LEVELS)
            with precision(level):
                await asyncio.sleep(0)  # let the other tasks run inside their own scopes
                problem = check_step(level, rec, refs, native)
                inner = rng.choice(LEVELS)
                with precision(inner):
                    await asyncio.sleep(0)
                    problem = problem or check_step(inner, rec, refs, native)
                await asyncio.sleep(0)
                problem = problem or check_step(level, rec, refs, native)
            if problem:
                errors.append(f"task {seed}: {problem}")

    async def main() -> None:
        await asyncio.gather(*(task(seed) for seed in range(8)))

    with Recorder() as rec:
        asyncio.run(main())
    assert errors == []
    assert scope.census()["holders"] == 0


@pytest.mark.parametrize("outer", ["precision", "emulate"])
def test_a_users_mode_entered_inside_a_scope_leaves_with_its_block_when_tasks_add_a_guard(outer):
    # The guard that concurrent tasks need is pushed while the user's mode is on: a mode's own exit pops the top of
    # the stack, so a guard above it would be popped in its place and the user's mode left on for good.
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as modes

    async def task(level: str) -> None:
        with precision(level):
            await asyncio.sleep(0)
            torch.mm(A, B)

    async def main() -> None:
        await asyncio.gather(task("medium"), task("highest"), task("high"))

    before = modes()
    block = precision("high") if outer == "precision" else tf32lab.emulate("a100")
    with block:
        inside = modes()
        with Recorder() as user:
            asyncio.run(main())
            assert user in modes()
        assert user not in modes() and [m for m in modes() if not isinstance(m, scope._Guard)] == inside
    assert modes() == before and scope.census()["guards"] == 0


def run_python(code: str, fresh: bool = False, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a process of its own: forked from the suite's CLI server (torch and tf32lab imported, no scope
    ever entered, one thread; TF32LAB_SCOPE_GUARD is read at the first scope), or a fresh interpreter where the
    test is about what happens at import."""
    if fresh:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env})
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "snippet.py").write_text(code)
        return cli_runner.run(module="snippet", cwd=folder, env={**os.environ, **env}, timeout=120)


def test_guard_always_lets_any_thread_contradict_the_main_thread():
    code = (
        "import threading, tf32lab\n"
        "out = {}\n"
        "def w():\n"
        "    with tf32lab.precision('highest'):\n"
        "        out['w'] = tf32lab.get_float32_matmul_precision()\n"
        "with tf32lab.precision('medium'):\n"
        "    t = threading.Thread(target=w); t.start(); t.join()\n"
        "    out['main'] = tf32lab.get_float32_matmul_precision()\n"
        "print(out['w'], out['main'])\n"
    )
    done = run_python(code, TF32LAB_SCOPE_GUARD="always")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["highest", "medium"]


def test_a_bad_guard_setting_is_one_clear_line():
    done = run_python("import tf32lab; print('imported')", fresh=True, TF32LAB_SCOPE_GUARD="sometimes")
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr  # importing never fails
    message = "TF32LAB_SCOPE_GUARD='sometimes' is not understood; accepted: 'auto', 'always'"
    done = run_python("import tf32lab\ntry:\n    tf32lab.precision('high').__enter__()\n"
                      "except tf32lab.Tf32LabError as exc:\n    print(exc)", TF32LAB_SCOPE_GUARD="sometimes")
    assert done.stdout.strip() == message
    cli = cli_runner.run("check", "builtin", module="tf32lab.cli", timeout=120,
                         env={**os.environ, "TF32LAB_SCOPE_GUARD": "sometimes"})
    assert cli.returncode == 2 and cli.stdout == ""
    assert cli.stderr.strip().splitlines() == [f"tf32lab check: error: {message}"]


def test_an_empty_or_differently_written_guard_setting_is_understood():
    # `TF32LAB_SCOPE_GUARD= python ...` (empty) means unset, as for the shell's other variables
    code = "import tf32lab\nwith tf32lab.precision('high'):\n    print(tf32lab.control.scope.guard_policy())"
    for value, expected in (("", "auto"), (" Always ", "always")):
        done = run_python(code, TF32LAB_SCOPE_GUARD=value)
        assert done.returncode == 0 and done.stdout.strip() == expected, (value, done.stderr)


@pytest.mark.skipif(not flags.NEW_API, reason="a mix no level writes needs the per-backend cells")
def test_contended_unscoped_code_runs_at_the_users_own_mix_not_the_level_it_amounts_to():
    # The user's cells (cuda tf32, mkldnn ieee) amount to 'high', but 'high' writes (tf32, tf32): while scopes of two
    # threads contend, unscoped code ran with oneDNN at TF32. (A bfx9 base, or a newer torch's value, went the same
    # way, or raised KeyError.) Now exactly the user's values are written back for it.
    code = (
        "import threading, torch, tf32lab\n"
        "from tf32lab import flags, scope\n"
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'\n"
        "before = flags.snapshot()\n"
        "x = torch.randn(8, 8)\n"
        "entered, done = threading.Barrier(3), threading.Barrier(3)\n"
        "def worker(level):\n"
        "    with tf32lab.precision(level):\n"
        "        entered.wait(); torch.mm(x, x); done.wait()\n"
        "threads = [threading.Thread(target=worker, args=(lv,)) for lv in ('high', 'medium')]\n"
        "[t.start() for t in threads]\n"
        "entered.wait()\n"
        "cells = flags.read_cells()\n"
        "print(cells['cuda.matmul'], cells['mkldnn.matmul'], tf32lab.get_float32_matmul_precision())\n"
        "print(scope.run_at('medium', lambda: flags.read_cells()['mkldnn.matmul']))\n"
        "done.wait(); [t.join() for t in threads]\n"
        "print(flags.snapshot() == before)\n"
    )
    done = run_python(code, TF32LAB_SCOPE_GUARD="always")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["tf32", "ieee", "high", "bf16", "True"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_child_sees_its_own_threads():
    # CPython gives a forked child a new set of shutdown locks, without its main thread's: read at import only,
    # the child's threads went unseen and its main thread's scopes took no guard while they ran
    code = (
        "import os, threading, tf32lab\n"
        "from tf32lab.control import scope\n"
        "def guarded():\n"
        "    stop = threading.Event()\n"
        "    t = threading.Thread(target=stop.wait); t.start()\n"
        "    try:\n"
        "        with tf32lab.precision('medium'):\n"
        "            return scope.census()['guards'] > 0\n"
        "    finally:\n"
        "        stop.set(); t.join()\n"
        "parent = guarded()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if guarded() else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(parent, os.waitstatus_to_exitcode(status) == 0)\n"
    )
    done = run_python(code, fresh=True)  # tf32lab imported in this very process, before its fork
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
