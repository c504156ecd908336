"""``check`` on models as users bring them: TorchScript, data-dependent control flow, a level that makes the model
raise, outputs that are not plain float tensors. Each ends in a full report (exit 0 or 1), never a crash."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import jsonschema
import pytest
import torch
from torch import nn

import cli_runner
import tf32lab
from tf32lab import Workload
from tf32lab.errors import Tf32LabError
from tf32lab.report import schema

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

MODELS = '''
import torch
from torch import nn


class Cascade(nn.Module):
    """Stage 1 scores rows, stage 2 refines the rows scoring >= 0 (a detector's cascade). Rows 0 and 2 score
    -2^-20 in float32 and float64 but exactly 0 under TF32 (both weights round to 1), so TF32 keeps two more."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(2, 1, bias=False)
        self.box = nn.Linear(4, 4)
        with torch.no_grad():
            self.score.weight.copy_(torch.tensor([[1 + 2**-15, -(1 + 2**-15 + 2**-20)]]))

    def forward(self, x, features):
        keep = self.score(x).squeeze(1) >= 0
        return {"boxes": self.box(features[keep]), "kept": keep.sum()}


def cascade():
    x = torch.tensor([[1.0, 1.0], [2.0, 0.0], [1.0, 1.0], [3.0, 0.0]])
    return Cascade(), (x, torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))


class Kernel(nn.Module):
    """A GP's RBF kernel: squared distances as |a|^2 + |b|^2 - 2 a.b (one GEMM, as cdist computes them), then its
    Cholesky factor. Points away from the origin make the GEMM's rounding count: under TF32 the matrix is no
    longer positive definite, at highest it is."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(4))
            self.proj.bias.fill_(3.0)

    def forward(self, x):
        z = self.proj(x)
        sq = (z * z).sum(1)
        d2 = (sq[:, None] + sq[None, :] - 2 * z @ z.T).clamp_min(0)
        return torch.linalg.cholesky(torch.exp(-0.5 * d2) + 1e-4 * torch.eye(z.shape[0], dtype=z.dtype))


def kernel():
    return Kernel(), torch.randn(64, 4, generator=torch.Generator().manual_seed(0))


def scripted():
    torch.manual_seed(0)
    return torch.jit.script(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))), torch.randn(16, 64)
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    (folder / "models.py").write_text(textwrap.dedent(MODELS))
    sys.path.insert(0, str(folder))
    try:
        import models as module

        yield module, folder / "models.py"
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("models", None)


def _valid(report) -> dict:
    data = report.to_dict()
    jsonschema.validate(data, schema())
    assert report.to_html() and data["conclusion"]
    return data


def _cli(spec: str, *extra: str) -> subprocess.CompletedProcess:
    return cli_runner.run("check", spec, *extra, module="tf32lab.cli", timeout=300)


# -- TorchScript -------------------------------------------------------------------------------------------------
def test_a_script_module_is_measured_against_a_real_float64_reference(models):
    module, _ = models
    report = tf32lab.check(Workload(*module.scripted(), name="scripted"), levels=("highest", "high"))
    highest, high = (report.level(name).outputs[0].normwise for name in ("highest", "high"))
    assert 0 < highest < 1e-5 < high < 1e-2  # a float32 "reference" would give exactly 0 at highest
    assert not report.level("high").layers  # nothing to hook inside
    assert any("TorchScript" in note and "'(model)'" in note for note in report.notes)
    _valid(report)


def test_a_frozen_script_module_is_measured_not_refused_with_a_traceback():
    """``torch.jit.freeze`` (and ``optimize_for_inference``, the usual way to ship a TorchScript model) drops the
    ``training`` attribute: check raised PyTorch's AttributeError from setting eval mode."""
    torch.manual_seed(0)
    frozen = torch.jit.freeze(torch.jit.script(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()))
    assert not hasattr(frozen, "training")
    report = tf32lab.check(Workload(frozen, torch.randn(16, 64), name="frozen"), levels=("highest", "high"))
    highest, high = (report.level(name).outputs[0].normwise for name in ("highest", "high"))
    assert 0 < highest < 1e-5 < high < 1e-2
    assert not hasattr(frozen, "training")


def test_a_script_module_that_convolves_its_input_first_gets_a_float64_input():
    """A scripted or traced convolution checks its input's dtype against its weights' inside TorchScript, where no
    mode widens: its float64 twin was handed the float32 input, and check refused the model ('raised at the
    float64 reference ... Input type (float) and bias type (double) should be the same')."""
    torch.manual_seed(0)
    convs = nn.Sequential(nn.Conv1d(1, 8, 9, padding=4), nn.ReLU(), nn.Conv1d(8, 1, 9))
    x = torch.randn(4, 1, 256)
    before = x.clone()
    for model in (torch.jit.script(convs), torch.jit.trace(convs, x)):
        report = tf32lab.check(Workload(model, x, name="convs"), levels=("highest",), conv="ieee", speed=False)
        assert 0 < report.level("highest").outputs[0].normwise < 1e-5  # IEEE convolutions: float32's own error
        assert x.dtype == torch.float32 and torch.equal(x, before)
        assert all(p.dtype == torch.float32 for p in model.parameters())

    class Host(nn.Module):  # a scripted part called first, on the model's own input
        def __init__(self) -> None:
            super().__init__()
            self.front, self.head = torch.jit.script(nn.Conv1d(1, 4, 5)), nn.Linear(252, 2)

        def forward(self, x):
            return self.head(self.front(x))

    report = tf32lab.check(Workload(Host(), x, name="host"), levels=("highest",), conv="ieee", speed=False)
    assert 0 < report.level("highest").outputs[0].normwise < 1e-5


def test_scripted_parts_of_a_python_model_are_said_and_the_rest_broken_down():
    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.jit.script(nn.Linear(32, 32))
            self.head = nn.Linear(32, 4)

        def forward(self, x):
            return self.head(torch.relu(self.inner(x)))

    model = Host()
    report = tf32lab.check(Workload(model, torch.randn(8, 32)), levels=("highest", "high"))
    # the scripted Linear's GEMM counts toward the module that calls it: here the model itself
    assert report and sorted(layer.name for layer in report.level("high").layers) == ["(model)", "head"]
    assert any("'inner'" in note for note in report.notes)
    assert model.inner.weight.dtype == torch.float32 and model._modules["inner"] is model.inner  # put back


def test_a_module_called_inside_vmap_is_said_and_its_ops_count_toward_its_caller():
    class PerSample(nn.Module):
        """A hypernetwork: one first-layer weight per sample, applied by torch.func.vmap over functional_call."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
            self.hyper = nn.Linear(8, 64 * 32)

        def forward(self, x, z):
            weights = self.hyper(z).view(-1, 64, 32) * 0.1
            params = dict(self.net.named_parameters())
            one = lambda w, x0: torch.func.functional_call(self.net, {**params, "0.weight": w}, (x0,))  # noqa: E731
            return torch.func.vmap(one)(weights, x)

    torch.manual_seed(0)
    model, x, z = PerSample(), torch.randn(16, 32), torch.randn(16, 8)
    expected = model(x, z)
    report = tf32lab.check(Workload(model, (x, z)), levels=("highest", "high"))
    high = report.level("high")
    # every GEMM emulated (the vmapped ones batched into one bmm); the model's own rows hold the vmapped net's
    assert high.coverage == {"aten::linear tf32-rna": 1, "aten::bmm tf32-rna": 1, "aten::mm tf32-rna": 1}, \
        high.coverage
    assert sorted(layer.name for layer in high.layers) == ["(model)", "hyper"]
    assert 1e-5 < high.outputs[0].normwise < 1e-2 and report.level("highest").outputs[0].normwise < 1e-5
    assert any(note.startswith("not broken down into layers where called inside a torch.func transform")
               and note.count("'net") == 1 and "'net'" in note for note in report.notes), report.notes
    assert torch.equal(model(x, z), expected)


def test_a_module_called_both_inside_and_outside_vmap_is_measured_at_its_calls_outside():
    class Laplacian(nn.Module):
        """A physics-informed net's value and Laplacian (torch.func.hessian under vmap): the same net is called
        inside the transform, then outside it."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

        def forward(self, x):
            u = lambda p: self.net(p).squeeze(-1)  # noqa: E731
            laplacian = torch.func.vmap(torch.func.hessian(u))(x).diagonal(dim1=-2, dim2=-1).sum(-1)
            return self.net(x).squeeze(-1), laplacian

    torch.manual_seed(0)
    report = tf32lab.check(Workload(Laplacian(), torch.rand(32, 2)), introduced="all", levels=("highest", "high"))
    for level in report.levels:
        # the calls outside vmap matched with the reference's one for one; the model's own row holds the rest
        assert sorted(layer.name for layer in level.layers) == ["(model)", "net.0", "net.2", "net.4"]
        assert all(layer.diverged is None and layer.calls == 1 and not math.isnan(layer.introduced)
                   and not math.isnan(layer.accumulated) for layer in level.layers), level.layers
    assert 1e-5 < report.level("high").layers[0].introduced < 1e-2


# -- data-dependent control flow ---------------------------------------------------------------------------------
def test_a_cascade_that_keeps_other_rows_is_reported_with_its_diverged_layer(models):
    module, path = models
    report = tf32lab.check(Workload(*module.cascade(), name="cascade"))
    highest, high = report.level("highest"), report.level("high")
    assert highest.passed and not high.passed
    outputs = {o.name: o for o in high.outputs}
    assert outputs["boxes"].failure == "shape (4, 4) differs from the reference's (2, 4)"
    assert "differ (compared exactly)" in outputs["kept"].failure
    box = next(layer for layer in high.layers if layer.name == "box")
    assert "shape (4, 4)" in box.diverged and not math.isnan(box.introduced)
    assert any("could not be matched" in line for line in report.conclusion())
    _valid(report)
    done = _cli(f"{path}:cascade")
    assert done.returncode == 1, done.stderr
    assert "FAILED | level 'high' | output 'boxes' | shape (4, 4) differs from the reference's (2, 4)" in done.stdout


# -- a level that makes the model raise --------------------------------------------------------------------------
def test_a_cholesky_that_fails_only_under_tf32_is_a_failed_level(models, tmp_path):
    module, path = models
    report = tf32lab.check(Workload(*module.kernel(), name="kernel"))
    assert report.level("highest").passed
    high = report.level("high")
    assert not high.passed and high.error.startswith("LinAlgError: linalg.cholesky")
    assert "FAILED | level 'high' | raised LinAlgError: linalg.cholesky" in str(report)
    assert report.conclusion()[0].startswith("Keep `highest`: at `high` the model raises LinAlgError")
    data = _valid(report)
    assert data["levels"][1]["error"].startswith("LinAlgError")
    html = tmp_path / "kernel.html"
    done = _cli(f"{path}:kernel", "--json", str(tmp_path / "kernel.json"), "--html", str(html))
    assert done.returncode == 1, done.stderr
    assert "the model raised LinAlgError" in done.stdout and "Keep `highest`" in done.stdout
    assert "the model raised LinAlgError" in html.read_text()
    assert json.loads((tmp_path / "kernel.json").read_text())["levels"][1]["error"].startswith("LinAlgError")


# -- outputs that are not plain float tensors --------------------------------------------------------------------
class _Kinds(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.make = make

    def forward(self, x):
        return self.make(self.linear(x))


def _check(make, **kwargs):
    return tf32lab.check(Workload(_Kinds(make), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))),
                         levels=("highest", "high"), **kwargs)


def test_integer_bool_and_python_outputs_are_compared_exactly():
    report = _check(lambda y: {"y": y, "index": y.argmax(-1), "positive": y > -100, "n": 3, "tag": "ok",
                               "nothing": None})
    outputs = {o.name: o for o in report.level("high").outputs}
    assert set(outputs) == {"y", "index", "positive", "n", "tag"}
    assert all(outputs[name].exact and outputs[name].passed for name in ("index", "positive", "n", "tag"))
    assert "PASSED | level 'high' | output 'index' | equal (compared exactly)" in str(report)
    _valid(report)


def test_complex_outputs_are_compared_as_pairs():
    report = _check(lambda y: torch.fft.rfft(y))
    out = report.level("high").outputs[0]
    assert out.passed and 0 < out.normwise < 1e-2 and "complex" in out.note
    assert report.level("highest").outputs[0].normwise < 1e-5
    _valid(report)


def test_an_empty_output_says_so_and_nothing_comparable_is_bad_input():
    report = _check(lambda y: (y, y[:0]))
    empty = report.level("high").outputs[1]
    assert empty.passed and empty.note.startswith("empty")
    _valid(report)
    with pytest.raises(Tf32LabError, match=r"nothing to compare \(None\)"):
        _check(lambda y: None)
    with pytest.raises(Tf32LabError, match="nothing to compare"):
        _check(lambda y: y[:0])


def test_nan_and_inf_held_alike_are_compared_by_position_and_value():
    def with_holes(y):
        y = y.clone()
        y[0, 0], y[1, 1] = float("nan"), float("inf")
        return y

    report = _check(with_holes)
    out = report.level("high").outputs[0]
    assert out.passed and math.isfinite(out.normwise) and "NaN/Inf at 2 of 32" in out.note
    _valid(report)

    def nan_only_in_float32(y):
        return y / 0 * 0 if y.dtype == torch.float32 else y  # NaN everywhere, not in the reference

    report = _check(nan_only_in_float32)
    out = report.level("high").outputs[0]
    assert not out.passed and out.failure.startswith("NaN/Inf at 32 positions")
    _valid(report)


# -- the command line, as a user meets it ------------------------------------------------------------------------
def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return cli_runner.run(*args, module="tf32lab.cli", timeout=300, cwd=cwd)


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


TINY = '''
import sys
import torch

sys.path.insert(0, "/nonexistent")  # a spec file may edit sys.path


def make():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4), torch.randn(4, 8)


def leaves():
    sys.exit(EXIT)


def function():
    return (lambda x: x), torch.ones(2)
'''


@pytest.fixture()
def spec_dir(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY.replace("EXIT", "0"))
    (tmp_path / "three.py").write_text(TINY.replace("EXIT", "3"))
    return tmp_path


def test_bad_specs_get_one_line_and_exit_2(spec_dir):
    long_name = "x" * 300
    assert "name too long" in _one_line_error(_run("check", f"{long_name}/m.py:make")).lower()
    assert "sys.exit(0)" in _one_line_error(_run("check", "tiny.py:leaves", cwd=spec_dir))
    assert "sys.exit(3)" in _one_line_error(_run("check", "three.py:leaves", cwd=spec_dir))
    assert "not a torch.nn.Module" in _one_line_error(_run("check", "tiny.py:function", cwd=spec_dir))
    assert "tiny.py:make" in _one_line_error(_run("check", "tiny.py", cwd=spec_dir))  # the hint
    assert "is a folder" in _one_line_error(_run("check", str(spec_dir)))
    newline = _one_line_error(_run("check", "tiny.py:make", "--html", "no\nsuch/r.html", cwd=spec_dir))
    assert "no\\nsuch" in newline
    unwritable = _run("check", "tiny.py:make", "--json", "/proc/r.json", cwd=spec_dir)
    assert "not writable" in _one_line_error(unwritable) and not unwritable.stdout  # before the model ran
    assert "no folder" in _one_line_error(_run("check", "tiny.py:make", "--json", "tiny.py/r.json", cwd=spec_dir))


def test_a_module_in_the_current_folder_case_insensitive_names_and_json_to_stdout(spec_dir):
    done = _run("check", "tiny:make", "--target", "A100", "--levels", "HIGH", "--json", "-", cwd=spec_dir)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["target"] == "a100" and data["levels"][0]["level"] == "high"


def test_names_and_paths_reach_the_terminal_as_inert_text(spec_dir):
    (spec_dir / "odd.py").write_text(TINY + '''

class Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.linear(x)
        return {"\\x1b]0;pwned\\x07:smile:": y, "\\udcff": y}


def odd():
    import tf32lab
    return tf32lab.Workload(Named(), torch.randn(4, 8), name="\\x1b[31mred :thumbs_up:")
''')
    html = os.fsdecode(b"r\xff.html")
    done = subprocess.run([sys.executable, "-m", "tf32lab.cli", "check", "odd.py:odd", "--levels", "high",
                           "--html", html], capture_output=True, cwd=spec_dir, timeout=300)
    out = done.stdout.decode("utf-8")
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in out and "\x07" not in out and "\\x1b" in out
    assert ":smile:" in out and "😄" not in out  # emoji codes stay text
    assert "PASSED | level 'high' | output '\\x1b]0;pwned\\x07:smile:' | normwise" in out
    assert (spec_dir / os.fsdecode(b"r\xff.html")).stat().st_size > 1000


def test_version_answers_without_importing_torch():
    code = "import sys\nfrom tf32lab import cli\ntry:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n" \
           "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().splitlines() == ["tf32lab 0.1.0", "False"], done.stderr


def test_ctrl_c_exits_130_with_one_line(spec_dir):
    (spec_dir / "slow.py").write_text('''
import time
import torch


class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        print("started", flush=True)
        time.sleep(60)
        return self.linear(x)


def make():
    return Slow(), torch.ones(2, 4)
''')
    # SIGINT back to its default in the child: a suite started in the background of a non-interactive shell
    # inherits it ignored (POSIX), and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "tf32lab.cli", "check", "slow.py:make"], cwd=spec_dir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "tf32lab check: interrupted", err


def test_a_closed_stdout_is_not_an_error(spec_dir):
    done = subprocess.run(f"{sys.executable} -m tf32lab.cli check tiny.py:make | head -c 10 >/dev/null; "
                          f"echo ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", capture_output=True,
                          text=True, cwd=spec_dir, timeout=300)
    assert done.stdout.strip() == "0" and "Traceback" not in done.stderr, done.stderr


def test_an_error_at_highest_from_tf32_convolutions_is_explained():
    class Edge(nn.Module):
        """A convolution whose output cancels to nearly nothing: TF32 (an A100's default for convs, even at
        highest) leaves a large relative error."""

        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(1, 1, 2, bias=False)
            with torch.no_grad():
                self.conv.weight.copy_(torch.tensor([[[1.0, -1.0 - 2**-14]]]))

        def forward(self, x):
            return self.conv(x)

    for accumulation in ("ideal", "hardware"):  # a "hardware" row's counts say how they were summed too
        report = tf32lab.check(Workload(Edge(), torch.ones(1, 1, 8)), levels=("highest",), accumulation=accumulation)
        assert not report
        text = " ".join(report.conclusion())
        assert "Even `highest` fails" in text and "convolutions" in text and "cudnn.conv.fp32_precision" in text, text
        assert "run TF32 at every level unless told otherwise" in text, text


def test_reports_are_written_whole_or_not_at_all(spec_dir):
    """A disk that fills up (here: a file size limit) leaves the old report in place and no temporary file."""
    (spec_dir / "r.json").write_text("old report\n")
    # no bytecode written under the limit: a module first imported there left a .pyc cut at 1000 bytes in the
    # clone, and every later import of it raised "EOFError: marshal data too short" (`make test` writes bytecode)
    limited = ("import resource, signal, sys; sys.dont_write_bytecode = True; "
               "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); from tf32lab.cli import main; "
               "sys.exit(main(['check', 'tiny.py:make', '--json', 'r.json']))")
    # the limit set in a process forked from the suite's CLI server (torch and tf32lab imported): its own alone
    (spec_dir / "limited.py").write_text(limited)
    done = cli_runner.run(module="limited", cwd=spec_dir, timeout=300)
    assert "cannot write r.json" in _one_line_error(done)
    assert (spec_dir / "r.json").read_text() == "old report\n"
    assert sorted(p.name for p in spec_dir.iterdir() if p.name.startswith(".")) == []


def test_numpy_outputs_are_compared_like_tensors():
    report = _check(lambda y: {"array": y.numpy(), "count": y.shape[0], "none": __import__("numpy").array([None])})
    outputs = {o.name: o for o in report.level("high").outputs}
    assert outputs["array"].passed and 0 < outputs["array"].normwise < 1e-2 and not outputs["array"].exact
    assert outputs["none"].exact and outputs["none"].passed  # an object array: by its text
    _valid(report)


def test_running_out_of_memory_is_said_as_such():
    class Greedy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            if x.dtype == torch.float32:  # only at the levels: 2^50 floats cannot be had
                torch.empty(2**50)
            return self.linear(x)

    with pytest.raises(Tf32LabError, match=r"out of memory at level 'highest' \(RuntimeError: .*can't allocate"):
        tf32lab.check(Workload(Greedy(), torch.randn(2, 4)))


def test_a_model_that_updates_a_buffer_starts_every_run_from_its_state_and_keeps_it():
    class Average(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)
            self.register_buffer("mean", torch.zeros(8))

        def forward(self, x):
            y = self.linear(x)
            self.mean.mul_(0.9).add_(y.mean(0), alpha=0.1)  # a running average, updated in eval mode too
            return y + self.mean

    model = Average()
    report = tf32lab.check(Workload(model, torch.randn(4, 8)), levels=("highest", "high"))
    assert report and report.level("highest").outputs[0].normwise < 1e-6
    assert torch.equal(model.mean, torch.zeros(8))  # the user's state, as it was
    assert any("float32" in note for note in report.notes)


def test_an_output_tf32lab_cannot_read_is_named_for_what_it_is():
    class Gaussian(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            return torch.distributions.Normal(self.lin(x), 1.0)

    with pytest.raises(Tf32LabError, match=r"nothing to compare \(a torch.distributions Normal, whose parameters "
                                           r"\(such as its mean\) are the tensors\)"):
        tf32lab.check(tf32lab.Workload(Gaussian(), torch.randn(3, 4)), levels=("high",), speed=False)
    with pytest.raises(Tf32LabError, match=r"nothing to compare \(an empty tensor\)"):
        _check(lambda y: y[:0])


class _Rotate(torch.distributions.Transform):
    """x -> x R^T, a torch.distributions transform holding its matrix (as zuko's RotationTransform does)."""

    bijective = True

    def __init__(self, r: torch.Tensor) -> None:
        super().__init__()
        self.r = r

    def _call(self, x):
        return x @ self.r.T


class _Rotation(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(n, n))

    def forward(self):
        return _Rotate(torch.linalg.matrix_exp(self.a - self.a.T))


class _RotatedFlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.rot = nn.Linear(8, 8), _Rotation(8)

    def forward(self, x):
        return self.rot()(self.lin(x))  # the rotation's product runs in this module, on the object's matrix


def test_a_layer_returning_a_distributions_object_feeds_its_caller_in_float32():
    torch.manual_seed(0)
    report = tf32lab.check(Workload(_RotatedFlow(), torch.randn(64, 8)), introduced="all", levels=("highest", "high"))
    for level in report.levels:
        layers = {layer.name: layer for layer in level.layers}
        # the caller reran with the rotation's reference object in float32, not float64's (which raised there)
        assert layers["(model)"].diverged is None and 0 < layers["(model)"].introduced < 1e-2, layers
        # an object with no tensor to compare is not measured, not a layer that introduces exactly 0
        assert math.isnan(layers["rot"].introduced) and "no tensor" in layers["rot"].diverged, layers
    highest, high = ({layer.name: layer.introduced for layer in report.level(lv).layers}["(model)"]
                     for lv in ("highest", "high"))
    assert highest < 1e-5 < high, (highest, high)
    assert not any("could not be matched" in line for line in report.conclusion()), report.conclusion()


class _Drawn(nn.Module):
    """A weight drawn at its first use in a call of the model and kept for the rest of it in a cache the model
    holds (pyro's PyroSample keeps its draws so)."""

    def __init__(self, cache: dict) -> None:
        super().__init__()
        self.cache = cache

    def forward(self, h):
        w = self.cache.get("w")
        if w is None:
            w = self.cache["w"] = 0.1 * torch.randn(8, 64)
        return h @ w.T


class _Bayesian(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cache: dict = {}
        self.body, self.head = nn.Linear(16, 64), _Drawn(self.cache)

    def forward(self, x):
        self.cache.clear()
        return self.head(torch.tanh(self.body(x)))


def test_a_layer_reading_a_draw_the_reference_cached_is_not_said_to_raise():
    torch.manual_seed(0)
    report = tf32lab.check(Workload(_Bayesian(), torch.randn(32, 16)), introduced="all", levels=("highest", "high"))
    assert report.passed
    for level in report.levels:
        head = {layer.name: layer for layer in level.layers}["head"]
        # run alone inside the reference's call, it reads the float64 draw cached there: not the level's doing
        assert math.isnan(head.introduced) and head.diverged.startswith("not measured") and \
            "float64" in head.diverged, head
    assert not any("could not be matched" in line for line in report.conclusion()), report.conclusion()


def test_a_layer_that_returns_none_is_not_measured_rather_than_exact():
    class Side(nn.Module):
        """Writes its product into a buffer its caller reads, and returns nothing."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("last", torch.zeros(4, 8))

        def forward(self, h):
            self.last.copy_(h @ self.lin.weight.T)  # its own product: a layer

    class Caller(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.side = nn.Linear(8, 8), Side()

        def forward(self, x):
            h = self.a(x)
            self.side(h)
            return h + self.side.last @ self.a.weight

    torch.manual_seed(0)
    report = tf32lab.check(Workload(Caller(), torch.randn(4, 8)), introduced="all", levels=("high",))
    side = {layer.name: layer for layer in report.level("high").layers}["side"]
    assert math.isnan(side.introduced) and side.diverged.endswith("(None)"), side  # it read 0.0
