"""An emulate() block's backward on a GPU: autograd runs it on a device thread of its own, which carries the
block's dispatch modes but not its context (the block, its precision scope). On an H200 every op there ran as if no
block were open: the GEMMs natively, and attention's backward op failed. The launching thread's context now reaches
them (``emulation.backward_threads``). No GPU here: a thread stands in for autograd's, carrying the mode as the
engine does."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

import tf32lab
from emulation_reference import randn
from tf32lab.emulation import backward_threads, emulator
from tf32lab.errors import Tf32LabError


def _on_a_device_thread(fn, backward: bool = True):
    """``fn()`` on another thread that holds this thread's emulator dispatch mode and none of its context, inside a
    backward there as autograd's device thread runs one (``backward=False``: outside any, as another thread)."""
    mode, found = emulator._thread_modes().dispatch, []

    def in_a_backward():
        leaf = torch.zeros((), requires_grad=True)
        leaf.register_hook(lambda grad: found.append(fn()))
        (leaf * 1).backward()

    def run():
        try:
            with mode:
                in_a_backward() if backward else found.append(fn())
        except BaseException as exc:  # raised again on the caller's thread
            found.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if isinstance(found[0], BaseException):
        raise found[0]
    return found[0]


def test_a_device_threads_op_is_emulated_as_the_launching_block_asks():
    a, b = randn(16, 96, seed=1), randn(96, 16, seed=2)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        here = torch.mm(a, b)
        with backward_threads.launched():
            there = _on_a_device_thread(lambda: torch.mm(a, b))
        unlaunched = _on_a_device_thread(lambda: torch.mm(a, b))
    assert torch.equal(there, here) and not torch.equal(here, a @ b)  # TF32, at the block's level
    assert dict(emu.coverage) == {("aten::mm", "tf32-rna"): 2}
    assert torch.equal(unlaunched, a @ b)  # no backward launched: nothing to take the block from


def test_two_threads_launching_at_once_are_refused_on_a_device_thread():
    started, release = threading.Event(), threading.Event()

    def other():
        with backward_threads.launched():
            started.set()
            release.wait(10)

    worker = threading.Thread(target=other)
    worker.start()
    started.wait(10)
    try:
        with tf32lab.emulate("a100"), backward_threads.launched(), \
                pytest.raises(Tf32LabError, match="2 threads run an emulated backward at once"):
            _on_a_device_thread(lambda: torch.mm(randn(4, 4, seed=5), randn(4, 4, seed=6)))
    finally:
        release.set()
        worker.join()
    assert not backward_threads.LAUNCHED


def test_a_backward_on_the_cpu_registers_nothing():
    x = randn(4, 8, seed=3).requires_grad_()
    seen = []

    def hook(grad):
        seen.append(bool(backward_threads.LAUNCHED))
        return grad

    x.register_hook(hook)
    with tf32lab.emulate("a100"):
        (x @ randn(8, 2, seed=4)).sum().backward()
    assert seen == [False] and x.grad is not None


def test_another_thread_outside_a_backward_keeps_its_own_math():
    # A thread that holds the emulator's modes (another task of it has a block open) and runs an op while a GPU
    # backward of this block runs: not autograd's device thread, it took this block before (emulated, counted here)
    a, b = randn(16, 96, seed=7), randn(96, 16, seed=8)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu, backward_threads.launched():
        there = _on_a_device_thread(lambda: torch.mm(a, b), backward=False)
    assert torch.equal(there, a @ b) and not emu.coverage


def test_two_threads_in_one_block_are_one():
    started, release = threading.Event(), threading.Event()
    a, b = randn(16, 96, seed=9), randn(96, 16, seed=10)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        block = tf32lab.control.scope.current_emulation()

        def other():
            with backward_threads.launched(block):
                started.set()
                release.wait(10)

        worker = threading.Thread(target=contextvars.copy_context().run, args=(other,))  # a thread of the block
        worker.start()
        started.wait(10)
        try:
            with backward_threads.launched(block):
                there = _on_a_device_thread(lambda: torch.mm(a, b))
        finally:
            release.set()
            worker.join()
    assert not torch.equal(there, a @ b) and dict(emu.coverage) == {("aten::mm", "tf32-rna"): 1}


def test_a_scope_entered_on_the_device_thread_governs_its_ops():
    # a backward hook (or a custom Function's backward) that enters precision() runs its ops at that level, on
    # autograd's device thread as on the launching one: each op ran in a copy of the launcher's context alone
    a, b = randn(16, 96, seed=11), randn(96, 16, seed=12)

    def pinned():
        with tf32lab.precision("highest"):
            return torch.mm(a, b)

    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu, backward_threads.launched():
        there = _on_a_device_thread(pinned)
    assert torch.equal(there, a @ b) and dict(emu.coverage) == {("aten::mm", "ieee"): 1}


def test_a_scope_left_on_the_device_thread_gives_its_ops_back_to_the_block():
    # leaving precision() sets the device thread's own scope variable to None: laid over the launcher's context,
    # it hid the block's scope from every later op there (the process level, not the block's)
    a, b = randn(16, 96, seed=13), randn(96, 16, seed=14)

    def pinned_then_not():
        with tf32lab.precision("highest"):
            torch.mm(a, b)
        return torch.mm(a, b)

    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu, backward_threads.launched():
        here = torch.mm(a, b)
        there = _on_a_device_thread(pinned_then_not)
    assert torch.equal(there, here) and dict(emu.coverage) == {("aten::mm", "ieee"): 1, ("aten::mm", "tf32-rna"): 2}


def test_an_emulate_block_left_on_the_device_thread_gives_its_ops_back_to_the_block():
    # leaving emulate() there set the thread's block variable to None: laid over the launcher's context, an op
    # found no block, asked for the launcher's context again, and recursed until RecursionError
    a, b = randn(16, 96, seed=15), randn(96, 16, seed=16)

    def emulated_then_not():
        with tf32lab.emulate("h100") as inner:
            pinned = torch.mm(a, b)
        return inner, pinned, torch.mm(a, b)

    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu, backward_threads.launched():
        here = torch.mm(a, b)
        inner, pinned, there = _on_a_device_thread(emulated_then_not)
    assert torch.equal(there, here) and dict(emu.coverage) == {("aten::mm", "tf32-rna"): 2}
    # the inner block holds no scope of the outer thread's: the process level there, IEEE
    assert torch.equal(pinned, a @ b) and set(inner.coverage) == {("aten::mm", "ieee")}


def test_a_launcher_context_without_an_open_block_passes_ops_on():
    # a launcher's context whose block is gone (closed from elsewhere while its backward runs) made each op ask for
    # that context again from inside it, until RecursionError: the op now runs natively
    a, b = randn(16, 96, seed=17), randn(96, 16, seed=18)
    blockless = contextvars.copy_context()
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        backward_threads.LAUNCHED[-1] = (blockless, None)
        try:
            there = _on_a_device_thread(lambda: torch.mm(a, b))
        finally:
            del backward_threads.LAUNCHED[-1]
    assert torch.equal(there, a @ b) and not emu.coverage


def test_two_threads_in_one_block_at_two_levels_are_refused():
    # one block, but each thread in its own precision() scope: the device thread's op took the level of whichever
    # thread registered first (here the other's "highest", not this thread's "high"), silently
    started, release = threading.Event(), threading.Event()
    a, b = randn(16, 96, seed=19), randn(96, 16, seed=20)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        block = tf32lab.control.scope.current_emulation()

        def other():
            with tf32lab.precision("highest"), backward_threads.launched(block):
                started.set()
                release.wait(10)

        worker = threading.Thread(target=contextvars.copy_context().run, args=(other,))
        worker.start()
        started.wait(10)
        try:
            with backward_threads.launched(block), \
                    pytest.raises(Tf32LabError, match="2 threads run an emulated backward at once"):
                _on_a_device_thread(lambda: torch.mm(a, b))
        finally:
            release.set()
            worker.join()


def test_on_a_machine_with_cuda_up_any_backward_in_a_block_registers(monkeypatch):
    # loss.cpu().backward() goes back through a GPU's graph: its root on the CPU says nothing of the device thread
    # its GPU nodes run on, so on a machine where CUDA is initialized every backward in a block registers
    x = randn(4, 8, seed=13).requires_grad_()
    seen = []
    x.register_hook(lambda grad: seen.append(bool(backward_threads.LAUNCHED)))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with tf32lab.emulate("a100"):
        (x @ randn(8, 2, seed=14)).sum().backward()
    assert seen == [True] and not backward_threads.LAUNCHED


def test_a_device_threads_warning_is_put_down_to_the_code_that_made_the_call(monkeypatch):
    # on autograd's device thread the function mode's handler hands the call to the block's context
    # (backward_threads.run_in), which calls the handler again: the warning was put down to backward_threads
    import warnings

    monkeypatch.setattr(backward_threads, "LAUNCHED", True)
    monkeypatch.setattr(backward_threads, "launcher", lambda: None if backward_threads._RUNNING.get(False)
                        else contextvars.copy_context())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("error", category=UserWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=__name__)
        with emulator._FunctionMode():
            torch.add(torch.ones(3), torch.ones(3), out=torch.empty(5))  # a kernel's TORCH_WARN
    assert seen == []
