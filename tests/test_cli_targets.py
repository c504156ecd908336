"""`python -m tf32lab` and `tf32lab targets`, through real subprocesses."""

import json
import os

import cli_runner
from tf32lab.know import targets


def run(*args, module="tf32lab"):
    # forked from the suite's CLI server, as `python -m <module>` runs (tests/cli_runner.py): a fresh interpreter
    # for each of the file's 12 runs cost ~1 CPU second apiece
    env = {**os.environ, "COLUMNS": "160"}
    return cli_runner.run(*args, module=module, env=env, timeout=120)


def test_python_dash_m_tf32lab_is_the_command():
    assert run("--version").stdout == run("--version", module="tf32lab.cli").stdout != ""
    done = run("levels")
    assert done.returncode == 0 and done.stdout == run("levels", module="tf32lab.cli").stdout
    done = run("--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: tf32lab ")
    done = run("no-such-command")
    assert done.returncode == 2 and "invalid choice: 'no-such-command'" in done.stderr
    assert "Traceback" not in done.stderr


def test_targets_json_gives_each_targets_math_per_level_and_its_peaks():
    done = run("targets", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["levels"] == ["highest", "high", "medium"]
    rows = {row["name"]: row for row in out["targets"]}
    assert list(rows) == list(targets.TARGETS)
    a100 = rows["a100"]
    assert a100["capability"] == [8, 0] and a100["title"] == targets.get("a100").title
    assert [a100["maths"][level]["matmul"] for level in out["levels"]] == ["ieee", "tf32-rna", "tf32-rna"]
    assert a100["maths"]["highest"]["conv"] == "tf32-rna"  # cuDNN's own flag, on by default
    assert a100["peaks"]["fp32_tflops"] == 19.5 and a100["peaks"]["tf32_tflops"] == 156
    assert {rows["v100"]["maths"][level]["matmul"] for level in out["levels"]} == {"ieee"}
    assert rows["v100"]["peaks"]["tf32_tflops"] is None
    assert rows["cpu-amx"]["maths"]["medium"]["matmul"] == "bf16-rne" and rows["cpu-amx"]["peaks"] is None


def test_targets_table_names_every_target():
    done = run("targets")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name, target in targets.TARGETS.items():
        assert any(line.startswith(f"│ {name} ") and target.title in line for line in lines), name
    a100 = next(line for line in lines if line.startswith("│ a100 "))
    assert [cell.strip() for cell in a100.split("│")[3:7]] == ["ieee", "tf32-rna", "tf32-rna", "tf32-rna"]


def test_every_help_that_takes_a_target_points_to_the_targets_command():
    # a user reading --help has the command, not the module: `tf32lab targets` lists what --target accepts
    for command in (("check",), ("doctor",)):
        done = run(*command, "--help")
        assert done.returncode == 0, done.stderr
        text = " ".join(done.stdout.split())
        assert "tf32lab targets" in text, (command, text)
        assert "tf32lab.targets" not in text and "tf32lab.know.targets" not in text, (command, text)


def test_levels_help_says_what_the_command_prints():
    text = " ".join(run("levels", "--help").stdout.split())
    assert "cuda.matmul" in text and "bfx9" in text, text


def test_the_table_gives_nvidia_targets_their_sm_and_amd_ones_their_gfx_name_only():
    # "sm94" is no name of an MI300X: its capability (9, 4) is how torch reports gfx942, which the title names
    lines = run("targets").stdout.splitlines()
    row = {name: next(line for line in lines if line.startswith(f"│ {name} ")) for name in ("a100", "mi300", "mi355")}
    assert "sm80" in row["a100"]
    assert "gfx942" in row["mi300"] and "gfx950" in row["mi355"]
    assert not any("sm9" in row[name] for name in ("mi300", "mi355")), row
