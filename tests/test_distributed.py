"""``torch.distributed`` jobs of 2 and 4 real processes on gloo (CPU): ranks that agree on precision, ranks that do
not, ``autoconfig(agree=True)``; the sharded check (FSDP2, tensor parallel) against one process; faults."""

from __future__ import annotations

import pytest

from distributed_jobs import run_job


@pytest.mark.parametrize("world", [2, 4])
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


def test_autoconfig_agree_puts_back_each_rank_on_disagreement():
    ranks = run_job("autoconfig", 2, "odd")
    errors = {line for r in ranks for line in r.stdout.splitlines() if line.startswith("ERROR")}
    assert [r.returncode for r in ranks] == [1, 1], [r.stdout + r.stderr for r in ranks]
    assert len(errors) == 1 and "ranks disagree" in errors.pop()


def test_autoconfig_agree():
    ranks = run_job("autoconfig", 2)
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout + r.stderr for r in ranks]
    assert [r.result for r in ranks] == [{"level": "high", "agreed": 2}] * 2


def test_agree_outside_a_job_is_one_clear_error():
    import tf32lab
    from tf32lab.machine import distributed
    with pytest.raises(tf32lab.Tf32LabError, match="needs an initialised"):
        distributed.agree()
    with pytest.raises(tf32lab.Tf32LabError, match="agree=True"):
        tf32lab.autoconfig(agree=True)
    assert distributed.rank_of({"RANK": "1", "WORLD_SIZE": "4"}) == (1, 4)
    assert distributed.rank_of({}) == (None, 1)
