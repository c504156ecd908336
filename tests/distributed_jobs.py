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
import time
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


def run_job(scenario: str, world: int, *args: str, timeout: float = 60.0, env: dict | None = None) -> list[Rank]:
    """Run ``scenario`` on ``world`` ranks; each rank's output. Raises ``AssertionError`` past ``timeout``."""
    port = free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    procs = []
    for rank in range(world):
        procs.append(subprocess.Popen(
            [sys.executable, str(SCENARIOS), scenario, *args],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    ranks = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            ranks.append(Rank(rank, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.communicate()
        raise AssertionError(f"distributed job {scenario!r} on {world} ranks still running after {timeout} s: "
                             f"killed") from None
    return ranks
