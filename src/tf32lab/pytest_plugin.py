"""A pytest plugin: run a project's own tests as a chosen GPU would compute them, from a CPU-only CI.

Registered through the ``pytest11`` entry point. Loading it imports neither torch nor the rest of tf32lab: that
happens only when it is enabled (``--tf32lab``, the ini key ``tf32lab``, ``TF32LAB_PYTEST``) or a test carries one
of its markers, so ``pytest --help`` elsewhere costs what it did.

- ``--tf32lab TARGET[:LEVEL]`` (``a100:high``; the level defaults to ``high``; ``native:LEVEL`` runs the level on
  this machine's own hardware): each test's body runs inside ``precision(LEVEL)`` and ``emulate(TARGET)``. Fixtures
  are set up outside it. Threads a test starts run natively unless they enter ``emulate()`` themselves.
- ``--tf32lab-strict``: a matmul-family op the emulator does not handle fails the test, naming the op.
- ``--tf32lab-compare``: a test that fails under the emulated level is run again at ``highest``, natively, with the
  same fixtures; the summary says "fails only under a100:high" or "fails at highest too".
- ``@pytest.mark.tf32lab(level=..., target=...)`` pins a test (``level="highest"``: PyTorch's ``with_tf32_off``);
  ``@pytest.mark.tf32lab_levels("highest", "high")`` runs it once per level (``tf32_on_and_off``), the level in the
  test id and in the ``tf32lab_level`` fixture. Both work without ``--tf32lab`` too: then natively, unless the
  marker names a target.
- Every test that runs under tf32lab has PyTorch's precision flags, tf32lab's scopes and the dispatch mode stack
  compared before and after; a test that leaks one is named in the summary, and the flags are put back so the
  next test does not inherit them.

``tf32lab.testing`` gives tolerances derived from the math (``tolerance``, ``assert_close``). Works with
pytest-xdist: each worker sets itself up; the summary gathers the workers' findings.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

ENV = "TF32LAB_PYTEST"
DEFAULT_LEVEL = "high"
_PROPERTY = "tf32lab"  # user_properties keys: they survive pytest-xdist's report serialisation
_LEAK = "tf32lab-leak"


@dataclass
class _Settings:
    target: Optional[str]  # None: native
    level: Optional[str]  # None: the plugin is off (markers only)
    strict: bool
    compare: bool
    findings: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, verdict) of failed tests
    leaks: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, what it left changed)

    @property
    def enabled(self) -> bool:
        return self.level is not None

    def describe(self) -> str:
        where = f"as {self.target} computes them (emulated here)" if self.target else "on this machine's hardware"
        extra = "".join([", strict" if self.strict else "", ", failures compared at highest" if self.compare else ""])
        return f"tf32lab: each test runs at precision {self.level!r} {where}{extra}"


_KEY = pytest.StashKey[_Settings]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tf32lab", "run the tests as a chosen GPU would compute them (tf32lab)")
    group.addoption("--tf32lab", metavar="TARGET[:LEVEL]", default=None,
                    help=f"run every test at LEVEL (default {DEFAULT_LEVEL}) as TARGET computes it (a100, h100, ...; "
                         f"'native': this machine); also the ini key 'tf32lab' and ${ENV}")
    group.addoption("--tf32lab-strict", action="store_true",
                    help="fail a test that runs a matmul-family op the emulator does not handle")
    group.addoption("--tf32lab-compare", action="store_true",
                    help="run each test that fails under tf32lab again at highest: 'fails only under TF32' or not")
    parser.addini("tf32lab", "TARGET[:LEVEL]: as --tf32lab", default="")


def _parse(spec: str) -> tuple[Optional[str], str]:
    """``a100:high`` -> (``a100``, ``high``); a bad value is a ``pytest.UsageError`` naming what is accepted."""
    from .errors import Tf32LabError
    from .levels import LEVELS
    from .targets import TARGETS, get

    target, _, level = spec.strip().lower().partition(":")
    level = level or DEFAULT_LEVEL
    if level not in LEVELS:
        raise pytest.UsageError(f"--tf32lab {spec!r}: unknown level {level!r}; accepted: {', '.join(LEVELS)}")
    if target == "native":
        return None, level
    try:
        return get(target).name, level
    except Tf32LabError:
        raise pytest.UsageError(f"--tf32lab {spec!r}: unknown target {target!r}; accepted: native, "
                                f"{', '.join(TARGETS)}") from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "tf32lab(level=None, target=None): run this test at that precision level "
                                       "(and as that target computes it); level='highest' is PyTorch's with_tf32_off")
    config.addinivalue_line("markers", "tf32lab_levels(*levels): run this test once per level (PyTorch's "
                                       "tf32_on_and_off); the tf32lab_level fixture gives the level")
    spec = config.getoption("--tf32lab") or os.environ.get(ENV) or config.getini("tf32lab")
    strict, compare = config.getoption("--tf32lab-strict"), config.getoption("--tf32lab-compare")
    if spec:
        target, level = _parse(spec)
        settings = _Settings(target, level, strict, compare)
    else:
        if strict or compare:
            raise pytest.UsageError("--tf32lab-strict and --tf32lab-compare need --tf32lab TARGET[:LEVEL]")
        settings = _Settings(None, None, False, False)
    config.stash[_KEY] = settings
    config.pluginmanager.register(_Collector(settings), f"tf32lab-collector-{id(config)}")


def pytest_report_header(config: pytest.Config) -> Optional[str]:
    settings = config.stash.get(_KEY, None)
    return settings.describe() if settings is not None and settings.enabled else None


# -- which level and target a test gets ----------------------------------------------------------------------
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("tf32lab_levels")
    if marker is None:
        return
    from .levels import check_levels

    try:
        levels = check_levels(marker.args)
    except Exception as exc:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: @pytest.mark.tf32lab_levels: {exc}") from None
    if "tf32lab_level" not in metafunc.fixturenames:
        metafunc.fixturenames.append("tf32lab_level")
    metafunc.parametrize("tf32lab_level", levels, ids=[f"tf32lab-{level}" for level in levels], indirect=True)


@pytest.fixture
def tf32lab_level(request: pytest.FixtureRequest) -> Optional[str]:
    """The precision level this test runs at (from ``tf32lab_levels``, the ``tf32lab`` marker or ``--tf32lab``)."""
    param = getattr(request, "param", None)
    if param is not None:
        return param
    return _placement(request.node)[1]


def _placement(item: pytest.Item) -> tuple[Optional[str], Optional[str]]:
    """(target, level) for this test: its markers over the session's setting; (None, None): not under tf32lab."""
    settings = item.config.stash[_KEY]
    target, level = settings.target, settings.level
    marker = item.get_closest_marker("tf32lab")
    if marker is not None:
        unknown = set(marker.kwargs) - {"level", "target"}
        if marker.args or unknown:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.tf32lab takes level= and target= only")
        if marker.kwargs.get("target"):
            target = _parse(f"{marker.kwargs['target']}:{marker.kwargs.get('level') or level or DEFAULT_LEVEL}")[0]
        if marker.kwargs.get("level"):
            level = _parse(f"native:{marker.kwargs['level']}")[1]
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "tf32lab_level" in callspec.params:
        level = callspec.params["tf32lab_level"]
    return target, level


def _under_tf32lab(item: pytest.Item) -> bool:
    return item.config.stash[_KEY].enabled or item.get_closest_marker("tf32lab") is not None or \
        item.get_closest_marker("tf32lab_levels") is not None


# -- running a test ------------------------------------------------------------------------------------------
_BEFORE = pytest.StashKey[tuple]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if _under_tf32lab(item):
        from . import flags, scope

        item.stash[_BEFORE] = (flags.snapshot(), scope.open_nodes(), _modes())
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: the rerun starts after every plugin's teardown
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]):
    yield
    before = item.stash.get(_BEFORE, None)
    if before is None:
        return
    _leaks(item, before)
    if item.stash.get(_FAILED, False) and not item.stash.get(_RERUN, False):
        # on the teardown's report, which is made after this: it reaches an xdist controller too
        item.user_properties.append((_PROPERTY, _verdict(item, nextitem)))
        item.stash[_FAILED] = False


def _leaks(item: pytest.Item, before: tuple) -> None:
    """Name what the test left behind, and undo it: open scopes and emulate() blocks closed, dispatch modes it
    pushed taken off, flags put back."""
    from . import flags, modestack, scope

    leaked = []
    closed = scope.close_since(before[1])
    if closed:
        leaked.append(f"{closed} precision() scope(s) or emulate() block(s) left open, closed")
    scope.drop_idle_guard()  # tf32lab's own, not the test's: its bookkeeping goes with it
    extra = [mode for mode in _modes()
             if all(mode is not m for m in before[2]) and not scope.is_guard(mode)]
    for mode in extra:
        try:
            modestack.remove(mode)
        except Exception:  # its own exit failed (it was put there raw): off it goes all the same
            modestack.discard(mode)
    if extra:
        leaked.append(f"{len(extra)} dispatch mode(s) left on the stack ({type(extra[0]).__name__}), taken off")
    after = flags.snapshot()
    if after != before[0]:
        leaked.append(f"PyTorch flags changed ({before[0].diff(after)}), put back")
        flags.restore(before[0])
    if leaked:
        item.user_properties.append((_LEAK, "; ".join(leaked)))  # before the teardown's report is made


def _modes() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


_FAILED = pytest.StashKey[bool]()
_RERUN = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if not _under_tf32lab(item):
        yield
        return
    target, level = _placement(item)
    if item.stash.get(_RERUN, False):  # --tf32lab-compare's second run: natively, at highest
        from .scope import get_float32_matmul_precision

        # at the process's own highest, no scope at all: the test as it runs without tf32lab
        target, level = None, (None if get_float32_matmul_precision() == "highest" else "highest")
    if level is None:
        yield
        return
    from .emulator import emulate
    from .scope import precision

    with contextlib.ExitStack() as stack:
        stack.enter_context(precision(level))
        if target is not None:
            stack.enter_context(emulate(target, strict=item.config.stash[_KEY].strict))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    # the report, not the call, knows: a unittest TestCase's failure is recorded, not raised
    if report.when == "call" and report.failed and item.config.stash[_KEY].enabled and _under_tf32lab(item):
        item.stash[_FAILED] = True


def _verdict(item: pytest.Item, nextitem: Optional[pytest.Item]) -> str:
    """What a failure under tf32lab means; with --tf32lab-compare, after running the test again at highest (its
    whole protocol, fresh function-scoped fixtures, nothing logged)."""
    from _pytest.runner import runtestprotocol

    target, level = _placement(item)
    where = f"{target or 'native'}:{level}"
    if not item.config.stash[_KEY].compare or level == "highest":
        return f"fails under {where}"
    item.stash[_RERUN] = True
    if hasattr(item, "_request"):  # fresh fixtures (a new tmp_path): the first run's values are still cached here
        item._request = False
        item.funcargs = None
    try:
        reports = runtestprotocol(item, log=False, nextitem=nextitem)
    finally:
        item.stash[_RERUN] = False
    failed = next((r for r in reports if r.failed), None)
    if failed is None:
        return f"fails only under {where}: passes at highest"
    return f"fails at highest too ({failed.when}: {_first_line(failed)})"


def _first_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:200] if text.strip() else "no message"


class _Collector:
    """Registered per pytest config: gathers what the reports carry (in an xdist controller too, where the
    workers' reports arrive) and writes the summary."""

    def __init__(self, settings: _Settings) -> None:
        self.settings = settings

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for key, value in report.user_properties:
            if report.when != "teardown":
                continue
            if key == _PROPERTY:
                self.settings.findings.append((report.nodeid, value))
            elif key == _LEAK:
                self.settings.leaks.append((report.nodeid, value))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        settings = self.settings
        if not (settings.enabled or settings.findings or settings.leaks):
            return
        write = terminalreporter.write_line
        terminalreporter.section("tf32lab")
        if settings.enabled:
            write(settings.describe())
        if settings.findings:
            only = [f for f in settings.findings if "fails only under" in f[1]]
            write(f"{len(settings.findings)} test(s) failed under tf32lab"
                  + (f"; {len(only)} of them only there (they pass at highest)" if settings.compare else "") + ":")
            for nodeid, verdict in settings.findings:
                write(f"  {nodeid}: {verdict}")
        elif settings.enabled:
            write("no test failed under it")
        for nodeid, what in settings.leaks:
            write(f"left global state changed: {nodeid}: {what}")
