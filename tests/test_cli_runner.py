"""The suite's CLI runner (tests/cli_runner.py): a forked run is the command a fresh interpreter runs, byte for
byte, exit code and signal included; what only a fresh interpreter can see gets one."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import cli_runner
import tf32lab


def _fresh(*args, **kw):
    return cli_runner.run(*args, fresh=True, **kw)


@pytest.mark.parametrize("args", [["--version"], ["check", "builtin", "--target", "nope"], ["levels"]],
                         ids=["version", "bad-target", "levels"])
def test_a_forked_run_is_the_fresh_interpreters_run(args, tmp_path):
    forked, fresh = cli_runner.run(*args, cwd=tmp_path), _fresh(*args, cwd=tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.args == fresh.args == [sys.executable, "-m", "tf32lab", *args]


def test_the_console_script_and_python_m_agree():
    script = Path(sys.executable).with_name("tf32lab")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable}")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"tf32lab {tf32lab.__version__}"


def test_exit_codes_signals_stdin_cwd_and_the_environment_are_the_childs_own(tmp_path):
    (tmp_path / "probe.py").write_text(
        "import os, signal, sys\n"
        "print(sys.stdin.read().upper(), os.getcwd(), sys.path[0], os.environ.get('PROBE'), flush=True)\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'kill':\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.exit(int(sys.argv[1]))\n")
    env = {**os.environ, "PROBE": "yes"}
    done = cli_runner.run("3", module="probe", cwd=tmp_path, env=env, input="abc")
    assert done.returncode == 3 and done.stderr == "to stderr\n"
    assert done.stdout == f"ABC {tmp_path} {tmp_path} yes\n"
    assert cli_runner.run("kill", module="probe", cwd=tmp_path, env=env).returncode == -signal.SIGTERM
    assert "PROBE" not in os.environ and os.getcwd() != str(tmp_path)  # nothing leaks back
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        cli_runner.run(module="sleeper", cwd=tmp_path, timeout=1)


def test_what_is_read_at_start_up_gets_a_fresh_interpreter(tmp_path):
    (tmp_path / "threads.py").write_text("import torch\nprint(torch.get_num_threads(), torch.ones(64, 64).sum())\n")
    other = "2" if os.environ.get("OMP_NUM_THREADS") == "1" else "1"  # xdist workers set it to their share
    one = cli_runner.run(module="threads", cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": other})
    assert one.returncode == 0 and one.stdout.split()[0] == other, one.stderr
    assert cli_runner.run(module="threads", cwd=tmp_path).returncode == 0  # a torch op after the fork: no hang


def test_forked_runs_count_their_cpu_seconds(tmp_path):
    (tmp_path / "spin.py").write_text("sum(range(3_000_000))\n")
    cli_runner.run(module="spin", cwd=tmp_path)  # the server's start counts too: then only the run
    before = cli_runner.forked_cpu_seconds()
    cli_runner.run(module="spin", cwd=tmp_path)
    assert cli_runner.forked_cpu_seconds() > before


def test_a_forked_tf32lab_command_keeps_the_one_tf32lab_package(tmp_path):
    # `python -m tf32lab` runs tf32lab.__main__ as __main__ and imports the package once: a second package object
    # would lack the submodules the server had imported (tf32lab.errors), which `import tf32lab.errors` then
    # does not attach to it
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "import tf32lab.errors\n\n\n"
        "def make():\n"
        "    assert tf32lab.errors.Tf32LabError is tf32lab.Tf32LabError\n"
        "    return torch.nn.Linear(8, 8), torch.randn(4, 8)\n")
    done = cli_runner.run("check", "mymodel.py:make", "--levels", "highest", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_a_folder_that_shadows_a_module_the_server_imported_gets_a_fresh_interpreter(tmp_path):
    # `python -m` puts the folder first on sys.path: its own tf32lab is the one a fresh interpreter runs, not the
    # server's (nor may the forked child quietly keep the server's copy of any module the folder shadows)
    package = tmp_path / "tf32lab"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text("print('the folder\\'s own tf32lab')\n")
    forked, fresh = cli_runner.run("--version", cwd=tmp_path), _fresh("--version", cwd=tmp_path)
    assert fresh.stdout == "the folder's own tf32lab\n"
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_stdout_or_stderr_given_is_the_childs_own_as_a_fresh_interpreters_is(tmp_path):
    # a full disk on stdout, a closed stdout, a full stderr: the exit code and what is left on the other stream are
    # the fresh interpreter's (its buffering, PYTHONUNBUFFERED or not, decides whether a full stderr costs exit 120)
    (tmp_path / "say.py").write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n")
    for given in ({"stdout": "full"}, {"stdout": cli_runner.CLOSED}, {"stderr": "full"}):
        runs = []
        for fresh in (False, True):
            with open("/dev/full", "w") as full:
                streams = {k: full if v == "full" else v for k, v in given.items()}
                done = cli_runner.run(module="say", cwd=tmp_path, fresh=fresh, **streams)
            runs.append((done.returncode, done.stdout, done.stderr and done.stderr.splitlines()[-1]))
        assert runs[0] == runs[1], (given, runs)


def test_a_variable_read_at_start_set_in_this_process_later_restarts_the_server(tmp_path, monkeypatch):
    # as importing sentence-transformers sets KMP_* after the server started: later runs still fork, from a
    # server started with this process's environment, instead of each taking a fresh interpreter
    (tmp_path / "spin.py").write_text("import os\nprint(os.environ.get('KMP_TF32LAB_PROBE'))\n")
    cli_runner.run(module="spin", cwd=tmp_path)
    monkeypatch.setenv("KMP_TF32LAB_PROBE", "set")
    before = cli_runner.forked_cpu_seconds()
    done = cli_runner.run(module="spin", cwd=tmp_path)
    assert done.stdout.strip() == "set" and cli_runner.forked_cpu_seconds() > before
    before = cli_runner.forked_cpu_seconds()  # the new server's start counted above: now the run alone
    assert cli_runner.run(module="spin", cwd=tmp_path).stdout.strip() == "set"
    assert cli_runner.forked_cpu_seconds() > before
