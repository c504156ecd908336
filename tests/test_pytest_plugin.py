"""The pytest plugin, through real pytest runs in subprocesses (pytester): a tolerance-too-tight test, a pinned
test, a twice-run test, a strict-mode failure, a leak, xdist, errors of tf32lab's own, the rerun's clean state,
fixtures of wider scope, bad markers, and that it costs nothing when off; ``tf32lab.testing``'s tolerance."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

from inner_pytest import run as _run

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

    def test_matrix_exponential():
        torch.linalg.matrix_exp(torch.randn(3, 3))  # a kernel whose inner GEMMs the emulator cannot reach
""")

LEAK = textwrap.dedent("""
    import pytest
    import torch

    import tf32lab

    def test_leaks_a_flag():
        torch.set_float32_matmul_precision("medium")

    @pytest.fixture
    def sets_a_flag_for_good():
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False

    def test_uses_a_fixture_that_leaks(sets_a_flag_for_good):
        pass

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
        assert tf32lab.control.scope.live_scopes() == 1 and tf32lab.get_float32_matmul_precision() == "high"
""")




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
    result.stdout.fnmatch_lines([
        "*aten::linalg_matrix_exp belongs to a precision-sensitive family but has no emulation rule*",
        # a request tf32lab cannot honour, not an effect of precision
        "*test_matrix_exponential: tf32lab refused (not precision): Tf32LabError: emulate(strict=True): "
        "aten::linalg_matrix_exp*"
        " (tf32lab/emulation/emulator.py:*)",
    ])


# Before torch 2.11 (2.4.1 to 2.9.1 measured; 2.10 not run) PyTorch itself crashes on a mode put on raw once it has
# been read off the stack and is put back: torch._C._get_dispatch_stack_at, _pop_torch_dispatch_stack, then
# _push_on_torch_dispatch_stack of the same mode segfaults inside the push, with no tf32lab in the process.
RAW_MODES_SURVIVE = tuple(int(p) for p in version("torch").split(".")[:2]) >= (2, 11)


def test_a_test_that_leaks_a_flag_or_a_scope_is_named_and_the_next_test_does_not_inherit_it(pytester: pytest.Pytester):
    leak = LEAK if RAW_MODES_SURVIVE else LEAK.replace("def test_leaks_a_mode_put_on_raw", "def _not_run")
    pytester.makepyfile(test_leak=leak)
    result = _run(pytester, "--tf32lab", "a100:high")
    result.assert_outcomes(passed=6 if RAW_MODES_SURVIVE else 5)
    result.stdout.fnmatch_lines([
        "left global state changed: test_leak.py::test_leaks_a_flag: PyTorch flags changed*put back",
        "left global state changed: test_leak.py::test_uses_a_fixture_that_leaks: PyTorch flags changed"
        " (*allow_fp16_reduced_precision_reduction*), put back",
        *(["left global state changed: test_leak.py::test_leaks_a_mode_put_on_raw: 1 dispatch mode(s) left on the "
           "stack (Stray), taken off"] if RAW_MODES_SURVIVE else []),
        "left global state changed: test_leak.py::test_leaks_a_scope: 1 precision() scope(s) or emulate() block(s)"
        " left open, closed*",
    ])


def test_parallel_workers_each_set_themselves_up(pytester: pytest.Pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = _run(pytester, "-n", "2", "--tf32lab", "a100:high", "--tf32lab-compare")
    result.assert_outcomes(passed=5, failed=2)
    result.stdout.fnmatch_lines(["*test_tolerance_too_tight: fails only under a100:high: passes at highest"])


@pytest.mark.parametrize("args, message", [
    (["--tf32lab", "b900:high"], "*--tf32lab 'b900:high': unknown target 'b900'; accepted: native, v100*"),
    (["--tf32lab", "a100:fast"], "*--tf32lab 'a100:fast': unknown level 'fast'; accepted: 'highest', 'bfx9', 'high', "
                                 "'medium'*"),
    (["--tf32lab-strict"], "*--tf32lab-strict and --tf32lab-compare need --tf32lab TARGET?:LEVEL?*"),
])
def test_a_bad_option_is_a_usage_error(pytester: pytest.Pytester, args, message):
    pytester.makepyfile(test_suite="def test_nothing():\n    pass\n")
    result = _run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize("where, message", [
    ("env", "*TF32LAB_PYTEST='bogus' (TARGET?:LEVEL?): unknown target 'bogus'; accepted: native, v100*"),
    ("env", "*TF32LAB_PYTEST='a100:fast' (TARGET?:LEVEL?): unknown level 'fast'; accepted: 'highest', 'bfx9', 'high', "
            "'medium'*"),
    ("ini", "*the ini key tf32lab='bogus' (TARGET?:LEVEL?): unknown target 'bogus'; accepted: native, v100*"),
], ids=["env-target", "env-level", "ini"])
def test_a_bad_environment_variable_or_ini_key_is_a_usage_error_naming_it(pytester: pytest.Pytester, monkeypatch,
                                                                         where, message):
    # It named "--tf32lab 'bogus'", an option the user never gave.
    pytester.makepyfile(test_suite="def test_nothing():\n    pass\n")
    value = message.split("='")[1].split("'")[0]
    if where == "env":
        monkeypatch.setenv("TF32LAB_PYTEST", value)
    else:
        pytester.makeini(f"[pytest]\ntf32lab = {value}\n")
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "--tf32lab '" not in result.stderr.str()


def test_loaded_but_off_it_imports_no_torch(pytester: pytest.Pytester):
    pytester.makeconftest(textwrap.dedent("""
        import sys

        def pytest_collection_finish(session):
            assert "tf32lab.pytest_plugin" in sys.modules, "the plugin is registered"
            assert "torch" not in sys.modules, "the plugin imported torch while off"
    """))
    pytester.makepyfile(test_plain="def test_nothing():\n    pass\n")
    _run(pytester, fresh=True).assert_outcomes(passed=1)  # fresh: the server has imported torch
    done = subprocess.run([sys.executable, "-m", "pytest", "--help"], capture_output=True, text=True, timeout=120,
                          cwd=pytester.path)
    assert done.returncode == 0 and "--tf32lab=TARGET[:LEVEL]" in done.stdout


INTERNAL_ERROR = textwrap.dedent("""
    import torch

    import tf32lab
    from tf32lab import rules

    # A custom op, given tf32lab's own addmm rule through the registry: that rule takes three operands and the
    # op has two, so the op fails inside tf32lab, while natively it computes fine.
    LIB = torch.library.Library("tf32labplugintest", "DEF")
    LIB.define("product(Tensor a, Tensor b) -> Tensor")
    LIB.impl("product", lambda a, b: a @ b, "CompositeExplicitAutograd")
    rules.rule(torch.ops.tf32labplugintest.product)(rules.RULES[torch.ops.aten.addmm])

    A, B = torch.randn(8, 16), torch.randn(16, 4)


    def test_an_op_whose_rule_breaks():
        assert torch.ops.tf32labplugintest.product(A, B).shape == (8, 4)


    def test_an_ops_own_error():
        # passed on by the emulator unchanged: the op's own error, as natively
        torch.linalg.cholesky(-torch.eye(3))


    def test_shapes_that_do_not_multiply():
        # met first by the mm rule, on its rounded copies: still the test's own error, as natively
        A @ A


    def test_a_backward_of_a_loss_that_needs_no_gradient():
        # refused by autograd's engine before any op of the backward ran: the test's own error, as natively
        (A @ B).sum().backward()


    def test_a_backward_of_a_loss_that_is_not_a_scalar():
        (A.requires_grad_() @ B).backward()


    @tf32lab.precision("high")
    def helper():
        raise ValueError("the project's own error")


    def test_the_projects_code_called_back_from_tf32lab():
        helper()
""")


def test_an_error_raised_inside_tf32lab_is_never_put_down_to_precision(pytester: pytest.Pytester):
    pytester.makepyfile(test_internal=INTERNAL_ERROR)
    result = _run(pytester, "--tf32lab", "a100:high", "--tf32lab-compare")
    result.assert_outcomes(failed=6)
    result.stdout.fnmatch_lines([
        "6 test(s) failed under tf32lab; 0 of them only there (they pass at highest); 1 because of tf32lab itself,"
        " not precision:",
        "*test_an_op_whose_rule_breaks: tf32lab error (not precision): ValueError: not enough values to unpack*"
        " (tf32lab/emulation/rules.py:*), please report",
        "*test_an_ops_own_error: fails at highest too (call: *not positive-definite*",
        "*test_shapes_that_do_not_multiply: fails at highest too (call: RuntimeError: mat1 and mat2 shapes cannot*",
        "*test_a_backward_of_a_loss_that_needs_no_gradient: fails at highest too (call: RuntimeError: element 0 of*",
        "*test_a_backward_of_a_loss_that_is_not_a_scalar: fails at highest too (call: RuntimeError: grad can be*",
        "*test_the_projects_code_called_back_from_tf32lab: fails at highest too (call: ValueError: the project's*",
    ])
    assert "passes at highest" not in result.stdout.str()
    result = _run(pytester, "--tf32lab", "a100:high")  # no rerun: said as plainly as it is known
    result.stdout.fnmatch_lines([
        "*test_an_op_whose_rule_breaks: tf32lab error (not precision): ValueError: *(tf32lab/emulation/rules.py:*); "
        "please report it if the test passes without --tf32lab",
        "*test_an_ops_own_error: fails under a100:high",
        "*test_shapes_that_do_not_multiply: fails under a100:high",
        "*test_a_backward_of_a_loss_that_needs_no_gradient: fails under a100:high",
        "*test_a_backward_of_a_loss_that_is_not_a_scalar: fails under a100:high",
        "*test_the_projects_code_called_back_from_tf32lab: fails under a100:high",
    ])


TRACED = textwrap.dedent("""
    import pytest
    import torch

    pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


    def test_traces_a_float64_conv_model():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).double()
        x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
        traced = torch.jit.trace(model, (x,))
        torch.testing.assert_close(traced(x), model(x))


    def test_traces_a_function_that_returns_nothing():
        # the tracer refuses it natively too
        torch.jit.trace(lambda x: None, (torch.ones(2),))
""")


def test_a_traced_float64_conv_model_passes_under_emulation(pytester: pytest.Pytester):
    # It failed in the tracer ("Cannot insert a Tensor that requires grad as a constant"), reported as "fails only
    # under a100:high: passes at highest": a crash of tf32lab's blamed on TF32.
    pytester.makepyfile(test_traced=TRACED)
    result = _run(pytester, "--tf32lab", "a100:high", "--tf32lab-compare", "-k", "float64")
    result.assert_outcomes(passed=1)
    assert "failed under tf32lab" not in result.stdout.str()


def test_an_error_of_the_tracer_under_emulate_is_not_put_down_to_precision(pytester: pytest.Pytester):
    # The tracer raises in C++ after the forward returned, where no frame of tf32lab's is left to see. To have
    # such an error at hand, the conftest puts back the emulator's pass-through as it was before the fix (the
    # tracer's key left excluded), with real torch and a real trace.
    pytester.makeconftest(textwrap.dedent("""
        import tf32lab.emulation.emulator as emulator

        emulator._passed_on = emulator._native
    """))
    pytester.makepyfile(test_traced=TRACED)
    result = _run(pytester, "--tf32lab", "a100:high", "--tf32lab-compare")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "2 test(s) failed under tf32lab; 0 of them only there (they pass at highest); 1 in torch.jit.trace under"
        " emulate(), not precision:",
        "*test_traces_a_float64_conv_model: tf32lab error or interaction (not precision): RuntimeError: Cannot insert"
        " a Tensor that requires grad as a constant*(raised by torch.jit.trace under emulate()), please report",
        "*test_traces_a_function_that_returns_nothing: fails at highest too (call: RuntimeError: The traced function*",
    ])
    assert "passes at highest" not in result.stdout.str()
    result = _run(pytester, "--tf32lab", "a100:high")  # no rerun: said as plainly as it is known
    result.stdout.fnmatch_lines([
        "*test_traces_a_float64_conv_model: tf32lab error or interaction (not precision): RuntimeError: *"
        "(raised by torch.jit.trace under emulate()); please report it if the test passes without --tf32lab",
    ])
    result = _run(pytester, "--tf32lab", "native:high")  # no emulation, no interaction: the test's failure
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_traces_a_function_that_returns_nothing: fails under native:high"])


RERUN = textwrap.dedent("""
    import random

    import torch

    torch.manual_seed(0)
    A, B = torch.randn(64, 1024), torch.randn(1024, 64)
    EXACT = (A.double() @ B.double()).float()
    DRAWN = []


    def product(a, b):
        return a @ b


    def test_compiled_with_fullgraph():
        # what the emulated run compiled (or failed to) must not fail the rerun at highest
        y = torch.compile(product, fullgraph=True, backend="eager")(A, B)
        torch.testing.assert_close(y, EXACT, rtol=1e-5, atol=1e-4)


    def test_draws_what_the_first_run_drew():
        DRAWN.append((random.random(), torch.rand(1).item()))
        assert DRAWN[-1] == DRAWN[0], "the rerun drew other numbers"
        torch.testing.assert_close(A @ B, EXACT, rtol=1e-5, atol=1e-4)
""")


WARNED = textwrap.dedent("""
    import pytest
    import torch

    # errors, but for the warnings this module's own calls raise: natively they are put down to it
    pytestmark = pytest.mark.filterwarnings("error", "ignore::UserWarning:test_warned")

    def test_a_python_functions_warning():
        torch.nn.functional.mse_loss(torch.randn(3, 1), torch.randn(3))  # warns stacklevel=2: its caller

    def test_a_kernels_warning():
        torch.add(torch.ones(3), torch.ones(3), out=torch.empty(5))  # TORCH_WARN: the innermost Python frame

    def test_an_implicit_dimension():
        torch.nn.functional.softmax(torch.randn(3))  # warns stacklevel=2 from a function written in Python
""")


def test_a_tests_warning_filters_by_module_hold_under_the_plugin(pytester: pytest.Pytester):
    # the function mode made every torch call once more from tf32lab's frame, and the warning was put down to
    # tf32lab.emulation.emulator: "ignore::UserWarning:test_warned" no longer matched, the test failed under the
    # plugin, and --tf32lab-compare called it a precision finding ("fails only under a100:high")
    pytester.makepyfile(test_warned=WARNED)
    _run(pytester).assert_outcomes(passed=3)
    result = _run(pytester, "--tf32lab", "a100:high", "--tf32lab-compare")
    result.assert_outcomes(passed=3)
    assert "fails only under" not in result.stdout.str()


def test_the_rerun_at_highest_starts_clean(pytester: pytest.Pytester):
    pytester.makepyfile(test_rerun=RERUN)
    _run(pytester).assert_outcomes(passed=2)
    result = _run(pytester, "--tf32lab", "a100:high", "--tf32lab-compare")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "fails at highest too" not in out, out
    # compiling inside emulate() is either emulated (TF32: too far off) or an error of tf32lab's, never "too"
    result.stdout.re_match_lines([
        r".*test_compiled_with_fullgraph: (fails only under a100:high: passes at highest"
        r"|tf32lab error \(not precision\): .*, please report)$",
    ])
    result.stdout.fnmatch_lines(["*test_draws_what_the_first_run_drew: fails only under a100:high: passes at highest"])


LEVELS_BY_FIXTURES = {
    "conftest": textwrap.dedent("""
        import pytest
        import torch


        @pytest.fixture(scope="session", autouse=True)
        def project_level():
            torch.set_float32_matmul_precision("high")
            yield
            torch.set_float32_matmul_precision("highest")
    """),
    "test_levels": textwrap.dedent("""
        import pytest

        import tf32lab


        @pytest.fixture(scope="module")
        def at_medium():
            with tf32lab.precision("medium"):
                yield


        @pytest.fixture
        def level_seen():
            return tf32lab.get_float32_matmul_precision()


        def test_the_projects_level(level_seen):
            assert level_seen == "high"


        def test_the_projects_level_again(level_seen):
            assert level_seen == "high"


        def test_the_modules_level(at_medium, level_seen):
            assert level_seen == "medium"


        def test_the_modules_level_again(at_medium, level_seen):
            assert level_seen == "medium"
    """),
    "test_class_level": textwrap.dedent("""
        import pytest

        import tf32lab


        class TestAClassAtHighest:
            @pytest.fixture(scope="class", autouse=True)
            def at_highest(self):
                before = tf32lab.get_float32_matmul_precision()
                tf32lab.set_float32_matmul_precision("highest")
                yield
                tf32lab.set_float32_matmul_precision(before)

            def test_one(self):
                pass

            def test_two(self, request):
                request.getfixturevalue("lazily")  # a module fixture set up from inside a test

            def test_three(self):
                # natively: the module fixture's scope, still open; under the plugin: the test's own
                assert tf32lab.get_float32_matmul_precision() in ("medium", "high")


        @pytest.fixture(scope="module")
        def lazily():
            with tf32lab.precision("medium"):
                yield
    """),
}


@pytest.mark.parametrize("args", [(), ("--tf32lab", "a100:high"), ("-n", "2", "--tf32lab", "a100:high")],
                         ids=["plain", "emulated", "xdist"])
def test_state_set_up_by_fixtures_of_wider_scope_is_where_a_test_starts(pytester: pytest.Pytester, args):
    pytester.makeconftest(LEVELS_BY_FIXTURES["conftest"])
    pytester.makepyfile(**{k: v for k, v in LEVELS_BY_FIXTURES.items() if k != "conftest"})
    result = _run(pytester, *args)
    result.assert_outcomes(passed=7)
    assert "left global state changed" not in result.stdout.str()


BAD_MARKERS = {
    "test_level": 'tf32lab(level="fast")',
    "test_target": 'tf32lab(target="b900")',
    "test_positional": 'tf32lab("high")',
    "test_levels": 'tf32lab_levels("highest", "fast")',
}


def test_a_bad_marker_is_one_line_naming_the_marker_the_value_and_what_is_accepted(pytester: pytest.Pytester):
    # Each bad marker errors its own test only; a bad tf32lab_levels was a collection error, which stopped the
    # whole session ("Interrupted: 1 error during collection") before any test ran.
    good = "\n\ndef test_unmarked():\n    pass\n"
    pytester.makepyfile(**{name: f"import pytest\n\n@pytest.mark.{marker}\ndef test_it():\n    pass\n{good}"
                           for name, marker in BAD_MARKERS.items()})
    result = _run(pytester, "-v")
    result.assert_outcomes(errors=4, passed=4)
    result.stdout.fnmatch_lines(["*test_levels.py::test_it?tf32lab-bad-levels? ERROR*"])
    result.stdout.fnmatch_lines_random([
        "@pytest.mark.tf32lab(level='fast'): unknown level 'fast'; accepted: 'highest', 'bfx9', 'high', 'medium'",
        "@pytest.mark.tf32lab(target='b900'): unknown target 'b900'; accepted: native, v100*",
        "@pytest.mark.tf32lab('high'): takes level= and target= only (keywords), got 'high'",
        "@pytest.mark.tf32lab_levels('highest', 'fast'): unknown level 'fast'; accepted: *",
    ])
    out = result.stdout.str()
    assert "pytest_plugin.py" not in out and "Traceback" not in out and "--tf32lab" not in out, out


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
    with pytest.raises(tf32lab.Tf32LabError,
                       match="unknown level 'fast'; accepted: 'highest', 'bfx9', 'high', 'medium'"):
        assert_close(y, exact, operands=(a, b), level="fast")


@pytest.mark.parametrize("shapes", [((256, 512), (512,)), ((512,), (512, 32)), ((512,), (512,)),
                                    ((3, 64, 512), (512,))], ids=["mv", "vecmat", "dot", "batched-mv"])
def test_assert_close_takes_a_product_with_a_vector_operand(shapes):
    import torch

    import tf32lab
    from tf32lab.testing import assert_close, tolerance

    torch.manual_seed(0)
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1])
    exact = a.double() @ b.double()
    assert tolerance(a, b).shape == exact.shape
    assert_close((a @ b).float(), exact, operands=(a, b), level="highest", target="cpu")
    with pytest.raises(AssertionError, match="exceed the tolerance"):
        assert_close(exact + 1.0, exact, operands=(a, b), level="highest", target="cpu")
    with tf32lab.precision("medium"), tf32lab.emulate("cpu-amx"):
        assert_close(a @ b, exact, operands=(a, b))  # bf16's tolerance where the product is emulated in bf16


BIASED = """
import torch


def test_a_mean_that_must_not_drift():
    g = torch.Generator().manual_seed(0)
    x, w = torch.rand(64, 32, generator=g), torch.rand(32, 48, generator=g)
    drift = ((x @ w).double() - x.double() @ w.double()).mean().item()
    assert abs(drift) < 1e-3, drift
"""


@pytest.mark.xdist_group("numba_accumulation")  # a fresh clone compiles the kernel it sums with on one worker only
def test_tests_that_fail_only_on_an_mi300(pytester: pytest.Pytester, monkeypatch):
    pytester.makepyfile(test_biased=BIASED)
    monkeypatch.setenv("TF32LAB_ACCUMULATION", "hardware")
    _run(pytester, "--tf32lab", "a100:high").assert_outcomes(passed=1)
    result = _run(pytester, "--tf32lab", "mi300:high", "--tf32lab-compare")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "tf32lab: each test runs at precision 'high' as mi300 computes them (emulated here, summed as its hardware*",
        "*test_a_mean_that_must_not_drift: fails only under mi300:high: passes at highest",
    ])


def test_a_leak_under_torchrun_names_the_rank(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    # each rank of a torchrun job runs its own pytest: a flag left changed on one rank makes the ranks disagree
    pytester.makepyfile(test_leak="import torch\n\ndef test_leaks_a_flag():\n"
                                  "    torch.set_float32_matmul_precision('medium')\n")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    result = _run(pytester, "--tf32lab", "a100:high")
    result.stdout.fnmatch_lines(["left global state changed: test_leak.py::test_leaks_a_flag: rank 3/4: PyTorch "
                                 "flags changed*put back"])
