"""Scopes and emulate() under asyncio tasks, worker threads, generators and out-of-order exits.

Each test is a repro of a way the core broke: modes popped that were not one's own, emulation leaking into a task
that never asked for it, refusals where the user did nothing wrong, a process stuck at a level for good.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import cli_runner
import tf32lab
from dynamo_state import compiling_restored
from kernel_levels import KernelLevels
from tf32lab import Tf32LabError, precision
from tf32lab.control import flags, scope

TIE_A, TIE_B = torch.tensor([[1024.5]]), torch.tensor([[1.0]])  # TF32 (RNA) gives 1025, IEEE 1024.5
A = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))
B = torch.randn(512, 64, generator=torch.Generator().manual_seed(2))


def native(level: str) -> torch.Tensor:
    with precision(level):
        return A @ B


def run_python(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a process of its own, forked from the suite's CLI server (torch and tf32lab imported, no scope
    ever entered, one thread), as ``python -c`` runs it in a fresh interpreter: the scope's state is the same."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "snippet.py").write_text(textwrap.dedent(code))
        return cli_runner.run(module="snippet", cwd=folder, env={**os.environ, **env}, timeout=timeout)


def in_thread(fn, *args):
    out: dict[str, object] = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # reported to the caller, never a silent thread death
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


# -- 1. emulate() pops only its own modes --------------------------------------------------------------------
def test_three_tasks_leave_no_mode_behind_and_later_matmuls_are_native():
    reference = native("high")

    async def a(entered, c_in, a_out):
        with tf32lab.emulate("a100"):
            entered.set()
            await c_in.wait()  # held across an await, while C pushes the thread's guard on top
        a_out.set()

    async def b(entered, c_in, a_out):
        await entered.wait()
        with precision("high"):
            await a_out.wait()

    async def c(entered, c_in, a_out):
        await entered.wait()
        await asyncio.sleep(0)
        with precision("medium"):
            c_in.set()
            await a_out.wait()

    async def main():
        events = asyncio.Event(), asyncio.Event(), asyncio.Event()
        await asyncio.gather(a(*events), b(*events), c(*events))

    asyncio.run(main())
    assert _get_current_dispatch_mode_stack() == []
    assert scope.live_scopes() == 0
    with precision("high"):
        assert (TIE_A @ TIE_B).item() == 1024.5
        assert torch.equal(A @ B, reference)


def test_a_workers_emulate_exit_leaves_its_guard_in_place():
    errors: list[str] = []
    hold, release = threading.Event(), threading.Event()

    def other():  # another thread at another level: contended, so unguarded ops would run at the base level
        with precision("high"):
            hold.set()
            release.wait()

    def worker():
        with KernelLevels() as kernel:
            emu = tf32lab.emulate("a100")
            emu.__enter__()
            p = precision("medium")
            p.__enter__()  # the worker's guard goes on top of emulate's modes
            emu.__exit__(None, None, None)
            torch.mm(A, B)
            if kernel.seen != ["medium"]:
                errors.append(f"medium scope's mm reached the kernel under {kernel.seen}")
            p.__exit__(None, None, None)
            stack = _get_current_dispatch_mode_stack()
            if stack != [kernel]:
                errors.append(f"modes left on the worker: {stack}")

    holder = threading.Thread(target=other)
    holder.start()
    hold.wait()
    try:
        in_thread(worker)
    finally:
        release.set()
        holder.join()
    assert errors == []
    assert scope.live_scopes() == 0


# -- 2. emulate() is context-local ---------------------------------------------------------------------------
def test_a_task_that_never_entered_emulate_runs_natively():
    async def emulating(started, done, emus):
        with tf32lab.emulate("a100") as emu, precision("high"):
            emus.append(emu)
            started.set()
            await done.wait()

    async def plain(started, done, results):
        await started.wait()
        with precision("high"):
            results.append((TIE_A @ TIE_B).item())
        done.set()

    async def main():
        started, done = asyncio.Event(), asyncio.Event()
        emus: list = []
        results: list = []
        await asyncio.gather(emulating(started, done, emus), plain(started, done, results))
        return emus[0], results

    emu, results = asyncio.run(main())
    assert results == [1024.5]  # native, not TF32-emulated
    assert not emu.coverage  # and not counted as the other task's


def test_tasks_each_use_their_own_emulate():
    async def run(target, level, go):
        with tf32lab.emulate(target) as emu, precision(level):
            await go.wait()
            out = (TIE_A @ TIE_B).item()
        return out, dict(emu.coverage)

    async def main():
        go = asyncio.Event()
        tasks = [asyncio.ensure_future(run("a100", "high", go)), asyncio.ensure_future(run("v100", "high", go))]
        await asyncio.sleep(0)
        go.set()
        return await asyncio.gather(*tasks)

    (a100, a100_cov), (v100, v100_cov) = asyncio.run(main())
    assert (a100, v100) == (1025.0, 1024.5)
    assert a100_cov == {("aten::mm", "tf32-rna"): 1} and v100_cov == {("aten::mm", "ieee"): 1}


def test_emulate_exited_in_another_thread_is_a_clear_error_and_compile_is_restored():
    import torch._dynamo  # noqa: F401  (loaded, so that the block sets and restores its eager state)

    with ThreadPoolExecutor(1) as pool:
        for ended in (False, True):
            emu = tf32lab.emulate("a100")
            if ended:
                in_thread(emu.__enter__)  # a thread that ends with the block open
            else:
                pool.submit(emu.__enter__).result()  # a worker that lives on
            with pytest.raises(Tf32LabError, match=r"entered in (thread|a task of thread) .* exited in thread"):
                emu.__exit__(None, None, None)
            assert compiling_restored()
            with precision("high"):
                assert (TIE_A @ TIE_B).item() == 1024.5

        def again():  # the worker emulates again, and is left with no mode afterwards
            with precision("high"), tf32lab.emulate("a100"):
                out = (TIE_A @ TIE_B).item()
            return out, _get_current_dispatch_mode_stack()

        assert pool.submit(again).result() == (1025.0, [])
    with precision("high"), tf32lab.emulate("a100"):
        assert (TIE_A @ TIE_B).item() == 1025.0
    assert compiling_restored()


# -- 3. no refusal where the user did nothing wrong -----------------------------------------------------------
def test_a_worker_emulating_beside_a_main_thread_scope():
    def worker():
        with precision("high"), tf32lab.emulate("a100") as emu:
            out = (TIE_A @ TIE_B).item()
        with tf32lab.emulate("a100"), precision("highest"):
            ieee = (TIE_A @ TIE_B).item()
        return out, ieee, dict(emu.coverage)

    with precision("high"):
        assert in_thread(worker) == (1025.0, 1024.5, {("aten::mm", "tf32-rna"): 1})


def test_check_in_a_worker_beside_a_main_thread_scope():
    from tf32lab.workloads import builtin

    with precision("high"):
        report = in_thread(lambda: tf32lab.check(builtin.covariance(), levels=("highest", "high")))
    assert report.level("highest").passed and not report.level("high").passed


def test_an_already_started_pool_may_hold_any_level_beside_the_main_thread():
    refs = {level: native(level) for level in tf32lab.LEVELS}

    def job(level):
        with KernelLevels() as kernel, precision(level):
            out = A @ B
            return level, kernel.seen, torch.equal(out, refs[level])

    levels = ["highest", "medium"] * 4
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: None, range(8)))  # the threads exist before the main thread's scope
        with precision("high"), KernelLevels() as main_kernel:
            results = list(pool.map(job, levels))
            A @ B
    for level, seen, same in results:
        assert seen == [level] and same
    assert main_kernel.seen == ["high"]


def test_the_one_case_that_cannot_work_says_so_and_its_advice_works():
    # A main-thread scope entered while no other thread exists runs unguarded. A thread started inside it that
    # runs a matmul at another level is refused, at that matmul; both remedies the message names work.
    code = """
        import json, threading, torch, tf32lab
        a, b = torch.randn(8, 8), torch.randn(8, 8)
        out, go = {}, threading.Event()
        def worker():
            go.wait()
            try:
                with tf32lab.precision("highest"):
                    out["level"] = tf32lab.get_float32_matmul_precision()
                    a @ b
                    out["ran"] = True
            except tf32lab.Tf32LabError as exc:
                out["error"] = str(exc)
        t = threading.Thread(target=worker)
        if "{mode}" == "threads first":
            t.start()
        with tf32lab.precision("high"):
            if "{mode}" != "threads first":
                t.start()
            go.set()
            t.join()
            agreed = tf32lab.get_float32_matmul_precision()
        live = tf32lab.control.scope.live_scopes()
        print(json.dumps([out.get("level"), out.get("ran"), out.get("error"), agreed, live]))
    """
    refused = run_python(code.replace("{mode}", "alone"))
    assert refused.returncode == 0, refused.stderr
    level, ran, error, agreed, live = json.loads(refused.stdout)
    assert (level, ran, agreed, live) == ("highest", None, "high", 0)
    assert "enter that scope after starting the threads, or set TF32LAB_SCOPE_GUARD=always" in error
    for mode, env in (("threads first", {}), ("alone", {"TF32LAB_SCOPE_GUARD": "always"})):
        done = run_python(code.replace("{mode}", mode), **env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == ["highest", True, None, "high", 0], (mode, env, done.stdout)


def test_reading_the_level_from_a_helper_thread_never_deadlocks_a_guarded_op():
    code = """
        import threading, torch, tf32lab
        torch.library.define("tf32lab_helper::mm", "(Tensor a, Tensor b) -> Tensor")

        @torch.library.impl("tf32lab_helper::mm", "cpu")
        def _mm(a, b):
            seen = []
            helper = threading.Thread(target=lambda: seen.append(tf32lab.get_float32_matmul_precision()))
            helper.start(); helper.join()
            return a @ b if seen else None

        a, b = torch.randn(4, 4), torch.randn(4, 4)
        hold, release = threading.Event(), threading.Event()
        def other():
            with tf32lab.precision("high"):
                hold.set(); release.wait()
        def worker(out):
            with tf32lab.precision("medium"):  # contended: the op runs with the flags written for it
                out.append(torch.ops.tf32lab_helper.mm(a, b).shape)
        t = threading.Thread(target=other); t.start(); hold.wait()
        out = []
        w = threading.Thread(target=worker, args=(out,)); w.start(); w.join()
        release.set(); t.join()
        print(out)
    """
    done = run_python(code, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[torch.Size([4, 4])]"


# -- 4. out-of-order and cross-task exits never leave the process stuck -----------------------------------------
def test_generators_closed_in_opening_order():
    before = flags.snapshot()

    def gen(level):
        with precision(level):
            yield tf32lab.get_float32_matmul_precision()

    first, second = gen("high"), gen("medium")
    assert next(first) == "high" and next(second) == "medium"
    first.close()
    assert tf32lab.get_float32_matmul_precision() == "medium"  # the open one still holds
    second.close()
    assert scope.live_scopes() == 0
    assert tf32lab.get_float32_matmul_precision() == "highest"
    assert flags.snapshot() == before


@pytest.mark.parametrize("entering_task", ["alive", "ended"])
def test_a_scope_entered_in_one_task_and_exited_in_another(entering_task):
    before = flags.snapshot()
    p = precision("high")

    async def enter(left):
        p.__enter__()
        if entering_task == "alive":
            await left.wait()

    async def leave(left):
        with pytest.raises(Tf32LabError, match=r"was entered in (another task|a task of thread 'MainThread', "
                                               r"which ended)"):
            p.__exit__(None, None, None)
        left.set()

    async def main():
        left = asyncio.Event()
        entering = asyncio.ensure_future(enter(left))
        await asyncio.sleep(0)
        if entering_task == "ended":
            await entering
        await asyncio.ensure_future(leave(left))
        await entering
        assert tf32lab.get_float32_matmul_precision() == "highest"

    asyncio.run(main())
    assert scope.live_scopes() == 0
    assert flags.snapshot() == before


def test_a_task_that_ends_with_a_scope_open_gives_it_back():
    before = flags.snapshot()

    async def leak():
        precision("medium").__enter__()  # never exited

    asyncio.run(leak())
    assert scope.live_scopes() == 0
    assert flags.snapshot() == before


# -- soak: scopes and emulate() blocks nested at random in threads and tasks ---------------------------------------
def _expected() -> dict:
    """What a 16x512 @ 512x64 product must be, natively at each level and emulated on each target at each level."""
    from tf32lab.know import levels, targets
    from tf32lab.numbers import formats

    out = {("native", level): native(level) for level in tf32lab.LEVELS}
    for target in ("a100", "cpu-amx"):
        for level in tf32lab.LEVELS:
            cuda, mkldnn = levels.BACKEND_VALUES[level]
            math = targets.get(target).math("matmul", {"cuda.matmul": cuda, "mkldnn.matmul": mkldnn})
            rnd = {"ieee": lambda t, **_: t, "tf32": formats.round_tf32, "bf16": formats.round_bf16}[math.name]
            kw = {} if math.rounding is None else {"rounding": math.rounding}
            out[(target, level)] = native_ieee(rnd(A, **kw), rnd(B, **kw))
    return out


def native_ieee(a, b):
    with precision("highest"):
        return a @ b


def _walk(rng, steps: int, expected: dict, errors: list[str], who: str) -> None:
    stack: list = []  # (kind, object)
    for _ in range(steps):
        if stack and (len(stack) >= 4 or rng.random() < 0.4):
            stack.pop()[1].__exit__(None, None, None)
        elif rng.random() < 0.35:
            emu = tf32lab.emulate(rng.choice(("a100", "cpu-amx")))
            emu.__enter__()
            stack.append(("emulate", emu))
        else:
            p = precision(rng.choice(tf32lab.LEVELS))
            p.__enter__()
            stack.append(("precision", p))
        if not stack:
            continue  # code outside any scope claims no level (docs/design.md)
        level = next((o.level for k, o in reversed(stack) if k == "precision"), "highest")  # the process level
        target = next((o.target.name for k, o in reversed(stack) if k == "emulate"), "native")
        got = A @ B
        if not torch.equal(got, expected[(target, level)]):
            errors.append(f"{who}: {target} at {level} gave another product")
    while stack:
        stack.pop()[1].__exit__(None, None, None)


def test_soak_scopes_and_emulate_blocks_in_threads_and_tasks():
    import random

    expected = _expected()
    errors: list[str] = []
    start = threading.Barrier(6)

    def worker(seed: int) -> None:
        try:
            start.wait()
            _walk(random.Random(seed), 150, expected, errors, f"thread {seed}")
        except Exception as exc:
            errors.append(f"thread {seed}: {exc!r}")

    async def task(seed: int) -> None:
        rng = random.Random(100 + seed)
        for _ in range(40):
            _walk(rng, 3, expected, errors, f"task {seed}")
            await asyncio.sleep(0)

    async def tasks() -> None:
        await asyncio.gather(*(task(seed) for seed in range(4)))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(5)]
    for t in threads:
        t.start()
    start.wait()
    asyncio.run(tasks())
    for t in threads:
        t.join()
    assert errors == []
    assert scope.live_scopes() == 0 and _get_current_dispatch_mode_stack() == []
