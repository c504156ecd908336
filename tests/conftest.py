"""Every test leaves PyTorch's precision flags, and its intra-op thread count, exactly as it found them.

`make test` runs the suite on pytest-xdist workers (``-n auto``): one worker per usable CPU, each with its share
of the intra-op threads, so tests must not share files, ports or environment with each other (docs/design.md,
"Testing")."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

from tf32lab.control import flags

settings.register_profile(
    "default", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.register_profile(
    "thorough", max_examples=20000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile("default")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may keep busy (affinity and cgroup quota), not per core the
    host has: a container limited to 2 CPUs of 64 gets 2."""
    from tf32lab.machine.hardware import detect

    return detect().usable_cpus


def pytest_configure(config: pytest.Config) -> None:
    # Each xdist worker takes its share of the CPUs: 2 workers x 2 intra-op threads on 2 CPUs oversubscribe, and
    # OpenMP's spinning threads then slow every matmul. Set once, before any test, so the per-test check holds.
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


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
