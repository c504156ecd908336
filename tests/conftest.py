"""Every test leaves PyTorch's precision flags exactly as it found them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tf32lab import flags

settings.register_profile(
    "default", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.register_profile(
    "thorough", max_examples=20000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile("default")


@pytest.fixture(autouse=True)
def _flags_unchanged():
    before = flags.snapshot()
    yield
    after = flags.snapshot()
    flags.restore(before)  # so one failure does not cascade into every later test
    assert after == before, f"flags changed by the test: {before.diff(after)}"


@pytest.fixture
def user_flags():
    """For tests that play the user and write PyTorch's flags themselves: put back afterwards."""
    before = flags.snapshot()
    yield
    flags.restore(before)
    from tf32lab import scope

    scope._reset_for_tests()
