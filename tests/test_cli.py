"""The command line, through real subprocesses."""


import cli_runner
import tf32lab


def run(*args):
    return cli_runner.run(*args, module="tf32lab.cli", timeout=120)


def test_version():
    done = run("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"tf32lab {tf32lab.__version__}"


def test_help_names_the_commands():
    done = run("--help")
    assert done.returncode == 0
    assert "levels" in done.stdout and "usage: tf32lab" in done.stdout


def test_levels_table():
    done = run("levels")
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["highest", "ieee", "ieee"]
    assert lines[2].split()[:3] == ["bfx9", "bfx9", "ieee"]  # the level beyond PyTorch's three, said so
    assert lines[4].split() == ["medium", "tf32", "bf16"]


def test_bad_option_exits_2_without_traceback():
    done = run("--no-such-option")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "unrecognized arguments: --no-such-option" in done.stderr
