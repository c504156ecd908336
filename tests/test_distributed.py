"""``torch.distributed`` jobs of 2 and 4 real processes on gloo (CPU): ranks that agree on precision, ranks that do
not, ``autoconfig(agree=True)``; the sharded check (FSDP2, tensor parallel) against one process; faults."""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path

import pytest

import cli_runner
from distributed_jobs import run_job
from tf32lab.errors import Tf32LabError


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_agree_ranks_at_one_precision(world):
    ranks = run_job("agree", world, "high")
    assert [r.returncode for r in ranks] == [0] * world, [r.stdout + r.stderr for r in ranks]
    assert [r.result["ranks"] for r in ranks] == [world] * world
    assert {r.result["level"] for r in ranks} == {"high"}
    assert [r.result["prefix"] for r in ranks] == [f"rank {i}/{world}: " for i in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_disagreement_is_one_line_on_every_rank(world):
    ranks = run_job("disagree", world)
    errors = [line for r in ranks for line in r.stdout.splitlines() if line.startswith("ERROR")]
    assert [r.returncode for r in ranks] == [1] * world
    assert len(errors) == world and len(set(errors)) == 1, errors  # the same line on every rank
    line = errors[0]
    even, odd = ",".join(map(str, range(0, world, 2))), ",".join(map(str, range(1, world, 2)))
    assert line.startswith("ERROR Tf32LabError: ranks disagree on precision")
    for who in (even, odd):
        assert (f"ranks {who} " if "," in who else f"rank {who} ") in line
    assert "level:" in line and "'high'" in line and "'highest'" in line
    assert "cell mkldnn.matmul:" in line
    assert "cell cudnn:" in line and "'off'" in line  # cuDNN off sets a GPU's convolution math


@pytest.mark.slow
def test_autoconfig_agree_puts_back_each_rank_on_disagreement():
    ranks = run_job("autoconfig", 2, "odd")
    errors = {line for r in ranks for line in r.stdout.splitlines() if line.startswith("ERROR")}
    assert [r.returncode for r in ranks] == [1, 1], [r.stdout + r.stderr for r in ranks]
    assert len(errors) == 1 and "ranks disagree" in errors.pop()


def test_autoconfig_agree():
    ranks = run_job("autoconfig", 2)
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout + r.stderr for r in ranks]
    assert [r.result for r in ranks] == [{"level": "high", "agreed": 2}] * 2


def test_agree_on_a_rank_outside_its_group_is_an_error():
    ranks = run_job("agree_subgroup", 3)
    assert [r.returncode for r in ranks] == [0, 0, 1], [r.stdout + r.stderr for r in ranks]
    assert [r.result["ranks"] for r in ranks[:2]] == [2, 2]  # the group's two ranks agree among themselves
    errors = [line for line in ranks[2].stdout.splitlines() if line.startswith("ERROR")]
    assert errors == ["ERROR Tf32LabError: agree(group=...) was called on rank 2, which is not a member of that "
                      "group: call it on the group's ranks only (or with group=None, the whole job)"]


def test_agree_outside_a_job_is_one_clear_error():
    import tf32lab
    from tf32lab.machine import distributed
    with pytest.raises(tf32lab.Tf32LabError, match="needs an initialised"):
        distributed.agree()
    with pytest.raises(tf32lab.Tf32LabError, match="agree=True"):
        tf32lab.autoconfig(agree=True)
    assert distributed.rank_of({"RANK": "1", "WORLD_SIZE": "4"}) == (1, 4)
    assert distributed.rank_of({}) == (None, 1)


# -- the sharded check ------------------------------------------------------------------------------------------
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sharded" / "model.py"


def _alone(factory: str, *args: str) -> dict:
    """The check of the same model, whole, in this one process (the example's factory outside a job)."""
    return json.loads(_alone_json(factory, *args))


@functools.cache
def _alone_json(factory: str, *args: str) -> str:
    # one check per model for the tests that compare with it (a worker's tests share it; each gets its own copy)
    import tf32lab
    from distributed_scenarios import LEVELS, check_options, example, numbers

    return json.dumps(numbers(tf32lab.check(example(factory, *(a for a in args if a != "failing")), levels=LEVELS,
                                            speed=False, **check_options(args))))


def _same(sharded, alone, path="report", rel=1e-9):
    """Equal, numbers to float64 rounding of the reductions (relative 1e-9). Three of an output's fields to 1e-6:
    the largest and mean relative error per element (2 and 3; the float64 reference of a batch of 4 rows and of 8
    differs in its last bits, another GEMM blocking, and an element whose reference is small divides that up) and
    the bias (8; a sum of signed errors that cancel, summed in another order)."""
    if isinstance(alone, dict):
        assert sorted(sharded) == sorted(alone), path
        for key in alone:
            _same(sharded[key], alone[key], f"{path}.{key}", rel)
    elif isinstance(alone, list):
        assert len(sharded) == len(alone), path
        for i, (a, b) in enumerate(zip(sharded, alone)):
            _same(a, b, f"{path}[{i}]", rel)
    elif isinstance(alone, float) and not isinstance(alone, bool):
        rel = 1e-6 if path.endswith(("[2]", "[3]", "[8]")) and ".outputs." in path else rel
        assert sharded == pytest.approx(alone, rel=rel, abs=1e-300, nan_ok=True), path
    else:
        assert sharded == alone, path


def _checked(ranks) -> dict:
    assert [r.returncode for r in ranks] == [0] * len(ranks), [r.stdout[-2000:] + r.stderr[-3000:] for r in ranks]
    found = ranks[0].result
    assert found is not None and all(r.result is None for r in ranks[1:])  # rank 0 reports
    return found


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fsdp2_transformer_checked_sharded_equals_one_process(world):
    # four rows per rank: CPU attention kernels sum in another order for fewer rows (float32 bits, as the same
    # model would give on that many rows in one process), so the batch grows with the ranks
    batch = f"batch={4 * world}"
    found = _checked(run_job("check", world, "transformer", batch, timeout=120))
    alone = _alone("transformer", batch)
    _same(found["numbers"], alone)
    assert alone["high"]["outputs"]["output"][4] > 1e-5  # the levels were emulated (TF32's error), on every rank
    assert any(f"sharded over {world} ranks" in note for note in found["notes"])


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_mlp_checked_sharded_equals_one_process(world):
    found = _checked(run_job("check", world, "tensor_parallel", timeout=120))
    alone = _alone("tensor_parallel")
    # The row-parallel layer's float64 reference is summed from each rank's partial products (the all-reduce):
    # float64 rounding of an output of size ~1, which is ~1e-9 of the float32 error (3e-7) at highest.
    _same(found["numbers"], alone, rel=1e-7)
    assert alone["high"]["layers"]["0"][2] > 1e-5 and found["numbers"]["high"]["unhandled"] == 0


def test_a_failing_level_of_a_tensor_parallel_mlp_has_its_layers_rerun_by_every_rank_as_in_one_process():
    # `high` fails at 1e-6: each rank runs the float64 reference again after the rows, rerunning the layers at it
    found = _checked(run_job("check", 2, "tensor_parallel", "failing", timeout=120))
    alone = _alone("tensor_parallel", "failing")
    _same(found["numbers"], alone, rel=1e-7)
    assert math.isnan(alone["highest"]["layers"]["0"][2]) and alone["high"]["layers"]["0"][2] > 1e-5
    assert not alone["high"]["outputs"]["output"][-1]


def test_a_tensor_parallel_check_at_a_reduced_level_alone_runs(tmp_path):
    # DTensor infers each op's sharding on fake tensors, the first time at whatever level comes first: the
    # emulator lets those through as they are (it once tried to round them and raised)
    out = tmp_path / "report.json"
    ranks = run_job("cli", 2, f"{EXAMPLE}:tensor_parallel", "--levels", "high", "--no-speed", "--json", str(out),
                    "--timeout", "30", timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout[-2000:] + r.stderr[-3000:] for r in ranks]
    assert [row["level"] for row in json.loads(out.read_text())["levels"]] == ["high"]


def test_a_sharded_check_refuses_ranks_at_other_levels():
    ranks = run_job("check", 2, "tensor_parallel", "odd-high", timeout=60)
    errors = [line for r in ranks for line in r.stdout.splitlines() if line.startswith("ERROR")]
    assert [r.returncode for r in ranks] == [1, 1] and len(errors) == 2, [r.stderr[-2000:] for r in ranks]
    assert errors[0].startswith("ERROR Tf32LabError: rank 0/2: ranks disagree on precision (2 ranks): ")
    assert errors[1].startswith("ERROR Tf32LabError: rank 1/2: ranks disagree on precision (2 ranks): ")


def test_cli_under_torchrun_writes_one_report(tmp_path):
    out = tmp_path / "report.json"
    ranks = run_job("cli", 2, f"{EXAMPLE}:transformer", "--levels", "highest,high", "--no-speed", "--json", str(out),
                    "--timeout", "30", timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout[-2000:] + r.stderr[-3000:] for r in ranks]
    assert "PASSED | level 'high' | output 'output'" in ranks[0].stdout and "PASSED" not in ranks[1].stdout
    data = json.loads(out.read_text())
    alone = _alone("transformer")
    for row in data["levels"]:
        assert row["outputs"][0]["normwise"] == pytest.approx(alone[row["level"]]["outputs"]["output"][4], rel=1e-9)


def test_sharded_outputs_of_huge_tiny_zero_and_empty_parts_equal_one_process():
    # one job for every case: each output split over two ranks, against the whole compared in one process
    ranks = run_job("sharded_outputs", 2, timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout[-2000:] + r.stderr[-3000:] for r in ranks]
    found = ranks[0].result
    for name, (sharded, alone) in found.items():
        _same(sharded, alone, name)
    assert not found["f64 1.7e308"][1][0][9]  # an error of 0.1 fails (it was 0.0 sharded, and passed)
    assert "below float32's normal range" in found["subnormal beside zero"][1][0][10]


MODELS = Path(__file__).resolve().parent / "sharded_models.py"


def test_ranks_that_run_the_model_differently_end_alike_or_say_so():
    # one job, four checks in turn: each ends with the one-process answer, or with one line on every rank
    ranks = run_job("hostile", 2, str(MODELS), "nan_part", "widened", "branch", "narrow", "zero", "loss",
                    timeout=180)
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout[-2000:] + r.stderr[-3000:] for r in ranks]
    found = [r.result for r in ranks]
    import tf32lab
    from distributed_scenarios import numbers
    from tf32lab.workloads import specs

    for factory in ("nan_part", "widened"):  # a rank's rows all NaN; a rank's part in float64
        alone = json.loads(json.dumps(numbers(tf32lab.check(specs.load(f"{MODELS}:{factory}"),
                                                            levels=("highest", "high"), speed=False))))
        _same(found[0][factory], alone, factory)
    # a layer called on one rank only: each rank says where it was, none waits for the group's timeout
    assert found[0]["branch"].startswith("rank 0/2: the ranks ran the model differently: this rank was at the "
                                         "comparison of the outputs, another elsewhere")
    assert found[1]["branch"].startswith("rank 1/2: the ranks ran the model differently: this rank was at call 2 "
                                         "of layer 'lin', another elsewhere")
    for rank, line in enumerate(r["narrow"] for r in found):
        assert line == (f"rank {rank}/2: output 'output': the ranks' parts have shapes [(2, 4), (2, 3)]; accepted: "
                        f"parts of one batch (the same shape but for dim 0)")
    # a 0-d output (a loss), each rank's own: the ranks' values as one vector (a 0-d tensor has no byte view: the
    # check said the workload raised)
    loss = found[0]["loss"]
    assert loss["high"]["outputs"]["output"][0] == [2] and loss["highest"]["outputs"]["output"][9]
    # zero on every rank: refused as in one process (it passed, having measured nothing)
    for rank, line in enumerate(r["zero"] for r in found):
        assert line.startswith(f"rank {rank}/2: workload 'zero': the float64 reference is zero at every element of "
                               f"output 'output' on every rank"), line


# -- faults -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [pytest.param("raise", marks=pytest.mark.slow), "kill",
                                  pytest.param("hang", marks=pytest.mark.slow)])
def test_a_failing_rank_ends_the_check_on_every_rank_with_one_error(tmp_path, kind):
    out = tmp_path / "report.json"
    started = time.monotonic()
    # a hanging rank is found by the timeout alone, which the test waits out (idle): 4 s, where no collective of this
    # small model's check takes a second; a rank that raises or is killed is found without it
    ranks = run_job("fault", 2, kind, "--json", str(out), "--timeout", "4" if kind == "hang" else "8", timeout=90,
                    wait_for=[0] if kind == "hang" else None)
    took = time.monotonic() - started
    assert ranks[0].returncode == 2, ranks[0].stdout[-2000:] + ranks[0].stderr[-3000:]
    errors = [line for line in ranks[0].stderr.splitlines() if line.startswith("tf32lab check: error:")]
    assert len(errors) == 1 and "rank 0/2: the sharded check stopped" in errors[0], ranks[0].stderr[-3000:]
    assert "Traceback" not in ranks[0].stderr
    if kind == "raise":  # the failing rank says why, in one line too
        assert ranks[1].returncode == 2 and "rank 1/2: workload 'sharded-transformer' raised" in \
            ranks[1].stderr and "rank 1's model failed" in ranks[1].stderr
    if kind == "kill":
        assert ranks[1].returncode == -9
    assert not out.exists() and not list(tmp_path.iterdir())  # no report, not even half of one
    assert took < 60


# -- in one process ---------------------------------------------------------------------------------------------
def test_disagreement_names_ranks_and_settings():
    from tf32lab.machine.distributed import RankState, disagreement

    cells = {"cuda.matmul": "ieee", "mkldnn.matmul": "ieee"}
    states = [RankState(r, dict(cells), "highest", "none", "0.1.0", "2.13.0") for r in range(3)]
    assert disagreement(states) is None
    states[2] = RankState(2, {**cells, "cuda.matmul": "tf32"}, "highest", "abc", "0.1.0", "2.13.0")
    line = disagreement(states)
    assert line == ("ranks disagree on precision (3 ranks): cell cuda.matmul: ranks 0,1 'ieee'; rank 2 'tf32' | "
                    "policy: ranks 0,1 'none'; rank 2 'abc'")


def test_a_group_of_one_rank_checks_as_one_process():
    import torch
    import torch.distributed as dist

    import tf32lab

    def report():
        torch.manual_seed(0)
        workload = tf32lab.Workload(torch.nn.Linear(8, 4), torch.randn(4, 8))
        return tf32lab.check(workload, levels=("high",), speed=False)

    alone = report()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        found = report()
    finally:
        dist.destroy_process_group()
    assert found.level("high").outputs == alone.level("high").outputs
    assert not any("sharded" in note for note in found.notes)


def test_a_sharded_checks_arguments_are_compared_too():
    import torch.distributed as dist

    from tf32lab.machine.distributed import RankState, agree, disagreement

    cells = {"cuda.matmul": "ieee"}
    states = [RankState(r, dict(cells), "highest", "none", "0.1.0", "2.13.0", {"check levels": lv})
              for r, lv in enumerate(("highest,high", "high,highest"))]
    assert disagreement(states) == ("ranks disagree on precision (2 ranks): check levels: rank 0 'highest,high'; "
                                    "rank 1 'high,highest'")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert agree(also={"check target": "a100"}).state.also == {"check target": "a100"}
        with pytest.raises(Tf32LabError, match=r"agree\(also=\.\.\.\) takes a dict"):
            agree(also=[("check target", "a100")])
    finally:
        dist.destroy_process_group()


def test_emulate_without_a_weight_cache_gives_the_same_bits():
    import torch

    import tf32lab

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    x = torch.randn(16, 64)
    with tf32lab.precision("high"):
        with tf32lab.emulate("a100") as cached:
            a = model(x)
        with tf32lab.emulate("a100", weight_cache=False) as uncached:
            b = model(x)
    assert torch.equal(a, b) and cached.coverage == uncached.coverage


def test_fsdp_wrapper_classes_are_named_as_written():
    import torch

    from tf32lab.measure.sharded import type_name

    fsdp = pytest.importorskip("torch.distributed.fsdp")
    module = torch.nn.Linear(2, 2)
    module.__class__ = type("FSDPLinear", (fsdp.FSDPModule, torch.nn.Linear), {})  # as fully_shard swaps it
    assert type(module).__name__ == "FSDPLinear" and type_name(module) == "Linear"
    assert type_name(torch.nn.Linear(2, 2)) == "Linear"


def test_a_check_of_a_model_without_fsdp_does_not_import_it(tmp_path):
    # torch.distributed.fsdp costs 0.9 s of CPU to import, half of torch's own import: only a model sharded with
    # FSDP2 needs its hooks, and that model's code has imported the package already. The process is forked from the
    # suite's CLI server (torch and check imported there, FSDP not: were it, the test would fail).
    code = ("import sys, torch, tf32lab\n"
            "tf32lab.check(tf32lab.Workload(torch.nn.Linear(8, 4), torch.randn(2, 8)), levels=('high',), speed=False)\n"
            "print('torch.distributed.fsdp' in sys.modules)")
    (tmp_path / "without_fsdp.py").write_text(code)
    done = cli_runner.run(module="without_fsdp", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"], done.stdout


@pytest.mark.parametrize("command", [["tune", "examples/tune/model.py:make"], ["speed", "examples/tune/model.py:make"],
                                     ["check", "examples/value_head/train.py:workload", "--train"]])
def test_commands_of_one_process_are_refused_under_torchrun(command):
    root = Path(__file__).resolve().parents[1]
    done = cli_runner.run(*command, timeout=120, cwd=root, env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "rank 1/2: " in done.stderr and "runs in one process, not under torchrun" in done.stderr


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "abc", "0.001"])
def test_a_timeout_no_collective_could_meet_is_refused(bad):
    done = cli_runner.run("check", "--timeout", bad, timeout=120)
    assert done.returncode == 2 and "bad timeout" in done.stderr and "seconds >= 1" in done.stderr, done.stderr


EMPTY_RANK = """
import torch, torch.distributed as dist
import tf32lab


def make():
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return tf32lab.Workload(torch.nn.Linear(8, 4), (x if rank == 0 else x[:0],), name="uneven")
"""


def test_a_rank_whose_part_of_the_batch_is_empty_still_checks_the_whole(tmp_path):
    import tf32lab
    from tf32lab.workloads import specs

    spec = tmp_path / "uneven.py"
    spec.write_text(EMPTY_RANK)
    out = tmp_path / "report.json"
    ranks = run_job("cli", 2, f"{spec}:make", "--levels", "highest,high", "--no-speed", "--json", str(out),
                    "--timeout", "30", timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout[-2000:] + r.stderr[-3000:] for r in ranks]
    sharded = {row["level"]: row for row in json.loads(out.read_text())["levels"]}
    alone = tf32lab.check(specs.load(f"{spec}:make"), levels=("highest", "high"), speed=False)
    for level in ("highest", "high"):
        got = sharded[level]["outputs"][0]["normwise"]
        assert got == pytest.approx(alone.level(level).outputs[0].normwise, rel=1e-9)


def test_a_group_without_a_cpu_backend_reduces_on_its_device_before_pytorch_2_6(monkeypatch):
    # PyTorch 2.4 and 2.5 have no _get_object_coll_device: an nccl-only group's reductions were made on the CPU
    # there, which such a group cannot take; _get_pg_default_device gives the same answer
    from types import SimpleNamespace

    import torch

    from tf32lab.measure import sharded

    c10d = torch.distributed.distributed_c10d
    monkeypatch.delattr(c10d, "_get_object_coll_device", raising=False)
    monkeypatch.setattr(c10d, "_get_pg_default_device", lambda group=None: torch.device("cuda"), raising=False)
    assert sharded._collective_device(SimpleNamespace(bound_device_id=None)) == torch.device("cuda")
    bound = SimpleNamespace(bound_device_id=torch.device("cuda", 1))
    assert sharded._collective_device(bound) == torch.device("cuda", 1)
