"""The pytest plugin, through real pytest runs in subprocesses (pytester): a tolerance-too-tight test, a pinned
test, a twice-run test, a strict-mode failure, a leak, xdist, and that it costs nothing when off."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest_plugins = ["pytester"]

SUITE = textwrap.dedent("""
    import threading

    import pytest
    import torch

    import tf32lab
    from tf32lab.testing import assert_close

    torch.manual_seed(0)
    A, B = torch.randn(64, 1024), torch.randn(1024, 64)
    EXACT = (A.double() @ B.double()).float()


    def test_tolerance_too_tight():
        # float32's own tolerance: true on a CPU, false on an A100 at `high`
        torch.testing.assert_close(A @ B, EXACT, rtol=1e-5, atol=1e-4)


    def test_writes_into_a_fresh_folder(tmp_path):
        # run again at highest by --tf32lab-compare: with fresh fixtures, or mkdir would fail the second time
        (tmp_path / "out").mkdir()
        torch.testing.assert_close(A @ B, EXACT, rtol=1e-5, atol=1e-4)


    @pytest.mark.tf32lab(level="highest")
    def test_pinned_to_highest():
        torch.testing.assert_close(A @ B, EXACT, rtol=1e-5, atol=1e-4)


    @pytest.mark.tf32lab_levels("highest", "high")
    def test_twice(tf32lab_level):
        assert tf32lab.get_float32_matmul_precision() == tf32lab_level
        assert_close(A @ B, EXACT, operands=(A, B), level=tf32lab_level)


    def test_derived_tolerance(tf32lab_level):
        assert_close(A @ B, EXACT, operands=(A, B), level=tf32lab_level or "highest")


    def test_a_thread_of_its_own():
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("y", A @ B))
        worker.start()
        worker.join()
        assert out["y"].shape == (64, 64)
""")

STRICT = textwrap.dedent("""
    import torch

    def test_sparse_product():
        s = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
        torch.hspmm(s, torch.randn(2, 3))
""")

LEAK = textwrap.dedent("""
    import torch

    import tf32lab

    def test_leaks_a_flag():
        torch.set_float32_matmul_precision("medium")

    def test_sees_the_default():
        assert torch.get_float32_matmul_precision() == "highest"

    def test_leaks_a_mode_put_on_raw():
        from torch.utils._python_dispatch import TorchDispatchMode

        class Stray(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        torch._C._push_on_torch_dispatch_stack(Stray())  # no __enter__: its __exit__ would fail

    def test_leaks_a_scope():
        tf32lab.precision("medium").__enter__()

    def test_runs_in_its_own_scope_only():
        assert tf32lab.scope.live_scopes() == 1 and tf32lab.get_float32_matmul_precision() == "high"
""")


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args, timeout=600)


def test_a_suite_as_an_a100_computes_it(pytester: pytest.Pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = _run(pytester, "--tf32lab", "a100:high", "--tf32lab-compare", "-v")
    result.assert_outcomes(passed=5, failed=2)
    result.stdout.fnmatch_lines([
        "tf32lab: each test runs at precision 'high' as a100 computes them (emulated here), failures compared*",
        "*test_tolerance_too_tight FAILED*",
        "*test_pinned_to_highest PASSED*",
        "*test_twice?tf32lab-highest? PASSED*",
        "*test_twice?tf32lab-high? PASSED*",
        "*2 test(s) failed under tf32lab; 2 of them only there (they pass at highest):",
        "*test_tolerance_too_tight: fails only under a100:high: passes at highest",
        "*test_writes_into_a_fresh_folder: fails only under a100:high: passes at highest",
    ])
    assert "left global state changed" not in result.stdout.str()


def test_without_the_option_the_suite_runs_natively_and_markers_still_work(pytester: pytest.Pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=7)
    assert "tf32lab: each test runs" not in result.stdout.str()


def test_the_ini_key_and_the_environment_turn_it_on(pytester: pytest.Pytester, monkeypatch):
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini("[pytest]\ntf32lab = a100\n")
    _run(pytester).assert_outcomes(passed=5, failed=2)
    pytester.makeini("[pytest]\n")
    monkeypatch.setenv("TF32LAB_PYTEST", "h100:high")
    result = _run(pytester)
    result.assert_outcomes(passed=5, failed=2)
    result.stdout.fnmatch_lines(["*precision 'high' as h100 computes them*"])


def test_strict_mode_fails_a_test_that_ran_an_op_it_cannot_emulate(pytester: pytest.Pytester):
    pytester.makepyfile(test_strict=STRICT)
    _run(pytester, "--tf32lab", "a100:high").assert_outcomes(passed=1)
    result = _run(pytester, "--tf32lab", "a100:high", "--tf32lab-strict")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*aten::hspmm belongs to a precision-sensitive family but has no emulation rule*"])


def test_a_test_that_leaks_a_flag_or_a_scope_is_named_and_the_next_test_does_not_inherit_it(pytester: pytest.Pytester):
    pytester.makepyfile(test_leak=LEAK)
    result = _run(pytester, "--tf32lab", "a100:high")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines([
        "left global state changed: test_leak.py::test_leaks_a_flag: PyTorch flags changed*put back",
        "left global state changed: test_leak.py::test_leaks_a_mode_put_on_raw: 1 dispatch mode(s) left on the stack"
        " (Stray), taken off",
        "left global state changed: test_leak.py::test_leaks_a_scope: 1 precision() scope(s) or emulate() block(s)"
        " left open, closed*",
    ])


def test_parallel_workers_each_set_themselves_up(pytester: pytest.Pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = _run(pytester, "-n", "2", "--tf32lab", "a100:high", "--tf32lab-compare")
    result.assert_outcomes(passed=5, failed=2)
    result.stdout.fnmatch_lines(["*test_tolerance_too_tight: fails only under a100:high: passes at highest"])


@pytest.mark.parametrize("args, message", [
    (["--tf32lab", "b200:high"], "*--tf32lab 'b200:high': unknown target 'b200'; accepted: native, v100*"),
    (["--tf32lab", "a100:fast"], "*--tf32lab 'a100:fast': unknown level 'fast'; accepted: highest, high, medium*"),
    (["--tf32lab-strict"], "*--tf32lab-strict and --tf32lab-compare need --tf32lab TARGET?:LEVEL?*"),
])
def test_a_bad_option_is_a_usage_error(pytester: pytest.Pytester, args, message):
    pytester.makepyfile(test_suite="def test_nothing():\n    pass\n")
    result = _run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_loaded_but_off_it_imports_no_torch(pytester: pytest.Pytester):
    pytester.makeconftest(textwrap.dedent("""
        import sys

        def pytest_collection_finish(session):
            assert "tf32lab.pytest_plugin" in sys.modules, "the plugin is registered"
            assert "torch" not in sys.modules, "the plugin imported torch while off"
    """))
    pytester.makepyfile(test_plain="def test_nothing():\n    pass\n")
    _run(pytester).assert_outcomes(passed=1)
    done = subprocess.run([sys.executable, "-m", "pytest", "--help"], capture_output=True, text=True, timeout=120,
                          cwd=pytester.path)
    assert done.returncode == 0 and "--tf32lab=TARGET[:LEVEL]" in done.stdout


TOLERANCE = textwrap.dedent("""
    import pytest
    import torch

    import tf32lab
    from tf32lab.testing import assert_close, unit_roundoff

    torch.manual_seed(0)
    A, B = torch.randn(64, 1024), torch.randn(1024, 64)
    EXACT = (A.double() @ B.double()).float()


    def test_the_runs_level_decides():
        with tf32lab.precision("high"):
            y = A @ B  # TF32, as the A100 being emulated computes it at high
        assert_close(y, EXACT, operands=(A, B), level="high")
        with pytest.raises(AssertionError, match="at 'highest' on a100 \\(ieee\\)"):
            assert_close(y, EXACT, operands=(A, B))  # the run's level: float32's tolerance


    @pytest.mark.tf32lab(target="cpu-amx", level="medium")
    def test_the_markers_target_and_level_decide():
        assert unit_roundoff() == (2.0**-8, "bf16-rne")
        assert_close(A @ B, EXACT, operands=(A, B))
""")


def test_assert_close_follows_the_target_and_level_of_the_run(pytester: pytest.Pytester):
    pytester.makepyfile(test_tolerance=TOLERANCE)
    _run(pytester, "--tf32lab", "a100:highest").assert_outcomes(passed=2)


def test_assert_close_takes_the_math_of_the_emulation_and_the_scope_it_runs_in():
    import torch

    import tf32lab
    from tf32lab.testing import assert_close, unit_roundoff

    torch.manual_seed(0)
    a, b = torch.randn(32, 512), torch.randn(512, 16)
    exact = (a.double() @ b.double()).float()
    with tf32lab.precision("medium"), tf32lab.emulate("cpu-amx"):
        y = a @ b
        assert unit_roundoff() == (2.0**-8, "bf16-rne")
        assert_close(y, exact, operands=(a, b))  # bf16's tolerance
    with tf32lab.emulate("a100"), pytest.raises(AssertionError, match=r"at 'highest' on a100 \(ieee\)"):
        assert_close(y, exact, operands=(a, b))  # at highest: float32's, which the bf16 result misses
    with tf32lab.emulate("a100", math="bf16"):  # a math the block forces is the one in force
        assert unit_roundoff()[1] == "bf16-rne"
    assert unit_roundoff("highest") == (2.0**-24, "ieee")  # no emulation: this machine's CPU at highest
    with pytest.raises(tf32lab.Tf32LabError, match="unknown level 'fast'; accepted: 'highest', 'high', 'medium'"):
        assert_close(y, exact, operands=(a, b), level="fast")
