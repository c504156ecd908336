"""check, tune, predict and speed at the edges: empty products, an applied policy, a NaN reference, products on a
helper thread, a model that sets PyTorch's level itself."""

from __future__ import annotations

import math
import random
import re
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import cli_runner
import tf32lab
from tf32lab.control import flags
from tf32lab.errors import Tf32LabError
from tf32lab.know import targets as known_targets
from tf32lab.speed.prediction import gemm_seconds

EXPERTS = """
import torch, tf32lab

class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(16, 16)
        self.idle = torch.nn.Linear(16, 16)
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        idle = self.idle(x[:0]).sum(0)  # an expert that got no tokens: m == 0
        zero_k = x[:, :0] @ self.w[:0]  # k == 0
        zero_n = (x @ self.w[:, :0]).sum(-1, keepdim=True)  # n == 0
        return self.used(x) + idle + zero_k + zero_n

def make():
    torch.manual_seed(0)
    return tf32lab.Workload(Experts(), torch.randn(8, 16), name="experts")
"""


@pytest.fixture
def experts(tmp_path, monkeypatch):
    (tmp_path / "experts.py").write_text(EXPERTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import experts as module

    return module.make()


# -- empty products -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gemm", [(1, 1, 0, 64, 64), (1, 1, 64, 0, 64), (1, 1, 64, 64, 0), (1, 0, 64, 64, 64),
                                  (0, 1, 64, 64, 64)])
def test_an_empty_product_takes_no_compute_time(gemm):
    assert gemm_seconds(gemm, "tf32-rna", known_targets.get("a100").speed_peaks()) == 0.0


def test_products_with_no_rows_no_k_or_no_columns_are_predicted_checked_and_tuned(experts):
    predicted = tf32lab.predict(experts, "a100")
    assert predicted.level("high").seconds > 0
    report = tf32lab.check(experts, levels=("highest", "high"))
    assert report.passed and report.speed is not None
    assert tf32lab.tune(experts, target="a100").passed


def test_speed_command_predicts_an_expert_that_got_no_tokens(tmp_path):
    (tmp_path / "experts.py").write_text(EXPERTS)
    done = cli_runner.run("speed", "experts.py:make", module="tf32lab.cli", timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "predicted (a100)" in done.stdout


# -- a model with a policy applied ----------------------------------------------------------------------------------
class _Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(self.a(x))


@pytest.mark.parametrize("run", [
    lambda w: tf32lab.check(w, levels=("high",)),
    lambda w: tf32lab.check(w, levels=("high",), policy=tf32lab.Policy(default="high")),
    lambda w: tf32lab.tune(w, target="a100"),
    lambda w: tf32lab.predict(w, "a100"),
    lambda w: tf32lab.bench(w, rounds=1, min_seconds=0.001),
], ids=["check", "check-policy", "tune", "predict", "bench"])
def test_check_tune_predict_and_bench_refuse_a_model_with_a_policy_applied_before_any_run(run):
    model = _Counted()
    handle = tf32lab.Policy(default="high", rules=[("b", "highest")]).apply(model)
    try:
        with pytest.raises(Tf32LabError, match=r"has a policy applied .*remove it first \(handle.remove\(\)\)"):
            run(tf32lab.Workload(model, torch.randn(4, 8)))
        assert model.calls == 0  # refused before the (slow) reference run
        assert handle.hooked == ["", "b"] and "applied" in repr(handle)  # the user's hooks are left as they were
    finally:
        handle.remove()
    assert tf32lab.check(tf32lab.Workload(model, torch.randn(4, 8)), levels=("high",)).passed


def test_a_policy_applied_to_a_parent_is_refused_for_its_child():
    parent = torch.nn.Sequential(_Counted())
    child = tf32lab.Workload(parent[0], torch.randn(4, 8))
    with tf32lab.Policy(default="high").applied(parent), pytest.raises(Tf32LabError, match="has a policy applied"):
        tf32lab.check(child)


# -- a reference that is NaN ------------------------------------------------------------------------------------------
class _NaN(torch.nn.Module):
    def __init__(self, everywhere: bool) -> None:
        super().__init__()
        self.linear, self.everywhere = torch.nn.Linear(4, 4), everywhere

    def forward(self, x):
        y = self.linear(x)
        return {"ok": y, "bad": y * torch.nan if self.everywhere else y.masked_fill(torch.arange(4) == 1, torch.nan)}


def test_a_reference_that_is_nan_in_float64_cannot_pass():
    with pytest.raises(Tf32LabError, match=r"the float64 reference itself is NaN at every element of "
                                           r"output 'bad': cannot judge"):
        tf32lab.check(tf32lab.Workload(_NaN(everywhere=True), torch.randn(3, 4)))


def test_a_reference_nan_in_places_is_compared_elsewhere_and_said():
    report = tf32lab.check(tf32lab.Workload(_NaN(everywhere=False), torch.randn(3, 4)), levels=("highest", "high"))
    bad = next(o for o in report.level("high").outputs if o.name == "bad")
    assert math.isfinite(bad.normwise) and bad.normwise > 0 and "NaN/Inf at 3 of 12" in bad.note


def test_check_of_a_nan_reference_exits_2_with_one_line(tmp_path):
    (tmp_path / "nan_model.py").write_text(textwrap.dedent("""
        import torch

        def make():
            return torch.nn.Linear(4, 4), torch.full((2, 4), float("nan"))
    """))
    done = cli_runner.run("check", "nan_model.py:make", module="tf32lab.cli", timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the float64 reference itself is NaN" in done.stderr and "PASSED" not in done.stdout
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_masked_minus_inf_among_finite_values_is_still_compared():
    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.linear(x)
            return y.masked_fill(torch.arange(4) == 0, -torch.inf)

    assert tf32lab.check(tf32lab.Workload(Masked(), torch.randn(3, 4)), levels=("high",)).passed


# -- products on a helper thread --------------------------------------------------------------------------------------
class _Threaded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        out = {}
        helper = threading.Thread(target=lambda: out.setdefault("b", self.b(x)))
        helper.start()
        helper.join()
        return self.a(x) + out["b"]


def test_products_a_model_runs_on_its_own_thread_are_named_not_silently_dropped():
    w = tf32lab.Workload(_Threaded(), torch.randn(8, 16))
    report = tf32lab.check(w, levels=("high",))
    assert any("ran on another thread (aten::addmm" in n and "not emulated" in n for n in report.notes)
    assert any("ran on another thread" in n for n in tf32lab.predict(w, "a100").notes)
    plain = tf32lab.Workload(torch.nn.Linear(16, 16), torch.randn(8, 16))
    assert not any("thread" in n for n in tf32lab.check(plain, levels=("high",)).notes)


class _AllThreaded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        out = {}
        helper = threading.Thread(target=lambda: out.setdefault("y", self.linear(x)))
        helper.start()
        helper.join()
        return out["y"]


@pytest.mark.parametrize("run", [
    lambda w: tf32lab.check(w, levels=("highest", "high")),
    lambda w: tf32lab.check(w, levels=("high",), target="native"),
    lambda w: tf32lab.tune(w, target="a100"),
    lambda w: tf32lab.predict(w, "a100"),
], ids=["check", "check-native", "tune", "predict"])
def test_a_model_whose_every_product_runs_on_another_thread_is_refused_not_called_safe(run):
    with pytest.raises(Tf32LabError, match=r"nothing was measured: all its matmul-family ops ran on other threads "
                                           r"\(1 op\(s\): aten::addmm x1\).*run them in the thread that calls"):
        run(tf32lab.Workload(_AllThreaded(), torch.randn(8, 16)))


THREADED = """
import threading, torch

class M(torch.nn.Module):
    def __init__(self, every):
        super().__init__()
        self.a, self.b, self.every = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), every

    def forward(self, x):
        out = {}
        helper = threading.Thread(target=lambda: out.setdefault("b", self.b(x)))
        helper.start()
        helper.join()
        return out["b"] if self.every else self.a(x) + out["b"]

def every():
    return M(True), torch.randn(8, 16)

def some():
    return M(False), torch.randn(8, 16)
"""


def test_the_commands_refuse_all_threaded_products_and_say_partly_threaded_ones_beside_the_verdict(tmp_path):
    (tmp_path / "threaded.py").write_text(THREADED)

    def cli(*args):
        return cli_runner.run(*args, module="tf32lab.cli", timeout=300, cwd=tmp_path)

    for command in ("check", "tune", "speed"):
        done = cli(command, "threaded.py:every")
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (command, done.stderr)
        assert "nothing was measured" in done.stderr and "safe" not in done.stdout
    done = cli("check", "threaded.py:some", "--levels", "highest,high")
    assert done.returncode == 0, done.stderr
    # the conclusion wrapped at the console's width; 3 runs: the reference, 2 levels; said right after the verdict
    said = " ".join(done.stdout[done.stdout.index("TF32 is safe"):].split())
    first = said.index("Not all of the model was measured; this verdict covers only part of it: 3 matmul-family "
                       "op(s) ran on another thread")
    assert re.fullmatch(r"TF32 is safe .* against tolerance \S+\)\. ", said[:first]), said
    assert done.stdout.count("ran on another thread") == 1  # said once: beside the verdict, not among the notes
    done = cli("tune", "threaded.py:some")
    assert done.returncode == 0 and "Not all of the model was measured" in done.stdout, done.stdout


# -- a model that sets the level itself -------------------------------------------------------------------------------
class _Setter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        torch.set_float32_matmul_precision("medium")
        return self.linear(x)


@pytest.mark.parametrize("run", [
    lambda w: tf32lab.check(w, levels=("highest", "high")).notes,
    lambda w: tf32lab.check(w, levels=("high",), target="native").notes,
    lambda w: tf32lab.tune(w, target="a100").report.notes,
    lambda w: tf32lab.predict(w, "a100").notes,
], ids=["check", "check-native", "tune", "predict"])
def test_a_level_the_model_sets_in_its_forward_does_not_outlive_the_call(run):
    before = flags.snapshot()
    notes = run(tf32lab.Workload(_Setter(), torch.randn(4, 8)))
    assert flags.snapshot() == before
    assert any("changed PyTorch's flags while it ran (float32_matmul_precision 'highest' -> 'medium'" in n
               for n in notes), notes


class _Flagger(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear, self.how = torch.nn.Linear(8, 8), how

    def forward(self, x):
        if self.how == "cudnn":
            torch.backends.cudnn.allow_tf32 = False
        elif self.how == "tf32lab":
            tf32lab.set_float32_matmul_precision("medium")
        else:
            torch.backends.fp32_precision = "tf32"
        return self.linear(x)


@pytest.mark.parametrize("how, changed", [("cudnn", "cudnn.allow_tf32 True -> False"),
                                          ("tf32lab", "float32_matmul_precision 'highest' -> 'medium'"),
                                          pytest.param("fp32", "fp32_precision.generic.all 'none' -> 'tf32'",
                                                       marks=pytest.mark.skipif(not flags.NEW_API,
                                                                                reason="per-backend API only"))])
def test_bench_puts_back_the_flags_a_model_sets_in_its_forward_and_says_so(how, changed):
    before = flags.snapshot()
    notes = tf32lab.bench(tf32lab.Workload(_Flagger(how), torch.randn(4, 8)), levels=("highest", "high"), rounds=1,
                          min_seconds=0.001).notes
    assert flags.snapshot() == before, before.diff(flags.snapshot())
    assert any(f"changed PyTorch's flags while it ran ({changed}" in n for n in notes), notes


# -- a Hugging Face Hub id where a folder is expected ----------------------------------------------------------------
def test_a_hub_id_is_told_how_to_get_a_local_folder(tmp_path):
    done = cli_runner.run("check", "hf:someorg/some-model", module="tf32lab.cli", timeout=300, cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "huggingface-cli download someorg/some-model --local-dir DIR" in done.stderr
    assert "snapshot_download('someorg/some-model', local_dir=DIR)" in done.stderr and "hf:DIR" in done.stderr


@pytest.mark.parametrize("folder", ["/nonexistent", "./models/x", "~/m", "a/b/c", "C:\\models\\x"])
def test_a_path_that_is_not_there_is_not_taken_for_a_hub_id(folder):
    from tf32lab.workloads import hf

    with pytest.raises(tf32lab.Tf32LabError) as caught:
        hf.workload(folder)
    said = "no config.json in" if Path(folder).expanduser().exists() else "no folder"  # a machine may have one
    assert said in str(caught.value) and "huggingface" not in str(caught.value)


# -- a model that samples ------------------------------------------------------------------------------------------
# a generator the model draws from but does not hold (one it holds is its state, put back before every row:
# tests/test_state_places.py)
_STREAM = torch.Generator().manual_seed(1)


class _Sampling(torch.nn.Module):
    """Draws from a stream no run of check seeds (PyTorch's own generators are: tests/test_random_draws.py)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear, self.how = torch.nn.Linear(16, 16), how

    def forward(self, x):
        y = self.linear(x)
        if self.how == "python":  # Python's global stream, which every row now seeds alike (test_random_draws.py)
            return y + torch.tensor([random.gauss(0.0, 1.0) for _ in range(y.numel())], dtype=y.dtype).view(y.shape)
        return y + torch.randn(y.shape, generator=_STREAM)  # a generator outside the model


def test_unseeded_sampling_is_named_as_the_cause_not_float64():
    w = tf32lab.Workload(_Sampling("generator"), torch.randn(8, 16))
    report = tf32lab.check(w, levels=("highest", "high"))
    said = " ".join(report.conclusion())
    assert not report.passed and report.level("highest").unstable is not None
    assert "two runs at `highest` differ" in said and "not deterministic" in said and "float64" not in said
    tuning = tf32lab.tune(w, target="a100")
    assert not tuning.passed and "not deterministic" in tuning.reason and "float64" not in tuning.reason


def test_sampling_from_pythons_global_stream_draws_alike_in_every_row():
    report = tf32lab.check(tf32lab.Workload(_Sampling("python"), torch.randn(8, 16)), levels=("highest",))
    assert report.passed and report.level("highest").outputs[0].normwise < 1e-6


def test_a_sampling_model_gets_one_recommendation_seed_it_and_no_tune_advice(tmp_path):
    w = tf32lab.Workload(_Sampling("generator"), torch.randn(8, 16))
    said = tf32lab.check(w, levels=("highest", "high")).conclusion()
    assert said[0].startswith("Even `highest` fails, but two runs at `highest` differ") and "seed it" in said[0]
    assert not any(line.startswith(("Keep `highest`", "TF32 is safe")) for line in said), said
    (tmp_path / "sampling.py").write_text(textwrap.dedent("""
        import torch

        STREAM = torch.Generator().manual_seed(1)

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(16, 16)

            def forward(self, x):
                y = self.linear(x)
                return y + torch.randn(y.shape, generator=STREAM)

        def make():
            return M(), torch.randn(8, 16)
    """))
    done = cli_runner.run("check", "sampling.py:make", module="tf32lab.cli", timeout=300, cwd=tmp_path)
    assert done.returncode == 1 and "not deterministic" in done.stdout
    assert "tune" not in done.stdout and "Keep `highest`" not in done.stdout, done.stdout


class _Overflows(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(x) * 1e30 * 1e10  # Inf in float32, finite (about 1e40) in float64


def test_float32_overflow_is_named_as_its_range_not_its_rounding():
    report = tf32lab.check(tf32lab.Workload(_Overflows(), torch.randn(8, 16)), levels=("highest", "high"))
    failure = report.level("highest").outputs[0].failure
    assert "beyond float32's range (largest finite 3.4e+38)" in failure
    said = report.conclusion()
    assert said[0].startswith("Even `highest` fails, and no precision level fixes it: the values exceed float32's "
                              "range (finite only up to ~3.4e38)"), said
    joined = " ".join(said)
    assert "loosen the tolerance" not in joined and "amplifies" not in joined and "Keep `highest`" not in joined


class _Underflows(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear, self.scale = torch.nn.Linear(16, 16), scale

    def forward(self, x):
        return self.linear(x) * self.scale


def test_values_below_float32s_normal_range_are_named_not_blamed_on_a_layer():
    # an untrained model's logits at 1e-41 (a random-weight MobileViT): float32 keeps a few bits there, at every
    # level; the conclusion said a layer's error was amplified and sent the user to `tf32lab tune`
    report = tf32lab.check(tf32lab.Workload(_Underflows(1e-44), torch.randn(8, 16)), levels=("highest", "high"))
    output = report.level("highest").outputs[0]
    assert not output.passed and "below float32's normal range" in output.note and "(1.2e-38)" in output.note
    said = report.conclusion()
    assert said[0].startswith("Even `highest` fails, and no precision level fixes it: output 'output' lies below "
                              "float32's normal range"), said
    joined = " ".join(said)
    assert "tune" not in joined and "amplified" not in joined and "Keep `highest`" not in joined, said
    # small values that float32 still holds well enough pass, and nothing is said of them
    passing = tf32lab.check(tf32lab.Workload(_Underflows(1e-39), torch.randn(8, 16)), levels=("highest",))
    assert passing.passed and passing.level("highest").outputs[0].note is None


class _Cached:
    """What a language model returns beside its logits: a cache object of its own (transformers' DynamicCache)."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


class _ReturnsCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.linear(x)
        return {"logits": y, "cache": _Cached(y)}


def test_an_object_with_no_equality_of_its_own_is_said_not_compared_not_failed():
    # each run makes another cache object, equal only to itself: "compared exactly", every level, highest
    # included, failed, and the conclusion blamed float32 for amplifying its own rounding
    report = tf32lab.check(tf32lab.Workload(_ReturnsCache(), torch.randn(8, 16)), levels=("highest", "high"))
    assert report.passed, report.verdicts()
    cache = next(o for o in report.level("highest").outputs if o.name == "cache")
    assert "not compared" in cache.verdict() and "compared exactly" not in cache.verdict()
    with pytest.raises(tf32lab.Tf32LabError):  # nothing else to compare: refused, not passed
        tf32lab.check(tf32lab.Workload(_OnlyCache(), torch.randn(8, 16)), levels=("highest",))


class _OnlyCache(_ReturnsCache):
    def forward(self, x):
        return _Cached(self.linear(x))


def test_check_does_not_point_to_tune_when_highest_fails_too(tmp_path):
    (tmp_path / "overflow.py").write_text(textwrap.dedent("""
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(16, 16)

            def forward(self, x):
                return self.linear(x) * 1e30 * 1e10

        def make():
            return M(), torch.randn(8, 16)
    """))
    done = cli_runner.run("check", "overflow.py:make", module="tf32lab.cli", timeout=300, cwd=tmp_path)
    assert done.returncode == 1 and "float32's range" in done.stdout, done.stdout + done.stderr
    assert "tf32lab tune" not in done.stdout


def test_a_deterministic_failure_at_highest_still_points_to_float64():
    report = tf32lab.check(tf32lab.Workload(torch.nn.Linear(16, 16), torch.randn(8, 16)), levels=("highest",),
                           tolerance=0.0)
    assert report.level("highest").unstable is None and "float64" in " ".join(report.conclusion())


# -- convolutions over nothing ----------------------------------------------------------------------------------------
class _EmptyConv(torch.nn.Module):
    """A Linear that does the work, beside a convolution of one kind fed an empty batch (or no channels)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.linear, self.kind = torch.nn.Linear(16, 16), kind
        self.conv = {"conv1d": torch.nn.Conv1d(3, 4, 3), "conv2d": torch.nn.Conv2d(3, 4, 3),
                     "conv3d": torch.nn.Conv3d(3, 4, 3), "grouped": torch.nn.Conv2d(4, 4, 3, groups=2),
                     "transposed": torch.nn.ConvTranspose2d(3, 4, 3), "no-channels": torch.nn.Conv2d(0, 4, 3),
                     "transposed1d": torch.nn.ConvTranspose1d(3, 4, 3)}[kind]

    def forward(self, x):
        channels = self.conv.in_channels
        spatial = {torch.nn.Conv1d: (8,), torch.nn.ConvTranspose1d: (8,), torch.nn.Conv3d: (5, 5, 5)}.get(
            type(self.conv), (8, 8))
        batch = 2 if channels == 0 else 0
        return self.linear(x) + self.conv(x.new_zeros(batch, channels, *spatial)).sum()


CONVS = ["conv1d", "conv2d", "conv3d", "grouped", "transposed", "transposed1d", "no-channels"]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("kind", CONVS)
def test_a_convolution_over_nothing_is_counted_as_no_work(kind):
    w = tf32lab.Workload(_EmptyConv(kind), torch.randn(8, 16), name=kind)
    with tf32lab.speed.counting.Counting(w.model) as counts, torch.inference_mode():
        w.run()
    conv = [c for c in counts.ops if c.family == "conv"]
    assert conv and all(c.flops == 0 for c in conv)
    predicted = tf32lab.predict(w, "a100")
    assert predicted.level("high").speedup >= 1.0
    report = tf32lab.check(w, levels=("highest", "high"))
    assert report.passed and all(lv.error is None for lv in report.levels)
    assert tf32lab.tune(w, target="a100").passed


def test_speed_check_and_tune_commands_take_empty_convolutions(tmp_path):
    (tmp_path / "empty_conv.py").write_text(textwrap.dedent("""
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin, self.conv = torch.nn.Linear(16, 16), torch.nn.Conv2d(3, 4, 3)
                self.c1, self.ct = torch.nn.Conv1d(3, 4, 3), torch.nn.ConvTranspose2d(3, 4, 3)

            def forward(self, x):
                e = x.new_zeros(0, 3, 8, 8)
                return self.lin(x) + self.conv(e).sum() + self.c1(x.new_zeros(0, 3, 8)).sum() + self.ct(e).sum()

        def make():
            return M(), torch.randn(8, 16)
    """))
    for command in (["speed"], ["check", "--target", "a100"], ["tune", "--target", "a100"]):
        done = cli_runner.run(command[0], "empty_conv.py:make", *command[1:], module="tf32lab.cli", timeout=300,
                              cwd=tmp_path)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        assert "raise" not in done.stdout + done.stderr, done.stdout


# -- an exception of tf32lab's own ------------------------------------------------------------------------------------
BROKEN_COUNTING = """
import builtins, torch
import tf32lab.speed.counting

def make():
    tf32lab.speed.counting._gemms = builtins.len  # a fault inside tf32lab's counting: a TypeError in its own frame
    return torch.nn.Linear(16, 16), torch.randn(4, 16)
"""


@pytest.fixture
def broken_counting(monkeypatch):
    import builtins

    from tf32lab.speed import counting

    # a fault inside tf32lab's own code (not a stand-in for anything of the model's): a TypeError raised in
    # Counting.record's frame, as a bug there would
    monkeypatch.setattr(counting, "_gemms", builtins.len)
    return tf32lab.Workload(torch.nn.Linear(16, 16), torch.randn(4, 16), name="linear")


@pytest.mark.parametrize("run", [
    lambda w: tf32lab.predict(w, "a100"),
    lambda w: tf32lab.check(w, levels=("highest", "high")),
    lambda w: tf32lab.tune(w, target="a100"),
], ids=["predict", "check", "tune"])
def test_an_error_in_tf32labs_own_code_is_reported_as_tf32labs_not_the_models(broken_counting, run):
    with pytest.raises(Tf32LabError, match=r"internal error in tf32lab while .*TypeError.* "
                                           r"\(at tf32lab/speed/counting\.py:\d+\); this is a bug in tf32lab, not in "
                                           r"the model: please report it"):
        run(broken_counting)


def test_the_commands_say_an_error_of_tf32labs_is_tf32labs_with_exit_2(tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN_COUNTING)
    for command in ("speed", "check", "tune"):
        done = cli_runner.run(command, "broken.py:make", module="tf32lab.cli", timeout=300, cwd=tmp_path)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
        assert "internal error in tf32lab" in done.stderr and "please report" in done.stderr
        assert "FAILED" not in done.stdout and "workload 'broken:make' raised" not in done.stderr


class _Divides(torch.nn.Module):
    """Divides by zero in float32 only: the float64 reference runs, each level raises."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return y * (1 / int(y.dtype == torch.float64))


def test_an_error_the_model_raises_itself_is_still_the_models():
    with pytest.raises(Tf32LabError, match=r"workload 'div' raised ZeroDivisionError while its work was counted"):
        tf32lab.predict(tf32lab.Workload(_Divides(), torch.randn(2, 4), name="div"), "a100")
    report = tf32lab.check(tf32lab.Workload(_Divides(), torch.randn(2, 4), name="div"), levels=("highest",))
    assert not report.passed and report.level("highest").error.startswith("ZeroDivisionError")


class _IndexesPast(torch.nn.Module):
    """Looks up a row past its table, as a model with a bad token id does: PyTorch's IndexError, the model's own."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(10, 4, sparse=sparse)
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.linear(self.table(ids)) if self.table.sparse else self.linear(self.table.weight)[ids]


@pytest.mark.parametrize("sparse", [True, False], ids=["embedding", "indexing"])
def test_an_index_error_of_the_models_in_the_float64_reference_is_the_models(sparse):
    # the float64 reference hands each op on; an IndexError raised there was said to be "a bug in tf32lab"
    ids = torch.tensor([3, 12])
    with pytest.raises(IndexError):
        _IndexesPast(sparse)(ids)  # the model alone raises it
    workload = tf32lab.TrainingWorkload(_IndexesPast(sparse), [ids], inputs=lambda b: b, loss=lambda out, b: out.sum(),
                                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(Tf32LabError, match=r"fails in float64, before any level ran: step 1: IndexError") as raised:
        tf32lab.check_training(workload, levels=("highest",), target="a100")
    assert "bug in tf32lab" not in str(raised.value)
    with pytest.raises(Tf32LabError, match=r"workload 'ids' raised at the float64 reference, before any level ran: "
                                           r"IndexError"):
        tf32lab.check(tf32lab.Workload(_IndexesPast(sparse), ids, name="ids"), levels=("highest",))


class _IndexesByItsSum(torch.nn.Module):
    """Indexes a one-row table by its product's sum, scaled: float64's index is 0, float32's and TF32's far off."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.table = torch.nn.Parameter(torch.ones(1, 3))
        with torch.no_grad():
            self.at = int(torch.floor(self.linear.double()(x.double()).sum() * 1e6))
        self.linear.float()

    def forward(self, x):
        total = self.linear(x).sum() * 1e6
        return self.table[total.floor().long() - self.at].sum() + 0 * total


def test_an_index_error_a_level_causes_in_training_fails_its_row():
    # the speed columns' counting pass handed ops on as func(*args, **(kwargs or {})), which origin did not know:
    # the model's IndexError was taken for tf32lab's, and check_training re-raised it bare (a traceback, no report)
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    workload = tf32lab.TrainingWorkload(_IndexesByItsSum(x), [x], inputs=lambda b: b, loss=lambda out, b: out,
                                        optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    report = tf32lab.check_training(workload, target="a100", levels=("highest", "high"), steps=1)
    assert not report.passed and report.level("high").failure.startswith("IndexError: index ")
    assert all(row.failure is None or row.failure.startswith("IndexError") for row in report.levels)


def test_where_an_exception_was_raised_is_read_from_its_frames():
    from tf32lab.numbers.origin import raised_by_tf32lab

    with pytest.raises(ValueError) as raised:
        tf32lab.speed.counting._shape_prod(["x"])  # int("x") inside tf32lab: tf32lab's
    assert raised_by_tf32lab(raised.value).startswith("tf32lab/speed/counting.py:")
    with pytest.raises(ValueError) as raised:
        int("x")  # this test's own frame: not tf32lab's
    assert raised_by_tf32lab(raised.value) is None
    from tf32lab.workloads.builtin import Covariance

    with pytest.raises(AttributeError) as raised:
        Covariance()("not a tensor")  # a built-in workload's model is a model, not tf32lab
    assert raised_by_tf32lab(raised.value) is None


class _WritesIntoInner(torch.nn.Module):
    """A layer (its own product) that writes in place into a nested layer's output, as ``nn.ReLU(inplace=True)``
    after a Linear does: rerun alone, the nested layer answers with its recorded output, which the write changes."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(16, 16)
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        h = self.inner(x)
        torch.relu_(h)
        h.mul_(2)
        return h @ self.w


def test_a_layer_writing_into_a_nested_layers_output_is_measured_the_same_at_every_level():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_WritesIntoInner(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 16)
    alone = tf32lab.check(tf32lab.Workload(model, x, name="m"), introduced="all", levels=("high",))
    after = tf32lab.check(tf32lab.Workload(model, x, name="m"), introduced="all", levels=("highest", "high"))
    want = {layer.name: layer.introduced for layer in alone.level("high").layers}
    got = {layer.name: layer.introduced for layer in after.level("high").layers}
    # the same rerun either way: fed the nested layer's recorded output, not what an earlier level's rerun left
    assert got == pytest.approx(want, rel=1e-6)
    assert 0 < got["0"] < 1e-2


def test_a_model_given_in_training_mode_is_checked_in_eval_mode_and_the_report_says_so():
    # a model built and handed over without .eval() (TabNet's ghost batch norm, a dropout): check measures
    # inference, as before, and now says that its training-mode modules ran in eval mode
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    x = torch.randn(16, 8)
    trained = tf32lab.check(tf32lab.Workload(model, x, name="train-mode"), levels=("high",), speed=False)
    said = [note for note in trained.notes if "training mode" in note]
    assert len(said) == 1 and "'1' Dropout" in said[0] and "'2' BatchNorm1d" in said[0] and "--train" in said[0]
    assert model.training and all(m.training for m in model.modules())  # its modes as they were
    inferred = tf32lab.check(tf32lab.Workload(model.eval(), x, name="eval-mode"), levels=("high",), speed=False)
    assert not any("training mode" in note for note in inferred.notes)
    assert inferred.levels[0].outputs[0].normwise == trained.levels[0].outputs[0].normwise
    quiet = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.0))  # nothing that computes otherwise
    assert not any("training mode" in n for n in tf32lab.check(tf32lab.Workload(quiet, x), levels=("high",),
                                                                speed=False).notes)


def test_the_training_mode_note_names_a_randomized_relu_and_the_model_itself_unquoted():
    # nn.RReLU draws its slope in training mode and takes the bounds' mean in eval mode: it computes otherwise
    from tf32lab.workloads.workload import training_note

    said = training_note(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RReLU()))
    assert said is not None and "'1' RReLU" in said, said
    assert training_note(torch.nn.Sequential(torch.nn.RReLU(0.2, 0.2))) is None  # one slope: alike in both modes
    assert "(the model Dropout)" in training_note(torch.nn.Dropout(0.5))


class _OwnDropout(torch.nn.Module):
    """Dropout written as a function call of the module's own: no nn.Dropout anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.dropout(self.lin(x), 0.3, self.training)


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).relu()


def test_the_training_mode_note_names_a_users_module_that_reads_its_training_flag():
    from tf32lab.workloads.workload import training_note

    said = training_note(_OwnDropout())
    assert said is not None and "(the model _OwnDropout)" in said, said
    assert training_note(_OwnDropout().eval()) is None and training_note(_Plain()) is None
    scripted = torch.jit.script(_OwnDropout())  # TorchScript: read from its code
    assert "(the model _OwnDropout)" in training_note(scripted)
    assert training_note(torch.jit.script(_Plain())) is None
    # PyTorch's own modules say it where they can: a module of the user's beside them is not guessed at
    both = torch.nn.Sequential(_OwnDropout(), torch.nn.Dropout(0.1))
    assert "('1' Dropout)" in training_note(both)
    report = tf32lab.check(tf32lab.Workload(_OwnDropout(), torch.randn(4, 8)), levels=("high",), speed=False)
    assert any("_OwnDropout" in note and "--train" in note for note in report.notes), report.notes


def test_the_training_mode_note_reads_a_decorated_forward_and_a_dropout_rate_of_zero():
    # Hugging Face wraps forward (deprecation, gradient checkpointing, output capturing): the wrapper reads
    # self.training for checkpointing, the forward it wraps for its dropout; a rate of 0 drops nothing
    import functools

    from tf32lab.workloads.workload import training_note

    def checkpointing(forward):
        @functools.wraps(forward)
        def wrapper(self, *args, **kwargs):
            if getattr(self, "gradient_checkpointing", False) and self.training:
                raise AssertionError("not reached")
            return forward(self, *args, **kwargs)
        return wrapper

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        @checkpointing
        def forward(self, x):
            return self.lin(x).relu()

    class Attention(torch.nn.Module):
        def __init__(self, attention_dropout: float) -> None:
            super().__init__()
            self.attention_dropout = attention_dropout
            self.lin = torch.nn.Linear(8, 8)

        @checkpointing
        def forward(self, x):
            p = 0.0 if not self.training else self.attention_dropout
            return torch.nn.functional.dropout(self.lin(x), p, self.training)

    assert training_note(Layer()) is None
    assert training_note(Attention(0.0)) is None
    said = training_note(Attention(0.1))
    assert said is not None and "(the model Attention)" in said, said
    # its rate in a child nn.Dropout read in forward (BERT's self-attention passes self.dropout.p to SDPA)

    class Sdpa(torch.nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.dropout = torch.nn.Dropout(p)

        def forward(self, x):
            return torch.nn.functional.scaled_dot_product_attention(
                x, x, x, dropout_p=0.0 if not self.training else self.dropout.p)

    assert training_note(Sdpa(0.0)) is None and "Dropout" in training_note(Sdpa(0.1))


def test_the_training_mode_note_reads_a_scripted_pytorch_module_as_its_class():
    # a scripted nn.Dropout or nn.BatchNorm1d reads self.training in its code, as any does: PyTorch's own rule decides
    from tf32lab.workloads.workload import training_note

    def scripted(*modules):
        return torch.jit.script(torch.nn.Sequential(torch.nn.Linear(2, 2), *modules))

    assert training_note(scripted(torch.nn.Dropout(0.0))) is None
    assert training_note(scripted(torch.nn.BatchNorm1d(2, track_running_stats=False))) is None
    assert "('1' Dropout)" in training_note(scripted(torch.nn.Dropout(0.1)))
    assert "('1' BatchNorm1d)" in training_note(scripted(torch.nn.BatchNorm1d(2)))
    said = training_note(scripted(torch.nn.Dropout(0.0), _OwnDropout()))  # a class of the user's: its code read
    assert said is not None and "('2' _OwnDropout)" in said, said


def test_a_compiled_model_is_checked_eagerly_and_its_own_calls_still_compile(counted_graphs):
    # the float64 reference and native rows run under dispatch modes of their own, outside emulate()'s eager
    # stance: Dynamo traced the compiled model into them, check() failed at the float64 reference
    # (InternalTorchDynamoError) and check_training() left Dynamo skipping the model's code for good (its own
    # compiled calls ran eagerly afterwards)
    counting, graphs = counted_graphs
    torch.manual_seed(0)
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
                             backend=counting)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(2)]
    assert tf32lab.check(tf32lab.Workload(compiled, data[0][0], name="compiled"), levels=("high",))
    workload = tf32lab.TrainingWorkload(compiled, data, inputs=lambda b: b[0],
                                        loss=lambda out, b: (out - b[1]).pow(2).mean())
    assert tf32lab.check_training(workload, levels=("highest", "high"), speed=False)
    assert graphs == {"compiled": 0, "ran": 0}  # the checks ran the model eagerly
    compiled(data[0][0])
    assert graphs == {"compiled": 1, "ran": 1}


# -- a model no level changes ------------------------------------------------------------------------------------------
def test_a_model_with_no_matmul_family_op_is_told_no_level_changes_it_not_to_enable_tf32():
    # "TF32 is safe ... Enable it with torch.set_float32_matmul_precision('high')": advice about nothing
    elementwise = tf32lab.Workload(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()), torch.randn(4, 8))
    report = tf32lab.check(elementwise, levels=("highest", "high"), speed=False)
    assert report.passed and any(n.startswith("the model ran no matmul-family op") for n in report.notes)
    said = " ".join(report.conclusion())
    assert "changes nothing there" in said and "Enable it" not in said, said
    product = tf32lab.check(tf32lab.Workload(torch.nn.Linear(8, 8), torch.randn(4, 8)), levels=("high",), speed=False)
    assert not any("no matmul-family op" in n for n in product.notes)
    assert "Enable it" in " ".join(product.conclusion())


def test_tune_says_products_on_another_thread_once_beside_its_answer_not_among_the_notes_too():
    # the note qualifies the answer, which says it; the notes the summary prints leave it out, as check's do
    lines = tf32lab.tune(tf32lab.Workload(_Threaded(), torch.randn(8, 16)), target="a100",
                         levels=("high",)).lines(width=200)
    assert sum("ran on another thread" in line for line in lines) == 1, lines
    assert lines[-1].startswith("Not all of the model was measured"), lines


def _dropping_forward(self, x):
    return torch.nn.functional.dropout(self.lin(x), 0.3, self.training)


def _attention_forward(self, x):
    return self.dropout(self.lin(x))


def test_the_training_mode_note_reads_a_scripted_users_class_named_as_one_of_pytorchs_by_its_code():
    # TorchScript keeps the class's name, not where it came from: a class of the user's called Linear (which reads
    # self.training) or MultiheadAttention (whose dropout is a module, not a rate) is not PyTorch's own
    from tf32lab.workloads.workload import training_note

    def init(self):
        torch.nn.Module.__init__(self)
        self.lin, self.dropout = torch.nn.Linear(8, 8), torch.nn.Dropout(0.0)

    linear = type("Linear", (torch.nn.Module,), {"__init__": init, "forward": _dropping_forward})
    said = training_note(torch.jit.script(linear()))
    assert said is not None and "(the model Linear)" in said, said
    attention = type("MultiheadAttention", (torch.nn.Module,), {"__init__": init, "forward": _attention_forward})
    assert training_note(torch.jit.script(attention())) is None  # its nn.Dropout(0.0) drops nothing
    # PyTorch's own, scripted, still read by their class
    assert "('0' Dropout)" in training_note(torch.jit.script(torch.nn.Sequential(torch.nn.Dropout(0.1))))
    assert training_note(torch.jit.script(torch.nn.MultiheadAttention(8, 2))) is None
