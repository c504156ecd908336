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


def test_a_subcommands_bad_option_is_named_by_that_subcommand():
    # tune takes no --levels: the line names tune and its --help, where the options it does take are listed
    done = run("tune", "minilm", "--levels", "bfx9")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("tf32lab tune: error: unrecognized arguments: --levels bfx9 "
                                   "(see tf32lab tune --help)")
    nested = run("policy", "show", "p.json", "--no-such-option")
    assert nested.returncode == 2 and nested.stderr.startswith("tf32lab policy show: error: unrecognized")
    # and so is its error after parsing: the same prefix as argparse's, not the parent command's
    missing = run("policy", "show", "no_such_policy.json")
    assert missing.returncode == 2 and missing.stderr.startswith(
        "tf32lab policy show: error: policy file 'no_such_policy.json': cannot read it"), missing.stderr
