"""A pytest plugin: run a project's own tests as a chosen GPU would compute them, from a CPU-only CI.

Registered through the ``pytest11`` entry point. Loading it imports neither torch nor the rest of tf32lab: that
happens only when it is enabled (``--tf32lab``, the ini key ``tf32lab``, ``TF32LAB_PYTEST``) or a test carries one
of its markers, so ``pytest --help`` elsewhere costs what it did.

- ``--tf32lab TARGET[:LEVEL]`` (``a100:high``; the level defaults to ``high``; ``native:LEVEL`` runs the level on
  this machine's own hardware): each test's body runs inside ``precision(LEVEL)`` and ``emulate(TARGET)``. Fixtures
  are set up outside it. Threads a test starts run natively unless they enter ``emulate()`` themselves.
- ``TF32LAB_ACCUMULATION=hardware``: the emulated tests' GEMMs are summed as the target's matrix unit does, bit
  for bit (``emulate(accumulation="hardware")``): ``--tf32lab mi300:high`` then shows the tests that fail only on an
  MI300 (its XF32 truncates operands and floors sums), ``--tf32lab h100:high`` the long same-sign reductions that
  the H100's truncated accumulation biases. The header line says so.
- ``--tf32lab-strict``: a matmul-family op the emulator does not handle fails the test, naming the op.
- ``--tf32lab-compare``: a test that fails under the emulated level is run again at ``highest``, natively, with
  fresh function-scoped fixtures, the random generators as the first run found them and Dynamo's caches reset;
  the summary says "fails only under a100:high" or "fails at highest too".
- A failure raised inside tf32lab itself (the emulator, a rule, ``formats``; a frame that only handed an op on
  does not count, nor the test's own code that tf32lab called back; an op whose operands PyTorch refuses natively
  too, shapes that do not multiply, raises its own error as natively, and so does a backward that autograd refuses
  before any emulated op of it ran) is never put down to precision: the summary says
  "tf32lab error (not precision): <error> (tf32lab/<file>:<line>), please report", or
  "tf32lab refused (not precision): ..." for a ``Tf32LabError`` (``--tf32lab-strict``, say). An error PyTorch's
  tracer raises inside a ``torch.jit.trace`` that ran under the emulation, with no frame of the model's or the
  test's in between, is "tf32lab error or interaction (not precision)"; other errors PyTorch raises later, outside
  tf32lab's frames (a scripted module's interpreter), cannot be told from the test's own.
- ``@pytest.mark.tf32lab(level=..., target=...)`` pins a test (``level="highest"``: PyTorch's ``with_tf32_off``);
  ``@pytest.mark.tf32lab_levels("highest", "high")`` runs it once per level (``tf32_on_and_off``), the level in the
  test id and in the ``tf32lab_level`` fixture. Both work without ``--tf32lab`` too: then natively, unless the
  marker names a target. A bad value fails that test only (for ``tf32lab_levels``, as one ``tf32lab-bad-levels``
  case) with one line naming the marker, the value and what is accepted.
- Every test that runs under tf32lab starts from the state its fixtures of wider scope (session, package,
  module, class) set up: a project's level set in a session fixture, a module held in ``precision()``. What the
  test and its function-scoped fixtures leave changed (PyTorch's precision flags, tf32lab's scopes, the
  dispatch mode stack) is named in the summary and undone, so the next test does not inherit it.

``tf32lab.testing`` gives tolerances derived from the math (``tolerance``, ``assert_close``); by default they
follow the target and level in force, so under ``--tf32lab`` a test's tolerance is its run's. PyTorch's own flags
do not: under an emulated target they keep the process's values (``torch.get_float32_matmul_precision()`` answers
the process's level, ``tf32lab.get_float32_matmul_precision()`` the test's), so a test that derives its tolerance
from them derives float32's. Works with pytest-xdist: each worker sets itself up; the summary gathers the
workers' findings.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import pytest

from tf32lab import settings as tf32lab_settings
from tf32lab.numbers.origin import LIBRARY, OURS, PACKAGE, forwarding_line, forwards, innermost_first, kind_of

ENV = "TF32LAB_PYTEST"
DEFAULT_LEVEL = "high"
_PROPERTY = "tf32lab"  # user_properties keys: they survive pytest-xdist's report serialisation
_LEAK = "tf32lab-leak"

if TYPE_CHECKING:
    from tf32lab.know.targets import Target


@dataclass
class _Settings:
    target: Optional[Target]  # None: native, this machine's own hardware (nothing emulated)
    level: Optional[str]  # None: the plugin is off (markers only)
    strict: bool
    compare: bool
    findings: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, verdict) of failed tests
    leaks: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, what it left changed)

    @property
    def enabled(self) -> bool:
        return self.level is not None

    def describe(self) -> str:
        where = f"as {self.target.name} computes them (emulated here)" if self.target else "on this machine's hardware"
        if self.target and tf32lab_settings.get("TF32LAB_ACCUMULATION") == "hardware":
            where = f"as {self.target.name} computes them (emulated here, summed as its hardware sums)"
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


class _BadValue(Exception):
    """One value of the plugin's options or markers is wrong; the message names it and what is accepted."""


def _level(level: object) -> str:
    from tf32lab.errors import Tf32LabError
    from tf32lab.know.levels import check_level

    try:
        return check_level(level, loose=True)
    except Tf32LabError as exc:
        raise _BadValue(str(exc)) from None


def _target(name: object) -> Optional[Target]:
    """The target a user names (once: the object is passed down to ``emulate``); None for ``native`` (this
    machine's own hardware, nothing emulated)."""
    from tf32lab.errors import Tf32LabError
    from tf32lab.know.targets import NATIVE, TARGETS, get

    key = name.strip().lower() if isinstance(name, str) else name
    if key == NATIVE:
        return None
    try:
        return get(key)  # type: ignore[arg-type]
    except Tf32LabError:
        raise _BadValue(f"unknown target {name!r}; accepted: native, {', '.join(TARGETS)}") from None


def _pair(target: Optional[Target], level: str) -> tuple[Optional[Target], str]:
    """A level the target cannot give (``bfx9`` before Blackwell; natively, on a torch that cannot set it) is
    refused here, once, rather than in every test."""
    from tf32lab.errors import Tf32LabError

    try:
        if target is None:
            from tf32lab.control.flags import native_refusal

            reason = native_refusal(level)
            if reason is not None:
                raise Tf32LabError(f"{reason}; name a target to emulate it (e.g. b200:{level})")
        else:
            target.maths_at(level, {})
    except Tf32LabError as exc:
        raise _BadValue(str(exc)) from None
    return target, level


def _parse(spec: str, source: str = "--tf32lab") -> tuple[Optional[Target], str]:
    """``a100:high`` -> (``a100``, ``high``); a bad value is a ``pytest.UsageError`` naming ``source`` (the
    option, the environment variable or the ini key it came from: the user must know which to fix), the value
    and what is accepted."""
    target, _, level = spec.strip().partition(":")
    try:
        return _pair(_target(target), _level(level or DEFAULT_LEVEL))
    except _BadValue as exc:
        where = f"--tf32lab {spec!r}" if source == "--tf32lab" else f"{source}={spec!r} (TARGET[:LEVEL])"
        raise pytest.UsageError(f"{where}: {exc}") from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "tf32lab(level=None, target=None): run this test at that precision level "
                                       "(and as that target computes it); level='highest' is PyTorch's with_tf32_off")
    config.addinivalue_line("markers", "tf32lab_levels(*levels): run this test once per level (PyTorch's "
                                       "tf32_on_and_off); the tf32lab_level fixture gives the level")
    sources = [("--tf32lab", config.getoption("--tf32lab")), (ENV, tf32lab_settings.get(ENV)),
               ("the ini key tf32lab", config.getini("tf32lab"))]
    source, spec = next(((name, value) for name, value in sources if value), ("", None))
    strict, compare = config.getoption("--tf32lab-strict"), config.getoption("--tf32lab-compare")
    if spec:
        target, level = _parse(spec, source)
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
    from tf32lab.know.levels import check_levels

    try:
        levels, ids = check_levels(marker.args), None
    except Exception as exc:
        # Not a collection error (pytest.fail here ends the whole session, --continue-on-collection-errors
        # aside): one test that errors at setup with the one line, as a bad ``tf32lab`` marker does.
        levels, ids = [_BadLevels(f"@pytest.mark.tf32lab_levels{_arguments(marker)}: {exc}")], ["tf32lab-bad-levels"]
    if "tf32lab_level" not in metafunc.fixturenames:
        metafunc.fixturenames.append("tf32lab_level")
    metafunc.parametrize("tf32lab_level", levels, ids=ids or [f"tf32lab-{level}" for level in levels], indirect=True)


class _BadLevels(str):
    """The parameter of a test whose ``tf32lab_levels`` marker is bad: its message, failed at setup. A ``str``,
    so pytest-xdist workers, which compare the collected ids and params, see equal values."""


@pytest.fixture
def tf32lab_level(request: pytest.FixtureRequest) -> Optional[str]:
    """The precision level this test runs at (from ``tf32lab_levels``, the ``tf32lab`` marker or ``--tf32lab``)."""
    param = getattr(request, "param", None)
    if param is not None:
        return param
    return _placement(request.node)[1]


def _arguments(marker: pytest.Mark) -> str:
    return "(" + ", ".join([*map(repr, marker.args), *(f"{k}={v!r}" for k, v in marker.kwargs.items())]) + ")"


_PLACEMENT = pytest.StashKey[tuple]()


def _placement(item: pytest.Item) -> tuple[Optional[Target], Optional[str]]:
    """(target, level) for this test: its markers over the session's setting; (None, None): not under tf32lab.

    A bad marker fails the test with one line naming the marker, the value and what is accepted."""
    placed = item.stash.get(_PLACEMENT, None)
    if placed is not None:
        return placed
    settings = item.config.stash[_KEY]
    target, level = settings.target, settings.level
    marker = item.get_closest_marker("tf32lab")
    if marker is not None:
        where = f"@pytest.mark.tf32lab{_arguments(marker)}"
        unknown = sorted(set(marker.kwargs) - {"level", "target"})
        if marker.args or unknown:
            pytest.fail(f"{where}: takes level= and target= only (keywords), got "
                        f"{', '.join([*map(repr, marker.args), *unknown])}", pytrace=False)
        try:
            if marker.kwargs.get("target") is not None:
                target = _target(marker.kwargs["target"])
                level = level or DEFAULT_LEVEL
            if marker.kwargs.get("level") is not None:
                level = _level(marker.kwargs["level"])
            if level is not None:
                _pair(target, level)
            bad = None
        except _BadValue as exc:
            bad = str(exc)
        if bad is not None:  # (outside the handler: one line, no chained traceback)
            pytest.fail(f"{where}: {bad}", pytrace=False)
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "tf32lab_level" in callspec.params:
        level = callspec.params["tf32lab_level"]
        if isinstance(level, _BadLevels):
            pytest.fail(str(level), pytrace=False)
    placed = item.stash[_PLACEMENT] = (target, level)
    return placed


def _under_tf32lab(item: pytest.Item) -> bool:
    return item.config.stash[_KEY].enabled or item.get_closest_marker("tf32lab") is not None or \
        item.get_closest_marker("tf32lab_levels") is not None


# -- what a test starts from, and what it leaves ------------------------------------------------------------
class _Baseline:
    """The global state a test starts from: PyTorch's flags, the open scopes and ``emulate()`` blocks, the
    dispatch mode stack. Taken after the fixtures of wider scope (session, package, module, class) are set up,
    so what they establish (a project's level, a module held in ``precision()``) is where the test starts, and
    only what the test and its function-scoped fixtures change counts as left behind."""

    __slots__ = ("checked", "flags", "modes", "nodes")

    def __init__(self) -> None:
        from tf32lab.control import flags, scope

        self.flags: Optional[flags.Snapshot] = flags.snapshot()
        self.nodes, self.modes = scope.open_nodes(), _modes()
        self.checked = False

    def absorb(self, before: _Baseline, after: _Baseline) -> None:
        """A fixture of wider scope was set up during the test (``request.getfixturevalue``): what it did between
        ``before`` and ``after`` belongs to the baseline too."""
        opened = after.nodes - before.nodes
        self.nodes = self.nodes | opened
        self.modes = self.modes + [m for m in after.modes if all(m is not b for b in before.modes)]
        if opened:  # a scope opened inside the test's own: the flags it will hold later are not known here
            self.flags = None
        elif after.flags != before.flags and self.flags is not None:
            self.flags = after.flags


_BASELINE = pytest.StashKey[_Baseline]()
_STATE_FIXTURE = "_tf32lab_state"
_current: Optional[_Baseline] = None  # the running test's baseline, while its function-scoped fixtures are up


@pytest.fixture(autouse=True)
def _tf32lab_state(request: pytest.FixtureRequest):
    """Takes the test's baseline and, at its teardown, undoes what the test left changed.

    Pytest sets fixtures of wider scope up before function-scoped ones, and this autouse fixture of a plugin
    comes first among those; its teardown runs after theirs and before a wider fixture's."""
    global _current
    item = request.node
    if not _under_tf32lab(item):
        yield
        return
    if not item.config.pluginmanager.has_plugin(_WiderFixtures.NAME):
        item.config.pluginmanager.register(_WiderFixtures(), _WiderFixtures.NAME)
    baseline = item.stash[_BASELINE] = _Baseline()
    if item.config.stash[_KEY].compare:
        if item.stash.get(_RERUN, False):
            _set_rng(item.stash[_RNG])  # the rerun draws what the first run drew
        else:
            item.stash[_RNG] = _rng()
    _current = baseline
    yield
    _current = None
    _undo_leaks(item, item.stash[_BASELINE])


class _WiderFixtures:
    """Registered once a test runs under tf32lab (a hook on every fixture's setup costs every project)."""

    NAME = "tf32lab-wider-fixtures"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
        baseline = _current
        if baseline is None or fixturedef.scope == "function":
            yield
            return
        before = _Baseline()
        yield
        baseline.absorb(before, _Baseline())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if _under_tf32lab(item):
        _placement(item)  # a bad marker fails here, in one line
        if _STATE_FIXTURE not in getattr(item, "fixturenames", ()):  # an item without fixtures: from here
            item.stash[_BASELINE] = _Baseline()
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: the rerun starts after every plugin's teardown
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]):
    global _current
    yield
    _current = None
    baseline = item.stash.get(_BASELINE, None)
    if baseline is not None and not baseline.checked:
        _undo_leaks(item, baseline)
    if item.stash.get(_FAILED, False) and not item.stash.get(_RERUN, False):
        # on the teardown's report, which is made after this: it reaches an xdist controller too
        item.user_properties.append((_PROPERTY, _verdict(item, nextitem)))
        item.stash[_FAILED] = False


def _undo_leaks(item: pytest.Item, baseline: _Baseline) -> None:
    """Name what the test left behind, and undo it: open scopes and emulate() blocks closed, dispatch modes it
    pushed taken off, flags put back. The rerun of --tf32lab-compare is cleaned the same way, but not named."""
    from tf32lab.control import flags, modestack, scope

    baseline.checked = True
    leaked = []
    closed = scope.close_since(baseline.nodes)
    if closed:
        leaked.append(f"{closed} precision() scope(s) or emulate() block(s) left open, closed")
    scope.drop_idle_guard()  # tf32lab's own, not the test's: its bookkeeping goes with it
    extra = [mode for mode in _modes()
             if all(mode is not m for m in baseline.modes) and not scope.is_guard(mode)]
    for mode in extra:
        try:
            modestack.remove(mode)
        except Exception:  # its own exit failed (it was put there raw): off it goes all the same
            modestack.discard(mode)
    if extra:
        leaked.append(f"{len(extra)} dispatch mode(s) left on the stack ({type(extra[0]).__name__}), taken off")
    after = flags.snapshot()
    if baseline.flags is not None and after != baseline.flags:
        leaked.append(f"PyTorch flags changed ({baseline.flags.diff(after)}), put back")
        flags.restore(baseline.flags)
    if leaked and not item.stash.get(_RERUN, False):
        from tf32lab.machine.distributed import rank_prefix  # under torchrun: which rank's state was left changed

        item.user_properties.append((_LEAK, rank_prefix() + "; ".join(leaked)))  # before the teardown's report is made


def _modes() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


_RNG = pytest.StashKey[tuple]()


def _rng() -> tuple:
    """The random generators' states (Python's, torch's, NumPy's when loaded) before the function-scoped
    fixtures draw: the rerun gets the same inputs, so its verdict is about precision only."""
    import random

    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    numpy = sys.modules.get("numpy")
    return random.getstate(), torch.get_rng_state(), cuda, numpy.random.get_state() if numpy is not None else None


def _set_rng(state: tuple) -> None:
    import random

    import torch

    python, cpu, cuda, numpy = state
    random.setstate(python)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if numpy is not None:
        sys.modules["numpy"].random.set_state(numpy)


_FAILED = pytest.StashKey[bool]()
_RERUN = pytest.StashKey[bool]()
_INSIDE = pytest.StashKey[Optional[tuple]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if not _under_tf32lab(item):
        yield
        return
    target, level = _placement(item)
    if item.stash.get(_RERUN, False):  # --tf32lab-compare's second run: natively, at highest
        from tf32lab.control.scope import get_float32_matmul_precision

        # at the process's own highest, no scope at all: the test as it runs without tf32lab
        target, level = None, (None if get_float32_matmul_precision() == "highest" else "highest")
    if level is None:
        yield
        return
    from tf32lab.control.scope import precision
    from tf32lab.emulation.emulator import emulate

    with contextlib.ExitStack() as stack:
        if target is not None:  # first: a scope inside emulate() never writes the flag (bfx9 needs no native write)
            stack.enter_context(emulate(target, strict=item.config.stash[_KEY].strict))
        stack.enter_context(precision(level))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    # the report, not the call, knows: a unittest TestCase's failure is recorded, not raised
    if report.when == "call" and report.failed and item.config.stash[_KEY].enabled and _under_tf32lab(item) \
            and not item.stash.get(_RERUN, False):
        item.stash[_FAILED] = True
        # (pytest's unittest plugin has put the TestCase's recorded error on the call by now)
        inside = None
        if call.excinfo is not None:
            inside = _inside_tf32lab(call.excinfo)
            if inside is None and _placement(item)[0] is not None:  # the test ran inside emulate()
                inside = _in_jit_trace(call.excinfo)
        item.stash[_INSIDE] = inside


def _verdict(item: pytest.Item, nextitem: Optional[pytest.Item]) -> str:
    """What a failure under tf32lab means; with --tf32lab-compare, after running the test again at highest (its
    whole protocol, fresh function-scoped fixtures, the same random draws, Dynamo reset, nothing logged).

    An exception raised inside tf32lab is never put down to precision."""
    from _pytest.runner import runtestprotocol

    target, level = _placement(item)
    where = f"{target.name if target else 'native'}:{level}"
    inside = item.stash.get(_INSIDE, None)
    if not item.config.stash[_KEY].compare or level == "highest":
        if inside is not None:
            return _not_precision(inside, natively=None)
        return f"fails under {where}"
    item.stash[_RERUN] = True
    _reset_compilers()
    if hasattr(item, "_request"):  # fresh fixtures (a new tmp_path): the first run's values are still cached here
        item._request = False
        item.funcargs = None
    try:
        reports = runtestprotocol(item, log=False, nextitem=nextitem)
    finally:
        item.stash[_RERUN] = False
    failed = next((r for r in reports if r.failed), None)
    if failed is not None:
        return f"fails at highest too ({failed.when}: {_first_line(failed)})"
    if inside is not None:
        return _not_precision(inside, natively=True)
    return f"fails only under {where}: passes at highest"


_ERROR, _REFUSED, _INTERACTION = "error", "refused", "interaction"
_SAYS = {_ERROR: "tf32lab error (not precision)", _REFUSED: "tf32lab refused (not precision)",
         _INTERACTION: "tf32lab error or interaction (not precision)"}
_NOT_PRECISION = tuple(_SAYS.values())


def _not_precision(inside: tuple, natively: Optional[bool]) -> str:
    error, where, kind = inside
    says = _SAYS[kind]
    if kind == _REFUSED:  # Tf32LabError: a request tf32lab cannot honour (strict mode, a thread it cannot serve)
        return f"{says}: {error} ({where})"
    if natively:
        return f"{says}: {error} ({where}), please report"
    return f"{says}: {error} ({where}); please report it if the test passes without --tf32lab"


def _reset_compilers() -> None:
    """What the emulated run compiled (or failed to) must not decide the rerun: Dynamo's caches go, as
    PyTorch's own Dynamo tests reset between tests (``torch._dynamo.test_case.TestCase``). Not imported here
    if the program never loaded it."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and hasattr(dynamo, "reset"):
        dynamo.reset()


# -- was it raised inside tf32lab? ---------------------------------------------------------------------------
# the frames' owners are told apart by tf32lab.numbers.origin, which check and tune use for the same question


def _inside_tf32lab(excinfo: pytest.ExceptionInfo) -> Optional[tuple[str, str, str]]:
    """``(error, where, kind)`` when the failure was raised by tf32lab's own code (kind "error", or "refused" for
    a ``Tf32LabError``), else None.

    The traceback is read from the frame that raised outwards, PyTorch's and the standard library's frames
    passed over: the first frame of tf32lab's decides for tf32lab, unless it only handed an op on
    (``func(*args, **kwargs)`` in a dispatch mode: the op's own error, as it would raise natively; or a backward
    that autograd refused before any op of it was emulated, ``origin.HANDS_ON``); the first frame of anyone
    else's (the test, the project, a callback tf32lab made) decides against. An exception a
    library raised while handling one of tf32lab's is tf32lab's. ``testing.assert_close``'s AssertionError is
    a verdict on precision, not an error."""
    exc: Optional[BaseException] = excinfo.value
    tb = excinfo.tb
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        where = _raised_in(tb, exc)
        if where is not LIBRARY:
            if where is None:
                return None
            from tf32lab.errors import Tf32LabError

            return _one_line(exc), where, _REFUSED if isinstance(exc, Tf32LabError) else _ERROR
        exc = exc.__cause__ or exc.__context__
        tb = exc.__traceback__ if exc is not None else None
    return None


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


_TRACER = os.sep + os.path.join("torch", "jit", "_trace.py")


def _in_jit_trace(excinfo: pytest.ExceptionInfo) -> Optional[tuple[str, str, str]]:
    """``(error, where, "interaction")`` for an error PyTorch's tracer raised inside a ``torch.jit.trace`` that
    ran under the test's ``emulate()``, else None.

    The tracer checks the graph after the forward has returned (a value it cannot place in the graph, an output
    with no data dependence on the inputs), in C++, where no frame of tf32lab's is left to see: the emulator's
    dispatch mode sat under the ops it recorded, so such an error is tf32lab's or its interaction with the tracer,
    not an effect of precision. Read from the raising frame outwards: frames of PyTorch, the standard library and
    tf32lab's own that only handed an op on are passed over until one of ``torch/jit/_trace.py``, which decides
    for; any other frame (the model's forward, the test) decides against, as its error may come from the numbers
    (a Cholesky of a matrix that TF32 made indefinite). Only a plain ``RuntimeError`` or ``torch.jit.Error``
    counts: a subclass (``torch.linalg.LinAlgError``) is raised by values."""
    exc = excinfo.value
    torch = sys.modules.get("torch")
    kinds = (RuntimeError,) if torch is None else (RuntimeError, torch.jit.Error)
    if type(exc) not in kinds:
        return None
    for entry in innermost_first(excinfo.tb):
        filename = entry.tb_frame.f_code.co_filename
        kind = kind_of(filename)
        if kind == OURS and forwards(entry):
            continue
        if kind != LIBRARY:
            return None
        if os.path.abspath(filename).endswith(_TRACER):
            return _one_line(exc), "raised by torch.jit.trace under emulate()", _INTERACTION
    return None


def _raised_in(tb: Any, exc: BaseException) -> Optional[str]:
    """``"tf32lab/x.py:N"``, None (someone else's), or LIBRARY (only library frames)."""
    frames: list[tuple[str, int, Callable[[], bool]]] = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, functools.partial(forwards, tb)))
        tb = tb.tb_next
    # Dynamo's errors carry the frames it was tracing symbolically when it gave up: the innermost ones
    for summary in getattr(exc, "real_stack", None) or ():
        frames.append((summary.filename, summary.lineno or 0, functools.partial(forwarding_line, summary.line)))
    for filename, lineno, handed_on in reversed(frames):
        kind = kind_of(filename)
        if kind == LIBRARY:
            continue
        if kind != OURS:
            return None
        if filename.endswith(f"{os.sep}testing.py") and isinstance(exc, AssertionError):
            return None
        if handed_on():
            return None
        return f"tf32lab/{os.path.abspath(filename)[len(PACKAGE):]}:{lineno}"
    return LIBRARY


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
            only = sum(verdict.startswith("fails only under") for _, verdict in settings.findings)
            ours = sum(verdict.startswith(_NOT_PRECISION[:2]) for _, verdict in settings.findings)
            mixed = sum(verdict.startswith(_SAYS[_INTERACTION]) for _, verdict in settings.findings)
            write(f"{len(settings.findings)} test(s) failed under tf32lab"
                  + (f"; {only} of them only there (they pass at highest)" if settings.compare else "")
                  + (f"; {ours} because of tf32lab itself, not precision" if ours else "")
                  + (f"; {mixed} in torch.jit.trace under emulate(), not precision" if mixed else "") + ":")
            for nodeid, verdict in settings.findings:
                write(f"  {nodeid}: {verdict}")
        elif settings.enabled:
            write("no test failed under it")
        for nodeid, what in settings.leaks:
            write(f"left global state changed: {nodeid}: {what}")
