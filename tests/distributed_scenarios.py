"""What each rank of a test's ``torch.distributed`` job runs (``tests/distributed_jobs.py`` starts them):
``python distributed_scenarios.py SCENARIO [ARGS...]`` with torchrun's environment (RANK, WORLD_SIZE, MASTER_*).
A scenario prints ``RESULT <json>`` for the test to read; an exception is printed as ``ERROR <type>: <line>``
and the process exits 1.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

TIMEOUT_S = float(os.environ.get("TF32LAB_TEST_TIMEOUT", "20"))


def _init() -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return dist.get_rank()


def _result(value) -> None:
    print("RESULT " + json.dumps(value), flush=True)


def agree(*args: str) -> None:
    """Every rank at the same settings (``high`` on all when asked): the agreement."""
    import tf32lab
    from tf32lab.machine import distributed
    _init()
    if "high" in args:
        tf32lab.set_float32_matmul_precision("high")
    found = distributed.agree()
    _result({"ranks": found.ranks, "level": found.state.level, "prefix": distributed.rank_prefix()})


def disagree(*args: str) -> None:
    """The odd ranks set ``high`` (as a library that runs on some ranks only would): every rank raises."""
    import tf32lab
    from tf32lab.machine import distributed
    rank = _init()
    before = tf32lab.flags.snapshot()
    if rank % 2:
        torch.set_float32_matmul_precision("high")
    try:
        distributed.agree()
    finally:
        tf32lab.flags.restore(before)


def autoconfig(*args: str) -> None:
    """``autoconfig(agree=True)``: rank 1 asks for another level than the others; every rank raises and each one's
    flags are as they were."""
    import tf32lab
    rank = _init()
    before = tf32lab.flags.snapshot()
    level = "medium" if rank == 1 and "odd" in args else "high"
    try:
        decisions = tf32lab.autoconfig(level, threads=1, agree=True)
    except tf32lab.Tf32LabError:
        changed = tf32lab.flags.snapshot().diff(before)
        assert not changed, changed
        raise
    _result({"level": decisions["precision"].new, "agreed": decisions["agreement"].new})
    decisions.undo()


def main() -> None:
    name, *args = sys.argv[1:]
    try:
        globals()[name](*args)
    except Exception as exc:  # one line for the test to read
        print(f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
