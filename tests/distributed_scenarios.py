"""What each rank of a test's ``torch.distributed`` job runs (``tests/distributed_jobs.py`` starts them):
``python distributed_scenarios.py SCENARIO [ARGS...]`` with torchrun's environment (RANK, WORLD_SIZE, MASTER_*).
A scenario prints ``RESULT <json>`` for the test to read; an exception is printed as ``ERROR <type>: <line>``
and the process exits 1.
"""

from __future__ import annotations

import datetime
import json
import math
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


def agree_subgroup(*args: str) -> None:
    """``agree(group=g)`` with ``g`` the ranks 0 and 1 of three: those two agree; rank 2, outside it, raises."""
    from tf32lab.machine import distributed
    _init()
    # a collective of the whole job: every rank makes it. Rank 2, outside the group, gets it back at once; had it
    # raised and left then, rank 1 was seen (twice in 300 jobs under load) to fail gloo's connection to rank 0 for the
    # new group ("Connection closed by peer") and rank 0 to wait for it past every timeout: so rank 2 stays until the
    # group is made, as the job's ranks do in a run that outlives its groups' set-up
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dist.barrier()
    found = distributed.agree(group=group)
    _result({"ranks": found.ranks})


def disagree(*args: str) -> None:
    """The odd ranks set ``high`` and turn cuDNN off (as a library that runs on some ranks only would): every rank
    raises."""
    import tf32lab
    from tf32lab.machine import distributed
    rank = _init()
    before = tf32lab.flags.snapshot()
    if rank % 2:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.enabled = False
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


EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "sharded", "model.py")
LEVELS = ("highest", "high", "medium")


def numbers(report) -> dict:
    """What a sharded check must share with one process's: every output's metrics, every layer's errors."""
    found = {}
    for row in report.levels:
        found[row.level] = {
            "outputs": {o.name: [list(o.shape), o.max_abs, o.max_rel, o.mean_rel, o.normwise, o.cosine, o.top1,
                                 list(o.histogram), o.bias, o.passed] for o in row.outputs},
            "layers": {e.name: [e.kind, e.calls, e.introduced, e.accumulated, e.diverged] for e in row.layers},
            "coverage": sum(row.coverage.values()), "unhandled": sum(row.unhandled.values())}
    return found


def example(factory: str, *args: str):
    """The example's workload, ``key=value`` arguments given to its factory as ints."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sharded_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, factory)(**{k: int(v) for k, v in (a.split("=") for a in args)})


def check_options(args: tuple[str, ...]) -> dict:
    """``check``'s options for a scenario's arguments: with ``failing``, a tolerance at which `high` fails (its
    layers rerun by a second float64 pass, on every rank, after the rows); else every level's layers rerun in the
    reference's own pass (``introduced="all"``)."""
    return {"tolerance": 1e-6} if "failing" in args else {"introduced": "all"}


def check(factory: str, *args: str) -> None:
    """``tf32lab.check`` of the example's sharded model (``factory``), through the Python API."""
    import tf32lab
    rank = _init()
    before = tf32lab.flags.snapshot()
    if "odd-high" in args and rank % 2:  # a library that set the level on some ranks only
        torch.set_float32_matmul_precision("high")
        before = tf32lab.flags.snapshot()
    workload = example(factory, *(a for a in args if a not in ("odd-high", "failing")))
    try:
        report = tf32lab.check(workload, levels=LEVELS, speed=False, **check_options(args))
    finally:
        assert not tf32lab.flags.snapshot().diff(before)
    if rank == 0:
        _result({"numbers": numbers(report), "notes": list(report.notes)})


def cli(*args: str) -> None:
    """``python -m tf32lab check ...`` as torchrun starts it on each rank (the CLI joins the job itself)."""
    from tf32lab.cli import main as tf32lab_main
    code = tf32lab_main(["check", *args])
    print(f"EXIT {code}", flush=True)
    sys.exit(code)


def fault(kind: str, *args: str) -> None:
    """Rank 1 raises, hangs or is killed in the middle of the check (its second end-to-end run); the job's
    other ranks must end with one error."""
    import signal
    import time

    from tf32lab.cli import main as tf32lab_main
    from tf32lab.workloads import specs

    real_load = specs.load

    def load(spec, **kw):
        workload = real_load(spec, **kw)
        if int(os.environ["RANK"]) == 1:
            runs = []

            def hook(module, inputs, output):
                if torch.is_inference_mode_enabled():  # an end-to-end run at a level (the reference is not)
                    runs.append(1)
                if len(runs) == 2:
                    if kind == "raise":
                        raise RuntimeError("rank 1's model failed")
                    if kind == "hang":
                        time.sleep(3600)
                    if kind == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)

            workload.model.head.register_forward_hook(hook)
        return workload

    specs.load = load
    code = tf32lab_main(["check", f"{EXAMPLE}:transformer", "--no-speed", *args])
    print(f"EXIT {code}", flush=True)
    sys.exit(code)



def output_cases():
    """``(name, output, reference, rows of rank 0)``: whole outputs of a batch of two ranks (rank 0 holds the first
    rows, rank 1 the rest) at magnitudes whose squares leave float64's range, beside zero, subnormal and empty parts."""
    g = torch.Generator().manual_seed(0)

    def pair(shape, scale, dtype=torch.float32, rel=1e-4):
        r = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
        return (r * (1 + rel * torch.randn(*shape, generator=g, dtype=torch.float64))).to(dtype), r

    found = [(f"f32 {s:.0e}", *pair((6, 5), s), 3) for s in (1e20, 1e-20, 1e37, 1e-38)]
    (y1, r1), (y2, r2) = pair((3, 5), 1e30), pair((3, 5), 1.0)
    found.append(("1e30 beside 1", torch.cat([y1, y2]), torch.cat([r1, r2]), 3))
    zero_y, zero_r = torch.zeros(3, 5), torch.zeros(3, 5, dtype=torch.float64)
    found.append(("zero beside 1", torch.cat([zero_y, y2]), torch.cat([zero_r, r2]), 3))
    y, r = pair((3, 5), 1e-42, rel=0.1)  # subnormal only, beside zeros: fails, and says why
    found.append(("subnormal beside zero", torch.cat([y, zero_y]), torch.cat([r, zero_r]), 3))
    found.append(("f64 1e-300", *pair((8, 4), 1e-300, torch.float64, 1e-3), 4))
    # float64 values whose norm is past float64's largest: the error of 0.1 was 0.0 (a pass)
    y = 1.7e308 * torch.linspace(0.5, 1, 16, dtype=torch.float64).reshape(8, 2)
    found.append(("f64 1.7e308", y, y * (1 - 0.1 * torch.rand(8, 2, generator=g, dtype=torch.float64)), 4))
    found.append(("logits", *pair((6, 5), 1e35), 3))
    found.append(("empty part", *pair((4, 5), 1e30), 0))
    y, r = pair((6, 5), 1e30)
    y[4, 1] = r[4, 1] = math.nan  # held alike, on rank 1 only
    found.append(("nan on one rank", y, r, 3))
    y, r = pair((6, 5), 1.0)
    y[4, 1] = math.inf  # where the reference is finite, on rank 1 only
    found.append(("inf on one rank", y, r, 3))
    return found


def sharded_outputs(*args: str) -> None:
    """``measure.sharded.outputs`` of each case of :func:`output_cases` and the one-process comparison of the whole
    (on rank 0, both)."""
    from tf32lab.measure import check, sharded
    rank = _init()
    ranks = sharded.Ranks.of_job()
    tolerances = {"default": 1e-2}

    def said(o):
        return [list(o.shape), o.max_abs, o.max_rel, o.mean_rel, o.normwise, o.cosine, o.top1, list(o.histogram),
                o.bias, o.passed, o.note, o.failure]

    found = {}
    for name, y, r, first in output_cases():
        part = slice(0, first) if rank == 0 else slice(first, None)
        mine = sharded.outputs({name: y[part]}, {name: r[part]}, tolerances, ranks, check._outputs,
                               check._below_float32)
        alone = check._outputs({name: y}, {name: r}, tolerances)
        found[name] = [said(o) for o in mine], [said(o) for o in alone]
    if rank == 0:
        _result(found)


def hostile(spec: str, *factories: str) -> None:
    """``tf32lab.check`` of each of ``factories`` (in ``spec``, a file) in turn, in one job: each one's numbers, or
    its error line, on every rank."""
    import tf32lab
    from tf32lab.workloads import specs
    _init()
    found = {}
    for factory in factories:
        before = tf32lab.flags.snapshot()
        try:
            found[factory] = numbers(tf32lab.check(specs.load(f"{spec}:{factory}"), levels=("highest", "high"),
                                                   speed=False))
        except tf32lab.Tf32LabError as exc:
            found[factory] = str(exc)
        assert not tf32lab.flags.snapshot().diff(before)
    _result(found)


def trainer(folder: str, on_fail: str) -> None:
    """A Hugging Face Trainer run without the check, then with it (``tests/transformers_ddp_job.py``)."""
    import transformers_ddp_job

    transformers_ddp_job.main(folder, on_fail)


def main() -> None:
    name, *args = sys.argv[1:]
    try:
        globals()[name](*args)
    except Exception as exc:  # one line for the test to read
        print(f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        sys.stderr.flush()
        # Out at once, the group left as it is: a rank that tears down gloo while a peer has already closed its
        # side was seen, once in three full runs under load, to abort ("terminate called without an active
        # exception") after its line was printed; what the test reads is that line.
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

