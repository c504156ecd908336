"""Every test leaves PyTorch's precision flags, and its intra-op thread count, exactly as it found them."""

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
