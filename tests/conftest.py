"""Every test leaves PyTorch's precision flags, and its intra-op thread count, exactly as it found them.

`make test` runs the suite on pytest-xdist workers (``-n auto``): one worker per usable CPU, each with its share
of the intra-op threads, so tests must not share files, ports or environment with each other (docs/design.md,
"Testing")."""

from __future__ import annotations

import os
import resource
import sys
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, settings

from tf32lab.control import flags

# the lost-group warning: a hook of its own module, so that its test runs it in a pytest without this suite
from xdist_groups import pytest_collection_modifyitems  # noqa: F401

settings.register_profile(
    "default", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.register_profile(
    "thorough", max_examples=20000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile("default")


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist` runs the suite too
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may keep busy (affinity and cgroup quota), not per core the
    host has: a container limited to 2 CPUs of 64 gets 2."""
    from tf32lab.machine.hardware import detect

    return detect().usable_cpus


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="print the N tests that cost the most CPU seconds (the worker and the child processes it waited for, "
        "setup to teardown) and the CPU seconds of each test file; 0 prints only the files. Wall time misleads on "
        "a loaded machine; CPU time does not.",
    )
    parser.addoption("--cpu-log", default=None, metavar="FILE",
                     help="with --cpu-durations: append each test's CPU seconds to FILE as it ends (a long run cut "
                     "short still tells)")


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its waited-for children, plus those of the CLI runs that
    tests/cli_runner.py forked from its server (children of the server, not of this process)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    runner = sys.modules.get("cli_runner")
    forked = runner.forked_cpu_seconds() if runner is not None else 0.0
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


_cpu_start: dict[str, float] = {}
_cpu_costs: dict[str, float] = {}
_cpu_log: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid: str, location) -> None:
    _cpu_start[nodeid] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # The teardown report carries the test's CPU seconds to the controller (xdist sends user_properties along).
    if call.when == "teardown" and item.config.getoption("cpu_durations") is not None and item.nodeid in _cpu_start:
        item.user_properties.append(("cpu_seconds", _cpu_seconds() - _cpu_start.pop(item.nodeid)))
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "cpu_seconds":
                _cpu_costs[report.nodeid] = value
                if _cpu_log:
                    with open(_cpu_log[0], "a") as log:
                        log.write(f"{value:.3f} {report.nodeid}\n")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    count = config.getoption("cpu_durations")
    if count is None or not _cpu_costs or hasattr(config, "workerinput"):
        return
    write = terminalreporter.write_line
    total = sum(_cpu_costs.values())
    terminalreporter.section(f"CPU seconds: {total:.1f} over {len(_cpu_costs)} tests")
    for nodeid, cost in sorted(_cpu_costs.items(), key=lambda kv: -kv[1])[:count]:
        write(f"{cost:9.2f}s  {nodeid}")
    per_file: dict[str, float] = defaultdict(float)
    for nodeid, cost in _cpu_costs.items():
        per_file[nodeid.split("::")[0]] += cost
    terminalreporter.section("CPU seconds per file")
    for path, cost in sorted(per_file.items(), key=lambda kv: -kv[1]):
        write(f"{cost:9.2f}s  {path}")


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("xdist"):  # `-p no:xdist`: the marks stay, --strict-markers knows them
        config.addinivalue_line("markers", "xdist_group(name): run on one xdist worker under --dist loadgroup")
    if config.getoption("cpu_log") and not hasattr(config, "workerinput"):
        _cpu_log.append(config.getoption("cpu_log"))
    # Each xdist worker takes its share of the CPUs: 2 workers x 2 intra-op threads on 2 CPUs oversubscribe, and
    # OpenMP's spinning threads then slow every matmul. Set once, before any test, so the per-test check holds.
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers > 1:
        share = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(share)
        # and so do the processes it starts (CLI runs, servers, examples), which otherwise start one OpenMP thread
        # per CPU: a CLI check of all-MiniLM-L6-v2 beside a busy worker took 26-38 s of CPU with 2 threads on 2
        # CPUs, 9.5 s with one (the spinning threads of one process wait for the other's)
        os.environ["OMP_NUM_THREADS"] = str(share)


def pytest_sessionfinish(session: pytest.Session) -> None:
    browser = sys.modules.get("browser")  # tests/browser.py: the Chromium a test opened pages in, closed
    if browser is not None:
        browser.close()


@pytest.fixture(autouse=True)
def _flags_unchanged():
    before, threads = flags.snapshot(), torch.get_num_threads()
    yield
    after, threads_after = flags.snapshot(), torch.get_num_threads()
    flags.restore(before)  # so one failure does not cascade into every later test
    torch.set_num_threads(threads)
    assert after == before, f"flags changed by the test: {before.diff(after)}"
    assert threads_after == threads, f"intra-op threads changed by the test: {threads} -> {threads_after}"


@pytest.fixture
def user_flags():
    """For tests that play the user and write PyTorch's flags (or thread count) themselves: put back afterwards."""
    before, threads = flags.snapshot(), torch.get_num_threads()
    yield
    flags.restore(before)
    torch.set_num_threads(threads)
    from tf32lab.control import scope

    scope.forget_flags_cache()


@pytest.fixture
def counted_graphs():
    """A ``torch.compile`` backend that runs each graph Dynamo makes as it is and counts them, as
    ``(backend, {"compiled": graphs made, "ran": graph calls})``; Dynamo starts and ends the test with nothing
    cached."""
    torch._dynamo.reset()
    graphs = {"compiled": 0, "ran": 0}

    def counting(gm, example_inputs):
        graphs["compiled"] += 1

        def run(*args):
            graphs["ran"] += 1
            return gm.forward(*args)
        return run

    try:
        yield counting, graphs
    finally:
        torch._dynamo.reset()


@pytest.fixture
def reruns(monkeypatch) -> list[str]:
    """The name of the layer of each rerun the test's checks make, in turn."""
    from tf32lab.measure.layers import Recorder

    names: list[str] = []
    rerun = Recorder._rerun

    def counted(self: Recorder, name: str, *args, **kwargs):
        names.append(name)
        return rerun(self, name, *args, **kwargs)

    monkeypatch.setattr(Recorder, "_rerun", counted)
    return names
