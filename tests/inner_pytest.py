"""An inner pytest run for the tests of tf32lab's pytest plugin: what ``pytester.runpytest_subprocess`` does, in a
real child process forked from the suite's CLI server (``tests/cli_runner.py``: torch and tf32lab already imported),
so that a run costs its own tests, not the 2-3 CPU seconds of importing torch again."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

import cli_runner

# Plugins of other packages that the inner runs leave out, as they do pytest-randomly's: hypothesis's imports
# hypothesis at the end of every session and anyio's imports anyio, and pytest rewrites the asserts of a plugin's
# whole distribution as it is imported (about 100 modules, 1.2-2 CPU seconds a run; its cache is off where
# PYTHONDONTWRITEBYTECODE is set). None of them meets tf32lab's plugin: no inner test uses hypothesis or anyio.
UNRELATED_PLUGINS = ("no:randomly", "no:hypothesispytest", "no:anyio")


def run(pytester: pytest.Pytester, *args: str, fresh: bool = False) -> pytest.RunResult:
    """``pytest <args>`` in ``pytester``'s folder with this process's environment (as ``runpytest_subprocess``
    runs it), the child forked from the suite's CLI server unless ``fresh`` (or unless the server cannot run it
    as a fresh interpreter would: see ``cli_runner.run``)."""
    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
    path = os.pathsep.join(filter(None, [str(pytester.path), os.environ.get("PYTHONPATH")]))  # as pytester's popen
    env = {**os.environ, "PYTHONPATH": path}
    start = time.monotonic()
    unrelated = [arg for name in UNRELATED_PLUGINS for arg in ("-p", name)]
    done = cli_runner.run(f"--basetemp={basetemp}", "-p", "no:cacheprovider", *unrelated, *args,
                          module="pytest", cwd=pytester.path, env=env, timeout=600, fresh=fresh)
    return pytest.RunResult(done.returncode, done.stdout.splitlines(), done.stderr.splitlines(),
                            time.monotonic() - start)
