"""Real multi-process ``torch.distributed`` jobs for the tests: ``run_job(scenario, world)`` starts ``world``
Python processes on gloo (CPU), each running ``scenario`` from ``tests/distributed_scenarios.py``, and returns each
rank's exit code and output. Every job has a hard timeout: a bug can never hang the suite (all its processes are
killed there, and the test fails saying so).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
SCENARIOS = HERE / "distributed_scenarios.py"


@dataclass
class Rank:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    @property
    def result(self):
        """The JSON the scenario printed last (``RESULT {...}``), or None."""
        lines = [line for line in self.stdout.splitlines() if line.startswith("RESULT ")]
        return json.loads(lines[-1][len("RESULT "):]) if lines else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(scenario: str, world: int, *args: str, timeout: float = 60.0, env: dict | None = None,
            wait_for: Sequence[int] | None = None) -> list[Rank]:
    """Run ``scenario`` on ``world`` ranks; each rank's output. Raises ``AssertionError`` past ``timeout``.
    ``wait_for``: the ranks that must end by themselves; once they have, the others are killed, as torchrun's
    agent kills a job's ranks when one fails (a rank that hangs on purpose)."""
    port = free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    waited = range(world) if wait_for is None else wait_for
    with tempfile.TemporaryDirectory() as folder:
        procs, files = [], []
        for rank in range(world):
            # closed below, once the processes are done with them
            out = open(os.path.join(folder, f"{rank}.out"), "w+")  # noqa: SIM115
            err = open(os.path.join(folder, f"{rank}.err"), "w+")  # noqa: SIM115
            files.append((out, err))
            procs.append(subprocess.Popen([sys.executable, str(SCENARIOS), scenario, *args],
                                          env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=out, stderr=err, text=True))
        deadline = time.monotonic() + timeout
        try:
            for rank in waited:
                procs[rank].wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"distributed job {scenario!r} on {world} ranks still running after {timeout} s: "
                                 f"killed") from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        ranks = []
        for rank, (out, err) in enumerate(files):
            out.seek(0)
            err.seek(0)
            ranks.append(Rank(rank, procs[rank].returncode, out.read(), err.read()))
            out.close()
            err.close()
    return ranks
