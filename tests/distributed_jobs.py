"""Real multi-process ``torch.distributed`` jobs for the tests: ``run_job(scenario, world)`` starts ``world``
Python processes on gloo (CPU), each running ``scenario`` from ``tests/distributed_scenarios.py``, and returns each
rank's exit code and output. Every job has a hard timeout: a bug can never hang the suite (all its processes are
killed there, and the test fails saying so).

The ranks are forked from one process per job that has imported torch, ``torch.distributed``, tf32lab and what
every rank of the scenario imports (this file, run as a script: a zygote, as ``tests/cli_runner.py``'s server is),
each with torchrun's environment of its rank: a job then pays one interpreter's start-up (2-3 CPU seconds with
torch, and up to 2 more for the check, FSDP and DTensor) instead of one per rank. The zygote itself is forked from
the suite's CLI server (``tests/cli_runner.py``, which has imported torch and tf32lab), or is a fresh interpreter
where that server cannot stand in for one: a job then pays only what its scenario imports beyond the server's.
Each rank is still its own process, with its own exit code, signals, stdout and stderr, and the zygote runs no
torch operation before it forks (OpenMP's thread pool does not survive a fork). It reaps the ranks and writes their
exit codes (a signal as a negative one, as ``subprocess`` gives it) for ``run_job`` to read; a job is a process
group of its own, which ``run_job`` kills whole once it has ended or run past its timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cli_runner

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
            "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    waited = ",".join(map(str, range(world) if wait_for is None else wait_for))
    with tempfile.TemporaryDirectory() as folder:
        try:
            # the zygote forked from the suite's CLI server (torch and tf32lab imported there once), or a fresh
            # interpreter where that server cannot stand in for one; a process group of its own either way
            zygote = cli_runner.run(folder, str(world), waited, scenario, *args, module="distributed_jobs",
                                    cwd=folder, env=base, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"distributed job {scenario!r} on {world} ranks still running after {timeout} s: "
                                 f"killed") from None
        finally:  # the job is killed whole: its ranks too (a rank that hangs on purpose, or past the timeout)
            with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
                os.killpg(int((Path(folder) / "zygote.pid").read_text()), signal.SIGKILL)
        codes_file = Path(folder) / "codes.json"
        assert zygote.returncode == 0 and codes_file.exists(), \
            f"distributed job {scenario!r}: its zygote ended with {zygote.returncode}: " \
            f"{(zygote.stdout + zygote.stderr)[-3000:]}"
        codes = json.loads(codes_file.read_text())
        return [Rank(rank, codes[rank], (Path(folder) / f"{rank}.out").read_text(),
                     (Path(folder) / f"{rank}.err").read_text()) for rank in range(world)]


def _preloaded(scenario: str, args: list[str]) -> list[str]:
    """The modules every rank of ``scenario`` imports: a check imports the CLI and the check itself, a sharded
    transformer FSDP, a tensor-parallel MLP DTensor's parallel API."""
    names = ["torch", "torch.distributed", "tf32lab", "tf32lab.machine.distributed"]
    if scenario in ("check", "cli", "fault"):
        names += ["tf32lab.cli", "tf32lab.measure.check"]
    if any("transformer" in arg for arg in args) or scenario == "fault":
        names.append("torch.distributed.fsdp")
    if any("tensor_parallel" in arg for arg in args):
        names.append("torch.distributed.tensor.parallel")
    if scenario == "trainer":  # transformers' Trainer: 3-4 CPU seconds a process to import
        names += ["transformers.trainer", "tf32lab.integrations.transformers", "transformers_ddp_job"]
    return names


def _zygote(folder: str, world: int, waited: set[int], scenario: str, args: list[str]) -> None:
    """Fork the job's ranks, wait for those in ``waited`` (then kill the rest), write every exit code."""
    import importlib

    # a process group of its own (setsid), named in the folder: run_job kills the job whole, zygote and ranks
    with contextlib.suppress(PermissionError):  # already leading one
        os.setsid()
    if os.getpgrp() == os.getpid():  # never the group of the process that started it
        (Path(folder) / "zygote.pid").write_text(str(os.getpid()))

    # what every rank of this scenario imports, once for all (no torch operation runs here)
    import distributed_scenarios

    for name in _preloaded(scenario, args):
        importlib.import_module(name)
    pids = {}
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: torchrun's environment, its own output files; never returns into this loop
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
            for fd, name in ((1, f"{rank}.out"), (2, f"{rank}.err")):
                target = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(target, fd)
                os.close(target)
            sys.argv = [str(SCENARIOS), scenario, *args]
            distributed_scenarios.main()
            sys.exit(0)
        pids[pid] = rank
    codes: dict[int, int] = {}
    while len(codes) < world:
        pid, status = os.wait()
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if waited <= set(codes):  # the ranks that had to end have: the others are killed
            for other, rank in pids.items():
                if rank not in codes:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
    (Path(folder) / "codes.json").write_text(json.dumps([codes[rank] for rank in range(world)]))


if __name__ == "__main__":
    _zygote(sys.argv[1], int(sys.argv[2]), {int(r) for r in sys.argv[3].split(",") if r}, sys.argv[4],
            sys.argv[5:])
